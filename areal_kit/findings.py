"""A failed check, as every doctor prints it: where, what, measured against expected, and the fix.
The SSH cluster's doctor (cluster/doctor.py) and Slurm's (slurm/doctor.py) both report them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Finding:
    """One failed check: where, what, measured vs expected, and how to fix it."""

    host: str
    check: str
    measured: str
    expected: str
    fix: str

    def line(self) -> str:
        return f"{self.host} {self.check}: {self.measured}, expected {self.expected}; fix: {self.fix}"
