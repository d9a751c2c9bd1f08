"""Trainer worker: one DeepSpeed rank of the actor (and the frozen reference model), in a Ray actor.

Ranks form a torch.distributed world (gloo on CPU, NCCL on GPU, from areal_kit.hardware). Each
step every rank gets its shard of the batch's sequences (one Ray object per rank) and hands it to
rl/algo/ppo.py's PPOActor, which holds the PPO/GRPO math; this worker is its engine (TrainEngine):
the packed forward passes in micro-batches of at most max_tokens_per_mb tokens, DeepSpeed's
backward and optimizer step, the collectives.
Rank 0 also owns the trainer's end of the weight sync (rl/trainer/weight_send.py).
DeepSpeed's config, ZeRO-3's gathered state and the universal checkpoint format are in
rl/trainer/deepspeed_zero.py.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import ray
import torch
import torch.distributed as dist

from areal_kit import hardware
from areal_kit.checkpoints import step_of
from areal_kit.data.tokenizer import copy_tokenizer_files
from areal_kit.durable import fsync_tree
from areal_kit.rl import lora
from areal_kit.rl.algo import functional as Fn
from areal_kit.rl.algo.packing import Answers, Packed, min_bins, pack, partition
from areal_kit.rl.algo.ppo import PPOActor, answer_budget
from areal_kit.rl.checkpoint import rng
from areal_kit.rl.common import heap, testhooks
from areal_kit.rl.common.stacks import StackDumps
from areal_kit.rl.hallway import RecoverLoad, TrainReply
from areal_kit.rl.sample import TrainerRow
from areal_kit.rl.trainer.deepspeed_zero import deepspeed_config, gathered_state, ranks_written, universal_tag
from areal_kit.rl.trainer.weight_send import IpcSender, WeightSender
from areal_kit.rl.weight_sync import transport

if TYPE_CHECKING:
    from areal_kit.config.schema import TrainConfig


def _pin_to_cores(cores: str) -> None:
    """Run this rank's threads on its own cores (cpu_cores=split); before any torch thread starts,
    since threads inherit the affinity of the thread that creates them."""
    if not cores:
        return
    ids = [int(c) for c in cores.split(",")]
    os.sched_setaffinity(0, ids)
    torch.set_num_threads(len(ids))


class TrainerWorker(WeightSender, IpcSender, StackDumps):
    def __init__(self, rank: int, world: int, cfg: TrainConfig, model_path: str, env: dict[str, str],
                 total_steps: int = 1) -> None:
        os.environ.update(env)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                           "LOCAL_WORLD_SIZE": "1"})
        self.rank, self.world, self.cfg, self.model_path = rank, world, cfg, model_path
        self.sync_group = None
        self.outbox = transport.Outbox()
        self.version = 0
        self.total_steps = total_steps

    # ---------------------------------------------------------------- setup
    def setup(self) -> float:
        t0 = time.time()
        # In the worker only: the driver, which imports this module to start the actor, never loads a model.
        import deepspeed
        from transformers import AutoModelForCausalLM

        from areal_kit.rl.algo import varlen

        heap.freeze_imports()
        plat = hardware.detect()
        self.device = plat.torch_device
        self.outbox.exclusive = plat.exclusive_weight_send
        _pin_to_cores(os.environ.get("AREAL_CPU_CORES", ""))
        hardware.pin_gloo_interface(ray.util.get_node_ip_address())  # ranks on several hosts find each other
        # A collective that never completes (a rank stuck or gone) fails after the watchdog's
        # longest bound instead of waiting forever.
        deepspeed.init_distributed(dist_backend=plat.dist_backend,
                                   timeout=timedelta(seconds=self.cfg.exp_ctrl.hang_first_s))
        torch.manual_seed(self.cfg.seed)
        dtype = self._dtype(plat)
        attn = varlen.choose(plat.device)
        # Which attention runs is decided on the trainer's node (flash-attn may be installed there
        # and not on the driver's): the controller asks for it and logs it (`attention()`).
        self.attention_note = varlen.explain(plat.device)
        self.layout = functools.partial(varlen.layout_kwargs, attn)  # (views, device) -> forward kwargs
        # A group's answers share one copy of their prompt where our attention runs (flash-attn's
        # takes contiguous sequences only): the other layers run on it once, not group_size times.
        self.share_prompts = attn == varlen.NAME
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype, attn_implementation=attn)
        if self.cfg.actor.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        a = self.cfg.actor
        trained = lora.wrap(model, a.lora)  # actor.lora: PEFT's adapter, the only weights trained
        # A torch AdamW from code: DeepSpeed's config "AdamW" JIT-compiles FusedAdam (~110 s on CPU).
        # On a GPU its fused kernel: the default there (foreach) allocates temporaries as large as
        # the fp32 states it updates for the step's duration, which the memory plan would have to
        # hold free. On CPU the default updates one tensor at a time, as the presets were tuned.
        opt = torch.optim.AdamW(lora.trainable(trained), lr=a.lr, betas=(a.adam_betas[0], a.adam_betas[1]),
                                weight_decay=a.weight_decay, fused=True if plat.device == "cuda" else None)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self._lr_lambda())
        self.engine, _, _, self.scheduler = deepspeed.initialize(model=trained, optimizer=opt, lr_scheduler=sched,
                                                                 config=deepspeed_config(a, dtype))
        self.ref = None
        # Under LoRA the reference is the base: the policy with its adapter disabled (logprob_pass).
        if self.cfg.ppo.kl_ctl > 0 and not self.cfg.actor.lora.enabled:
            ref_path = self.cfg.ref.path or self.model_path
            self.ref = AutoModelForCausalLM.from_pretrained(ref_path, dtype=dtype, attn_implementation=attn)
            # transformers types .to through a wrapper whose first parameter is the model itself.
            self.ref.to(self.device).eval().requires_grad_(False)  # type: ignore[arg-type]
        c = self.cfg
        self.actor = PPOActor(c.ppo, self, train_tokens=c.actor_train.mb_spec.max_tokens_per_mb,
                              ref_tokens=c.ref_inf.mb_spec.max_tokens_per_mb,
                              answer_tokens=answer_budget(c.ppo, c.dataset, c.agent))
        heap.freeze()
        return time.time() - t0

    def _dtype(self, plat: hardware.Platform) -> torch.dtype:
        d = self.cfg.actor.dtype
        if d == "auto":
            d = "fp32" if plat.is_cpu else "bf16"
        return torch.bfloat16 if d == "bf16" else torch.float32

    def _lr_lambda(self) -> Callable[[int], float]:
        a = self.cfg.actor
        total = max(self.total_steps, 1)
        warm = int(a.warmup_steps_proportion * total)

        def f(step: int) -> float:
            if warm and step < warm:
                return (step + 1) / warm
            if a.lr_scheduler == "constant":
                return 1.0
            frac = min(1.0, (step - warm) / max(total - warm, 1))
            return 0.5 * (1 + math.cos(math.pi * frac)) if a.lr_scheduler == "cosine" else 1.0 - frac

        return f

    def attention(self) -> str:
        """The attention this rank trains with, in words for the run's log (after setup)."""
        return self.attention_note

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it (for rendezvous hosted by this rank)."""
        return ray.util.get_node_ip_address(), hardware.free_port()

    def set_master(self, addr: str, port: int) -> None:
        os.environ.update({"MASTER_ADDR": addr, "MASTER_PORT": str(port)})

    # ---------------------------------------------------------------- forward
    def _pack(self, shard: list[TrainerRow], idx: list[int]) -> Packed:
        return pack([shard[i].prompt_ids for i in idx], [shard[i].output_ids for i in idx], self.share_prompts)

    def _logprobs(self, model: torch.nn.Module, pk: Packed, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob, entropy) of each answer token of pk, in its order (Packed.targets)."""
        ids = pk.input_ids.to(self.device)[None]
        pos = pk.position_ids.to(self.device)[None]
        lm: Any = model  # its decoder and head are found by name: transformers' and PEFT's models differ
        base = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
        with torch.set_grad_enabled(grad):
            # use_cache=False: transformers only turns position ids into a packed (block-diagonal)
            # mask when no KV cache is present. The layout spares every layer finding the sequences.
            hidden = base(input_ids=ids, position_ids=pos, use_cache=False,
                          **self.layout(pk.views, self.device)).last_hidden_state[0]
            # Logits at the positions that predict answer tokens only: a prompt's are never used.
            lp, ent = Fn.chunked_logprobs(hidden[pk.pred_pos.to(self.device)], lm.get_output_embeddings(),
                                          pk.targets.to(self.device), self.cfg.ppo.gen.temperature)
        return lp, ent

    # ---------------------------------------------------------------- TrainEngine (rl/algo/ppo.py)
    def allreduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Sum (or max) of values over the ranks, in float64 (token counts stay exact)."""
        self.outbox.before_collectives()  # a step's first collective: on GPUs, after the weight send
        # On the trainer's device: NCCL, DeepSpeed's group on GPUs, refuses host tensors.
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()

    def micro_batches(self, shard: list[TrainerRow], max_tokens: int) -> list[list[int]]:
        lengths = [len(s.prompt_ids) + len(s.output_ids) for s in shard]
        n = int(self.allreduce([min_bins(lengths, max_tokens) if lengths else 0], "max")[0])
        return partition(lengths, max_tokens, n)

    def logprob_pass(self, shard: list[TrainerRow], ans: Answers, bins: list[list[int]],
                     reference: bool = False) -> torch.Tensor:
        """Under LoRA the KL reference is the base: the policy with its adapter disabled."""
        if reference and self.ref is not None:
            return self._pass(self.ref, shard, ans, bins)
        self.engine.eval()
        if not reference:
            return self._pass(self.engine.module, shard, ans, bins)
        with self.engine.module.disable_adapter():
            return self._pass(self.engine.module, shard, ans, bins)

    def _pass(self, model: torch.nn.Module, shard: list[TrainerRow], ans: Answers,
              bins: list[list[int]]) -> torch.Tensor:
        out = torch.empty(ans.n_tokens)
        for idx in bins:
            if not idx:  # keep in step with ranks that have more micro-batches (ZeRO-3 gathers)
                self._logprobs(model, _dummy_pack(), grad=False)
                continue
            lp, _ = self._logprobs(model, self._pack(shard, idx), grad=False)
            out[ans.index(idx)] = lp.detach().cpu()
        return out

    def train_forward(self, shard: list[TrainerRow], rows: list[int], last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        self.engine.train()
        self.engine.set_gradient_accumulation_boundary(last)
        return self._logprobs(self.engine.module, self._pack(shard, rows) if rows else _dummy_pack(), grad=True)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def optimizer_step(self) -> float | None:
        self.send_wait += self.outbox.wait_sent()  # the step changes the weights being sent
        own = self._grad_norm() if self.cfg.actor.zero_stage == 0 else None
        self.engine.step()
        gn = self.engine.get_global_grad_norm()
        gn = own if gn is None else gn
        return None if gn is None else float(gn)

    def _grad_norm(self) -> torch.Tensor | None:
        """2-norm of the gradients on the parameters, before clipping. DeepSpeed reports none at
        ZeRO-0 (its clipping discards it); there the gradients are already averaged over ranks."""
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else None

    def last_lr(self) -> float:
        return self.scheduler.get_last_lr()[0] if self.scheduler else self.cfg.actor.lr

    # ---------------------------------------------------------------- train
    def train_step(self, shard: list[TrainerRow], trace: list[int] | None = None) -> TrainReply:
        """One PPO step on this rank's shard of the batch (groups.shard_batch): rl/algo/ppo.py's PPOActor;
        trace: the shard's rows whose per-token values come back with the stats (a dump step's samples)."""
        t0 = time.time()
        testhooks.before_train_step(self.rank, self.version + 1)
        self.send_wait = 0.0  # seconds the optimizer steps waited for a weight send
        reply = self.actor.train_step(shard, trace or ())
        self.version += 1
        reply.stats["train_time"] = time.time() - t0
        reply.stats["send_wait_time"] = self.send_wait
        return reply

    # ---------------------------------------------------------------- weights
    def full_state(self, adapter_only: bool = False, every_rank: bool = False) -> dict[str, torch.Tensor]:
        """The full (unsharded) weights, or the LoRA adapter's alone, on rank 0 ({} elsewhere), or
        with every_rank on each rank; every rank must call it under ZeRO-3."""
        self.outbox.before_collectives()  # ZeRO-3's gathers are collectives of the training world
        m = self.engine.module
        only = lora.is_adapter if adapter_only else None
        if self.cfg.actor.zero_stage == 3:
            return gathered_state(m, keep=self.rank == 0 or every_rank, only=only)
        if self.rank != 0 and not every_rank:  # ZeRO 0-2: every rank holds the whole model
            return {}
        return {k: v for k, v in m.state_dict().items() if only(k)} if only else m.state_dict()

    def save_hf(self, path: str, merged: bool | None = None) -> str:
        """Hugging Face folder (weights + config + tokenizer), written atomically by rank 0. Under
        LoRA a PEFT adapter folder, or with merged (default actor.lora.save_merged) the merged model."""
        lcfg = self.cfg.actor.lora
        merged = lcfg.save_merged if merged is None else merged
        state = self.full_state(adapter_only=lcfg.enabled and not merged)
        if self.rank != 0:
            return path
        tmp = path.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        module = self.engine.module
        if lcfg.enabled and merged:
            module, state = module.get_base_model(), lora.merged_state(state, lcfg)
        module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        copy_tokenizer_files(self.model_path, tmp)  # byte for byte: a re-save can change how it reads
        fsync_tree(tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
        return path

    # ---------------------------------------------------------------- recover (rl/driver/recover.py)
    def save_recover(self, path: str) -> float:
        """DeepSpeed checkpoint (model, optimizer, LR scheduler) plus this rank's RNG states into path.

        Every rank must call it: each saves its own ZeRO shard. Each rank fsyncs what is there
        before returning, so the driver's rename publishes only durable files.
        """
        t0 = time.time()
        self.outbox.before_collectives()  # DeepSpeed's save runs collectives of the training world
        # Under LoRA the frozen base is left out: it is actor.path's, and loads from there.
        self.engine.save_checkpoint(path, tag="deepspeed", client_state={"version": self.version},
                                    save_latest=False, **lora.recover_kwargs(self.cfg.actor.lora, save=True))
        rng.save(os.path.join(path, f"rng_rank{self.rank}.pt"))
        fsync_tree(path)
        return time.time() - t0

    def load_recover(self, path: str) -> RecoverLoad:
        """Inverse of save_recover (every rank); what it loaded: the weight version it holds, how many
        ranks wrote the checkpoint, whether it was loaded in the universal format, and the load's seconds.

        A checkpoint written by another number of ranks (a node lost, or added) loads through
        DeepSpeed's universal format: rank 0 converts the ZeRO shards once (kept beside them for a
        later resume), and every rank takes its own slice of the merged state. ZeRO-0 keeps whole
        states, which load on any number of ranks as they are."""
        testhooks.before_load(self.rank, step_of(os.path.dirname(path)))  # a fault the tests inject (unset: nothing)
        self.outbox.wait_sent()  # the load overwrites the weights a send may still be reading
        self.outbox.before_collectives()  # the conversion's barrier is a collective of the training world
        tag, t0 = "deepspeed", time.time()
        written = ranks_written(path)
        if written != self.world and self.cfg.actor.zero_stage > 0:
            tag = universal_tag(path, self.rank)
            dist.barrier()
            # Read at load time: the engine was built before anyone knew the checkpoint's layout.
            self.engine._config.load_universal_checkpoint = True
        loaded, client = self.engine.load_checkpoint(path, tag=tag, load_optimizer_states=True,
                                                     load_lr_scheduler_states=True,
                                                     **lora.recover_kwargs(self.cfg.actor.lora, save=False))
        self.engine._config.load_universal_checkpoint = False
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{tag}' in {path}")
        self.version = int((client or {}).get("version", 0))
        own = os.path.join(path, f"rng_rank{self.rank}.pt")
        if os.path.exists(own):  # a rank the writing run did not have keeps its seeded RNG
            rng.load(own)
        return RecoverLoad(self.version, written, tag != "deepspeed", time.time() - t0)

    def logprobs(self, prompts: list[list[int]], answers: list[list[int]]) -> list[list[float]]:
        """Answer logprobs under the current weights (tests compare them with vLLM's)."""
        self.outbox.before_collectives()  # ZeRO-3 gathers every layer for the forward
        shard = [TrainerRow(p, a) for p, a in zip(prompts, answers)]
        bins = partition([len(p) + len(a) for p, a in zip(prompts, answers)],
                         self.cfg.actor_train.mb_spec.max_tokens_per_mb)
        ans = Answers([len(a) for a in answers])
        return [t.tolist() for t in ans.split(self.logprob_pass(shard, ans, bins))]

    def local_checksum(self) -> float:
        """Sum of this rank's parameters: full replicas under ZeRO 0-2, its shards under ZeRO-3
        (padded with zeros, so the ranks' sums add up to the model's)."""
        return float(sum(getattr(p, "ds_tensor", p).detach().double().sum().item()
                         for p in self.engine.module.parameters()))


def _dummy_pack() -> Packed:
    return pack([[0]], [[0]])  # a 2-token sequence for the zero-weight passes of ranks with fewer sequences

