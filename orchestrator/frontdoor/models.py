"""What the front door knows about each app: its OIP model metadata and configuration.

An app's name is the model name. Its one input (``input``) is the app's ``input_shape`` and
``dtype`` with a leading batch dimension; its one output (``logits``) is FP32 ``[batch, K]``, the
row the instance answers with. K comes from the model zoo once at start: the app's ``num_classes``
or the zoo model's own class count (`apps.zoo.names`, no torch); a user model (``module:factory``) is built and run once on a
zero input; a DAG app's K depends on the stage a request ends at, so it is ``-1`` (variable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from apps.zoo.names import NAMES, canonical_name
from gpuprims.tensors import ModelSignature, TensorSpec
from orchestrator.config.model_files import model_name
from orchestrator.config.schema import AppConfig
from orchestrator.frontdoor.policy import AdmissionPolicy, admission_policy

#: OIP datatype name of each app dtype, and numpy dtypes of OIP datatypes the front door reads.
OIP_DATATYPE = {"float32": "FP32", "uint8": "UINT8"}
NUMPY_OF = {"FP32": np.dtype("<f4"), "UINT8": np.dtype("u1"), "FP16": np.dtype("<f2"), "INT64": np.dtype("<i8"),
            "FP64": np.dtype("<f8"), "INT32": np.dtype("<i4"), "INT8": np.dtype("i1"), "BOOL": np.dtype("?")}
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
PLATFORM = "gpuprims"
#: The bound of one request of a model file with dynamic dimensions where the node's pool gives none.
DEFAULT_REQUEST_BYTES = 64 << 20
#: Room for everything in a request but its tensor data: the JSON header, names, parameters, id.
HEAD_BYTES = 64 << 10
#: Most bytes one element takes in JSON text: a float64 repr ("-1.2345678901234567e-308") and ", ".
JSON_BYTES_PER_ELEMENT = 25
#: Most bytes one element takes in a gRPC typed ``contents`` field: packed fixed32 for FP32, a varint
#: of at most 2 bytes for a UINT8 value in ``uint_contents``.
TYPED_BYTES_PER_ELEMENT = {"FP32": 4, "UINT8": 2}


@dataclass(frozen=True)
class ModelInfo:
    """One app as an OIP model. ``output_dim`` is -1 when it varies per request (DAG apps)."""

    name: str
    app_id: int
    input_shape: tuple[int, ...]
    dtype: str
    output_dim: int
    max_batch: int
    max_wait_ms: float
    slo_ms: float
    instances: int
    #: A model file's named tensors (None: the zoo's one input and one output, as above).
    signature: ModelSignature | None = None
    #: A model file's completed config.pbtxt in Triton's JSON form (GET /v2/models/<name>/config).
    triton_config: dict[str, Any] | None = None
    #: The version served (a model file's, from its repository; "1" otherwise).
    version: str = "1"
    #: A model file's largest request body: its inputs' bytes when every dimension is fixed, else the
    #: node's pool bound (node.pool.max_chunks x max_payload).
    request_bytes_max: int = 0
    platform: str = PLATFORM
    #: Queue policy and priority levels at the front door (orchestrator/frontdoor/admission.py).
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    #: The app that serves it: the model's name, or one version's app (``<model>-v<version>``) when the
    #: model's version_policy serves several versions (orchestrator/config/model_files.py). "" means ``name``.
    app: str = ""

    @property
    def app_name(self) -> str:
        return self.app or self.name

    @property
    def datatype(self) -> str:
        return OIP_DATATYPE[self.dtype]

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.input_shape) * self.numpy_dtype.itemsize

    @property
    def row_elements(self) -> int:
        return math.prod(self.input_shape)

    @property
    def rows_max(self) -> int:
        """Most requests (rows of the batch dimension) one inference may carry: 1 for a model file
        without batching."""
        if self.signature is not None and not self.signature.batched:
            return 1
        return self.max_batch

    def max_body_bytes(self, binary: bool) -> int:
        """Largest HTTP request body the model can take: ``max_batch`` rows, as binary tensor data
        after a JSON header (``binary``) or as JSON numbers, plus :data:`HEAD_BYTES`."""
        if self.signature is not None:
            per = self.request_bytes_max if binary else self.request_bytes_max * JSON_BYTES_PER_ELEMENT
            return self.rows_max * per + HEAD_BYTES
        per_row = self.row_bytes if binary else self.row_elements * JSON_BYTES_PER_ELEMENT
        return self.max_batch * per_row + HEAD_BYTES

    @property
    def max_message_bytes(self) -> int:
        """Largest gRPC ModelInfer message the model can take: ``max_batch`` rows as raw or typed
        contents, whichever is larger, plus :data:`HEAD_BYTES`."""
        if self.signature is not None:  # typed contents take at most 8 bytes an element (varints, 64-bit)
            return self.rows_max * self.request_bytes_max * 8 + HEAD_BYTES
        typed = self.row_elements * TYPED_BYTES_PER_ELEMENT.get(self.datatype, 8)
        return self.max_batch * max(self.row_bytes, typed) + HEAD_BYTES

    def metadata(self) -> dict[str, Any]:
        """The OIP model metadata (GET /v2/models/<name>)."""
        if self.signature is not None:
            lead = [-1] if self.signature.batched else []

            def one(t: TensorSpec) -> dict[str, Any]:
                return {"name": t.name, "datatype": t.datatype.value, "shape": [*lead, *t.dims]}
            return {"name": self.name, "versions": [self.version], "platform": self.platform,
                    "inputs": [one(t) for t in self.signature.inputs],
                    "outputs": [one(t) for t in self.signature.outputs]}
        return {
            "name": self.name,
            "versions": ["1"],
            "platform": PLATFORM,
            "inputs": [{"name": INPUT_NAME, "datatype": self.datatype, "shape": [-1, *self.input_shape]}],
            "outputs": [{"name": OUTPUT_NAME, "datatype": "FP32", "shape": [-1, self.output_dim]}],
        }

    def config(self) -> dict[str, Any]:
        """Triton's model configuration (GET /v2/models/<name>/config), in its JSON form."""
        if self.triton_config is not None:
            return self.triton_config
        return {
            "name": self.name,
            "platform": PLATFORM,
            "backend": PLATFORM,
            "max_batch_size": self.max_batch,
            "input": [{"name": INPUT_NAME, "data_type": f"TYPE_{self.datatype}", "format": "FORMAT_NCHW",
                       "dims": list(self.input_shape)}],
            "output": [{"name": OUTPUT_NAME, "data_type": "TYPE_FP32", "dims": [self.output_dim]}],
            "instance_group": [{"name": self.name, "count": self.instances, "kind": "KIND_AUTO"}],
            "dynamic_batching": {"max_queue_delay_microseconds": round(self.max_wait_ms * 1000)},
            "parameters": {"app_id": {"string_value": str(self.app_id)},
                           "slo_ms": {"string_value": f"{self.slo_ms:g}"}},
        }


def output_dim(app: AppConfig) -> int:
    """Length of one answer row of ``app`` (see the module docstring); -1 for a DAG app."""
    if app.stages is not None or app.model is None:
        return -1
    if ":" not in app.model:
        return app.num_classes or NAMES[canonical_name(app.model)].num_classes
    # Only a user model is built here, and only it needs torch: a node of zoo apps never imports it.
    import torch

    from apps.zoo import load_model

    model = load_model(app.model, seed=app.seed, num_classes=app.num_classes, input_shape=app.input_shape)
    with torch.inference_mode():
        out = model(torch.zeros((1, *app.input_shape)))
    return math.prod(out.shape[1:])


def _with_app_keys(cfg: dict[str, Any], app: AppConfig) -> dict[str, Any]:
    """A model file's config as the front door reports it: its own, with the node's ``app_id`` (a UDP
    client's address for it: one version's, where each version is an app), ``app`` and ``slo_ms`` among its parameters, as a zoo app's config has them."""
    params = dict(cfg.get("parameters") or {})
    params["app_id"] = {"string_value": str(app.app_id)}
    params["app"] = {"string_value": app.name}
    params["slo_ms"] = {"string_value": f"{app.slo_ms:g}"}
    return {**cfg, "parameters": params}


def model_info(app: AppConfig, request_bytes_max: int = DEFAULT_REQUEST_BYTES) -> ModelInfo:
    """The ModelInfo of one app (builds a user model once to learn its output size). A model file's
    comes from its config; ``request_bytes_max`` bounds a request with dynamic dimensions (the pool's
    largest request)."""
    if app.file is not None:
        cfg = app.file.config
        sizes = [s.fixed_bytes() for s in cfg.signature.inputs]
        fixed = None if any(b is None for b in sizes) else sum(b or 0 for b in sizes)
        bound = fixed if fixed is not None and (not request_bytes_max or fixed <= request_bytes_max) \
            else request_bytes_max or (fixed or 0)
        name = model_name(app.name, cfg.name, app.file.repository)
        return ModelInfo(name=name, app=app.name, app_id=app.app_id, input_shape=(), dtype="uint8", output_dim=-1,
                         max_batch=app.max_batch, max_wait_ms=app.max_wait_ms, slo_ms=app.slo_ms,
                         instances=app.instances if app.instances != "auto" else 0, signature=cfg.signature,
                         triton_config=_with_app_keys(app.file.triton_json(), app), version=str(app.file.version),
                         request_bytes_max=bound, platform=cfg.platform or cfg.backend or PLATFORM,
                         admission=admission_policy(app))
    return ModelInfo(name=app.name, app_id=app.app_id, input_shape=tuple(app.input_shape), dtype=app.dtype,
                     output_dim=output_dim(app), max_batch=app.max_batch, max_wait_ms=app.max_wait_ms,
                     slo_ms=app.slo_ms, instances=app.instances if app.instances != "auto" else 0,
                     admission=admission_policy(app))
