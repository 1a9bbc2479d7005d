"""The engine interface: what every model runner behind an instance's run seam provides.

An *engine* turns an app's model (a zoo name or ``module:factory``, its seed, input shape and max batch)
into something that runs a float32 batch ``(n, C, H, W)``, ``1 <= n <= max_batch``, on the instance's
device and returns the output tensor. One small interface, as Triton's backend API and ONNX Runtime's
execution providers have one, with the choice a configuration value (apps.yaml ``engine:``):

- :meth:`Engine.check` (a class method, no build, no torch): can this kind run on this backend with
  these options? Raises :class:`EngineUnavailable` with the reason. The node calls it at ``validate``
  and ``start``, so a GPU-only engine on the cpu backend is refused before anything starts.
- :meth:`Engine.prepare`: build the artefact, or take it from the cache (:mod:`gpuprims.engines.cache`),
  and load it. Never on the serving path: an instance calls it at start or in a shadow's pre-warm.
- :meth:`Engine.run`: one batch, on the engine's device, to its output tensor. The instance's run seam
  (``gpuprims.gather.ModelRunner``) calls it, so on CUDA Sync-lite waits on an event recorded after it.
- :meth:`Engine.static_input`: the device buffer the engine reads its input from, if it has one (a CUDA
  graph's captured input, a TensorRT binding). GPU-DMA gathers straight into it, so a request goes pool ->
  kernel -> engine with no copy.
- :meth:`Engine.describe`: what status shows (kind, options, fingerprint, cache hit, build time...).

Importing this module imports neither torch nor any engine library: the node validates ``engine:``
without them. Engine modules import their libraries lazily for the same reason.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gpuprims.engines.errors import EngineError, EngineUnavailable, ExportError
from gpuprims.engines.kinds import BACKENDS, ENGINE_KINDS, EngineKind, engine_kind

__all__ = ["BACKENDS", "KINDS", "BuildInfo", "Engine", "EngineError", "EngineUnavailable", "ExportError",
           "ModelSource", "Progress", "Target", "check_engine", "engine_class", "make_engine"]

#: Every kind an app's ``engine:`` may name: the kinds table (:data:`gpuprims.engines.kinds.ENGINE_KINDS`).
KINDS: dict[str, EngineKind] = ENGINE_KINDS

#: progress(message, fraction or None): how a long build says how far it is (log, status, progress bar).
Progress = Callable[[str, "float | None"], None]


@dataclass(frozen=True)
class ModelSource:
    """What an engine is built from: the app's model and the inputs it will be given.

    ``model`` is a zoo name or ``package.module:factory`` (``apps.zoo.load_model``); the zoo's weights are
    deterministic from (name, seed, num_classes, input_shape), so a zoo model's identity is those and the
    zoo's code; a user model's identity includes a digest of its weights.
    """

    model: str
    input_shape: tuple[int, int, int]
    max_batch: int
    seed: int = 0
    num_classes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise EngineError(f"model must be a zoo name or 'package.module:factory', got {self.model!r}")
        shape = tuple(self.input_shape)
        if len(shape) != 3 or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
            raise EngineError(f"input_shape must be three positive integers (C, H, W), got {self.input_shape!r}")
        object.__setattr__(self, "input_shape", shape)
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise EngineError(f"max_batch must be an integer >= 1, got {self.max_batch!r}")

    @property
    def is_zoo(self) -> bool:
        return ":" not in self.model

    def build_module(self, device: Any = "cpu") -> Any:
        """The model as an eval-mode ``torch.nn.Module`` on ``device`` (``apps.zoo.load_model``)."""
        from apps.zoo import load_model

        return load_model(self.model, seed=self.seed, num_classes=self.num_classes,
                          input_shape=self.input_shape).to(device).eval()


@dataclass(frozen=True)
class Target:
    """Where an engine runs: the backend, the device, the CPU threads the app's share gives it (never
    more), and on CUDA the instance's stream (the one GPU-DMA gathers on and Sync-lite waits on)."""

    backend: str = "cpu"
    device_index: int = 0
    threads: int | None = None
    stream: Any = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise EngineError(f"backend must be one of {BACKENDS} (resolve 'auto' first), got {self.backend!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise EngineError(f"threads must be an integer >= 1 or None, got {self.threads!r}")


@dataclass
class BuildInfo:
    """What :meth:`Engine.prepare` did: built or taken from the cache, how long it took, and where."""

    fingerprint: str | None = None
    cache_hit: bool = False
    build_ms: float = 0.0
    load_ms: float = 0.0
    artefact: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "cache_hit": self.cache_hit, "build_ms": round(self.build_ms, 1),
                "load_ms": round(self.load_ms, 1), "artefact": self.artefact, **self.extra}


def check_batch(kind: str, x: Any, source: ModelSource) -> int:
    """The rows of `x`; refuses, by name, a batch that is not ``(n, C, H, W)`` with 1 <= n <= max_batch."""
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 4 or shape[1:] != source.input_shape or not 1 <= shape[0] <= source.max_batch:
        raise EngineError(f"engine {kind!r} takes (n, {', '.join(map(str, source.input_shape))}) with "
                          f"1 <= n <= {source.max_batch}, got {shape or type(x).__name__}")
    return int(shape[0])


class KindOptions:
    """What an engine class and a file engine class (:class:`gpuprims.engines.files.FileEngine`) share:
    their kind's row of the kinds table (:attr:`spec`), or else :attr:`backends` and
    :attr:`option_defaults` set by the class itself, and the checks of a configuration against them."""

    kind: ClassVar[str] = ""
    #: The kind's row of the kinds table: its options, their checks and its backends, written once there.
    spec: ClassVar[EngineKind | None] = None
    backends: ClassVar[tuple[str, ...]] = BACKENDS
    #: Every option this kind takes, with its default: anything else is refused by name.
    option_defaults: ClassVar[Mapping[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "spec" in cls.__dict__ and cls.spec is not None:
            cls.backends = cls.spec.backends
            cls.option_defaults = cls.spec.options

    @classmethod
    def validate_options(cls, options: Mapping[str, Any] | None) -> dict[str, Any]:
        """The options with defaults filled in; unknown keys and bad values are refused by name."""
        if cls.spec is not None:
            return cls.spec.validate_options(options)
        options = dict(options or {})
        unknown = sorted(set(options) - set(cls.option_defaults))
        if unknown:
            allowed = ", ".join(sorted(cls.option_defaults)) or "none"
            raise EngineError(f"engine {cls.kind!r} has no option(s) {unknown} (it takes: {allowed})")
        return {**cls.option_defaults, **options}

    @classmethod
    def check(cls, backend: str, options: Mapping[str, Any] | None = None) -> None:
        """Raise :class:`EngineUnavailable` when this kind cannot run on ``backend`` (or its library is
        missing), :class:`EngineError` for bad options. Builds nothing and imports no engine library."""
        if cls.spec is not None:
            cls.spec.check(backend, options)
            return
        if backend not in cls.backends:
            raise EngineUnavailable(f"engine {cls.kind!r} needs the {' or '.join(cls.backends)} backend; "
                                    f"this node runs on {backend}")
        cls.validate_options(options)


class Engine(KindOptions, abc.ABC):
    """One model on one device behind the run seam (see the module docstring).

    Subclasses set :attr:`kind` and :attr:`spec` (their row of :data:`~gpuprims.engines.kinds.ENGINE_KINDS`,
    which gives :attr:`backends`, :attr:`option_defaults` and the option checks), or else :attr:`backends` and
    :attr:`option_defaults` themselves (a custom engine), and :attr:`tolerance`, and implement
    :meth:`_prepare` and :meth:`run`.
    """

    #: (rtol, atol) within which this engine's float32 outputs equal eager's on every zoo model it supports.
    tolerance: ClassVar[tuple[float, float]] = (1e-4, 1e-4)
    #: Whether the engine runs on the torch module's own weights (so Param-Share applies to it).
    uses_torch_weights: ClassVar[bool] = False
    #: Whether run() only enqueues on Target.stream and returns (a CUDA graph, TensorRT): the run seam
    #: then calls it on the host thread and waits on an event recorded after it (Sync-lite).
    asynchronous: ClassVar[bool] = False

    def __init__(self, source: ModelSource, target: Target, options: Mapping[str, Any] | None = None, *,
                 cache: Any = None) -> None:
        # cache: a gpuprims.engines.cache.EngineCache (typed Any: the cache module imports this one).
        self.check(target.backend, options)
        self.source = source
        self.target = target
        self.options = self.validate_options(options)
        self.cache = cache
        self.info = BuildInfo()
        self.prepared = False

    # -- life cycle --------------------------------------------------------------------------------------
    def prepare(self, module: Any = None, progress: Progress | None = None) -> BuildInfo:
        """Build (or take from the cache) and load; returns what happened. ``module``: the model already
        built on the target device (Param-Share's mapped weights), which engines that run on torch weights
        use instead of building their own; others may export from it. Idempotent."""
        if self.prepared:
            return self.info
        t0 = time.perf_counter()
        self._prepare(module, progress)
        self.prepared = True
        if not self.info.build_ms and not self.info.load_ms:
            self.info.load_ms = (time.perf_counter() - t0) * 1e3
        return self.info

    @abc.abstractmethod
    def _prepare(self, module: Any, progress: Progress | None) -> None:
        """Build or load the artefact and make :meth:`run` ready; fill ``self.info``."""

    @abc.abstractmethod
    def run(self, x: Any) -> Any:
        """Run one float32 batch ``(n, C, H, W)`` on the engine's device; returns the output tensor."""

    def __call__(self, x: Any) -> Any:
        return self.run(x)

    def static_input(self) -> Any:
        """The device buffer ``(max_batch, C, H, W)`` this engine reads its input from, or None when it
        takes any tensor. GPU-DMA gathers into it, so the request needs no copy."""
        return None

    def describe(self) -> dict[str, Any]:
        """What status shows about this engine."""
        return {"kind": self.kind, "options": dict(self.options), "backend": self.target.backend,
                "prepared": self.prepared, "param_share": self.uses_torch_weights, **self.info.to_dict()}

    def close(self) -> None:
        """Release what the engine holds (sessions, graphs, device memory). Idempotent; subclasses that
        hold something release it and call this."""
        self.prepared = False

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def engine_class(kind: str) -> type[Engine]:
    """The class implementing ``kind`` (its module imported now); raises :class:`EngineError` naming the
    known kinds."""
    return engine_kind(kind).load()  # type: ignore[no-any-return]


def check_engine(kind: str, backend: str, options: Mapping[str, Any] | None = None) -> None:
    """Validate an app's ``engine:`` and its options for ``backend`` without building anything or
    importing the engine's module (:data:`~gpuprims.engines.kinds.ENGINE_KINDS`)."""
    engine_kind(kind).check(backend, options)


def make_engine(kind: str, source: ModelSource, target: Target, options: Mapping[str, Any] | None = None, *,
                cache: Any = None) -> Engine:
    """An unprepared engine of ``kind`` (call :meth:`Engine.prepare` before :meth:`Engine.run`)."""
    return engine_class(kind)(source, target, options, cache=cache)
