"""An evaluation whose engine fails part-way: one line (exit 1), the traceback in OUT/error.log,
the samples graded before it kept, and a re-run that resumes after them.

The engine is a stand-in (an engine that dies on its second chunk cannot be made on demand); the
runner, the records and the CLI are the real code. The real engine refusing to start is in
tests/integration/test_eval_tiny.py.
"""

import io
import json

import pytest
from rich.console import Console

from areal_kit.data.tokenizer import load_tokenizer
from areal_kit.errors import RunFailed
from areal_kit.eval import engine as eval_engine
from areal_kit.eval.evaluation import EvalConfig, run

ROWS = [{"idx": i, "question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
        for i in range(6)]
BOXED_ZERO: tuple[int, ...] = ()


class DiesOnChunk:
    """Answers every request with the right boxed answer, until its chunk number `dies`."""

    num_engines = 1

    def __init__(self, dies: int | None, error: BaseException | None = None):
        self.dies, self.calls = dies, 0
        self.error = error or RuntimeError("EngineCore died unexpectedly")

    def generate(self, requests):
        self.calls += 1
        if self.calls == self.dies:
            raise self.error
        return [eval_engine.GenResult(r.key, BOXED_ZERO, "stop") for r in requests]

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from areal_kit.data.tiny_model import TinySpec, build

    path = build(str(tmp_path_factory.mktemp("tiny") / "bpe"), TinySpec(kind="bpe", heads=2, kv_heads=1))
    global BOXED_ZERO  # the engine answers in token ids, as vLLM does; the runner decodes them
    BOXED_ZERO = tuple(load_tokenizer(path)("\\boxed{0}", add_special_tokens=False)["input_ids"])
    return path


def test_a_failed_engine_keeps_what_was_graded_and_a_rerun_resumes(model, tmp_path, monkeypatch):
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "out"
    cfg = EvalConfig(model_path=model, output_path=str(out), data_dir=str(tmp_path / "data"), data_names=["gsm8k"],
                     num_samples=0, max_gen_tokens=4, prompt_type="plain", chunk_size=4)  # 4 graded, then death
    engine = DiesOnChunk(dies=2)
    monkeypatch.setattr(eval_engine, "open_engines", lambda *a, **k: engine)
    with pytest.raises(RunFailed) as got:
        run(cfg, console=Console(file=io.StringIO()))
    assert str(got.value) == (f"eval failed: RuntimeError: EngineCore died unexpectedly (traceback in "
                              f"{out}/error.log; the 4 sample(s) graded before it are kept, a re-run resumes "
                              "after them)")
    assert "Traceback (most recent call last):" in (out / "error.log").read_text()
    assert len((out / "gsm8k" / "samples.jsonl").read_text().splitlines()) == 4
    assert not (out / "aggregate.json").exists()

    engine = DiesOnChunk(dies=None)
    monkeypatch.setattr(eval_engine, "open_engines", lambda *a, **k: engine)
    printed = io.StringIO()
    agg = run(cfg, console=Console(file=printed, width=200))
    assert "4 already done, 2 to generate" in printed.getvalue()
    assert engine.calls == 1
    assert not (out / "error.log").exists()
    assert agg["results"]["gsm8k"]["num_questions"] == 6


def test_ctrl_c_during_generation_says_so(model, tmp_path, monkeypatch, capsys):
    from areal_kit.cli import main

    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    monkeypatch.setattr(eval_engine, "open_engines", lambda *a, **k: DiesOnChunk(dies=1, error=KeyboardInterrupt()))
    with pytest.raises(SystemExit) as got:
        main(["eval", "--model_path", model, "--output_path", str(tmp_path / "out"), "--data_dir",
              str(tmp_path / "data"), "--data_names", "gsm8k", "--num_samples", "0", "--prompt_type", "plain"])
    assert got.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted (Ctrl-C)"
    assert not (tmp_path / "out" / "error.log").exists()  # an interruption is no failure


def test_sigterm_during_generation_stops_the_engines_and_keeps_the_graded_samples(model, tmp_path, monkeypatch):
    """A real SIGTERM (a scheduler's stop) to this process while the second chunk generates, inside
    the CLI's stops_say_so: Interrupted (exit code 143), not a kill. The engines are closed, the 4
    graded samples stay, no error.log, and SIGTERM's handler is the old one afterwards."""
    import os
    import signal
    import time

    from areal_kit.interrupts import Interrupted, stops_say_so

    class SigtermOnChunk(DiesOnChunk):
        def generate(self, requests):
            if self.calls == 1:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises before this ends
            return super().generate(requests)

    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "out"
    cfg = EvalConfig(model_path=model, output_path=str(out), data_dir=str(tmp_path / "data"), data_names=["gsm8k"],
                     num_samples=0, max_gen_tokens=4, prompt_type="plain", chunk_size=4)
    engine = SigtermOnChunk(dies=None)
    monkeypatch.setattr(eval_engine, "open_engines", lambda *a, **k: engine)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as got, stops_say_so():
        run(cfg, console=Console(file=io.StringIO()))
    assert (str(got.value), got.value.exit_code) == ("interrupted (SIGTERM)", 143)
    assert engine.closed
    assert signal.getsignal(signal.SIGTERM) is before
    assert len((out / "gsm8k" / "samples.jsonl").read_text().splitlines()) == 4
    assert not (out / "error.log").exists()
