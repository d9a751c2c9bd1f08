"""The prompts a run trains on (the guide's dataset.*): one source (path, type) or a weighted mix
of several, the batch size, and the held-out eval split. data/sources.py reads them."""

# opt() returns dataclasses.field(...), with a fresh default per instance where it is mutable;
# ruff's RUF009 knows only field() itself by name.
# ruff: noqa: RUF009

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

from areal_kit.config.fields import check, check_choice, check_choices, check_positive, opt


@dataclass
class DatasetConfig:
    path: str = opt("", 'Dataset: a jsonl file, a HF datasets folder, or "" for the built-in toy task.')
    type: str = opt("toy", "Format: toy | areal (prompt + query_id, with id2info.json) | jsonl | hf.",
        choices=("toy", "areal", "jsonl", "hf"))
    id2info_path: str = opt("", 'areal format: id2info.json ("" = next to path).')
    question_field: str = opt("question", "jsonl/hf: field holding the question.")
    answer_field: str = opt("answer", "jsonl/hf: field holding the reference answer.")
    mix: list[dict] = opt([],
        "Several training sources instead of path/type: [{path, type, weight, name}, ...] (other keys: "
        "id2info_path, question_field, answer_field; unset ones come from dataset.*). Training takes "
        "weight x a source's rows (0.5: a seeded half of them, 2: every row twice), shuffled together by seed; "
        "rows keep their source's name, and each source's task reward is logged (task_reward/NAME).")
    train_bs_n_seqs: int = opt(1024,
        "Prompts per training step (the batch is train_bs_n_seqs x ppo.group_size sequences).")
    max_prompt_len: int = opt(2048, "Prompts longer than this (tokens) are dropped and counted, never truncated.")
    apply_chat_template: bool = opt(False, "Apply the tokenizer's chat template to prompts.")
    toy_size: int = opt(4096, "Toy task only: number of generated prompts.")
    toy_task: str = opt("sums", "Toy task only: sums (\"3 + 4 =\", one digit each) | calc (two digits each: "
        "the calculator tool's task, agents/calculator.py).", choices=("sums", "calc"))
    shuffle: bool = opt(True, "Shuffle the prompt order each epoch (seeded).")
    eval_path: str = opt("",
        'In-training eval split: a file/folder of the same type and fields ("" = hold out '
        "eval_size prompts of the training data instead; they are then never trained on).")
    eval_size: int = opt(0,
        "Prompts in the eval split: the first N of eval_path (0 = all), or N held out of the "
        'training data when eval_path is "".')

    def __post_init__(self) -> None:
        check_choices(self, "dataset.")
        check(not (self.mix and self.path), f"dataset.path={self.path!r} and dataset.mix are both set; expected "
              "one of them (put the path in the mix)")
        self.mix = [_mix_source(i, m, self) for i, m in enumerate(self.mix)]
        names = [m["name"] for m in self.mix]
        check(len(set(names)) == len(names), f"dataset.mix names {names} are not unique; expected a distinct "
              "name per source (give each a name:)")
        check(self.type == "toy" or bool(self.path) or bool(self.mix),
              f"dataset.path is empty for dataset.type={self.type}; expected a file or folder")
        check_positive("dataset.train_bs_n_seqs", self.train_bs_n_seqs)
        check_positive("dataset.max_prompt_len", self.max_prompt_len)
        check_positive("dataset.toy_size", self.toy_size)
        check_positive("dataset.eval_size", self.eval_size, allow_zero=True)


MIX_KEYS = ("path", "type", "weight", "name", "id2info_path", "question_field", "answer_field")


def _mix_source(i: int, m: dict, d: DatasetConfig) -> dict:
    """One dataset.mix entry, checked, with what it leaves unset taken from dataset.*."""
    where = f"dataset.mix[{i}]"
    check(isinstance(m, dict), f"{where}={m!r} is not valid; expected {{path, type, weight, name}}")
    extra = sorted(set(m) - set(MIX_KEYS))
    check(not extra, f"{where} has unknown key(s) {', '.join(extra)}; expected some of {', '.join(MIX_KEYS)}")
    out = {k: m.get(k, getattr(d, k, None)) for k in MIX_KEYS if k not in ("weight", "name")}
    types = next(f for f in dataclasses.fields(DatasetConfig) if f.name == "type").metadata["choices"]
    check_choice(f"{where}.type", out["type"], types)
    check(out["type"] == "toy" or bool(out["path"]), f"{where} has no path for type {out['type']}; expected a file "
          "or folder")
    w = m.get("weight", 1.0)
    check(isinstance(w, (int, float)) and w > 0, f"{where}.weight={w!r} is not valid; expected a number > 0")
    stem = os.path.splitext(os.path.basename(str(out["path"]).rstrip("/")))[0]
    name = str(m.get("name") or stem or out["type"])
    check(bool(re.fullmatch(r"[\w.-]+", name)), f"{where}.name={name!r} is not valid; expected letters, digits, _ . -")
    return {**out, "weight": float(w), "name": name}
