"""Trainer worker: one DeepSpeed rank of the actor (and the frozen reference model), in a Ray actor.

Ranks form a torch.distributed world (gloo on CPU, NCCL on GPU, from areal_kit.hardware). Each
step every rank gets its shard of the batch's sequences (one Ray object per rank), packs it into
micro-batches of at most max_tokens_per_mb tokens, and accumulates gradients so that the loss is
the mean over every answer token of the global batch, not a mean of micro-batch means.
Rank 0 also owns the trainer's end of the weight sync (rl/weight_sync/sender.py).
DeepSpeed's config, ZeRO-3's gathered state and the universal checkpoint format are in
rl/workers/deepspeed_zero.py.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import time
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from areal_kit import hardware
from areal_kit.data.tokenizer import copy_tokenizer_files
from areal_kit.durable import fsync_tree
from areal_kit.rl import lora
from areal_kit.rl.algo import functional as Fn
from areal_kit.rl.algo.packing import Answers, Packed, min_bins, pack, partition
from areal_kit.rl.checkpoint import rng
from areal_kit.rl.weight_sync import transport
from areal_kit.rl.weight_sync.colocated import IpcSender
from areal_kit.rl.weight_sync.sender import WeightSender
from areal_kit.rl.workers import heap, release, testhooks
from areal_kit.rl.workers.deepspeed_zero import deepspeed_config, gathered_state, ranks_written, universal_tag
from areal_kit.rl.workers.stacks import StackDumps


def _pin_to_cores(cores: str) -> None:
    """Run this rank's threads on its own cores (cpu_cores=split); before any torch thread starts,
    since threads inherit the affinity of the thread that creates them."""
    if not cores:
        return
    ids = [int(c) for c in cores.split(",")]
    os.sched_setaffinity(0, ids)
    torch.set_num_threads(len(ids))


class TrainerWorker(WeightSender, IpcSender, StackDumps, release.TrainerTurn):
    def __init__(self, rank: int, world: int, cfg, model_path: str, env: dict[str, str],
                 total_steps: int = 1):
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
        model = lora.wrap(model, a.lora)  # actor.lora: PEFT's adapter, the only weights trained
        # A torch AdamW from code: DeepSpeed's config "AdamW" JIT-compiles FusedAdam (~110 s on CPU).
        # On a GPU its fused kernel: the default there (foreach) allocates temporaries as large as
        # the fp32 states it updates for the step's duration, which the memory plan would have to
        # hold free. On CPU the default updates one tensor at a time, as the presets were tuned.
        opt = torch.optim.AdamW(lora.trainable(model), lr=a.lr, betas=tuple(a.adam_betas),
                                weight_decay=a.weight_decay, fused=True if plat.device == "cuda" else None)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self._lr_lambda())
        self.engine, _, _, self.scheduler = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                                                 config=deepspeed_config(a, dtype))
        self.ref = None
        # Under LoRA the reference is the base: the policy with its adapter disabled (_ref_logprobs).
        if self.cfg.ppo.kl_ctl > 0 and not lora.enabled(self.cfg):
            ref_path = self.cfg.ref.path or self.model_path
            self.ref = AutoModelForCausalLM.from_pretrained(ref_path, dtype=dtype, attn_implementation=attn)
            self.ref.to(self.device).eval().requires_grad_(False)
        heap.freeze()
        return time.time() - t0

    def _dtype(self, plat):
        d = self.cfg.actor.dtype
        if d == "auto":
            d = "fp32" if plat.is_cpu else "bf16"
        return torch.bfloat16 if d == "bf16" else torch.float32

    def _lr_lambda(self):
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
    def _pack(self, shard: list[dict], idx: list[int]) -> Packed:
        return pack([shard[i]["prompt_ids"] for i in idx], [shard[i]["output_ids"] for i in idx], self.share_prompts)

    def _logprobs(self, model, pk: Packed, grad: bool):
        """(logprob, entropy) of each answer token of pk, in its order (Packed.targets)."""
        ids = pk.input_ids.to(self.device)[None]
        pos = pk.position_ids.to(self.device)[None]
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        with torch.set_grad_enabled(grad):
            # use_cache=False: transformers only turns position ids into a packed (block-diagonal)
            # mask when no KV cache is present. The layout spares every layer finding the sequences.
            hidden = base(input_ids=ids, position_ids=pos, use_cache=False,
                          **self.layout(pk.views, self.device)).last_hidden_state[0]
            # Logits at the positions that predict answer tokens only: a prompt's are never used.
            lp, ent = Fn.chunked_logprobs(hidden[pk.pred_pos.to(self.device)], model.get_output_embeddings(),
                                          pk.targets.to(self.device), self.cfg.ppo.gen.temperature)
        return lp, ent

    def _allreduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Sum (or max) of values over the ranks, in float64 (token counts stay exact)."""

        self.outbox.before_collectives()  # a step's first collective: on GPUs, after the weight send
        # On the trainer's device: NCCL, DeepSpeed's group on GPUs, refuses host tensors.
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()

    def _micro_batches(self, shard: list[dict], max_tokens: int) -> list[list[int]]:
        lengths = [len(s["prompt_ids"]) + len(s["output_ids"]) for s in shard]
        n = int(self._allreduce([min_bins(lengths, max_tokens) if lengths else 0], "max")[0])
        return partition(lengths, max_tokens, n)

    def _pass(self, model, shard, ans: Answers, bins, grad=False) -> torch.Tensor:
        """Answer logprobs of shard, flat (ans), micro-batch by micro-batch (no grad)."""
        out = torch.empty(ans.n_tokens)
        for idx in bins:
            if not idx:  # keep in step with ranks that have more micro-batches (ZeRO-3 gathers)
                self._logprobs(model, _dummy_pack(), grad)
                continue
            lp, _ = self._logprobs(model, self._pack(shard, idx), grad)
            out[ans.index(idx)] = lp.detach().cpu()
        return out

    # ---------------------------------------------------------------- train
    def train_step(self, shard: list[dict]) -> dict:
        """One PPO step on this rank's shard of the batch (groups.shard_batch)."""
        t0 = time.time()
        testhooks.before_train_step(self.rank, self.version + 1)
        p = self.cfg.ppo
        # Every per-token quantity below is one flat tensor over the shard's answer tokens (ans).
        ans = Answers([len(s["output_ids"]) for s in shard])
        bins = self._micro_batches(shard, self.cfg.actor_train.mb_spec.max_tokens_per_mb)
        t_start_ref = time.time()
        ref_lp = self._ref_logprobs(shard, ans)
        t_ref = time.time()
        behav = torch.tensor([x for s in shard for x in s["logprobs"]], dtype=torch.float32)
        if p.use_decoupled_loss or p.ppo_n_minibatches > 1:
            self.engine.eval()
            prox = self._pass(self.engine.module, shard, ans, bins)
        elif p.max_head_offpolicyness > 0:
            prox = behav  # plain PPO off-policy: the behaviour policy is the old policy
        else:
            prox = None  # on-policy, one minibatch: the old policy is the current one
        t_prox = time.time()
        pol = prox if prox is not None else behav
        kls = Fn.kl_estimate(pol, ref_lp, p.kl_estimator) if ref_lp is not None else None
        mask = loss_masks(shard, ans)
        adv = self._advantages(shard, ans, mask, kls)
        stats = self._optimize(shard, ans, mask, adv, prox, behav, ref_lp)
        self.version += 1
        if kls is not None and kls.numel():
            stats["kl_reward"] = -p.kl_ctl * float(kls.mean())
        stats["train_time"] = time.time() - t0
        # Parts of train_time, for metrics.jsonl's per-step breakdown: the reference
        # model's logprobs and the recomputed proximal logprobs; the rest is the PPO update.
        stats["ref_logp_time"] = t_ref - t_start_ref
        stats["prox_logp_time"] = t_prox - t_ref
        return stats

    def _ref_logprobs(self, shard, ans: Answers):
        """The KL reference's answer logprobs, in ref_inf.mb_spec's micro-batches (None without KL)."""
        if self.cfg.ppo.kl_ctl <= 0:
            return None
        bins = self._micro_batches(shard, self.cfg.ref_inf.mb_spec.max_tokens_per_mb)
        if self.ref is not None:
            return self._pass(self.ref, shard, ans, bins)
        self.engine.eval()  # LoRA (setup loaded no reference): the base, the policy without its adapter
        with self.engine.module.disable_adapter():
            return self._pass(self.engine.module, shard, ans, bins)

    def _advantages(self, shard, ans: Answers, w: torch.Tensor, kls) -> torch.Tensor:
        """Every answer token's advantage (flat); w is the loss mask: tokens a workflow inserted
        are not the policy's."""
        p = self.cfg.ppo
        lens = ans.lens.tolist()
        seq_r = torch.tensor([s["seq_reward"] for s in shard], dtype=torch.float32)
        if kls is not None and p.kl_mode == "reward":
            tok_r = -p.kl_ctl * kls * w
        else:
            tok_r = torch.zeros(ans.n_tokens)
        ret = Fn.token_returns(seq_r, tok_r, lens, p.discount)
        if p.adv_norm:
            ret = Fn.masked_normalize(ret, stats=tuple(self._allreduce(
                [(ret * w).sum().item(), (ret.pow(2) * w).sum().item(), w.sum().item()])))
        return ret

    def _optimize(self, shard, ans: Answers, mask, adv, prox, behav, ref_lp) -> dict:
        """The PPO update: ppo.ppo_n_minibatches optimizer steps over the shard; the step's stats
        summed over the ranks, the per-token ones as means over every answer token."""
        n_mini = self.cfg.ppo.ppo_n_minibatches
        minis = [list(range(len(shard)))[i::n_mini] for i in range(n_mini)]
        self.engine.train()
        acc = {"actor_loss": 0.0, "ppo_approx_kl": 0.0, "actor_clip_ratio": 0.0,
               "importance_weight": 0.0, "entropy": 0.0, "n_valid_tokens": 0.0, "grad_norm": 0.0}
        send_wait = 0.0  # seconds the optimizer steps waited for a weight send
        for mini in minis:
            send_wait += self._minibatch(shard, ans, mini, mask, adv, prox, behav, ref_lp, acc)
        total = self._allreduce([acc[k] for k in acc])
        out = dict(zip(acc, total))
        n = max(out["n_valid_tokens"], 1.0)
        for k in ("actor_loss", "ppo_approx_kl", "actor_clip_ratio", "importance_weight", "entropy"):
            out[k] /= n
        out["grad_norm"] = acc["grad_norm"]
        out["lr"] = self.scheduler.get_last_lr()[0] if self.scheduler else self.cfg.actor.lr
        out["send_wait_time"] = send_wait
        return out

    def _minibatch(self, shard, ans: Answers, mini: list[int], mask, adv, prox, behav, ref_lp, acc: dict) -> float:
        """One optimizer step on the shard's sequences `mini`, micro-batch by micro-batch; adds its
        sums to acc and returns the seconds the step waited for a weight send."""
        p = self.cfg.ppo
        mb = self.cfg.actor_train.mb_spec.max_tokens_per_mb
        sub = [shard[i] for i in mini]
        # Per-token weights of the loss (ppo.loss_agg) and their global denominator.
        toks, lens = ans.index(mini), ans.lens[mini].tolist()
        agg_w = torch.zeros(ans.n_tokens)
        agg_w[toks] = Fn.agg_weights(mask[toks], lens, p.loss_agg, p.gen.max_new_tokens)
        denom = self._allreduce([Fn.agg_denominator(agg_w[toks], lens, p.loss_agg)])[0]
        bins = self._micro_batches(sub, mb)
        for j, idx in enumerate(bins):
            self.engine.set_gradient_accumulation_boundary(j == len(bins) - 1)
            if not idx:  # a zero-weight pass: this rank has fewer sequences than micro-batches
                lp, _ = self._logprobs(self.engine.module, _dummy_pack(), grad=True)
                self.engine.backward(lp.sum() * 0.0)
                continue
            rows = [mini[i] for i in idx]
            logp, ent = self._logprobs(self.engine.module, self._pack(shard, rows), grad=True)
            t = ans.index(rows)  # this micro-batch's tokens, in the packed order

            def cat(flat, t=t):
                return flat[t].to(self.device)

            w = cat(mask)
            old = logp.detach() if prox is None else cat(prox)
            loss_tok, st = Fn.ppo_loss(logp, old, cat(adv), p.eps_clip,
                                       behav_logp=cat(behav) if p.use_decoupled_loss else None,
                                       behav_cap=p.behav_imp_weight_cap, eps_clip_high=p.eps_clip_high or None)
            agg = cat(agg_w)
            loss = (loss_tok * agg).sum()
            if ref_lp is not None and p.kl_mode == "loss":
                loss = loss + p.kl_ctl * (Fn.kl_estimate(logp, cat(ref_lp), p.kl_estimator) * agg).sum()
            # Weighted sum / the global batch's denominator, times world because DeepSpeed
            # averages gradients over ranks: the loss of the whole batch, as Fn.aggregate has it.
            self.engine.backward(loss * self.world / max(denom, 1e-12))
            acc["actor_loss"] += (loss_tok * w).sum().item()
            acc["ppo_approx_kl"] += (st["approx_kl"] * w).sum().item()
            acc["actor_clip_ratio"] += (st["clip"] * w).sum().item()
            acc["importance_weight"] += (st["importance_weight"] * w).sum().item()
            acc["entropy"] += (ent * w).sum().item()
            acc["n_valid_tokens"] += float(w.sum().item())
        send_wait = self.outbox.wait_sent()  # the step changes the weights being sent
        own = self._grad_norm() if self.cfg.actor.zero_stage == 0 else None
        self.engine.step()
        gn = self.engine.get_global_grad_norm()
        gn = own if gn is None else gn
        acc["grad_norm"] += float(gn) / p.ppo_n_minibatches if gn is not None else 0.0
        return send_wait

    def _grad_norm(self):
        """2-norm of the gradients on the parameters, before clipping. DeepSpeed reports none at
        ZeRO-0 (its clipping discards it); there the gradients are already averaged over ranks."""
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else None

    # ---------------------------------------------------------------- weights
    def full_state(self, adapter_only: bool = False) -> dict[str, torch.Tensor]:
        """The full (unsharded) weights, or the LoRA adapter's alone; every rank must call it under ZeRO-3."""
        self.outbox.before_collectives()  # ZeRO-3's gathers are collectives of the training world
        m = self.engine.module
        only = lora.is_adapter if adapter_only else None
        if self.cfg.actor.zero_stage == 3:
            return gathered_state(m, keep=self.rank == 0, only=only)
        if self.rank != 0:
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

    # ---------------------------------------------------------------- recover (rl/checkpoint/recover.py)
    def save_recover(self, path: str) -> dict:
        """DeepSpeed checkpoint (model, optimizer, LR scheduler) plus this rank's RNG states into path.

        Every rank must call it: each saves its own ZeRO shard. Each rank fsyncs what is there
        before returning, so the driver's rename publishes only durable files.
        """
        t0 = time.time()
        self.outbox.before_collectives()  # DeepSpeed's save runs collectives of the training world
        # Under LoRA the frozen base is left out: it is actor.path's, and loads from there.
        self.engine.save_checkpoint(path, tag="deepspeed", client_state={"version": self.version},
                                    save_latest=False, **lora.recover_kwargs(self.cfg, save=True))
        rng.save(os.path.join(path, f"rng_rank{self.rank}.pt"))
        fsync_tree(path)
        return {"rank": self.rank, "save_time": time.time() - t0}

    def load_recover(self, path: str) -> dict:
        """Inverse of save_recover (every rank); returns the weight version it holds, how many ranks
        wrote the checkpoint, whether it was loaded in the universal format, and the load's seconds.

        A checkpoint written by another number of ranks (a node lost, or added) loads through
        DeepSpeed's universal format: rank 0 converts the ZeRO shards once (kept beside them for a
        later resume), and every rank takes its own slice of the merged state. ZeRO-0 keeps whole
        states, which load on any number of ranks as they are."""
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
                                                     **lora.recover_kwargs(self.cfg, save=False))
        self.engine._config.load_universal_checkpoint = False
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{tag}' in {path}")
        self.version = int((client or {}).get("version", 0))
        own = os.path.join(path, f"rng_rank{self.rank}.pt")
        if os.path.exists(own):  # a rank the writing run did not have keeps its seeded RNG
            rng.load(own)
        return {"version": self.version, "ranks_written": written, "universal": tag != "deepspeed",
                "load_time": time.time() - t0}

    def logprobs(self, prompts: list[list[int]], answers: list[list[int]]) -> list[list[float]]:
        """Answer logprobs under the current weights (tests compare them with vLLM's)."""
        self.outbox.before_collectives()  # ZeRO-3 gathers every layer for the forward
        self.engine.eval()
        shard = [{"prompt_ids": p, "output_ids": a} for p, a in zip(prompts, answers)]
        bins = partition([len(p) + len(a) for p, a in zip(prompts, answers)],
                         self.cfg.actor_train.mb_spec.max_tokens_per_mb)
        ans = Answers([len(a) for a in answers])
        return [t.tolist() for t in ans.split(self._pass(self.engine.module, shard, ans, bins))]

    def local_checksum(self) -> float:
        """Sum of this rank's parameters: full replicas under ZeRO 0-2, its shards under ZeRO-3
        (padded with zeros, so the ranks' sums add up to the model's)."""
        return float(sum(getattr(p, "ds_tensor", p).detach().double().sum().item()
                         for p in self.engine.module.parameters()))


def _dummy_pack() -> Packed:
    return pack([[0]], [[0]])  # a 2-token sequence for the zero-weight passes of ranks with fewer sequences


def loss_masks(shard: list[dict], ans: Answers) -> torch.Tensor:
    """1.0 on the answer tokens the loss covers (flat): all, unless a workflow gave a sample a
    loss_mask (0 for tokens it inserted, e.g. a tool's output between two model turns)."""
    if not any("loss_mask" in s for s in shard):
        return torch.ones(ans.n_tokens)
    return torch.tensor([float(bool(x)) for s in shard
                         for x in s.get("loss_mask", [1] * len(s["output_ids"]))], dtype=torch.float32)
