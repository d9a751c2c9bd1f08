"""The test command exits clean after heavy tests: a pytest process that ran a streaming RL run
(Ray, vLLM's AsyncLLM engine, DeepSpeed on gloo, the reward pool), a Ray-actor test, an offline wandb
run and the math grader's worker processes exits 0, with nothing it started still running (tests/conftest.py names and fails what is left, under
AREAL_TESTS_STRICT_EXIT). A crash while the interpreter shuts down (exit 139 after the summary)
fails here too, and its stacks are in the output (the faulthandler kept on after the session).

    .venv/bin/python -m pytest tests/integration/test_suite_exits_clean.py
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# long: CI's own pytest process, which runs these tests and more, exits the same way.
pytestmark = pytest.mark.long
TESTS = Path(__file__).resolve().parents[1]
HEAVY = ["integration/test_stream_tiny.py::test_a_streaming_run_trains_every_step_once_within_the_bound",
         "integration/test_controller_actors.py::test_dead_workers_counts_killed_actors_only",
         # two services that live until exit (wandb's, the grader's pool): the hook closes them as
         # exit would, and must not report them
         "unit/test_recover_checkpoint.py::test_a_resumed_run_continues_the_same_wandb_run",
         "unit/test_reward_grader.py::test_grade_from_a_non_main_thread_uses_worker_processes"]


def test_a_pytest_process_that_ran_heavy_tests_exits_zero_with_nothing_left_running(tmp_path):
    env = {**os.environ, "AREAL_TESTS_STRICT_EXIT": "1"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path),
                        *[str(TESTS / t) for t in HEAVY]], cwd=TESTS.parent, capture_output=True, text=True,
                       timeout=900, env=env, check=False)
    out = p.stdout[-3000:] + p.stderr[-3000:]
    assert f"{len(HEAVY)} passed" in p.stdout, out
    assert "tests left running at exit" not in p.stderr, out
    assert p.returncode == 0, out
