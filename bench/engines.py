"""Our engines as the benchmarks drive them: a config for the bench model, an in-process rollout
worker, a running controller, and `areal-kit train` runs read back from metrics.jsonl.

Everything here goes through areal_kit's own classes (RolloutWorker, Controller, the CLI), so a
benchmark measures the code a user runs, with the settings of areal_kit.hardware.

    cfg = bench_config(workload.rl_model(), fileroot)          # the RL-shaped workload's config
    w = rollout_worker(cfg)                                   # vLLM in this process (EngineCore child)
    rows = train_run(["tiny", "exp_ctrl.total_train_steps=12"], workdir)   # metrics rows
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rl_overrides(model_path: str) -> list[str]:
    """`areal-kit train tiny` overrides for the RL-shaped workload on the bench model.

    The tiny preset's prompts and group (and its 4096-token micro-batches), with the 10M model,
    answers up to 256 tokens, and the math reward (the last number of the answer against
    (a+b) mod 10: a random model gets it now and then, so groups carry signal and the reward
    curve can move).
    """
    return [f"actor.path={model_path}", f"ppo.gen.max_new_tokens={workload.MAX_NEW}",
            f"dataset.max_prompt_len={workload.PROMPT_LEN}", "ppo.reward_fns=[math]",
            f"ppo.group_size={workload.GROUP}", f"dataset.train_bs_n_seqs={workload.N_PROMPTS}",
            f"ppo.gen.temperature={workload.TEMPERATURE}", "actor.lr=1e-4", "ppo.kl_ctl=0"]


def bench_config(model_path: str, fileroot: str, extra: list[str] | None = None):
    from areal_kit.config.loader import load_config

    return load_config("tiny", rl_overrides(model_path) + [f"fileroot={fileroot}"] + (extra or []))


def rollout_worker(cfg):
    """A started RolloutWorker in this process, with the env the controller gives its actors."""
    from areal_kit.rl.driver.groups import worker_env
    from areal_kit.rl.engine.worker import RolloutWorker

    env = worker_env(cfg, os.path.join(cfg.fileroot, "cache"))
    w = RolloutWorker(0, cfg.actor.path, cfg, env)
    w.setup()
    return w


def close_llm(llm) -> None:
    """Stop a vLLM engine's EngineCore process now (not whenever the garbage collector runs)."""
    import gc

    with contextlib.suppress(Exception):  # best effort: an engine that already stopped
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def rows_for(cfg, step: int = 0) -> list[dict]:
    """One batch of generation rows, seeded the way the controller seeds them."""
    from areal_kit.data.tokenizer import load_tokenizer
    from areal_kit.rl.algo.batch import sample_seed

    tok = load_tokenizer(cfg.actor.path)
    rows = workload.prompts(cfg.dataset.train_bs_n_seqs, seed=cfg.seed + step)
    ids = workload.prompt_ids(tok, rows)
    return [{**r, "prompt_text": r["question"], "prompt_ids": p, "seed": sample_seed(cfg.seed, step, i)}
            for i, (r, p) in enumerate(zip(rows, ids))]


def areal_kit_bin() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "areal-kit")
    return exe if os.path.exists(exe) else "areal-kit"


_RUNS: dict[tuple, dict] = {}


def train_run(args: list[str], workdir: str, name: str, timeout: float = 900,
              watch: Callable[[int], Any] | None = None, reuse: bool = True) -> dict:
    """Run `areal-kit train ARGS` in workdir; its metrics rows, wall time, start (epoch seconds)
    and log path.

    Each run gets its own fileroot and trial, `--fresh` and no saves, so nothing is resumed or
    written beyond logs; the log goes to workdir/NAME.log for a reader who wants the details.
    A run with the same ARGS earlier in this process is reused: `run.py` then starts the
    tiny preset once for the pipeline's synchronous row and the peer's tiny workload.
    `watch`, where given, is called with the command's pid as it starts; what it returns is
    stopped (its stop()) once the command ends, and comes back as the run's "watch" (a watched
    run is never a reused one); reuse=False runs the command again (a benchmark's second round).
    """
    from areal_kit import runlog
    from areal_kit.config.loader import load_config

    key = tuple(args)
    if reuse and watch is None and key in _RUNS:
        return _RUNS[key]

    fileroot = os.path.join(workdir, name)
    args = args + [f"fileroot={fileroot}", f"trial_name={name}", "exp_ctrl.save_freq_epochs=0",
                   "exp_ctrl.ckpt_freq_secs=0", "recover_mode=disabled", "tensorboard=false"]
    log_path = os.path.join(workdir, f"{name}.log")
    env = {**os.environ, "AREAL_USER": "bench"}
    t0 = time.time()
    with open(log_path, "w") as log, subprocess.Popen([areal_kit_bin(), "train", *args, "--fresh"], cwd=workdir,
                                                      env=env, stdout=log, stderr=subprocess.STDOUT) as proc:
        watcher = watch(proc.pid) if watch is not None else None
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            if watcher is not None:
                watcher.stop()
    wall = time.time() - t0
    if proc.returncode != 0:
        tail = Path(log_path).read_text()[-2000:]
        raise RuntimeError(f"areal-kit train {' '.join(args)} exited {proc.returncode}; log {log_path}:\n{tail}")
    exp = _value(args, "experiment_name") or load_config(args[0]).experiment_name  # args[0]: the preset
    paths = runlog.run_paths(fileroot, exp, name, user="bench")
    _RUNS[key] = {"rows": runlog.read_metrics(paths.metrics_file), "wall": wall, "start": t0, "log": log_path,
                  "watch": watcher}
    return _RUNS[key]


def _value(args: list[str], key: str) -> str | None:
    for a in args:
        if a.startswith(key + "="):
            return a.split("=", 1)[1]
    return None


def steady(rows: list[dict], skip: int = 2, tail: int = 0) -> list[dict]:
    """Steps after the first `skip` (warm-up: first allocations, queue filling) and before the
    last `tail`: at max_head_offpolicyness k the last k steps train with no generation queued
    behind them, faster than any step of a longer run."""
    kept = rows[skip:len(rows) - tail]
    return kept or rows


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def median(xs) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2
