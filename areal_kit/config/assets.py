"""A preset's `assets` entries, checked: what the run reads from shared storage, name ->
{uri, dest, sha256}, as `areal-kit setup --train_param PRESET` fetches them (data/assets.py)."""

from __future__ import annotations

import re

from areal_kit.config.fields import check

ASSET_KEYS = ("uri", "dest", "sha256")


def asset(name: str, a) -> dict:
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
