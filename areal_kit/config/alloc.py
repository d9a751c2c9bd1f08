"""Allocation-mode grammar: which GPUs generate and which train, with what parallelism.

    d4m2p1                       colocated: generation and training share all 8 GPUs
    actor_gen:d4p1m2,*:d4p2m1    per role on the same GPUs (`*` = every other role)
    vllm.d16p1m1+d8p2m1          disaggregated: 16 generation GPUs + 16 training GPUs

Letters d (data), m (tensor/model), p (pipeline) in any order, each at most once, missing = 1.
`check(n_nodes, n_gpus_per_node)` compares the products with the cluster and shows the sum.
Training parallelism runs on DeepSpeed ZeRO: the d*m*p training GPUs form one ZeRO data-parallel
world (ZeRO-3 shards what TP/PP would split), and `Allocation.training_notes` says so in the dry run
and the run log when m or p of training is over 1; generation uses vLLM's own TP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from areal_kit.errors import ConfigError

_PART = re.compile(r"([dmp])(\d+)")
ROLES = ("actor_gen", "actor_train", "ref_inf", "*")
GEN_BACKENDS = ("vllm",)
UNSUPPORTED_BACKENDS = ("sglang",)


@dataclass(frozen=True)
class Parallel:
    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"d{self.dp}m{self.tp}p{self.pp}"


@dataclass(frozen=True)
class Allocation:
    text: str
    kind: str  # colocated | per_role | decoupled
    gen: Parallel
    train: Parallel

    @property
    def gen_gpus(self) -> int:
        return self.gen.world

    @property
    def train_gpus(self) -> int:
        return self.train.world

    @property
    def total_gpus(self) -> int:
        if self.kind == "decoupled":
            return self.gen_gpus + self.train_gpus
        return max(self.gen_gpus, self.train_gpus)

    def check(self, n_nodes: int, n_gpus_per_node: int) -> None:
        have = n_nodes * n_gpus_per_node
        if self.kind == "decoupled":
            need = f"{self.gen_gpus}+{self.train_gpus}={self.total_gpus}"
        else:
            need = str(self.total_gpus)
        arith = f"{self.text} needs {need} GPUs, cluster has {n_nodes}x{n_gpus_per_node}={have}"
        if self.total_gpus != have:
            raise ConfigError(f"{arith}; change allocation_mode or n_nodes/n_gpus_per_node so they match")
        if self.kind != "decoupled" and self.gen_gpus != self.train_gpus:
            raise ConfigError(f"{self.text}: colocated roles must use the same GPUs, but generation uses "
                              f"{self.gen_gpus} and training {self.train_gpus}")
        if self.gen.tp > n_gpus_per_node:
            raise ConfigError(f"{self.text}: generation tensor parallel m{self.gen.tp} spans more than one "
                              f"node ({n_gpus_per_node} GPUs); expected m <= n_gpus_per_node")

    def split(self) -> str | None:
        """The same GPUs as vllm.GEN+TRAIN, half each (generation keeps its tensor parallel when it
        fits), or None when there is nothing to split: how a shared allocation runs on GPUs."""
        gen = self.total_gpus // 2
        if self.kind == "decoupled" or gen == 0:
            return None
        tp = self.gen.tp if gen % self.gen.tp == 0 else 1
        return f"vllm.d{gen // tp}p1m{tp}+d{self.total_gpus - gen}p1m1"

    def training_notes(self, zero_stage: int = 0, gradient_checkpointing: bool = False) -> list[str]:
        """What areal-kit does with a training part of m > 1 or p > 1 (the guide's presets have
        p2): one ZeRO data-parallel world over all its GPUs, never Megatron-style tensor or
        pipeline parallelism; and what to change for memory instead. No line for a plain d{N}."""
        t = self.train
        if t.tp == 1 and t.pp == 1:
            return []
        fixes = [*([] if zero_stage == 3 else ["actor.zero_stage=3"]),
                 *([] if gradient_checkpointing else ["actor.gradient_checkpointing=true"]),
                 "a smaller actor_train.mb_spec.max_tokens_per_mb", "more training GPUs"]
        line = (f"training part {t}: areal-kit trains with ZeRO data parallelism over its {t.world} GPUs; "
                f"pipeline/tensor parallelism of training is not used; for memory: {', '.join(fixes)}")
        return [line]

    def describe(self, n_nodes: int, n_gpus_per_node: int) -> str:
        have = n_nodes * n_gpus_per_node
        need = f"{self.gen_gpus}+{self.train_gpus}={self.total_gpus}" if self.kind == "decoupled" \
            else str(self.total_gpus)
        return f"{self.text} needs {need} GPUs, cluster has {n_nodes}x{n_gpus_per_node}={have}: ok"


def parse_parallel(text: str, where: str = "") -> Parallel:
    """Parse d{DP}m{TP}p{PP} in any letter order."""
    where = where or text
    parts = _PART.findall(text)
    if not text or "".join(f"{k}{v}" for k, v in parts) != text:
        raise ConfigError(f"allocation {where!r}: {text!r} is not a parallel strategy; "
                          "expected letters d, m, p each followed by a number, e.g. d4m2p1")
    letters = [k for k, _ in parts]
    if len(set(letters)) != len(letters):
        raise ConfigError(f"allocation {where!r}: {text!r} repeats a letter; expected each of d, m, p at most once")
    values = {k: int(v) for k, v in parts}
    if any(v < 1 for v in values.values()):
        raise ConfigError(f"allocation {where!r}: {text!r} has a zero; expected every degree >= 1")
    return Parallel(dp=values.get("d", 1), tp=values.get("m", 1), pp=values.get("p", 1))


def _parse_roles(text: str) -> dict[str, Parallel]:
    roles: dict[str, Parallel] = {}
    for item in text.split(","):
        role, sep, strat = item.partition(":")
        if not sep:
            raise ConfigError(f"allocation {text!r}: {item!r} has no role; expected role:strategy, "
                              f"e.g. actor_gen:d4p1m2,*:d4p2m1")
        if role not in ROLES:
            raise ConfigError(f"allocation {text!r}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
        roles[role] = parse_parallel(strat, text)
    return roles


def parse_allocation(text: str) -> Allocation:
    text = (text or "").strip()
    if not text:
        raise ConfigError("allocation_mode is empty; expected e.g. d4m2p1, actor_gen:d4p1m2,*:d4p2m1 "
                          "or vllm.d16p1m1+d8p2m1")
    backend, dot, rest = text.partition(".")
    if dot and backend in UNSUPPORTED_BACKENDS:
        raise ConfigError(f"allocation {text!r}: generation backend {backend!r} is not supported; use vllm.")
    if dot and backend in GEN_BACKENDS:
        gen_s, plus, train_s = rest.partition("+")
        if not plus or not gen_s or not train_s:
            raise ConfigError(f"allocation {text!r}: expected vllm.GEN+TRAIN, e.g. vllm.d16p1m1+d8p2m1")
        gen = parse_parallel(gen_s, text)
        if gen.pp != 1:
            raise ConfigError(f"allocation {text!r}: generation pipeline parallel p{gen.pp} is not "
                              "supported by vLLM here; expected p1")
        return Allocation(text, "decoupled", gen, parse_parallel(train_s, text))
    if dot:
        raise ConfigError(f"allocation {text!r}: unknown generation backend {backend!r}; expected vllm")
    if ":" in text:
        roles = _parse_roles(text)
        default = roles.get("*")
        gen_role = roles.get("actor_gen", default)
        train_role = roles.get("actor_train", default)
        if gen_role is None or train_role is None:
            raise ConfigError(f"allocation {text!r}: actor_gen and actor_train need a strategy; add *:STRATEGY")
        return Allocation(text, "per_role", gen_role, train_role)
    p = parse_parallel(text)
    return Allocation(text, "colocated", p, p)
