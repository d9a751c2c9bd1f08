"""The AReaL guide's path, rehearsed on the testbed with no registry and no hub: one `areal-kit setup`
builds the runtime image on the head from the package's own Dockerfile, shares it through the storage
and loads it on the other nodes, fetches a model in HF layout, an AReaL-format dataset with id2info and
the eval sets from a mirror to exactly the paths the preset reads, starts training and reports that it
runs; a second setup finds everything present; `areal-kit eval` scores the run's checkpoint from the
eval sets on storage, and the log under the storage answers the guide's greps.

The mirror is a plain HTTP server on the testbed's own bridge address (the nodes have no other route),
laid out like its origins (``MIRROR/raw.githubusercontent.com/...``; the tiny model and the toy prompts
at the paths `python -m areal_kit.cluster.fetch --export-tiny` writes). The one thing given beforehand
is the Dockerfile's base image on the head, as a registry would serve ``nvidia/cuda`` or ``debian``
there: the testbed's debootstrap base, which the cpu_image fixture imports on node1.
"""

from __future__ import annotations

import functools
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


def wait_finished(log, timeout: float = 600) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = log.read_text() if log.exists() else ""
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
                         "--output_path", str(out), "--storage_root", str(testbed.storage), "--data_names",
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
