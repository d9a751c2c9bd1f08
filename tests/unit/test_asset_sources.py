"""The user's names win: a model or data path named by hub id, hf:// or a URL becomes its storage
path and an asset (for `areal-kit train` and setup alike), a preset asset whose path the user
named is dropped with a line saying so, a destination holding another source is refused and kept
byte for byte, a missing eval set is a warning of setup's data step, and `setup --fetch-only`
runs the steps up to the data step. The data step's fetch runs on this machine (runtime host,
this Python) against a local HTTP mirror.

    .venv/bin/python -m pytest tests/unit/test_asset_sources.py -q
"""

from __future__ import annotations

import functools
import http.server
import json
import subprocess
import sys
import threading

import pytest
from cli_run import assert_one_line_error, cli, dry_run

from areal_kit.cluster import data as data_step
from areal_kit.cluster.context import Cluster, HostState
from areal_kit.cluster.options import SetupOptions
from areal_kit.cluster.parallel import StepFailed
from areal_kit.cluster.remote import HostLog, Result
from areal_kit.config.cluster_spec import ClusterSpec, HostSpec
from areal_kit.config.loader import load_config, load_resolved
from areal_kit.data import assets
from areal_kit.data.assets import MANIFEST, Asset, FetchError
from areal_kit.eval.data import manifest

pytestmark = pytest.mark.unit

DEEPSEEK = "hf://deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"


@pytest.fixture(autouse=True)
def kit_home(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_KIT_HOME", str(tmp_path / "home"))


def _opts(**kw) -> SetupOptions:
    spec = ClusterSpec(storage=kw.pop("storage", "/s"), hosts=[HostSpec(hostname="h1")])
    return SetupOptions(spec=spec, log_dir="/tmp/unused", **kw)


# -- what the run reads -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["Qwen/Qwen3-1.7B", "hf://Qwen/Qwen3-1.7B"])
def test_a_hub_id_or_uri_is_read_from_its_storage_copy_and_drops_the_presets_model(name):
    cfg, dropped = load_resolved("1.5B_n4", ["storage_root=/s", f"actor.path={name}"])
    assert cfg.actor.path == "/s/models/Qwen3-1.7B"  # what the run loads, on every node
    assert cfg.assets["actor.path"] == {"uri": "hf://Qwen/Qwen3-1.7B", "dest": "/s/models/Qwen3-1.7B", "sha256": ""}
    assert "model" not in cfg.assets and set(cfg.assets) == {"actor.path", "prompts", "id2info"}
    assert dropped == [(f"model: {DEEPSEEK} dropped: actor.path names {name}, not the preset's "
                        "/s/models/DeepSeek-R1-Distill-Qwen-1.5B")]
    assert load_config("1.5B_n4", [f"actor.path={name}"]).actor.path == "/storage/models/Qwen3-1.7B"  # train's


def test_a_local_folder_of_a_hub_ids_name_is_a_path(tmp_path, monkeypatch):
    (tmp_path / "me" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    cfg, dropped = load_resolved("1.5B_n4", ["actor.path=me/model"])
    assert cfg.actor.path == "me/model" and "actor.path" not in cfg.assets and len(dropped) == 1


def test_a_users_model_path_gets_no_preset_model():
    cfg, dropped = load_resolved("7B_n4", ["storage_root=/s", "actor.path=/s/models/DeepSeek-R1-Distill-Qwen-1.5B"])
    assert cfg.actor.path == "/s/models/DeepSeek-R1-Distill-Qwen-1.5B"
    assert all(a["dest"] != cfg.actor.path for a in cfg.assets.values())  # no 7B into the 1.5B folder
    assert dropped[0].startswith("model: hf://deepseek-ai/DeepSeek-R1-Distill-Qwen-7B dropped: actor.path names")
    plan = {a.name: a for a in data_step.plan(_opts(train_param="7B_n4", train_args=[
        "actor.path=/s/models/Qwen3-1.7B"]))}
    assert "model" not in plan and "prompts" in plan


def test_the_presets_own_path_or_storage_keeps_its_assets():
    own = load_config("1.5B_n4", ["storage_root=/s"])
    for args in (["storage_root=/s", f"actor.path={own.actor.path}"], ["storage_root=/s"]):
        cfg, dropped = load_resolved("1.5B_n4", args)
        assert (cfg.assets, dropped) == (own.assets, [])
    named, dropped = load_resolved("1.5B_n4", ["assets.model.uri=hf://me/M", "actor.path=/storage/models/M"])
    assert named.assets["model"]["uri"] == "hf://me/M" and dropped == []  # an asset the user names is theirs


@pytest.mark.parametrize("value,path,uri", [
    ("hf://datasets/me/math", "/s/datasets/math", "hf://datasets/me/math"),
    ("https://x.org/a/mine.jsonl", "/s/datasets/mine.jsonl", "https://x.org/a/mine.jsonl"),
    ("/s/mine/prompts.jsonl", "/s/mine/prompts.jsonl", None),
])
def test_data_named_by_uri_or_path_drops_the_presets_prompts_and_their_solutions(value, path, uri):
    cfg, dropped = load_resolved("1.5B_n4", ["storage_root=/s", f"dataset.path={value}"])
    assert cfg.dataset.path == path
    assert cfg.assets.get("dataset.path", {}).get("uri") == uri
    assert cfg.dataset.id2info_path == ""  # next to the user's file (or inline), never AReaL's
    assert {"prompts", "id2info"}.isdisjoint(cfg.assets) and "model" in cfg.assets
    assert [d.split(":")[0] for d in dropped] == ["prompts", "id2info"]
    kept = load_config("1.5B_n4", [f"dataset.path={value}", "dataset.id2info_path=/s/mine/id2info.json"])
    assert kept.dataset.id2info_path == "/s/mine/id2info.json"


def test_data_beside_the_preset_lands_where_the_user_named_it():
    got = data_step.plan(_opts(train_param="1.5B_n4", data=["hf://Qwen/Qwen3-1.7B"],
                               train_args=["actor.path=/s/models/Qwen3-1.7B"]))
    assert [a.name for a in got if a.dest == "/s/models/Qwen3-1.7B"] == ["data:Qwen3-1.7B"]
    assert DEEPSEEK not in {a.uri for a in got}


def test_setup_dry_run_says_what_it_dropped_and_fetches_the_users(capsys):
    out = dry_run(["setup", "--hostnames", "h1", "--dry-run", "--train_param", "1.5B_n4",
                   "--train-arg", "actor.path=Qwen/Qwen3-1.7B", "--train-arg", "dataset.path=/storage/me.jsonl"],
                  capsys)
    assert (f"[fetch] model: {DEEPSEEK} dropped: actor.path names Qwen/Qwen3-1.7B, not the preset's "
            "/storage/models/DeepSeek-R1-Distill-Qwen-1.5B") in out
    assert "[fetch] actor.path: hf://Qwen/Qwen3-1.7B -> /storage/models/Qwen3-1.7B (folder)" in out
    assert "[fetch] prompts: https://" in out and "-> /storage/datasets/prompts_for" not in out


# -- nothing of another source is replaced ------------------------------------------------------
def test_a_folder_fetched_from_another_source_is_refused_and_kept(tmp_path):
    src_a, src_b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "models" / "m"
    for src, text in ((src_a, "A"), (src_b, "B")):
        src.mkdir()
        (src / "config.json").write_text(text)
    assets.fetch(Asset("model", f"file://{src_a}/", str(dest)))
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    with pytest.raises(FetchError, match=f"{dest} holds file://{src_a}/ .fetched by areal-kit., not "
                                         f"file://{src_b}/: refused, nothing removed"):
        assets.fetch(Asset("model", f"file://{src_b}/", str(dest)))
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before


def test_a_file_fetched_from_another_source_is_refused_and_kept(tmp_path):
    (tmp_path / "a.jsonl").write_text("a\n")
    (tmp_path / "b.jsonl").write_text("bb\n")
    dest = tmp_path / "d" / "p.jsonl"
    assets.fetch(Asset("p", f"file://{tmp_path}/a.jsonl", str(dest)))
    with pytest.raises(FetchError, match="holds file://.*/a.jsonl .fetched by areal-kit., not file://.*/b.jsonl"):
        assets.fetch(Asset("p", f"file://{tmp_path}/b.jsonl", str(dest)))
    assert dest.read_text() == "a\n"


def test_files_areal_kit_did_not_fetch_are_kept_and_named(tmp_path):
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "mine.bin").write_bytes(b"x")
    line = assets.fetch(Asset("model", "file:///nowhere/m/", str(dest)))
    assert line == f"present model {dest} (there already, not fetched by areal-kit: kept; file:///nowhere/m/ not fetched)"
    (tmp_path / "f").write_text("mine")
    with pytest.raises(FetchError, match="is a file .not fetched by areal-kit., and file:///nowhere/m/ a folder: refused"):
        assets.fetch(Asset("model", "file:///nowhere/m/", str(tmp_path / "f")))
    assert (dest / "mine.bin").read_bytes() == b"x" and (tmp_path / "f").read_text() == "mine"


def test_refetching_the_same_source_touches_only_its_files(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "m"
    src.mkdir()
    (src / "w.bin").write_bytes(b"abc")
    a = Asset("model", f"file://{src}/", str(dest))
    assets.fetch(a)
    (dest / "w.bin").unlink()  # incomplete now
    (dest / "notes.txt").write_text("mine")
    assert assets.fetch(a).startswith("fetched model")
    assert (dest / "w.bin").read_bytes() == b"abc" and (dest / "notes.txt").read_text() == "mine"
    assert json.loads((dest / MANIFEST).read_text())["files"] == {"w.bin": [3, assets.sha256(src / "w.bin")]}


# -- the data step on this machine ---------------------------------------------------------------
class LocalRemote:
    """The head's commands, run on this machine."""

    def __init__(self):
        self.log, self.user, self.commands = HostLog(None, []), "root", []

    def run(self, cmd, sudo=False, check=False, timeout=None, quiet=False) -> Result:
        r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout, check=False)
        return Result(cmd, r.returncode, r.stdout, r.stderr)


@pytest.fixture
def mirror(tmp_path):
    """A mirror over HTTP holding every eval set but gsm8k (each with its row count)."""
    root = tmp_path / "mirror"
    for name, spec in manifest().items():
        if spec.url and name != "gsm8k":
            p = root / spec.url.split("://", 1)[1]
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text("".join(json.dumps({"problem": str(i), "answer": str(i)}) + "\n" for i in range(spec.rows)))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield root, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_an_eval_set_that_cannot_be_fetched_is_a_warning_not_a_failure(tmp_path, mirror):
    root, url = mirror
    (root / "x.org").mkdir()
    (root / "x.org" / "mine.jsonl").write_text('{"prompt": "1+1", "query_id": "q", "solutions": ["2"]}\n')
    opts = _opts(storage=str(tmp_path / "st"), runtime="host", python=sys.executable, train_param="tiny_storage",
                 train_args=["actor.path=/somewhere/mine", "dataset.path=https://x.org/mine.jsonl"])
    c = Cluster(opts=opts, hosts=[HostState(spec=opts.spec.hosts[0], index=0, remote=LocalRemote())])
    out = data_step.data(c, c.head, data_step.plan(opts, url), url)
    assert out.status == "changed", out.message
    assert "not the preset's model, prompts, id2info (a path you named)" in out.message
    assert "warning: eval set(s) not fetched (eval/gsm8k: " in out.message and "HTTP 404" in out.message
    assert "`areal-kit eval` fetches them on first use" in out.message
    assert (tmp_path / "st" / "datasets" / "mine.jsonl").read_text().startswith('{"prompt"')
    assert (tmp_path / "st" / "datasets" / "eval" / "aime24" / "test.jsonl").is_file()
    needed = _opts(storage=str(tmp_path / "st"), runtime="host", python=sys.executable, train_param="tiny_storage",
                   train_args=["actor.path=/somewhere/mine", "dataset.path=https://x.org/absent.jsonl"])
    c.opts = needed
    with pytest.raises(StepFailed, match="fetching failed: dataset.path: .*absent.jsonl: HTTP 404"):
        data_step.data(c, c.head, data_step.plan(needed, url), url)


# -- fetch only ---------------------------------------------------------------------------------
def test_fetch_only_stops_after_the_data_step(capsys):
    argv = ["setup", "--hostnames", "h1", "h2", "--dry-run", "--train_param", "1.5B_n4"]
    full, only = dry_run(argv, capsys), dry_run([*argv, "--fetch-only"], capsys)
    assert "areal_kit.cluster.fetch --plan" in only and "docker build" in only
    for step in ("--head --port 6379", "--address h1:6379", "exec python3 -m areal_kit.cli train 1.5B_n4"):
        assert step in full and step not in only, step
    code, _, err = cli(capsys, "setup", "--hostnames", "h1", "--dry-run", "--fetch-only")
    assert_one_line_error(code, err, "--fetch-only: nothing to fetch; expected --train_param PRESET or --data URI")
