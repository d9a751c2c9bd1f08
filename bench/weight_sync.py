"""Weight sync benchmark: seconds per sync, in-memory broadcast vs the disk path, vs raw broadcast.

A ~50M-parameter model on our real workers (one DeepSpeed trainer actor, one vLLM rollout actor,
started by areal_kit's Controller); each sync is the training loop's `Controller._sync`, timed
until the engine has loaded the weights: broadcast = trainer rank 0 sends 32 MB buckets over the
standalone gloo group into the vLLM worker extension, which receives them straight into its
parameters and re-packs each bucket's layers while the next bucket arrives; disk = the trainer
saves a Hugging Face folder with fsync (as a write to shared storage must be) and the engine
reloads it. The limit is a raw torch.distributed (gloo) broadcast of the same bytes, one flat
buffer ready on both sides, between this process and a child: no Ray call, no loading. The three
alternate, 5 of each.

    python bench/run.py weight_sync
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time

from bench import engines, workload
from bench.report import Result

REPS = 5
ABOUT = __doc__.split("\n\n")[1].replace("\n", " ")


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _raw_receiver(port: int, nbytes: int, reps: int) -> None:
    import torch

    from areal_kit.rl import weight_sync

    _, group = weight_sync.init_group("127.0.0.1", port, 1, 2, "gloo")
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(reps):
        weight_sync._broadcast(group, buf).wait()


class RawBroadcast:
    """A bare gloo broadcast of the weights' bytes, one flat buffer ready on both sides, between
    this process and a child; `once()` times one, so reps interleave with the real syncs."""

    def __init__(self, model_path: str, reps: int):
        import torch
        from transformers import AutoModelForCausalLM

        from areal_kit.rl import weight_sync

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        # The bytes a sync sends: every parameter once (the engine ties lm_head itself).
        self.flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).view(torch.uint8)
        port = _free_port()
        self.child = mp.get_context("spawn").Process(target=_raw_receiver, args=(port, self.flat.numel(), reps),
                                                     daemon=True)
        self.child.start()
        _, self.group = weight_sync.init_group("127.0.0.1", port, 0, 2, "gloo")

    def once(self) -> float:
        from areal_kit.rl import weight_sync

        t0 = time.time()
        weight_sync._broadcast(self.group, self.flat).wait()
        return time.time() - t0

    def close(self) -> None:
        self.child.join(60)


def _parts(ctrl) -> dict:
    """Where a sync's time goes: the same worker calls as Controller._sync, timed one by one."""
    import ray

    w = ctrl.workers
    trainer, rollout = w.trainers[0], w.rollouts[0]
    ctrl.state.version += 1
    t0 = time.time()
    ray.get(trainer.stage_weights.remote())
    send = trainer.send_weights.options(concurrency_group="weights").remote()
    send, recv = ray.get([send, rollout.receive_weights.remote(ctrl.state.version)])
    total = time.time() - t0
    path = os.path.join(ctrl.cfg.fileroot, "cache", "weight_sync", "parts")
    t0 = time.time()
    ray.get(trainer.save_hf.remote(path))
    save = time.time() - t0
    load = ray.get(rollout.load_from_disk.remote(path, ctrl.state.version))["load_time"]
    return {"bcast_total": total, "bcast_send": send["sync_send_time"], "bcast_recv_load": recv["load_time"],
            "bcast_recv_wait": recv["load_wait"], "bcast_recv_copy": recv["load_copy"],
            "bcast_recv_repack": recv["load_repack"], "bcast_recv_placed": recv["load_placed"], "disk_save": save,
            "disk_load": load}


def run() -> Result:
    import ray

    from areal_kit import logs
    from areal_kit.rl import controller as C

    model_path = workload.sync_model()
    fileroot = tempfile.mkdtemp(prefix="bench-sync-")
    cfg = engines.bench_config(model_path, fileroot, ["ppo.gen.max_new_tokens=16", "weight_sync=broadcast",
                                                      "ppo.reward_fns=[toy]"])
    job = C.prepare(cfg)
    log = logs.RunLogger(job.paths, tensorboard=False, console=False)
    ctrl = C.Controller(job, log)
    times = {"broadcast": [], "disk": [], "raw": []}
    raw = RawBroadcast(model_path, REPS)
    try:
        ctrl.start()
        n_tensors = sum(len(b) for b in ray.get(ctrl.workers.trainers[0].sync_plan.remote()))
        for _ in range(REPS):
            for mode in ("broadcast", "disk"):
                cfg.weight_sync = mode  # _sync reads it each call; the group stays joined
                ctrl.state.version += 1
                times[mode].append(ctrl._sync(wait_engines=True))
            times["raw"].append(raw.once())
        runs = [_parts(ctrl) for _ in range(3)]
        parts = {k: engines.median(r[k] for r in runs) for k in runs[0]}
    finally:
        ctrl.stop()
        ray.shutdown()
        log.close()
        raw.close()
    b, d, raw_s = (engines.median(times[k]) for k in ("broadcast", "disk", "raw"))
    mb = raw.flat.numel() / 1e6
    n = workload.n_params(model_path)
    figures = {"params": n, "megabytes": mb, "broadcast_s": b, "disk_s": d, "raw_broadcast_s": raw_s,
               "broadcast_mb_per_s": mb / b, "raw_mb_per_s": mb / raw_s, "broadcast_over_raw": b / raw_s,
               "reps": REPS, "tensors": n_tensors, "tensors_placed": parts.pop("bcast_recv_placed"),
               **{f"part_{k}_s": v for k, v in parts.items()}}
    rows = [["broadcast (areal-kit)", b, mb / b, f"{b / raw_s:.1f}x raw"],
            ["disk: save + fsync + reload", d, mb / d, f"{d / raw_s:.1f}x raw"],
            ["raw gloo broadcast (limit)", raw_s, mb / raw_s, "1.0x"]]
    notes = [f"{n / 1e6:.1f}M parameters, {mb:.0f} MB per sync (fp32; the tied lm_head is not sent, the engine "
             f"ties it); disk path on {_fs(fileroot)}. Seconds per sync include the Ray calls and vLLM's weight "
             "repacking (common to both paths).",
             f"One sync taken apart (medians of 3): broadcast {parts['bcast_total']:.2f} s = trainer send (gather, "
             f"broadcast) {parts['bcast_send']:.2f} s, overlapped with the engine's receive + load "
             f"{parts['bcast_recv_load']:.2f} s (blocked on the wire {parts['bcast_recv_wait']:.2f} s, copying "
             f"{parts['bcast_recv_copy']:.2f} s, re-packing {parts['bcast_recv_repack']:.2f} s; "
             f"{figures['tensors_placed']:.0f} of {n_tensors} tensors received straight into the parameters); "
             f"disk = save with fsync {parts['disk_save']:.2f} s + engine reload {parts['disk_load']:.2f} s.",
             "Both paths end in the same re-pack of every linear layer for oneDNN on CPU (0.065 s for this model "
             "on one core, about the cost of transposing the weights; it keeps generation 1.3x faster "
             "than torch's linear). With a local ext4 and its page cache as the 'disk' the ratio stays near "
             "(save + re-pack) / (transfer + re-pack); writing to shared storage, and GPUs (NCCL, no re-pack), "
             "change that balance."]
    return Result("weight_sync", "seconds per sync: in-memory broadcast vs disk save + reload", figures,
                  ratio=d / b, target=3.0, columns=["path", "seconds/sync", "MB/s", "vs raw"], rows=rows,
                  notes=notes, checks={"broadcast within 2x of raw": b / raw_s <= 2.0})


def _fs(path: str) -> str:
    """The filesystem under path (a tmpfs would flatter the disk path)."""
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mnt, fstype = line.split()[:3]
                if os.path.abspath(path).startswith(mnt) and len(mnt) > len(best):
                    best, kind = mnt, fstype
    except OSError:
        pass
    return f"{kind} ({best})"
