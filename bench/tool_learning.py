"""Tool-use benchmark: the calculator task (tiny_tool) learned with the calculator, without it, and
through the chat endpoint by an agent written with the `openai` client, batch and streaming.

Two-digit sums ("4 7 + 3 8 ="), which the ~110k-parameter model cannot learn to add in the run's
time; the model (tiny://tool) knows how a calculator call and its use are written and calls about
one time in ten. With the tool (the preset's workflow, agents/calculator.py), on seeds 1-3; the
same task with ppo.workflow="" (single-turn: a call gets no reply), on seeds 1-3; and the agent
(openai_agent, agent.tool_parser=calc) through the engine's chat endpoint in batch and stream mode,
seed 1. The peer: TRL's GRPOTrainer with its own tool calling (tools=[calculator], one round of
calls) on the same model folder, prompts in the same order, group, batch, KL term and optimizer,
against the tool run of seed 1 (bench/trl_tool_grpo.py says what TRL needs of the tokenizer). The
model is built once, before any clock starts. "Learned" is the first step at which the mean task
reward of the last 10 steps reaches 0.8 (as in the learning benchmark); its wall time counts from
the command's start.

    python bench/run.py tool
"""

from __future__ import annotations

import tempfile

from bench import engines, peer
from bench.learning import THRESHOLD, TRL_LOSS, WINDOW, ratio_to_target, reached_cell, side
from bench.report import Result

ABOUT = __doc__.split("\n\n")[1].replace("\n", " ")
SEEDS = (1, 2, 3)
AGENT = ["ppo.workflow=", "agent.fn=areal_kit.agents.calculator:openai_agent", "agent.tool_parser=calc"]
AGENT_STEPS = 100  # each of the agent's calls goes through vLLM's chat server (bench/endpoint.py: its cost)


def run() -> Result:
    from areal_kit.config.loader import load_config
    from areal_kit.rl.driver.job import resolve_model

    workdir = tempfile.mkdtemp(prefix="bench-tool-")
    cfg = load_config("tiny_tool", [f"fileroot={workdir}"])
    cfg.actor.path = resolve_model(cfg)  # built once, before any clock starts: every run trains it
    preset = ["tiny_tool", f"actor.path={cfg.actor.path}"]
    runs: dict[str, dict] = {}
    for seed in SEEDS:
        runs[f"calculator, seed {seed}"] = engines.train_run([*preset, f"seed={seed}"], workdir, f"tool-{seed}")
    n_steps = len(runs["calculator, seed 1"]["rows"])
    runs["TRL GRPOTrainer, tools=[calculator], seed 1"] = peer.run_trl(
        cfg, n_steps, 256, workdir, "trl-tool", loss_type=TRL_LOSS[cfg.ppo.loss_agg], script="trl_tool_grpo.py")
    for seed in SEEDS:
        runs[f"no tool, seed {seed}"] = engines.train_run([*preset, f"seed={seed}", "ppo.workflow="], workdir,
                                                          f"notool-{seed}")
    for mode in ("batch", "stream"):
        runs[f"openai agent via endpoint, {mode}, seed 1"] = engines.train_run(
            [*preset, *AGENT, f"rollout.mode={mode}", f"exp_ctrl.total_train_steps={AGENT_STEPS}"], workdir,
            f"agent-{mode}")
    res = {who: side(r["rows"], r["wall"], r["start"]) for who, r in runs.items()}
    figures: dict = {"threshold": THRESHOLD, "window": WINDOW}
    for who, x in res.items():
        key = who.replace(", ", "_").replace(" ", "_")
        for f in ("steps_to_target", "wall_to_target", "start_up", "s_per_step", "steps_run", "last10"):
            figures[f"{key}_{f}"] = x[f]
        figures[f"{key}_first10"] = sum(x["rewards"][:WINDOW]) / WINDOW
        figures[f"{key}_rewards"] = x["rewards"]
    ours, trl = res["calculator, seed 1"], res["TRL GRPOTrainer, tools=[calculator], seed 1"]
    ratio = ratio_to_target(ours, trl)
    tool = [x for who, x in res.items() if who.startswith("calculator")]
    bare = [x for who, x in res.items() if who.startswith("no tool")]
    agent = [x for who, x in res.items() if who.startswith("openai agent")]
    checks = {"step 1 below 0.2 on every seed": all(x["rewards"][0] < 0.2 for x in tool + bare),
              "with the tool: 0.8 reached on every seed": all(x["steps_to_target"] for x in tool),
              "without the tool: stays below 0.2": all(x["last10"] < 0.2 for x in bare),
              "the agent through the endpoint reaches 0.8, batch and stream": all(x["steps_to_target"] for x in agent)}
    rows = [[who, x["rewards"][0], reached_cell(x["steps_to_target"]), reached_cell(x["wall_to_target"]), x["start_up"],
             x["s_per_step"], x["steps_run"], x["last10"]] for who, x in res.items()]
    notes = ["First: the task reward of step 1 (the model before any update).",
             (f"Ratio = TRL's wall time to a {WINDOW}-step mean task reward of {THRESHOLD} / areal-kit's (seed 1, "
              "start-up included on both sides); where TRL does not get there, its whole run's wall time."),
             (f"Per-step reward curves are in latest.json (*_rewards). The agent runs {AGENT_STEPS} steps: each of "
              "its calls goes through vLLM's OpenAI server (render, tokenize; in process, without HTTP: "
              "areal_kit.agent_client), which for a model this small costs more than generating; "
              "`bench/run.py endpoint` measures it.")]
    return Result("tool", "the calculator task: areal-kit with the tool vs TRL GRPOTrainer with tools, without the tool, "
                  "and an OpenAI-client agent via the endpoint",
                  figures, ratio=ratio, target=2.0, checks=checks,
                  columns=["run", "first", f"steps to {THRESHOLD}", f"s to {THRESHOLD}", "start-up s", "s/step (median)",
                           "steps run", "last-10 reward"], rows=rows, notes=notes)
