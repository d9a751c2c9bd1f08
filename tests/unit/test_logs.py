"""The log lines users grep (the AReaL guide's lines), the ETA, run paths and metrics.jsonl.

Each kind of line round-trips: its parser gives its writer's values back, from the message alone or
with the logger's time and level before it; and it reads the values out of a line copied from a real
run's train.log (the tiny preset's, a relaunch and a stop from other runs)."""

import ast
import json
import math
import os
import re
import subprocess
import time

import pytest

from areal_kit import logs, runlog
from areal_kit.logs import RPC_KEYS, epoch_line, rpc_line
from areal_kit.runlog import StepTimer, run_paths

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
    step = logs.parse_epoch(epoch_line(3, 4, 7, 9, 25, 10, 1, 2, 3))
    assert (step.epoch, step.n_epochs, step.step, step.steps_per_epoch, step.global_step) == (3, 4, 7, 9, 25)


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


def test_rpc_line_round_trip_with_nan_and_inf():
    stats = {"task_reward": 0.5, "actor_loss": math.inf, "grad_norm": -math.inf, "n_seqs": 256, "staleness": 0}
    back = logs.parse_rpc(f"20261126-22:36:59 INFO {rpc_line({**stats, 'entropy': math.nan})}")
    assert math.isnan(back.pop("entropy")) and back == stats
    assert list(back)[:2] == ["actor_loss", "task_reward"]  # the guide's order, as written


def test_a_line_that_only_looks_like_a_stat_line_is_not_run():
    assert logs.parse_rpc("RPC name actor_train returns {'a': __import__('os').getcwd()}") is None
    assert logs.parse_rpc("RPC name actor_train returns {'a': 1") is None


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
    log = runlog.RunLogger(paths, tensorboard=False, console=False)
    log.info(GUIDE_EPOCH_LINE)
    log.step(1, {"task_reward": 0.25, "n_seqs": 256})
    log.step(2, {"task_reward": 0.5, "n_seqs": 256})
    log.close()
    with open(paths.log_file) as f:
        text = f.read()
    assert text.rstrip().endswith(GUIDE_EPOCH_LINE)
    with open(paths.metrics_file, "a") as f:
        f.write('{"global_step": 3, "task_')  # a torn last line after a crash
    rows = runlog.read_metrics(paths.metrics_file)
    assert [r["global_step"] for r in rows] == [1, 2]
    assert [r["task_reward"] for r in rows] == [0.25, 0.5]
    assert runlog.read_metrics(str(tmp_path / "none.jsonl")) == []


def test_a_failure_goes_to_train_log_with_its_traceback_and_not_to_the_console(tmp_path, capsys):
    paths = run_paths(str(tmp_path), "exp", "t", user="u")
    log = runlog.RunLogger(paths, tensorboard=False, console=True)
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
    log = runlog.RunLogger(paths, tensorboard=True, console=False)
    for g in (1, 2, 3, 4):
        log.step(g, {"task_reward": 0.1 * g})
    log.close()
    with open(paths.metrics_file, "a") as f:
        f.write('{"global_step": 5, "task_')  # killed mid-write
    for resumed_at, until in ((2, 5), (3, 6)):  # resumed from step 2's checkpoint, then from step 3's
        log = runlog.RunLogger(paths, tensorboard=True, console=False)
        log.resume_at(resumed_at)
        for g in range(resumed_at + 1, until + 1):
            log.step(g, {"task_reward": 0.5 + 0.01 * g})
        log.close()
    rows = runlog.read_metrics(paths.metrics_file)
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
    log = runlog.RunLogger(paths, tensorboard=False, console=False)
    log.step(1, {"task_reward": 0.25})
    log.resume_at(0)
    log.step(1, {"task_reward": 0.75})
    log.close()
    assert [r["task_reward"] for r in runlog.read_metrics(paths.metrics_file)] == [0.75]


# -- each line kind: written, then parsed back ------------------------------------------------
STAMPS = ("", "20261126-22:36:59 INFO ", "20261126-22:36:59 WARNING ")


@pytest.mark.parametrize("stamp", STAMPS)
@pytest.mark.parametrize("write,parse,values", [
    (logs.run_line, logs.parse_run, ("tiny/run0", 2500, 100, 3200, 0, "/r/logs/root/tiny/run0")),
    (logs.run_line, logs.parse_run, ("a/b", 10, 5, 48, 2, "/dir with space")),
    (logs.ready_line, logs.parse_ready, (12.5, "1 trainer rank(s) (setup 4.1s), weight sync auto: gloo")),
    (epoch_line, logs.parse_epoch, (2, 25, 7, 100, 107, 1893, 0.204, 31.25, None)),
    (epoch_line, logs.parse_epoch, (1, 1, 6, 19, 6, 111847, 2299.448, 13720.729, 29350.673)),
    (logs.finished_line, logs.parse_finished, (2500, 0.8516)),
    (logs.stopped_line, logs.parse_stopped, ("Ctrl-C", 0, "")),
    (logs.stopped_line, logs.parse_stopped, ("SIGTERM", 646, "/r/recover/root/tiny/run0/globalstep646")),
    (logs.relaunch_line, logs.parse_relaunch, ("timeout in global step 3: WorkerHang: (x) no reply", 1, 2)),
    (logs.resume_line, logs.parse_resume, ("/r/globalstep10", 10, 5, 2, "2026-11-26 21:58:43", 12)),
])
def test_each_line_kind_parses_back_to_what_was_written(stamp, write, parse, values):
    parsed = parse(stamp + write(*values))
    assert tuple(vars(parsed).values()) == values


@pytest.mark.parametrize("stamp", STAMPS)
@pytest.mark.parametrize("write,parse,value", [
    (logs.failed_line, logs.parse_failed, "Trainer.train_step: ValueError: packed batch has 3 rows (expected 4)"),
    (logs.after_sigterm_line, logs.parse_after_sigterm, "Trainer.train_step: RayActorError: (died)"),
])
def test_the_one_value_lines_parse_back(stamp, write, parse, value):
    assert parse(stamp + write(value)) == value


def test_the_clis_error_line_parses_back():
    assert logs.parse_error(logs.error_line("unknown preset 'x'")) == "unknown preset 'x'"
    assert logs.parse_error("20261126-22:36:59 INFO error: x") is None  # the CLI's line starts its line


def test_a_finished_run_without_a_reward_says_nan():
    assert math.isnan(logs.parse_finished(logs.finished_line(3, math.nan)).task_reward)


# Lines copied from real runs' train.log: the tiny preset's (areal-kit train tiny), a LoRA run's
# stop and relaunch, a resumed run's.
REAL = {
    "run": "20261126-22:36:46 INFO Run tiny/run0: 2500 steps, 100 per epoch, 3200 prompts; logs in "
           "/work/baseline/tiny/logs/root/tiny/run0",
    "ready": "20261126-22:36:59 INFO Workers ready in 12.5s: 1 trainer rank(s) (setup 4.1s, attention areal_varlen "
             "(per-sequence SDPA; on CPU)), 1 rollout engine(s) (setup 8.2s), weight sync auto: shared memory for 26 "
             "of 26 tensors.",
    "rpc": "20261126-22:36:59 INFO RPC name actor_train returns {'ppo_approx_kl': -0.0, 'actor_loss': 0.0111, "
           "'actor_clip_ratio': 0.0, 'importance_weight': 1.0, 'task_reward': 0.0352, 'kl_reward': -0.0, "
           "'final_reward': 0.0352, 'advantage': 0.0, 'avg_seq_len': 2.3945, 'avg_prompt_len': 5.0, 'n_tokens': 1893, "
           "'n_valid_tokens': 613, 'n_seqs': 256, 'no_eos_ratio': 0.0312, 'perc_zero_adv': 0.7188, 'entropy': 1.3017, "
           "'grad_norm': 0.2077, 'staleness': 0}",
    "epoch": "20261126-22:36:59 INFO Epoch 1/25 step 3/100 (global step 3) finishes. Average #tokens per batch is "
             "1885. #End to end# execution time: *0.067*s. Total time consumption: 0.359s. Estimated remaining time: "
             "167.997s.",
    "finished": "20261126-22:41:59 INFO Training finished: 2500 steps, final task_reward 0.8516.",
    "stopped": "20261126-22:53:10 WARNING Run interrupted (SIGTERM) after global step 646, with its recover checkpoint "
               "/tmp/h6/kl05s1/recover/root/tiny_lora/run0/globalstep646; the same command resumes it from there.",
    "relaunch": "20261126-22:46:23 WARNING Worker failure (ActorDiedError: The actor died because of an error raised "
                "in its creation task, \x1b[36mray::TrainerWorker.__init__()\x1b[39m (pid=25363, ip=192.0.2.2, "
                "actor_id=65ccbfc0939a5d2cd62c27f201000000, repr=<areal_kit.rl.trainer.worker.FunctionActorManager."
                "_create_fake_actor_class.<locals>.TemporaryActor object at 0x7f472bf1f4); relaunching from the last "
                "recover checkpoint (retry 1/1).",
    "resume": "20261126-21:58:52 INFO Will recover from: /tmp/areal-kit-testbed/storage/ray/experiments/recover/root/"
              "mine/run0/globalstep10 (global step 10, epoch 5 step 2, written 2026-11-26 21:58:43); resuming at "
              "global step 11 of 12.",
}


def test_real_lines_give_their_values():
    assert logs.parse_run(REAL["run"]) == logs.RunStart("tiny/run0", 2500, 100, 3200, 0,
                                                        "/work/baseline/tiny/logs/root/tiny/run0")
    ready = logs.parse_ready(REAL["ready"])
    assert ready.seconds == 12.5 and ready.detail.endswith("shared memory for 26 of 26 tensors")
    rpc = logs.parse_rpc(REAL["rpc"])
    assert (rpc["task_reward"], rpc["n_tokens"], rpc["staleness"]) == (0.0352, 1893, 0)
    assert list(rpc)[:len(RPC_KEYS)] == list(RPC_KEYS)
    assert logs.parse_epoch(REAL["epoch"]) == logs.Epoch(1, 25, 3, 100, 3, 1885, 0.067, 0.359, 167.997)
    assert logs.parse_finished(REAL["finished"]) == logs.Finished(2500, 0.8516)
    assert logs.parse_stopped(REAL["stopped"]) == logs.Stopped(
        "SIGTERM", 646, "/tmp/h6/kl05s1/recover/root/tiny_lora/run0/globalstep646")
    relaunch = logs.parse_relaunch(REAL["relaunch"])
    assert (relaunch.attempt, relaunch.retries) == (1, 1)
    assert relaunch.cause.startswith("ActorDiedError: ") and relaunch.cause.endswith("object at 0x7f472bf1f4")
    assert logs.parse_resume(REAL["resume"]) == logs.Resume(
        "/tmp/areal-kit-testbed/storage/ray/experiments/recover/root/mine/run0/globalstep10", 10, 5, 2,
        "2026-11-26 21:58:43", 12)
    assert logs.line_time(REAL["run"]) == time.mktime((2026, 11, 26, 22, 36, 46, 0, 0, -1))


def test_each_parser_takes_its_own_kind_only():
    parsers = {"run": logs.parse_run, "ready": logs.parse_ready, "rpc": logs.parse_rpc, "epoch": logs.parse_epoch,
               "finished": logs.parse_finished, "stopped": logs.parse_stopped, "relaunch": logs.parse_relaunch,
               "resume": logs.parse_resume}
    for kind, line in REAL.items():
        assert [k for k, parse in parsers.items() if parse(line) is not None] == [kind]
        assert logs.parse_failed(line) is None and logs.parse_after_sigterm(line) is None
        assert logs.parse_error(line) is None


def test_grep_picks_the_same_lines_as_the_parsers(tmp_path):
    """grep -E with grep_pattern, as setup runs it on the head, keeps the lines of the kinds asked for."""
    heads = (logs.RUN_HEAD, logs.READY_HEAD, logs.EPOCH_HEAD, logs.FINISHED_HEAD, logs.ERROR_HEAD,
             logs.RELAUNCH_HEAD)
    other = ["20261126-22:36:59 INFO Dumped recover info to file.", "Traceback (most recent call last):",
             "ValueError: Run failed: inside a traceback", "  Epoch 3 of a quoted line"]
    cli_error = logs.error_line("vllm.d16p1m1+d8p2m1 needs 16+16=32 GPUs")
    wanted = [REAL["run"], REAL["ready"], REAL["epoch"], REAL["finished"], REAL["relaunch"], cli_error,
              "20261126-22:46:29 ERROR " + logs.failed_line("ValueError: (x)"), REAL["stopped"]]
    log = tmp_path / "train.log"
    log.write_text("\n".join([*other, REAL["rpc"], REAL["resume"], *wanted]) + "\n")
    out = subprocess.run(["grep", "-aE", logs.grep_pattern(*heads), str(log)], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == wanted
    assert [ln for ln in log.read_text().splitlines() if re.search(logs.grep_pattern(*heads), ln)] == wanted
