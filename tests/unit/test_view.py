"""`areal-kit view` without a browser: the samples index and the metrics columns (view/index.py),
the page's JSON (view/app.py, through starlette's test client), and the command's bad input."""

import json
import math
import os
import socket
import threading
import time

import numpy as np
import pytest
from cli_run import assert_one_line_error, run_cli
from starlette.testclient import TestClient

from areal_kit import runlog
from areal_kit.monitor import latest_run
from areal_kit.rl.hallway import TokenTrace
from areal_kit.view.app import RunData, make_app
from areal_kit.view.index import SampleIndex
from areal_kit.view.metrics import MetricsTable

pytestmark = pytest.mark.unit


def sample(i: int, group: int = 0, reward: float = 0.0, n: int = 3, mask: list[int] | None = None) -> dict:
    toks = [str(i % 10)] * (n - 1) + ["<|endoftext|>"]
    return {"id": f"toy-{group}", "group": group, "prompt": "1 + 2 =", "answer": " ".join(toks), "task_reward": reward,
            "seq_reward": reward - 0.5, "no_eos": False, "n_tokens": n, "version": 2, "final_reward": reward,
            "tool_calls": 0, "turns": 1, **runlog.token_fields(toks, [-0.1 * (j + 1) for j in range(n)], mask, None)}


def write_run(log_dir, steps: int, per_step: int = 4, samples: bool = True) -> runlog.RunPaths:
    paths = runlog.RunPaths(str(log_dir), "", "")
    log = runlog.RunLogger(paths, tensorboard=False, console=False)
    for g in range(1, steps + 1):
        log.step(g, {"task_reward": g / 10, "entropy": 1.0, "e2e_time": 0.5})
        if samples:
            log.samples(g, [sample(i, group=i // 2, reward=float(i % 2)) for i in range(per_step)])
    log.close()
    return paths


def test_the_run_writes_the_index_and_a_scan_rebuilds_the_same(tmp_path):
    paths = write_run(tmp_path, 5)
    written = SampleIndex(paths.samples_file, paths.samples_index_file)
    written.update()
    assert written.steps == [1, 2, 3, 4, 5] and written.scanned_bytes == 0
    os.remove(paths.samples_index_file)
    scanned = SampleIndex(paths.samples_file, paths.samples_index_file)
    scanned.update()
    assert scanned.by_step == written.by_step and scanned.scanned_bytes == os.path.getsize(paths.samples_file)
    assert os.path.exists(paths.samples_index_file)  # kept beside the file: the next open reads it
    rows, bad = scanned.rows(3)
    assert bad == 0 and [r["global_step"] for r in rows] == [3] * 4 and rows[1]["task_reward"] == 1.0


def test_index_goes_on_from_where_it_stopped_and_skips_a_torn_line(tmp_path):
    paths = write_run(tmp_path, 2)
    idx = SampleIndex(paths.samples_file, paths.samples_index_file)
    idx.update()
    with open(paths.samples_file, "ab") as f:  # a dump cut mid-line (a crash, or a write under way)
        f.write(b'{"global_step": 3, "id": "toy-0", "prom')
    assert not idx.update() and idx.torn and idx.steps == [1, 2]
    with open(paths.samples_file, "ab") as f:  # the line goes on: then whole
        f.write(b'pt": "x"}\n')
    assert idx.update() and not idx.torn and idx.steps == [1, 2, 3]
    with open(paths.samples_file, "ab") as f:  # a garbled line inside a step: that step shows the rest
        f.write(b'{"global_step": 4, "id": "a"}\n{"global_step": 4, "id": \n{"global_step": 4, "id": "b"}\n')
    idx.update()
    rows, bad = idx.rows(4)
    assert [r["id"] for r in rows] == ["a", "b"] and bad == 1


def test_a_rewritten_file_is_indexed_again(tmp_path):
    paths = write_run(tmp_path, 4)
    idx = SampleIndex(paths.samples_file, paths.samples_index_file)
    idx.update()
    log = runlog.RunLogger(paths, tensorboard=False, console=False)
    log.resume_at(2)  # a resume: the steps after its checkpoint go from the files
    log.samples(3, [sample(9, reward=1.0)])
    log.close()
    assert idx.update()
    assert idx.steps == [1, 2, 3] and idx.rows(3)[0][0]["task_reward"] == 1.0


def test_a_resume_cuts_samples_by_the_index_and_keeps_it(tmp_path):
    paths = write_run(tmp_path, 4)
    size_through_2 = SampleIndex(paths.samples_file, paths.samples_index_file)
    size_through_2.update()
    cut = size_through_2.entry(3).offset
    log = runlog.RunLogger(paths, tensorboard=False, console=False)
    log.resume_at(2)
    assert os.path.getsize(paths.samples_file) == cut  # the rows of steps 3 and 4 go, the others' bytes stay
    log.samples(3, [sample(9, reward=1.0)])
    log.close()
    reopened = SampleIndex(paths.samples_file, paths.samples_index_file)
    reopened.update()
    assert reopened.steps == [1, 2, 3] and reopened.scanned_bytes == 0  # the index survived: no scan
    assert reopened.rows(3)[0][0]["id"] == "toy-0" and len(reopened.rows(2)[0]) == 4


def test_a_resume_over_rows_the_index_lacks_rewrites_and_drops_it(tmp_path):
    paths = write_run(tmp_path, 3)
    with open(paths.samples_file, "ab") as f:  # a dump whose index record a crash kept from being written
        f.write(json.dumps({"global_step": 4, **sample(0)}).encode() + b"\n")
    log = runlog.RunLogger(paths, tensorboard=False, console=False)
    log.resume_at(2)
    log.close()
    assert not os.path.exists(paths.samples_index_file)
    idx = SampleIndex(paths.samples_file, paths.samples_index_file)
    idx.update()
    assert idx.steps == [1, 2] and idx.scanned_bytes == os.path.getsize(paths.samples_file)


def test_metrics_columns_incremental_and_cached(tmp_path):
    paths = write_run(tmp_path, 3, samples=False)
    cache = str(tmp_path / "m.npz")
    t = MetricsTable(paths.metrics_file, cache)
    assert t.update() and t.steps.tolist() == [1, 2, 3] and t.cols["task_reward"].tolist() == [0.1, 0.2, 0.3]
    with open(paths.metrics_file, "a") as f:
        f.write(json.dumps({"global_step": 4, "time": 1.0, "task_reward": 0.4, "eval/pass@1": 0.5}) + "\n")
        f.write('{"global_step": 5, "task_rew')
    assert t.update() and t.steps.tolist() == [1, 2, 3, 4] and t.torn
    assert t.cols["eval/pass@1"][3] == 0.5 and all(math.isnan(v) for v in t.cols["eval/pass@1"][:3])  # NaN: not logged
    with open(paths.metrics_file, "a") as f:  # the torn row written whole, and step 2 logged again (the later wins)
        f.write('ard": 0.5}\n' + json.dumps({"global_step": 2, "task_reward": 0.9}) + "\n")
    t.update()
    assert t.steps.tolist() == [1, 2, 3, 4, 5] and t.row(2) == {"task_reward": 0.9}
    t.save_cache()
    again = MetricsTable(paths.metrics_file, cache)
    again.update()
    assert again.steps.tolist() == t.steps.tolist() and again.cols["task_reward"].tolist() == t.cols["task_reward"].tolist()
    assert again.end == t.end and again.row(4) == t.row(4)


def _odd_metrics(path: str, steps: int) -> None:
    """metrics.jsonl with what a block reader trips on: a NaN, a bool, a key a number in one row and a
    string in another, a list, a line that is not JSON, a step logged twice, rows without a time."""
    with open(path, "w") as f:
        for g in range(1, steps + 1):
            row: dict = {"global_step": g, "time": 1e9 + g, "task_reward": g / 7, "n": g, "flag": g % 2 == 0}
            if g % 97 == 0:
                row.update(task_reward=float("nan"), kind="a string", hist=[1, 2])
            if g % 89 == 0:
                row["kind"] = 3.5
            if g % 101 == 0:
                del row["time"]
            f.write(json.dumps(row) + "\n")
            if g % 113 == 0:
                f.write('{"global_step": 5, "task_rew\n')
            if g == steps // 2:
                f.write(json.dumps({"global_step": 3, "task_reward": -1.0}) + "\n")


def test_metrics_read_in_blocks_equals_row_by_row(tmp_path, monkeypatch):
    from areal_kit.view import metrics as index

    path = str(tmp_path / "metrics.jsonl")
    _odd_metrics(path, 3000)
    rows = MetricsTable(path, str(tmp_path / "a.npz"))
    rows.update()  # under index._BULK: row by row
    monkeypatch.setattr(index, "_BULK", 4096)  # blocks of ~4 KB: some go to pyarrow, some (odd lines) to json
    blocks = MetricsTable(path, str(tmp_path / "b.npz"), background=False)
    blocks.update()
    assert blocks.steps.tolist() == rows.steps.tolist() and blocks.bad == rows.bad == 3000 // 113
    assert sorted(blocks.cols) == sorted(rows.cols) == ["kind", "n", "task_reward"]  # no bool, string or list column
    for k in rows.cols:
        assert np.array_equal(blocks.cols[k], rows.cols[k], equal_nan=True), k
    assert np.array_equal(blocks.times, rows.times, equal_nan=True)
    assert blocks.row(3) == {"task_reward": -1.0} and blocks.row(89)["kind"] == 3.5


def test_a_long_metrics_file_opens_on_a_sample_then_whole(tmp_path, monkeypatch):
    """The first read of a long metrics.jsonl runs in a thread; the test holds it back (an Event) to
    see the page meanwhile: a sample of the rows, the latest ones whole, a note; then every row."""
    from areal_kit.view import metrics as index

    paths = write_run(tmp_path, 3000, per_step=1)
    monkeypatch.setattr(index, "_BULK", 4096)
    monkeypatch.setattr(index, "_BACKGROUND", 8192)
    monkeypatch.setattr(index, "_SAMPLED", 100)
    monkeypatch.setattr(index, "_TAIL", 2048)
    gate, run = threading.Event(), index._Job.run
    monkeypatch.setattr(index._Job, "run", lambda job: (gate.wait(10), run(job)))
    data = RunData(paths, "long")
    client = TestClient(make_app(data))
    st = client.get("/api/status").json()
    assert any("read whole for the first time" in n for n in st["notes"])
    assert 2700 < st["n_steps"] < 3300 and st["last_step"] == 3000  # an estimate; the last rows exact
    sampled = client.get("/api/trend?keys=task_reward").json()
    assert 100 <= len(sampled["steps"]) < 200 and sampled["steps"][-1] == 3000
    assert client.get("/api/step/3000").json()["metrics"]["task_reward"] == 300.0
    gate.set()
    for _ in range(100):
        data.refresh(force=True)
        if not data.metrics.sampled:
            break
        time.sleep(0.05)
    whole = client.get("/api/trend?keys=task_reward&points=0").json()
    assert whole["steps"] == list(range(1, 3001)) and whole["series"]["task_reward"][:2] == [0.1, 0.2]
    assert not any("first time" in n for n in client.get("/api/status").json()["notes"])


def test_page_json(tmp_path):
    paths = write_run(tmp_path, 3)
    with open(paths.samples_file, "ab") as f:
        f.write(b'{"global_step": 4, "id"')
    data = RunData(paths, "tiny/run0")
    client = TestClient(make_app(data))
    assert "uPlot" in client.get("/static/vendor/uplot/uPlot.iife.min.js").text
    assert "app.js" in client.get("/").text
    st = client.get("/api/status").json()
    assert (st["n_steps"], st["last_sample_step"], st["sample_steps"]) == (3, 3, 3)
    assert any("cut mid-write" in n for n in st["notes"])
    trend = client.get("/api/trend?keys=task_reward,nope").json()
    assert trend == {"steps": [1, 2, 3], "every": 1, "series": {"task_reward": [0.1, 0.2, 0.3]}}
    assert client.get("/api/trend?points=2").json()["steps"] == [1, 3]  # bucket means past `points`
    step = client.get("/api/step/2").json()
    assert step["metrics"]["task_reward"] == 0.2 and len(step["groups"]) == 2
    assert [s["task_reward"] for s in step["groups"][0]["samples"]] == [1.0, 0.0]  # sorted by reward
    assert client.get("/api/sample/2/1").json()["logprobs"] == [-0.1, -0.2, -0.3]
    assert client.get("/api/sample/2/9").status_code == 404
    run = client.get("/api/run").json()
    assert run["config"] is None and "no config.json" in run["config_note"]


def test_a_run_without_samples_shows_its_trend(tmp_path):
    paths = write_run(tmp_path, 2, samples=False)
    data = RunData(paths, "x")
    assert data.status()["n_steps"] == 2
    assert any("no samples.jsonl" in n for n in data.notes())


def test_latest_run(tmp_path):
    root = tmp_path / "areal_runs"
    for trial in ("a", "b"):
        write_run(runlog.run_paths(str(root), "exp", trial, "ci").log_dir, 1)
    os.utime(os.path.join(runlog.run_paths(str(root), "exp", "a", "ci").log_dir, "metrics.jsonl"), (9e9, 9e9))
    assert latest_run(str(root), "ci").name == "exp/a"


def test_bad_input_is_one_line(tmp_path, capsys):
    code, _, err = run_cli(["view", str(tmp_path)], capsys)
    assert_one_line_error(code, err, "is not a run")
    code, _, err = run_cli(["view", "--fileroot", str(tmp_path), "--user", "ci"], capsys)
    assert_one_line_error(code, err, "no run under")
    paths = write_run(tmp_path / "run", 1)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        code, _, err = run_cli(["view", paths.log_dir, "--port", str(busy.getsockname()[1])], capsys)
    finally:
        busy.close()
    assert_one_line_error(code, err, "is in use", "--port")


def test_run_page_sources_launches_and_checkpoints(tmp_path):
    from areal_kit import logs
    from areal_kit.config.loader import describe_options, load_config, origin

    paths = write_run(tmp_path / "logs" / "ci" / "tiny" / "run0", 2)
    paths = runlog.RunPaths(paths.log_dir, str(tmp_path / "recover"), str(tmp_path / "ckpt"))
    cfg = load_config("tiny", ["actor.lr=1e-5", "exp_ctrl.dump_samples_every=1"])
    log = runlog.RunLogger(paths, tensorboard=False, console=False)
    log.config(describe_options(cfg), origin(cfg))
    log.info(logs.run_line("tiny/run0", 2, 2, 8, 0, paths.log_dir))
    log.info(logs.rpc_line({"task_reward": 0.5}))  # a step's lines: not a launch's
    log.warning(logs.relaunch_line("worker death in global step 2: actor died", 1, 1))
    log.info(logs.resume_line(os.path.join(paths.recover_dir, "globalstep1"), 1, 1, 1, "2026-01-01 00:00:00", 2))
    log.info(logs.finished_line(2, 0.5))
    log.close()
    os.makedirs(os.path.join(paths.recover_dir, "globalstep1"))
    with open(os.path.join(paths.recover_dir, "globalstep1", "state.json"), "w") as f:
        json.dump({"global_step": 1, "time": 1.7e9}, f)
    os.makedirs(os.path.join(paths.ckpt_dir, "actor", "epoch1epochstep2globalstep2"))
    os.makedirs(os.path.join(paths.ckpt_dir, "actor", "epoch1epochstep3globalstep3.tmp"))  # a save under way: none
    run = TestClient(make_app(RunData(paths, "tiny/run0"))).get("/api/run").json()
    assert run["preset"] == "tiny" and run["overrides"] == ["actor.lr=1e-5", "exp_ctrl.dump_samples_every=1"]
    by_key = {o["key"]: o for o in run["options"]}
    assert by_key["actor.lr"]["source"] == "override" and by_key["actor.lr"]["value"] == 1e-5
    assert by_key["actor.lr"]["preset"] != 1e-5  # what the preset said, beside the override
    assert by_key["experiment_name"]["source"] == "preset" and by_key["experiment_name"]["preset"] == "tiny"
    assert by_key["exp_ctrl.dump_sample_tokens"]["source"] == "default"
    kinds = [e["kind"] for e in run["events"]]
    assert kinds == ["launch", "relaunch", "resume", "finished"]
    assert "worker death in global step 2" in run["events"][1]["text"] and run["events"][0]["time"]
    ck = run["checkpoints"]
    assert [c["global_step"] for c in ck["recover"]] == [1] and [s["global_step"] for s in ck["saves"]] == [2]


def test_timeline_lanes_per_process(tmp_path):
    from types import SimpleNamespace

    from areal_kit.rl.driver.controller import Controller
    from areal_kit.rl.sample import Generated

    out = Generated([], gen_time=2.0, reward_time=0.5, version=1, engine=1)
    assert abs(out.done - __import__("time").time()) < 5  # stamped where the engine makes it
    got = SimpleNamespace(outs=[out, Generated([], 1.0, 0.25, 1, 0, done=out.done)])
    spans = Controller._spans(None, got, t_step=out.done - 3, t_got=out.done, t_train=out.done + 0.1,
                              train_time=1.0, t_sync=out.done + 1.2, sync_time=0.3, stats={"ref_logp_time": 0.25})
    assert ("engine 1", "generate", out.done - 2.5, out.done - 0.5) in spans
    assert ("trainer parts", "reference logprobs", out.done + 0.1, out.done + 0.35) in spans
    assert ("trainer parts", "forward/backward/optimizer", out.done + 0.35, out.done + 1.1) in spans
    assert ("engine 1", "reward", out.done - 0.5, out.done) in spans
    assert ("trainer", "train step", out.done + 0.1, out.done + 1.1) in spans
    paths = write_run(tmp_path, 3)
    log = runlog.RunLogger(paths, tensorboard=False, console=False)
    for g in (1, 2, 3):
        log.timeline(g, spans + [("driver", "recover checkpoint", out.done + 2, out.done + 2 + g)])
    log.close()
    client = TestClient(make_app(RunData(paths, "x")))
    tl = client.get("/api/timeline/3").json()
    assert tl["lanes"] == ["driver", "trainer", "trainer parts", "engine 1", "engine 0"] and tl["recorded"]
    ck = [s for s in tl["spans"] if s[1] == "recover checkpoint"]
    assert ck == [["driver", "recover checkpoint", round(out.done + 2, 3), round(out.done + 5, 3)]]
    assert client.get("/api/timeline/9").json()["spans"] == []
    log = runlog.RunLogger(paths, tensorboard=False, console=False)
    log.resume_at(1)  # a resume drops the steps after its checkpoint from the timeline too
    log.close()
    with open(paths.timeline_file) as f:
        assert [json.loads(x)["global_step"] for x in f] == [1]


def test_token_fields_can_be_turned_off(tmp_path):
    from types import SimpleNamespace

    from areal_kit.config.loader import load_config
    from areal_kit.rl.driver.controller import Controller
    from areal_kit.rl.sample import Sample

    class Tok:
        def decode(self, ids: list[int]) -> str:
            return " ".join(map(str, ids))

        def batch_decode(self, ids: list[list[int]]) -> list[str]:
            return [self.decode(x) for x in ids]

    s = Sample("toy-0", 0, [1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], False, 1, 1.0, seq_reward=0.5)
    trace = TokenTrace([-0.3, -0.2, -0.1], [1.0, 0.5, 0.25], [0.1, 0.0, -0.1])
    sizes = {}
    for on in (True, False):
        cfg = load_config("tiny", [f"exp_ctrl.dump_sample_tokens={str(on).lower()}"])
        stub = SimpleNamespace(cfg=cfg, job=SimpleNamespace(tokenizer=Tok()))
        row = Controller._readable(stub, [(s, trace)])[0]
        assert ("tokens" in row and "logprobs" in row and "trainer_logprob" in row) is on and row["answer"] == "3 4 5"
        sizes[on] = len(json.dumps(row))
    assert sizes[True] > sizes[False]
    data = RunData(write_run(tmp_path, 1), "x")
    assert data.step(1)["has_tokens"]


def test_the_trainers_fields_of_a_dumped_sample():
    """What the trainer computed, per output token, beside the sampling logprob: its logprob, the
    ratio to the sampling one (none on a token the model did not sample), entropy and reference KL,
    4 decimals; a sample the trainer skipped (a group without signal) has none of them."""
    from areal_kit.rl.driver.controller import trainer_fields
    from areal_kit.rl.sample import Sample

    s = Sample("toy-0", 0, [1], [3, 4, 5], [-0.5, 0.0, -1.0], False, 1, 1.0, loss_mask=[1, 0, 1])
    t = TokenTrace([-0.25, -2.0, -1.0], [0.123456, 0.5, 1.0], [0.1, 0.2, 0.3])
    row = runlog.token_fields(["a", "b", "c"], s.logprobs, s.loss_mask, None, trainer_fields(s, t))
    assert row["trainer_logprob"] == [-0.25, -2.0, -1.0]
    assert row["ratio"] == [round(math.exp(0.25), 4), None, 1.0]
    assert row["entropy"] == [0.1235, 0.5, 1.0] and row["ref_kl"] == [0.1, 0.2, 0.3]
    assert "ref_kl" not in trainer_fields(s, TokenTrace([0.0] * 3, [0.0] * 3))  # no reference model
    assert trainer_fields(s, None) == {}
    assert json.loads(json.dumps(row)) == row  # null, not NaN: the page reads it as JSON


# -- a cluster's run: `view RUN --cluster NAME` ----------------------------------------------------
def _saved_cluster(name: str, storage: str, runtime: str, python: str = "python3"):
    from areal_kit.cluster.options import SetupOptions, save_state
    from areal_kit.cluster.target import Hosts

    opts = SetupOptions(spec=Hosts(hostnames=["h1", "h2"], name=name, storage=storage).spec(), runtime=runtime,
                        python=python)
    save_state(opts)
    return opts


def test_an_unknown_cluster_is_one_line(capsys, kit_home):
    _saved_cluster("lab", "/mnt/st", "docker")
    code, _, err = run_cli(["view", "tiny/run0", "--cluster", "nosuch"], capsys)
    assert_one_line_error(code, err, "--cluster nosuch: no cluster of that name was set up from here", ": lab")


def test_the_heads_viewer_command(kit_home):
    """In the head's container (docker exec -i: the SSH session's stdin reaches it) or on the host,
    from the storage, the cluster's fileroot, on the head's loopback, any free port."""
    import shlex

    from areal_kit.cluster.view_on import viewer_cmd

    docker = shlex.split(viewer_cmd(_saved_cluster("lab", "/mnt/st", "docker"), "tiny/run0"))
    assert docker[:6] == ["docker", "exec", "-i", "areal-lab-head", "sh", "-c"] and len(docker) == 7
    assert docker[6].startswith("cd /mnt/st && exec 3<&0 && { python3 -m areal_kit.cli view tiny/run0 --fileroot "
                                "/mnt/st/ray/experiments --host 127.0.0.1 --port 0 < /dev/null & p=$!;")
    host = shlex.split(viewer_cmd(_saved_cluster("box", "/data", "host", "/opt/py/bin/python"), "", "ci", "/data/fr"))
    assert host[:2] == ["sh", "-c"] and "/opt/py/bin/python -m areal_kit.cli view --fileroot /data/fr --user ci " in host[2]


def test_the_heads_viewer_serves_until_its_session_closes(tmp_path, kit_home):
    """The host runtime's command, run here as sshd would run it on the head (a subprocess whose stdin
    is the session's): it prints the address it serves the run's page on, the page answers there,
    and closing its stdin (the session's end) stops the viewer."""
    import shlex
    import subprocess
    import sys
    import urllib.request

    from areal_kit.cluster.view_on import _ADDRESS, viewer_cmd

    opts = _saved_cluster("box", str(tmp_path / "st"), "host", sys.executable)
    write_run(runlog.run_paths(opts.spec.fileroot, "tiny", "run0", "ci").log_dir, 2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen(shlex.split(viewer_cmd(opts, "tiny/run0", "ci")), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        m = _ADDRESS.search(line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        with urllib.request.urlopen(f"http://127.0.0.1:{m[1]}/api/status", timeout=30) as r:
            assert json.loads(r.read())["n_steps"] == 2
        proc.stdin.close()
        proc.wait(timeout=30)
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{m[1]}/api/status", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
