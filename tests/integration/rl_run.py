"""A tiny run (the tiny preset's, or another's) driven in-process, kept alive so tests can inspect
its workers; and the streaming check a CPU and a GPU test share (a weight update interrupting generations in flight)."""

import sys
import time

import ray

from areal_kit import runlog
from areal_kit.config.loader import load_config
from areal_kit.rl.agreement import engine_vs_trainer
from areal_kit.rl.driver.controller import Controller, start_ray
from areal_kit.rl.driver.job import prepare

LONG = 40  # tokens of the interrupted answers (a streaming run's engines leave room for them)


class Run:
    def __init__(self, tmp, overrides, preset: str = "tiny"):
        cfg = load_config(preset, [f"fileroot={tmp}", "tensorboard=false", *overrides])
        self.job = prepare(cfg)
        self.log = runlog.RunLogger(self.job.paths, tensorboard=False, console=False)
        self.ctrl = Controller(self.job, self.log)
        start_ray(cfg)
        self.ctrl.start()
        self.last = self.ctrl.run().last
        self.rows = runlog.read_metrics(self.job.paths.metrics_file)

    def close(self):
        import ray

        self.ctrl.stop()
        self.log.close()
        ray.shutdown()


def _engine_vs_trainer(run, engine):
    """The gap for one engine, given by its actor handle."""
    index = next(i for i, a in enumerate(run.ctrl.workers.engines.actors) if a is engine)
    return engine_vs_trainer(run.ctrl.workers, run.job.loader.rows, index)


# Run on the actors: Ray workers cannot import this module, so its functions travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _long_answers(self, prompts: list[list[int]], n_tokens: int) -> list[tuple]:
    """On a streaming engine: n_tokens-token answers, each token's logprob and weight version."""
    from vllm import SamplingParams

    # ignore_eos, not min_tokens: min_tokens masks eos, and the processed logprobs would be of that
    # masked distribution, which the trainer's are not.
    # The run's temperature: the trainer's logprobs it is compared with divide the logits by it.
    sp = SamplingParams(n=8, temperature=self.cfg.ppo.gen.temperature, max_tokens=n_tokens, ignore_eos=True,
                        logprobs=0, detokenize=False, seed=11)
    outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [(p, a.token_ids, [lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)], a.versions)
            for p, o in zip(prompts, outs) for a in o.outputs]


def _perturb(self) -> None:
    """On a trainer rank: new weights, far enough from the old that their logprobs differ (under
    LoRA the adapter's: the frozen base is not sent)."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for p in self.engine.module.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)


def interrupt_check(run: Run, n_prompts: int, n_tokens: int) -> dict:
    """Start n_prompts x 8 long answers on engine 0, push new weights while they decode, and
    compare each answer's logprobs with the trainer's (which holds the new weights): the largest
    gap over tokens sampled after the update (new_gap) and before it (old_gap), and how many
    answers crossed the update. rollout.mode=stream, one trainer rank (ZeRO 0-2: whole parameters)."""
    ctrl = run.ctrl
    engine, trainer = ctrl.workers.engines.actors[0], ctrl.workers.trainers.actors[0]
    old = ctrl.state.version
    pending = engine.__ray_call__.remote(_long_answers, [r["prompt_ids"] for r in run.job.loader.rows[:n_prompts]],
                                         n_tokens)
    time.sleep(1.0)  # the first wave is decoding
    ray.get(trainer.__ray_call__.remote(_perturb))
    ctrl.weights.push(old + 1)
    ctrl.weights.wait()
    answers = ray.get(pending, timeout=600)
    crossed = [a for a in answers if set(a[3]) == {old, old + 1}]
    picked = crossed[:16] + [a for a in answers if set(a[3]) == {old + 1}][:16]
    lp = ray.get(trainer.logprobs.remote([a[0] for a in picked], [a[1] for a in picked]))
    gaps = {old: 0.0, old + 1: 0.0}
    for a, t in zip(picked, lp):
        for x, y, v in zip(a[2], t, a[3]):
            gaps[v] = max(gaps[v], abs(x - y))
    return {"crossed": len(crossed), "monotone": all(a[3] == sorted(a[3]) for a in answers),
            "new_gap": gaps[old + 1], "old_gap": gaps[old]}


def _answers_with_reasons(self, prompts: list[list[int]], n_tokens: int) -> list[tuple]:
    """On a streaming engine: n_tokens-token answers, each one's finish reason and token versions."""
    from vllm import SamplingParams

    sp = SamplingParams(n=8, temperature=1.0, max_tokens=n_tokens, ignore_eos=True, detokenize=False, seed=12)
    outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [(a.finish_reason, a.versions) for o in outs for a in o.outputs]


def abort_check(run: Run, n_prompts: int, n_tokens: int, pushes: int = 6) -> dict:
    """Start n_prompts x 8 long answers on engine 0 and push new weights `pushes` times while they
    decode: the answers (finish reason, token versions), the engine's version before the pushes,
    and how many requests the loads reported aborted."""
    ctrl = run.ctrl
    engine = ctrl.workers.engines.actors[0]
    old = ray.get(engine.get_version.remote())
    pending = engine.__ray_call__.remote(_answers_with_reasons,
                                         [r["prompt_ids"] for r in run.job.loader.rows[:n_prompts]], n_tokens)
    time.sleep(1.0)  # the first wave is decoding
    aborted = 0
    for v in range(old + 1, old + 1 + pushes):
        ctrl.weights.push(v)
        aborted += sum(x.get("aborted", 0) for x in ctrl.weights.wait())  # the send reports none
    return {"answers": ray.get(pending, timeout=600), "old": old, "aborted": aborted}
