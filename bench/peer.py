"""Peer benchmark: areal-kit vs TRL's GRPOTrainer, same job on this CPU, steps per hour.

Same model, prompts (in the same order), group size, generation settings (temperature 1, top-p 1,
no top-k), batch (32 prompts x 8, one optimizer step a batch, token-mean loss, the KL term of the
workload: the tiny preset's k3 loss term, none on the RL-shaped one), optimizer
(AdamW, lr, clip) and number of steps on both sides; the reward is areal-kit's own function on
both. Two workloads: the tiny preset's task (a generated token or two: a step is all fixed
overhead; reported, no target) and the RL-shaped one (~10M model, answers up to 256 tokens of widely
varying length, math reward), where generation dominates. TRL runs in its own venv with
transformers `generate` (no vLLM), as a user without a vLLM server would run it; areal-kit runs
`areal-kit train` as its tiny preset does, max_head_offpolicyness 1 (the next batch generates
while the trainer trains; TRL has no such mode), and the notes give its synchronous estimate.
Steps/hour count steps after the first (warm-up) and, for ours, before the last (which has no
generation queued behind it); wall times including start-up are shown too.

    bash bench/setup_trl_venv.sh        # TRL in /work/bench-venvs/trl (AREAL_BENCH_TRL_VENV); run on first use
    python bench/run.py peer
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from bench import engines, pipeline, workload
from bench.report import Result

TRL_VENV = os.environ.get("AREAL_BENCH_TRL_VENV", "/work/bench-venvs/trl")
TINY_STEPS = pipeline.STEPS  # the pipeline benchmark's synchronous run is reused in one invocation
RL_STEPS = 3  # warm-up, a steady step, and (ours) a last step with no generation behind it
OURS_K = 1  # max_head_offpolicyness of our runs: the tiny preset's
ABOUT = __doc__.split("\n\n")[1].replace("\n", " ")


def ordered_rows(cfg, steps: int) -> list[dict]:
    """The prompts our run trains on, in its order, with the text TRL needs for the same ids."""
    from areal_kit.data.prompts import PromptLoader, load_rows, tokenize_rows
    from areal_kit.data.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.actor.path)
    rows, _ = tokenize_rows(load_rows(cfg.dataset, cfg.seed), tok, cfg.dataset.max_prompt_len)
    loader = PromptLoader(rows, cfg.dataset.train_bs_n_seqs, seed=cfg.seed, shuffle=cfg.dataset.shuffle)
    out = []
    for _ in range(steps):
        out += loader.next_batch()[2]
    # TRL tokenizes the prompt text without special tokens: spell bos out so the ids match ours
    # (the toy tokenizer splits on whitespace, so it needs a space after bos; BPE must not get one).
    for r in out:
        for sep in ("", " "):
            r["prompt"] = tok.bos_token + sep + r["question"]
            if tok(r["prompt"], add_special_tokens=False)["input_ids"] == r["prompt_ids"]:
                break
        else:
            raise RuntimeError(f"no prompt text gives TRL our prompt ids {r['prompt_ids']} for {r['question']!r}")
    return [{k: r[k] for k in ("prompt", "question", "answer")} for r in out]


def run_trl(cfg, steps: int, micro_batch: int, workdir: str, name: str, loss_type: str = "dapo",
            script: str = "trl_grpo.py") -> dict:
    """TRL's side of a benchmark: `script` (bench/trl_grpo.py, or a variant on its spec) in TRL's venv on
    cfg's model, prompts in our order and settings; its per-step rows, wall time and start."""
    py = os.path.join(TRL_VENV, "bin", "python")
    if not os.path.exists(py):  # TRL gets its own venv, apart from areal-kit's packages
        setup = os.path.join(os.path.dirname(os.path.abspath(__file__)), "setup_trl_venv.sh")
        print(f"no TRL venv at {TRL_VENV}: creating it (bash {setup}, ~3 minutes)", flush=True)
        subprocess.run(["bash", setup, TRL_VENV], check=True)
    a, p = cfg.actor, cfg.ppo
    spec = {"model": cfg.actor.path, "rows": ordered_rows(cfg, steps), "reward": p.reward_fns[0],
            "n_prompts": cfg.dataset.train_bs_n_seqs, "group_size": p.group_size, "micro_batch": micro_batch,
            "max_new_tokens": p.gen.max_new_tokens, "temperature": p.gen.temperature, "steps": steps,
            "seed": cfg.seed, "lr": a.lr, "weight_decay": a.weight_decay, "adam_betas": list(a.adam_betas),
            "gradient_clipping": a.gradient_clipping, "loss_type": loss_type, "workdir": os.path.join(workdir, name),
            # TRL's KL is Schulman's k3 as a loss term: our kl_mode=loss, k3.
            "beta": p.kl_ctl if p.kl_mode == "loss" and p.kl_estimator == "k3" else 0.0}
    if p.kl_ctl and not spec["beta"]:
        raise ValueError("TRL has no KL penalty in the reward nor other estimators than k3: set ppo.kl_mode=loss, "
                         "ppo.kl_estimator=k3 or ppo.kl_ctl=0 for a comparison")
    spec_path, out_path = os.path.join(workdir, f"{name}.json"), os.path.join(workdir, f"{name}.out.json")
    Path(spec_path).write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": engines.ROOT, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    log_path = os.path.join(workdir, f"{name}.log")
    import time

    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run([py, os.path.join(engines.ROOT, "bench", script), spec_path, out_path],
                              env=env, stdout=log, stderr=subprocess.STDOUT, timeout=3600, check=False)
    if proc.returncode != 0:
        tail = Path(log_path).read_text()[-2000:]
        raise RuntimeError(f"TRL run {name} exited {proc.returncode}; log {log_path}:\n{tail}")
    out = json.loads(Path(out_path).read_text())
    return {"rows": out["steps"], "wall": time.time() - t0, "start": t0}


def side(rows: list[dict], wall: float, skip: int, tail: int = 0) -> dict:
    s = engines.steady(rows, skip, tail)
    m = lambda key: engines.mean(r.get(key, 0.0) for r in s)
    e2e, gen = m("e2e_time"), m("gen_time")
    # Time the trainer sat idle for generation: ours measures it; TRL's loop always waits for it.
    wait = engines.mean(r.get("wait_time", r.get("gen_time", 0.0)) for r in s)
    return {"s_per_step": e2e, "steps_per_hour": 3600 / e2e, "gen": gen, "train": m("train_time"),
            "sync_estimate": gen + m("train_time") + m("sync_time"),
            "other": max(e2e - wait - m("train_time"), 0.0), "wall": wall,
            "rewards": [round(r.get("task_reward", float("nan")), 4) for r in rows]}


def run() -> Result:
    from areal_kit.config.loader import load_config

    workdir = tempfile.mkdtemp(prefix="bench-peer-")
    results = {}
    # Tiny preset: ours first (reused from the pipeline benchmark when it ran in this process).
    tiny_cfg = load_config("tiny", [f"fileroot={workdir}"])
    from areal_kit.rl.driver.job import resolve_model

    tiny_cfg.actor.path = resolve_model(tiny_cfg)  # the same seeded tiny://toy model our run builds
    ours = engines.train_run(pipeline.tiny_args(OURS_K, TINY_STEPS), workdir, "ours-tiny")
    trl = run_trl(tiny_cfg, TINY_STEPS, 256, workdir, "trl-tiny")
    results["tiny"] = {"areal-kit": side(ours["rows"], ours["wall"], 2, OURS_K),
                       "TRL": side(trl["rows"], trl["wall"], skip=2)}
    # RL-shaped: generation dominates; back to back.
    model = workload.rl_model()
    rl_cfg = engines.bench_config(model, workdir)
    ours = engines.train_run(["tiny", *engines.rl_overrides(model), f"exp_ctrl.total_train_steps={RL_STEPS}",
                              f"ppo.max_head_offpolicyness={OURS_K}", "experiment_name=rl"], workdir, "ours-rl")
    trl = run_trl(rl_cfg, RL_STEPS, 16, workdir, "trl-rl")
    results["rl"] = {"areal-kit": side(ours["rows"], ours["wall"], 1, OURS_K),
                     "TRL": side(trl["rows"], trl["wall"], skip=1)}
    figures, rows = {"tiny_steps": TINY_STEPS, "rl_steps": RL_STEPS}, []
    tiny_new = tiny_cfg.ppo.gen.max_new_tokens
    for wl, label in (("tiny", f"tiny preset ({tiny_new} token{'s' if tiny_new > 1 else ''})"),
                      ("rl", f"RL-shaped (<= {workload.MAX_NEW} tokens)")):
        r = results[wl]
        for who in ("areal-kit", "TRL"):
            x, key = r[who], f"{wl}_{'ours' if who == 'areal-kit' else 'trl'}"
            for f in ("s_per_step", "steps_per_hour", "gen", "train", "wall"):
                figures[f"{key}_{f}"] = x[f]
            figures[f"{key}_rewards"] = x["rewards"]
            rows.append([label, who, x["s_per_step"], x["steps_per_hour"], x["gen"], x["train"], x["other"],
                         x["wall"], _curve(x["rewards"])])
        figures[f"{wl}_ratio"] = r["areal-kit"]["steps_per_hour"] / r["TRL"]["steps_per_hour"]
    est = results["rl"]["areal-kit"]["sync_estimate"]
    figures["rl_ours_sync_estimate_s"] = est
    figures["rl_ratio_sync_estimate"] = results["rl"]["TRL"]["s_per_step"] / est
    notes = [(f"Synchronous areal-kit (max_head_offpolicyness 0) would take about gen + train + sync = {est:.1f} s "
              f"a step on the RL-shaped workload ({figures['rl_ratio_sync_estimate']:.2f}x TRL), an estimate "
              "from the same run; with 2 shared cores, overlapped generation and training slow each other."),
             (f"Tiny preset ratio {figures['tiny_ratio']:.2f}x (reported, no target). Reward curves are per step "
              "(mean task reward); a few steps of a random-init model show throughput, not learning."),
             ("TRL's gen = its transformers generate; train = the rest of its step (logprobs, loss, backward, "
              "optimizer); other = rewards. Ours: gen on the vLLM engine (overlapping training), train on the "
              "DeepSpeed actor, other = idle wait + sync + loop. The full reward curves are in latest.json.")]
    return Result("peer", "steps/hour: areal-kit vs TRL GRPOTrainer on the RL-shaped workload", figures,
                  ratio=figures["rl_ratio"], target=2.0,
                  columns=["workload", "toolkit", "s/step", "steps/hour", "gen s", "train s", "other s",
                           "wall incl. start-up s", "reward per step"], rows=rows, notes=notes)


def _curve(rewards: list[float]) -> str:
    """A reward curve in a table cell: every step, or the mean of the first and last five."""
    if len(rewards) <= 6:
        return " ".join(f"{v:.3f}" for v in rewards)
    return f"{engines.mean(rewards[:5]):.3f} (first 5) -> {engines.mean(rewards[-5:]):.3f} (last 5)"
