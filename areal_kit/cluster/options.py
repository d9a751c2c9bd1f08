"""Setup options (validated dataclass), the run context shared by steps, and saved cluster state.

`SetupOptions` is everything `areal-kit setup` was told; `Cluster` is one run over the hosts
(connections, facts, secrets). After a setup, the options are saved to
``$AREAL_KIT_HOME/clusters/<cluster_name>.json`` (default ``~/.areal-kit``) so that
`areal-kit status` and `areal-kit down` find the same hosts without repeating them. Secrets
are never saved there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets as secrets_mod
import shlex
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from areal_kit.config.cluster_spec import ClusterSpec, HostSpec
from areal_kit.errors import UserError

RUNTIMES = ("docker", "host")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgG]?)[bB]?$")


def parse_size(text: str | int | None, what: str) -> int | None:
    """'512m' / '2g' / '1048576' -> bytes (None stays None)."""
    if text is None or text == "":
        return None
    m = _SIZE.match(str(text).strip())
    if not m:
        raise UserError(f"{what}: expected a size like 512m or 2g, got {text!r}")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def state_dir() -> Path:
    return Path(os.environ.get("AREAL_KIT_HOME", "~/.areal-kit")).expanduser()


STOP_GRACE = 300.0  # seconds a SIGTERMed training may take to finish its step and checkpoint it


@dataclass
class SetupOptions:
    """What `areal-kit setup` does; see `areal-kit setup --help` for each option."""

    spec: ClusterSpec  # hosts (first = head), storage, cluster_name, fileroot, GPUs per node
    runtime: str = "docker"  # docker: Ray in containers; host: Ray directly on the hosts
    image: str = "areal-kit:latest"  # runtime image (docker runtime)
    image_tar: str | None = None  # `docker load` this tarball (on shared storage) instead of pulling
    python: str = "python3"  # interpreter with ray and areal_kit: in the image, or on the hosts
    mounts: list[str] = field(default_factory=list)  # extra bind mounts SRC[:DST[:ro]] for containers
    env: list[str] = field(default_factory=list)  # extra KEY=VALUE for Ray processes
    ray_port: int = 6379  # GCS port on the head
    dashboard: bool = True  # Ray dashboard on the head, bound to the head's cluster address
    num_cpus: int | None = None  # CPUs each Ray node offers (None: all)
    object_store_memory: str | None = None  # per-node object store, e.g. 2g (None: Ray's default)
    shm_size: str = "16g"  # container /dev/shm (Ray's object store lives there)
    ray_auth_mode: str = "disabled"  # RAY_AUTH_MODE, set explicitly on every node and driver
    data: list[str] = field(default_factory=list)  # URIs fetched onto storage once (head)
    train_param: str | None = None  # preset to start in the head container after setup
    train_args: list[str] = field(default_factory=list)  # extra key=value overrides for training
    min_disk_gb: float = 20.0  # free space required on the storage path
    ray_wait: float = 180.0  # seconds to wait for every node to join Ray
    log_dir: str = ""  # per-host log files (default: $AREAL_KIT_HOME/logs/<cluster>/<time>)
    dry_run: bool = False  # print the commands, run nothing
    nas_url: str | None = None  # NFS export mounted at storage where it is not mounted yet
    ssh_config: str | None = None  # OpenSSH client config (None: ~/.ssh/config)
    gateway: str | None = None  # jump host [user@]host[:port] (None: ProxyJump from the ssh config, if any)

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise UserError(f"--runtime: expected docker or host, got {self.runtime!r}")
        if not self.spec.hosts:
            raise UserError("no hosts: give --hostnames H1 H2 ... or --inventory FILE")
        if not 0 < self.ray_port < 65536:
            raise UserError(f"--ray-port: expected 1-65535, got {self.ray_port}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise UserError(f"--num-cpus: expected >= 1, got {self.num_cpus}")
        parse_size(self.object_store_memory, "--object-store-memory")
        parse_size(self.shm_size, "--shm-size")
        if self.ray_auth_mode not in ("disabled", "token"):
            raise UserError(f"--ray-auth-mode: expected disabled or token, got {self.ray_auth_mode!r}")
        for m in self.mounts:
            parts = m.split(":")
            if not 1 <= len(parts) <= 3 or not all(p.startswith("/") for p in parts[:2]) or \
                    (len(parts) == 3 and parts[2] not in ("ro", "rw")):
                raise UserError(f"--mount: expected SRC[:DST[:ro]] with absolute paths, got {m!r}")
        for e in self.env:
            if "=" not in e or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", e.split("=", 1)[0]):
                raise UserError(f"--env: expected KEY=VALUE, got {e!r}")
        for a in self.train_args:
            if "=" not in a:
                raise UserError(f"--train-arg: expected key=value, got {a!r}")
        if self.train_param is not None and not re.match(r"^[A-Za-z0-9_.\-]+$", self.train_param):
            raise UserError(f"--train_param: expected a preset name like 1.5B_n4, got {self.train_param!r}")
        if self.min_disk_gb < 0 or self.ray_wait <= 0:
            raise UserError("--min-disk-gb must be >= 0 and --ray-wait > 0")
        if not self.log_dir:
            self.log_dir = str(state_dir() / "logs" / self.spec.cluster_name / time.strftime("%Y%m%d-%H%M%S"))

    # -- derived ---------------------------------------------------------------------------
    @property
    def storage(self) -> str:
        return self.spec.storage

    @property
    def container_prefix(self) -> str:
        return f"areal-{self.spec.cluster_name}"

    def ray_env(self) -> dict[str, str]:
        """Environment every Ray process and driver gets (auth mode explicit: a Ray that defaults to token auth would refuse workers without it)."""
        env = {"RAY_AUTH_MODE": self.ray_auth_mode, "RAY_USAGE_STATS_ENABLED": "0"}
        env.update(e.split("=", 1) for e in self.env)
        return env

    def volume_args(self) -> list[str]:
        src, dst, *mode = self.spec.default_mount.split(":")
        vols = [f"{src}:{dst}" + (f":{mode[0]}" if mode else "")]
        for m in self.mounts:
            parts = m.split(":")
            if len(parts) == 1:
                parts.append(parts[0])
            vols.append(":".join(parts))
        out: list[str] = []
        for v in dict.fromkeys(vols):
            out += ["-v", v]
        return out

    def secrets_path(self, user: str) -> str:
        """Where a host's secrets file lives, in the home of the user we log in as."""
        home = "/root" if user == "root" else f"/home/{user}"
        return f"{home}/.areal-kit/{self.spec.cluster_name}.env"

    def to_state(self) -> dict:
        d = dataclasses.asdict(self)
        d["dry_run"] = False
        return d

    @classmethod
    def from_state(cls, d: dict) -> SetupOptions:
        d = dict(d)
        spec = dict(d.pop("spec"))
        spec["hosts"] = [HostSpec(**h) for h in spec["hosts"]]
        return cls(spec=ClusterSpec(**spec), **d)


def save_state(opts: SetupOptions) -> Path:
    p = state_dir() / "clusters" / f"{opts.spec.cluster_name}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(opts.to_state(), indent=2))
    return p


def load_state(name: str) -> SetupOptions:
    p = state_dir() / "clusters" / f"{name}.json"
    if not p.exists():
        raise UserError(f"no cluster named {name!r} was set up from here ({p} missing); "
                        "give --hostnames/--inventory, or --name of a cluster set up before")
    try:
        return SetupOptions.from_state(json.loads(p.read_text()))
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"cluster state {p} is unreadable ({e}); delete it and pass the hosts again") from None


@dataclass
class Cluster:
    """One run over the hosts: options, host states, and the secrets to mask."""

    opts: SetupOptions
    hosts: list  # list[HostState]
    secrets: dict[str, str] = field(default_factory=dict)  # env name -> value (never logged)
    token: str = field(default_factory=lambda: secrets_mod.token_hex(8))  # this run's storage marker
    # Setup stops a running training at most once, before the first container it replaces:
    # (the host that asked, the outcome), shared by the hosts' threads under stop_lock.
    training_stop: tuple | None = None
    stop_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    doctor: dict = field(default_factory=dict)  # what doctor's checks measured and found (cluster/doctor.py)

    @property
    def head(self):
        return self.hosts[0]


def q(*args: object) -> str:
    """Shell-quote and join: the only way commands are built from user-given values."""
    return shlex.join(str(a) for a in args)


def env_prefix(env: dict[str, str]) -> str:
    return q("env", *(f"{k}={v}" for k, v in env.items()))
