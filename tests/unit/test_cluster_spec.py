"""Cluster spec (guide JSON) and host inventory (YAML): valid files load, malformed ones give
a UserError naming the field, and the CLI turns that into one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_kit.cli import main
from areal_kit.config.cluster_spec import ClusterSpec, HostSpec, load_cluster_spec
from areal_kit.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
GUIDE = {"cluster_type": "local", "cluster_name": "local", "fileroot": "/storage/ray/experiments",
         "default_mount": "/storage:/storage", "n_gpus_per_node": 8}


def write(tmp_path: Path, name: str, data) -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_example_specs_load():
    spec = load_cluster_spec(ROOT / "cluster_specs" / "local_4node.json")
    assert (spec.cluster_name, spec.n_gpus_per_node, spec.n_nodes) == ("local", 8, 4)
    assert spec.head.hostname == "10.0.0.11"
    assert spec.hosts[3].port == 2222
    assert spec.hosts[0].key_file.endswith(".ssh/id_ed25519")
    one = load_cluster_spec(ROOT / "cluster_specs" / "local_1node.json")
    assert one.hosts == []
    assert one.n_nodes == 1
    assert one.fileroot == "/storage/ray/experiments"
    inv = load_cluster_spec(ROOT / "cluster_specs" / "hosts_4node.yaml")
    assert [h.hostname for h in inv.hosts] == [h.hostname for h in spec.hosts]


def test_guide_json_with_inline_hosts(tmp_path):
    p = write(tmp_path, "c.json", {**GUIDE, "hosts": ["a", {"hostname": "b", "user": "ubuntu", "port": 2200}]})
    spec = load_cluster_spec(p)
    assert spec.n_nodes == 2
    assert spec.hosts[1] == HostSpec("b", "ubuntu", 2200, None)
    assert spec.default_mount == "/storage:/storage"


def test_defaults_fill_in(tmp_path):
    p = write(tmp_path, "h.yaml", "storage: /nfs\nhosts: [x, y]\n")
    spec = load_cluster_spec(p)
    assert spec.fileroot == "/nfs/ray/experiments"
    assert spec.default_mount == "/nfs:/nfs"
    assert spec.cluster_name == "areal"
    assert spec.hosts[0].user is None  # ~/.ssh/config decides, else root (cluster/remote.py)


BAD = [
    ("c.json", "{not json", "invalid JSON at line 1"),
    ("h.yaml", "hosts: [a\n", "invalid YAML"),
    ("c.json", {**GUIDE, "n_gpus_per_node": -1}, "n_gpus_per_node"),
    ("c.json", {**GUIDE, "n_gpus_per_node": "eight"}, "n_gpus_per_node"),
    ("c.json", {**GUIDE, "cluster_type": "k8s"}, "cluster_type"),
    ("c.json", {**GUIDE, "fileroot": "relative/path"}, "fileroot"),
    ("c.json", {**GUIDE, "default_mount": "/storage"}, "default_mount"),
    ("c.json", {**GUIDE, "clustr_name": "x"}, "unknown field 'clustr_name'"),
    ("c.json", {**GUIDE, "cluster_name": "a b"}, "cluster_name"),
    ("c.json", {**GUIDE, "hosts": ["a"], "n_nodes": 2}, "n_nodes"),
    ("h.yaml", "hosts: []\n", "hosts: expected a non-empty list"),
    ("h.yaml", "hosts: [{user: root}]\n", "missing field 'hostname'"),
    ("h.yaml", "hosts: [{hostname: a, port: 70000}]\n", "port"),
    ("h.yaml", "hosts: [{hostname: a, prot: 22}]\n", "unknown field 'prot'"),
    ("h.yaml", "hosts: ['a b']\n", "whitespace"),
    ("h.yaml", "hosts: [a, a]\n", "listed twice"),
    ("h.yaml", "storage: relative\nhosts: [a]\n", "storage"),
    ("h.yaml", "- a\n- b\n", "mapping of fields"),
    ("h.yaml", "defaults: {usr: x}\nhosts: [a]\n", "defaults"),
    ("c.json", {**GUIDE, "inventory": "missing.yaml"}, "file not found"),
]


@pytest.mark.parametrize("name,data,needle", BAD, ids=[b[2] for b in BAD])
def test_malformed_specs_name_the_field(tmp_path, name, data, needle):
    p = write(tmp_path, name, data)
    with pytest.raises(UserError) as e:
        load_cluster_spec(p)
    assert needle in str(e.value)
    assert str(p.name) in str(e.value)


@pytest.mark.parametrize("name,data,needle", BAD[:8], ids=[b[2] for b in BAD[:8]])
def test_malformed_spec_via_cli_is_one_line_exit_2(tmp_path, capsys, name, data, needle):
    p = write(tmp_path, name, data)
    with pytest.raises(SystemExit) as e:
        main(["setup", "--inventory", str(p), "--dry-run"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ")
    assert len(err.splitlines()) == 1
    assert needle in err
    assert "Traceback" not in err


def test_wrong_extension_and_missing_file(tmp_path):
    with pytest.raises(UserError, match="expected a .json spec or a .yaml inventory"):
        load_cluster_spec(tmp_path / "spec.toml")
    with pytest.raises(UserError, match="file not found"):
        load_cluster_spec(tmp_path / "nope.json")


def test_dataclass_validates_directly():
    with pytest.raises(UserError, match="n_nodes"):
        ClusterSpec(hosts=[HostSpec("a")], n_nodes=3)
    assert ClusterSpec(hosts=["a", "b"]).hosts[1].hostname == "b"
