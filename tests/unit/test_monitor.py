"""`areal-kit logs` and `areal-kit plot` on a synthetic run folder (no training, no Ray)."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_kit import logs, monitor, runlog
from areal_kit.cli import main

T0 = 1_700_000_000.0


def make_run(root, steps=6, resumed_at=None, finished=False, pid=None, recover_step=4, saves=(2, 4), failed="",
             interrupted="", relaunched=False):
    """A run's folders as the run writes them, its train.log lines by logs' writers."""
    p = runlog.run_paths(str(root), "tiny", "run0", "u")
    os.makedirs(p.log_dir)
    lines = [f"20231114-22:13:20 INFO {logs.run_line('tiny/run0', 10, 100, 3200, 0, p.log_dir)}"]
    rows = []
    for g in range(1, steps + 1):
        rows.append({"global_step": g, "time": T0 + g, "task_reward": 0.1 * g, "avg_seq_len": 2.0,
                     "ppo_approx_kl": 0.001 * g, "entropy": 2.0 - 0.1 * g, "e2e_time": 1.0, "epoch": 1,
                     "epoch_step": g})
        eta = (10 - g) * 1.0 if g >= 3 else None
        lines.append(f"20231114-22:13:{20 + g:02d} INFO {logs.epoch_line(1, 1, g, 100, g, 10, 1.0, g, eta)}")
    if resumed_at:  # the resumed run re-did steps after its checkpoint, with other values
        if relaunched:
            lines.append(f"20231114-22:13:59 WARNING {logs.relaunch_line('ValueError: boom', 1, 3)}")
        resume = logs.resume_line(f"/x/globalstep{resumed_at}", resumed_at, 1, resumed_at, "2023-11-14 22:13:50", 10)
        lines.append(f"20231114-22:14:00 INFO {resume}")
        for g in range(resumed_at + 1, steps + 1):
            rows.append({**rows[g - 1], "task_reward": 0.9, "time": T0 + 100 + g})
    if finished:
        lines.append(f"20231114-22:15:00 INFO {logs.finished_line(10, 0.9)}")
    if interrupted:
        lines.append(f"20231114-22:15:00 WARNING {logs.stopped_line(interrupted)}")
    if failed:  # launch.py's line, then the traceback
        lines += [f"20231114-22:15:00 ERROR {logs.failed_line(failed)}", "Traceback (most recent call last):",
                  '  File "x.py", line 1', failed.split(": ", 1)[1]]
    torn = '{"global_step": 7, "task_'  # a crash mid-write
    Path(p.metrics_file).write_text("".join(json.dumps(r) + "\n" for r in rows) + torn)
    Path(p.log_file).write_text("\n".join(lines) + "\n")
    Path(p.log_dir, "driver.json").write_text(json.dumps({"host": os.uname().nodename, "pid": pid or 999999999,
                                                          "recover_dir": p.recover_dir, "ckpt_dir": p.ckpt_dir}))
    if recover_step:
        ck = os.path.join(p.recover_dir, f"globalstep{recover_step}")
        os.makedirs(ck)
        Path(ck, "state.json").write_text(json.dumps({"format": 1, "global_step": recover_step, "time": T0 + 50}))
        os.makedirs(os.path.join(p.recover_dir, ".tmp-globalstep6"))  # a torn write: not a recover point
    for g in saves:
        os.makedirs(os.path.join(p.ckpt_dir, "actor", f"epoch1epochstep{g}globalstep{g}"))
    return p


def test_dead_run_shows_last_step_recover_point_eta_and_how_to_resume(tmp_path):
    p = make_run(tmp_path, resumed_at=4, relaunched=True)
    st = monitor.read_status(monitor.resolve_run(p.log_dir))
    assert st.state == "dead"
    assert st.total_steps == 10
    assert (st.resumes, st.relaunches) == (1, 1)
    assert [r["global_step"] for r in st.rows] == [1, 2, 3, 4, 5, 6]
    assert st.rows[-1]["task_reward"] == 0.9  # the resumed run's row wins
    assert st.recover.global_step == 4
    text = "\n".join(monitor.summary_lines(st, now=T0 + 200))
    assert "state      dead (driver pid 999999999" in text
    assert "resumed 1x, relaunched after failures 1x" in text
    assert "last step  6/10 (epoch 1 step 6/100), task_reward 0.9000" in text
    assert "recover    global step 4" in text
    assert "globalstep4" in text
    assert "epoch1epochstep4globalstep4 (+1 earlier)" in text
    assert "eta        4s when it was last running" in text
    assert "resumes at global step 5" in text


@pytest.fixture
def driver_pid():
    """A live Python process to stand for a run's driver (this test's own process may be titled
    otherwise, as a pytest-xdist worker is, and a driver is told from a recycled pid by its command).
    In a session of its own: a signal another test's script sends to its process group (the
    workers' own) is not this driver's end."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    yield child.pid
    child.kill()
    child.wait()


def test_failed_run_names_its_error_and_how_to_resume(tmp_path, driver_pid):
    error = "TrainerWorker.train_step: ValueError: packed batch has 3 rows, expected 4"
    p = make_run(tmp_path, failed=error, pid=driver_pid)  # even while the driver is still exiting
    st = monitor.read_status(monitor.resolve_run(p.log_dir))
    assert (st.state, st.why) == ("failed", error)
    text = "\n".join(monitor.summary_lines(st, now=T0 + 200))
    assert f"state      failed ({error})" in text
    assert "it resumes at global step 5" in text
    # A new launch of the same trial starts over: the old failure no longer counts.
    with open(p.log_file, "a") as f:
        f.write(f"20231114-22:16:00 INFO {logs.run_line('tiny/run0', 10, 100, 3200, 0, p.log_dir)}\n")
    assert monitor.read_status(monitor.resolve_run(p.log_dir)).state == "running"


def test_interrupted_run_says_by_what(tmp_path, driver_pid):
    p = make_run(tmp_path, interrupted="SIGTERM", pid=driver_pid)
    st = monitor.read_status(monitor.resolve_run(p.log_dir))
    assert (st.state, st.why) == ("interrupted", "SIGTERM")
    assert "it resumes at global step 5" in "\n".join(monitor.summary_lines(st, now=T0 + 200))


def test_running_and_finished(tmp_path, driver_pid):
    p = make_run(tmp_path / "a", pid=driver_pid)
    assert monitor.read_status(monitor.resolve_run(p.log_dir)).state == "running"
    p = make_run(tmp_path / "b", finished=True)
    st = monitor.read_status(monitor.resolve_run(p.log_dir))
    assert st.state == "finished"
    assert "eta        done" in monitor.summary_lines(st)


def test_other_host_is_judged_by_the_last_write(tmp_path):
    p = make_run(tmp_path)
    driver = Path(p.log_dir, "driver.json")
    driver.write_text(json.dumps({**json.loads(driver.read_text()), "host": "elsewhere"}))
    files = monitor.resolve_run(p.log_dir)
    assert monitor.read_status(files).state == "probably running"
    old = time.time() - 3600
    for f in (files.log_file, files.metrics_file):
        os.utime(f, (old, old))
    st = monitor.read_status(files)
    assert st.state == "probably dead"
    assert "1h 00m" in st.why
    assert "elsewhere" in st.why


def test_exp_trial_and_no_run(tmp_path, capsys):
    make_run(tmp_path)
    os.environ["AREAL_USER"] = "u"
    try:
        main(["logs", "tiny/run0", "--fileroot", str(tmp_path), "--tail", "1", "--plot"])
        out = capsys.readouterr().out
        assert "last step  6/10" in out
        assert "task_reward per global step" in out
        assert "Epoch 1/1 step 6/100" in out  # --tail 1
    finally:
        del os.environ["AREAL_USER"]
    with pytest.raises(SystemExit) as e:
        main(["logs", "tiny/nope", "--fileroot", str(tmp_path), "--user", "u"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no run tiny/nope")
    assert err.count("\n") == 1


@pytest.mark.slow
def test_plot_writes_a_png(tmp_path, capsys):
    p = make_run(tmp_path, resumed_at=3)
    out = tmp_path / "curves.png"
    main(["plot", p.log_dir, "-o", str(out), "--smooth", "2"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000
    assert "6 steps, global step 1..6" in capsys.readouterr().out


def test_plot_without_steps_is_one_line(tmp_path, capsys):
    p = runlog.run_paths(str(tmp_path), "e", "t", "u")
    os.makedirs(p.log_dir)
    open(p.log_file, "w").close()
    with pytest.raises(SystemExit):
        main(["plot", p.log_dir])
    assert "error: no steps in" in capsys.readouterr().err


@pytest.mark.slow
def test_commands_document_every_option():
    for cmd in ("logs", "plot"):
        out = subprocess.run([sys.executable, "-m", "areal_kit.cli", cmd, "--help"], capture_output=True,
                             text=True, check=False, env={**os.environ, "COLUMNS": "200"}).stdout
        for opt in {"logs": ("--follow", "--plot", "--fileroot", "--user", "--tail", "--interval"),
                    "plot": ("--output", "--fileroot", "--user", "--smooth")}[cmd]:
            line = next(ln for ln in out.splitlines() if opt in ln)
            assert len(line.split(opt, 1)[1].strip(" │")) > 10, (cmd, opt)  # help text after the flag


def test_follow_stops_when_the_run_has_finished(tmp_path, capsys):
    p = make_run(tmp_path, finished=True)
    main(["logs", p.log_dir, "--follow", "--interval", "0.01", "--tail", "2"])
    out = capsys.readouterr().out
    assert "--- following train.log" in out
    assert out.rstrip().endswith("eta        done")
    assert "Training finished" in out


def test_logs_plot_has_colours_only_on_a_terminal_without_no_color(tmp_path, capsys, monkeypatch):
    p = make_run(tmp_path)
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    main(["logs", p.log_dir, "--plot", "--tail", "0"])
    out = capsys.readouterr().out
    assert "task_reward per global step" in out, out
    assert "\x1b[" not in out, "escape codes in a pipe"
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich takes the captured output for a terminal
    main(["logs", p.log_dir, "--plot", "--tail", "0"])
    assert re.search(r"\x1b\[(?!0m)[0-9;]+m", capsys.readouterr().out), "no styles on a terminal"
    monkeypatch.setenv("NO_COLOR", "1")
    main(["logs", p.log_dir, "--plot", "--tail", "0"])
    out = capsys.readouterr().out
    assert "task_reward per global step" in out, out
    assert "\x1b[" not in out, "colours on a terminal despite NO_COLOR"


def test_logs_samples_shows_the_latest_dump_whole_in_a_pipe(tmp_path):
    """`areal-kit logs RUN --samples`: the rows of the last dumped step, every cell whole, and a
    resume drops the dumps of the steps it redoes."""
    import subprocess
    import sys

    p = runlog.run_paths(str(tmp_path), "tiny", "run0", "u")
    log = runlog.RunLogger(p, tensorboard=False, console=False)
    row = {"id": "q1", "prompt": "3 + 4 =", "answer": "7<eos>", "task_reward": 1.0, "seq_reward": 0.935,
           "no_eos": False, "n_tokens": 2, "version": 9}
    log.samples(10, [row, {**row, "answer": "1 2 3", "task_reward": 0.0, "seq_reward": -0.935, "no_eos": True}])
    log.samples(20, [{**row, "answer": "a long answer " * 12}])
    log.resume_at(10)  # step 20 will be redone: its dump goes
    log.close()
    exe = Path(sys.executable).with_name("areal-kit")
    out = subprocess.run([str(exe), "logs", p.log_dir, "--samples", "--tail", "0"], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert "samples of global step 10" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 3 + 4 =")]
    assert len(rows) == 2
    assert "| 7<eos> " in rows[0]
    assert "+0.935" in rows[0]
    assert "| 1 2 3 " in rows[1]
    assert "-0.935" in rows[1]
    assert rows[1].rstrip().endswith("| true |")
