"""Endpoint benchmark: calls per second through one engine's chat endpoint, N agents at once.

One streaming engine (vLLM's AsyncLLM on the tool task's model, tiny://tool) with its chat
endpoint, as an agent run builds it; N agents (N = 64 to 4096) written with the `openai` async
client, on a thread and event loop of their own in the engine's process, as agent.fn runs them,
each asking the calculator task's chat twice (the second call carries the first's answer and a
tool result), a few tokens generated a call: generation is small, so what is measured is the
endpoint's own cost. Each N runs over HTTP (a socket, uvicorn on the engine's event loop) and in
process (areal_kit.agent_client: vLLM's chat server on the agents' loop, only the generation on
the engine's), in turns, against the same endpoint. A call's time is split by the CPU time of the
agents' thread and of the engine's loop, and the endpoint's counters (render, engine). Then the
tool task (tiny_tool) trains its step three ways, each twice, in turns: as its workflow, and as the openai agent through
the endpoint in process and over HTTP.

    python bench/run.py endpoint
    python -m bench.endpoint 64 256       # some N only, without the tool task's steps
    python -m bench.endpoint tool 16      # the tool task's steps only (16-step runs), one JSON line
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
import time

from bench.report import Result

ABOUT = __doc__.split("\n\n")[1].replace("\n", " ")
AGENTS = (64, 256, 1024, 4096)
# Over HTTP the agents' connection pool costs O(N) a call: 4096 agents would take over ten minutes
# on this machine's two shared cores, so HTTP stops at 1024.
HTTP_MAX = 1024
CALLS = 2  # per agent: the calculator episode's ask and its answer after the tool
MAX_TOKENS = 4
TOOL_STEPS = 30  # per side of the tool task's step: the workflow, the agent in process and over HTTP
TOOL_ROUNDS = 2  # runs of each side, in turns
PATHS = ("http", "in-process")  # how the agents reach the endpoint: over a socket, or agent_client's


def serve(model: str) -> tuple[object, object, str]:
    from areal_kit import hardware
    from areal_kit.rl.engine.endpoint import ChatEndpoint
    from areal_kit.rl.engine.streaming_llm import StreamingLLM

    plat = hardware.detect()
    os.environ.update(hardware.vllm_env(plat, 1))
    # As an agent run's engine (rollout.engine_kwargs); 256 calls generate at once, the rest queue.
    llm = StreamingLLM(**hardware.vllm_kwargs(plat, model, 256), scheduling_policy="priority",
                       logprobs_mode="processed_logprobs", max_num_seqs=256)
    ep = ChatEndpoint(llm, model, "policy", tool_parser="calc", temperature=1.0, max_tokens=MAX_TOKENS)
    return llm, ep, ep.start()


def drive(llm: object, ep: object, url: str, n_agents: int, path: str) -> dict:
    """n_agents agents at once, CALLS calls each: calls/s, a call's mean latency, the CPU time per
    call of the agents' thread (the client's side) and of the engine's event loop (the server's),
    and the endpoint's render and engine seconds per call."""
    from openai import AsyncOpenAI

    from areal_kit.agent_client import http_client
    from areal_kit.agents.calculator import TOOL

    lat: list[float] = []

    async def agent(client: AsyncOpenAI, i: int) -> None:
        key = ep.open_episode(seed=i)  # type: ignore[attr-defined]
        c = client.with_options(api_key=key)
        messages: list = [{"role": "user", "content": f"{i % 10} {i // 10 % 10} + 3 8 ="}]
        for _ in range(CALLS):
            t0 = time.perf_counter()
            r = await c.chat.completions.create(model="policy", messages=messages, tools=[TOOL],
                                                max_tokens=MAX_TOKENS)
            lat.append(time.perf_counter() - t0)
            messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                         {"role": "user", "content": "<tool_response> 8 5 </tool_response>"}]
        assert len(ep.close_episode(key)) == CALLS  # type: ignore[attr-defined]

    async def main() -> dict:
        # One client for all agents, as the calculator agent shares one per event loop; over HTTP
        # the openai client's own pool (1000 connections at most).
        http = http_client(url) if path == "in-process" else None
        client = AsyncOpenAI(base_url=url, api_key="-", max_retries=0, timeout=600, http_client=http)
        loop0 = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_cpu(), llm.loop))  # type: ignore[attr-defined]
        cpu0, t0 = time.thread_time(), time.perf_counter()
        await asyncio.gather(*(agent(client, i) for i in range(n_agents)))
        wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        loop = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_cpu(), llm.loop)) - loop0  # type: ignore[attr-defined]
        await client.close()
        return {"wall": wall, "client": cpu, "loop": loop}

    ep.take_timings()  # type: ignore[attr-defined]
    out: dict = {}
    th = threading.Thread(target=lambda: out.update(asyncio.run(main())))
    th.start()
    th.join()
    calls = n_agents * CALLS
    t = ep.take_timings()  # type: ignore[attr-defined]
    return {"agents": n_agents, "calls": calls, "wall": out["wall"], "calls_per_s": calls / out["wall"],
            "latency_ms": 1e3 * sum(lat) / calls, "client_cpu_ms": 1e3 * out["client"] / calls,
            "loop_cpu_ms": 1e3 * out["loop"] / calls, "render_ms": 1e3 * t["render"] / calls,
            "engine_ms": 1e3 * t["engine"] / calls}


async def _cpu() -> float:
    return time.thread_time()


async def http_agent(base_url: str, api_key: str, row: dict) -> None:
    """The calculator task's openai agent with its calls over HTTP, as every agent ran before
    agent_client: the step's old path, for the side-by-side row (agent.fn=bench.endpoint:http_agent)."""
    from areal_kit.agents import calculator

    calculator.http_client = _over_http  # this run's agents all take HTTP: the module is theirs alone
    await calculator.openai_agent(base_url, api_key, row)


def _over_http(base_url: str) -> None:
    return None


def tool_steps(workdir: str, model: str) -> dict[str, float]:
    """The tool task's median step (s), as its workflow and through the endpoint, in process and over HTTP."""
    from bench import engines

    # The HTTP agent is this module's: the run's processes find it from the repository's root.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    agent = ["ppo.workflow=", "agent.tool_parser=calc", f"exp_ctrl.total_train_steps={TOOL_STEPS}"]
    sides = {"workflow": [f"exp_ctrl.total_train_steps={TOOL_STEPS}"],
             "agent, in process": [*agent, "agent.fn=areal_kit.agents.calculator:openai_agent"],
             "agent, over HTTP": [*agent, "agent.fn=bench.endpoint:http_agent"]}
    steps: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(TOOL_ROUNDS):  # the sides in turns: a swing of the machine's load falls on each
        for name, args in sides.items():
            slug = name.replace(", ", "-").replace(" ", "_")
            run = engines.train_run(["tiny_tool", f"actor.path={model}", *args], workdir, f"{slug}-{r}", reuse=False)
            steps[name] += [row["e2e_time"] for row in engines.steady(run["rows"], 2, tail=1)]
    return {name: engines.median(v) for name, v in steps.items()}


def run(agents: tuple[int, ...] = AGENTS, tool: bool = True) -> Result:
    from areal_kit.config.loader import load_config
    from areal_kit.rl.driver.job import resolve_model

    workdir = tempfile.mkdtemp(prefix="bench-endpoint-")
    cfg = load_config("tiny_tool", [f"fileroot={workdir}"])
    model = resolve_model(cfg)
    load = os.getloadavg()[0]
    results: dict[str, dict[int, dict]] = {p: {} for p in PATHS}
    llm, ep, url = serve(model)
    try:
        for p in PATHS:  # a warm-up round each: the first calls compile the template, build the parsers
            drive(llm, ep, url, 16, p)
        for n in agents:
            for p in PATHS:
                if p == "http" and n > HTTP_MAX:
                    continue
                results[p][n] = drive(llm, ep, url, n, p)
                print(p, results[p][n], file=sys.stderr, flush=True)
    finally:
        ep.shutdown()  # type: ignore[attr-defined]
        llm.shutdown()  # type: ignore[attr-defined]
    steps = tool_steps(workdir, model) if tool else {}
    figures: dict = {"calls_per_agent": CALLS, "max_tokens": MAX_TOKENS, "load_before": load,
                     "load_after": os.getloadavg()[0]}
    rows = []
    for n in agents:
        for p in PATHS:
            if n not in results[p]:
                continue
            r = results[p][n]
            for k, v in r.items():
                figures[f"{p.replace('-', '_')}_{n}_{k}"] = v
            rows.append([n, p, r["calls_per_s"], r["latency_ms"], r["client_cpu_ms"], r["loop_cpu_ms"],
                         r["render_ms"], r["engine_ms"]])
    # The engine-side cost: CPU of the engine's event loop per call, summed over every N.
    both = [n for n in agents if n in results["http"]]
    loop = {p: sum(results[p][n]["loop_cpu_ms"] for n in both) for p in PATHS}
    calls = {p: sum(results[p][n]["calls_per_s"] for n in both) for p in PATHS}
    ratio = loop["http"] / loop["in-process"]
    figures["loop_cpu_ratio"] = ratio
    figures["calls_per_s_ratio"] = calls["in-process"] / calls["http"]
    notes = [(f"Each agent makes {CALLS} calls of at most {MAX_TOKENS} tokens. calls/s: all calls over the wall "
              "time of the N agents. latency: a call's mean time as the agent sees it, queueing included. "
              "client CPU: the agents' thread's CPU time per call (the openai client, httpx, their event loop; "
              "in process also vLLM's chat server, which then runs there). loop CPU: the engine's event loop's "
              "CPU time per call (over HTTP: uvicorn, the ASGI app, vLLM's chat server, the engine's output "
              "handling; in process only the engine's part). render: vLLM's render of the chat (template, "
              "tokenizer), engine: request to final output, both wall seconds per call (waits included)."),
             (f"Ratio = the engine loop's CPU per call over HTTP / in process (summed over the N both ran; HTTP "
              f"stops at {HTTP_MAX} agents); calls/s in process / over HTTP: {figures['calls_per_s_ratio']:.2f}x. Load average {load:.1f} before, "
              f"{figures['load_after']:.1f} after (2 shared cores: ratios, not absolute figures, carry).")]
    for name, step in steps.items():
        figures[f"tool_step_{name.replace(', ', '_').replace(' ', '_')}_s"] = step
    if steps:
        wf = steps["workflow"]
        figures["tool_step_agent_over_workflow"] = steps["agent, in process"] / wf
        figures["tool_step_http_agent_over_workflow"] = steps["agent, over HTTP"] / wf
        notes.append(f"The tool task (tiny_tool), median steady step of {TOOL_ROUNDS} runs of {TOOL_STEPS} steps a side, "
                     f"the sides in turns: as its workflow "
                     f"{wf:.3f} s; the openai agent through the endpoint in process {steps['agent, in process']:.3f} s "
                     f"({steps['agent, in process'] / wf:.1f}x), over HTTP {steps['agent, over HTTP']:.3f} s "
                     f"({steps['agent, over HTTP'] / wf:.1f}x).")
    checks = {"the engine loop's CPU a call at least 3x less in process": ratio >= 3.0}
    if steps:
        checks["the tool task's step through the endpoint within 3x of its workflow's"] = \
            figures["tool_step_agent_over_workflow"] <= 3.0
    return Result("endpoint", "calls/s through one engine's chat endpoint, N openai agents at once: over HTTP vs "
                  "in process (areal_kit.agent_client)", figures, ratio=ratio, target=3.0,
                  columns=["agents", "transport", "calls/s", "latency ms", "client CPU ms/call",
                           "loop CPU ms/call", "render ms/call", "engine ms/call"], rows=rows, notes=notes,
                  checks=checks)


def _tool_only(steps: int) -> None:
    import json

    from areal_kit.config.loader import load_config
    from areal_kit.rl.driver.job import resolve_model

    global TOOL_STEPS
    TOOL_STEPS = steps
    workdir = tempfile.mkdtemp(prefix="bench-endpoint-")
    model = resolve_model(load_config("tiny_tool", [f"fileroot={workdir}"]))
    load = os.getloadavg()[0]
    print(json.dumps({"steps": steps, "load_before": load, **tool_steps(workdir, model),
                      "load_after": os.getloadavg()[0]}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["tool"]:
        _tool_only(int(sys.argv[2]) if len(sys.argv) > 2 else TOOL_STEPS)
    else:
        print(run(tuple(int(a) for a in sys.argv[1:]) or AGENTS, tool=False))
