"""Build tiny random-init Qwen2 models with a local tokenizer: no hub, no network.

Two tokenizers:
  toy  a word-level vocabulary of 22 tokens (specials, digits, + - =, a few words) for the
       `tiny` preset's arithmetic task, words read back with a space between them ("1 7"):
       small enough that pure RL learns it in minutes. Its models get a format prior (how
       answers are written, not which); `arith_steps` adds an arithmetic prior on other tasks
       (copying, subtraction) for the LoRA preset's base.
  bpe  a byte-level BPE tokenizer trained on a small built-in corpus, so any text (eval
       questions, LaTeX) tokenizes; for eval tests and benchmarks.

    python -m areal_kit.data.tiny_model OUT_DIR [--kind toy|bpe] [--hidden 64] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from areal_kit.data.model_source import TinySpec
from areal_kit.data.toy_task import (
    CALC_RANGE,
    CALL,
    END_CALL,
    END_REPLY,
    MAX_SUM,
    REPLY,
    calc_question,
    spell,
    tool_call,
    tool_response,
)

SPECIALS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOY_WORDS = [str(d) for d in range(10)] + ["+", "-", "=", "answer", "is", "the", "what", "?"]
# The tool kind's words besides the toy ones: a call and the tool's reply, as Hermes-style chat
# templates write them, one word each.
TOOL_WORDS = [CALL, END_CALL, REPLY, END_REPLY]

BPE_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 2 + 3? The answer is 5. Therefore the final answer is \\boxed{5}.",
    "Let x be a real number such that x^2 = 16. Then x = 4 or x = -4.",
    "Solve for $n$: \\frac{1}{2} n + 3 = 7, so n = 8. #### 8",
    "GRPO samples a group of answers per prompt and normalizes the rewards.",
    "Compute 12 * 7 = 84, 9 + 10 = 19, 100 - 1 = 99, \\sqrt{2}, \\pi, (a, b).",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "Question: How many apples does she have left? Answer: Let's think step by step.",
]


# The tool kind's chat template: a user's message is the prompt after bos, an assistant's is its
# text and its calls (the calculator's expression), then eos, a tool's is its reply; nothing is
# added for the generation prompt. So a chat renders to exactly the tokens of the same episode
# written by hand (data/toy_task.py), and an agent's calls through the endpoint extend each other.
TOOL_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' or m.role == 'system' -%}<|im_start|> {{ m.content }}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if m.content %} {{ m.content }}{% endif -%}"
    "{%- for c in m.tool_calls or [] -%}"
    "{%- set args = c.function.arguments if c.function is defined else c.arguments -%}"
    " <tool_call> {{ args.expression if args is mapping else args }} </tool_call>"
    "{%- endfor -%}"
    " <|endoftext|>"
    "{%- elif m.role == 'tool' -%} <tool_response> {{ m.content }} </tool_response>"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def build_tokenizer(spec: TinySpec) -> PreTrainedTokenizerFast:
    if spec.kind in ("toy", "tool"):
        words = TOY_WORDS + (TOOL_WORDS if spec.kind == "tool" else [])
        vocab = {t: i for i, t in enumerate(SPECIALS + words)}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        # Words joined with a space. No clean-up: it would drop the space before "?" and the text
        # would not read back as it was written.
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=spec.bpe_vocab,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(BPE_CORPUS * 20, trainer=trainer)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|im_start|>",
        pad_token="<pad>",
        unk_token="?" if spec.kind != "bpe" else None,
    )
    if spec.kind == "tool":
        # Every word of more than one character an added token as well: vLLM loads a qwen2 model's
        # tokenizer as transformers' Qwen2Tokenizer, which rebuilds a byte-level pipeline from the
        # vocabulary and reads only its single characters and added tokens. So the chat endpoint
        # reads back every id the model can sample as that id, and an agent's chat extends itself.
        out.add_tokens([AddedToken(w, special=False, normalized=False) for w in words if len(w) > 1])
        out.chat_template = TOOL_CHAT_TEMPLATE
    return out


def format_prior(model: PreTrainedModel, tok: PreTrainedTokenizerBase, steps: int, seed: int, batch: int = 64, lr: float = 3e-3) -> float:
    """Teach the model how the toy task's answers are written, not what they are: supervised
    steps on "a + b = n <eos>" with n drawn independently of a and b. Returns the last loss.

    A real RL run starts from a pretrained model that already writes numbers; a random one
    would have to find a three-token answer ("1 7" then eos, 1 in 22^3 samples) by chance
    before "one digit, then eos" takes over, and in practice never does. After this the model
    writes every number from 0 to 18 about equally often, whatever the question: which number
    is right for a + b is left to RL.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    # Every prompt and answer the task has, tokenized once.
    prompts = [[tok.bos_token_id] + enc(f"{a} + {b} =") for a in range(10) for b in range(10)]
    answers = [enc(spell(n)) + [tok.eos_token_id] for n in range(MAX_SUM + 1)]
    with supervised(model, lr) as opt:
        for _ in range(steps):
            loss = supervised_step(model, opt, [(rng.choice(prompts), rng.choice(answers)) for _ in range(batch)],
                                   tok.pad_token_id)
    return loss


@contextmanager
def supervised(model: PreTrainedModel, lr: float) -> Iterator[torch.optim.Optimizer]:
    """AdamW over the model, in train mode and on one thread while it lasts, in eval mode after.
    One thread: a model this small gains nothing from two, and OpenMP threads that wait for each
    other on a busy machine make every step ten times slower."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield opt
    finally:
        torch.set_num_threads(threads)
        model.eval()


def supervised_step(model: PreTrainedModel, opt: torch.optim.Optimizer, pairs: list[tuple[list[int], list[int]]], pad: int) -> float:
    """One AdamW step on (prompt ids, answer ids) pairs, the loss on the answers; returns it."""
    # The answer only: prompts are the task's, not the model's to write.
    return masked_step(model, opt, [(p + a, [0] * len(p) + [1] * len(a)) for p, a in pairs], pad)


def masked_step(model: PreTrainedModel, opt: torch.optim.Optimizer, seqs: list[tuple[list[int], list[int]]], pad: int) -> float:
    """One AdamW step on (ids, loss mask) sequences, the loss on the tokens the mask keeps; returns it."""
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.tensor([x + [pad] * (width - len(x)) for x, _ in seqs])
    labels = torch.tensor([[t if m else -100 for t, m in zip(x, mask)] + [-100] * (width - len(x))
                           for x, mask in seqs])
    loss = model(input_ids=ids, labels=labels).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


# What the arithmetic prior must reach: greedy accuracy at copying and at subtraction, each. A base
# below it has not learned to read its prompt, and no adapter takes it to the sums.
READS_PROMPT = 0.6
ARITH_ATTEMPTS = 4


def arith_prior(model: PreTrainedModel, tok: PreTrainedTokenizerBase, steps: int, seed: int, batch: int = 64, lr: float = 3e-3) -> float:
    """Pre-train on number text that is not the toy task, after format_prior: a base model that
    reads the digits of its prompt, as a pretrained one does. A quarter of each batch is the
    format prior's "a + b = n" (n drawn independently of a and b, so "+" stays unlearned: sampled,
    the base's answers to it are right about as often as a number from 0 to 18 drawn at random);
    the rest is drawn from two other tasks written in the same words: copying, "n =" -> n for n
    in 0..18, and one-digit subtraction, "a - b =" -> a - b for digits a >= b. No "+" prompt is
    ever paired with its sum: what a + b is stays for RL to find. Returns the last loss.

    Why a quarter: with half, the base learns to ignore the operands of "+" so firmly that a
    low-rank update cannot undo it; with none, it answers "+" as "-" and samples few sums.

    The same steps can end on a plateau where the model ignores its prompt (loss 1.1-1.3, copying
    at 0-30%): whether they do depends on how the CPU's kernels round (seed 1 does with AVX2
    kernels, not with AVX-512 ones). A base that does not copy and subtract (READS_PROMPT) is
    trained again from the format prior's weights on the next stream of examples, up to
    ARITH_ATTEMPTS times; the first attempt is the whole recipe, so a base that learns there is
    the same base as before the retry existed.
    """
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    prompt = lambda text: [tok.bos_token_id] + enc(text)
    answer = lambda n: enc(spell(n)) + [tok.eos_token_id]
    plus = [prompt(f"{a} + {b} =") for a in range(10) for b in range(10)]
    numbers = [answer(n) for n in range(MAX_SUM + 1)]
    copies = [(prompt(f"{spell(n)} ="), answer(n)) for n in range(MAX_SUM + 1)]
    differences = [(prompt(f"{a} - {b} ="), answer(a - b)) for a in range(10) for b in range(a + 1)]
    facts = copies + differences
    start = {k: v.clone() for k, v in model.state_dict().items()}
    for attempt in range(ARITH_ATTEMPTS):
        if attempt:
            model.load_state_dict(start)
        rng = random.Random(seed + 1000 * attempt + 1)
        with supervised(model, lr) as opt:
            for _ in range(steps):
                pairs = [(rng.choice(plus), rng.choice(numbers)) for _ in range(batch // 4)]
                pairs += [rng.choice(facts) for _ in range(batch - batch // 4)]
                loss = supervised_step(model, opt, pairs, tok.pad_token_id)
        reads = greedy_accuracy(model, copies), greedy_accuracy(model, differences)
        if min(reads) >= READS_PROMPT:
            break
    else:
        logging.getLogger(__name__).warning(
            "the arithmetic prior did not learn to read its prompt in %d attempts (greedy copying %.0f%%, "
            "subtraction %.0f%%; %.0f%% each expected): an adapter on this base is not expected to learn the sums",
            ARITH_ATTEMPTS, 100 * reads[0], 100 * reads[1], 100 * READS_PROMPT)
    return loss


def greedy_accuracy(model: PreTrainedModel, pairs: list[tuple[list[int], list[int]]]) -> float:
    """Share of (prompt ids, answer ids) pairs whose answer, eos included, the model writes greedily."""
    right = 0
    with torch.no_grad():
        for p, a in pairs:
            ids = torch.tensor([p])
            for _ in a:
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
            right += ids[0, len(p):].tolist() == a
    return right / len(pairs)


def tool_prior(model: PreTrainedModel, tok: PreTrainedTokenizerBase, steps: int, seed: int, call_rate: float = 0.1, batch: int = 64,
               lr: float = 3e-3) -> float:
    """Teach the tool kind's model how a calculator call and its use are written, not when to call:
    supervised steps on the calculator task's prompts ("4 7 + 3 8 =", data/toy_task.py), half of
    them answered by an episode, "<tool_call> 4 7 + 3 8 </tool_call> <eos>", the tool's reply
    "<tool_response> n </tool_response>" (context, not trained on), then "n <eos>", half by a number
    written straight away, then eos. The numbers (the reply's and the direct answers) are drawn
    independently of the question, 20 to 198: the model learns to copy the question into the call
    and the reply into its answer, and that a direct answer is a number, never which.

    Whether to call is the first token's choice; it is trained on in few enough of the episodes
    that the model, sampled, calls about call_rate of the time (and is then right about as often):
    calling every time is left to RL. Returns the last loss.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    share = 0.5  # of the examples, episodes with a call
    # The share of episodes whose first token (the call) is trained on: call_rate of all first tokens.
    decide = call_rate * (1 - share) / (share * (1 - call_rate))
    with supervised(model, lr) as opt:
        for _ in range(steps):
            seqs = []
            for _ in range(batch):
                a, b = rng.randint(*CALC_RANGE), rng.randint(*CALC_RANGE)
                n = rng.randint(2 * CALC_RANGE[0], 2 * CALC_RANGE[1])
                prompt = [tok.bos_token_id] + enc(calc_question(a, b))
                answer = enc(spell(n)) + [eos]
                if rng.random() < share:
                    call = enc(tool_call(f"{spell(a)} + {spell(b)}")) + [eos]
                    reply = enc(tool_response(spell(n)))
                    first = int(rng.random() < decide)
                    seqs.append((prompt + call + reply + answer, [0] * len(prompt) + [first] + [1] * (len(call) - 1)
                                 + [0] * len(reply) + [1] * len(answer)))
                else:
                    seqs.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
            loss = masked_step(model, opt, seqs, tok.pad_token_id)
    return loss


def save_atomic(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str, notes: dict[str, dict]) -> None:
    """Write model + tokenizer (+ small JSON notes) to a temporary folder, then rename it over
    out_dir: a crash mid-write never leaves a half model behind for the next run to load."""

    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    for name, data in notes.items():
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(data, f)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def build(out_dir: str, spec: TinySpec | None = None) -> str:
    """Write a tiny Qwen2 model + tokenizer to out_dir (HF format); return out_dir.

    Idempotent: an existing folder built from the same spec is reused.
    """

    hf_logging.disable_progress_bar()  # a progress bar on stderr for a 1 MB file is noise
    spec = spec or TinySpec()
    marker = os.path.join(out_dir, "tiny_spec.json")
    tok = build_tokenizer(spec)
    # The tokenizer's whole definition is part of the key: a folder built by a version of this
    # module with another vocabulary or decoder is rebuilt, never trained on.
    key = {**asdict(spec), "tokenizer": json.loads(tok.backend_tokenizer.to_str())}
    seed = spec.model_seed or spec.seed
    key["seed"] = seed  # the weights' seed: a pinned base is reused by runs of every seed
    for late in ("arith_steps", "model_seed"):
        if not key[late]:
            del key[late]  # the key of a folder built before the field existed: no rebuild
    if spec.arith_steps:
        key["reads_prompt"] = READS_PROMPT  # a base built before the prior was checked is built again
    if os.path.exists(marker) and json.loads(Path(marker).read_text()) == key:
        return out_dir
    # bpe: a multiple of 16 like real checkpoints. toy: exactly the tokenizer, so no probability
    # mass goes to ids that decode to nothing (the policy starts at 1/22 per token, not 1/32).
    vocab = len(tok) if spec.kind != "bpe" else ((len(tok) + 15) // 16) * 16
    # Here, not at the top: a run whose model is built already (most) skips a second of imports.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=spec.tie_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    if spec.kind == "toy" and spec.prior_steps:
        format_prior(model, tok, spec.prior_steps, seed)
    if spec.kind == "toy" and spec.arith_steps:
        arith_prior(model, tok, spec.arith_steps, seed)
    if spec.kind == "tool" and spec.prior_steps:
        tool_prior(model, tok, spec.prior_steps, seed)
    save_atomic(model, tok, out_dir, {"tiny_spec.json": key})
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    for f, v in asdict(TinySpec()).items():
        ap.add_argument(f"--{f.replace('_', '-')}", type=type(v) if not isinstance(v, bool) else int, default=v)
    a = vars(ap.parse_args())
    out = a.pop("out")
    fields: dict[str, Any] = {k: (bool(v) if k == "tie_embeddings" else v) for k, v in a.items()}
    spec = TinySpec(**fields)
    build(out, spec)
    print(f"saved {out} ({spec.kind}, hidden {spec.hidden}, {spec.layers} layers)")


if __name__ == "__main__":
    main()
