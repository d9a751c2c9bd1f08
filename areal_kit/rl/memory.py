"""The memory plan of a GPU preset: what one trainer GPU and one generation GPU hold, from the
model's shape, the ZeRO stage, the micro-batch's token budget and vLLM's share of its GPU.
`areal-kit train PRESET --dry-run` prints it (rl/plan.py) and refuses a preset that cannot fit,
with the arithmetic. Pure arithmetic: no GPU, no torch.

    AREAL_DEVICE=cuda areal-kit train 7B_n4 --dry-run
    AREAL_DEVICE=cuda areal-kit train 7B_n4 --dry-run actor.zero_stage=0     # refused, with the sums

    from areal_kit.rl import memory, shapes
    shape = shapes.model_shape("/storage/models/DeepSeek-R1-Distill-Qwen-1.5B")
    t = memory.trainer_plan(shape, zero_stage=2, ranks=16, tokens=19456, reference=True)
    t.refusal(80e9, memory.trainer_fixes(2, True, 19456))   # "" when it fits

What a trainer GPU holds (P parameters, N data-parallel trainer ranks, b bytes of the training dtype):
  weights      b x P; / N under ZeRO-3
  gradients    ZeRO-0: b x P (DeepSpeed has no fp32 accumulation without ZeRO); ZeRO-1: 4 x P (its bf16
               optimizer accumulates every gradient in fp32); ZeRO-2/3: 4 x P / N (fp32 accumulation,
               partitioned; b for an fp32 model is 4 anyway)
  optimizer    AdamW: fp32 master weights and 2 moments, 12 B a parameter with bf16 weights (8 with fp32:
               the weights are the master); / N under ZeRO 1-3
  reference    b x P when ppo.kl_ctl > 0: the trainer loads it beside DeepSpeed, so no stage partitions it
  activations  with gradient checkpointing, each layer's input (hidden x layers x tokens x b) and one
               layer's working set recomputed in backward; without it, every layer's working set
  logits       one chunk of chunked_logprobs (rl/algo/functional.py): chunk x vocab x 4 B, three times
  buffers      DeepSpeed's reduce and all-gather buckets, of this module's sizes (deepspeed_zero.py passes
               them on); ZeRO 1-2: two reduce buckets, overlap_comm reducing one while backward fills the
               next (ZeRO-3: the reduce bucket and the most parameters it gathers at once)
Under LoRA (actor.lora, L adapter parameters) the base's weights stay, frozen; gradients and
optimizer states are the adapter's alone (4 x L and 12 x L, split as above), and there is no
reference model (the base with the adapter disabled is the reference).
A generation GPU: vLLM takes gpu_memory_utilization of it; the weights take b x P / TP; what is left
is the ceiling of its KV cache (vLLM's activations and CUDA graphs come out of it too), at
2 x layers x KV heads per GPU x head_dim x b bytes a token.
Shared GPUs (turns, rl/driver/turns.py): while the trainer trains, the engine sleeps and holds only
what its sleep mode cannot release (SLEEP_RESIDUE) beside the trainer's peak, which torch's caching
allocator keeps reserved until the trainer returns it (torch.cuda.empty_cache) before the engine
wakes: while generating, the engine's share sits beside the trainer's resident states (all but a
micro-batch's activations and logits). The trainer's CUDA context counts in both (TRAINER_CONTEXT).
Both sums must fit the GPU's capacity as CUDA reports it (an 80 GB card: CARD_80GB).
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_kit.rl.algo.functional import LOGITS_CHUNK
from areal_kit.rl.shapes import ModelShape

GB = 1e9
GIB = 2**30
# What CUDA reports of an "80 GB" card (torch.cuda.get_device_properties(0).total_memory on an
# H100 80 GB: 79.2 GiB): the plan's capacity where the config names none and no GPU is here.
CARD_80GB = 85.0e9
# DeepSpeed's buckets, in elements: the reduce and the ZeRO 1/2 all-gather bucket (deepspeed_zero.py
# sets both), and ZeRO-3's most parameters gathered at once (its default). DeepSpeed's 5e8 for the
# two would hold 1 GB in bf16 and 2 GB for a reduced bucket's fp32 copy, beside vLLM on a shared
# GPU; 5e7 (100 MB in bf16) still saturates NCCL's rings (tens of MB a call suffice).
REDUCE_BUCKET = 50_000_000
ALLGATHER_BUCKET = 50_000_000
ZERO0_ALLREDUCE_BUCKET = 500_000_000  # without ZeRO: DeepSpeed's MEMORY_OPT_ALLREDUCE_SIZE, no config sets it
ZERO3_LIVE_PARAMS = 1_000_000_000
# A chunk's fp32 logits, their log-softmax and, in backward, the gradient of those are alive together.
LOGITS_COPIES = 3
# What a trainer GPU holds only while it trains a micro-batch (the rest stays between steps).
TRANSIENT = ("activations", "recomputed layer", "logits chunk")
# What a sleeping vLLM engine still holds on each GPU: the CUDA context, its CUDA graphs and what it
# allocated outside the sleep-mode pool (NCCL buffers under tensor parallel). An estimate: vLLM
# logs the real figure at each sleep ("Sleep mode freed ... GiB, ... GiB still in use").
SLEEP_RESIDUE = 3 * GB
# A trainer rank's GPU memory outside torch's allocator (CUDA context ~0.5 GB, NCCL's buffers): an estimate.
TRAINER_CONTEXT = 1 * GB


@dataclass(frozen=True)
class Part:
    """One thing a GPU holds: its name, its bytes, and how they were counted."""

    name: str
    nbytes: float
    how: str


@dataclass(frozen=True)
class GpuPlan:
    """What one GPU of a role holds, part by part."""

    title: str
    parts: tuple[Part, ...]

    @property
    def total(self) -> float:
        return sum(p.nbytes for p in self.parts)

    @property
    def resident(self) -> float:
        """What stays on the GPU between micro-batches: all but the activations and logits."""
        return sum(p.nbytes for p in self.parts if p.name not in TRANSIENT)

    def lines(self, capacity: float) -> list[str]:
        head = f"  {self.title}: {gb(self.total)} of {gb(capacity)}"
        return [head, *(f"    {p.name:<18} {gb(p.nbytes):>9}  {p.how}" for p in self.parts)]

    def refusal(self, capacity: float, fixes: list[str]) -> str:
        """'' when the parts fit capacity; else one line with the sum and what to change."""
        if self.total <= capacity:
            return ""
        terms = " + ".join(f"{p.name} {p.nbytes / GB:.3g}" for p in self.parts if p.nbytes)
        return (f"{self.title} needs {terms} = {self.total / GB:.3g} GB, more than the {gb(capacity)} it has; "
                f"try {', or '.join(fixes)}")


def gb(nbytes: float) -> str:
    return f"{nbytes / GB:.3g} GB"


def _billions(n: float) -> str:
    return f"{n / 1e9:.3g}B"


def _weights_and_state(s: ModelShape, zero_stage: int, ranks: int, b: int) -> list[Part]:
    """The model's own bytes on one trainer GPU: weights, gradients, optimizer states."""
    p, n = s.params, ranks
    count = _billions(p)
    if zero_stage == 3:
        w = Part("weights", b * p / n, f"{b} B x {count} parameters / {n} ranks (ZeRO-3 partitions them)")
    else:
        w = Part("weights", b * p, f"{b} B x {count} parameters")
    if zero_stage == 0 and b == 2:
        # DeepSpeed's optimizer for a bf16 model without ZeRO turns every gradient into fp32 before
        # its step, beside the bf16 one.
        g = Part("gradients", (b + 4) * p, f"({b} B in the weights' dtype + 4 B, the fp32 copy the optimizer "
                 f"steps on) x {count} (ZeRO-0 keeps them whole)")
    elif zero_stage == 0:
        g = Part("gradients", b * p, f"{b} B x {count}, in the weights' dtype (ZeRO-0 keeps them whole)")
    elif zero_stage == 1:
        g = Part("gradients", 4 * p, f"4 B x {count}, accumulated in fp32 (ZeRO-1 keeps them whole)")
    elif zero_stage == 3 and b == 2:
        # ZeRO-3 also keeps its partition of the gradients in the weights' dtype, reduced into the
        # fp32 accumulation.
        g = Part("gradients", (4 + b) * p / n, f"(4 B accumulated in fp32 + {b} B ZeRO-3's buffer in the weights' "
                 f"dtype) x {count} / {n} ranks")
    else:
        g = Part("gradients", 4 * p / n,
                 f"4 B x {count} / {n} ranks, accumulated in fp32 (ZeRO-{zero_stage} partitions them)")
    per = 12 if b == 2 else 8
    what = "fp32 master weights + 2 moments" if b == 2 else "2 fp32 moments"
    if zero_stage == 0:
        o = Part("optimizer", per * p, f"AdamW {what}, {per} B x {count} (ZeRO-0 keeps them whole)")
    else:
        o = Part("optimizer", per * p / n, f"AdamW {what}, {per} B x {count} / {n} ranks")
    return [w, g, o]


def _lora_weights_and_state(s: ModelShape, zero_stage: int, ranks: int, b: int, lora: int) -> list[Part]:
    """Under LoRA: the frozen base, and gradients and optimizer states of the adapter's `lora`
    parameters alone."""
    p, n, count = s.params, ranks, _billions(lora)
    split = zero_stage == 3
    w = Part("weights", b * (p + lora) / (n if split else 1),
             f"{b} B x ({_billions(p)} frozen base + {count} adapter)" + (f" / {n} ranks (ZeRO-3)" if split else ""))
    gn = n if zero_stage >= 2 else 1
    g = Part("gradients", (b if zero_stage == 0 else 4) * lora / gn,
             f"the adapter's alone: {b if zero_stage == 0 else 4} B x {count}" + (f" / {gn} ranks" if gn > 1 else ""))
    per = 12 if b == 2 else 8
    on = n if zero_stage else 1
    o = Part("optimizer", per * lora / on, f"AdamW, the adapter's alone: {per} B x {count}" +
             (f" / {on} ranks" if on > 1 else ""))
    return [w, g, o]


def _activations(s: ModelShape, tokens: int, b: int, checkpointing: bool) -> list[Part]:
    """A micro-batch of `tokens` tokens in training: the layers' activations and one logits chunk."""
    per_layer = s.layer_values_per_token()
    if checkpointing:
        acts = [Part("activations", s.hidden * s.layers * tokens * b,
                     f"each layer's input: {s.hidden} hidden x {s.layers} layers x {tokens} tokens x {b} B"),
                Part("recomputed layer", per_layer * tokens * b,
                     f"one layer in backward, about {per_layer} values a token x {tokens} tokens x {b} B")]
    else:
        acts = [Part("activations", s.layers * per_layer * tokens * b,
                     f"no gradient checkpointing: {s.layers} layers x about {per_layer} values a token x "
                     f"{tokens} tokens x {b} B")]
    chunk = min(LOGITS_CHUNK, tokens)
    logits = Part("logits chunk", LOGITS_COPIES * chunk * s.vocab * 4,
                  f"{s.vocab} vocab x {chunk} tokens x 4 B x {LOGITS_COPIES} (logits, log-softmax, their gradient)")
    return [*acts, logits]


def _buffers(s: ModelShape, zero_stage: int, b: int) -> Part:
    """DeepSpeed's buckets, each counted up to the model's size. Under LoRA only the adapter's
    gradients fill them, but the model's size is kept until a term of the plan accounts for the
    rest of a LoRA step's measured peak (tests/gpu/test_trainer_gpu.py holds the plan to it)."""
    p = s.params
    reduce, gather = min(REDUCE_BUCKET, p), min(ALLGATHER_BUCKET, p)
    if zero_stage == 0:
        whole = min(ZERO0_ALLREDUCE_BUCKET, p)
        return Part("DeepSpeed buffers", whole * b, f"gradient all-reduce bucket {_billions(whole)} elements x {b} B")
    # Under ZeRO a bf16 model's reduced bucket is added to the fp32 accumulation through an fp32 copy.
    rb, copy = (b + 4, f" ({b} B + its fp32 copy 4 B)") if b == 2 else (b, "")
    if zero_stage == 3:
        live = min(ZERO3_LIVE_PARAMS, p)
        return Part("DeepSpeed buffers", live * b + reduce * rb,
                    f"parameters gathered at once {_billions(live)} elements x {b} B + reduce bucket "
                    f"{_billions(reduce)} elements x {rb} B{copy}")
    # overlap_comm (ZeRO 1-2): a second bucket in the weights' dtype fills while the first reduces.
    return Part("DeepSpeed buffers", reduce * (rb + b) + gather * b,
                f"reduce bucket {_billions(reduce)} elements x {rb} B{copy} + the next one filling while it "
                f"reduces (overlap_comm) x {b} B + all-gather bucket {_billions(gather)} elements x {b} B")


def trainer_plan(s: ModelShape, zero_stage: int, ranks: int, tokens: int, reference: bool,
                 checkpointing: bool = True, dtype_bytes: int = 2, lora_params: int = 0) -> GpuPlan:
    """What one trainer GPU holds while it trains a micro-batch of `tokens` tokens (lora_params:
    the adapter's size under LoRA, which has no separate reference model)."""
    b = dtype_bytes
    if lora_params:
        parts = _lora_weights_and_state(s, zero_stage, ranks, b, lora_params)
    else:
        parts = _weights_and_state(s, zero_stage, ranks, b)
    if reference and not lora_params:
        parts.append(Part("reference model", b * s.params,
                          f"{b} B x {_billions(s.params)}, a whole copy (kl_ctl > 0; loaded beside DeepSpeed, "
                          "never partitioned)"))
    parts += [*_activations(s, tokens, b, checkpointing), _buffers(s, zero_stage, b)]
    dtype = "bf16" if b == 2 else "fp32"
    lora = f", LoRA adapter of {_billions(lora_params)}" if lora_params else ""
    return GpuPlan(f"trainer GPU (ZeRO-{zero_stage} over {ranks} rank(s), {dtype}{lora})", tuple(parts))


def kv_bytes_per_token(s: ModelShape, tp: int, b: int = 2) -> int:
    """KV cache bytes a token on one GPU of a TP group: vLLM splits the KV heads over it (each GPU
    keeps at least one: with more GPUs than KV heads they are replicated)."""
    return 2 * s.layers * max(1, s.kv_heads // tp) * s.dim * b


def generation_plan(s: ModelShape, tp: int, gpu_bytes: float, utilization: float, max_model_len: int,
                    b: int = 2, lora: tuple[int, int] = (0, 0)) -> tuple[GpuPlan, int]:
    """(vLLM's share of one generation GPU, the tokens of KV cache left in it). lora: the engine's
    (max_lora_rank, max_loras) when it serves adapters, whose buffers come out of its share."""
    share = utilization * gpu_bytes
    weights = b * s.params / tp
    per_token = kv_bytes_per_token(s, tp, b)
    parts = [Part("weights", weights, f"{b} B x {_billions(s.params)} parameters / TP {tp}")]
    rank, slots = lora
    if rank:
        n = s.vllm_lora_params(rank, slots, tp)
        parts.append(Part("LoRA buffers", b * n, f"{b} B x {_billions(n)}: {slots} adapter slot(s) (max_loras) x "
                          f"max_lora_rank {rank} x (in + out) of every linear layer of {s.layers} blocks, as "
                          f"vLLM allocates them" + (f", split over TP {tp}" if tp > 1 else "")))
    kv = max(share - sum(p.nbytes for p in parts), 0.0)
    tokens = int(kv // per_token)
    kv_heads = max(1, s.kv_heads // tp)
    parts.append(Part("KV cache", kv, f"what is left: {tokens / 1e6:.3g}M tokens at {per_token} B a token (2 x "
                      f"{s.layers} layers x {kv_heads} KV head(s) x {s.dim} head dim x {b} B); "
                      f"{tokens // max_model_len} sequences of {max_model_len} tokens"))
    return GpuPlan(f"generation GPU (vLLM, TP {tp}, gpu_memory_utilization {utilization:g})", tuple(parts)), tokens


def generation_refusal(plan: GpuPlan, tokens: int, max_model_len: int, share: float) -> str:
    """'' when vLLM's share holds the weights (and LoRA buffers) and one whole sequence of KV cache
    (vLLM refuses to start otherwise); else one line with the arithmetic and the fix."""
    fixed = [p for p in plan.parts if p.name != "KV cache"]
    weights = sum(p.nbytes for p in fixed)
    if weights < share and tokens >= max_model_len:
        return ""
    what = " - ".join(f"{p.name} {gb(p.nbytes)}" for p in fixed)
    return (f"{plan.title}: its share {gb(share)} - {what} leaves KV cache for {tokens} tokens, "
            f"fewer than one sequence of {max_model_len} (dataset.max_prompt_len + ppo.gen.max_new_tokens); raise "
            "actor.vllm.gpu_memory_utilization, or more tensor parallel in allocation_mode, or shorter answers")


def trainer_fixes(zero_stage: int, checkpointing: bool, tokens: int) -> list[str]:
    """What to change for a trainer GPU that does not fit, the likeliest first."""
    return [*([] if zero_stage == 3 else ["actor.zero_stage=3"]),
            *([] if checkpointing else ["actor.gradient_checkpointing=true"]),
            f"a smaller actor_train.mb_spec.max_tokens_per_mb (now {tokens})",
            "more training GPUs in allocation_mode" if zero_stage else "GPUs with more memory (gpu_memory_gb)"]


@dataclass(frozen=True)
class MemoryPlan:
    """A run's GPUs: one trainer GPU and one generation GPU, held to the GPUs' memory."""

    shape: ModelShape
    capacity: float
    capacity_note: str  # where the GPUs' memory came from
    trainer: GpuPlan
    fixes: tuple[str, ...]  # what to change when the trainer GPU does not fit
    generation: GpuPlan
    kv_tokens: int
    max_model_len: int
    share: float  # vLLM's bytes of a generation GPU
    shared: bool = False  # generation and training on the same GPUs

    def lines(self) -> list[str]:
        s = self.shape
        head = (f"memory plan per GPU of {gb(self.capacity)} = {self.capacity / GIB:.3g} GiB ({self.capacity_note}; "
                f"GB here are 1e9 bytes, vLLM's share is gpu_memory_utilization x all of it); {s.name}: "
                f"{_billions(s.params)} parameters, shape from {s.source}")
        out = [head, *self.trainer.lines(self.capacity), *self.generation.lines(self.capacity)]
        if self.shared:
            gen, train = self.turn_sums()
            ctx = gb(TRAINER_CONTEXT)
            generating = (f"    while generating: vLLM's {gb(self.share)} + the trainer's resident states "
                          f"{gb(self.trainer.resident)} (its cached peak returned before the engine wakes) + its "
                          f"CUDA context {ctx} = {gb(gen)} of {gb(self.capacity)}")
            training = (f"    while training: the trainer's peak {gb(self.trainer.total)} + its CUDA context {ctx} + a sleeping "
                        f"engine's {gb(SLEEP_RESIDUE)} (released: its weights and KV cache) = {gb(train)} of {gb(self.capacity)}")
            out += ["  generation and training take turns on each GPU (vLLM sleep mode):", generating, training]
        return out

    def turn_sums(self) -> tuple[float, float]:
        """(a shared GPU's bytes while the engine generates, while the trainer trains)."""
        return self.share + self.trainer.resident + TRAINER_CONTEXT, self.trainer.total + TRAINER_CONTEXT + SLEEP_RESIDUE

    def refusal(self) -> str:
        """'' when both GPUs fit; else one line: the one that does not, with its arithmetic and fix."""
        return (self.trainer.refusal(self.capacity, list(self.fixes))
                or generation_refusal(self.generation, self.kv_tokens, self.max_model_len, self.share)
                or self.turns_refusal())

    def turns_refusal(self) -> str:
        """'' unless a shared GPU overflows in one of its turns; else that turn's sum and the fix."""
        if not self.shared:
            return ""
        gen, train = self.turn_sums()
        if gen > self.capacity:
            room = (self.capacity - self.trainer.resident - TRAINER_CONTEXT) / self.capacity
            return (f"shared GPU while generating: vLLM's {gb(self.share)} + the trainer's resident states "
                    f"{gb(self.trainer.resident)} + its CUDA context {gb(TRAINER_CONTEXT)} = {gb(gen)}, more than the "
                    f"{gb(self.capacity)} it has; try "
                    f"actor.vllm.gpu_memory_utilization={max(room - 0.01, 0.01):.2f} or less, or "
                    f"{', or '.join(f for f in self.fixes if 'max_tokens_per_mb' not in f)}")
        if train > self.capacity:
            return (f"shared GPU while training: the trainer's peak {gb(self.trainer.total)} + its CUDA context "
                    f"{gb(TRAINER_CONTEXT)} + a sleeping engine's {gb(SLEEP_RESIDUE)} = {gb(train)}, more than the "
                    f"{gb(self.capacity)} it has; try "
                    f"{', or '.join(self.fixes)}")
        return ""


def plan_for(s: ModelShape, *, capacity: float, capacity_note: str, zero_stage: int, ranks: int, tokens: int,
             reference: bool, checkpointing: bool, dtype_bytes: int, tp: int, utilization: float,
             max_model_len: int, shared: bool = False, lora_params: int = 0,
             engine_lora: tuple[int, int] = (0, 0)) -> MemoryPlan:
    """The memory plan of a run's settings (rl/plan.py reads them from its config); engine_lora:
    the engines' (max_lora_rank, max_loras) when they serve the adapter, else (0, 0)."""
    trainer = trainer_plan(s, zero_stage, ranks, tokens, reference, checkpointing, dtype_bytes, lora_params)
    gen, kv_tokens = generation_plan(s, tp, capacity, utilization, max_model_len, lora=engine_lora)
    return MemoryPlan(s, capacity, capacity_note, trainer, tuple(trainer_fixes(zero_stage, checkpointing, tokens)),
                      gen, kv_tokens, max_model_len, utilization * capacity, shared)
