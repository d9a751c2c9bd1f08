"""Fetch the models and datasets of setup's data step onto shared storage, once, on the head.

Runs where the runtime's libraries are (a throwaway container of the runtime image, or the hosts'
Python): areal_kit/data/assets.py fetches, verifies and resumes; this module adds the sources
that need the hub client or torch, and the command line.

    python -m areal_kit.cluster.fetch URI DEST [--sha256 HEX] [--rows N] [--mirror URL]
    python -m areal_kit.cluster.fetch --check [--verify] URI DEST     # exit 0 when DEST is complete
    python -m areal_kit.cluster.fetch --plan JSON [--check] [--mirror URL]  # [{name, uri, dest, sha256, rows}]
    python -m areal_kit.cluster.fetch --export-tiny DIR   # tiny_storage's sources, laid out as a mirror

The sources added here: hf://ORG/NAME (a model repository) and hf://datasets/ORG/NAME, by the hub
client (HF_TOKEN for gated ones); tiny://toy[?seed=N&hidden=...], a tiny model built in place
(data/tiny_model.py); toy://sums/prompts.jsonl?n=N&seed=S and toy://sums/id2info.json?n=N&seed=S,
the toy task's prompts in AReaL's format, the same prompts in the same order as dataset.type=toy
with toy_size N and seed S (a row's `answer` is what the toy reward grades; id2info.json holds
it as the row's solution). With --mirror every source comes from the mirror; generated ones
are built here where the mirror lacks them. `--check` compares sizes (fast on multi-GB models),
`--verify` recomputes every sha256.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import urllib.parse
from pathlib import Path

from huggingface_hub import snapshot_download

from areal_kit.config.loader import load_config
from areal_kit.data.assets import GENERATED, SCHEMES, Asset, FetchError, check, mirror_url
from areal_kit.data.assets import fetch as fetch_asset
from areal_kit.data.tiny_model import TinySpec, build
from areal_kit.data.toy_task import toy_rows
from areal_kit.errors import ExitCode

TOY_FILES = ("prompts.jsonl", "id2info.json")
TINY_PRESET = "tiny_storage"  # the preset whose generated sources --export-tiny lays out


def tiny_spec(base: str) -> TinySpec:
    """tiny://toy?seed=1&hidden=128 -> its TinySpec (the seed as the training's: cfg.seed)."""
    url, _, query = base.partition("?")
    pairs = urllib.parse.parse_qsl(query)
    shape = "&".join(f"{k}={v}" for k, v in pairs if k != "seed")
    seeds = [v for k, v in pairs if k == "seed"]
    try:
        return TinySpec.from_url(url + (f"?{shape}" if shape else ""), int(seeds[-1]) if seeds else 0)
    except ValueError as e:
        raise FetchError(f"{base}: {e}") from None


def toy_file(base: str) -> str:
    """The text of toy://sums/prompts.jsonl?n=N&seed=S (AReaL rows) or toy://sums/id2info.json?..."""
    parts = urllib.parse.urlsplit(base)
    q = dict(urllib.parse.parse_qsl(parts.query))
    name = parts.path.strip("/")
    if parts.netloc != "sums" or name not in TOY_FILES or not q.get("n", "").isdigit() or \
            not q.get("seed", "").isdigit() or int(q["n"]) < 1:
        raise FetchError(f"{base}: expected toy://sums/prompts.jsonl?n=N&seed=S or toy://sums/id2info.json?n=N&seed=S")
    rows = toy_rows(int(q["n"]), seed=int(q["seed"]))
    if name == "id2info.json":
        return json.dumps({r["id"]: {"solutions": [r["answer"]]} for r in rows})
    return "".join(json.dumps({"prompt": r["question"], "query_id": r["id"], "task": "toy", "answer": r["answer"]})
                   + "\n" for r in rows)


def local_source(base: str, target: Path) -> int | None:
    """Fetch or build a source that needs this image's libraries into target (a folder or a file)."""
    scheme, rest = base.split("://", 1)
    if scheme == "hf":
        kind, repo = ("dataset", rest.removeprefix("datasets/")) if rest.startswith("datasets/") else ("model", rest)
        try:
            snapshot_download(repo.strip("/"), repo_type=kind, local_dir=str(target), token=os.environ.get("HF_TOKEN"))
        except Exception as e:  # noqa: BLE001 - the hub client raises many types; the data step shows one line
            raise FetchError(f"{base}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        return None
    if scheme == "tiny":
        build(str(target), tiny_spec(base))
        return None
    if scheme == "toy":
        target.write_text(toy_file(base))
        return target.stat().st_size
    raise FetchError(f"{base}: unsupported URI scheme; expected one of {', '.join(SCHEMES)}")


def fetch(a: Asset, mirror: str = "") -> str:
    return fetch_asset(a, mirror, local_source)


def run_plan(items: list[Asset], mirror: str = "", check_only: bool = False, verify: bool = False) -> int:
    """A line per asset (present / missing / fetched / failed); 1 when any is missing or failed."""
    bad = 0
    for a in items:
        if check_only:
            ok, why = check(a, verify)
            print(f"{'present' if ok else 'missing'} {a.name} {why}", flush=True)
            bad += not ok
            continue
        try:
            print(fetch(a, mirror), flush=True)
        except (FetchError, OSError) as e:
            print(f"failed {a.name}: {str(e).removeprefix(f'{a.name}: ')}", flush=True)
            bad += 1
    return ExitCode.FAILED if bad else ExitCode.OK


def export_tiny(root: Path) -> list[str]:
    """tiny_storage's generated sources under root, at the paths a mirror serves them from."""
    lines = []
    for name, spec in load_config(TINY_PRESET).assets.items():
        if spec["uri"].startswith(GENERATED):
            rel = mirror_url(spec["uri"], "mirror").removeprefix("mirror/")
            lines.append(fetch(Asset(name, spec["uri"], str(root / rel))))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("uri", nargs="?")
    ap.add_argument("dest", nargs="?", type=Path)
    ap.add_argument("--sha256", default="", help="expected sha256 of a single-file URI")
    ap.add_argument("--rows", type=int, default=0, help="expected non-empty lines of a single-file URI")
    ap.add_argument("--mirror", default=os.environ.get("AREAL_KIT_MIRROR", ""),
                    help="fetch every source from this mirror, laid out as its origin (default $AREAL_KIT_MIRROR)")
    ap.add_argument("--check", action="store_true", help="only report whether each dest is complete")
    ap.add_argument("--verify", action="store_true", help="with --check: recompute checksums")
    ap.add_argument("--plan", help="JSON list of {name, uri, dest[, sha256, rows]} (setup's data step)")
    ap.add_argument("--export-tiny", type=Path, metavar="DIR", help=f"write {TINY_PRESET}'s generated sources "
                    "into DIR, laid out as a mirror serves them")
    a = ap.parse_args(argv)
    if a.export_tiny:
        print("\n".join(export_tiny(a.export_tiny)))
        return ExitCode.OK
    if a.plan:
        fields = {f.name for f in dataclasses.fields(Asset)}
        items = [Asset(**{k: v for k, v in x.items() if k in fields}) for x in json.loads(a.plan)]
    elif a.uri and a.dest:
        items = [Asset(a.dest.name, a.uri, str(a.dest), a.sha256, a.rows)]
    else:
        ap.error("expected URI DEST, --plan JSON or --export-tiny DIR")
    return run_plan(items, a.mirror, a.check, a.verify)


if __name__ == "__main__":
    sys.exit(main())
