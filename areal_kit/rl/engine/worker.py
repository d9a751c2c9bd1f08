"""Rollout worker: one vLLM engine in a Ray actor; generates groups of answers and scores them.

Prompts arrive as token ids (no re-tokenization drift between engine and trainer); answers go
back as Samples (areal_kit/rl/sample.py): token ids with their behaviour logprobs (vLLM's processed logprobs: after temperature,
which is what the trainer recomputes), the weight version that produced them and the verifier's
reward. New weights arrive in place through the worker extension (areal_kit/rl/vllm_worker/extension.py).
Under rollout.mode=stream the engine is vLLM's AsyncLLM (streaming_llm.py) and the actor serves
one call per prompt group, many at once; samples then record the weight version of each token.

What happens to one prompt is the workflow (areal_kit/rl/workflow.py: single-turn by default,
or a user's multi-turn plug-in); rewards run through areal_kit/reward/scoring.py, which keeps a
failing or hanging plug-in from stopping the engine.
"""

from __future__ import annotations

import functools
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from areal_kit import hardware
from areal_kit.api import MODEL, Trajectory, Turn, Workflow
from areal_kit.config.rollout import streaming
from areal_kit.data.tokenizer import decode, load_tokenizer
from areal_kit.reward.grading import grade_row
from areal_kit.reward.scoring import RewardScorer
from areal_kit.rl import lora, sharing, workflow
from areal_kit.rl.common import heap
from areal_kit.rl.common.stacks import StackDumps
from areal_kit.rl.engine.sleeper import Sleeper
from areal_kit.rl.engine.weight_receive import WeightReceiver
from areal_kit.rl.sample import Generated, Sample

if TYPE_CHECKING:
    from vllm import SamplingParams

    from areal_kit.config.schema import TrainConfig
    from areal_kit.rl.engine.agent import AgentEpisodes

EXTENSION = "areal_kit.rl.vllm_worker.extension.WeightSyncExtension"


def engine_kwargs(cfg: TrainConfig, plat: hardware.Platform, model_path: str, index: int, tp: int) -> dict:
    """vllm.LLM's arguments for rollout engine `index`: the device's settings, actor.vllm, and
    what training needs of the engine (weights received in place, logprobs after temperature)."""
    max_len = cfg.dataset.max_prompt_len + cfg.ppo.gen.max_new_tokens
    kw = hardware.vllm_kwargs(plat, model_path, max_len, seed=cfg.seed + index, tp=tp, engine=cfg.actor.vllm,
                              sleep_mode=sharing.sleep_mode(cfg, plat))
    if streaming(cfg):
        # The stream names each group's priority (the weight version it was first submitted at):
        # when slots run short the oldest groups run first, so they finish within the staleness
        # bound instead of queueing behind newer ones, a group generated again included.
        kw["scheduling_policy"] = "priority"
    return {**kw, "worker_extension_cls": EXTENSION, "logprobs_mode": "processed_logprobs", **lora.engine_kwargs(cfg.actor.lora)}


class RolloutWorker(WeightReceiver, Sleeper, StackDumps):
    def __init__(self, index: int, model_path: str, cfg: TrainConfig, env: dict[str, str], tp: int = 1) -> None:
        os.environ.update(env)
        self.index, self.cfg, self.model_path, self.tp = index, cfg, model_path, tp
        self.version = 0

    def setup(self) -> float:
        t0 = time.time()

        plat = hardware.detect()
        # Before vLLM reads its settings.
        os.environ.update(hardware.vllm_env(plat, self.tp, self.cfg.actor.vllm.engine_core))
        kw = engine_kwargs(self.cfg, plat, self.model_path, self.index, self.tp)
        self.streaming = streaming(self.cfg)
        engine: Callable[..., Any]
        if self.streaming or self.cfg.agent.fn:  # an agent's chat endpoint serves from AsyncLLM
            from areal_kit.rl.engine.streaming_llm import StreamingLLM
            engine = StreamingLLM
        else:
            from vllm import LLM
            engine = LLM
        heap.freeze_imports()
        self.llm = engine(**kw)
        surface_engine_death(self.llm)
        self.llm = lora.serving(self.llm, self.cfg.actor.lora)  # under LoRA, generations name the adapter loaded last
        self.tokenizer = load_tokenizer(self.model_path, check=False)  # the driver checked it
        self.rewards = RewardScorer(self.cfg.ppo)
        self.agent = self._agent() if self.cfg.agent.fn else None  # its episodes count their drops
        self.episode: Workflow = self.agent if self.agent is not None else workflow.load(self.cfg.ppo.workflow)
        heap.freeze()
        return time.time() - t0

    def _agent(self) -> AgentEpisodes:
        """agent.fn as the workflow of its episodes, through a chat endpoint over this engine."""
        # Here, not at the top: the server's imports (fastapi, uvicorn, vLLM's OpenAI layer) would
        # lengthen every engine's start-up, and only an agent's engine serves.
        from areal_kit.rl.engine.agent import AgentEpisodes
        from areal_kit.rl.engine.endpoint import ChatEndpoint

        g, a = self.cfg.ppo.gen, self.cfg.agent
        fn = workflow.load_agent(a.fn)  # the driver imported it first: a bad spec never reaches here
        self.endpoint = ChatEndpoint(self.llm, self.model_path, "policy", tool_parser=a.tool_parser or None,
                                     temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                     max_tokens=g.max_new_tokens, version=lambda: self.version,
                                     adapter=lora.request if lora.sends_adapter(self.cfg.actor.lora) else None)
        return AgentEpisodes(fn, self.endpoint, self.endpoint.start(), a)

    def _params(self, seed: int | None, n: int, max_tokens: int | None = None,
                temperature: float | None = None) -> SamplingParams:
        from vllm import SamplingParams

        g = self.cfg.ppo.gen
        t = g.temperature if temperature is None else temperature
        max_tokens = max_tokens or g.max_new_tokens
        # A greedy request (in-training eval, t=0) takes the argmax: no top-p/top-k there.
        return SamplingParams(n=n, temperature=t, top_p=g.top_p if t else 1.0, top_k=g.top_k if t else -1,
                              max_tokens=max_tokens, min_tokens=min(g.min_new_tokens, max_tokens), logprobs=0,
                              detokenize=False, seed=seed)

    def _generate_batch(self, requests: list[workflow.Request], priority: int = 0) -> list[list[workflow.Completion]]:
        """One vLLM call for the workflows' pending requests (workflow.Engine); `priority`: the
        streaming engine's scheduling priority of the call's group (lower runs first)."""
        more = {"priority": priority} if self.streaming else {}
        seeds = [r.seed for r in requests]
        if not self.streaming and any(s is not None for s in seeds):
            # One seed for the whole call, from its requests' seeds: vLLM samples a seeded request
            # on a generator of its own, one draw per request each decode step, which cost the
            # tiny preset's engine an eighth of its time. The same call still samples the same
            # answers; a streaming engine's calls overlap, so there each request keeps its seed.
            self.llm.collective_rpc("seed_sampling", args=(workflow.call_seed(seeds),))
            seeds = [None] * len(requests)
        # One SamplingParams per distinct setting: vLLM copies each request's, and building one
        # per request was a visible share of the tiny preset's step.
        keys = [(s, r.n, r.max_tokens, r.temperature) for r, s in zip(requests, seeds)]
        params = {key: self._params(*key) for key in set(keys)}
        outs = self.llm.generate([{"prompt_token_ids": r.prompt_ids} for r in requests], [params[k] for k in keys],
                                 use_tqdm=False, **more)
        return [[workflow.Completion(list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)],
                                     o.finish_reason, getattr(o, "versions", None)) for o in out.outputs]
                for out in outs]

    def _workflow_engine(self, priority: int = 0) -> workflow.Engine:
        # One per call: a streaming engine runs many calls at once, each with its own pending requests.
        max_len = self.cfg.dataset.max_prompt_len + self.cfg.ppo.gen.max_new_tokens
        return workflow.Engine(functools.partial(self._generate_batch, priority=priority), self.tokenizer,
                               self.cfg.ppo.gen, self.cfg.ppo.group_size, max_len)

    def occupancy(self) -> float | None:
        """Streaming: the mean share of the engine's slots that held a running request since the last call."""
        return self.llm.take_occupancy() if self.streaming else None

    def generate(self, rows: list[dict], priority: int = 0) -> Generated:
        """Run the workflow on every row (group_size samples each) and score the answers.

        Each row's `seed` makes its samples reproducible; `priority` orders a streaming engine's
        groups when its slots run short (lower first). Besides the samples: reward_failures
        {kind: (count, first message)}, reward_extras {key: mean} of the dict rewards, the agent's
        dropped episodes {kind: (count, first message)}, and the calls refused or failed (the
        workflow engine's, and the chat endpoint's answered with an error status).
        """
        t0 = time.time()
        version = self.version
        engine = self._workflow_engine(priority)
        groups = workflow.run_episodes(self.episode, engine, rows)
        gen_time = time.time() - t0
        t1 = time.time()
        answers = [(gi, t, answer_text(t, self._text)) for gi, group in enumerate(groups) for t in group]
        rewards, extras = self._task_rewards(rows, answers)
        samples = [s for ei, ((gi, t, text), reward) in enumerate(zip(answers, rewards))
                   for s in episode_samples(rows[gi], gi, ei % self.cfg.ppo.group_size, t, version, reward,
                                            self._format_reward(text))]
        dropped = self.agent.take_failures() if self.agent is not None else {}
        failed = engine.failed_calls + (self.endpoint.take_failed_calls() if self.cfg.agent.fn else 0)
        return Generated(samples, gen_time, time.time() - t1, version, self.index, self.rewards.take_failures(),
                         extras, dropped, failed)

    def _task_rewards(self, rows: list[dict], answers: list[tuple]) -> tuple[list[float], dict]:
        """Each answer's task_reward: the workflow's own, else the reward_fns' sum on its text; and
        the means of the rewards' extra numbers. answers: (row index, Trajectory, text)."""
        given = [_given_reward(t) for _, t, _ in answers]
        todo = [i for i, r in enumerate(given) if r is None]
        items = []
        for i in todo:
            gi, t, text = answers[i]
            fields = {k: v for k, v in rows[gi].items() if k not in ("prompt_ids", "seed")}
            fields.update(turn_fields(t, self._text))
            items.append((rows[gi]["prompt_text"], text, {**fields, "no_eos": bool(t.no_eos)}))
        sums: dict[str, float] = {}
        scored = dict.fromkeys(todo, 0.0)
        for i, (reward, extra) in zip(todo, self.rewards.score(items)):
            scored[i] = reward
            for k, v in extra.items():
                sums[k] = sums.get(k, 0.0) + v
        rewards = [scored[i] if r is None else r for i, r in enumerate(given)]
        return rewards, {f"reward/{k}": v / len(todo) for k, v in sums.items()}

    def _format_reward(self, text: str) -> float | None:
        p = self.cfg.ppo
        if not p.format_reward:
            return None
        return p.format_reward if re.search(p.format_pattern, text, re.DOTALL) else 0.0

    def evaluate(self, rows: list[dict], max_new_tokens: int, n_samples: int = 0) -> list[dict]:
        """In-training eval of rows, graded like `areal-kit eval`: the greedy answer of each
        (correct, n_tokens, no_eos) and, with n_samples, how many of n_samples answers sampled at
        ppo.gen's temperature (seeded by row["seed"]) are correct (n_correct)."""
        prompts = [{"prompt_token_ids": r["prompt_ids"]} for r in rows]
        params = [self._params(None, 1, max_new_tokens, 0.0)] * len(rows)
        if n_samples:
            prompts += prompts
            params += [self._params(r["seed"], n_samples, max_new_tokens) for r in rows]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        res = []
        for i, row in enumerate(rows):
            o = outs[i].outputs[0]
            res.append({"id": row["id"], "correct": grade_row(self._text(o.token_ids), row),
                        "n_tokens": len(o.token_ids), "no_eos": o.finish_reason == "length"})
            if n_samples:
                sampled = outs[len(rows) + i].outputs
                res[-1]["n_correct"] = sum(grade_row(self._text(x.token_ids), row) for x in sampled)
        return res

    def _text(self, token_ids: Sequence[int]) -> str:
        return decode(self.tokenizer, token_ids, skip_special_tokens=True)

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprob of every token after the first of each sequence (engine vs trainer checks)."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=self.cfg.ppo.gen.temperature)
        outs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], sp, use_tqdm=False)
        res = []
        for seq, o in zip(sequences, outs):
            assert o.prompt_logprobs is not None, "asked for with prompt_logprobs=0"
            res.append([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], seq[1:])])
        return res


def surface_engine_death(llm: object, poll_s: float = 0.5) -> None:
    """Make calls on `llm` raise vLLM's EngineDeadError once its engine core process has died.

    vLLM's synchronous client (vllm.LLM with the engine core in its own process, as on GPUs) marks
    itself dead when the core exits but leaves a generate() or collective_rpc() under way waiting
    forever for the core's answer; the watchdog would only end it at its bound, as a hang. A
    thread watches that mark and hands those waits the error (rl/driver/retry.py relaunches on it). The
    in-process engine (CPU, one worker) dies with its actor, and AsyncLLM raises on its own.
    """
    # vLLM's private internals, found by name: Any.
    client: Any = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    resources: Any = getattr(client, "resources", None)
    if not hasattr(resources, "engine_dead") or not isinstance(getattr(client, "outputs_queue", None), queue.Queue):
        return

    def watch() -> None:
        while not resources.engine_dead:
            time.sleep(poll_s)
        from vllm.v1.engine.exceptions import EngineDeadError

        for future in list(client.utility_results.values()):
            if not future.done():
                future.set_exception(EngineDeadError())
        client.outputs_queue.put_nowait(EngineDeadError())

    threading.Thread(target=watch, name="engine-core-death", daemon=True).start()


def _given_reward(t: Trajectory) -> float | None:
    """The reward a workflow or agent gave an episode: its own, else (segments each with their
    own) its last segment's; None: ppo.reward_fns grade it."""
    if t.reward is not None:
        return float(t.reward)
    if t.segments is not None and all(s.reward is not None for s in t.segments):
        return float(cast(float, t.segments[-1].reward))
    return None


def _turn_text(turn: Turn, decode: Callable[[list[int]], str]) -> str:
    return decode(turn.token_ids) if turn.text is None else turn.text


def answer_text(t: Trajectory, decode: Callable[[list[int]], str]) -> str:
    """What rewards grade: the workflow's text, else the model's turns alone, else the whole output."""
    if t.text is not None:
        return t.text
    if t.segments is not None:  # each segment's model text, in order
        return "".join(answer_text(u, decode) for u in t.segments)
    if t.turns is not None:
        model = [u for u in t.turns if u.role == MODEL]
        if all(u.text is None for u in model):  # decoded as one: how a tokenizer spaces its words stays
            return decode([i for u in model for i in u.token_ids])
        return "".join(_turn_text(u, decode) for u in model)
    return decode(t.output_ids)


def turn_fields(t: Trajectory, decode: Callable[[list[int]], str]) -> dict:
    """A multi-turn episode's fields for its reward: every turn's role and text, and the
    environment's text (a tool's results) on its own; none for a single-turn answer. Segments:
    the turns of each in order (a later segment's prompt is not among them)."""
    if t.segments is not None:
        parts = [turn_fields(u, decode).get("turns") or [{"role": MODEL, "text": answer_text(u, decode)}]
                 for u in t.segments]
        turns = [x for p in parts for x in p]
        return {"turns": turns, "env_text": "".join(x["text"] for x in turns if x["role"] != MODEL)}
    if t.turns is None:
        return {}
    turns = [{"role": u.role, "text": _turn_text(u, decode)} for u in t.turns]
    return {"turns": turns, "env_text": "".join(x["text"] for x in turns if x["role"] != MODEL)}


def episode_samples(row: dict, group: int, index: int, t: Trajectory, version: int, task_reward: float,
                    format_reward: float | None) -> list[Sample]:
    """The Samples of the episode `index` of a workflow's group for `row`, scored: one, or one per
    segment, in order, each with its own reward where the episode gave one per segment, else the
    episode's (task_reward)."""
    if t.segments is None:
        return [_sample(row, group, t, version, task_reward, format_reward)]
    return [_sample(row, group, s, version, task_reward if s.reward is None else float(s.reward), format_reward, index)
            for s in t.segments]


def _sample(row: dict, group: int, t: Trajectory, version: int, task_reward: float,
            format_reward: float | None, episode: int | None = None) -> Sample:
    """The Sample of one of a workflow's trajectories (or one segment of an episode's, `episode`
    its index in the group) for `row`, scored."""
    versions = None if t.versions is None else [int(v) for v in t.versions]
    prompt = row["prompt_ids"] if t.prompt_ids is None else list(t.prompt_ids)
    return Sample(id=row["id"], group=group, prompt_ids=prompt, output_ids=list(t.output_ids),
                  logprobs=[float(x) for x in t.logprobs], no_eos=bool(t.no_eos),
                  version=version if not versions else min(versions), versions=versions,
                  task_reward=task_reward, format_reward=format_reward,
                  source=row.get("source"),  # dataset.mix: the step's task reward per source
                  loss_mask=None if t.loss_mask is None else [int(bool(x)) for x in t.loss_mask],
                  n_model_tokens=None if t.loss_mask is None else t.n_model_tokens,
                  turns=t.n_turns, tool_calls=t.n_tool_calls, episode=episode)
