"""Learning benchmark: wall time and steps until the tiny preset's task is learned, areal-kit vs TRL.

The same task (the tiny preset's multi-token sums, graded by areal-kit's own reward on both
sides), model (the preset's seeded random-init Qwen2), prompts in the same order, batch (the
preset's prompts x group, one optimizer step a batch), GRPO settings (group-normalized rewards,
the preset's KL term as a k3 loss (TRL's beta), its loss aggregation mapped to TRL's loss_type,
temperature 1) and optimizer (AdamW, lr, clipping) on both sides. areal-kit runs `areal-kit train
tiny` as a user does (async, max_head_offpolicyness 1); TRL's GRPOTrainer runs in its own venv
with transformers `generate`. Both start from one model folder, built once before either clock
starts (as a user's second run of the preset finds it built). "Learned" is the first step at which the mean task reward of the
last 10 steps reaches 0.8; its wall time counts from the command's start to the end of that step,
start-up included (the shutdown after the last step is reported apart). Each side stops at the
preset's step budget: a side that never reaches 0.8 is reported as such. areal-kit runs once more
with rollout.mode=stream (the same settings otherwise), which is how the default mode was chosen.
Before either side, vLLM alone (bench/engine_floor.py) gives the engine's start and the step's
generate with nothing else running: our side's least time to the target if all else were free.

    python bench/run.py learning
"""

from __future__ import annotations

import tempfile

from bench import engine_floor, engines, machine, peer
from bench.report import Result

THRESHOLD = 0.8
WINDOW = 10
ABOUT = __doc__.split("\n\n")[1].replace("\n", " ")
# ppo.loss_agg -> TRL's loss_type computing the same aggregation.
TRL_LOSS = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}


def reached(rows: list[dict], start: float) -> tuple[int | None, float | None]:
    """(step, seconds from the command's start to that step's end) at which the WINDOW-step mean
    reward first reaches THRESHOLD, or (None, None). Each row's `time` is when its step ended."""
    window: list[float] = []
    for i, r in enumerate(rows):
        window = (window + [r["task_reward"]])[-WINDOW:]
        if len(window) == WINDOW and sum(window) / WINDOW >= THRESHOLD:
            return i + 1, r["time"] - start
    return None, None


def ratio_to_target(ours: dict, peer: dict) -> float | None:
    """The peer's wall time to the target over ours (sides as side() gives them); where the peer never
    gets there, its whole run's wall time (ours is at least that much faster); None where ours never does."""
    if not ours["wall_to_target"]:
        return None
    return (peer["wall_to_target"] or peer["wall"]) / ours["wall_to_target"]


def side(rows: list[dict], wall: float, start: float, steal: float | None = None) -> dict:
    # Start-up: from the command's start to its first step's start (workers, engines, model load);
    # the shutdown after the last step is apart: it does not delay reaching the target.
    start_up = rows[0]["time"] - rows[0]["e2e_time"] - start
    step, secs = reached(rows, start)
    rewards = [r["task_reward"] for r in rows]
    return {"steps_to_target": step, "wall_to_target": secs, "start_up": start_up, "steps_run": len(rows),
            "s_per_step": engines.median(r["e2e_time"] for r in rows), "shutdown": wall - (rows[-1]["time"] - start),
            "wall": wall, "last10": sum(rewards[-WINDOW:]) / WINDOW, "steal": steal,
            "rewards": [round(v, 4) for v in rewards]}


def run() -> Result:
    from areal_kit.config.loader import load_config
    from areal_kit.rl.driver.job import resolve_model

    workdir = tempfile.mkdtemp(prefix="bench-learning-")
    cfg = load_config("tiny", [f"fileroot={workdir}"])
    cfg.actor.path = resolve_model(cfg)  # built once, before either clock starts: both sides train it
    # Each side's share of CPU time the host gave to other guests (steal): the sides run one after
    # the other, so a host that got busier between them moves the ratio without any change here.
    steal = {}

    def timed(name: str, fn, *args, **kw) -> dict:
        before = machine.cpu_ticks()
        out = fn(*args, **kw)
        steal[name] = machine.steal_share(before, machine.cpu_ticks())
        return out

    # vLLM alone on the same model and prompts: the part of our side no change of ours removes.
    floor = engine_floor.run(cfg.actor.path, workdir)
    ours = timed("ours", engines.train_run, ["tiny", f"actor.path={cfg.actor.path}"], workdir, "ours-learning",
                 timeout=1800)
    n_steps = len(ours["rows"])
    stream = timed("stream", engines.train_run, ["tiny", f"actor.path={cfg.actor.path}", "rollout.mode=stream"],
                   workdir, "ours-stream-learning", timeout=1800)
    trl = timed("trl", peer.run_trl, cfg, n_steps, 256, workdir, "trl-learning", loss_type=TRL_LOSS[cfg.ppo.loss_agg])
    res = {"areal-kit": side(ours["rows"], ours["wall"], ours["start"], steal["ours"]),
           "TRL": side(trl["rows"], trl["wall"], trl["start"], steal["trl"])}
    a, t = res["areal-kit"], res["TRL"]
    res["areal-kit, rollout.mode=stream"] = side(stream["rows"], stream["wall"], stream["start"], steal["stream"])
    st = res["areal-kit, rollout.mode=stream"]
    figures = {"threshold": THRESHOLD, "window": WINDOW, "budget_steps": n_steps}
    for who, key in (("areal-kit", "ours"), ("TRL", "trl"), ("areal-kit, rollout.mode=stream", "stream")):
        for f, v in res[who].items():
            figures[f"{key}_{f}"] = v
    ratio = ratio_to_target(a, t)
    least = engine_floor.least(floor, a["steps_to_target"])
    ceiling = ratio_to_target({"wall_to_target": least}, t)
    figures.update(vllm_alone_start_s=floor["start_s"], vllm_alone_call_s=floor["call_s"], ours_least_s=least,
                   ratio_ceiling=ceiling)
    checks = {"areal-kit reaches 0.8": a["steps_to_target"] is not None,
              "in no more steps than TRL": a["steps_to_target"] is not None
              and (t["steps_to_target"] is None or a["steps_to_target"] <= t["steps_to_target"]),
              # The default rollout mode is the one that learns the tiny task sooner.
              "the default mode (batch) is there no later than stream": a["wall_to_target"] is not None
              and (st["wall_to_target"] is None or a["wall_to_target"] <= st["wall_to_target"])}
    rows = [[who, reached_cell(x["steps_to_target"]), reached_cell(x["wall_to_target"]), x["start_up"], x["s_per_step"],
             x["steps_run"], x["last10"], x["shutdown"], cell(x["steal"], "{:.1%}")] for who, x in res.items()]
    notes = [(f"Ratio = TRL's wall time to a {WINDOW}-step mean task reward of {THRESHOLD} / areal-kit's "
              "(start-up included on both sides); where TRL does not get there, its whole run's wall time."),
             "Per-step reward curves of both sides are in latest.json (ours_rewards, trl_rewards).",
             (f"vLLM alone (bench/engine_floor.py: one engine of the preset on one core, nothing else running): "
              f"start {floor['start_s']:.1f} s, the step's generate {floor['call_s'] * 1000:.0f} ms. At "
              f"{reached_cell(a['steps_to_target'])} steps, with every other part of our side at no cost, ours would "
              f"take {cell(least)} s: at most {cell(ceiling, '{:.2f}x')} against this TRL run."),
             ("Host steal: the share of the CPUs' time the hypervisor gave to other guests while the side ran "
              "(/proc/stat); a side run on a busier host is slower for it.")]
    return Result("learning", f"wall time to task_reward {THRESHOLD}: areal-kit vs TRL GRPOTrainer, tiny preset",
                  figures, ratio=ratio, target=2.0, checks=checks,
                  columns=["toolkit", f"steps to {THRESHOLD}", f"s to {THRESHOLD}", "start-up s", "s/step (median)",
                           "steps run", "last-10 reward", "shutdown s", "host steal"], rows=rows, notes=notes)


def cell(v: float | None, fmt: str = "{:.1f}") -> str:
    """A table or note cell: "-" where there is no figure."""
    return "-" if v is None else fmt.format(v)


def reached_cell(v):
    """A table cell of steps or seconds to the target: "not reached" where there is none."""
    return "not reached" if v is None else v
