"""What an instance is told at start: its :class:`InstanceSpec`, JSON in ``GPUPRIMS_INSTANCE_SPEC``.

A module of its own, free of torch, so that the node (which builds specs and never runs a model)
does not import the instance's serving code.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass, field

from gpuprims.engines.errors import EngineError
from gpuprims.engines.kinds import file_engine_kind
from orchestrator.control.records import EngineSpec, StageSpec

ENV_SPEC = "GPUPRIMS_INSTANCE_SPEC"
#: The instance code, which every instance imports (torch-free).
INSTANCE_MODULE = "orchestrator.worker.instance"


@dataclass
class InstanceSpec:
    """Everything an instance needs to start, JSON-serialisable (`to_json`); `from_json` rebuilds and
    checks it, its engine choice and stages included."""

    name: str
    app: str
    app_id: int
    model: str
    pool: str
    consumer: int
    input_shape: tuple[int, int, int] = (3, 224, 224)
    dtype: str = "float32"
    seed: int = 0
    num_classes: int | None = None
    slo_ms: float = 100.0
    max_batch: int = 8
    max_wait_ms: float = 2.0
    gpu_pct: int = 100
    backend: str = "cpu"
    gpu: int = 0
    cores: list[int] | None = None
    threads: int | None = None
    defer_init: bool = False
    heartbeat_ms: float = 500.0
    chunk_payload: int = 1024
    warmup: bool = True
    share_params: str | None = None
    # A DAG app's stages, each on its own engine; the stage named in `entry` runs first and class i of
    # its output continues at routes[i] (classes past the list end there).
    stages: tuple[StageSpec, ...] | None = None
    entry: str | None = None
    # Scheduler-dispatched (node.scheduler spatiotemporal/temporal): serve only what RunBatch says,
    # one stage at a time; the warm-up measures every stage at ``profile_batches`` for the scheduler.
    dispatched: bool = False
    profile_batches: list[int] | None = None
    # A file the node's instances lock while measuring, so that their measurements do not overlap.
    measure_lock: str | None = None
    stage_pcts: dict[str, int] | None = None  # dispatched: the GPU% each stage is measured and run at
    gather_method: str | None = None  # host (cpu) | gpu_dma (cuda default) | cuda_copy (the baseline)
    # A shadow on the cpu backend: load and warm the model at the lowest priority before InitGpu (see
    # Instance.start_prewarm), so that a change is a route flip.
    prewarm: bool = False
    # The model runner (gpuprims.engines): eager (torch), onnxruntime, tensorrt, cudagraph, compile, ...
    # and its options (apps.yaml ``engine:``), validated by the node before it starts the instance.
    engine: EngineSpec = field(default_factory=EngineSpec)
    engine_cache: str | None = None  # the engine cache's directory (node.engine_cache); None: the default
    # A model file (a Triton model repository's version, or apps.yaml ``model: path``): its completed
    # config (gpuprims.modelrepo.ModelConfig JSON, the one message from the repository to the instance),
    # the file, its version and its content fingerprint (the engine cache's key). ``engine`` is then a
    # file engine kind (gpuprims.engines.files).
    model_config: str | None = None
    model_path: str | None = None
    model_version: int | None = None
    model_fingerprint: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineSpec):
            raise TypeError(f"InstanceSpec.engine must be an EngineSpec, got {self.engine!r}")
        if self.stages is not None:
            self.stages = tuple(self.stages)
            if not all(isinstance(s, StageSpec) for s in self.stages):
                raise TypeError(f"InstanceSpec.stages must be StageSpecs, got {self.stages!r:.120}")

    @property
    def serves_file(self) -> bool:
        """Whether this instance serves a model file with named tensors (not a zoo or torch model)."""
        return self.model_config is not None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> InstanceSpec:
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown instance spec keys: {sorted(unknown)}")
        data["input_shape"] = tuple(data.get("input_shape", (3, 224, 224)))
        if "engine" in data:
            data["engine"] = EngineSpec.from_wire(data["engine"])
        if data.get("stages") is not None:
            if not isinstance(data["stages"], list):
                raise ValueError(f"instance spec stages must be a list, got {data['stages']!r:.80}")
            data["stages"] = tuple(StageSpec.from_wire(s) for s in data["stages"])
        return cls(**data)


#: What a torch instance imports: the instance code and the zoo's runner (torch, the zoo).
TORCH_IMPORTS = (INSTANCE_MODULE, "orchestrator.worker.zoo_runner")


def instance_imports(spec: InstanceSpec) -> tuple[str, ...]:
    """The modules an instance of ``spec`` imports to serve (what its fork server preloads): the
    instance code, and either the zoo's runner, which imports torch (a zoo model, on any engine, and a
    model file on a torch kind), or the file engine's module and its library (ONNX Runtime, OpenVINO,
    TensorRT: no torch). A kind this build does not know preloads only the instance code (the instance
    refuses it itself)."""
    if not spec.serves_file:
        return TORCH_IMPORTS
    try:
        kind = file_engine_kind(spec.engine.kind)
    except EngineError:
        return (INSTANCE_MODULE,)
    if kind.needs_torch:
        return TORCH_IMPORTS
    return (INSTANCE_MODULE, kind.impl.partition(":")[0],
            *(lib for lib in kind.libraries if importlib.util.find_spec(lib) is not None))
