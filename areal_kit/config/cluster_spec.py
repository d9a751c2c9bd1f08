"""Cluster spec (the AReaL guide's JSON) and host inventory (YAML): loading and validation.

The guide describes a cluster with a small JSON file::

    {"cluster_type": "local", "cluster_name": "local", "fileroot": "/storage/ray/experiments",
     "default_mount": "/storage:/storage", "n_gpus_per_node": 8}

areal-kit adds the hosts: either inline (``"hosts": [...]``) or in a YAML inventory the JSON
names (``"inventory": "hosts.yaml"``, relative to the JSON file), or a YAML inventory alone::

    cluster_name: my-cluster          # optional, default "areal"
    storage: /storage                 # shared storage path, the same on every host
    n_gpus_per_node: 8                # optional
    defaults: {user: root, port: 22, key_file: ~/.ssh/id_ed25519}
    hosts:
      - 10.0.0.1                      # a bare hostname takes the defaults
      - {hostname: 10.0.0.2, port: 2222}
    env:                              # optional: NCCL / gloo settings for every Ray container
      NCCL_IB_HCA: mlx5
      NCCL_SOCKET_IFNAME: eth0

The first host is the head. ``load_cluster_spec(path)`` reads either form and returns a
ClusterSpec; every malformed file raises UserError naming the file and the field.
Try it: ``python -m areal_kit.config.cluster_spec cluster_specs/local_3node.json``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from areal_kit.errors import UserError

CLUSTER_TYPES = ("local", "ray", "slurm")
DEFAULT_STORAGE = "/storage"
# The cluster spec's `env` is for the collective libraries' settings, which depend on the cluster's
# network (NICs, InfiniBand HCAs, interfaces); other variables go through `areal-kit setup --env`.
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "UCX_", "TORCH_DISTRIBUTED_")


@dataclass
class HostSpec:
    """One SSH-reachable node."""

    hostname: str  # name, ~/.ssh/config alias or address the controller connects to (first host = Ray head)
    user: str | None = None  # SSH login user (None: ~/.ssh/config's User, else root); non-root needs sudo
    port: int | None = None  # SSH port (None: ~/.ssh/config's Port, else 22)
    key_file: str | None = None  # private key path (None: ~/.ssh/config's IdentityFile, ssh-agent, defaults)

    def __post_init__(self) -> None:
        if not isinstance(self.hostname, str) or not self.hostname.strip():
            raise UserError(f"hosts: hostname must be a non-empty string, got {self.hostname!r}")
        # A hostname is passed to the network stack, never to a shell unquoted; still refuse
        # whitespace and control characters, which are always a typo.
        if any(c.isspace() or ord(c) < 32 for c in self.hostname):
            raise UserError(f"hosts: hostname {self.hostname!r} contains whitespace; expected a name or address")
        if self.user is not None and (not isinstance(self.user, str) or not self.user
                                      or any(c.isspace() for c in self.user)):
            raise UserError(f"hosts[{self.hostname}].user: expected a login name, got {self.user!r}")
        if self.port is not None and (isinstance(self.port, bool) or not isinstance(self.port, int)
                                      or not 0 < self.port < 65536):
            raise UserError(f"hosts[{self.hostname}].port: expected an integer 1-65535, got {self.port!r}")
        if self.key_file is not None:
            if not isinstance(self.key_file, str) or not self.key_file:
                raise UserError(f"hosts[{self.hostname}].key_file: expected a path, got {self.key_file!r}")
            self.key_file = os.path.expanduser(self.key_file)

    @property
    def label(self) -> str:
        return self.hostname if self.port in (None, 22) else f"{self.hostname}:{self.port}"


@dataclass
class ClusterSpec:
    """The cluster a training run or a setup targets."""

    cluster_name: str = "areal"  # names Ray containers, state and log folders
    cluster_type: str = "local"  # the guide's field; "local" = hosts we provision ourselves
    fileroot: str = ""  # logs, recover files, checkpoints (default: <storage>/ray/experiments)
    default_mount: str = ""  # "SRC:DST" mounted into every container (default: storage:storage)
    n_gpus_per_node: int = 0  # GPUs per node (0 on CPU clusters)
    n_nodes: int = 0  # number of nodes; 0 = len(hosts); must equal len(hosts) when both given
    storage: str = DEFAULT_STORAGE  # shared storage path, identical on every host
    hosts: list[HostSpec] = field(default_factory=list)  # first = head
    env: dict[str, str] = field(default_factory=dict)  # NCCL_* / GLOO_* / ... for every Ray process

    def __post_init__(self) -> None:
        if not isinstance(self.cluster_name, str) or not self.cluster_name or not all(
            c.isalnum() or c in "-_." for c in self.cluster_name
        ):
            raise UserError(f"cluster_name: expected letters, digits, '-', '_' or '.', got {self.cluster_name!r}")
        if self.cluster_type not in CLUSTER_TYPES:
            raise UserError(f"cluster_type: expected one of {', '.join(CLUSTER_TYPES)}, got {self.cluster_type!r}")
        if not isinstance(self.storage, str) or not self.storage.startswith("/"):
            raise UserError(f"storage: expected an absolute path, got {self.storage!r}")
        if not self.fileroot:
            self.fileroot = f"{self.storage.rstrip('/')}/ray/experiments"
        if not isinstance(self.fileroot, str) or not self.fileroot.startswith("/"):
            raise UserError(f"fileroot: expected an absolute path, got {self.fileroot!r}")
        if not self.default_mount:
            self.default_mount = f"{self.storage}:{self.storage}"
        parts = self.default_mount.split(":") if isinstance(self.default_mount, str) else []
        if len(parts) not in (2, 3) or not all(p.startswith("/") for p in parts[:2]):
            raise UserError(f"default_mount: expected 'SRC:DST' with absolute paths, got {self.default_mount!r}")
        for name in ("n_gpus_per_node", "n_nodes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UserError(f"{name}: expected a non-negative integer, got {v!r}")
        hosts = [h if isinstance(h, HostSpec) else HostSpec(hostname=h) for h in self.hosts]
        self.hosts = hosts
        seen: set[str] = set()
        for h in hosts:
            if h.label in seen:
                raise UserError(f"hosts: {h.label} is listed twice")
            seen.add(h.label)
        if hosts and self.n_nodes and self.n_nodes != len(hosts):
            raise UserError(f"n_nodes: is {self.n_nodes} but {len(hosts)} hosts are listed")
        if not self.n_nodes:
            self.n_nodes = max(1, len(hosts))
        self.env = _check_env(self.env)

    @property
    def head(self) -> HostSpec | None:
        return self.hosts[0] if self.hosts else None


def _check_env(env: Any) -> dict[str, str]:
    """The spec's `env` as strings: names of collective-library settings, one-line values."""
    if not isinstance(env, dict):
        raise UserError(f"env: expected a mapping of NAME: value, got {env!r}")
    out = {}
    for name, value in env.items():
        if not isinstance(name, str) or not name.startswith(ENV_PREFIXES) or not re.fullmatch(r"[A-Z0-9_]+", name):
            raise UserError(f"env: {name!r} is not a communication setting; expected a name starting with "
                            f"{', '.join(ENV_PREFIXES)} (other variables: areal-kit setup --env KEY=VALUE)")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise UserError(f"env: {name}: expected a string or a number, got {value!r}")
        text = str(value)
        if any(ord(c) < 32 for c in text):
            raise UserError(f"env: {name}: the value contains a line break or control character")
        out[name] = text
    return out


def _read(path: Path) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"cluster spec {path}: file not found") from None
    except OSError as e:
        raise UserError(f"cluster spec {path}: cannot read ({e.strerror})") from None
    try:
        if path.suffix == ".json":
            return json.loads(text)
        import yaml

        return yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise UserError(f"cluster spec {path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - yaml.YAMLError; keep the import lazy
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"cluster spec {path}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None


def _hosts(raw: Any, defaults: dict, where: str) -> list[HostSpec]:
    if not isinstance(raw, list) or not raw:
        raise UserError(f"{where}: hosts: expected a non-empty list of hostnames or mappings")
    host_keys = {f.name for f in fields(HostSpec)}
    out = []
    for i, item in enumerate(raw):
        entry = dict(defaults)
        if isinstance(item, str):
            entry["hostname"] = item
        elif isinstance(item, dict):
            unknown = set(item) - host_keys
            if unknown:
                raise UserError(f"{where}: hosts[{i}]: unknown field {min(unknown)!r}; "
                                f"expected {', '.join(sorted(host_keys))}")
            entry.update(item)
        else:
            raise UserError(f"{where}: hosts[{i}]: expected a hostname or a mapping, got {item!r}")
        if "hostname" not in entry:
            raise UserError(f"{where}: hosts[{i}]: missing field 'hostname'")
        try:
            out.append(HostSpec(**entry))
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
    return out


def _spec_from_mapping(data: Any, path: Path) -> ClusterSpec:
    where = f"cluster spec {path}"
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping of fields at the top level")
    data = dict(data)
    spec_keys = {f.name for f in fields(ClusterSpec)} - {"hosts"}
    allowed = spec_keys | {"hosts", "defaults", "inventory"}
    unknown = set(data) - allowed
    if unknown:
        raise UserError(f"{where}: unknown field {min(unknown)!r}; expected some of {', '.join(sorted(allowed))}")
    defaults = data.pop("defaults", None) or {}
    if not isinstance(defaults, dict) or set(defaults) - {"user", "port", "key_file"}:
        raise UserError(f"{where}: defaults: expected a mapping with user, port, key_file")
    hosts: list[HostSpec] = []
    inv = data.pop("inventory", None)
    if inv is not None:
        if not isinstance(inv, str):
            raise UserError(f"{where}: inventory: expected a path to a YAML inventory, got {inv!r}")
        try:
            inv_spec = load_cluster_spec(path.parent / os.path.expanduser(inv))
        except UserError as e:
            raise UserError(f"{where}: inventory: {e}") from None
        hosts = inv_spec.hosts
        data.setdefault("storage", inv_spec.storage)
    if "hosts" in data:
        if hosts:
            raise UserError(f"{where}: give hosts either inline or via inventory, not both")
        hosts = _hosts(data.pop("hosts"), defaults, where)
    for key in ("n_gpus_per_node", "n_nodes"):
        if isinstance(data.get(key), str) and data[key].isdigit():
            data[key] = int(data[key])
    try:
        return ClusterSpec(hosts=hosts, **data)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def load_cluster_spec(path: str | os.PathLike) -> ClusterSpec:
    """Read a guide-style JSON spec or a YAML inventory; raise UserError naming the bad field."""
    p = Path(path).expanduser()
    if p.suffix not in (".json", ".yaml", ".yml"):
        raise UserError(f"cluster spec {p}: expected a .json spec or a .yaml inventory")
    return _spec_from_mapping(_read(p), p)


if __name__ == "__main__":  # pragma: no cover - manual inspection
    import dataclasses

    print(json.dumps(dataclasses.asdict(load_cluster_spec(sys.argv[1])), indent=2))
