"""Run areal-kit's benchmarks against the baselines users would pick, side by side on this machine.

    python bench/run.py                    # every benchmark, in the order below (~20 min on 2 cores)
    python bench/run.py rollout packing    # some of them
    python bench/run.py --list
    python bench/run.py --markdown         # rewrite bench/PERFORMANCE.md from latest.json

Each benchmark prints one JSON line and a table, updates its entry in bench/results/latest.json
({name: {figures..., ratio: x}}) and regenerates bench/PERFORMANCE.md. Both sides of every
ratio run in the same invocation, back to back, so a busy machine slows both alike.
Run it with the project's venv (`.venv/bin/python bench/run.py` after `bash .ci/install.sh`);
the peer benchmark runs TRL from its own venv, made on first use (bench/setup_trl_venv.sh, see bench/peer.py).
Models are built locally on first use and cached under ~/.cache/areal-kit-bench.
"""

from __future__ import annotations

import importlib
import os
import sys

# Before torch loads libgomp: OpenMP threads that spin at barriers collapse when the cores are
# shared (measured here at load 12-17 on 2 cores: a 2-thread transformers generate took 56-82 s
# spinning vs 3.8-4.6 s passive, and 1 thread 3-4.5 s). Both sides of every ratio, and every
# process they start (vLLM, Ray workers, TRL), inherit the same setting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import PERFORMANCE_MD, load_latest, main_args, run_all, write_markdown

# name -> module; each module has run() -> Result and ABOUT (the text PERFORMANCE.md shows).
MODULES = {
    "rollout": "bench.rollout",
    "weight_sync": "bench.weight_sync",
    "pipeline": "bench.pipeline",
    "streaming": "bench.streaming",
    "peer": "bench.peer",
    "packing": "bench.packing",
    "learning": "bench.learning",
    "faults": "bench.faults",
    "lora": "bench.lora",
    "tool": "bench.tool_learning",
    "cpu": "bench.cpu",
    "engine_core": "bench.engine_core",
    "endpoint": "bench.endpoint",
}


INTRO = """
Measured on the machine named under each benchmark, both sides of every ratio in one run, back
to back (`python bench/run.py`, about 20 minutes; `python bench/run.py NAME` for one). The
machine was 2 cores shared with other work: figures move by 10-30% between runs, so rerun
before quoting. The runner sets OMP_WAIT_POLICY=PASSIVE for every process on both sides:
OpenMP threads that spin at barriers collapse on a busy machine (15x slower measured here).
The peer benchmark runs TRL from its own venv, made on first use by `bash bench/setup_trl_venv.sh` (~3 minutes).
"""


def _lazy(mod: str):
    # Import on use: `run.py packing` must not pay for (or need) vLLM and TRL imports.
    return lambda: importlib.import_module(mod).run()


def about() -> dict[str, str]:
    out = {}
    for name, mod in MODULES.items():
        try:
            out[name] = importlib.import_module(mod).ABOUT
        except Exception:  # noqa: BLE001 (a module that fails to import still gets its figures written)
            out[name] = ""
    return out


def main(argv: list[str] | None = None) -> None:
    registry = {name: _lazy(mod) for name, mod in MODULES.items()}
    args = sys.argv[1:] if argv is None else argv
    if "--markdown" in args:  # rewrite PERFORMANCE.md from latest.json, run nothing
        print(write_markdown(load_latest(), PERFORMANCE_MD, about(), INTRO))
        return
    names = main_args(args, registry)
    done = run_all(registry, names, about=about(), intro=INTRO)
    if any("error" in r for r in done.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
