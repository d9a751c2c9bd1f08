"""One SGLang server process for one rollout engine: start, watch, generate, pause, take new weights.

SGLang runs from its own venv (sglang_env.py) as `python -m sglang.launch_server`, as AReaLite
runs it: its own process, port and log file; the engine talks to it over HTTP.

    server = SGLangServer(model_path, log_dir=run_dir / "sglang")
    server.start()                                   # waits for /health
    out = server.generate([2, 5, 6], max_new_tokens=8, temperature=0.0)
    out.token_ids, out.logprobs                      # per-token logprobs of the sampled tokens
    server.update_weights_from_disk(ckpt_dir, version="3")
    server.ensure_alive()                            # relaunches a dead server; True when it did

Prompts go as token ids, never text: the trainer's ids are the engine's ids (no re-tokenization),
and tokenizers SGLang rebuilds can differ from the one the model was saved with.

Weights through a distributed group (NCCL on GPUs, gloo on CPU): init_weights_group() once, then
update_weights_from_distributed() per push while the trainer broadcasts the same tensors in the
same order (rl/weight_sync/sglang_group.py is that side). Both calls block until the trainer's
side has done its part, so the caller runs them beside it (a thread). SGLang 0.5.23 answers 400
to an update not bracketed by /begin_weight_update and /end_weight_update: the method does both.

On CPU the server runs with SGLANG_USE_CPU_ENGINE=1 and the torch-native attention backend
(CPU_ARGS); the stand-ins that venv needs are in sglang_cpu_standins.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from areal_kit.rl.engine.sglang_env import python_of

# SGLang's CPU engine: torch-native attention, no overlap scheduler (its CUDA streams), no warmup
# request (it sends text, which a word-level toy tokenizer turns into no tokens), a small KV pool
# (the default sizes it from free memory: 10 GB and 30 s on this machine for nothing).
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
            "--skip-server-warmup", "--max-total-tokens", "8192", "--max-running-requests", "64")


class SGLangError(RuntimeError):
    """The server refused a request, died, or did not come up in time (the log file says why)."""


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, under the sampling temperature's distribution
    finish_reason: str  # "stop", "length" or "abort"
    weight_version: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SGLangServer:
    """One server: its process, port and log file (log_dir/sglang-<port>.log, appended across relaunches)."""

    def __init__(self, model_path: str, log_dir: Path, *, device: str = "cpu", python: Path | None = None,
                 port: int = 0, host: str = "127.0.0.1", extra_args: Sequence[str] = (),
                 start_timeout_s: float = 900.0, request_timeout_s: float = 600.0) -> None:
        py = python or python_of()
        if py is None:
            raise SGLangError("SGLang is not installed: python -m areal_kit.rl.engine.sglang_env")
        self.python, self.model_path, self.device, self.host = py, model_path, device, host
        self.port = port or free_port()
        self.log_path = Path(log_dir) / f"sglang-{self.port}.log"
        self.extra_args = tuple(extra_args)
        self.start_timeout_s = start_timeout_s
        self.url = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.model_path_now = model_path  # the weights a relaunch loads: the last disk load's
        self.launches = 0
        self._http = httpx.Client(base_url=self.url, timeout=request_timeout_s)

    def command(self) -> list[str]:
        args = [str(self.python), "-m", "sglang.launch_server", "--model-path", self.model_path_now,
                "--host", self.host, "--port", str(self.port)]
        return args + list(CPU_ARGS if self.device == "cpu" else ()) + list(self.extra_args)

    def start(self) -> None:
        """Launch the process and wait until /health answers 200 (SGLANG_USE_CPU_ENGINE on CPU)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **({"SGLANG_USE_CPU_ENGINE": "1"} if self.device == "cpu" else {})}
        # Our PYTHONPATH points at this project's packages, which must not shadow the SGLang venv's.
        env.pop("PYTHONPATH", None)
        with open(self.log_path, "ab") as log:
            # Its own session, so stop() ends the server's scheduler and detokenizer children with it.
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.launches += 1
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SGLangError(f"SGLang server exited {self.proc.returncode} while starting; see {self.log_path}")
            if self._healthy():
                return
            time.sleep(1.0)
        self.stop()
        raise SGLangError(f"SGLang server not healthy after {self.start_timeout_s:.0f}s; see {self.log_path}")

    def _healthy(self) -> bool:
        try:
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self._healthy()

    def ensure_alive(self) -> bool:
        """Relaunch a dead or unanswering server (on the last weights loaded from disk); True when it did."""
        if self.alive():
            return False
        self.stop()
        self.start()
        return True

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.proc = None

    def close(self) -> None:
        self.stop()
        self._http.close()

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            r = self._http.post(path, json=body or {})
        except httpx.HTTPError as e:
            raise SGLangError(f"{path}: {type(e).__name__}: {e}; see {self.log_path}") from None
        if r.status_code != 200:
            raise SGLangError(f"{path} answered {r.status_code}: {r.text[:300]}")
        out = r.json() if r.content else None
        if isinstance(out, dict) and out.get("success") is False:
            raise SGLangError(f"{path} failed: {out.get('message')}")
        return out

    def generate(self, input_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, ignore_eos: bool = False, stop_token_ids: Sequence[int] = ()) -> Generation:
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                                  "ignore_eos": ignore_eos}
        if stop_token_ids:
            params["stop_token_ids"] = list(stop_token_ids)
        out = self._post("/generate", {"input_ids": list(input_ids), "sampling_params": params,
                                       "return_logprob": True})
        meta = out["meta_info"]
        pairs = meta["output_token_logprobs"]  # [logprob, token_id, text or None] per sampled token
        finish = meta.get("finish_reason") or {}
        return Generation(token_ids=[int(p[1]) for p in pairs], logprobs=[float(p[0]) for p in pairs],
                          finish_reason=str(finish.get("type", "")), weight_version=str(meta.get("weight_version")))

    def pause(self) -> None:
        """Stop generating; requests under way are aborted (they come back with finish_reason abort)."""
        self._post("/pause_generation", {"mode": "abort"})

    def resume(self) -> None:
        self._post("/continue_generation")

    def update_weights_from_disk(self, model_path: str, version: str | None = None) -> None:
        """Load a saved model folder (safetensors) in place; a relaunch starts from it too."""
        self._post("/update_weights_from_disk", {"model_path": model_path, "flush_cache": True,
                                                 "weight_version": version})
        self.model_path_now = model_path

    def init_weights_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str = "weight_update_group", backend: str = "gloo") -> None:
        """Join the trainer's broadcast group as rank rank_offset; blocks until every rank has joined."""
        self._post("/init_weights_update_group", {"master_address": master_address, "master_port": master_port,
                                                  "rank_offset": rank_offset, "world_size": world_size,
                                                  "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], group_name: str = "weight_update_group",
                                        version: str | None = None) -> None:
        """Receive the named tensors by broadcast from the group's rank 0, in this order; blocks until done."""
        self._post("/begin_weight_update")
        try:
            self._post("/update_weights_from_distributed", {
                "names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                "group_name": group_name, "flush_cache": True, "weight_version": version})
        finally:
            self._post("/end_weight_update")
