"""A rollout engine's Ray actor (RolloutWorker, worker.py): one vLLM engine, its half of the weight
sync (weight_receive.py), its sleep on shared GPUs, and the chat endpoint agents call."""
