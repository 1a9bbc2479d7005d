"""The Ray Serve side of bench/peer: one zoo app behind Serve's HTTP proxy, with Serve's dynamic batching.

Run by ``bench.peer`` as its own process (the root of the process tree whose CPU it counts)::

    python -m bench.peer_ray --port 8123 --model mobilenet_v2 --shape 3 64 64 --cores 0 --threads 1 \
        --max-batch 8 --wait-ms 2 --temp-dir /tmp/rayXXXX

It starts a fresh local Ray cluster (``address="local"``: never joins one already on the machine;
no dashboard), deploys one replica that loads the zoo model with the same seed as the node, confines
itself to the same cores and torch threads as the node's instance (``apply_cpu_share``), batches with
``@serve.batch`` at the node's max batch size and wait, and answers ``POST /infer`` (the raw float32
request tensor as the body) with the raw float32 logits. It prints ``READY`` once Serve reports the
app running, and shuts Serve and Ray down on SIGTERM/SIGINT. Needs the ``peer`` extra.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

import numpy as np
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from bench.common import peer_server_parser
from gpuprims.cpushare import CpuShare, apply_cpu_share

ROUTE = "/infer"


def make_deployment(model_name: str, shape: tuple[int, ...], cores: list[int], threads: int, max_batch: int,
                    wait_s: float, max_ongoing: int) -> Any:
    """The Serve deployment (one replica, one CPU) for these settings."""

    @serve.deployment(num_replicas=1, max_ongoing_requests=max_ongoing, ray_actor_options={"num_cpus": 1})
    class ZooModel:
        def __init__(self) -> None:
            apply_cpu_share(CpuShare(cores=cores, threads=threads, gpu_pct=50))
            import torch

            from apps.zoo import load_model

            self.torch = torch
            self.row_bytes = int(np.prod(shape)) * 4
            self.model = load_model(model_name, seed=0, input_shape=shape).eval()
            with torch.inference_mode():
                for b in (1, max_batch):
                    self.model(torch.zeros((b, *shape)))

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=wait_s)
        async def infer(self, bodies: list[bytes]) -> list[bytes]:
            x = self.torch.from_numpy(np.frombuffer(b"".join(bodies), np.float32).reshape(len(bodies), *shape))
            with self.torch.inference_mode():
                logits = self.model(x).float().cpu().numpy().reshape(len(bodies), -1)
            return [row.tobytes() for row in logits]

        async def __call__(self, request: Request) -> Response:
            body = await request.body()
            if len(body) != self.row_bytes:
                return Response(f"want {self.row_bytes} bytes, got {len(body)}", status_code=400)
            return Response(await self.infer(body), media_type="application/octet-stream")

    return ZooModel


def main() -> None:
    ap = peer_server_parser(__doc__.splitlines()[0])
    ap.add_argument("--max-ongoing", type=int, required=True)
    ap.add_argument("--num-cpus", type=int, required=True)
    ap.add_argument("--temp-dir", required=True)
    args = ap.parse_args()

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, _temp_dir=args.temp_dir,
             log_to_driver=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        dep = make_deployment(args.model, tuple(args.shape), args.cores, args.threads, args.max_batch,
                              args.wait_ms / 1e3, args.max_ongoing)
        serve.run(dep.bind(), name="peer", route_prefix=ROUTE)
        print("READY", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
