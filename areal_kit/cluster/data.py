"""The data step: what training and eval read, onto shared storage, once, on the head host.

What it fetches (`plan`): each `--data URI[=DEST]`, and with `--train_param PRESET` the assets of
the preset as the run loads it (config/assets.py: the preset's own, name -> {uri, dest, sha256},
each dest the path the preset reads, less those whose path a --train-arg names; and each hub id
or URI a --train-arg names as a model or data path, at its storage path) and, with them, the
eval sets of evaluation/manifest.yaml into STORAGE/datasets/eval (eval/data.py `eval_sets_dir`,
where `areal-kit eval` reads them). An eval set that cannot be fetched is a warning, not a
failure: training never reads one, and `areal-kit eval` fetches it on first use. `--data`
without DEST lands a file as a file at STORAGE/datasets/<file name>, a hub model at
STORAGE/models/<name>, a hub dataset or another folder at STORAGE/datasets/<name>. With `--mirror URL` every source comes from the mirror, laid
out as its origin (data/assets.py `mirror_url`).

`python -m areal_kit.cluster.fetch --plan JSON` does the work on the head, in a throwaway
container of the runtime image (docker) or with the hosts' Python (host): a check first, then a
fetch of what is missing or incomplete, each verified and resumable.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from typing import TYPE_CHECKING

from areal_kit.cluster.context import Cluster, HostState, Outcome
from areal_kit.cluster.options import SetupOptions, q
from areal_kit.cluster.steps import fail
from areal_kit.config.assets import PATH_KEYS, dest_for
from areal_kit.config.loader import load_resolved
from areal_kit.data.assets import SCHEMES, Asset, is_folder, mirror_url
from areal_kit.errors import UserError
from areal_kit.eval.data import eval_set_assets, eval_sets_dir

if TYPE_CHECKING:
    from areal_kit.config.schema import TrainConfig

EVAL = "eval/"  # the eval sets' asset names (eval/data.py eval_set_assets)


def validate(uri: str, what: str) -> None:
    """A source URI setup can fetch, with at most a #sha256=HEX fragment; what names the option."""
    base, _, frag = uri.partition("#")
    if not base.startswith(SCHEMES) or not base.split("://", 1)[1].strip("/"):
        raise UserError(f"{what}: expected hf://org/name, hf://datasets/org/name, https://..., file:///path, "
                        f"tiny://toy or toy://sums/FILE, got {uri!r}")
    if frag and not re.fullmatch(r"sha256=[0-9a-f]{64}", frag):
        raise UserError(f"{what}: fragment must be #sha256=<64 hex digits>, got #{frag}")


def split_data(spec: str) -> tuple[str, str]:
    """"URI=DEST" -> (URI, DEST) when DEST is an absolute path; "URI" -> (URI, "")."""
    uri, sep, dest = spec.rpartition("=")
    return (uri, dest) if sep and dest.startswith("/") else (spec, "")


def preset_sources(opts: SetupOptions) -> tuple[TrainConfig, list[str]]:
    """(the preset's config as its assets are fetched, a line per preset asset a --train-arg dropped):
    under the storage setup provides, unless a --train-arg says otherwise (it comes later, so it
    wins); a cluster spec is the head's file, and the assets do not depend on it."""
    assert opts.train_param, "setup was given a preset"
    args = [a for a in opts.train_args if a.split("=", 1)[0].strip() != "cluster"]
    return load_resolved(opts.train_param, [f"storage_root={opts.storage}", *args])


def plan(opts: SetupOptions, mirror: str = "", cfg: TrainConfig | None = None) -> list[Asset]:
    """Every source the data step fetches, checked (a UserError before any host is touched). cfg: the
    preset's config as the run loads it, where the caller has it already (setup loads it first)."""
    if mirror and not mirror.startswith(("http://", "https://", "file://")):
        raise UserError(f"--mirror: expected http://HOST[:PORT][/PATH] (or file:///PATH), got {mirror!r}")
    out = []
    for spec in opts.data:
        uri, dest = split_data(spec)
        validate(uri, "--data")
        shared = [opts.storage, *(m.split(":")[1 if ":" in m else 0] for m in opts.mounts)]
        if dest and not any(dest.startswith(d.rstrip("/") + "/") for d in shared):
            raise UserError(f"--data {spec}: {dest} is outside the shared storage {opts.storage} (and every "
                            "--mount); expected a DEST under it")
        dest = dest or dest_for(opts.storage, uri)
        out.append(Asset(f"data:{dest.rstrip('/').rsplit('/', 1)[-1]}", uri, dest))
    if opts.train_param:
        if cfg is None:
            cfg = preset_sources(opts)[0]
        wanted = {name: entry for name, entry in cfg.assets.items() if entry["uri"]}
        for name, entry in wanted.items():
            validate(entry["uri"], name if name in PATH_KEYS else f"{opts.train_param} assets.{name}.uri")
            out.append(Asset(name, entry["uri"], entry["dest"], entry["sha256"]))
        if wanted:
            out += eval_set_assets(eval_sets_dir(cfg.storage_root))
    seen: dict[str, Asset] = {}
    for a in out:
        other = seen.setdefault(a.dest.rstrip("/"), a)
        if other.base != a.base:
            raise UserError(f"{a.name} and {other.name} both land at {a.dest} ({a.base}, {other.base}); "
                            "expected one source per destination (give --data URI=DEST)")
    return [a for a in out if seen[a.dest.rstrip("/")] is a]


def _fetch_cmd(c: Cluster, h: HostState, *args: str) -> str:
    o = c.opts
    py = [o.python, "-m", "areal_kit.cluster.fetch", *args]
    if o.runtime == "docker":
        run = ["docker", "run", "--rm", "--network", "host", *o.volume_args()]
        if c.secrets:
            run += ["--env-file", o.secrets_path(h.remote.user)]
        return q(*run, c.image, *py)
    pre = f"set -a; . {shlex.quote(o.secrets_path(h.remote.user))}; set +a; " if c.secrets else ""
    return pre + q(*py)


def data(c: Cluster, h: HostState, assets: list[Asset], mirror: str = "") -> Outcome:
    dropped = preset_sources(c.opts)[1] if c.opts.train_param else []
    if c.opts.dry_run:  # a line per source, readable beside the command that fetches them all
        for line in dropped:
            h.dry.commands.append(("fetch", line))
        for a in assets:
            kind = {True: "folder", False: "file", None: "file or folder"}[is_folder(a.uri)]
            h.dry.commands.append(("fetch", f"{a.name}: {mirror_url(a.uri, mirror)} -> {a.dest} ({kind})"))
    mine = f"; not the preset's {', '.join(d.split(':', 1)[0] for d in dropped)} (a path you named)" if dropped else ""
    if not assets:
        return Outcome("skipped", "nothing to fetch (no --data, and the preset declares no assets)" + mine)
    sudo = c.opts.runtime == "docker"
    items = [{k: v for k, v in dataclasses.asdict(a).items() if v} for a in assets]
    args = ["--plan", json.dumps(items), *(["--mirror", mirror] if mirror else [])]
    names = ", ".join(a.name for a in assets)
    if h.remote.run(_fetch_cmd(c, h, *args, "--check"), sudo=sudo, check=True, timeout=600).ok:
        return Outcome("ok", f"present: {names}{mine}")
    res = h.remote.run(_fetch_cmd(c, h, *args), sudo=sudo, timeout=6 * 3600)
    said = [line.split(maxsplit=2) for line in res.stdout.splitlines()]
    failed = [(w[1].rstrip(":"), " ".join(w[1:])) for w in said if len(w) > 1 and w[0] == "failed"]
    needed = [why for name, why in failed if not name.startswith(EVAL)]
    if not res.ok and (needed or not failed):  # an eval set alone never stops training: it reads none
        fail(c, f"fetching failed: {needed[0] if needed else f'exit {res.rc}'}"
                + (f" (and {len(needed) - 1} more)" if len(needed) > 1 else ""), res)
    warn = ""
    if failed:
        warn = (f"; warning: eval set(s) not fetched ({failed[0][1]}"
                + (f", and {len(failed) - 1} more" if len(failed) > 1 else "")
                + "): training goes on, `areal-kit eval` fetches them on first use")
    fetched = [w[1] for w in said if len(w) > 1 and w[0] == "fetched"]
    present = [w[1] for w in said if len(w) > 1 and w[0] == "present"]
    if fetched:
        return Outcome("changed", f"fetched {', '.join(fetched)}" + (f"; present {len(present)}" if present else "")
                       + mine + warn)
    return Outcome("ok", f"present: {', '.join(present) or names}{mine}{warn}")
