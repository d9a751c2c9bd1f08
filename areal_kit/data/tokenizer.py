"""The one way areal-kit loads and saves a checkpoint's tokenizer: exactly as it was saved.

transformers' AutoTokenizer picks the tokenizer class from the model type (every qwen2 model gets
Qwen2Tokenizer) and rebuilds that class's own pipeline from the vocabulary, whatever the saved
tokenizer.json says. For a checkpoint whose tokenizer is not that class's (the tiny models'
word-level vocabulary, a custom pre-tokenizer) the reloaded tokenizer then reads and writes text
differently from the one the model was built with: "7 3" comes back as "73". Where tokenizer.json
exists it is the whole pipeline, so it is loaded as is; special tokens and the chat template come
from tokenizer_config.json as usual. Checkpoints without one (sentencepiece-only) go through
AutoTokenizer. Saves copy the tokenizer's files byte for byte instead of re-serialising them.

    tok = load_tokenizer("/storage/models/Qwen2.5-1.5B")   # refuses one that cannot read itself
    copy_tokenizer_files(src_dir, dst_dir)
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING

from areal_kit.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Everything a tokenizer is made of in a Hugging Face folder (fast, slow and template files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "chat_template.jinja", "chat_template.json")

# Share of sampled vocabulary entries allowed to read back differently (e.g. a normalizer that
# rewrites a handful of non-NFC entries) before the tokenizer is refused.
MAX_BAD_SHARE = 0.01


def load_tokenizer(path: str, check: bool = True) -> PreTrainedTokenizerBase:
    """The tokenizer of the model folder `path`, as saved; with check, refused (UserError) when it
    does not read back text made of its own vocabulary."""
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
    if check:
        check_roundtrip(tok, path)
    return tok


def roundtrip_failures(tok: PreTrainedTokenizerBase, n: int = 256) -> tuple[int, int, tuple[str, str] | None]:
    """(failures, checked, first failure as (text, text read back)) over up to n vocabulary
    entries spread over the vocabulary, singly and in runs of three.

    Text is compared after a decode -> encode -> decode cycle, so a different but equivalent
    segmentation is not a failure. Entries that decode to nothing or to part of a UTF-8
    character (byte-level BPE pieces) are skipped: no text a person writes consists of them.
    """
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    step = max(1, len(ids) // n)
    pieces = [i for i in ids[::step][:n] if _readable(decode(tok, [i]))]
    cases = [[i] for i in pieces] + [pieces[k:k + 3] for k in range(0, len(pieces) - 2, 3)]
    bad, first = 0, None
    for case in cases:
        text = decode(tok, case)
        if not _readable(text):
            continue
        back = decode(tok, tok(text, add_special_tokens=False)["input_ids"])
        if back != text:
            bad += 1
            first = first or (text, back)
    return bad, len(cases), first


def check_roundtrip(tok: PreTrainedTokenizerBase, path: str) -> None:
    bad, n, first = roundtrip_failures(tok)
    if n and bad / n > MAX_BAD_SHARE and first is not None:  # bad > 0: first is the first failure
        text, back = first
        raise UserError(f"the tokenizer of {path} does not read back its own vocabulary: {text!r} is encoded "
                        f"and decoded as {back!r} ({bad} of {n} checks); expected a tokenizer.json that "
                        "round-trips (save it with the tokenizers library that built it)")


def copy_tokenizer_files(src: str, dst: str) -> list[str]:
    """Copy the tokenizer's files of model folder src into dst, unchanged; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        p = os.path.join(src, name)
        if os.path.isfile(p):
            shutil.copy2(p, os.path.join(dst, name))
            copied.append(name)
    if not copied:
        raise FileNotFoundError(f"no tokenizer files in {src}")
    return copied


def decode(tok: PreTrainedTokenizerBase, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """One sequence's text (transformers types decode as str | list[str]: a batch decodes to a list)."""
    text = tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str), "one sequence decodes to one text"
    return text


def _readable(text: str) -> bool:
    return bool(text.strip()) and "\ufffd" not in text
