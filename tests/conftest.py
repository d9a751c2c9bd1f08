"""Shared pytest setup: markers by folder (unit, integration, cluster, gpu); the fake_model and kit_home
fixtures; at the end, what the tests left running is named and ended before the interpreter exits."""

import os
import signal
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# Under `-n 2` (the README's test command) the tests run on two workers, a module at a time, in
# the order they are collected: the cluster tests first, as one unit on one worker (they share one
# testbed, a session fixture, which is a worker's own; their time goes to SSH, Docker and Slurm in
# the testbed's network namespaces, so the other worker's tests run beside them), then the
# integration modules (minutes each: Ray, DeepSpeed and vLLM), then the unit modules (seconds
# each), which fill the end so that the two workers finish close together.
SERIAL_UNITS = ("cluster",)


def serial_unit(nodeid: str) -> str | None:
    """The serial unit a test belongs to (its folder, if one of SERIAL_UNITS), or None."""
    parts = nodeid.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in SERIAL_UNITS else None


def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduler by module, in collection order (not its default, most tests first: the
    long units must start first), with each serial unit one piece of work (on one worker)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByKind(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return serial_unit(nodeid) or super()._split_scope(nodeid)

    config.option.loadscopereorder = False
    return ByKind(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).relative_to(ROOT / "tests").parts
        if parts and parts[0] in ("unit", "integration", "cluster", "gpu"):
            item.add_marker(getattr(pytest.mark, parts[0]))


@pytest.fixture
def fake_model(tmp_path):
    """A model folder that passes the commands' path checks and loads nothing (bad-input tests)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture
def kit_home(tmp_path, monkeypatch):
    """A private AREAL_KIT_HOME: cluster state saved by one test is never read by another."""
    monkeypatch.setenv("AREAL_KIT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def pytest_unconfigure(config):
    """pytest's own faulthandler stops at the end of the session; a crash while the interpreter shuts
    down (a native thread of Ray, vLLM, torch or DeepSpeed outliving its test) would then exit 139 with
    no trace. Keep one on until the process is gone, so such a crash names where it happened."""
    import faulthandler
    import sys

    faulthandler.enable(file=sys.__stderr__, all_threads=True)


# Set by tests/integration/test_suite_exits_clean.py: what is left running fails the session.
STRICT_EXIT = "AREAL_TESTS_STRICT_EXIT"


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command name) of every live process below pid, from /proc."""
    parent = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if entry.isdigit() and rest[0] != "Z":  # a zombie has exited already
            parent[int(entry)] = (int(rest[1]), name)
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [(c, n) for c, (pp, n) in parent.items() if pp == p]
        found += kids
        frontier += [c for c, _ in kids]
    return found


def _left_running() -> list[tuple[int, str]]:
    # multiprocessing's resource tracker is meant to outlive its users: it exits with this
    # interpreter, when the pipe to it closes.
    return [(p, n) for p, n in descendants(os.getpid()) if "multiprocessing.resource_tracker" not in _cmdline(p)]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return ""


def _close_what_exit_would_close(modules: dict) -> None:
    """Two services are meant to live until the interpreter exits, and close from atexit, which
    runs after this hook: the math grader's worker pool and wandb's service process. Closed here,
    as exit would, so that what remains is what a test really left behind."""
    if "areal_kit.reward.math_grader" in modules:
        modules["areal_kit.reward.math_grader"].workers.close()
    if "wandb" in modules:
        modules["wandb"].teardown()


def pytest_sessionfinish(session, exitstatus):
    """Every test must leave nothing running: a Ray cluster, a vLLM engine core or a DeepSpeed child
    that outlives its test keeps native threads attached to this interpreter, which can crash it
    at exit after the summary. Ray is shut down if a test left it up; what still runs is named on
    one line and ended."""
    import sys

    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()
    _close_what_exit_would_close(sys.modules)
    deadline = time.time() + 10  # processes a test's own shutdown has already asked to exit
    left = _left_running()
    while left and time.time() < deadline:
        time.sleep(0.5)
        left = _left_running()
    if not left:
        return
    print(f"\ntests left running at exit: {', '.join(f'{n}[{p}] {_cmdline(p)}' for p, n in left)}",
          file=sys.__stderr__, flush=True)
    for p, _ in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if os.environ.get(STRICT_EXIT):
        session.exitstatus = 1
