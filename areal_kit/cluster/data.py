"""The data step: models and datasets onto shared storage, once, on the head host.

``--data URI`` lands in ``<storage>/models/<name>`` (hf:// model repos),
``<storage>/datasets/<name>`` (hf://datasets/...) or ``<storage>/data/<name>`` (https://,
file://). The work is done by areal_kit.cluster.fetch on the head, inside a throwaway
container of the runtime image (docker) or with the hosts' Python (host): check first,
fetch only what is missing or incomplete.
"""

from __future__ import annotations

import re
import shlex

from areal_kit.cluster.options import Cluster, q
from areal_kit.cluster.parallel import HostState, Outcome
from areal_kit.cluster.steps import must
from areal_kit.errors import UserError

SCHEMES = ("hf://", "https://", "http://", "file://")


def validate(uris: list[str]) -> None:
    for u in uris:
        base, _, frag = u.partition("#")
        if not base.startswith(SCHEMES) or len(base.split("://", 1)[1].strip("/")) == 0:
            raise UserError(f"--data: expected hf://org/name, hf://datasets/org/name, https://... or "
                            f"file:///path, got {u!r}")
        if frag and not re.fullmatch(r"sha256=[0-9a-f]{64}", frag):
            raise UserError(f"--data: fragment must be #sha256=<64 hex digits>, got #{frag}")


def dest_for(storage: str, uri: str) -> str:
    base = uri.partition("#")[0].rstrip("/")
    name = base.rsplit("/", 1)[-1]
    kind = "data"
    if base.startswith("hf://"):
        kind = "datasets" if base.startswith("hf://datasets/") else "models"
    return f"{storage.rstrip('/')}/{kind}/{name}"


def _fetch_cmd(c: Cluster, h: HostState, *args: str) -> str:
    o = c.opts
    py = [o.python, "-m", "areal_kit.cluster.fetch", *args]
    if o.runtime == "docker":
        run = ["docker", "run", "--rm", "--network", "host", *o.volume_args()]
        if c.secrets:
            run += ["--env-file", o.secrets_path(h.remote.user)]
        return q(*run, o.image, *py)
    pre = f"set -a; . {shlex.quote(o.secrets_path(h.remote.user))}; set +a; " if c.secrets else ""
    return pre + q(*py)


def data(c: Cluster, h: HostState) -> Outcome:
    o = c.opts
    if not o.data:
        return Outcome("skipped", "no --data")
    sudo = o.runtime == "docker"
    fetched, present = [], []
    for uri in o.data:
        dest = dest_for(o.storage, uri)
        if h.remote.run(_fetch_cmd(c, h, "--check", uri, dest), sudo=sudo, check=True, timeout=600).ok:
            present.append(dest)
            continue
        must(c, h, _fetch_cmd(c, h, uri, dest), f"fetching {uri}", sudo=sudo, timeout=6 * 3600)
        fetched.append(dest)
    if fetched:
        return Outcome("changed", f"fetched {', '.join(fetched)}" + (f"; present {len(present)}" if present else ""))
    return Outcome("ok", f"present: {', '.join(present)}")
