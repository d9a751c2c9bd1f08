"""One run over the hosts: what every step sees (cluster/parallel.py runs them).

`Cluster` is the run: setup's options, the hosts' states (their connections, the facts steps
learned, each step's `Outcome`), the secrets to mask and doctor's findings. It sits above the
options (cluster/options.py) and the connections (cluster/remote.py), and below the steps and
their runner, so none of them imports another in a circle.
"""

from __future__ import annotations

import secrets as secrets_mod
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_kit.cluster.options import SetupOptions
from areal_kit.cluster.remote import DryRemote, Result, Shell
from areal_kit.config.cluster_spec import HostSpec
from areal_kit.findings import Finding


@dataclass
class Outcome:
    """What one step did on one host (a step is `fn(cluster, host) -> Outcome`)."""

    status: str  # ok | changed | failed | skipped
    message: str = ""
    result: Result | None = None  # the failing command, for the recap
    seconds: float = 0.0
    blocking: bool = True  # a failure that keeps the host out of later steps (doctor's checks are not)



class Unconnected:
    """The connection of a host given none (a plan, a test that runs no command): any use is a bug."""

    def _refuse(self, *args: object, **kwargs: object) -> Any:
        raise RuntimeError("this host has no connection")

    user = is_root = property(_refuse)
    connect = run = put_text = put_bytes = close = _refuse


@dataclass
class HostState:
    """A host as the run sees it: its connection, facts learned, and per-step outcomes."""

    spec: HostSpec
    index: int
    remote: Shell = field(default_factory=Unconnected)
    ip: str = ""  # address Ray uses for this node
    facts: dict[str, Any] = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)  # step name -> Outcome
    log_path: Path | None = None

    @property
    def name(self) -> str:
        return self.spec.label

    @property
    def is_head(self) -> bool:
        return self.index == 0

    @property
    def dry(self) -> DryRemote:
        """The connection of a dry run (setup --dry-run), which lists what would run."""
        assert isinstance(self.remote, DryRemote), "a dry run's host records its commands"
        return self.remote

    @property
    def failed(self) -> bool:
        """A step failed that the later ones need."""
        return any(o.status == "failed" and o.blocking for o in self.outcomes.values())

    @property
    def any_failed(self) -> bool:
        return any(o.status == "failed" for o in self.outcomes.values())


@dataclass
class DoctorState:
    """What doctor's checks measured and found, filled step by step (cluster/doctor.py)."""

    hosts: dict[str, dict] = field(default_factory=dict)  # host name -> the facts its probe measured (probe.py)
    findings: list[Finding] = field(default_factory=list)  # every failed check, on every host
    ray_nodes: dict[str, float] | None = None  # address -> GPUs of each node Ray counts alive (None: no answer)
    network: dict | None = None  # the head's network probe: links_gbps, nodes, interfaces, backend, ...
    rl_step: dict | None = None  # the tiny RL step's outcome (--rl-step)


@dataclass
class Cluster:
    """One run over the hosts: options, host states, and the secrets to mask."""

    opts: SetupOptions
    hosts: list[HostState]
    secrets: dict[str, str] = field(default_factory=dict)  # env name -> value (never logged)
    token: str = field(default_factory=lambda: secrets_mod.token_hex(8))  # this run's storage marker
    # Setup stops a running training at most once, before the first container it replaces:
    # (the host that asked, the outcome), shared by the hosts' threads under stop_lock.
    training_stop: tuple[str, Outcome] | None = None
    stop_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    doctor: DoctorState = field(default_factory=DoctorState)
    # The containers' image: the one the options name, or areal-kit's own, whose tag the image step
    # learns on the head (it depends on the hosts' GPUs).
    image: str = ""

    def __post_init__(self) -> None:
        self.image = self.image or self.opts.image or ""

    @property
    def head(self) -> HostState:
        return self.hosts[0]
