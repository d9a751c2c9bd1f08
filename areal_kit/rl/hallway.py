"""What the driver and its actors answer each other, besides samples (rl/sample.py): one dataclass
per structured reply, imported by both sides. The calls themselves are typed where the driver makes
them (rl/driver/client.py): each names the worker's method, whose signature returns these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RecoverLoad:
    """A trainer rank's load of a recover checkpoint (TrainerWorker.load_recover)."""

    version: int  # the weight version the checkpoint holds
    ranks_written: int  # how many ranks wrote it
    universal: bool  # loaded through DeepSpeed's universal format (another number of ranks wrote it)
    load_time: float  # seconds


@dataclass(frozen=True)
class IpcStart:
    """A trainer rank's IPC buffer for one sync (IpcSender.ipc_start): its handle under the rank's
    device key (ipc.trainer_key), and how many chunks the weights take."""

    handles: dict[str, dict]
    chunks: int


@dataclass(frozen=True)
class WorkerProbe:
    """An engine worker's answer to the IPC probe (WeightReceiver.ipc_probe): its device key, and
    why it cannot load chunks of an IPC buffer ('' when it can)."""

    uuid: str
    why: str


@dataclass(frozen=True)
class TokenTrace:
    """What the trainer computed for each output token of one sample, in its tokens' order:
    its logprob before the step's update (the one the PPO ratio takes), the entropy of its train
    forward, and the reference KL, logprob - reference logprob (None without a reference model)."""

    logprobs: list[float]
    entropy: list[float]
    ref_kl: list[float] | None = None


@dataclass(frozen=True)
class TrainReply:
    """A train step's answer (TrainerWorker.train_step): its stats, summed over the ranks, and the
    token traces of the rows the driver asked for, by their index in the rows it was given."""

    stats: dict[str, float]
    traces: dict[int, TokenTrace]
