"""A trainer rank's Ray actor (TrainerWorker, worker.py): one DeepSpeed rank of the actor model, its
half of the weight sync (weight_send.py) and of the turns on shared GPUs (release.py)."""
