"""A tiny-preset run driven in-process, kept alive so tests can inspect its workers."""

from areal_kit import logs
from areal_kit.config.loader import load_config
from areal_kit.rl import controller as C
from areal_kit.rl.job import prepare


class Run:
    def __init__(self, tmp, overrides):
        cfg = load_config("tiny", [f"fileroot={tmp}", "tensorboard=false", *overrides])
        self.job = prepare(cfg)
        self.log = logs.RunLogger(self.job.paths, tensorboard=False, console=False)
        self.ctrl = C.Controller(self.job, self.log)
        self.ctrl.start()
        self.last = self.ctrl.run()
        self.rows = logs.read_metrics(self.job.paths.metrics_file)

    def close(self):
        import ray

        self.ctrl.stop()
        self.log.close()
        ray.shutdown()



def _fixed_sequences(run, n=6):
    """Prompts of the dataset with answers sampled by the engine: a real RL-shaped sequence."""
    rows = run.job.loader.rows[:n]
    return [r["prompt_ids"] for r in rows], [[5 + (i % 10), 1] for i in range(n)]


def _engine_vs_trainer(run, engine):
    import ray

    prompts, answers = _fixed_sequences(run)
    # Every rank runs the forward: ZeRO-3 gathers each layer's parameters from all of them.
    trainer_lp = ray.get([t.logprobs.remote(prompts, answers) for t in run.ctrl.workers.trainers.actors])[0]
    seqs = [p + a for p, a in zip(prompts, answers)]
    engine_lp = ray.get(engine.prompt_logprobs.remote(seqs))
    diffs = []
    for p, t, e in zip(prompts, trainer_lp, engine_lp):
        tail = e[len(p) - 1:]  # engine gives logprobs of tokens 1.., the answer starts at len(p)
        assert len(tail) == len(t)
        diffs += [abs(x - y) for x, y in zip(t, tail)]
    return max(diffs)
