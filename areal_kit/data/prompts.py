"""Prompt datasets for training, and a loader whose position can be saved and restored.

A dataset is a list of rows, each with an `id`, the prompt's token ids and whatever its reward
function needs (answer, solutions). `PromptLoader` walks it in a seeded, per-epoch shuffled order
and remembers (epoch, position, ids used this epoch), so a resumed run neither repeats nor
skips a prompt.

`run_prompts` makes a run's prompts in one pass, every problem a UserError before any worker
starts: the sources read (data/sources.py, or the toy task), the eval split held out, the mix
weighed, each row checked for what its verifier reads, then tokenized and put in the loader.
`read_rows` is its first half, what the dry-run plan counts without the model's tokenizer.

    from areal_kit.config.loader import load_config
    prompts = run_prompts(load_config("tiny"), MODEL_DIR)   # .loader, .eval_rows, .n_dropped, .tokenizer
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING

from areal_kit.data import sources
from areal_kit.data.tokenizer import load_tokenizer
from areal_kit.data.toy_task import calc_rows, toy_rows
from areal_kit.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from areal_kit.config.dataset import DatasetConfig
    from areal_kit.config.schema import TrainConfig

# What each built-in reward reads from a dataset row.
REWARD_FIELDS = {"toy": ("answer",), "calc": ("answer",), "math": ("answer", "solutions"), "gsm8k": ("answer",)}


@dataclass(frozen=True)
class RunPrompts:
    """What a run trains and evaluates on."""

    loader: PromptLoader  # the training rows, tokenized
    eval_rows: list[dict]  # the in-training eval split, tokenized (rl/driver/validation.py)
    n_dropped: int  # training prompts left out: longer than dataset.max_prompt_len
    tokenizer: PreTrainedTokenizerBase  # the model's, as load_tokenizer gives it


def run_prompts(cfg: TrainConfig, model_path: str) -> RunPrompts:
    """cfg's prompts, tokenized with the tokenizer of the model folder model_path (refused, in one
    line, when it cannot read itself), and the loader over them."""
    rows, eval_rows = read_rows(cfg)
    tok = load_tokenizer(model_path)
    d = cfg.dataset
    rows, dropped = tokenize_rows(rows, tok, d.max_prompt_len, d.apply_chat_template, d.question_field)
    if eval_rows:
        eval_rows, _ = tokenize_rows(eval_rows, tok, d.max_prompt_len, d.apply_chat_template, d.question_field)
    return RunPrompts(PromptLoader(rows, d.train_bs_n_seqs, seed=cfg.seed, shuffle=d.shuffle), eval_rows, dropped, tok)


def read_rows(cfg: TrainConfig) -> tuple[list[dict], list[dict]]:
    """(training rows, eval rows) of cfg, before tokenization: the sources read, the eval split
    held out (sources.split_eval), the mix weighed, and every row checked against cfg's rewards."""
    rows, eval_rows = sources.split_eval(load_rows(cfg.dataset, cfg.seed), cfg.dataset, cfg.seed)
    rows = mix_rows(rows, cfg.dataset.mix, cfg.seed)
    check_rows(rows + eval_rows, cfg.ppo.reward_fns)
    return rows, eval_rows


def load_rows(d: DatasetConfig, seed: int) -> list[dict]:
    """Rows of the dataset section d, before tokenization (seed: the run's, for generated rows);
    with dataset.mix, every source's rows, each tagged with its source's name (`source`, and the
    id's prefix) and not yet weighed (see mix_rows)."""
    if not d.mix:
        return _rows_of(d, seed)
    out = []
    for m, src in zip(d.mix, _sources(d)):
        out += [{**r, "id": f"{m['name']}/{r['id']}", "source": m["name"]} for r in _rows_of(src, seed)]
    return out


def _sources(d: DatasetConfig) -> list[sources.Source]:
    """The datasets d reads: each dataset.mix entry over d's own settings, or d alone."""
    return [SimpleNamespace(**{**vars(d), **m}) for m in d.mix] or [d]


def check_sources(d: DatasetConfig) -> None:
    """The files the dataset section d reads (every dataset.mix source's, and dataset.eval_path) are
    there: load's UserError for the first that is not, told from the settings alone, before anything is read."""
    for src in _sources(d):
        if src.type != "toy":
            sources.check_path(src)
    if d.eval_path:
        sources.check_path(d, d.eval_path)


def _rows_of(d: sources.Source, seed: int) -> list[dict]:
    if d.type != "toy":
        return sources.load(d)
    return (calc_rows if d.toy_task == "calc" else toy_rows)(d.toy_size, seed=seed)


def mix_rows(rows: list[dict], mix: list[dict], seed: int) -> list[dict]:
    """The training rows of a dataset.mix: weight x each source's rows (a seeded subset for the
    fraction, every row again per whole unit; a copy gets the id suffix #2, #3, ...). The
    PromptLoader shuffles them together, so the mix is a pure function of (rows, mix, seed) and a
    recover checkpoint's loader position resumes it exactly."""
    if not mix:
        return rows
    out = []
    for m in mix:
        own = [r for r in rows if r.get("source") == m["name"]]
        whole, frac = divmod(m["weight"], 1.0)
        rng = random.Random(f"{seed}/{m['name']}")  # a str seed hashes stably (sha512), unlike hash()
        part = sorted(rng.sample(range(len(own)), round(frac * len(own))))
        for copy in range(int(whole)):
            out += [r if copy == 0 else {**r, "id": f"{r['id']}#{copy + 1}"} for r in own]
        out += [own[i] if not whole else {**own[i], "id": f"{own[i]['id']}#{int(whole) + 1}"} for i in part]
        if not own or (not whole and not part):
            raise UserError(f"dataset.mix source {m['name']!r} gives no training rows (weight {m['weight']:g} of "
                            f"{len(own)}); expected a larger weight or more rows")
    return out


def check_rows(rows: list[dict], reward_fns: list[str]) -> None:
    """Fail before any actor starts when a row lacks what its verifier needs."""
    for name in reward_fns:
        need = REWARD_FIELDS.get(name)
        if not need:
            continue
        for row in rows:
            if not any(row.get(f) not in (None, "", []) for f in need):
                raise UserError(f"dataset row {row.get('id', '?')!r} has no {' or '.join(need)} field, which "
                                f"reward {name!r} needs; expected every row to carry the reference answer")


def tokenize_rows(rows: list[dict], tokenizer: PreTrainedTokenizerBase, max_prompt_len: int, apply_chat_template: bool = False,
                  question_field: str = "question") -> tuple[list[dict], int]:
    """Add prompt_ids (bos + tokens) to each row; drop, and count, prompts over max_prompt_len."""
    kept, dropped = [], 0
    for row in rows:
        text = row.get("prompt") or row.get(question_field)
        if not isinstance(text, str) or not text:
            raise UserError(f"dataset row {row.get('id', '?')!r} has no {question_field!r} or 'prompt' text; "
                            "expected every row to carry the question")
        if apply_chat_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            # AReaL's prompts come chat-formatted, bos text included: never a second bos.
            has_bos = bool(tokenizer.bos_token) and text.startswith(tokenizer.bos_token)
            if tokenizer.bos_token_id is not None and not has_bos:
                ids = [tokenizer.bos_token_id] + ids
        if len(ids) > max_prompt_len:
            dropped += 1
            continue
        kept.append({**row, "prompt_text": text, "prompt_ids": list(ids)})
    if not kept:
        raise UserError(f"every prompt is longer than dataset.max_prompt_len={max_prompt_len}; "
                        "expected a larger max_prompt_len")
    return kept, dropped


@dataclass
class PromptLoader:
    rows: list[dict]
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    position: int = 0
    used_ids: list[str] = field(default_factory=list)
    # The last epoch's order: a batch is a slice of it, not a new shuffle of the whole dataset.
    _order_cache: tuple[int, list[int]] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.batch_size > len(self.rows):
            raise UserError(f"dataset.train_bs_n_seqs={self.batch_size} is larger than the dataset "
                            f"({len(self.rows)} prompts); expected <= {len(self.rows)}")

    @property
    def steps_per_epoch(self) -> int:
        return len(self.rows) // self.batch_size  # the last partial batch is dropped

    def _order(self, epoch: int) -> list[int]:
        if self._order_cache is None or self._order_cache[0] != epoch:
            idx = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed * 1000003 + epoch).shuffle(idx)
            self._order_cache = (epoch, idx)
        return self._order_cache[1]

    def next_batch(self) -> tuple[int, int, list[dict]]:
        """(epoch, step within epoch, rows); rolls over to the next epoch when one ends."""
        if self.position >= self.steps_per_epoch:
            self.epoch += 1
            self.position = 0
            self.used_ids = []
        order = self._order(self.epoch)
        start = self.position * self.batch_size
        batch = [self.rows[i] for i in order[start:start + self.batch_size]]
        step = self.position
        self.position += 1
        self.used_ids.extend(r["id"] for r in batch)
        return self.epoch, step, batch

    def batch_at(self, index: int) -> tuple[int, int, list[dict]]:
        """What next_batch gave (or will give) as batch `index` of the run, without moving the loader."""
        epoch, step = divmod(index, self.steps_per_epoch)
        order = self._order(epoch)
        return epoch, step, [self.rows[i] for i in order[step * self.batch_size:(step + 1) * self.batch_size]]

    def state_at(self, global_step: int) -> dict:
        """The state after `global_step` batches were taken (what state_dict() would say then).

        Recover checkpoints use it: with max_head_offpolicyness > 0 the loader runs ahead of
        training, so the position to save is the trained step's, and the order is a pure
        function of (seed, epoch), so it can be recomputed.
        """
        spe = self.steps_per_epoch
        # The loader rolls over lazily (on the next call), so the end of an epoch is position spe.
        epoch, position = divmod(global_step, spe)
        if global_step > 0 and position == 0:
            epoch, position = epoch - 1, spe
        order = self._order(epoch)
        used = [self.rows[i]["id"] for i in order[:position * self.batch_size]]
        return {"epoch": epoch, "position": position, "used_ids": used, "n_rows": len(self.rows),
                "seed": self.seed}

    def seek(self, global_step: int) -> None:
        """Continue as if exactly `global_step` batches had been taken."""
        self.load_state_dict(self.state_at(global_step))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "used_ids": list(self.used_ids),
                "n_rows": len(self.rows), "seed": self.seed}

    def load_state_dict(self, s: dict) -> None:
        if s["n_rows"] != len(self.rows):
            raise UserError(f"the recover checkpoint's dataset had {s['n_rows']} prompts, this run has "
                            f"{len(self.rows)}; the checkpoint is kept as it is: use the same dataset, or --fresh to "
                            "start over (it sets the checkpoint aside, deleting nothing)")
        self.epoch, self.position, self.used_ids = s["epoch"], s["position"], list(s["used_ids"])
