"""Bad input to `areal-kit train` that is only visible when the run prepares.

Each must fail with one line and exit 2 before any Ray actor starts: the test would hang or take
a minute if workers were started, and it checks that Ray was never initialized. A wrong actor.path
is told from the setting alone, before Ray starts at all.
"""


import pytest

from areal_kit.cli import main
from areal_kit.rl.driver import raystart


@pytest.fixture()
def no_ray(monkeypatch):
    """Ray's start, if reached, fails the test after it: the input is refused before it. (It runs on
    launch's thread, whose error a later refusal would swallow, so the call is recorded.)"""
    started = []
    monkeypatch.setattr(raystart, "start_ray", started.append)
    yield
    assert not started, "Ray was started for input refused from the setting alone"


def _run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return e.value.code, err


def test_missing_model_path(tmp_path, capsys, no_ray):
    code, err = _run(["train", "tiny", f"fileroot={tmp_path}", f"actor.path={tmp_path}/nope"], capsys)
    assert code == 2
    assert len(err) == 1
    assert "actor.path=" in err[0]
    assert "not a model folder" in err[0]


@pytest.mark.parametrize("path, message", [
    ("tiny://toy?width=3", "'width=3' is not a tiny model setting"),
    ("tiny://toy?hidden=big", "'hidden=big' is not a tiny model setting"),
    ("tiny://cat", "kind must be one of toy, tool, bpe"),
])
def test_bad_tiny_model_url(tmp_path, capsys, path, message, no_ray):
    code, err = _run(["train", "tiny", f"fileroot={tmp_path}", f"actor.path={path}"], capsys)
    assert (code, len(err)) == (2, 1)
    assert f"actor.path={path}: " in err[0] and message in err[0]
    assert not (tmp_path / "models").exists()


@pytest.mark.slow
def test_row_without_answer_for_the_verifier(tmp_path, capsys, monkeypatch):
    from areal_kit.data import prompts

    rows = [{"id": "q1", "question": "1 + 1 =", "answer": "2"}, {"id": "q2", "question": "2 + 2 ="}]
    monkeypatch.setattr(prompts, "load_rows", lambda d, seed: rows)
    code, err = _run(["train", "tiny", f"fileroot={tmp_path}"], capsys)
    assert code == 2
    assert len(err) == 1
    assert "'q2'" in err[0]
    assert "answer" in err[0]


@pytest.mark.slow
def test_prompt_batch_larger_than_dataset(tmp_path, capsys):
    code, err = _run(["train", "tiny", f"fileroot={tmp_path}", "dataset.toy_size=16"], capsys)
    assert code == 2
    assert "larger than the dataset (16 prompts)" in err[0]


@pytest.mark.slow
def test_agent_that_does_not_import(tmp_path, capsys):
    """agent.fn imports in the driver, as ppo.workflow does: a bad one stops the run before Ray."""
    import ray

    code, err = _run(["train", "tiny_tool", f"fileroot={tmp_path}", "ppo.workflow=",
                      "agent.fn=areal_kit.agents.calculator:no_such_agent"], capsys)
    assert (code, len(err)) == (2, 1)
    assert "areal_kit.agents.calculator:no_such_agent" in err[0]
    assert not ray.is_initialized()
    assert not (tmp_path / "models").exists()  # refused before the tool model was built


def test_nothing_started(tmp_path, capsys, no_ray):
    import ray

    _run(["train", "tiny", f"fileroot={tmp_path}", f"actor.path={tmp_path}/nope"], capsys)
    assert not ray.is_initialized()
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").rglob("metrics.jsonl"))


@pytest.mark.parametrize("what", ["path", "mix", "eval_path"])
def test_missing_dataset_file(tmp_path, capsys, no_ray, what):
    """A dataset file that is not there, as dataset.path, one of dataset.mix's sources or
    dataset.eval_path: the line names it, and neither Ray nor the tiny model was started."""
    (tmp_path / "here.jsonl").write_text('{"question": "1 + 1 =", "answer": "2"}\n')
    gone = tmp_path / "gone.jsonl"
    given = {"path": [f"dataset.path={gone}", "dataset.type=jsonl"],
             "mix": [f"dataset.mix=[{{path: {tmp_path}/here.jsonl, type: jsonl}}, {{path: {gone}, type: jsonl}}]"],
             "eval_path": [f"dataset.eval_path={gone}"]}[what]
    code, err = _run(["train", "tiny", f"fileroot={tmp_path}", *given], capsys)
    assert (code, len(err)) == (2, 1), err
    assert f"dataset.path={gone} not found" in err[0]
    assert not (tmp_path / "models").exists()


def test_a_gpu_run_whose_memory_plan_does_not_fit_is_refused_before_ray(tmp_path, capsys, monkeypatch, no_ray):
    """A plain `areal-kit train` on a GPU platform checks the dry run's memory plan, with its line, before
    Ray starts and before the node's CUDA check. No GPU here: AREAL_DEVICE=cuda takes the GPU path and
    the card is the plan's 80 GB default (as in test_memory_plan.py)."""
    from areal_kit import hardware

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AREAL_DEVICE", "cuda")
    monkeypatch.setattr(hardware, "gpu_memory_bytes", lambda: None)
    checked = []
    monkeypatch.setattr(hardware, "check_cuda", lambda *a, **k: checked.append(a) or "ok")
    code, err = _run(["train", "1.5B_1gpu", f"fileroot={tmp_path}", "actor.vllm.gpu_memory_utilization=0.6"], capsys)
    assert (code, len(err)) == (2, 1), err
    assert err[0].startswith("error: the memory plan does not fit: shared GPU while generating: vLLM's 51 GB"), err
    assert "try actor.vllm.gpu_memory_utilization=0.55 or less" in err[0]
    assert not checked  # refused from the settings, before the node's CUDA is probed


def test_a_cpu_run_computes_no_memory_plan(tmp_path, capsys, monkeypatch, no_ray):
    """On CPU the plain run skips the plan (CPU workers take what the machine has): nothing is computed."""
    from areal_kit.rl import plan

    monkeypatch.setenv("AREAL_DEVICE", "cpu")
    monkeypatch.setattr(plan, "memory_plan", lambda cfg: pytest.fail("a memory plan on CPU"))
    code, err = _run(["train", "tiny", f"fileroot={tmp_path}", f"actor.path={tmp_path}/nope"], capsys)
    assert (code, len(err)) == (2, 1) and "not a model folder" in err[0]
