"""The MLServer side of bench/peer: one zoo app behind MLServer, the Open Inference Protocol server a KServe
user would pick, with its adaptive batching on.

``bench.peer`` writes MLServer's repository (``mlserver_repository``: ``settings.json`` and the model's
``model-settings.json``, which names ``bench.peer_mlserver.ZooModel`` as the runtime) and runs ``mlserver
start`` on it with the interpreter of MLServer's own environment (``scripts/setup-mlserver.sh``: MLServer
pins fastapi, starlette, protobuf and tritonclient to versions the ``peer`` extra's Ray Serve and
perf_analyzer cannot share), the repository root on ``PYTHONPATH``. This module is MLServer's side: the
model class its inference worker loads. MLServer's defaults hold except:

- its gRPC port is the bench's (driven with ``tritonclient.grpc.aio`` and ``raw_input_contents``, the same
  client and encoding as gpuprims' own gRPC row); its HTTP port is a free one (MLServer's HTTP path has no
  binary tensor extension, so its fastest way in is gRPC);
- adaptive batching at the node's max batch size and wait (``max_batch_size``, ``max_batch_time``);
- one inference worker process (``parallel_workers: 1``, its default), which loads the zoo model with the
  same seed as the node and confines itself to the same cores and torch threads (``apply_cpu_share``);
- no metrics server (``metrics_endpoint: null``; the node runs without one too) and ``debug: false``.

The model (``parameters.extra``) on ``engine: onnxruntime`` runs on gpuprims' own ONNX Runtime engine, built
from the same model into (or loaded from) the same engine cache as the node's, as ``bench.peer_litserve``
does. Inputs are ``input`` (FP32, ``[n, *shape]``), outputs ``logits`` (FP32, ``[n, classes]``), the node's names.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse

from gpuprims.cpushare import CpuShare, apply_cpu_share
from gpuprims.engines import EngineCache, ModelSource, Target, make_engine


class ZooModel(MLModel):
    """A zoo model in MLServer's worker process; its parameters (``parameters.extra``) carry the share,
    the shape and the engine."""

    async def load(self) -> bool:
        extra: dict[str, Any] = dict(self.settings.parameters.extra or {}) if self.settings.parameters else {}
        shape, max_batch = tuple(extra["shape"]), int(extra["max_batch"])
        apply_cpu_share(CpuShare(cores=list(extra["cores"]), threads=int(extra["threads"]), gpu_pct=50))
        import torch

        from apps.zoo import load_model

        self._torch = torch
        if extra["engine"] == "eager":
            self._model = load_model(extra["model"], seed=0, input_shape=shape).eval()
        else:
            self._model = make_engine(extra["engine"], ModelSource(extra["model"], shape, max_batch, seed=0),
                                      Target("cpu", threads=int(extra["threads"])),
                                      cache=EngineCache(extra.get("engine_cache")))
            self._model.prepare()
        with torch.inference_mode():
            for b in (1, max_batch):
                self._model(torch.zeros((b, *shape)))
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0])
        with self._torch.inference_mode():
            y = self._model(self._torch.from_numpy(np.ascontiguousarray(x, np.float32)))
        logits = y.float().cpu().numpy().reshape(x.shape[0], -1)
        return InferenceResponse(model_name=self.name, id=payload.id,
                                 outputs=[NumpyCodec.encode_output("logits", logits)])
