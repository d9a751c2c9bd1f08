"""A tiny-preset run driven in-process, kept alive so tests can inspect its workers."""

from areal_kit import logs
from areal_kit.config.loader import load_config
from areal_kit.rl.agreement import engine_vs_trainer
from areal_kit.rl.controller import Controller, start_ray
from areal_kit.rl.job import prepare


class Run:
    def __init__(self, tmp, overrides):
        cfg = load_config("tiny", [f"fileroot={tmp}", "tensorboard=false", *overrides])
        self.job = prepare(cfg)
        self.log = logs.RunLogger(self.job.paths, tensorboard=False, console=False)
        self.ctrl = Controller(self.job, self.log)
        start_ray(cfg)
        self.ctrl.start()
        self.last = self.ctrl.run().last
        self.rows = logs.read_metrics(self.job.paths.metrics_file)

    def close(self):
        import ray

        self.ctrl.stop()
        self.log.close()
        ray.shutdown()


def _engine_vs_trainer(run, engine):
    return engine_vs_trainer(run.ctrl.workers, run.job.loader.rows, engine)
