"""The peer side of the tool benchmark: TRL's GRPOTrainer on the calculator task (tiny_tool), with
TRL's own tool calling, in TRL's own venv; bench/trl_grpo.py's spec, training loop and output.

The episode is areal-kit's (agents/calculator.py): the model answers "4 7 + 3 8 =" straight away or
writes one call, "<tool_call> 4 7 + 3 8 </tool_call>" then eos; the calculator's reply,
"<tool_response> 8 5 </tool_response>", follows (kept out of the loss) and the model answers; the calc
reward grades its last turn. TRL runs it as a tool-using GRPOTrainer job does: the prompt is a user
message, tools=[calculator], the call is read out of the model's text by the tokenizer's
response_template and run, the reply is rendered by the chat template, one round of calls at most.
Two things TRL asks of a tokenizer are added to the tiny model's, neither changing an episode's tokens:
a response_template (TRL ships them only for the model families it knows), and a chat template that
writes a call to any other tool in full (TRL refuses one whose text lacks a tool's name and argument
names; the tiny model's writes only the calculator's expression). Each model turn gets at most the
spec's max_new_tokens, as in areal-kit; an episode three times that (TRL's max_completion_length bounds
the whole completion, reply included, and a reply is never longer than the call's turn).

    PYTHONPATH=. /work/bench-venvs/trl/bin/python bench/trl_tool_grpo.py SPEC.json OUT.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from bench.trl_grpo import grpo_args, load, reward_fn, train

# How the tiny tool model's chat template writes a call's arguments, and the same for TRL: a call
# with an expression as before, any other call as its name and its arguments in JSON.
CALL_ARGS = "{{ args.expression if args is mapping else args }}"
CALL_ARGS_TRL = ("{{ args.expression if args is mapping and 'expression' in args "
                 "else (c.function or c).name ~ ' ' ~ (args | tojson if args is mapping else args) }}")


def calculator(expression: str) -> str:
    """Adds or subtracts two numbers.

    Args:
        expression: two numbers with + or - between them, as "4 7 + 3 8"
    """
    from areal_kit.data.toy_task import calculate

    return calculate(expression)


def response_template(eos: str) -> dict:
    """How TRL reads the model's turn (transformers' response_template): a turn that is one call and
    nothing else, ended by eos, calls the calculator with the text between the tags, as the calculator
    workflow reads it; any other turn is an answer, its text up to eos."""
    end = re.escape(eos)
    call = {"type": "function", "function": {"name": calculator.__name__, "arguments": {"expression": "{expression}"}}}
    return {
        "defaults": {"role": "assistant"},
        # The chat template adds nothing for the generation prompt: a turn starts where the prompt ends.
        "start_anchor_pattern": r"\Z",
        "fields": {
            "tool_calls": {"open_pattern": rf"\A\s*<tool_call>(?P<expression>(?:(?!</?tool_call>).)*)</tool_call>"
                                           rf"\s*{end}\s*\Z",
                           "repeats": True,  # TRL reads a list of calls
                           "transform": call},
            "content": {"close_pattern": end},
        },
    }


def chat_template(tok) -> str:
    """The tokenizer's chat template with CALL_ARGS_TRL; refused unless it renders a calculator
    episode to the same tokens."""
    if CALL_ARGS not in tok.chat_template:
        raise SystemExit(f"the chat template of the model has no {CALL_ARGS!r}: not the tiny tool model's")
    template = tok.chat_template.replace(CALL_ARGS, CALL_ARGS_TRL)
    call = {"type": "function", "function": {"name": calculator.__name__, "arguments": {"expression": "4 7 + 3 8"}}}
    episode = [{"role": "user", "content": "4 7 + 3 8 ="}, {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "name": calculator.__name__, "content": "8 5"}, {"role": "assistant", "content": "8 5"}]
    render = lambda **kw: tok.apply_chat_template(episode, return_dict=False, **kw)
    if render(chat_template=template) != render():
        raise SystemExit("the chat template for TRL renders the calculator episode differently from the model's")
    return template


def last_turn(reward):
    """`reward` on the model's last turn: TRL hands a reward function each episode as its messages."""

    def graded(prompts, completions, **kw):
        last = [next(m["content"] for m in reversed(c) if m["role"] == "assistant") for c in completions]
        return reward(prompts, last, **kw)

    graded.__name__ = reward.__name__
    return graded


def main(spec_path: str, out_path: str) -> None:
    import transformers
    from datasets import Dataset
    from packaging.version import Version

    # Older transformers parse with the legacy response_schema only: TRL would see no call at all.
    if Version(transformers.__version__) < Version("5.13"):
        raise SystemExit(f"TRL's tool calling with a response_template needs transformers >= 5.13, this venv has "
                         f"{transformers.__version__}")
    spec = json.loads(Path(spec_path).read_text())
    tok, model = load(spec)
    tok.chat_template = chat_template(tok)
    tok.response_template = response_template(tok.eos_token)
    rows = [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"], "question": r["question"]}
            for r in spec["rows"]]
    for r, given in zip(rows, spec["rows"]):  # the prompt tokens areal-kit generates from
        ids = tok.apply_chat_template(r["prompt"], tools=[calculator], add_generation_prompt=True, return_dict=False)
        if ids != tok(given["prompt"], add_special_tokens=False)["input_ids"]:
            raise SystemExit(f"the chat template renders {r['question']!r} as {tok.decode(ids)!r}, "
                             f"not as {given['prompt']!r}")
    turn = spec["max_new_tokens"]
    args = grpo_args(spec, max_completion_length=3 * turn, generation_kwargs={"max_new_tokens": turn},
                     max_tool_calling_iterations=1)
    reward = last_turn(reward_fn(spec["reward"], {tok.eos_token_id, tok.pad_token_id}))
    train(spec, tok, model, Dataset.from_list(rows), [reward], out_path, args=args,
          logged={"tool_calls": "tools/call_frequency"}, tools=[calculator])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
