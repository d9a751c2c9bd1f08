"""The AReaL guide's path, rehearsed on the testbed with no registry and no hub: one `areal-kit setup`
builds the runtime image on the head from the package's own Dockerfile, shares it through the storage
and loads it on the other nodes, fetches a model in HF layout, an AReaL-format dataset with id2info and
the eval sets from a mirror to exactly the paths the preset reads, starts training and reports that it
runs; a second setup finds everything present; `areal-kit eval` scores the run's checkpoint from the
eval sets on storage, and the log under the storage answers the guide's greps.

The second scenario steps off the preset's rails on the same cluster: the user's own model named by a
hub-style id and their own AReaL-format files named by URL (all through the mirror), so the preset's
assets are dropped; a hub id whose folder holds what areal-kit fetched from another source is refused
with nothing removed; the run is stopped (SIGTERM, as a scheduler stops it) and `areal-kit train PRESET
--cluster areal` from the workstation resumes it at the step after its recover checkpoint.

The mirror is a plain HTTP server on the testbed's own bridge address (the nodes have no other route),
laid out like its origins (``MIRROR/raw.githubusercontent.com/...``; the tiny model and the toy prompts
at the paths `python -m areal_kit.cluster.fetch --export-tiny` writes). The one thing given beforehand
is the Dockerfile's base image on the head, as a registry would serve ``nvidia/cuda`` or ``debian``
there: the testbed's debootstrap base, which the cpu_image fixture imports on node1.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
from image import BASE_TAG, venv_mounts
from kit import Kit, lines
from shared_data import SHARED_EVAL

from areal_kit.data.assets import mirror_url
from areal_kit.eval.data import DatasetSpec, manifest

PRESET = "tiny_storage"
STEPS = 4
SETS = ("math_500", "aime24", "amc23", "gsm8k")
# The user's sources on the mirror: a model of another shape than the preset's (3 layers, not 2, so its
# checkpoint shows which model trained) and toy prompts of another seed with their id2info.
USER_SOURCES = {"tiny://toy?seed=7&layers=3": "huggingface.co/userorg/toy-user",
                "toy://sums/prompts.jsonl?n=64&seed=3": "example.org/mine/sums.jsonl",
                "toy://sums/id2info.json?n=64&seed=3": "example.org/mine/sums-id2info.json"}
USER_STEPS = 400  # more than it gets to before it is stopped (a tiny step takes ~0.1 s)


def eval_set(spec: DatasetSpec) -> bytes:
    """The set's real file where the shared copies are, else rows made to its manifest entry (fields,
    answer format, row count): the rehearsal checks where sets land and that eval reads them."""
    real = os.path.join(os.environ.get("AREAL_EVAL_DATA", SHARED_EVAL), spec.name, "test.jsonl")
    if os.path.exists(real):
        with open(real, "rb") as f:
            return f.read()
    rows = []
    for i in range(spec.rows):
        answer = f"{i} plus one is {i + 1}.\n#### {i + 1}" if spec.answer_format == "gsm8k" else str(i + 1)
        row = {spec.question_field: f"What is {i} + 1?", spec.answer_field: answer}
        if spec.id_field:
            row[spec.id_field] = f"{spec.name}-{i}"
        rows.append(json.dumps(row) + "\n")
    return "".join(rows).encode()


@pytest.fixture(scope="module")
def mirror(testbed, tmp_path_factory):
    """The mirror's address, and the bytes of each eval set it serves."""
    root = tmp_path_factory.mktemp("mirror")
    subprocess.run([sys.executable, "-m", "areal_kit.cluster.fetch", "--export-tiny", str(root)], check=True)
    served = {}
    for name in SETS:
        spec = manifest()[name]
        dest = root / mirror_url(spec.url, "m").removeprefix("m/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        served[name] = eval_set(spec)
        dest.write_bytes(served[name])
    for uri, rel in USER_SOURCES.items():  # the user's own model and data, as their hub and site serve them
        subprocess.run([sys.executable, "-m", "areal_kit.cluster.fetch", uri, str(root / rel)], check=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer((testbed.ips[0].rsplit(".", 1)[0] + ".1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://{srv.server_address[0]}:{srv.server_address[1]}", served
    srv.shutdown()


@pytest.fixture(scope="module")
def guide(testbed, cpu_image, mirror, tmp_path_factory):
    """No areal-kit image on any node, nothing on storage; the guide's setup line plus the testbed's
    settings (the checkout's venv on storage as the image's Python, 1 CPU per Ray node)."""
    kit = Kit(tmp_path_factory.mktemp("kit-guide"), testbed)
    for i in (1, 2, 3):
        testbed.ssh(i, "docker rm -f $(docker ps -aq) 2>/dev/null; docker images --format "
                       "'{{.Repository}}:{{.Tag}}' | grep '^areal-kit:' | xargs -r docker rmi -f", check=False)
    for sub in ("images", "models", "datasets", "ray/experiments"):
        shutil.rmtree(testbed.storage / sub, ignore_errors=True)
    venv, mounts = venv_mounts()
    kit.args = [*kit.conn_args(), "--username", "root", "--ssh_port", "22", "--storage", str(testbed.storage),
                "--python", f"{venv}/bin/python", "--build-arg", f"BASE_IMAGE={BASE_TAG}",
                "--build-arg", "PY_ENV=storage", "--build-arg", f"VENV={venv}", "--mirror", mirror[0],
                "--num-cpus", "1", "--object-store-memory", "100m", "--no-dashboard", "--min-disk-gb", "1",
                "--min-shm-gb", "0.25", "--min-nofile", "10000", "--ray-wait", "120", "--shm-size", "512m",
                *[a for m in mounts for a in ("--mount", m)],
                "--train_param", PRESET, "--train-arg", f"exp_ctrl.total_train_steps={STEPS}"]
    r = kit.run("setup", *kit.args, timeout=1200)
    yield kit, r
    kit.run("down", "--known-hosts", str(kit.known_hosts))
    for i in (1, 2, 3):
        testbed.ssh(i, "docker rm -f $(docker ps -aq) 2>/dev/null; true", check=False)


def wait_finished(log, timeout: float = 600, since: int = 0) -> str:
    """The log from byte `since` once it says the run finished or failed."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = log.read_bytes()[since:].decode(errors="replace") if log.exists() else ""
        if "Training finished" in text or "Run failed" in text:
            return text
        time.sleep(2)
    raise AssertionError(f"training did not finish in {timeout:.0f}s:\n{text[-3000:]}")


def test_the_guide_end_to_end(guide, mirror, testbed, tmp_path):
    kit, r = guide
    _, served = mirror
    assert r.returncode == 0, r.stdout + r.stderr
    head, *others = testbed.ips
    # the image: built once on the head, shared through storage, loaded everywhere else
    image = [ln for ln in lines(r, "changed") if "] image: " in ln]
    assert [ln for ln in image if " image: built " in ln and f"[{head}]" in ln], image
    assert sorted(ln.split("]")[0] for ln in image if " image: loaded " in ln) == \
        sorted(f"changed: [{ip}" for ip in others), image
    tars = list((testbed.storage / "images").glob("*.tar"))
    assert len(tars) == 1 and tars[0].stat().st_size > 10e6, tars
    # the preset's own paths: the model in HF layout, the AReaL data and id2info, the eval sets
    assert (testbed.storage / "models" / "tiny-toy" / "config.json").is_file()
    assert (testbed.storage / "datasets" / "tiny" / "id2info.json").is_file()
    for name in SETS:
        got = testbed.storage / "datasets" / "eval" / name / "test.jsonl"
        assert got.read_bytes() == served[name], name
    # setup waited for a sign of life and said where the run stands
    said = [ln for ln in r.stdout.splitlines() if f"training {PRESET}: " in ln]
    assert said and re.search(r"(engines generating|at global step \d+|finished)", said[-1]), r.stdout

    log = testbed.storage / "ray" / "experiments" / "logs" / f"areal-{PRESET}.log"
    text = wait_finished(log)
    assert "Training finished" in text, text[-3000:]
    assert len(re.findall(r"Epoch \d+/\d+ step \d+/\d+ \(global step \d+\) finishes", text)) == STEPS
    assert len(re.findall(r"RPC name actor_train returns \{.*'task_reward': ", text)) == STEPS

    # areal-kit eval of the run's checkpoint reads the eval sets from the storage
    ckpts = sorted((testbed.storage / "ray" / "experiments" / "checkpoints").glob("*/*/*/actor/*"))
    assert ckpts, "the run saved no HF checkpoint"
    out = tmp_path / "eval"
    ev = subprocess.run([sys.executable, "-m", "areal_kit.cli", "eval", "--model_path", str(ckpts[-1]),
                         "--output_path", str(out), "--storage", str(testbed.storage), "--data_names",
                         ",".join(SETS), "--max_questions", "3", "--num_samples", "0", "--max_gen_tokens", "4",
                         "--prompt_type", "plain"], capture_output=True, text=True, timeout=600, check=False,
                        env={k: v for k, v in os.environ.items() if k != "AREAL_EVAL_DATA"})  # storage, not a copy
    assert ev.returncode == 0, ev.stdout + ev.stderr
    for name in SETS:
        assert re.search(rf"\b{name}\b.*\b3\b", ev.stdout), ev.stdout
    assert (out / "aggregate.json").is_file() or list(out.glob("*.json")), list(out.iterdir())

    # a second setup finds the image, the data and the eval sets present
    again = kit.run("setup", *kit.args, "--train-wait", "0", timeout=900)
    assert again.returncode == 0, again.stdout
    assert not [ln for ln in lines(again, "changed") if "] image: " in ln or "] data: " in ln], again.stdout
    assert len([ln for ln in lines(again, "ok") if "] image: " in ln]) == 3, again.stdout


def tree_digest(root) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def driver_gone(testbed, timeout: float = 300) -> None:
    """Waits until no driver of PRESET runs in the head's container."""
    end = time.monotonic() + timeout
    while testbed.ssh(1, f"docker exec {HEAD} pgrep -f '{DRIVER}'", check=False).returncode == 0:
        assert time.monotonic() < end, f"the {PRESET} driver still runs after {timeout:.0f}s"
        time.sleep(2)


HEAD = "areal-areal-head"  # setup's container on the head (cluster name "areal")
DRIVER = f"areal_kit[.]cli train {PRESET} "


def test_own_model_and_data_then_stop_and_resume_from_the_workstation(guide, testbed):
    kit, _ = guide
    base = kit.args[:kit.args.index("--train_param")]
    own = ["--train-arg", "actor.path=userorg/toy-user",
           "--train-arg", "dataset.path=https://example.org/mine/sums.jsonl",
           "--train-arg", "dataset.id2info_path=https://example.org/mine/sums-id2info.json",
           "--train-arg", "experiment_name=mine", "--train-arg", "exp_ctrl.total_train_epochs=1000"]
    models = testbed.storage / "models"
    earlier = tree_digest(models / "tiny-toy")  # the first scenario's model, fetched by areal-kit
    driver_gone(testbed)  # the first scenario's last setup restarted its finished run

    # a hub id whose folder holds another source's fetch: refused in one line, nothing removed
    clash = kit.run("setup", *base, "--train_param", PRESET, "--train-arg", "actor.path=userorg/tiny-toy",
                    "--fetch-only", timeout=600)
    assert clash.returncode == 1, clash.stdout + clash.stderr
    assert "refused, nothing removed" in clash.stdout and "tiny://toy" in clash.stdout, clash.stdout

    # the user's own model and data: fetched to the storage, the preset's own assets dropped
    log = testbed.storage / "ray" / "experiments" / "logs" / f"areal-{PRESET}.log"
    since = log.stat().st_size
    r = kit.run("setup", *base, "--train_param", PRESET, *own, "--train-arg",
                f"exp_ctrl.total_train_steps={USER_STEPS}", "--train-wait", "0", timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (models / "toy-user" / "config.json").is_file()
    assert (testbed.storage / "datasets" / "sums.jsonl").is_file()
    assert not [ln for ln in r.stdout.splitlines() if "tiny-toy" in ln and "] data: " in ln and "changed" in ln]

    # stopped after its second step (SIGTERM: the step under way finishes and is checkpointed)
    end = time.monotonic() + 600
    while not re.search(r"\(global step [2-9]\) finishes", log.read_bytes()[since:].decode(errors="replace")):
        assert time.monotonic() < end, log.read_bytes()[since:].decode(errors="replace")[-3000:]
        time.sleep(1)
    testbed.ssh(1, f"docker exec {HEAD} pkill -TERM -f '{DRIVER}'")
    driver_gone(testbed)
    text = log.read_bytes()[since:].decode(errors="replace")
    done = [int(g) for g in re.findall(r"\(global step (\d+)\) finishes", text)]
    assert done == list(range(1, len(done) + 1)) and len(done) < USER_STEPS, text[-3000:]
    last = done[-1] + 2
    assert "Training finished" not in text and "Dumped recover info to file." in text, text[-3000:]

    # again from the workstation, for 2 more steps: it resumes at the next step; a second start meanwhile is refused
    more = ["actor.path=userorg/toy-user", "dataset.path=https://example.org/mine/sums.jsonl",
            "dataset.id2info_path=https://example.org/mine/sums-id2info.json", "experiment_name=mine",
            "exp_ctrl.total_train_epochs=1000",
            f"exp_ctrl.total_train_steps={last}", "--known-hosts", str(kit.known_hosts)]
    since = log.stat().st_size
    again = kit.run("train", PRESET, "--cluster", "areal", *more, "--train-wait", "0", timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    twice = kit.run("train", PRESET, "--cluster", "areal", *more, timeout=300)
    assert twice.returncode == 2 and f"error: training {PRESET} is already running on " in twice.stderr, twice.stderr
    text = wait_finished(log, since=since)
    assert re.search(rf"Will recover from: .* \(global step {done[-1]},", text), text[-3000:]
    assert re.findall(r"\(global step (\d+)\) finishes", text) == \
        [str(done[-1] + 1), str(last)], text[-3000:]

    # it trained the user's model (3 layers), and the earlier folder is byte for byte as it was
    ckpts = sorted((testbed.storage / "ray" / "experiments" / "checkpoints").glob("*/mine/*/actor/*"))
    assert ckpts and '"num_hidden_layers": 3' in (ckpts[-1] / "config.json").read_text(), ckpts
    assert tree_digest(models / "tiny-toy") == earlier
