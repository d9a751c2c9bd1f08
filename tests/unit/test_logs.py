"""The log lines users grep (the AReaL guide's lines), the ETA, run paths and metrics.jsonl."""

import ast
import json
import os
import re

from areal_kit import logs
from areal_kit.logs import RPC_KEYS, StepTimer, epoch_line, rpc_line, run_paths

GUIDE_EPOCH_LINE = ("Epoch 1/1 step 6/19 (global step 6) finishes. Average #tokens per batch is 111847. "
                     "#End to end# execution time: *2299.448*s. Total time consumption: 13720.729s. "
                     "Estimated remaining time: 29350.673s.")
GUIDE_RPC_KEYS = ["ppo_approx_kl", "actor_loss", "actor_clip_ratio", "importance_weight", "task_reward",
                   "kl_reward", "final_reward", "advantage", "avg_seq_len", "avg_prompt_len", "n_tokens",
                   "n_valid_tokens", "n_seqs", "no_eos_ratio"]


def test_epoch_line_exactly_as_design():
    line = epoch_line(1, 1, 6, 19, 6, 111847.0, 2299.448, 13720.729, 29350.673)
    assert line == GUIDE_EPOCH_LINE


def test_epoch_line_rounding_and_no_eta():
    line = epoch_line(2, 10, 1, 100, 101, 4607.6, 0.0754, 7.5, None)
    assert line == ("Epoch 2/10 step 1/100 (global step 101) finishes. Average #tokens per batch is 4608. "
                    "#End to end# execution time: *0.075*s. Total time consumption: 7.500s.")
    assert "Estimated remaining time" not in line


def test_epoch_line_greppable():
    line = epoch_line(3, 4, 7, 9, 25, 10, 1, 2, 3)
    m = re.fullmatch(r"Epoch (\d+)/(\d+) step (\d+)/(\d+) \(global step (\d+)\) finishes\. .*", line)
    assert m
    assert m.groups() == ("3", "4", "7", "9", "25")


def test_rpc_line_keys_in_design_order_and_parsable():
    stats = {k: float(i) for i, k in enumerate(reversed(GUIDE_RPC_KEYS))}
    stats["perc_zero_adv"] = 0.25
    line = rpc_line(stats)
    prefix = "RPC name actor_train returns "
    assert line.startswith(prefix)
    d = ast.literal_eval(line[len(prefix):])
    assert list(d)[:len(GUIDE_RPC_KEYS)] == GUIDE_RPC_KEYS
    assert list(d)[-1] == "perc_zero_adv"
    assert d == stats
    assert "'task_reward': " in line
    assert list(RPC_KEYS) == GUIDE_RPC_KEYS


def test_rpc_line_hand_example():
    assert rpc_line({"task_reward": 0.5, "actor_loss": -0.1}) == \
        "RPC name actor_train returns {'actor_loss': -0.1, 'task_reward': 0.5}"


def test_eta_from_step_3_averaged_over_steps_after_the_first_two():
    t = StepTimer()
    t.add(100.0)  # warm-up
    assert t.eta(10) is None
    t.add(50.0)  # warm-up
    assert t.eta(10) is None
    t.add(4.0)
    assert t.eta(10) == 40.0
    t.add(6.0)
    assert t.eta(10) == 50.0  # mean(4, 6) x 10, the 100 and 50 are not counted
    assert t.total == 160.0
    assert t.eta(0) == 0.0


def test_timer_state_round_trip():
    t = StepTimer()
    for s in (9.0, 8.0, 2.0, 4.0):
        t.add(s)
    t2 = StepTimer(json.loads(json.dumps(t.state_dict())))
    assert t2.total == 23.0
    assert t2.eta(3) == t.eta(3) == 9.0


def test_run_paths(tmp_path):
    p = run_paths(str(tmp_path), "exp", "trial", user="alice")
    assert p.log_file == f"{tmp_path}/logs/alice/exp/trial/train.log"
    assert p.metrics_file == f"{tmp_path}/logs/alice/exp/trial/metrics.jsonl"
    assert p.recover_dir == f"{tmp_path}/recover/alice/exp/trial"
    assert p.ckpt_dir == f"{tmp_path}/checkpoints/alice/exp/trial"


def test_run_logger_writes_lines_and_metrics(tmp_path):
    paths = run_paths(str(tmp_path), "exp", "t", user="u")
    log = logs.RunLogger(paths, tensorboard=False, console=False)
    log.info(GUIDE_EPOCH_LINE)
    log.step(1, {"task_reward": 0.25, "n_seqs": 256})
    log.step(2, {"task_reward": 0.5, "n_seqs": 256})
    log.close()
    with open(paths.log_file) as f:
        text = f.read()
    assert text.rstrip().endswith(GUIDE_EPOCH_LINE)
    with open(paths.metrics_file, "a") as f:
        f.write('{"global_step": 3, "task_')  # a torn last line after a crash
    rows = logs.read_metrics(paths.metrics_file)
    assert [r["global_step"] for r in rows] == [1, 2]
    assert [r["task_reward"] for r in rows] == [0.25, 0.5]
    assert logs.read_metrics(str(tmp_path / "none.jsonl")) == []


def test_a_failure_goes_to_train_log_with_its_traceback_and_not_to_the_console(tmp_path, capsys):
    paths = run_paths(str(tmp_path), "exp", "t", user="u")
    log = logs.RunLogger(paths, tensorboard=False, console=True)
    try:
        raise ValueError("kv cache larger than memory")
    except ValueError as e:
        log.failure("Run failed: ValueError: kv cache larger than memory", e)
    log.close()
    with open(paths.log_file) as f:
        text = f.read()
    assert " ERROR Run failed: ValueError: kv cache larger than memory\nTraceback (most recent call last):" in text
    assert text.rstrip().endswith("ValueError: kv cache larger than memory")
    assert capsys.readouterr().out == ""


def test_a_resumed_run_logs_every_step_once(tmp_path):
    """Steps redone after a resume replace their earlier rows and tensorboard events (read back
    with tensorboard's own event reader), however many times the run resumes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    paths = run_paths(str(tmp_path), "exp", "t", user="u")
    log = logs.RunLogger(paths, tensorboard=True, console=False)
    for g in (1, 2, 3, 4):
        log.step(g, {"task_reward": 0.1 * g})
    log.close()
    with open(paths.metrics_file, "a") as f:
        f.write('{"global_step": 5, "task_')  # killed mid-write
    for resumed_at, until in ((2, 5), (3, 6)):  # resumed from step 2's checkpoint, then from step 3's
        log = logs.RunLogger(paths, tensorboard=True, console=False)
        log.resume_at(resumed_at)
        for g in range(resumed_at + 1, until + 1):
            log.step(g, {"task_reward": 0.5 + 0.01 * g})
        log.close()
    rows = logs.read_metrics(paths.metrics_file)
    assert [r["global_step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["task_reward"] for r in rows[:2]] == [0.1, 0.2], "rows before the checkpoint are kept"
    assert rows[3]["task_reward"] == 0.5 + 0.04, "a redone step's row is the new one"
    acc = EventAccumulator(os.path.join(paths.log_dir, "tensorboard"))
    acc.Reload()
    events = acc.Scalars("task_reward")
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
    assert abs(events[3].value - 0.54) < 1e-6


def test_resume_at_zero_starts_the_metrics_over(tmp_path):
    paths = run_paths(str(tmp_path), "exp", "t", user="u")
    log = logs.RunLogger(paths, tensorboard=False, console=False)
    log.step(1, {"task_reward": 0.25})
    log.resume_at(0)
    log.step(1, {"task_reward": 0.75})
    log.close()
    assert [r["task_reward"] for r in logs.read_metrics(paths.metrics_file)] == [0.75]
