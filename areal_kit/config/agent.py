"""agent.*: an agent written against an OpenAI-style client, trained through the rollout engines'
chat endpoint (rl/engine/endpoint.py). A section of the training config (config/schema.py).

    areal-kit train tiny_tool agent.fn=areal_kit.agents.calculator:openai_agent agent.tool_parser=calc ppo.workflow=
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_kit.config.fields import check, opt


@dataclass
class AgentConfig:
    fn: str = opt("",
        "The agent: pkg.mod:fn or file.py:fn, a function (async or not) (base_url, api_key, row) -> reward "
        "or None, run ppo.group_size times per prompt. It talks to the policy through any OpenAI-style "
        "client at base_url with api_key (the episode's own); every call it makes is recorded token-exact "
        "and trained on, the chat template's and the tools' tokens in the context only. None: "
        "ppo.reward_fns grade the episode (the model's turns, the tools' text in the row's turns and "
        'env_text). "" = no agent (ppo.workflow or single-turn).')
    timeout_s: float = opt(120.0,
        "An episode whose agent takes longer than this, of its own time, is dropped (counted in "
        "agent/dropped) and run again; the time its calls spend in the endpoint (queued behind other "
        "episodes, generating) is the engine's and does not count.")
    attempts: int = opt(3,
        "Tries per episode: an agent that raises or overruns timeout_s is run again, with a new key and "
        "seed, so the step still fills; past this many failures of one episode the rollout fails with "
        "the agent's first error.")
    tool_parser: str = opt("",
        "vLLM's tool parser that turns the model's text into tool_calls (hermes, llama3_json, ..., or "
        'calc for tiny://tool\'s calculator calls); "" = none (tools are then not parsed).')

    def __post_init__(self) -> None:
        check(self.timeout_s > 0, f"agent.timeout_s={self.timeout_s} is not valid; expected > 0")
        check(isinstance(self.attempts, int) and self.attempts >= 1,
              f"agent.attempts={self.attempts} is not valid; expected an integer >= 1")
