"""The peer side of bench/peer.py: TRL's GRPOTrainer on one workload, run in TRL's own venv.

Reads a JSON spec (model, prompt rows, reward name, group size, generation settings, batch,
steps, optimizer settings), trains with GRPOTrainer on this CPU (transformers `generate`, no
vLLM), and writes per-step wall time, generation and reward time, and mean reward as JSON.
The reward and the tokenizer loader are areal-kit's own (areal_kit on PYTHONPATH), so both sides
read and score answers alike.

    PYTHONPATH=. /work/bench-venvs/trl/bin/python bench/trl_grpo.py SPEC.json OUT.json
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path


def reward_fn(name: str, stops: set[int]):
    """areal-kit's reward `name` in TRL's signature (lists in, list of floats out); an answer whose
    last token is not in `stops` (eos, pad) was truncated, as areal-kit's no_eos says."""
    if name == "toy":
        from areal_kit.data.toy_task import toy_reward as fn
    else:
        from areal_kit.reward import get_reward

        fn = get_reward(name)

    def reward(prompts, completions, answer, question, completion_ids, **_):
        return [fn(q, c, {"answer": a, "no_eos": not ids or ids[-1] not in stops})
                for q, c, a, ids in zip(question, completions, answer, completion_ids)]

    reward.__name__ = f"areal_{name}"
    return reward


def main(spec_path: str, out_path: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal_kit.data.tokenizer import load_tokenizer

    spec = json.loads(Path(spec_path).read_text())
    torch.manual_seed(spec["seed"])
    tok = load_tokenizer(spec["model"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    rows = spec["rows"]
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"], "question": r["question"]}
                            for r in rows])
    n_prompts, group = spec["n_prompts"], spec["group_size"]
    mb = spec["micro_batch"]  # completions per forward/backward
    args = GRPOConfig(
        output_dir=spec["workdir"], use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        logging_steps=1, max_steps=spec["steps"], seed=spec["seed"], dataloader_num_workers=0,
        # One optimizer step per batch of n_prompts x group completions, generated at once.
        per_device_train_batch_size=mb, gradient_accumulation_steps=n_prompts * group // mb,
        num_generations=group, max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"], top_p=1.0, top_k=0, beta=spec.get("beta", 0.0), num_iterations=1,
        loss_type=spec.get("loss_type", "dapo"), scale_rewards="group",
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=spec["weight_decay"], adam_beta1=spec["adam_betas"][0], adam_beta2=spec["adam_betas"][1],
        max_grad_norm=spec["gradient_clipping"], shuffle_dataset=False, disable_tqdm=True,
    )
    timers = {"gen": 0.0, "reward": 0.0}

    @contextmanager
    def timed(key: str):
        t0 = time.time()
        try:
            yield
        finally:
            timers[key] += time.time() - t0

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *a, **k):
            with timed("gen"):
                return super()._generate_single_turn(*a, **k)

        def _calculate_rewards(self, *a, **k):
            with timed("reward"):
                return super()._calculate_rewards(*a, **k)

    steps: list[dict] = []

    class StepLog(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.time()
            timers.update(gen=0.0, reward=0.0)

        def on_step_end(self, args, state, control, **kw):
            e2e = time.time() - self.t0
            # time: when the step ended (epoch seconds), as areal-kit's metrics.jsonl has it.
            steps.append({"step": state.global_step, "time": time.time(), "e2e_time": e2e, "gen_time": timers["gen"],
                          "reward_time": timers["reward"],
                          "train_time": e2e - timers["gen"] - timers["reward"]})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs and steps:
                steps[-1]["task_reward"] = logs["reward"]
                steps[-1]["completion_len"] = logs.get("completions/mean_length")

    trainer = Timed(model=model, reward_funcs=[reward_fn(spec["reward"], {tok.eos_token_id, tok.pad_token_id})], args=args, train_dataset=ds,
                    processing_class=tok, callbacks=[StepLog()])
    t0 = time.time()
    trainer.train()
    Path(out_path).write_text(json.dumps({"steps": steps, "wall": time.time() - t0}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
