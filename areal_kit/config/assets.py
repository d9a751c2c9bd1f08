"""What a run reads from shared storage and where it comes from: a preset's `assets` entries
(name -> {uri, dest, sha256}, checked by `asset`), and the sources a user names in place of a path
(`resolve`), as `load_config` applies them for `areal-kit train` and `areal-kit setup` alike.

A model setting (actor.path, ref.path) takes a folder, a hub id ORG/NAME (a local folder of that
name wins, as in transformers) or a URI; a data setting (dataset.path, dataset.id2info_path,
dataset.eval_path) a file or folder, or a URI (hf://datasets/ORG/NAME, https://..., file://...).
A URI or hub id becomes the storage path it is fetched to, STORAGE/models/NAME or
STORAGE/datasets/NAME, with an asset naming the source: the run reads that copy, on every node,
with no hub at run time; setup's data step (cluster/data.py) fetches it. A preset's asset applies
only while the path it fills is the preset's own: a path the user names drops it.

    resolve("/s", {"actor.path": "/s/models/A"}, {"actor.path": "Qwen/Qwen3-1.7B"},
            {"model": {"uri": "hf://o/A", "dest": "/s/models/A"}}, set())
    # paths {"actor.path": "/s/models/Qwen3-1.7B"}, add {"actor.path": {"uri": "hf://Qwen/Qwen3-1.7B", ...}},
    # dropped {"model": "model: hf://o/A dropped: actor.path names Qwen/Qwen3-1.7B, not the preset's /s/models/A"}
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass, field

from areal_kit.config.fields import check

ASSET_KEYS = ("uri", "dest", "sha256")
MODEL_KEYS = ("actor.path", "ref.path")
DATA_KEYS = ("dataset.path", "dataset.id2info_path", "dataset.eval_path")
PATH_KEYS = MODEL_KEYS + DATA_KEYS
# Sources fetched onto the storage; tiny:// is not among them: the run builds that model itself.
FETCHED = ("hf://", "https://", "http://", "file://", "toy://")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def asset(name: str, a: dict) -> dict:
    """One assets entry, checked: {uri, dest, sha256} with sha256 "" when not given."""
    where = f"assets.{name}"
    check(bool(re.fullmatch(r"[\w.-]+", str(name))), f"{where} is not a valid name; expected letters, digits, _ . -")
    check(isinstance(a, dict), f"{where}={a!r} is not valid; expected {{uri, dest, sha256}}")
    extra = sorted(set(a) - set(ASSET_KEYS))
    check(not extra, f"{where} has unknown key(s) {', '.join(extra)}; expected some of {', '.join(ASSET_KEYS)}")
    out = {"uri": str(a.get("uri") or ""), "dest": str(a.get("dest") or ""), "sha256": str(a.get("sha256") or "")}
    check("://" in out["uri"] or not out["uri"], f"{where}.uri={out['uri']!r} is not valid; expected a URI such "
          "as hf://ORG/NAME, or \"\" for a path you fill yourself")
    check(out["dest"].startswith("/"), f"{where}.dest={out['dest']!r} is not valid; expected an absolute path "
          "(the path the preset reads, e.g. ${actor.path})")
    check(not out["sha256"] or bool(re.fullmatch(r"[0-9a-f]{64}", out["sha256"])),
          f"{where}.sha256={out['sha256']!r} is not valid; expected 64 lowercase hex digits")
    return out


def source_of(key: str, value: object) -> str:
    """The URI a path setting names, "" for a path (or tiny://, built by the run): a URI as given,
    a model's hub id ORG/NAME as hf://ORG/NAME unless a folder of that name is here."""
    v = str(value or "")
    if v.startswith(FETCHED):
        return v
    if key in MODEL_KEYS and HUB_ID.fullmatch(v) and not os.path.isdir(v):
        return f"hf://{v}"
    return ""


def dest_for(storage: str, uri: str, key: str = "") -> str:
    """Where a source lands on the storage: STORAGE/models/NAME for a model (a model setting's, or
    else hf://ORG/NAME and tiny://), STORAGE/datasets/NAME for the rest (a file keeps its name)."""
    base = uri.partition("#")[0]
    parts = urllib.parse.urlsplit(base)
    name = parts.path.rstrip("/").rsplit("/", 1)[-1] or parts.netloc
    if base.startswith("tiny://"):
        name = f"tiny-{parts.netloc}"
    model = key in MODEL_KEYS if key else \
        base.startswith("tiny://") or (base.startswith("hf://") and not base.startswith("hf://datasets/"))
    return f"{storage.rstrip('/')}/{'models' if model else 'datasets'}/{name}"


@dataclass
class Resolved:
    paths: dict[str, str] = field(default_factory=dict)  # key -> the storage path its URI or hub id lands at
    add: dict[str, dict] = field(default_factory=dict)  # asset name (the key) -> {uri, dest}
    dropped: dict[str, str] = field(default_factory=dict)  # preset asset name -> the line saying why


def resolve(storage: str, own: dict[str, str], paths: dict[str, str], own_assets: dict[str, dict],
            named: set[str]) -> Resolved:
    """What the user's path settings change. own: each path key as the preset sets it (with the
    user's other overrides), paths: as the user's overrides leave it; own_assets: the preset's
    assets as its own paths resolve them; named: the assets the user's overrides touch (kept)."""
    out, paths = Resolved(), dict(paths)
    why = {key: f"{key} names {paths.get(key) or '(empty)'}, not the preset's {own.get(key)}" for key in PATH_KEYS}
    data, info = "dataset.path", "dataset.id2info_path"
    if paths.get(data) != own.get(data) and own.get(info) and paths.get(info) == own[info]:
        # The solutions belong to the prompts: the user's file's are inline or next to it, not the preset's.
        paths[info] = out.paths[info] = ""
        why[info] = f"{data} names {paths.get(data) or '(empty)'}, and {info} follows it (\"\": next to it)"
    for name, a in own_assets.items():
        if name in named or not a.get("uri"):
            continue
        for key in PATH_KEYS:
            if own.get(key) and own[key] == a.get("dest") and paths.get(key) != own[key]:
                out.dropped[name] = f"{name}: {a['uri']} dropped: {why[key]}"
                break
    for key in PATH_KEYS:
        uri = source_of(key, paths.get(key))
        if uri:
            out.paths[key] = dest_for(storage, uri, key)
            out.add[key] = {"uri": uri, "dest": out.paths[key]}
    return out
