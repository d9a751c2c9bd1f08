"""One SSH connection per host (paramiko): connect with a clear diagnosis, run commands, log.

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

import os
import shlex
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from areal_kit.config.cluster_spec import HostSpec
from areal_kit.errors import UserError

HOST_KEY_POLICIES = ("accept-new", "strict", "off")
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


@dataclass
class ConnectOptions:
    """How the controller reaches hosts."""

    known_hosts: str = "~/.ssh/known_hosts"  # file read, and appended to under accept-new
    host_key_policy: str = "accept-new"  # accept-new | strict | off
    connect_timeout: float = 10.0  # seconds for one TCP+SSH handshake attempt
    wait: float = 30.0  # keep retrying an unreachable host this long (hosts still booting)

    def __post_init__(self) -> None:
        if self.host_key_policy not in HOST_KEY_POLICIES:
            raise UserError(f"--host-key-policy: expected one of {', '.join(HOST_KEY_POLICIES)}, "
                            f"got {self.host_key_policy!r}")
        if self.connect_timeout <= 0 or self.wait < 0:
            raise UserError("--connect-timeout must be > 0 and --ssh-wait >= 0 (seconds)")
        self.known_hosts = os.path.expanduser(self.known_hosts)


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


def _known_hosts_entry(host: HostSpec) -> str:
    return host.hostname if host.port == 22 else f"[{host.hostname}]:{host.port}"


def _accept_new_policy(path: str):
    class AcceptNew(paramiko.MissingHostKeyPolicy):
        # Record the key of a host seen for the first time (OpenSSH's accept-new). paramiko's
        # AutoAddPolicy rewrites the whole file from one client's view, which loses entries
        # when several hosts are first seen in parallel: append under a lock instead.
        def missing_host_key(self, client, hostname, key):
            client.get_host_keys().add(hostname, key.get_name(), key)
            with _known_hosts_lock:
                Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                with open(path, "a") as f:
                    f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")

    return AcceptNew()


class Remote:
    """An SSH session to one host; `run` executes a shell command string."""

    def __init__(self, host: HostSpec, opts: ConnectOptions, log: HostLog):
        self.host, self.opts, self.log = host, opts, log
        self.client = None
        self.is_root = host.user == "root"

    # -- connecting --------------------------------------------------------------------------
    def connect(self) -> str:
        """Open the session (retrying while unreachable); return the host's address as seen
        by the SSH server, which is the address Ray should use for this node."""

        deadline = time.monotonic() + self.opts.wait
        last: Exception | None = None
        attempt = 0
        while True:
            attempt += 1
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
            kw = {"hostname": self.host.hostname, "port": self.host.port, "username": self.host.user,
                  "timeout": self.opts.connect_timeout, "banner_timeout": self.opts.connect_timeout,
                  "auth_timeout": self.opts.connect_timeout}
            if self.host.key_file:
                kw.update(key_filename=self.host.key_file, allow_agent=False, look_for_keys=False)
            try:
                client.connect(**kw)
                self.client = client
                self.log.write(f"connected to {self.host.user}@{self.host.label} (attempt {attempt})")
                break
            except paramiko.BadHostKeyException as e:
                entry = _known_hosts_entry(self.host)
                raise ConnectError(
                    "hostkey",
                    f"host key changed: {self.host.label} offered {e.key.get_name()} key "
                    f"{e.key.get_fingerprint().hex()[:16]}.., known_hosts has a different one. If the "
                    f"host was reinstalled, remove the old key: ssh-keygen -f "
                    f"{shlex.quote(self.opts.known_hosts)} -R {shlex.quote(entry)}") from None
            except paramiko.AuthenticationException as e:
                raise ConnectError(
                    "auth", f"authentication refused for {self.host.user}@{self.host.label} with key "
                    f"{self.host.key_file or '(agent/default keys)'}: {e}; check --username and that "
                    f"the public key is in the user's authorized_keys") from None
            except paramiko.SSHException as e:
                if "not found in known_hosts" in str(e):
                    raise ConnectError("hostkey", f"{self.host.label} is not in {self.opts.known_hosts} "
                                       "and --host-key-policy is strict; add it with ssh-keyscan") from None
                last = e  # e.g. banner timeout while sshd starts: retry
            except (TimeoutError, OSError, EOFError) as e:
                last = e
            client.close()
            if time.monotonic() + 1 > deadline:
                raise ConnectError(
                    "unreachable", f"{self.host.label} unreachable after {attempt} attempt(s) over "
                    f"{self.opts.wait:.0f}s: {type(last).__name__}: {last or 'timed out'}") from None
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        conn = self.run("echo $SSH_CONNECTION", quiet=True)
        parts = conn.stdout.split()
        return parts[2] if len(parts) >= 3 else socket.gethostbyname(self.host.hostname)

    # -- commands ----------------------------------------------------------------------------
    def wrap(self, cmd: str, sudo: bool = False) -> str:
        """The command as sent: root-needing commands go through `sudo -n` for other users."""
        if sudo and not self.is_root:
            return "sudo -n sh -c " + shlex.quote(cmd)
        return cmd

    def run(self, cmd: str, sudo: bool = False, check: bool = False, timeout: float | None = None,
            quiet: bool = False) -> Result:
        """Run a shell command; never raises on a non-zero exit (callers decide)."""
        full = self.wrap(cmd, sudo)
        if not quiet:
            self.log.write(f"$ {full}")
        t0 = time.monotonic()
        chan = self.client.get_transport().open_session()
        chan.settimeout(1.0)
        chan.exec_command(full)
        out, err = bytearray(), bytearray()
        # Drain both streams as they come: a command that fills the stderr window while we
        # wait on stdout would otherwise hang forever.
        while True:
            if chan.recv_ready():
                out += chan.recv(65536)
            elif chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            elif chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                break
            else:
                if timeout and time.monotonic() - t0 > timeout:
                    chan.close()
                    res = Result(full, 124, out.decode(errors="replace"),
                                 err.decode(errors="replace") + f"\n(timed out after {timeout:.0f}s)",
                                 time.monotonic() - t0)
                    self.log.write(res.tail(20) + "\n-> rc=124 timeout")
                    return res
                time.sleep(0.05)
        rc = chan.recv_exit_status()
        chan.close()
        res = Result(full, rc, out.decode(errors="replace"), err.decode(errors="replace"),
                     time.monotonic() - t0)
        if not quiet:
            body = (res.stdout + res.stderr).strip()
            self.log.write((body + "\n" if body else "") + f"-> rc={rc} ({res.seconds:.1f}s)")
        return res

    def put_text(self, text: str, path: str, mode: int = 0o600) -> None:
        """Write a small file (e.g. secrets) over SFTP: never part of a command line or log."""
        sftp = self.client.open_sftp()
        try:
            d = os.path.dirname(path)
            if d:
                self.run("mkdir -p -m 700 " + shlex.quote(d), quiet=True)
            with sftp.open(path, "w") as f:
                f.chmod(mode)
                f.write(text)
        finally:
            sftp.close()
        self.log.write(f"wrote {path} (mode {oct(mode)}, contents not logged)")

    def close(self) -> None:
        if self.client:
            self.client.close()
            self.client = None


@dataclass
class DryRemote:
    """Records what would run; checks report "not satisfied" so every action is listed."""

    host: HostSpec
    commands: list[tuple[str, str]] = field(default_factory=list)  # (kind, command)

    @property
    def is_root(self) -> bool:
        return self.host.user == "root"

    wrap = Remote.wrap

    def connect(self) -> str:
        self.commands.append(("connect", f"ssh -p {self.host.port} {self.host.user}@{self.host.hostname}"))
        return self.host.hostname

    def run(self, cmd: str, sudo: bool = False, check: bool = False, timeout: float | None = None,
            quiet: bool = False) -> Result:
        full = self.wrap(cmd, sudo)
        self.commands.append(("check" if check else "run", full))
        return Result(full, 1 if check else 0)

    def put_text(self, text: str, path: str, mode: int = 0o600) -> None:
        self.commands.append(("put", f"sftp put (contents hidden) -> {path} mode {oct(mode)}"))

    def close(self) -> None:
        pass
