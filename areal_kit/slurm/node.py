"""What the sbatch script runs on a job's nodes, besides Ray's head and the driver.

    python -m areal_kit.slurm.node worker HEAD_IP:PORT      # join Ray (blocks), by this node's address
    python -m areal_kit.slurm.node wait HEAD_IP:PORT N TIMEOUT_S

`worker` gives Ray the node's address on the route to the head: Ray's Python finds it so, but its
raylet looks for a route to the internet, and a cluster's nodes often have none (it would then
register as 127.0.0.1). `wait` returns once Ray has N live nodes, so the driver's placement sees
every node of the job; after TIMEOUT it exits 1, saying which nodes came.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time

import ray


def address_towards(host: str) -> str:
    """This machine's address on its route to host (no packet is sent: a UDP socket's connect)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def wait_nodes(address: str, n: int, timeout: float) -> list[str]:
    """The live nodes' addresses once there are n of them; raises TimeoutError with those that came."""
    host, port = address.rsplit(":", 1)
    end = time.monotonic() + timeout
    while True:  # the head's GCS first: ray.init on a head not up yet would wait a minute and fail
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            break
        except OSError:
            if time.monotonic() > end:
                raise TimeoutError(f"Ray's head at {address} did not answer in {timeout:g} s") from None
            time.sleep(1)
    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        while True:
            alive = sorted(x["NodeManagerAddress"] for x in ray.nodes() if x["Alive"])
            if len(alive) >= n:
                return alive
            if time.monotonic() > end:
                raise TimeoutError(f"{len(alive)} of {n} nodes joined Ray at {address} in {timeout:g} s: "
                                   f"{', '.join(alive) or 'none'}")
            time.sleep(1)
    finally:
        ray.shutdown()


def main() -> None:
    what, address = sys.argv[1], sys.argv[2]
    if what == "worker":
        ip = address_towards(address.rsplit(":", 1)[0])
        os.execv(sys.executable, [sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
                                  f"--address={address}", f"--node-ip-address={ip}"])
    n, timeout = int(sys.argv[3]), float(sys.argv[4])
    try:
        alive = wait_nodes(address, n, timeout)
    except TimeoutError as e:
        print(f"areal-kit: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"areal-kit: Ray has {len(alive)} nodes: {', '.join(alive)}", flush=True)


if __name__ == "__main__":
    main()
