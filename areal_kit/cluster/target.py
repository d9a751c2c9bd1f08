"""Which hosts a cluster command acts on: setup's hosts as given, and the cluster a later command targets.

`Hosts` is how `areal-kit setup` is given its hosts (--hostnames and HOSTS, or --inventory, with
the flags that override the inventory) and makes the ClusterSpec. `Target` is how `status`,
`down` and `doctor` name a cluster: by --name (default areal), whose saved state (cluster/options.py)
fills whatever the command line leaves out, runtime, python, storage, route (ssh config, jump
host), and each host's user, port and key. Naming the same hosts again therefore changes
nothing: after `setup --runtime host --hostnames A B C`, `doctor --hostnames A B C` probes the
host runtime too. The four commands' shared options are declared once, on Hosts and on Route
(how the hosts are reached and run Ray), with --python in areal_kit/options.py.

    areal-kit doctor                                  # the saved cluster, as set up
    areal-kit doctor --hostnames A B C --username root  # the same, named again
    areal-kit status --hostnames X Y                  # a cluster setup never saw: defaults
"""

# flag(), many() and argument() return dataclasses.field(...); ruff's RUF009 knows only field() by name.
# ruff: noqa: RUF009

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from areal_kit.cluster.options import ConnectOptions, SetupOptions, load_state, state_path
from areal_kit.config.cluster_spec import ClusterSpec, HostSpec, load_cluster_spec
from areal_kit.errors import UserError
from areal_kit.flags import argument, flag, many


@dataclass
class Hosts:
    """The hosts a cluster command names: setup's, from --inventory, or from --hostnames plus positional
    HOSTS (flags override the inventory); status's, down's and doctor's instead of the saved ones (Target)."""

    hosts: list[str] = argument("More hostnames, so the guide's `--hostnames h1 h2 h3` works (status, down, doctor: "
                                "instead of the saved state of the last setup).")
    hostnames: list[str] = many("--hostnames", help="Hosts (repeat, or comma-separate): setup provisions them, the "
                                "first is the Ray head; status, down, doctor: default the saved ones.")
    inventory: str | None = flag(None, "--inventory", "--cluster-spec", help="YAML inventory or JSON cluster spec "
                                 "(cluster_specs/) instead of --hostnames.")
    private_key_file: str | None = flag(None, "--private_key_file", "--private-key-file", help="SSH private key "
                                        "(must be chmod 600; status, down, doctor: default as at setup).")
    username: str | None = flag(None, "--username", help="SSH user (default: the ssh config's User, else root; "
                                "status, down, doctor: as at setup); others need passwordless sudo.")
    ssh_port: int | None = flag(None, "--ssh_port", "--ssh-port", help="SSH port (default: the ssh config's Port, "
                                "else 22; status, down, doctor: as at setup).")
    storage: str | None = None  # --storage, declared in areal_kit/options.py (eval and doctor --slurm take it too)
    name: str | None = flag(None, "--name", help="Cluster name: names containers, logs, saved state (default areal; "
                            "status, down, doctor: the one given at setup).")
    n_gpus_per_node: int | None = flag(None, "--n-gpus-per-node", help="Fail unless every host has this many GPUs.")

    @property
    def named(self) -> bool:
        """Whether the command line names any host."""
        return bool(self.hosts or self.hostnames or self.inventory)

    def spec(self) -> ClusterSpec:
        names = [h for arg in self.hostnames + self.hosts for h in arg.split(",") if h]
        if self.inventory and names:
            raise UserError("give hosts either with --hostnames or with --inventory, not both")
        key = os.path.expanduser(self.private_key_file) if self.private_key_file else None
        if not self.inventory:
            hs = [HostSpec(hostname=n, user=self.username, port=self.ssh_port, key_file=key) for n in names]
            return ClusterSpec(cluster_name=self.name or "areal", storage=self.storage or "/storage",
                               n_gpus_per_node=self.n_gpus_per_node or 0, hosts=hs)
        spec = load_cluster_spec(self.inventory)
        hosts = [HostSpec(h.hostname, user=self.username or h.user,
                          port=self.ssh_port if self.ssh_port is not None else h.port, key_file=key or h.key_file)
                 for h in spec.hosts]
        gpus = self.n_gpus_per_node if self.n_gpus_per_node is not None else spec.n_gpus_per_node
        return dataclasses.replace(spec, hosts=hosts, storage=self.storage or spec.storage,
                                   cluster_name=self.name or spec.cluster_name, n_gpus_per_node=gpus)


@dataclass
class Target(Hosts):
    """The cluster status, down and doctor act on: the one saved under --name, with what the command
    line gives instead (the hosts as Hosts', Route's options, --python); hosts setup never saw, without
    a saved state, get setup's defaults. None: not given."""

    runtime: str | None = None
    python: str | None = None
    ssh_wait: float = 10.0  # less than setup's: the hosts are up
    ssh_config: str | None = None
    gateway: str | None = None

    def options(self, dry_run: bool = False) -> SetupOptions:
        """The setup options of the cluster: as saved, with what the command line gives instead."""
        spec, name = self._named()
        # Hosts named with their own ssh config take their route from it (its ProxyJump), not
        # the jump host setup was given for the addresses it saved.
        route_given = spec is not None and bool(self.ssh_config)
        # No host named and nothing saved: load_state says which name it looked for.
        saved: SetupOptions | None
        if spec is None:
            saved = load_state(name)
            spec = saved.spec
        else:
            saved = load_state(name) if state_path(name).exists() else None
            if saved is not None:
                spec = _as_saved(spec, saved.spec, inventory=bool(self.inventory))
        base = saved or SetupOptions(spec=spec)
        return dataclasses.replace(base, spec=spec, runtime=self.runtime or base.runtime,
                                   python=self.python or base.python, ssh_config=self.ssh_config or base.ssh_config,
                                   gateway=self.gateway or (None if route_given else base.gateway), dry_run=dry_run, log_dir=None)

    def runtime_assumed(self) -> bool:
        """Whether the runtime and python this command uses are not the ones setup saved: others given
        on the command line, or defaults for a cluster not set up from here."""
        name = self._named()[1]
        if not state_path(name).exists():
            return True
        saved = load_state(name)
        return (self.runtime or saved.runtime, self.python or saved.python) != (saved.runtime, saved.python)

    def _named(self) -> tuple[ClusterSpec | None, str]:
        """The hosts the command line names (None: none), and the cluster's name."""
        spec = self.spec() if self.named else None
        return spec, self.name or (spec.cluster_name if spec else "areal")


@dataclass
class Route:
    """How the hosts are reached and what runs Ray on them: setup's choice, and for status, down and
    doctor what they take instead of what setup saved. None: not given (the command's default, on
    SetupOptions, ConnectOptions or Target)."""

    ssh_config: str | None = flag(None, "--ssh-config", help="OpenSSH client config for host aliases, User, Port, "
                                  "IdentityFile, ProxyJump (default ~/.ssh/config; status, down, doctor: as at "
                                  "setup).")
    # user@host:port, not [user@]host[:port]: --help reads brackets that start with a letter as markup.
    gateway: str | None = flag(None, "--gateway", help="Jump host user@host:port (user and port optional) through "
                               "which every host is reached (default: the ssh config's ProxyJump, if any; status, "
                               "down, doctor: as at setup).")
    runtime: str | None = flag(None, "--runtime", help="docker: Ray in containers; host: Ray directly on the hosts "
                               f"(no Docker). Default {SetupOptions.runtime}; status, down, doctor: as at setup.")
    ssh_wait: float | None = flag(None, "--ssh-wait", help="Keep retrying unreachable hosts this many seconds "
                                  f"(default: setup {ConnectOptions.ssh_wait:g}, status, down, doctor "
                                  f"{Target.ssh_wait:g}).")


def _as_saved(given: ClusterSpec, saved: ClusterSpec, inventory: bool) -> ClusterSpec:
    """The hosts named again, each with the user, port and key setup saved for it where the command
    line leaves them out; storage, GPUs and env as saved, unless an inventory gives its own."""
    hosts = []
    for h in given.hosts:
        was = next((s for s in saved.hosts if s.hostname == h.hostname and h.port in (None, s.port)), None)
        if was is None:
            hosts.append(h)
            continue
        hosts.append(HostSpec(h.hostname, user=h.user or was.user, port=h.port if h.port is not None else was.port,
                              key_file=h.key_file or was.key_file))
    return dataclasses.replace(given if inventory else saved, hosts=hosts, n_nodes=0)
