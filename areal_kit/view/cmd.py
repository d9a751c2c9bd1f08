"""`areal-kit view [RUN]`: serve the run's page on this machine and print its address. The command's
options are view_options' (and --cluster, cluster/cmd.py's OnCluster's, for a run on a cluster's head:
cluster/view_on.py); cli.py finds the run through monitor.py (as `logs` does) and calls serve."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable

import typer

from areal_kit.errors import UserError
from areal_kit.runlog import RunPaths

DEFAULT_PORT = 8420


def listen(host: str, port: int) -> socket.socket:
    """The page's socket, bound now: a port in use is one line before anything else starts."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: {e.strerror}; expected an address of this machine (127.0.0.1, 0.0.0.0)") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise UserError(f"port {port} on {host} is in use or not allowed ({e.strerror}); pick another with --port "
                        "(--port 0: any free port)") from None
    sock.listen(128)
    return sock


def view_options(
    run: str = typer.Argument("", help="The run: its log folder ({fileroot}/logs/{user}/{exp}/{trial}), EXP/TRIAL "
                                       "under --fileroot, or nothing for the run written last there."),
    port: int = typer.Option(DEFAULT_PORT, "--port", min=0, max=65535, help="Port of the page (0: any free one)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to serve on (0.0.0.0: every interface; the page "
                                                         "has no login, so only on a network you trust)."),
) -> None:
    """Serve one local page of a run, live: its trend, steps, answers token by token, times and config.

    Reads the run's files only; Ctrl-C stops the page, not the run."""


def serve(files: RunPaths, name: str, host: str, port: int, summary: Callable[[], list[str]] | None = None) -> None:
    """The page of the run whose files these are, on host:port, until Ctrl-C; summary: where the run
    stands, as `areal-kit logs` says it (the command passes monitor's)."""
    import uvicorn

    from areal_kit.view.app import RunData, make_app

    sock = listen(host, port)
    data = RunData(files, name, summary)
    for note in data.notes():
        print(f"note: {note}", file=sys.stderr, flush=True)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    print(f"areal-kit view: {name} ({files.log_dir}) at http://{shown}:{bound}/ (Ctrl-C stops the page)", flush=True)
    server = uvicorn.Server(uvicorn.Config(make_app(data), log_level="warning", access_log=False))
    try:
        server.run(sockets=[sock])
    finally:
        data.metrics.save_cache()
        sock.close()
