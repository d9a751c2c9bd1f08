"""What a preset needs, fetched to where it reads it: `--data URI[=DEST]` destinations (a file as a
file, a repository as a folder), a single file and a manifest folder over HTTP from a local server
(verified, resumed, nothing left at the destination by a failure, nothing fetched again by a
re-run), mirror rewriting, and each preset's asset destinations against the paths it reads.

    .venv/bin/python -m pytest tests/unit/test_data_assets.py -q
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import threading
from pathlib import Path
from typing import ClassVar

import pytest
from cli_run import assert_one_line_error, run_cli

from areal_kit.cli import main
from areal_kit.cluster import fetch as head_fetch
from areal_kit.cluster.data import dest_for, plan, split_data
from areal_kit.cluster.options import SetupOptions
from areal_kit.config.cluster_spec import ClusterSpec, HostSpec
from areal_kit.config.loader import load_config
from areal_kit.data import assets
from areal_kit.data.assets import MANIFEST, Asset, FetchError, mirror_url, partial_path, record_path
from areal_kit.data.toy_task import toy_rows
from areal_kit.errors import UserError
from areal_kit.eval.data import eval_sets_dir, find_sets, manifest

pytestmark = pytest.mark.unit

GPU_PRESETS = ["1.5B_n1", "1.5B_n4", "1.5B_n16", "7B_n4", "7B_n16", "1.5B_n1_dapo", "7B_n1_lora"]


class Files(http.server.SimpleHTTPRequestHandler):
    """A folder over HTTP, with the Range requests plain http.server ignores; records each GET."""

    seen: ClassVar[list] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        rng = self.headers.get("Range")
        self.seen.append((self.path, rng))
        path = Path(self.translate_path(self.path))
        if not (rng and path.is_file()):
            return super().do_GET()
        data = path.read_bytes()
        start = int(rng.removeprefix("bytes=").rstrip("-"))
        if start >= len(data):
            return self.send_error(416)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        self.wfile.write(data[start:])
        return None


@pytest.fixture
def server(tmp_path):
    """(folder served, its URL, the GETs so far)."""
    root = tmp_path / "srv"
    root.mkdir()
    seen: ClassVar[list] = []
    handler = functools.partial(type("Handler", (Files,), {"seen": seen}), directory=str(root))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield root, f"http://127.0.0.1:{srv.server_address[1]}", seen
    srv.shutdown()
    srv.server_close()


def _serve(root: Path, rel: str, data: bytes) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


ROWS = b"".join(json.dumps({"problem": f"{i} + 1", "answer": str(i + 1)}).encode() + b"\n" for i in range(30))


# -- where things land --------------------------------------------------------------------------
def test_data_destinations_a_file_as_a_file_a_repository_as_a_folder():
    assert dest_for("/s", "hf://org/Model-1.5B") == "/s/models/Model-1.5B"
    assert dest_for("/s/", "hf://datasets/org/math") == "/s/datasets/math"
    assert dest_for("/s", "https://x.org/a/b.jsonl#sha256=" + "0" * 64) == "/s/datasets/b.jsonl"
    assert dest_for("/s", "http://m:8000/huggingface.co/org/model/") == "/s/datasets/model"
    assert dest_for("/s", "file:///data/w.bin") == "/s/datasets/w.bin"
    assert dest_for("/s", "tiny://toy?seed=1") == "/s/models/tiny-toy"
    sha = "#sha256=" + "a" * 64
    assert split_data(f"https://x/a.jsonl{sha}=/s/d/a.jsonl") == (f"https://x/a.jsonl{sha}", "/s/d/a.jsonl")
    assert split_data("toy://sums/prompts.jsonl?n=8&seed=1") == ("toy://sums/prompts.jsonl?n=8&seed=1", "")


def _opts(**kw) -> SetupOptions:
    spec = ClusterSpec(storage=kw.pop("storage", "/s"), hosts=[HostSpec(hostname="h1")])
    return SetupOptions(spec=spec, log_dir="/tmp/unused", **kw)


def test_data_with_a_dest_lands_there_and_only_on_shared_storage():
    got = plan(_opts(data=["https://x.org/a.jsonl=/s/mine/prompts.jsonl", "hf://org/M"]))
    assert [(a.name, a.dest) for a in got] == [("data:prompts.jsonl", "/s/mine/prompts.jsonl"),
                                               ("data:M", "/s/models/M")]
    with pytest.raises(UserError, match="outside the shared storage /s"):
        plan(_opts(data=["https://x.org/a.jsonl=/home/me/a.jsonl"]))
    with pytest.raises(UserError, match="both land at /s/datasets/a.jsonl"):
        plan(_opts(data=["https://x.org/a.jsonl", "https://y.org/a.jsonl"]))


def test_a_preset_brings_its_assets_and_the_eval_sets_under_setups_storage():
    got = {a.name: a for a in plan(_opts(storage="/mnt/shared", train_param="1.5B_n4"))}
    assert got["model"].dest == "/mnt/shared/models/DeepSeek-R1-Distill-Qwen-1.5B"
    for name, spec in manifest().items():
        a = got[f"eval/{name}"]
        assert (a.dest, a.rows) == (str(eval_sets_dir("/mnt/shared") / name / "test.jsonl"), spec.rows)
        assert a.uri.startswith("https://raw.githubusercontent.com/QwenLM/Qwen2.5-Math/main/evaluation/data/")
    moved = plan(_opts(train_param="1.5B_n4", train_args=["storage_root=/elsewhere"]))
    assert {a.dest.split("/")[1] for a in moved} == {"elsewhere"}  # a --train-arg wins over --storage
    assert plan(_opts(train_param="tiny")) == []  # all generated in the run: nothing to fetch


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_every_gpu_preset_fetches_exactly_the_paths_it_reads(name):
    cfg = load_config(name, ["storage_root=/s"])
    dests = {n: a["dest"] for n, a in cfg.assets.items()}
    assert dests == {"model": cfg.actor.path, "prompts": cfg.dataset.path, "id2info": cfg.dataset.id2info_path}
    model = cfg.assets["model"]["uri"]
    assert model == "hf://deepseek-ai/" + cfg.actor.path.rsplit("/", 1)[1]
    for key in ("prompts", "id2info"):
        assert cfg.assets[key]["uri"].rsplit("/", 1)[1] == dests[key].rsplit("/", 1)[1]


def test_tiny_storage_reads_storage_like_the_gpu_presets():
    cfg, tiny = load_config("tiny_storage", ["storage_root=/s"]), load_config("tiny")
    assert {n: a["dest"] for n, a in cfg.assets.items()} == {
        "model": "/s/models/tiny-toy", "prompts": cfg.dataset.path, "id2info": cfg.dataset.id2info_path}
    assert cfg.dataset.path.startswith("/s/datasets/tiny/") and cfg.dataset.type == "areal"
    assert (cfg.seed, cfg.ppo, cfg.actor.lr) == (tiny.seed, tiny.ppo, tiny.actor.lr)  # the same run
    moved = load_config("tiny_storage", ["assets.model.uri=http://m/tiny/toy-seed1/"])
    assert moved.assets["model"] == {"uri": "http://m/tiny/toy-seed1/", "dest": moved.actor.path, "sha256": ""}


def test_the_toy_source_is_the_toy_task_in_areal_format(tmp_path):
    base = "toy://sums/prompts.jsonl?n=5&seed=1"
    rows = [json.loads(line) for line in head_fetch.toy_file(base).splitlines()]
    info = json.loads(head_fetch.toy_file(base.replace("prompts.jsonl", "id2info.json")))
    want = toy_rows(5, seed=1)
    assert [(r["prompt"], r["query_id"], r["answer"]) for r in rows] == [(w["question"], w["id"], w["answer"])
                                                                         for w in want]
    assert info == {w["id"]: {"solutions": [w["answer"]]} for w in want}
    with pytest.raises(FetchError, match="expected toy://sums/prompts.jsonl"):
        head_fetch.toy_file("toy://sums/other.jsonl?n=5&seed=1")


# -- mirrors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("uri,want", [
    ("https://huggingface.co/datasets/o/d/resolve/main/x.jsonl", "M/huggingface.co/datasets/o/d/resolve/main/x.jsonl"),
    ("https://raw.githubusercontent.com/Q/M/main/e/aime24/test.jsonl#sha256=" + "0" * 64,
     "M/raw.githubusercontent.com/Q/M/main/e/aime24/test.jsonl"),
    ("hf://deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "M/huggingface.co/deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B/"),
    ("hf://datasets/inclusionAI/AReaL-RL-Data", "M/huggingface.co/datasets/inclusionAI/AReaL-RL-Data/"),
    ("tiny://toy?seed=1", "M/tiny/toy-seed1/"),
    ("toy://sums/prompts.jsonl?n=3200&seed=1", "M/toy/sums-n3200-seed1/prompts.jsonl"),
    ("file:///data/x.bin", "file:///data/x.bin"),
])
def test_mirror_layout_is_the_origins(uri, want):
    assert mirror_url(uri, "M/") == want
    assert mirror_url(uri, "") == uri.partition("#")[0]


def test_setup_dry_run_names_each_source_and_destination(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_KIT_HOME", str(tmp_path))
    main(["setup", "--hostnames", "h1", "--dry-run", "--train_param", "tiny_storage", "--mirror", "http://m:8000",
          "--data", "https://x.org/a/b.jsonl"])
    out = capsys.readouterr().out
    eval_url = "http://m:8000/raw.githubusercontent.com/QwenLM/Qwen2.5-Math/main/evaluation/data/aime24/test.jsonl"
    for line in ("[fetch] data:b.jsonl: http://m:8000/x.org/a/b.jsonl -> /storage/datasets/b.jsonl (file)",
                 "[fetch] model: http://m:8000/tiny/toy-seed1/ -> /storage/models/tiny-toy (folder)",
                 ("[fetch] id2info: http://m:8000/toy/sums-n3200-seed1/id2info.json -> "
                  "/storage/datasets/tiny/id2info.json (file)"),
                 f"[fetch] eval/aime24: {eval_url} -> /storage/datasets/eval/aime24/test.jsonl (file)"):
        assert line in out, out


# -- fetching over HTTP -------------------------------------------------------------------------
def test_a_file_is_fetched_as_a_file_once(server, tmp_path):
    root, url, seen = server
    _serve(root, "q/aime24/test.jsonl", ROWS)
    a = Asset("aime24", f"{url}/q/aime24/test.jsonl", str(tmp_path / "s" / "aime24" / "test.jsonl"), rows=30,
              sha256=hashlib.sha256(ROWS).hexdigest())
    assert assets.fetch(a).startswith("fetched aime24")
    assert Path(a.dest).read_bytes() == ROWS
    assert json.loads(record_path(Path(a.dest)).read_text())["rows"] == 30
    n = len(seen)
    assert assets.fetch(a) == f"present aime24 {a.dest}"
    assert len(seen) == n, "a complete file is not fetched again"
    assert sorted(p.name for p in Path(a.dest).parent.iterdir()) == [".test.jsonl.areal-kit.json", "test.jsonl"]


@pytest.mark.parametrize("wrong", [{"sha256": "0" * 64}, {"rows": 31}])
def test_a_file_that_fails_verification_leaves_nothing_at_dest(server, tmp_path, wrong):
    root, url, _ = server
    _serve(root, "x.jsonl", ROWS)
    dest = tmp_path / "s" / "x.jsonl"
    with pytest.raises(FetchError, match="checksum mismatch|has 30 rows, expected 31"):
        assets.fetch(Asset("x", f"{url}/x.jsonl", str(dest), **wrong))
    assert sorted(p.name for p in dest.parent.iterdir()) == []


def test_an_interrupted_download_resumes_and_a_bad_partial_restarts(server, tmp_path):
    root, url, seen = server
    _serve(root, "x.jsonl", ROWS)
    dest = tmp_path / "x.jsonl"
    partial_path(dest).write_bytes(ROWS[:100])  # what a dropped connection left
    a = Asset("x", f"{url}/x.jsonl", str(dest), sha256=hashlib.sha256(ROWS).hexdigest())
    assets.fetch(a)
    assert seen[-1] == ("/x.jsonl", "bytes=100-")
    assert dest.read_bytes() == ROWS and not partial_path(dest).exists()
    dest.unlink()
    record_path(dest).unlink()
    partial_path(dest).write_bytes(b"X" * 100)  # not a prefix of the file: fails, and starts over next time
    with pytest.raises(FetchError, match="checksum mismatch"):
        assets.fetch(a)
    assert not dest.exists() and not partial_path(dest).exists()
    assets.fetch(a)
    assert dest.read_bytes() == ROWS


def _model(root: Path) -> dict:
    src = root / "huggingface.co" / "org" / "m"
    _serve(src, "config.json", b'{"model_type": "qwen2"}')
    _serve(src, "sub/model.safetensors", b"w" * 5000)
    files = assets.manifest_of(src)
    (src / MANIFEST).write_text(json.dumps({"uri": "hf://org/m", "files": files}))
    return files


def test_a_folder_over_http_comes_through_its_manifest(server, tmp_path):
    root, url, seen = server
    files = _model(root)
    dest = tmp_path / "s" / "models" / "m"
    a = Asset("model", "hf://org/m", str(dest))
    assert assets.fetch(a, mirror=url).startswith("fetched model")
    assert assets.manifest_of(dest) == files
    assert json.loads((dest / MANIFEST).read_text())["uri"] == "hf://org/m"  # the origin, mirror or not
    n = len(seen)
    assert assets.fetch(a, mirror=url).startswith("present")
    assert len(seen) == n
    direct = Asset("model", f"{url}/huggingface.co/org/m/", str(tmp_path / "direct"))
    assert assets.fetch(direct).startswith("fetched model")  # a folder URI, trailing slash, no mirror
    assert assets.manifest_of(tmp_path / "direct") == files


def test_a_folder_whose_file_does_not_match_its_manifest_leaves_nothing_at_dest(server, tmp_path):
    root, url, _ = server
    _model(root)
    m = root / "huggingface.co" / "org" / "m" / MANIFEST
    data = json.loads(m.read_text())
    data["files"]["config.json"][0] += 1  # a wrong size
    m.write_text(json.dumps(data))
    dest = tmp_path / "s" / "m"
    with pytest.raises(FetchError, match="does not match its manifest"):
        assets.fetch(Asset("model", "hf://org/m", str(dest)), mirror=url)
    assert not dest.exists()


def test_generated_sources_come_from_the_mirror_or_are_built_here(server, tmp_path):
    root, url, seen = server
    uri = "toy://sums/prompts.jsonl?n=4&seed=1"
    text = head_fetch.toy_file(uri)
    _serve(root, "toy/sums-n4-seed1/prompts.jsonl", text.encode())
    assert head_fetch.fetch(Asset("p", uri, str(tmp_path / "a.jsonl")), url).startswith("fetched p")
    assert seen[-1][0] == "/toy/sums-n4-seed1/prompts.jsonl"
    other = uri.replace("n=4", "n=3")  # not on the mirror: built here
    assert head_fetch.fetch(Asset("p", other, str(tmp_path / "b.jsonl")), url).startswith("fetched p")
    assert (tmp_path / "b.jsonl").read_text() == head_fetch.toy_file(other)


def test_what_someone_put_at_dest_is_kept(tmp_path):
    dest = tmp_path / "prompts.jsonl"
    dest.write_bytes(ROWS)
    a = Asset("prompts", "https://unreachable.invalid/prompts.jsonl", str(dest))
    assert "not fetched by areal-kit: kept" in assets.fetch(a)
    assert dest.read_bytes() == ROWS
    with pytest.raises(FetchError, match="remove it to fetch"):
        assets.fetch(Asset("prompts", a.uri, str(dest), rows=7))


# -- eval finds its data ------------------------------------------------------------------------
QWEN = "raw.githubusercontent.com/QwenLM/Qwen2.5-Math/main/evaluation/data"


def test_every_eval_set_has_its_exact_file_and_row_count():
    folders = {"math_500": "math500", "aime24": "aime24", "amc23": "amc23", "gsm8k": "gsm8k"}
    assert {n: (s.url, s.rows) for n, s in manifest().items()} == {
        n: (f"https://{QWEN}/{sub}/test.jsonl", {"math_500": 500, "aime24": 30, "amc23": 40, "gsm8k": 1319}[n])
        for n, sub in folders.items()}
    assert eval_sets_dir("/s") == Path("/s/datasets/eval")


def test_a_missing_eval_set_is_one_line_naming_it_where_and_the_command(tmp_path):
    with pytest.raises(UserError) as e:
        find_sets(tmp_path, ["aime24"], fetch_missing=False)
    line = str(e.value)
    assert "\n" not in line
    dest = tmp_path / "aime24" / "test.jsonl"
    command = f"python -m areal_kit.cluster.fetch https://{QWEN}/aime24/test.jsonl {dest} --rows 30"
    for needle in ("eval set aime24 is missing", f"{tmp_path}/aime24/test.jsonl not found", command):
        assert needle in line, line
    with pytest.raises(UserError, match=r"fetching it failed \(http://127.0.0.1:9/.* unreachable"):
        find_sets(tmp_path, ["aime24"], fetch_missing=True, mirror="http://127.0.0.1:9")


def test_eval_fetches_a_missing_set_to_the_storage_on_first_use(server, tmp_path):
    root, url, _ = server
    _serve(root, f"{QWEN}/aime24/test.jsonl", ROWS)
    data = eval_sets_dir(str(tmp_path / "storage"))
    assert find_sets(data, ["aime24"], fetch_missing=True, mirror=url)[0].startswith("fetched eval/aime24")
    assert (data / "aime24" / "test.jsonl").read_bytes() == ROWS
    assert find_sets(data, ["aime24"], fetch_missing=True, mirror=url) == []


def test_eval_cli_looks_in_the_storage_and_says_what_is_missing(tmp_path, fake_model, capsys, monkeypatch):
    monkeypatch.delenv("AREAL_EVAL_DATA", raising=False)
    monkeypatch.delenv("AREAL_KIT_MIRROR", raising=False)
    code, _, err = run_cli(["eval", "--model_path", str(fake_model), "--output_path", str(tmp_path / "o"),
                            "--storage", str(tmp_path / "st"), "--mirror", "http://127.0.0.1:9",
                            "--data_names", "amc23"], capsys)
    assert_one_line_error(code, err, "eval set amc23 is missing", f"{tmp_path}/st/datasets/eval/amc23/test.jsonl")


@pytest.mark.slow
def test_export_tiny_is_a_mirror_tiny_storage_fetches_from(server, tmp_path):
    root, url, seen = server
    head_fetch.main(["--export-tiny", str(root)])
    items = [a for a in plan(_opts(storage=str(tmp_path / "st"), train_param="tiny_storage"))
             if not a.name.startswith("eval/")]
    assert head_fetch.run_plan(items, url) == 0
    got = {p for p, _ in seen}
    assert {"/tiny/toy-seed1/config.json", "/toy/sums-n3200-seed1/prompts.jsonl"} <= got
    cfg = load_config("tiny_storage", [f"storage_root={tmp_path / 'st'}"])
    assert assets.manifest_of(Path(cfg.actor.path)) == assets.manifest_of(root / "tiny" / "toy-seed1")
    assert Path(cfg.dataset.id2info_path).is_file()
    assert head_fetch.run_plan(items, url, check_only=True) == 0
