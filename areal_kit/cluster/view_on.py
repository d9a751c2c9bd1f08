"""`areal-kit view RUN --cluster NAME`: the page of a run on a cluster, for a workstation that neither
mounts the cluster's storage nor reaches the head's ports. Over the SSH route setup saved for NAME
(its jump host, users, keys), `areal-kit view` starts on the head where the run's files are (in the
head's container under the docker runtime), listening on the head's loopback only, and a local
port is forwarded to it through the same SSH connection; the page is then this machine's
http://127.0.0.1:PORT/. Ctrl-C here ends the forward and closes the session, whose end (its stdin
closing) stops the viewer on the head.

    areal-kit view tiny/run0 --cluster areal            # http://127.0.0.1:8420/ on this machine
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import socket
import time

from areal_kit.cluster import cmd as cluster_cmd
from areal_kit.cluster import steps
from areal_kit.cluster.options import ConnectOptions, SetupOptions, q, saved_cluster
from areal_kit.cluster.parallel import StepFailed
from areal_kit.cluster.remote import Remote
from areal_kit.errors import RunFailed, UserError

START_S = 120.0  # for the head's viewer to print its address (it reads the run's index and metrics first)
_ADDRESS = re.compile(r" at http://127\.0\.0\.1:(\d+)/")


def viewer_cmd(opts: SetupOptions, run: str, user: str = "", fileroot: str = "") -> str:
    """The command the head runs: `areal-kit view` of run (as given here: EXP/TRIAL under the
    cluster's fileroot, a log folder on the head, or "" for the latest) on 127.0.0.1 and a free
    port, from the storage folder as the driver runs. It ends with the viewer, or when its stdin
    closes (the SSH session's end: the watcher stops the viewer). In the head's container under the
    docker runtime (`-i`: the session's stdin reaches it)."""
    view = [opts.python, "-m", "areal_kit.cli", "view", *([run] if run else []),
            "--fileroot", fileroot or opts.spec.fileroot, *(["--user", user] if user else []),
            "--host", "127.0.0.1", "--port", "0"]
    # fd 3: the session's stdin, for the watcher (a background job's own stdin is /dev/null)
    body = (f"cd {shlex.quote(opts.storage)} && exec 3<&0 && {{ {shlex.join(view)} < /dev/null & p=$!; "
            f"{{ cat <&3 > /dev/null; kill $p 2>/dev/null; }} & wait $p; }}")
    if opts.runtime == "docker":
        return q("docker", "exec", "-i", f"{opts.container_prefix}-head", "sh", "-c", body)
    return q("sh", "-c", body)


def view_on(name: str, run: str, user: str, fileroot: str, host: str, port: int, copts: ConnectOptions) -> None:
    """Serve run's page of cluster name here on host:port (free: the command has bound it once, so
    that a port in use is its one line before any host), until Ctrl-C or the head's viewer ends."""
    opts = dataclasses.replace(saved_cluster(name), dry_run=False, log_dir=None)
    copts = dataclasses.replace(copts, ssh_config=opts.ssh_config, gateway=opts.gateway)
    cluster = cluster_cmd._build(opts, copts, {})
    head = cluster.head
    try:
        try:
            steps.connect(cluster, head)
        except StepFailed as e:
            raise RunFailed(f"cluster {name}, head {head.name}: {e}") from None
        remote = head.remote
        assert isinstance(remote, Remote), "a connected head's session is an SSH one"
        conn = remote.conn
        chan = conn.client.get_transport().open_session()
        chan.exec_command(remote.wrap(viewer_cmd(opts, run, user, fileroot), sudo=opts.runtime == "docker"))
        out, err = chan.makefile("r"), chan.makefile_stderr("r")
        chan.settimeout(START_S)
        remote_port, said = None, ""
        try:
            for line in out:
                said = line.strip() or said
                if m := _ADDRESS.search(line):
                    remote_port = int(m[1])
                    break
        except TimeoutError:
            raise RunFailed(f"cluster {name}: the viewer on {head.name} printed no address in {START_S:g}s "
                            f"(last: {said or 'nothing'})") from None
        if remote_port is None:
            _ended(name, head.name, chan.recv_exit_status(), err.read().decode(errors="replace"), said)
        chan.settimeout(None)
        with conn.forward_local(port, remote_port=remote_port, remote_host="127.0.0.1", local_host=host):
            _until_listening(host, port)
            shown = f"[{host}]" if ":" in host else host
            print(f"areal-kit view: {run or 'the latest run'} on cluster {name}, head {head.name} "
                  f"(its 127.0.0.1:{remote_port}) at http://{shown}:{port}/ (Ctrl-C stops the page here "
                  "and on the head)", flush=True)
            tail = b""
            try:
                while not chan.exit_status_ready():  # what the viewer writes is read, so it never blocks on it
                    while chan.recv_ready():
                        chan.recv(1 << 16)
                    while chan.recv_stderr_ready():
                        tail = (tail + chan.recv_stderr(1 << 16))[-(1 << 14):]
                    time.sleep(0.5)
            except KeyboardInterrupt:  # the page's end, as the local viewer's Ctrl-C: the session's close stops the head's
                return
        rest = b"".join(iter(lambda: chan.recv_stderr(1 << 16), b""))
        _ended(name, head.name, chan.recv_exit_status(), (tail + rest).decode(errors="replace"), said)
    finally:
        cluster_cmd._close(cluster)


def _until_listening(host: str, port: int, within_s: float = 30.0) -> None:
    """fabric's forward_local binds its port on a thread of its own, after it has returned: the
    address is printed once a connection there is taken, so that a browser sent to it finds it."""
    probe = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
    deadline = time.monotonic() + within_s
    while True:
        try:
            socket.create_connection((probe, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RunFailed(f"the page's port {host}:{port} was not listening after {within_s:g}s") from None
            time.sleep(0.05)


def _ended(name: str, head: str, rc: int, stderr: str, said: str) -> None:
    """The head's viewer ended by itself: its own line, as bad input (its exit 2) or a failure."""
    last = next((ln.strip() for ln in reversed(stderr.splitlines()) if ln.strip()), said or f"exit {rc}")
    last = re.sub(r"^(error|Error):\s*", "", last)
    msg = f"cluster {name}, head {head}: {last}"
    if rc == 2:
        raise UserError(msg)
    raise RunFailed(msg)
