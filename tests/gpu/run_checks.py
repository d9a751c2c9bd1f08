"""The acceptance suite's checks on a live run's workers (tests/integration/rl_run.py's Run, its
Ray actors kept alive): the engine's sampled tokens' logprobs against the trainer's, a weight sync
that must change them, the GPU memory an engine's sleep frees and its wake takes back, and a
trainer rank's reserved memory. test_gpu_acceptance.py drives them; the arithmetic that decides
each is acceptance.py's (tested on CPU by tests/unit/test_gpu_acceptance_helpers.py).
"""

from __future__ import annotations

import copy
import sys

import ray
from acceptance import logprob_gap

from areal_kit.rl import plan as run_plan

ROWS = 4  # prompts sampled per check, group_size answers each


def sampled_vs_trainer(run, engine) -> float:
    """Answers the engine samples through its rollout path (RolloutWorker.generate: the run's
    temperature, SamplingParams.logprobs=0 under logprobs_mode=processed_logprobs, so each token's
    logprob after temperature), against the trainer's logprobs of the same tokens (which divide
    the logits by the same temperature): the largest gap."""
    rows = [{**r, "seed": 1000 + i} for i, r in enumerate(run.job.loader.rows[:ROWS])]
    samples = [s for s in ray.get(engine.generate.remote(rows), timeout=600).samples if s.output_ids]
    prompts, answers = [s.prompt_ids for s in samples], [s.output_ids for s in samples]
    # Every rank runs the forward: ZeRO-3 gathers each layer's parameters from all of them.
    trainer = ray.get([t.logprobs.remote(prompts, answers) for t in run.ctrl.workers.trainers.actors])[0]
    return logprob_gap([s.logprobs for s in samples], trainer)


def all_engines_vs_trainer(run) -> float:
    return max(sampled_vs_trainer(run, e) for e in run.ctrl.workers.engines.actors)


# Run on the actors: Ray workers cannot import this module, so its functions travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _perturb(self) -> None:
    """On every trainer rank at once: new weights, far from the old (each by 0.05 x noise, the
    same noise on every rank). Under ZeRO-3 rank 0's change of the gathered parameters is what
    DeepSpeed partitions again when the gather ends."""
    import contextlib

    import deepspeed
    import torch

    self.outbox.before_collectives()
    params = [p for p in self.engine.module.parameters() if p.requires_grad]
    zero3 = any(hasattr(p, "ds_tensor") for p in params)
    gather = deepspeed.zero.GatheredParameters(params, modifier_rank=0) if zero3 else contextlib.nullcontext()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad(), gather:
        for p in params:
            p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.device, p.dtype))


def _free_memory(self) -> tuple[int, int]:
    """On a trainer rank: (free, total) bytes of its GPU as CUDA reports them, every process's use counted."""
    import torch

    torch.cuda.synchronize(self.device)
    return torch.cuda.mem_get_info(self.device)


def _max_reserved(self) -> int:
    """On a trainer rank: the most its caching allocator has reserved since it started."""
    import torch

    return torch.cuda.max_memory_reserved(self.device)


def sync_check(run) -> dict:
    """Perturb the trainer's weights, measure the engines' gap to them (must be large), push them
    as the run's next version, measure again (must be small). On shared GPUs the push goes through
    the run's own turns: every engine sleeps, then wakes for the sync, and each trainer rank's GPU
    reports its free memory awake, asleep and woken again ("memory": [(awake, asleep, woken,
    total)] a GPU, "utilization": vLLM's share)."""
    ctrl = run.ctrl
    trainers, engines = ctrl.workers.trainers.actors, ctrl.workers.engines.actors
    version = max(ray.get([e.get_version.remote() for e in engines])) + 1
    ray.get([t.__ray_call__.remote(_perturb) for t in trainers])
    out = {"before": all_engines_vs_trainer(run)}

    def push() -> float:
        return ctrl.weights.push(version, wait_engines=True)

    def free() -> list[tuple[int, int]]:
        return ray.get([t.__ray_call__.remote(_free_memory) for t in trainers])

    if ctrl.turns.active:
        ray.get([t.release_memory.remote() for t in trainers])  # what the checks' forwards cached
        awake = free()
        ctrl.turns.before_train()  # the run's sleep level
        asleep = free()
        ctrl.turns.after_train(push)  # wake the weights, sync, wake the KV cache
        woken = free()
        out["memory"] = [(a[0], s[0], w[0], a[1]) for a, s, w in zip(awake, asleep, woken)]
        out["utilization"] = ctrl.cfg.actor.vllm.gpu_memory_utilization
    else:
        push()
    out["after"] = all_engines_vs_trainer(run)
    return out


def reserved_check(run) -> dict:
    """Each trainer rank's reserved memory: its peak over the run ("peaks") and what stays once it
    returned its cache ("released"), with the memory plan of the run's settings ("plan": its
    trainer GPU; None where the model's shape is unknown)."""
    trainers = run.ctrl.workers.trainers.actors
    peaks = ray.get([t.__ray_call__.remote(_max_reserved) for t in trainers])
    released = [r["reserved"] for r in ray.get([t.release_memory.remote() for t in trainers])]
    cfg = copy.deepcopy(run.ctrl.cfg)
    cfg.actor.path = run.job.model_path  # tiny://toy is built: its folder has the shape
    plan = run_plan.memory_plan(cfg)
    return {"peaks": peaks, "released": released, "plan": plan.trainer if plan else None}
