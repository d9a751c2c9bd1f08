"""This machine's processes as Linux's /proc shows them: who started whom, which session holds whom.

    from areal_kit.procs import stat_fields
    parents = {pid: int(f[1]) for pid, f in stat_fields().items()}   # pid -> parent pid
"""

from __future__ import annotations

import os


def stat_fields() -> dict[int, list[str]]:
    """Each live process's /proc/PID/stat fields after its command name: [state, ppid, pgrp,
    session, ...]. A process that ends while it is read is left out."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    # The name, in parentheses, may hold spaces and parentheses itself: split after its last ")".
                    out[int(d)] = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
    return out
