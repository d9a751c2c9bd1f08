"""The dry-run plan: everything `areal-kit train PRESET --dry-run` can check without GPUs.

    areal-kit train 1.5B_n4 --dry-run
    AREAL_DEVICE=cuda areal-kit train 7B_n4 --dry-run     # the plan on GPU nodes, from a CPU machine
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from areal_kit import hardware, netfigures, runlog, stack
from areal_kit.config.alloc import parse_allocation
from areal_kit.errors import UserError
from areal_kit.rl import lora, memory, shapes, sharing
from areal_kit.rl.algo import varlen
from areal_kit.rl.driver import placement
from areal_kit.rl.weight_sync import ipc, mode
from areal_kit.rl.weight_sync.mode import weight_sync_dir
from areal_kit.rl.weight_sync.transport import DEFAULT_BUCKET_BYTES, first_bucket_bytes

if TYPE_CHECKING:
    from areal_kit.config.lora import LoRAConfig
    from areal_kit.config.schema import TrainConfig


def dataset_size(cfg: TrainConfig) -> tuple[int | None, str]:
    """(number of training prompts, note) when the dataset is readable here; (None, why not) otherwise.

    The rows the run reads and checks (data.prompts.read_rows), counted before tokenization: prompts over
    max_prompt_len are dropped when the run starts.
    """
    d = cfg.dataset
    for src in d.mix or [{"type": d.type, "path": d.path}]:
        if src["type"] != "toy" and not os.path.exists(src["path"]):
            return None, f"{src['path']} not found here (it is read on the cluster)"
    try:
        from areal_kit.data.prompts import read_rows

        rows, ev = read_rows(cfg)
    except Exception as e:  # noqa: BLE001 - the plan reports, the run fails
        return None, f"{d.path or 'dataset.mix'}: {str(e).splitlines()[0]}"
    note = "built-in toy task" if d.type == "toy" else d.path
    if d.mix:
        note = "mix of " + ", ".join(f"{m['name']} x{m['weight']:g}" for m in d.mix)
    if ev:
        note += f"; eval split {len(ev)} prompts" + ("" if d.eval_path else " held out")
    return len(rows), note


def weight_sync_line(cfg: TrainConfig, n_workers: int, plat: hardware.Platform | None = None) -> str:
    chosen = mode.sync_mode(cfg, plat)
    if chosen == "ipc":
        why = " (auto on shared GPUs)" if cfg.weight_sync == "auto" else ""
        how = ipc.medium((plat or hardware.detect()).is_cpu)
        return (f"weight sync: ipc{why}: each trainer rank hands the engine worker beside it "
                f"one {how} buffer of up to {mode.IPC_BUFFER_BYTES >> 20} MB, a chunk at a time "
                f"({n_workers} engine worker(s)); disk if an engine cannot map it")
    if chosen == "disk":
        why = " (auto on shared GPUs: a LoRA adapter alone)" if cfg.weight_sync == "auto" else ""
        return (f"weight sync: disk{why}: trainer rank 0 saves a Hugging Face folder in {weight_sync_dir(cfg)}, "
                f"{n_workers} engine worker(s) reload it")
    line = (f"weight sync: {cfg.weight_sync}: trainer rank 0 broadcasts to {n_workers} engine worker(s) in "
            f"{DEFAULT_BUCKET_BYTES >> 20} MB buckets, the first {first_bucket_bytes() >> 20} MB (NCCL on GPUs, gloo on CPU)")
    return line + ("; on CPU it writes engines on its node through shared memory" if cfg.weight_sync == "auto" else "")


def model_bytes(path: str) -> int | None:
    """The weights' bytes as saved (what a weight sync sends), when the model folder is here."""
    if not os.path.isdir(path):
        return None
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    return sum(os.path.getsize(os.path.join(path, f)) for f in files) or None


def sync_estimate(cfg: TrainConfig) -> list[str]:
    """The weight sync's time a step from the bandwidth `areal-kit doctor` last measured, if it ran here."""
    line = netfigures.sync_estimate_line(model_bytes(cfg.actor.path), netfigures.latest())
    return [line] if line else []


def device_lines(cfg: TrainConfig, plat: hardware.Platform) -> list[str]:
    """What the run uses on plat's device: the exact versions of its stack (on GPUs, the image's),
    the trainer's attention, and the placement groups it requests on the configured cluster."""
    hint = "" if os.environ.get("AREAL_DEVICE") or not plat.is_cpu else " (no GPU here; AREAL_DEVICE=cuda plans for GPUs)"
    lines = [f"device: {plat.device}{hint}",
             f"stack ({plat.device} image): " + ", ".join(f"{name} {v}" for name, v in stack.versions(plat.device).items()),
             f"attention (this install): {varlen.explain(plat.device)}"]
    a = parse_allocation(cfg.allocation_mode)
    try:
        return lines + placement.on_nodes(a, plat, cfg.n_nodes, cfg.n_gpus_per_node, cfg.spread_roles).describe()
    except UserError as e:  # the run lays out on the Ray cluster it joins, which may differ from the config
        return lines + [f"placement: not on the configured {cfg.n_nodes} node(s): {e}"]




def gpu_capacity(cfg: TrainConfig) -> tuple[float, str]:
    """Bytes of each GPU for the memory plan, and where the figure comes from."""
    if cfg.gpu_memory_gb:
        return cfg.gpu_memory_gb * memory.GB, "gpu_memory_gb"
    here = hardware.gpu_memory_bytes()
    if here:
        return float(here), "this machine's GPU"
    return memory.CARD_80GB, "gpu_memory_gb unset and no GPU here: what CUDA reports of an 80 GB card"


def _lora_lines(lc: LoRAConfig) -> list[str]:
    if not lc.rank:
        return []
    return [f"LoRA: rank {lc.rank}, alpha {lc.alpha:g} on {lc.target_modules}; only the adapter trains; the KL "
            f"reference is the base with the adapter disabled; engines receive "
            + ("the adapter (vLLM LoRA, max_lora_rank " f"{lc.engine_rank})" if lc.sync == "adapter"
               else "the merged weights")]


def memory_plan(cfg: TrainConfig) -> memory.MemoryPlan | None:
    """What one trainer GPU and one generation GPU hold under cfg; None when the model's shape is unknown."""
    shape = shapes.model_shape(cfg.actor.path)
    if shape is None:
        return None
    a = parse_allocation(cfg.allocation_mode)
    capacity, note = gpu_capacity(cfg)
    return memory.plan_for(
        shape, capacity=capacity, capacity_note=note, zero_stage=cfg.actor.zero_stage, ranks=a.train.world,
        tokens=cfg.actor_train.mb_spec.max_tokens_per_mb, reference=cfg.ppo.kl_ctl > 0,
        checkpointing=cfg.actor.gradient_checkpointing, dtype_bytes=4 if cfg.actor.dtype == "fp32" else 2,
        tp=a.gen.tp, utilization=cfg.actor.vllm.gpu_memory_utilization,
        max_model_len=cfg.dataset.max_prompt_len + cfg.ppo.gen.max_new_tokens, shared=a.kind != "decoupled",
        lora_params=shape.lora_params(cfg.actor.lora.rank, cfg.actor.lora.target_modules),
        engine_lora=lora.engine_buffers(cfg.actor.lora))


def memory_lines(cfg: TrainConfig, plat: hardware.Platform) -> list[str]:
    """The memory plan on GPUs (CPU workers take what the machine has)."""
    if plat.is_cpu:
        return []
    plan = memory_plan(cfg)
    if plan is None:
        why = "no config.json there, and not one of the presets' models in rl/memory.py"
        return [f"memory plan: skipped: the shape of {cfg.actor.path} is unknown ({why})"]
    return plan.lines()


def memory_refusal(cfg: TrainConfig, plat: hardware.Platform) -> str:
    """'' when the run's GPUs hold what the plan says they must; else one line with the arithmetic."""
    plan = None if plat.is_cpu else memory_plan(cfg)
    refusal = plan.refusal() if plan else ""
    return f"the memory plan does not fit: {refusal}" if refusal else ""


def memory_figures(cfg: TrainConfig, plat: hardware.Platform, side: str) -> str:
    """One line of the memory plan for a trainer GPU (side "trainer") or vLLM's share of a generation
    GPU ("generation"): its parts and their sum against the GPU's memory, the figures to weigh a
    lever against when that GPU runs out (retry.py says it past the relaunch bound). '' on CPU
    (no plan) or where the model's shape is unknown."""
    plan = None if plat.is_cpu else memory_plan(cfg)
    if plan is None:
        return ""
    gpu = plan.trainer if side == "trainer" else plan.generation
    held = plan.trainer.total if side == "trainer" else plan.share
    terms = " + ".join(f"{p.name} {memory.gb(p.nbytes)}" for p in gpu.parts if p.nbytes)
    return f"{gpu.title}: {terms} = {memory.gb(held)} of {memory.gb(plan.capacity)} ({plan.capacity_note})"


def check_memory(cfg: TrainConfig, plat: hardware.Platform) -> None:
    """The memory plan enforced: a run whose GPUs cannot hold what the plan says they must is refused in
    one line (exit 2). The dry run checks it after printing its plan; a plain `areal-kit train` on a GPU
    platform before Ray starts (rl/cmd.py). On CPU there is no plan, and nothing is computed."""
    refusal = memory_refusal(cfg, plat)
    if refusal:
        raise UserError(refusal)


def shared_words(cfg: TrainConfig, plat: hardware.Platform) -> str:
    """How training shares the generation GPUs on plat: cores on CPU, turns on GPUs."""
    if plat.is_cpu:
        return " sharing the generation GPUs (on CPU: worker slots on the same cores)"
    return (f" sharing the generation GPUs, taking turns: the engines sleep (vLLM sleep level "
            f"{sharing.sleep_level(cfg.actor.lora)}) while the trainer trains, then wake for the weight sync")


def recipe_lines(cfg: TrainConfig) -> list[str]:
    """The recipe options that change what a step trains on, and the in-training eval, when on."""
    p, x = cfg.ppo, cfg.exp_ctrl
    parts = []
    if p.dynamic_sampling:
        parts.append(f"dynamic sampling (groups with equal task rewards dropped, up to "
                     f"{p.dynamic_sampling_max_rounds} extra generation rounds a step)")
    if p.eps_clip_high:
        parts.append(f"clip-higher {p.eps_clip}/{p.eps_clip_high}")
    if p.overlong_buffer:
        parts.append(f"overlong penalty over the last {p.overlong_buffer} tokens (down to -{p.overlong_penalty_factor:g})")
    if p.overlong_filter:
        parts.append("truncated answers out of the loss")
    lines = [f"recipe: {', '.join(parts)}; loss {p.loss_agg}"] if parts else []
    if x.eval_every:
        k = x.eval_n_samples
        lines.append(f"eval: every {x.eval_every} steps on the eval split: greedy pass@1"
                     + (f", avg@{k} and pass@{k} of {k} samples" if k else ""))
    return lines


def plan_lines(cfg: TrainConfig, plat: hardware.Platform | None = None) -> list[str]:
    plat = plat or hardware.detect()
    a = parse_allocation(cfg.allocation_mode)
    p, d = cfg.ppo, cfg.dataset
    paths = runlog.run_paths(cfg.fileroot, cfg.experiment_name, cfg.trial_name)
    n_seqs = d.train_bs_n_seqs * p.group_size
    n, note = dataset_size(cfg)
    lines = [
        f"experiment {cfg.experiment_name} / trial {cfg.trial_name}",
        (f"cluster: {cfg.n_nodes} node(s) x {cfg.n_gpus_per_node} GPU(s) = {cfg.n_gpus} GPUs; "
         f"{a.describe(cfg.n_nodes, cfg.n_gpus_per_node)}"),
        f"generation: {a.gen_gpus} GPUs as {a.gen.dp} vLLM engine(s), tensor parallel {a.gen.tp} ({a.gen})",
        f"training: {a.train_gpus} GPUs, DeepSpeed ZeRO-{cfg.actor.zero_stage} over {a.train.world} rank(s) ({a.train})"
        + (shared_words(cfg, plat) if a.kind != "decoupled" else ""),
        *a.training_notes(cfg.actor.zero_stage, cfg.actor.gradient_checkpointing),
        *hardware.vllm_notes(cfg.actor.vllm),
        *device_lines(cfg, plat),
        *memory_lines(cfg, plat),
        f"model: {cfg.actor.path}" + (f"; reference: {cfg.ref.path or cfg.actor.path} (kl_ctl {p.kl_ctl}, "
                                       f"{p.kl_estimator}, in {p.kl_mode})" if p.kl_ctl > 0 else "; no reference model"),
        *_lora_lines(cfg.actor.lora),
        (f"batch: {d.train_bs_n_seqs} prompts x {p.group_size} answers = {n_seqs} sequences; "
         f"{p.ppo_n_minibatches} optimizer step(s) per batch"),
        (f"tokens: prompt <= {d.max_prompt_len}, answer <= {p.gen.max_new_tokens}; micro-batches <= "
         f"{cfg.actor_train.mb_spec.max_tokens_per_mb} tokens; at most {n_seqs * (d.max_prompt_len + p.gen.max_new_tokens):,} "
         "tokens a batch"),
        f"off-policyness: {p.max_head_offpolicyness}" + (" (synchronous, on-policy)" if p.max_head_offpolicyness == 0
                                                        else f" (decoupled loss: {p.use_decoupled_loss})"),
        _rollout_line(cfg),
        weight_sync_line(cfg, a.gen.dp * a.gen.tp, plat),
        *sync_estimate(cfg),
        *recipe_lines(cfg),
    ]
    if n is not None:
        spe = n // d.train_bs_n_seqs
        total = spe * cfg.exp_ctrl.total_train_epochs
        if cfg.exp_ctrl.total_train_steps:
            total = min(total, cfg.exp_ctrl.total_train_steps)
        lines.append(f"dataset: {n} prompts ({note}); {spe} steps per epoch, {total} steps in all")
    else:
        lines.append(f"dataset: {note}")
    lines += [f"logs: {paths.log_file}", f"recover: {paths.recover_dir}", f"checkpoints: {paths.ckpt_dir}/actor"]
    return lines


def _rollout_line(cfg: TrainConfig) -> str:
    """How the engines generate (rollout.mode), and what a weight update does to them."""
    if cfg.rollout.mode == "batch":
        return (f"rollout: batch (each engine generates a batch in one call; up to "
                f"{cfg.ppo.max_head_offpolicyness} batch(es) queued ahead of training)")
    n = (1 + cfg.ppo.max_head_offpolicyness) * cfg.dataset.train_bs_n_seqs
    return (f"rollout: stream (vLLM AsyncLLM engines, a prompt group per call; at most {n} prompts in flight or "
            f"untrained; new weights {'pause and resume' if cfg.rollout.interrupt == 'keep' else 'wait for'} the "
            "generations in flight)")
