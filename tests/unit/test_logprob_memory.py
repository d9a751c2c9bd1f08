"""Peak memory of the trainer's logprob step over a long packed batch: chunked vs all at once.

functional.chunked_logprobs computes log-softmax over [chunk, vocab] logits blocks (and, under
autograd, recomputes each block in backward) instead of one [tokens, vocab] tensor. Each path
runs in a fresh subprocess; its peak resident memory over the step is measured with Linux's
VmHWM, reset just before the step (/proc/self/clear_refs), minus the memory held before it.

    python -m pytest tests/unit/test_logprob_memory.py -s     # prints the two peaks
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

T, H, V, CHUNK = 8192, 64, 8192, 512  # one [T, V] fp32 block is 256 MiB; a chunk's is 16 MiB

SCRIPT = textwrap.dedent(f"""
    import json, sys, torch
    from areal_kit.rl.algo import functional as Fn

    def kib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1])

    torch.manual_seed(0)
    torch.set_num_threads(1)
    head = torch.nn.Linear({H}, {V}, bias=False)
    hidden = torch.randn({T}, {H}, requires_grad=True)
    labels = torch.randint(0, {V}, ({T},))
    adv = torch.randn({T})

    def step():
        if sys.argv[1] == "chunked":
            lp, ent = Fn.chunked_logprobs(hidden, head, labels, temperature=0.7, chunk={CHUNK})
        else:
            lp, ent = Fn.gather_logprobs(head(hidden), labels, temperature=0.7)
        (lp * adv).sum().backward()
        return float(lp.sum()), float(ent.sum()), float(hidden.grad.abs().sum())

    step()  # warm-up: lazy allocations (grad buffers, thread pools) happen outside the measure
    hidden.grad = None
    head.weight.grad = None
    before = kib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    sums = step()
    print(json.dumps({{"peak_mib": (kib("VmHWM:") - before) / 1024, "sums": sums}}))
""")


def _measure(mode: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # A fixed mmap threshold: glibc then maps every large block and unmaps it when freed, so
    # resident memory follows live tensors (its default threshold adapts and keeps freed
    # blocks in the heap, which makes the peak depend on allocation history).
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_chunked_logprob_peak_memory_is_bounded():
    full = _measure("full")
    chunked = _measure("chunked")
    block_mib = T * V * 4 / 2**20
    print(f"\nlogprob step, {T} tokens x vocab {V}: peak +{full['peak_mib']:.0f} MiB all at once, "
          f"+{chunked['peak_mib']:.0f} MiB chunked by {CHUNK}")
    # Same numbers either way: chunking changes memory, not math.
    assert chunked["sums"] == pytest.approx(full["sums"], rel=1e-4)
    # All at once holds several [T, V] blocks (logits, log-softmax, their grads).
    assert full["peak_mib"] > 2 * block_mib
    # Chunked: under a quarter of that, and under one [T, V] block: it does not scale with T x V.
    assert chunked["peak_mib"] < full["peak_mib"] / 4
    assert chunked["peak_mib"] < block_mib
