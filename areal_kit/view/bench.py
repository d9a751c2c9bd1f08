"""What opening a long run costs `areal-kit view`: a synthetic run's files (metrics.jsonl and
samples.jsonl as a run writes them, with the index a run appends) in DIR, then the page's first
answers timed in process (no browser, no HTTP: the server's side of it). The first open of a long run
shows a sample of its metrics' rows while a thread reads them all: open_first_s is the page's first
answers, open_first_whole_trend_s until the trend has every row.

    python -m areal_kit.view.bench /tmp/long --steps 100000 --samples 256 --tokens 3
    python -m areal_kit.view.bench /tmp/long --reuse        # time again over the files already there

It prints one JSON object of seconds and bytes (docs/view.md has the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

from areal_kit.runlog import INDEX_RECORD, RunPaths, token_fields
from areal_kit.view.app import RunData
from areal_kit.view.index import SampleIndex
from areal_kit.view.metrics import MetricsTable

_T = TypeVar("_T")
_METRIC_KEYS = ("ppo_approx_kl", "actor_loss", "actor_clip_ratio", "importance_weight", "task_reward", "kl_reward",
                "final_reward", "advantage", "avg_seq_len", "avg_prompt_len", "n_tokens", "n_valid_tokens", "n_seqs",
                "no_eos_ratio", "perc_zero_adv", "entropy", "grad_norm", "lr", "gen_time", "reward_time", "load_time",
                "send_wait_time", "epoch", "epoch_step", "version", "ref_logp_time", "prox_logp_time", "staleness",
                "wait_time", "reward_failures", "train_time", "sync_time", "e2e_time")


def _rows(n: int, tokens: int, group_size: int = 8) -> list[bytes]:
    """n sample rows (after their global_step) as a run dumps them, each answer `tokens` tokens."""
    rng = random.Random(0)
    out = []
    for i in range(n):
        toks = [str(rng.randrange(10)) for _ in range(tokens - 1)] + ["<|endoftext|>"]
        r = {"id": f"toy-{i // group_size}", "group": i // group_size, "prompt": "<|im_start|> 3 + 4 =",
             "answer": " ".join(toks), "task_reward": float(rng.random() < 0.5), "seq_reward": rng.gauss(0, 1),
             "no_eos": False, "n_tokens": tokens, "version": 3, "final_reward": 1.0, "tool_calls": 0, "turns": 1,
             **token_fields(toks, [-rng.random() * 3 for _ in toks], None, None)}
        out.append(json.dumps(r).encode()[1:])  # without its "{": the line is '{"global_step": G, ' + this
    return out


def generate(log_dir: str, steps: int, samples: int, tokens: int) -> None:
    os.makedirs(log_dir, exist_ok=True)
    paths = RunPaths(log_dir, "", "")
    rng = random.Random(1)
    with open(paths.metrics_file, "w") as f:
        f.writelines(json.dumps({"global_step": g, "time": 1.7e9 + g,
                                **{k: rng.random() for k in _METRIC_KEYS}}) + "\n" for g in range(1, steps + 1))
    rows = _rows(samples, tokens)
    with open(paths.samples_file, "wb") as f, open(paths.samples_index_file, "wb") as idx:
        pos = 0
        for g in range(1, steps + 1):
            head = b'{"global_step": %d, ' % g
            data = b"".join(head + r + b"\n" for r in rows)
            f.write(data)
            idx.write(INDEX_RECORD.pack(g, pos, len(data), samples))
            pos += len(data)


def _timed(fn: Callable[..., _T], *args: Any) -> tuple[_T, float]:
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def measure(log_dir: str) -> dict:
    paths = RunPaths(log_dir, "", "")
    out: dict = {"samples_bytes": os.path.getsize(paths.samples_file),
                 "metrics_bytes": os.path.getsize(paths.metrics_file),
                 "index_bytes": os.path.getsize(paths.samples_index_file)}
    for cache in ("metrics.view.npz", "no-cache.npz"):  # metrics parsed anew
        if os.path.exists(os.path.join(log_dir, cache)):
            os.remove(os.path.join(log_dir, cache))

    def page_open() -> dict:
        data = RunData(paths, "bench")
        st = data.status()
        data.trend(None, 4000)
        data.step(st["last_sample_step"])
        return {"status": st, "data": data}

    got, out["open_first_s"] = _timed(page_open)  # a sample of the metrics' rows, the run's index
    st, first = got["status"], got["data"]
    out["open_first_sampled"] = first.metrics.sampled

    def read_whole() -> None:  # as the page polls: until the thread has read metrics.jsonl whole
        while first.metrics.sampled:
            time.sleep(0.01)
            first.refresh(force=True)
        first.trend(None, 4000)

    _, wait = _timed(read_whole)
    out["open_first_whole_trend_s"] = out["open_first_s"] + wait
    st = first.status()
    _, out["metrics_parse_s"] = _timed(lambda: _metrics(paths))
    first.metrics.save_cache()
    _, out["open_cached_s"] = _timed(page_open)  # the metrics' cache, the run's index
    data = RunData(paths, "bench")
    steps = data.samples.steps
    times = [_timed(data.step, g)[1] for g in random.Random(2).sample(steps, min(20, len(steps)))]
    out["step_open_median_s"], out["step_open_max_s"] = statistics.median(times), max(times)
    _, out["sample_open_s"] = _timed(data.sample, steps[len(steps) // 2], 0)
    _, out["trend_4000_points_s"] = _timed(data.trend, None, 4000)
    os.rename(paths.samples_index_file, paths.samples_index_file + ".run")
    try:
        idx = SampleIndex(paths.samples_file, paths.samples_index_file)
        _, out["index_scan_s"] = _timed(idx.update)  # a run without samples.index: scanned once, then kept
        _, out["index_reload_s"] = _timed(SampleIndex(paths.samples_file, paths.samples_index_file).update)
        out["index_scan_agrees"] = idx.steps == steps
    finally:
        os.replace(paths.samples_index_file + ".run", paths.samples_index_file)
    out["steps"], out["sample_steps"] = st["n_steps"], st["sample_steps"]
    return out


def _metrics(paths: RunPaths) -> int:
    t = MetricsTable(paths.metrics_file, os.path.join(paths.log_dir, "no-cache.npz"), background=False)
    t.update()
    return len(t.steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--tokens", type=int, default=3)
    p.add_argument("--reuse", action="store_true", help="measure the files already in DIR")
    a = p.parse_args()
    if not a.reuse:
        t = time.perf_counter()
        generate(a.dir, a.steps, a.samples, a.tokens)
        print(f"generated in {time.perf_counter() - t:.1f}s", flush=True)
    print(json.dumps(measure(a.dir), indent=1))


if __name__ == "__main__":
    main()
