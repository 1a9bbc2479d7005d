"""The LitServe side of bench/peer: one zoo app behind LitServe's HTTP server, with its dynamic batching.

Run by ``bench.peer`` as its own process (the root of the process tree whose CPU it counts)::

    python -m bench.peer_litserve --port 8124 --model mobilenet_v2 --shape 3 64 64 --cores 0 --threads 1 \
        --max-batch 8 --wait-ms 2

One inference worker process (``accelerator="cpu"``, one device, one worker) loads the zoo model with the
same seed as the node, confines itself to the same cores and torch threads as the node's instance
(``apply_cpu_share``) and batches at the node's max batch size and wait (``LitAPI(max_batch_size,
batch_timeout)``); one API server process (uvicorn) takes ``POST /predict``. LitServe's request path is
JSON, so the request is ``{"x": <base64 of the raw float32 tensor>}`` and the answer ``{"y": <base64 of
the float32 logits>}``. ``fast_queue`` (ZeroMQ between the API server and the worker) is on, as LitServe's
documentation advises above 100 requests/s; everything else is LitServe's default, including its 30 s
request timeout. LitServe prints its own banner when it is up; bench.peer waits for answers instead.
Needs the ``peer`` extra.
"""

from __future__ import annotations

import base64
from typing import Any

import litserve as ls
import numpy as np

from bench.common import peer_server_parser
from gpuprims.cpushare import CpuShare, apply_cpu_share

ROUTE = "/predict"


class ZooAPI(ls.LitAPI):
    """A zoo model with LitServe's batching; the share is applied in the worker process (``setup``)."""

    def __init__(self, model_name: str, shape: tuple[int, ...], cores: list[int], threads: int, max_batch: int,
                 wait_s: float) -> None:
        super().__init__(max_batch_size=max_batch, batch_timeout=wait_s, api_path=ROUTE)
        self.model_name, self.shape, self.cores, self.threads = model_name, shape, cores, threads
        self.max_batch = max_batch

    def setup(self, device: str) -> None:
        apply_cpu_share(CpuShare(cores=self.cores, threads=self.threads, gpu_pct=50))
        import torch

        from apps.zoo import load_model

        self.torch = torch
        self.model = load_model(self.model_name, seed=0, input_shape=self.shape).eval()
        with torch.inference_mode():
            for b in (1, self.max_batch):
                self.model(torch.zeros((b, *self.shape)))

    def decode_request(self, request):  # type: ignore[no-untyped-def]  # (unannotated: LitServe then passes the JSON body)
        return np.frombuffer(base64.b64decode(request["x"]), np.float32).reshape(self.shape)

    def batch(self, inputs: list[np.ndarray]) -> Any:
        return self.torch.from_numpy(np.stack(inputs))

    def predict(self, x: Any) -> np.ndarray:
        with self.torch.inference_mode():
            return self.model(x).float().cpu().numpy().reshape(x.shape[0], -1)

    def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
        return list(output)

    def encode_response(self, output: np.ndarray) -> dict[str, str]:
        return {"y": base64.b64encode(np.ascontiguousarray(output, np.float32).tobytes()).decode("ascii")}


def main() -> None:
    ap = peer_server_parser(__doc__.splitlines()[0])
    args = ap.parse_args()
    api = ZooAPI(args.model, tuple(args.shape), args.cores, args.threads, args.max_batch, args.wait_ms / 1e3)
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, fast_queue=True)
    server.run(host="127.0.0.1", port=args.port, num_api_servers=1, log_level="warning", generate_client_file=False)


if __name__ == "__main__":
    main()
