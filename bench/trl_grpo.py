"""The peer side of bench/peer.py: TRL's GRPOTrainer on one workload, run in TRL's own venv.

Reads a JSON spec (model, prompt rows, reward name, group size, generation settings, batch,
steps, optimizer settings), trains with GRPOTrainer on this CPU (transformers `generate`, no
vLLM), and writes per-step wall time, generation and reward time, and mean reward as JSON.
The reward and the tokenizer loader are areal-kit's own (areal_kit on PYTHONPATH), so both sides
read and score answers alike.

    PYTHONPATH=. /work/bench-venvs/trl/bin/python bench/trl_grpo.py SPEC.json OUT.json
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path


def reward_fn(name: str, stops: set[int]):
    """areal-kit's reward `name` in TRL's signature (lists in, list of floats out); an answer whose
    last token is not in `stops` (eos, pad) was truncated, as areal-kit's no_eos says."""
    from areal_kit.reward.plugins import load_reward, reward_spec

    fn = load_reward(reward_spec(name, {}))  # a built-in's name, as ppo.reward_fns names it

    def reward(prompts, completions, answer, question, completion_ids, **_):
        return [fn(q, c, {"answer": a, "no_eos": not ids or ids[-1] not in stops})
                for q, c, a, ids in zip(question, completions, answer, completion_ids)]

    reward.__name__ = f"areal_{name}"
    return reward


def load(spec: dict):
    """The spec's tokenizer (left padding, as GRPOTrainer generates) and fp32 model, torch seeded."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal_kit.data.tokenizer import load_tokenizer

    torch.manual_seed(spec["seed"])
    tok = load_tokenizer(spec["model"])
    tok.padding_side = "left"
    return tok, AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)


def grpo_args(spec: dict, **more):
    """GRPOConfig for the spec: one optimizer step per batch of n_prompts x group completions,
    generated at once; `more` adds or replaces settings."""
    from trl import GRPOConfig

    n_prompts, group = spec["n_prompts"], spec["group_size"]
    mb = spec["micro_batch"]  # completions per forward/backward
    settings = {
        "output_dir": spec["workdir"], "use_cpu": True, "bf16": False, "report_to": [], "save_strategy": "no",
        "logging_steps": 1, "max_steps": spec["steps"], "seed": spec["seed"], "dataloader_num_workers": 0,
        "per_device_train_batch_size": mb, "gradient_accumulation_steps": n_prompts * group // mb,
        "num_generations": group, "max_completion_length": spec["max_new_tokens"],
        "temperature": spec["temperature"], "top_p": 1.0, "top_k": 0, "beta": spec.get("beta", 0.0), "num_iterations": 1,
        "loss_type": spec.get("loss_type", "dapo"), "scale_rewards": "group",
        "learning_rate": spec["lr"], "lr_scheduler_type": "constant", "warmup_steps": 0,
        "weight_decay": spec["weight_decay"], "adam_beta1": spec["adam_betas"][0], "adam_beta2": spec["adam_betas"][1],
        "max_grad_norm": spec["gradient_clipping"], "shuffle_dataset": False, "disable_tqdm": True,
    }
    return GRPOConfig(**{**settings, **more})


def train(spec: dict, tok, model, ds, reward_funcs: list, out_path: str, args=None,
          logged: dict[str, str] | None = None, **trainer_kw) -> None:
    """Trains with GRPOTrainer and writes per-step wall, generation, reward and train time and mean
    reward to `out_path`; `logged` maps more step fields to the names TRL logs them under."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    timers = {"gen": 0.0, "reward": 0.0}

    @contextmanager
    def timed(key: str):
        t0 = time.time()
        try:
            yield
        finally:
            timers[key] += time.time() - t0

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *a, **k):
            with timed("gen"):
                return super()._generate_single_turn(*a, **k)

        def _calculate_rewards(self, *a, **k):
            with timed("reward"):
                return super()._calculate_rewards(*a, **k)

    steps: list[dict] = []
    fields = {"task_reward": "reward", "completion_len": "completions/mean_length", **(logged or {})}

    class StepLog(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.time()
            timers.update(gen=0.0, reward=0.0)

        def on_step_end(self, args, state, control, **kw):
            e2e = time.time() - self.t0
            # time: when the step ended (epoch seconds), as areal-kit's metrics.jsonl has it.
            steps.append({"step": state.global_step, "time": time.time(), "e2e_time": e2e, "gen_time": timers["gen"],
                          "reward_time": timers["reward"],
                          "train_time": e2e - timers["gen"] - timers["reward"]})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs and steps:
                steps[-1].update({k: logs.get(name) for k, name in fields.items()})

    trainer = Timed(model=model, reward_funcs=reward_funcs, args=args or grpo_args(spec), train_dataset=ds,
                    processing_class=tok, callbacks=[StepLog()], **trainer_kw)
    t0 = time.time()
    trainer.train()
    Path(out_path).write_text(json.dumps({"steps": steps, "wall": time.time() - t0}))


def main(spec_path: str, out_path: str) -> None:
    from datasets import Dataset

    spec = json.loads(Path(spec_path).read_text())
    tok, model = load(spec)
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"], "question": r["question"]}
                            for r in spec["rows"]])
    train(spec, tok, model, ds, [reward_fn(spec["reward"], {tok.eos_token_id, tok.pad_token_id})], out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
