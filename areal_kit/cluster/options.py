"""Setup options (validated dataclasses) and saved cluster state.

`SetupOptions` is everything `areal-kit setup` was told, `ConnectOptions` how this machine reaches
the hosts, `Limits` what doctor holds them to; each field that is a command-line option carries
its flag, default and help (areal_kit/flags.py), and the commands' signatures are made of them;
an option other commands take as well is declared once where they share it (cluster/target.py,
areal_kit/options.py), and the field here holds setup's default.
The run over the hosts they make (connections, facts, secrets, doctor's findings) is `Cluster`
(cluster/context.py). After a setup, the options are saved to
``$AREAL_KIT_HOME/clusters/<cluster_name>.json`` (default ``~/.areal-kit``) so that `areal-kit
status`, `down` and `doctor` find the same hosts, runtime and route without repeating them
(cluster/target.py). Secrets are never saved there.

    areal-kit setup --hostnames h1 h2 --runtime host && areal-kit doctor
"""

# flag() and many() return dataclasses.field(...), a fresh list per instance where the option repeats;
# ruff's RUF009 knows only field() itself by name.
# ruff: noqa: RUF009

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from areal_kit.config.cluster_spec import ClusterSpec, HostSpec
from areal_kit.errors import UserError
from areal_kit.flags import flag, many
from areal_kit.home import state_dir

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


STOP_GRACE = 300.0  # seconds a SIGTERMed training may take to finish its step and checkpoint it
# Seconds setup waits for a started training's sign of life: a GPU run loads its models and starts
# its engines before its workers are ready, which takes minutes.
TRAIN_WAIT = 900.0


@dataclass
class SetupOptions:
    """What `areal-kit setup` does: each field is the setup option of the same name (its flag, default and
    help; an option other commands take too is declared where they share it, and its field here holds
    setup's default); status, down and doctor read them back from the saved state."""

    spec: ClusterSpec  # hosts (first = head), storage, cluster_name, fileroot, GPUs per node (target.py)
    # --ssh-config, --gateway and --runtime are Route's (target.py), --python is areal_kit/options.py's:
    # status, down and doctor take them too, defaulting to what setup saved.
    ssh_config: str | None = None  # OpenSSH client config (None: ~/.ssh/config)
    gateway: str | None = None  # jump host (None: the ssh config's ProxyJump, if any)
    nas_url: str | None = flag(None, "--nas_url", "--nas-url", help="NFS export (server:/path) to mount at --storage "
                               "where it is not mounted yet.")
    runtime: str = "docker"  # one of RUNTIMES
    image: str | None = flag(None, "--image", help="Runtime image to pull from a registry you name, e.g. "
                             "ghcr.io/OWNER/areal-kit:0.1.0-cuda. Default: areal-kit's own, "
                             "areal-kit:VERSION-cpu|cuda-DIGEST (cuda when any host has a GPU), built once on the head "
                             "from the installed package's docker/Dockerfile where missing, saved to STORAGE/images/ "
                             "and loaded on the other hosts.")
    image_tar: str | None = flag(None, "--image-tar", help="`docker load` this tarball (on shared storage) where the "
                                 "image is missing, instead of pulling: for air-gapped clusters. It holds --image "
                                 "(default areal-kit:latest).")
    build_args: list[str] = many("--build-arg", help="KEY=VALUE passed to the docker build of areal-kit's own image "
                                 "(repeat), e.g. BASE_IMAGE=IMG, PY_ENV=storage, VENV=PATH, FLASH_ATTN=build; see "
                                 "docker/Dockerfile.")
    python: str = "python3"  # inside the image (docker) or on the hosts (host)
    mounts: list[str] = many("--mount", help="Extra bind mount SRC[:DST[:ro]] for the containers (repeat).")
    env: list[str] = many("--env", help="Extra KEY=VALUE for Ray processes (repeat).")
    ray_port: int = flag(6379, "--ray-port", help="Ray GCS port on the head.")
    dashboard: bool = flag(True, "--dashboard/--no-dashboard", help="Ray dashboard on the head, bound to its "
                           "cluster address.")
    num_cpus: int | None = flag(None, "--num-cpus", help="CPUs each Ray node offers (default: all).")
    object_store_memory: str | None = flag(None, "--object-store-memory", help="Object store per node, e.g. 2g.")
    shm_size: str = flag("16g", "--shm-size", help="Container /dev/shm size (holds the object store).")
    ray_auth_mode: str = flag("disabled", "--ray-auth-mode", help="RAY_AUTH_MODE on every node: disabled | token.")
    data: list[str] = many("--data", help="URI[=DEST] to fetch once onto storage, besides the preset's assets: "
                           "hf://org/name (to STORAGE/models/name), hf://datasets/org/name, https://.../FILE, "
                           "https://.../FOLDER/, file://... (to STORAGE/datasets/name, a file as a file); add "
                           "#sha256=HEX to verify (repeat).")
    train_param: str | None = flag(None, "--train_param", "--train-param", help="Preset to start training in the "
                                   "head container after setup (log on shared storage).")
    train_args: list[str] = many("--train-arg", help="Extra key=value override for that training (repeat).")
    train_wait: float = TRAIN_WAIT  # --train-wait, OnCluster's (cluster/cmd.py): train --cluster takes it too
    ray_wait: float = flag(180.0, "--ray-wait", help="Seconds to wait for every node to join Ray.")
    min_disk_gb: float = flag(20.0, "--min-disk-gb", min=0, help="Free space required on the storage, in GB.")
    log_dir: str | None = flag(None, "--log-dir", help="Per-host log files (default ~/.areal-kit/logs/NAME/TIME).")
    dry_run: bool = False  # --dry-run, areal_kit/options.py's Output
    fetch_only: bool = flag(False, "--fetch-only", help="Run setup's steps up to its data step (connect, storage, "
                            "image, data) and stop: fetch the preset's assets and --data onto the storage, start "
                            "neither Ray nor training.")

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
        for a in self.build_args:
            if "=" not in a or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", a.split("=", 1)[0]):
                raise UserError(f"--build-arg: expected KEY=VALUE, got {a!r}")
            if a.startswith("ACCELERATOR=") and a not in ("ACCELERATOR=cpu", "ACCELERATOR=cuda"):
                raise UserError(f"--build-arg: ACCELERATOR must be cpu or cuda, got {a!r}")
        if self.build_args and (self.image or self.image_tar):
            raise UserError("--build-arg: only areal-kit's own image is built, and --image/--image-tar name "
                            "another; drop one or the other")
        if self.image_tar and not self.image:
            self.image = "areal-kit:latest"  # what a tarball held before setup built its own image
        for a in self.train_args:
            if "=" not in a:
                raise UserError(f"--train-arg: expected key=value, got {a!r}")
        if self.train_param is not None and not re.match(r"^[A-Za-z0-9_.\-]+$", self.train_param):
            raise UserError(f"--train_param: expected a preset name like 1.5B_n4, got {self.train_param!r}")
        if self.fetch_only and not (self.train_param or self.data):
            raise UserError("--fetch-only: nothing to fetch; expected --train_param PRESET or --data URI")
        if self.min_disk_gb < 0 or self.ray_wait <= 0 or self.train_wait < 0:
            raise UserError("--min-disk-gb and --train-wait must be >= 0, --ray-wait > 0")
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
        env.update(e.partition("=")[::2] for e in self.env)  # each KEY=VALUE, checked above
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
        d["dry_run"] = d["fetch_only"] = False
        return d

    @classmethod
    def from_state(cls, d: dict) -> SetupOptions:
        d = dict(d)
        spec = dict(d.pop("spec"))
        spec["hosts"] = [HostSpec(**h) for h in spec["hosts"]]
        return cls(spec=ClusterSpec(**spec), **d)


HOST_KEY_POLICIES = ("accept-new", "strict", "off")


@dataclass
class ConnectOptions:
    """How this machine reaches the hosts (cluster/remote.py): the SSH flags of every command, never saved."""

    known_hosts: str = flag("~/.ssh/known_hosts", "--known-hosts", help="known_hosts file to check host keys "
                            "against.")  # read, and appended to under accept-new
    host_key_policy: str = flag("accept-new", "--host-key-policy", help="accept-new (record unknown, refuse "
                                "changed) | strict | off.")
    connect_timeout: float = flag(10.0, "--connect-timeout", help="Seconds for one SSH connection attempt.")
    # Keep retrying an unreachable host this long: hosts still booting. --ssh-wait, Route's (target.py):
    # status, down and doctor wait less.
    ssh_wait: float = 30.0
    ssh_config: str | None = None  # OpenSSH client config (None: ~/.ssh/config and /etc/ssh/ssh_config)
    gateway: str | None = None  # [user@]host[:port] of a jump host for every host (else ProxyJump, if any)

    def __post_init__(self) -> None:
        if self.host_key_policy not in HOST_KEY_POLICIES:
            raise UserError(f"--host-key-policy: expected one of {', '.join(HOST_KEY_POLICIES)}, "
                            f"got {self.host_key_policy!r}")
        if self.connect_timeout <= 0 or self.ssh_wait < 0:
            raise UserError("--connect-timeout must be > 0 and --ssh-wait >= 0 (seconds)")
        self.known_hosts = os.path.expanduser(self.known_hosts)
        if self.ssh_config is not None:
            self.ssh_config = os.path.expanduser(self.ssh_config)
            if not os.path.isfile(self.ssh_config):
                raise UserError(f"--ssh-config: {self.ssh_config} does not exist; expected an OpenSSH client config file")
        if self.gateway is not None and (not self.gateway or any(c.isspace() for c in self.gateway)):
            raise UserError(f"--gateway: expected [user@]host[:port], got {self.gateway!r}")


def state_path(name: str) -> Path:
    """Where setup saves cluster name's options."""
    return state_dir() / "clusters" / f"{name}.json"


def saved_cluster(name: str) -> SetupOptions:
    """The options setup saved for cluster name (a command's --cluster); UserError naming the saved ones
    when there are none."""
    if not state_path(name).exists():
        saved = sorted(p.stem for p in state_path(name).parent.glob("*.json"))
        raise UserError(f"--cluster {name}: no cluster of that name was set up from here ({state_path(name)} "
                        f"missing); expected the --name given to setup (default areal)"
                        + (f": {', '.join(saved)}" if saved else ""))
    return load_state(name)


def save_state(opts: SetupOptions) -> Path:
    p = state_path(opts.spec.cluster_name)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(opts.to_state(), indent=2))
    return p


def load_state(name: str) -> SetupOptions:
    p = state_path(name)
    if not p.exists():
        raise UserError(f"no cluster named {name!r} was set up from here ({p} missing); "
                        "give --hostnames/--inventory, or --name of a cluster set up before")
    try:
        return SetupOptions.from_state(json.loads(p.read_text()))
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"cluster state {p} is unreadable ({e}); delete it and pass the hosts again") from None


@dataclass
class Limits:
    """What doctor holds the hosts to: doctor's flags, and setup's for its fast checks."""

    min_shm_gb: float = flag(1.0, "--min-shm-gb", min=0, help="/dev/shm each host (container) must have, in GB "
                             "(doctor's check).")
    # Ray's and vLLM's sockets, files and pipes at scale
    min_nofile: int = flag(65536, "--min-nofile", min=0, help="Open-file hard limit each host (container) must "
                           "allow (doctor's check).")
    min_disk_gb: float = SetupOptions.min_disk_gb  # --min-disk-gb, declared there: setup and doctor both take it
    gpus_per_node: int = 0  # the preset's (0: whatever the hosts agree on); CPU clusters count slots, not GPUs
    preset: str | None = flag(None, "--preset", help="Also check against this preset: Ray has its GPUs per node, "
                              "its placement groups are reserved (and released), one of its vLLM engines generates.")
    net_mb: float = flag(16.0, "--net-mb", min=0.01, help="Megabytes each bandwidth measurement sends.")
    rl_step: bool = flag(False, "--rl-step", help="Also one tiny RL step across the cluster (2 trainer ranks and an "
                         "engine apart, a weight sync, engine logprobs against the trainers').")
    quick_network: bool = False  # setup's fast checks: the network step's all-reduce only, no link matrix


def q(*args: object) -> str:
    """Shell-quote and join: the only way commands are built from user-given values."""
    return shlex.join(str(a) for a in args)


def env_prefix(env: dict[str, str]) -> str:
    return q("env", *(f"{k}={v}" for k, v in env.items()))
