"""The calculator task (agents/calculator.py, data/toy_task.py) and tiny://tool's model: two-digit
sums, a calculator that reads the call, a reward on the model's last turn, a tokenizer and chat
template that write a chat as the same tokens as the hand-written episode, and a prior that knows
the call format but calls rarely."""

import asyncio
import json

import pytest

from areal_kit.agents.calculator import TOOL, calculator, called
from areal_kit.api import Completion, Trajectory
from areal_kit.data.tiny_model import TinySpec, build_tokenizer
from areal_kit.data.toy_task import calc_reward, calc_rows, calculate, spell, tool_call, tool_response
from areal_kit.rl.engine.worker import turn_fields


def test_rows_are_two_digit_sums():
    rows = calc_rows(500, seed=2)
    for r in rows:
        a, b = r["question"].removesuffix(" =").split(" + ")
        x, y = int(a.replace(" ", "")), int(b.replace(" ", ""))
        assert 10 <= x <= 99 and 10 <= y <= 99
        assert r["answer"] == spell(x + y)
    assert len({r["question"] for r in rows}) > 450


def test_the_calculator_reads_a_call_as_either_tokenizer_writes_it():
    assert calculate("4 7 + 3 8") == "8 5"
    assert calculate("47+38") == "8 5"  # a byte-level tokenizer's reading of the same ids
    assert calculate("9 5 - 1 8") == "7 7"
    for bad in ["", "4 7 +", "+ 3 8", "4 7 * 3 8", "a + b", "4 7 + + 3 8"]:
        assert calculate(bad) == "?", bad


def test_a_call_is_a_whole_turn_of_one_call():
    assert called(" <tool_call> 4 7 + 3 8 </tool_call> ") == "4 7 + 3 8"
    assert called("<tool_call>47+38</tool_call>") == "47+38"
    for not_a_call in ["8 5", "5 <tool_call> 4 7 </tool_call>", "<tool_call> 4 7 </tool_call> 5",
                       "<tool_call> 4 7", "<tool_call> <tool_call> 4 </tool_call>"]:
        assert called(not_a_call) is None, not_a_call


def test_the_reward_grades_the_model_s_last_turn_only():
    row = {"answer": "8 5"}
    turns = [{"role": "model", "text": "<tool_call> 4 7 + 3 8 </tool_call>"},
             {"role": "env", "text": "<tool_response> 8 5 </tool_response>"}, {"role": "model", "text": "8 5"}]
    assert calc_reward("", "<tool_call> 4 7 + 3 8 </tool_call> 8 5", {**row, "turns": turns}) == 1.0
    assert calc_reward("", "x", {**row, "turns": turns[:2]}) == 0.0  # the tool's reply alone earns nothing
    assert calc_reward("", "8 5", row) == 1.0  # a direct answer
    assert calc_reward("", "8 5", {**row, "no_eos": True}) == 0.0
    assert calc_reward("", "8 6", row) == 0.0


def test_the_chat_template_writes_the_hand_written_episode():
    tok = build_tokenizer(TinySpec(kind="tool"))
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    question = "4 7 + 3 8 ="
    chat = [{"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calculator",
                                                              "arguments": {"expression": "4 7 + 3 8"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "8 5"}]
    # As vLLM renders a chat: the template's text, tokenized without added specials.
    ids = enc(tok.apply_chat_template(chat, tools=[TOOL], tokenize=False, add_generation_prompt=True))
    by_hand = [tok.bos_token_id] + enc(question) + enc(tool_call("4 7 + 3 8")) + [tok.eos_token_id] \
        + enc(tool_response("8 5"))
    assert ids == by_hand
    # The tool words are single tokens and added tokens (vLLM's byte-level reading keeps them).
    assert all(len(enc(w)) == 1 for w in ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    assert {"<tool_call>", "</tool_response>"} <= {t.content for t in tok.added_tokens_decoder.values()}
    assert json.loads(json.dumps(TOOL))["function"]["name"] == "calculator"


class ScriptedEngine:
    """The workflow's engine with scripted answers: the episode's control flow, not the model's."""

    group_size = 3

    def __init__(self, tok, first: list[str], second: str):
        self.tok, self.first, self.second, self.prompts = tok, first, second, []

    def encode(self, text):
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    def _c(self, text):
        ids = self.encode(text) + [self.tok.eos_token_id]
        return Completion(ids, [-0.5] * len(ids), "stop")

    async def generate(self, prompt_ids, n=1, max_tokens=None, seed=None, temperature=None):
        self.prompts.append(list(prompt_ids))
        return [self._c(t) for t in self.first] if len(self.prompts) == 1 else [self._c(self.second)]


def test_the_workflow_runs_the_calculator_only_for_a_call():
    tok = build_tokenizer(TinySpec(kind="tool"))
    engine = ScriptedEngine(tok, ["<tool_call> 4 7 + 3 8 </tool_call>", "8 5", "8 <tool_call> 4 </tool_call>"], "8 5")
    prompt = [tok.bos_token_id] + engine.encode("4 7 + 3 8 =")
    out = asyncio.run(calculator(engine, {"prompt_ids": prompt, "seed": 3}))
    assert len(out) == 3 and all(isinstance(t, Trajectory) for t in out)
    call, direct, malformed = out
    reply = engine.encode(tool_response("8 5"))
    assert engine.prompts[1] == prompt + engine.encode("<tool_call> 4 7 + 3 8 </tool_call>") + [tok.eos_token_id] + reply
    assert [t.role for t in call.turns] == ["model", "env", "model"]
    n_call = len(call.turns[0].token_ids)
    assert call.loss_mask == [1] * n_call + [0] * len(reply) + [1] * 3  # the reply is context only
    assert call.logprobs[n_call:n_call + len(reply)] == [0.0] * len(reply)
    assert len(direct.turns) == 1 and len(malformed.turns) == 1  # no call, no tool
    fields = turn_fields(call, engine.decode)
    assert fields["env_text"].split() == tool_response("8 5").split()
    assert calc_reward("", "", {"answer": "8 5", **fields}) == 1.0


@pytest.mark.slow
def test_the_tool_prior_copies_but_rarely_calls(tmp_path):
    """A small prior (fewer steps than the preset's) already writes calls and answers in form."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal_kit.data.tiny_model import build
    from areal_kit.data.tokenizer import load_tokenizer

    path = build(str(tmp_path / "m"), TinySpec(kind="tool", prior_steps=150, seed=1))
    tok, model = load_tokenizer(path), AutoModelForCausalLM.from_pretrained(path)
    call_id = tok.convert_tokens_to_ids("<tool_call>")
    prompts = torch.tensor([[tok.bos_token_id] + tok(r["question"], add_special_tokens=False)["input_ids"]
                            for r in calc_rows(200, seed=9)])
    with torch.no_grad():
        p_call = model(prompts).logits[:, -1].softmax(-1)[:, call_id]
    assert 0.02 < float(p_call.mean()) < 0.3  # it knows the call, and does not make it a habit
