"""The fault campaign of bench/faults.py in CI, one fault of each signal kind and a torn checkpoint:
a tiny run whose driver is SIGKILLed and SIGTERMed, whose trainer and engine processes are
SIGKILLed and whose engine is stopped (SIGSTOP: a hang), and whose driver is SIGKILLed once more
with a file of its newest recover checkpoint then cut short, each at a random moment, finishes
with every step once in metrics.jsonl, every fault resumed from, the torn checkpoint passed over
for the one before it, and no checkpoint that failed to load.

    .venv/bin/python -m pytest tests/integration/test_fault_campaign.py -v
"""

import os
import sys

import pytest

from bench.faults import SIGNALS, campaign

# long: each kind's relaunch or resume has its own CI test (test_failure_relaunch, test_hang_relaunch,
# test_recover_tiny, test_run_failure); this runs them all in one run.
pytestmark = [pytest.mark.integration, pytest.mark.long]


def test_one_run_survives_one_fault_of_each_kind(tmp_path):
    if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "areal-kit")):
        pytest.skip("areal-kit is not installed in this interpreter's environment")
    kinds = [*SIGNALS, "torn-checkpoint"]
    t = campaign(kinds, seed=3, root=str(tmp_path), compare=False)
    assert t["exit_code"] == 0, t["log"]
    assert t["resumed"] == len(kinds)
    assert t["steps_lost"] == 0
    assert t["steps_twice_in_metrics"] == 0
    assert t["failed_resumes"] == 0
    assert t["torn_passed_over"] == 1  # resumed from the checkpoint before the torn one, not refused
    # Three re-runs of the command (SIGKILL, SIGTERM, SIGKILL before the tear) and three relaunches
    # inside one: every fault but the SIGTERM (which checkpoints the step under way) resumed from a checkpoint.
    assert t["launches"] == 4
    assert t["resumes_from_checkpoint"] == len(kinds)
