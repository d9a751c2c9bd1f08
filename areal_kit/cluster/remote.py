"""One SSH connection per host (fabric): connect with a clear diagnosis, run commands, log.

Hosts are resolved as OpenSSH would: ~/.ssh/config (or --ssh-config) gives aliases, HostName,
User, Port, IdentityFile and ProxyJump; keys held by ssh-agent are offered; a jump host
(--gateway [user@]host[:port], or ProxyJump) reaches nodes that only a login node can see.
Flags given on the command line win over the config file; without either, the user is root
and the port 22.

Connection failures are classified, because "it did not work" is what users of `ray up` on
on-prem hosts get and what this toolkit exists to avoid:

- unreachable: no TCP connection within the wait time (host down, wrong address/port);
- auth: the server refused the key (wrong key or user);
- hostkey: the host key differs from known_hosts (refused; the message says how to fix);
- ssh: any other SSH protocol error.

Host keys follow OpenSSH's `StrictHostKeyChecking`: ``accept-new`` (default) records unknown
hosts in the known_hosts file and refuses changed keys; ``strict`` refuses unknown hosts too;
``off`` checks nothing (throwaway test machines only).

Every command and its output go to a per-host log file; secret values are replaced by
``***`` before anything is written or shown. `DryRemote` records commands instead of running
them (``--dry-run``). Commands are shell strings built by callers with shlex quoting.
"""

from __future__ import annotations

import io
import logging
import os
import shlex
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import fabric
import invoke
import paramiko

from areal_kit.cluster.options import ConnectOptions
from areal_kit.config.cluster_spec import HostSpec
from areal_kit.errors import UserError

# paramiko logs a refused jump channel to stderr on its own; our ConnectError says it once.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
_known_hosts_lock = threading.Lock()


@dataclass
class Result:
    """What one remote command did."""

    cmd: str
    rc: int
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def tail(self, n: int = 8) -> str:
        lines = (self.stdout + "\n" + self.stderr).strip().splitlines()
        return "\n".join(lines[-n:])


class ConnectError(Exception):
    """Could not open an SSH session; `kind` is unreachable | auth | hostkey | ssh."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _fabric_config(opts: ConnectOptions) -> fabric.Config:
    # root and 22 unless the command line or the ssh config says otherwise (fabric's own
    # default user is the local one, which is rarely right on a fresh GPU node).
    return fabric.Config(runtime_ssh_path=opts.ssh_config, overrides={"user": "root", "port": 22})


def check_key_file(path: str | None) -> None:
    """Refuse missing or group/world-readable private keys, as OpenSSH does."""
    if path is None:
        return
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UserError(f"--private_key_file: {path} does not exist") from None
    if mode & 0o077:
        raise UserError(f"--private_key_file: {path} has permissions {oct(mode & 0o777)}, readable by "
                        f"others; run: chmod 600 {shlex.quote(path)}")


class Shell(Protocol):
    """What a step needs of a host's connection: a Remote, a DryRemote, or a test's stand-in."""

    @property
    def user(self) -> str: ...

    @property
    def is_root(self) -> bool: ...

    def connect(self) -> str: ...

    def run(self, cmd: str, sudo: bool = False, check: bool = False, timeout: float | None = None,
            quiet: bool = False) -> Result: ...

    def put_text(self, text: str, path: str, mode: int = 0o600) -> None: ...

    def put_bytes(self, data: bytes, path: str, mode: int = 0o600) -> None: ...

    def close(self) -> None: ...


def as_sent(cmd: str, sudo: bool, is_root: bool) -> str:
    """The command as sent: root-needing commands go through `sudo -n` for other users."""
    if sudo and not is_root:
        return "sudo -n sh -c " + shlex.quote(cmd)
    return cmd


class HostLog:
    """Append-only log file for one host, with secrets masked."""

    def __init__(self, path: Path | None, secrets: list[str]):
        self.path = path
        self.secrets = [s for s in secrets if s]
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)

    def redact(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "***")
        return text

    def write(self, text: str) -> None:
        if not self.path:
            return
        stamp = time.strftime("%H:%M:%S")
        with open(self.path, "a") as f:
            f.writelines(f"{stamp} {line}\n" for line in self.redact(text).rstrip("\n").splitlines() or [""])


def _known_hosts_entry(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def _accept_new_policy(path: str) -> paramiko.MissingHostKeyPolicy:
    class AcceptNew(paramiko.MissingHostKeyPolicy):
        # Record the key of a host seen for the first time (OpenSSH's accept-new). paramiko's
        # AutoAddPolicy rewrites the whole file from one client's view, which loses entries
        # when several hosts are first seen in parallel: append under a lock instead.
        def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
            client.get_host_keys().add(hostname, key.get_name(), key)
            with _known_hosts_lock:
                Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                with open(path, "a") as f:
                    f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")

    return AcceptNew()


def _hops(conn: fabric.Connection) -> list[fabric.Connection]:
    """The jump hosts in the order they are opened (the first is reached directly), then conn."""
    chain = [conn]
    while isinstance(chain[0].gateway, fabric.Connection):
        chain.insert(0, chain[0].gateway)
    return chain


def _name(conn: fabric.Connection) -> str:
    return f"{conn.user}@{conn.host}" + ("" if conn.port == 22 else f":{conn.port}")


class Remote:
    """An SSH session to one host; `run` executes a shell command string."""

    def __init__(self, host: HostSpec, opts: ConnectOptions, log: HostLog):
        self.host, self.opts, self.log = host, opts, log
        self.conn = self._connection()
        self.user = self.conn.user
        self.is_root = self.user == "root"

    def _connection(self) -> fabric.Connection:
        """A not yet opened connection, resolved through the ssh config, with our host key rules
        on every hop (fabric's default accepts any key)."""
        config = _fabric_config(self.opts)
        keys = {"key_filename": [self.host.key_file], "allow_agent": False, "look_for_keys": False} \
            if self.host.key_file else {}
        t = self.opts.connect_timeout
        gateway = None
        if self.opts.gateway:
            gateway = fabric.Connection(self.opts.gateway, config=config, connect_timeout=t,
                                        connect_kwargs={**keys, "banner_timeout": t, "auth_timeout": t})
        conn = fabric.Connection(self.host.hostname, user=self.host.user, port=self.host.port, config=config,
                                 gateway=gateway, connect_timeout=t,
                                 connect_kwargs={**keys, "banner_timeout": t, "auth_timeout": t})
        for hop in _hops(conn):
            client = paramiko.SSHClient()
            if self.opts.host_key_policy == "off":
                client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
            else:
                if os.path.exists(self.opts.known_hosts):
                    client.load_host_keys(self.opts.known_hosts)
                    client._host_keys_filename = None  # never let paramiko rewrite the file
                client.set_missing_host_key_policy(
                    _accept_new_policy(self.opts.known_hosts)
                    if self.opts.host_key_policy == "accept-new" else paramiko.RejectPolicy())
            hop.client = client
        return conn

    def route(self) -> list[str]:
        """user@host[:port] of each hop, jump hosts first, as resolved from flags and ssh config."""
        return [_name(h) for h in _hops(self.conn)]

    # -- connecting --------------------------------------------------------------------------
    def connect(self) -> str:
        """Open the session (retrying while unreachable); return the host's address as seen
        by the SSH server, which is the address Ray should use for this node."""
        deadline = time.monotonic() + self.opts.ssh_wait
        last: Exception | None = None
        attempt = 0
        while True:
            attempt += 1
            hops = _hops(self.conn)
            via = f" through {', '.join(self.route()[:-1])}" if len(hops) > 1 else ""
            try:
                for hop in hops:  # one by one, so that a failure names the hop it happened on
                    self._open(hop)
                self.log.write(f"connected to {_name(self.conn)}{via} (attempt {attempt})")
                break
            except ConnectError as e:
                if e.kind != "unreachable":
                    raise
                last = e
            self.close()
            self.conn = self._connection()
            if time.monotonic() + 1 > deadline:
                raise ConnectError(
                    "unreachable", f"{self.host.label} unreachable{via} after {attempt} attempt(s) over "
                    f"{self.opts.ssh_wait:.0f}s: {last}") from None
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        conn = self.run("echo $SSH_CONNECTION", quiet=True)
        parts = conn.stdout.split()
        return parts[2] if len(parts) >= 3 else socket.gethostbyname(self.conn.host)

    def _open(self, hop: fabric.Connection) -> None:
        """Open one hop; ConnectError with its kind."""
        who = _name(hop)
        try:
            hop.open()
        except paramiko.BadHostKeyException as e:
            entry = _known_hosts_entry(hop.host, hop.port)
            raise ConnectError(
                "hostkey",
                f"host key changed: {who} offered {e.key.get_name()} key "
                f"{e.key.get_fingerprint().hex()[:16]}.., known_hosts has a different one. If the "
                f"host was reinstalled, remove the old key: ssh-keygen -f "
                f"{shlex.quote(self.opts.known_hosts)} -R {shlex.quote(entry)}") from None
        except paramiko.AuthenticationException as e:
            raise ConnectError(
                "auth", f"authentication refused for {who} with key "
                f"{self.host.key_file or '(ssh config/agent/default keys)'}: {e}; check --username and that "
                f"the public key is in the user's authorized_keys") from None
        except paramiko.ChannelException as e:  # the jump host could not reach this hop
            raise ConnectError("unreachable", f"{who}: the jump host cannot connect ({e})") from None
        except paramiko.SSHException as e:
            if "not found in known_hosts" in str(e):
                raise ConnectError("hostkey", f"{who} is not in {self.opts.known_hosts} "
                                   "and --host-key-policy is strict; add it with ssh-keyscan") from None
            raise ConnectError("unreachable", f"{who}: {type(e).__name__}: {e}") from None  # e.g. sshd starting
        except (TimeoutError, OSError, EOFError) as e:
            raise ConnectError("unreachable", f"{who}: {type(e).__name__}: {e or 'timed out'}") from None

    # -- commands ----------------------------------------------------------------------------
    def wrap(self, cmd: str, sudo: bool = False) -> str:
        return as_sent(cmd, sudo, self.is_root)

    def run(self, cmd: str, sudo: bool = False, check: bool = False, timeout: float | None = None,
            quiet: bool = False) -> Result:
        """Run a shell command; never raises on a non-zero exit (callers decide)."""
        full = self.wrap(cmd, sudo)
        if not quiet:
            self.log.write(f"$ {full}")
        t0 = time.monotonic()
        try:
            r = self.conn.run(full, hide=True, warn=True, in_stream=False, pty=False, encoding="utf-8",
                              timeout=timeout or None)
            res = Result(full, r.exited, r.stdout, r.stderr, time.monotonic() - t0)
        except invoke.CommandTimedOut as e:
            res = Result(full, 124, e.result.stdout, e.result.stderr + f"\n(timed out after {timeout:.0f}s)",
                         time.monotonic() - t0)
            self.log.write(res.tail(20) + "\n-> rc=124 timeout")
            return res
        if not quiet:
            body = (res.stdout + res.stderr).strip()
            self.log.write((body + "\n" if body else "") + f"-> rc={res.rc} ({res.seconds:.1f}s)")
        return res

    def put_text(self, text: str, path: str, mode: int = 0o600) -> None:
        """Write a small file (e.g. secrets) over SFTP: never part of a command line or log."""
        d = os.path.dirname(path)
        if d:
            self.run("mkdir -p -m 700 " + shlex.quote(d), quiet=True)
        sftp = self.conn.sftp()
        with sftp.open(path, "w") as f:
            f.chmod(mode)  # before the first byte: the secret is never readable by others
            f.write(text)
        self.log.write(f"wrote {path} (mode {oct(mode)}, contents not logged)")

    def put_bytes(self, data: bytes, path: str, mode: int = 0o600) -> None:
        """Upload a file over SFTP (e.g. an image's build context), pipelined: no command line carries it."""
        sftp = self.conn.sftp()
        sftp.putfo(io.BytesIO(data), path)
        sftp.chmod(path, mode)
        self.log.write(f"uploaded {path} ({len(data)} bytes, mode {oct(mode)})")

    def close(self) -> None:
        for hop in reversed(_hops(self.conn)):
            hop.close()


@dataclass
class DryRemote:
    """Records what would run; checks report "not satisfied" so every action is listed."""

    host: HostSpec
    gateway: str | None = None
    commands: list[tuple[str, str]] = field(default_factory=list)  # (kind, command)

    @property
    def user(self) -> str:
        return self.host.user or "root"

    @property
    def is_root(self) -> bool:
        return self.user == "root"

    def wrap(self, cmd: str, sudo: bool = False) -> str:
        return as_sent(cmd, sudo, self.is_root)

    def connect(self) -> str:
        words = ["ssh"] + (["-J", self.gateway] if self.gateway else []) + (["-p", str(self.host.port)] if self.host.port else [])
        self.commands.append(("connect", " ".join([*words, f"{self.user}@{self.host.hostname}"])))
        return self.host.hostname

    def run(self, cmd: str, sudo: bool = False, check: bool = False, timeout: float | None = None,
            quiet: bool = False) -> Result:
        full = self.wrap(cmd, sudo)
        self.commands.append(("check" if check else "run", full))
        return Result(full, 1 if check else 0)

    def put_text(self, text: str, path: str, mode: int = 0o600) -> None:
        self.commands.append(("put", f"sftp put (contents hidden) -> {path} mode {oct(mode)}"))

    def put_bytes(self, data: bytes, path: str, mode: int = 0o600) -> None:
        self.commands.append(("put", f"sftp put ({len(data)} bytes) -> {path} mode {oct(mode)}"))

    def close(self) -> None:
        pass
