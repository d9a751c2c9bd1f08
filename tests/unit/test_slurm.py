"""The Slurm side without a Slurm: the sbatch script as written for each kind of partition and
container runtime (and that bash parses it), a partition's GPUs from sinfo's gres field, and the
refusals of a preset a partition cannot hold. tests/cluster/test_slurm_cluster.py runs the scripts
on a real Slurm."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from cli_run import assert_one_line_error, dry_run, run_cli

from areal_kit import logs
from areal_kit.slurm.cluster import Node, Partition, gpus_of, refusal
from areal_kit.slurm.options import SlurmOptions
from areal_kit.slurm.script import Job, sbatch_script


def job(**kw) -> Job:
    base = {"preset": "1.5B_n4", "overrides": ["actor.lr=1e-6", "fileroot=/storage/runs"], "name": "areal-x-t",
                "n_nodes": 4, "gpus_per_node": 8, "log": "/storage/runs/logs/u/x/t/slurm.log", "log_dir": "/storage/runs/logs/u/x/t",
                "script": "/storage/runs/logs/u/x/t/slurm.sbatch", "binds": ["/storage"]}
    return Job(**{**base, **kw})


def as_slurmstepd(*args: str) -> list[str]:
    """bash with args, started as slurmstepd starts a batch shell: SIGINT at its default, whatever
    this test's runner left it at (one started in the background has it ignored, which no shell
    can then reset)."""
    start = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp('bash', ['bash', *sys.argv[1:]])"
    return [sys.executable, "-c", start, *args]


def sbatch_lines(text: str) -> list[str]:
    return [ln.removeprefix("#SBATCH ") for ln in text.splitlines() if ln.startswith("#SBATCH ")]


def test_a_gpu_job_asks_for_whole_nodes_a_signal_and_requeue():
    text = sbatch_script(job(), SlurmOptions(slurm=True, partition="gpu", account="lab", time="12:00:00",
                                             python="/storage/venv/bin/python", sbatch_args=["--qos=high"]))
    assert sbatch_lines(text) == [
        "--job-name=areal-x-t", "--nodes=4", "--ntasks-per-node=1", "--exclusive", "--gres=gpu:8",
        "--partition=gpu", "--account=lab", "--time=12:00:00", "--output=/storage/runs/logs/u/x/t/slurm.log",
        "--open-mode=append", "--requeue", "--signal=B:USR1@300", "--comment=areal-kit:/storage/runs/logs/u/x/t",
        "--qos=high"]
    driver = next(ln for ln in text.splitlines() if "areal_kit.cli train" in ln)
    assert driver.strip().startswith("(trap - INT; exec /storage/venv/bin/python -m areal_kit.cli train 1.5B_n4 "
                                     'actor.lr=1e-6 fileroot=/storage/runs ray_address="$head_ip:$port"')
    assert "-m areal_kit.slurm.node worker" in text and "fresh=()" in text and "--fresh" not in text


def test_a_cpu_job_on_one_node_has_no_gres_and_no_workers():
    text = sbatch_script(job(n_nodes=1, gpus_per_node=0, fresh=True), SlurmOptions(slurm=True))
    assert not [a for a in sbatch_lines(text) if a.startswith(("--gres", "--partition", "--time"))]
    assert "slurm.node worker" not in text
    # --fresh on the first start only: a requeued start resumes from its checkpoint
    assert 'fresh=(); [ "${SLURM_RESTART_COUNT:-0}" = 0 ] && fresh=(--fresh)' in text
    text = sbatch_script(job(n_nodes=1, gpus_per_node=0, fresh=True, discard=True), SlurmOptions(slurm=True))
    assert 'fresh=(); [ "${SLURM_RESTART_COUNT:-0}" = 0 ] && fresh=(--fresh --discard)' in text


@pytest.mark.parametrize("runtime", ["apptainer", "pyxis"])
def test_containers_wrap_every_ray_process_and_the_driver(runtime):
    text = sbatch_script(job(), SlurmOptions(slurm=True, container="/img/areal.sif", container_runtime=runtime))
    steps = [ln for ln in text.splitlines() if "python3 -m" in ln]
    assert len(steps) == 5  # the head, two waits, the workers, the driver
    for ln in steps:
        if runtime == "apptainer":
            assert "apptainer exec --nv --bind /storage /img/areal.sif python3 -m" in ln
        else:  # pyxis: only through srun, the driver included
            assert ln.strip().removeprefix("(trap - INT; exec ").startswith("srun ") and "--container-image=/img/areal.sif --container-mounts=/storage:/storage" in ln


def test_the_driver_takes_the_sigint_the_term_trap_sends(tmp_path):
    """scancel: the batch shell's TERM trap stops the driver with SIGINT, which a command the script
    puts in the background would ignore (bash's rule without job control). The script's own driver
    line, run by bash with a stand-in Python that reports how it would take SIGINT."""
    py = tmp_path / "python"
    py.write_text("#!/usr/bin/env python3\nimport signal\nprint(signal.getsignal(signal.SIGINT))\n")
    py.chmod(0o755)
    text = sbatch_script(job(), SlurmOptions(slurm=True, python=str(py)))
    driver = next(ln for ln in text.splitlines() if "areal_kit.cli train" in ln)
    r = subprocess.run(as_slurmstepd("-c", f"fresh=(); head_ip=h; port=1\n{driver}\nwait"), capture_output=True,
                       text=True, check=False)
    assert r.stdout.strip() == "<built-in function default_int_handler>", r.stdout + r.stderr


@pytest.mark.parametrize("opts", [SlurmOptions(slurm=True), SlurmOptions(slurm=True, container="x.sif"),
                                  SlurmOptions(slurm=True, container="nvcr.io#x", container_runtime="pyxis")])
def test_bash_parses_the_script(opts, tmp_path):
    path = tmp_path / "job.sbatch"
    path.write_text(sbatch_script(job(preset="/home/me/my preset.yaml"), opts))
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert "'/home/me/my preset.yaml'" in path.read_text()  # quoted where a path has a space


@pytest.mark.parametrize(("gres", "gpus"), [("gpu:4", 4), ("gpu:a100:8(S:0-1)", 8), ("gpu:2,shard:8", 2),
                                            ("gpu:h100:4,gpu:a100:2", 6), ("(null)", 0), ("shard:4", 0)])
def test_gpus_from_sinfo_gres(gres, gpus):
    assert gpus_of(gres) == gpus


def part(*nodes: tuple[str, str, int]) -> Partition:
    return Partition("p", [Node(n, st, 64, g) for n, st, g in nodes])


def test_refusals_name_what_is_short():
    assert refusal(part(("a", "idle", 8), ("b", "mixed", 8)), "x", 2, 8) is None
    assert refusal(part(("a", "idle", 0)), "x", 2, 0).startswith("partition p has 1 node(s), x needs 2 (n_nodes)")
    assert "has 1 node(s) with 8 GPUs, x needs 2 (its nodes have at most 8)" in \
        refusal(part(("a", "idle", 8), ("b", "idle", 4)), "x", 2, 8)
    assert "has 1 node(s) up, x needs 2 (b down)" in refusal(part(("a", "idle", 8), ("b", "down", 8)), "x", 2, 8)
    assert refusal(part(("a", "idle", 0), ("b", "idle", 0)), "x", 2, 0) is None  # a CPU run counts nodes only


def test_without_slurm_commands_the_submission_says_so(capsys, monkeypatch, tmp_path):
    """A workstation without sinfo/sbatch: a submission is refused in one line, a dry run shows the
    script the preset sizes, unchecked, and writes nothing."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm command on it
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["train", "tiny", "--slurm"], capsys)
    assert_one_line_error(code, err, "sinfo not found: --slurm needs Slurm's client commands")
    out = dry_run(["train", "tiny", "--slurm", "--dry-run", "n_nodes=2", "allocation_mode=vllm.d2p1m1+d2p1m1"],
                  capsys)
    assert "#SBATCH --nodes=2" in out and "not checked against a partition" in out
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("said", [
    # Slurm's client installed, never configured: no slurm.conf, no DNS SRV record of a controller.
    ("sinfo: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
     "sinfo: error: fetch_config: DNS SRV lookup failed\n"
     "sinfo: error: _establish_config_source: failed to fetch config\n"
     "sinfo: fatal: Could not establish a configuration source"),
    # Configured, its controller down.
    "slurm_load_partitions: Unable to contact slurm controller (connect failure)",
], ids=["unconfigured", "controller down"])
def test_where_slurm_cannot_be_asked_a_dry_run_prints_the_script_unchecked(said, capsys, monkeypatch, tmp_path):
    """The fake sinfo on PATH stands for a Slurm that cannot be asked: it says what the real one
    says unconfigured (or with its controller down) and exits 1. The dry run prints the script
    marked unchecked, the reason in one line, and writes nothing; a submission stops in one line."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "sinfo").write_text(f"#!/bin/sh\ncat >&2 <<'EOF'\n{said}\nEOF\nexit 1\n")
    (bin_ / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    out = dry_run(["train", "tiny", "--slurm", "--dry-run"], capsys)
    reason = said.splitlines()[-1]
    why = reason.removeprefix("sinfo: ")
    [note] = [ln for ln in out.splitlines() if ln.startswith("note: ")]
    assert note == f"note: Slurm cannot be asked here (sinfo: {why}); the script below is not checked against a partition"
    assert "#SBATCH --nodes=1" in out
    assert "no partition checked" in out
    assert not list(work.iterdir())
    code, _, err = run_cli(["train", "tiny", "--slurm"], capsys)
    assert (code, err.strip().splitlines()) == (1, [f"error: sinfo: {why}"])  # Slurm's failure, not bad input


def test_a_driver_that_ends_without_a_word_after_scancel_is_said_stopped(tmp_path):
    """scancel signals Ray's processes too, and a driver whose Ray went first can end without a
    line of its own. The script, run by bash with stand-ins for srun, scontrol and Python (whose
    driver exits 1, silent, on the trap's SIGINT), says the stop itself after the SIGTERM."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    stubs = {
        "scontrol": 'case "$1 $2" in "show hostnames") echo n1;; "show node") echo NodeAddr=127.0.0.1;; esac',
        "srun": 'while [ $# -gt 0 ]; do case "$1" in -w) shift 2;; -*) shift;; *) break;; esac; done; exec "$@"',
        "python": ('case "$*" in *"scripts start"*) exec sleep 30;; *"node wait"*) exit 0;; *"cli train"*)\n'
                   f'  sleep 30 & trap \'kill $!; exit 1\' INT; touch {tmp_path}/driver; wait; exit 1;; esac'),
    }
    for name, body in stubs.items():
        (bin_ / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_ / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(job(n_nodes=1, gpus_per_node=0), SlurmOptions(slurm=True, python=str(bin_ / "python"))))
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}
    p = subprocess.Popen(as_slurmstepd(str(script)), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 20
    while not (tmp_path / "driver").exists():
        assert time.monotonic() < deadline and p.poll() is None, "the driver never started"
        time.sleep(0.1)
    p.terminate()  # SIGTERM to the batch shell, as scancel sends it
    out, _ = p.communicate(timeout=20)
    assert f"areal-kit: {logs.stopped_line('SIGTERM')}" in out, out
    assert p.returncode == 1, out
