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
request timeout. ``--engine onnxruntime`` runs the model on the ONNX Runtime session gpuprims' own
``engine: onnxruntime`` uses: the same ``gpuprims.engines`` engine, built from the same model into (or
loaded from) the same engine cache (``--engine-cache``, the node's ``engine_cache``), so the same ONNX
file with the same session options and the share's threads; the comparison is then of the servers alone. LitServe prints its own banner when it is up; bench.peer waits for answers instead.
Needs the ``peer`` extra.
"""

from __future__ import annotations

import base64
from typing import Any

import litserve as ls
import numpy as np

from bench.common import peer_server_parser
from gpuprims.cpushare import CpuShare, apply_cpu_share
from gpuprims.engines import EngineCache, ModelSource, Target, make_engine

ROUTE = "/predict"


class ZooAPI(ls.LitAPI):
    """A zoo model with LitServe's batching; the share is applied in the worker process (``setup``)."""

    def __init__(self, model_name: str, shape: tuple[int, ...], cores: list[int], threads: int, max_batch: int,
                 wait_s: float, engine: str = "eager", engine_cache: str | None = None) -> None:
        super().__init__(max_batch_size=max_batch, batch_timeout=wait_s, api_path=ROUTE)
        self.model_name, self.shape, self.cores, self.threads = model_name, shape, cores, threads
        self.max_batch, self.engine, self.engine_cache = max_batch, engine, engine_cache

    def setup(self, device: str) -> None:
        apply_cpu_share(CpuShare(cores=self.cores, threads=self.threads, gpu_pct=50))
        import torch

        from apps.zoo import load_model

        self.torch = torch
        if self.engine == "eager":
            self.model = load_model(self.model_name, seed=0, input_shape=self.shape).eval()
        else:
            self.model = make_engine(self.engine, ModelSource(self.model_name, self.shape, self.max_batch, seed=0),  # type: ignore[arg-type]
                                     Target("cpu", threads=self.threads), cache=EngineCache(self.engine_cache))
            self.model.prepare()
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
    ap.add_argument("--engine", default="eager", choices=["eager", "onnxruntime"],
                    help="the model runner: torch eager, or gpuprims' onnxruntime engine (the node's session)")
    ap.add_argument("--engine-cache", default=None, help="the engine cache (default: the per-user one)")
    args = ap.parse_args()
    api = ZooAPI(args.model, tuple(args.shape), args.cores, args.threads, args.max_batch, args.wait_ms / 1e3,
                 args.engine, args.engine_cache)
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, fast_queue=True)
    server.run(host="127.0.0.1", port=args.port, num_api_servers=1, log_level="warning", generate_client_file=False)


if __name__ == "__main__":
    main()
