"""A run before any worker starts: its inputs validated (Job) and the state that continues it (RunState).

    from areal_kit.config.loader import load_config
    from areal_kit.rl.driver.job import prepare
    job = prepare(load_config("tiny"))      # model built or found, prompts tokenized, steps counted
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from areal_kit import runlog
from areal_kit.config.schema import TrainConfig
from areal_kit.data.model_source import model_spec
from areal_kit.data.prompts import PromptLoader, run_prompts
from areal_kit.data.tiny_model import build
from areal_kit.reward.plugins import reward_specs
from areal_kit.rl import lora
from areal_kit.rl.workflow import load as load_workflow
from areal_kit.rl.workflow import load_agent


@dataclass
class RunState:
    """Everything the loop needs to continue; recover checkpoints persist it."""

    global_step: int = 0  # steps finished
    version: int = 0  # weight updates applied (= global_step after each sync)
    batches: int = 0  # prompt batches the finished steps took (> global_step under ppo.dynamic_sampling)
    # Streaming: batches counts those taken from the loader, and pending names the prompts of them
    # not trained yet ([batch, row] pairs), which a resumed run generates again first.
    pending: list = field(default_factory=list)
    loader: dict = field(default_factory=dict)
    timer: dict = field(default_factory=dict)
    last_save_time: float = 0.0
    last_ckpt_time: float = 0.0
    recover_path: str = ""  # the recover checkpoint this state was read from (Checkpointer.load)
    wandb_id: str = ""  # the wandb run the metrics go to: a resumed run continues it

    @property
    def resumed(self) -> bool:
        """Read from a recover checkpoint, whose trainer state the workers load (Checkpointer.restore)."""
        return bool(self.recover_path)


@dataclass
class Job:
    """What a run needs before any actor starts (all input validated here)."""

    cfg: TrainConfig
    paths: runlog.RunPaths
    model_path: str
    loader: PromptLoader
    total_steps: int
    n_dropped: int
    recover_attempts: int = 0  # launch attempts so far (Checkpointer.count_attempt: fault mode, relaunch messages)
    eval_rows: list = field(default_factory=list)  # the in-training eval split, tokenized (validation.py)
    tokenizer: Any = None  # the model's (a transformers tokenizer), to show samples as text

    @property
    def n_epochs(self) -> int:
        return self.cfg.exp_ctrl.total_train_epochs


def resolve_model(cfg: TrainConfig) -> str:
    """The model folder the run trains: actor.path, or the tiny model it names, built if not yet."""
    spec = model_spec(cfg.actor.path, cfg.seed)
    if spec is None:
        return cfg.actor.path
    return build(os.path.join(cfg.fileroot, "models", spec.dirname()), spec)


def prepare(cfg: TrainConfig) -> Job:
    paths = runlog.run_paths(cfg.fileroot, cfg.experiment_name, cfg.trial_name)
    # Plug-ins import first, so a bad path is a one-line error before a tiny model is built (seconds)
    # and before any worker starts.
    reward_specs(cfg.ppo)
    load_workflow(cfg.ppo.workflow)
    if cfg.agent.fn:
        load_agent(cfg.agent.fn)
    model_path = resolve_model(cfg)
    lora.check_targets(model_path, cfg.actor.lora)  # actor.lora: its target modules against the model, in one line
    prompts = run_prompts(cfg, model_path)
    total = cfg.exp_ctrl.total_train_epochs * prompts.loader.steps_per_epoch
    if cfg.exp_ctrl.total_train_steps:
        total = min(total, cfg.exp_ctrl.total_train_steps)
    return Job(cfg, paths, model_path, prompts.loader, total, prompts.n_dropped, eval_rows=prompts.eval_rows,
               tokenizer=prompts.tokenizer)
