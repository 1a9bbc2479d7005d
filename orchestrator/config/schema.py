"""The apps.yaml schema: what a node runs, validated before anything starts.

`load_config(path)` reads one YAML file and returns a frozen `NodeConfig`, or raises `ConfigError`
whose message names the file, the key path (``apps[1].slo_ms``) and what is wrong, one line per
problem. YAML syntax errors carry the line and column. Every model forbids unknown keys and takes
values strictly (a quoted ``"5"`` is not an int; ``true`` is not a number).

``docs/apps-yaml.md`` is the reference of every key; ``examples/apps.yaml`` is a small CPU example.
What the machine offers (cores, free memory) is read in ``orchestrator.config.host``, never here; the
loader checks apps with ``overflow: cpu`` against it.
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import re
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from gpuprims.engines import EngineError, check_engine
from gpuprims.engines.files import resolve_file_kind
from gpuprims.engines.kinds import engine_kind, file_engine_kind
from gpuprims.modelrepo import ModelConfig
from orchestrator.config import model_files
from orchestrator.config.host import HostResources
from orchestrator.config.model_files import MODEL_FILE_SUFFIXES, is_model_file

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "AppConfig",
    "ConfigError",
    "EngineChoice",
    "FileModel",
    "HostResources",
    "ListenConfig",
    "NodeConfig",
    "NodeSettings",
    "PoolConfig",
    "RepositoryConfig",
    "StageConfig",
    "UnavailableModel",
    "engine_problems",
    "load_config",
    "parse_config",
]

#: Payload bytes per datagram, as in the paper (wire.DEFAULT_CHUNK_PAYLOAD).
DEFAULT_MAX_PAYLOAD = 1024
#: Largest UDP/IPv4 payload less the 48-byte wire header (wire.MAX_DATAGRAM_PAYLOAD).
_MAX_DATAGRAM_PAYLOAD = 65507 - 48
_DTYPE_SIZE = {"float32": 4, "uint8": 1}
_NAME_RE = re.compile(r"^[a-z0-9_-]{1,64}$")
_ZOO_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_USER_MODEL_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
_ERROR_TYPE = "gpuprims_config"


class ConfigError(ValueError):
    """An apps.yaml that cannot run. ``problems`` holds (key path, what is wrong) pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = list(problems)
        lines = [f"{source}: {key}: {what}" if key else f"{source}: {what}" for key, what in self.problems]
        n = len(self.problems)
        head = f"invalid config {source} ({n} problem{'s' if n != 1 else ''}):"
        super().__init__("\n  ".join([head, *lines]) if n > 1 else lines[0] if lines else head)

    def __reduce__(self) -> tuple[type, tuple[str, list[tuple[str, str]]]]:
        return (type(self), (self.source, self.problems))


def _problem(key: str, msg: str) -> PydanticCustomError:
    """A validation error whose key path (relative to the model raising it) travels in its context."""
    return _problems([(key, msg)])


def _problems(items: list[tuple[str, str]]) -> PydanticCustomError:
    """One validation error carrying several (relative key path, message) problems."""
    return PydanticCustomError(_ERROR_TYPE, "{msg}", {"msg": "; ".join(f"{k}: {m}" for k, m in items),
                                                       "items": items})


# ---- value types with their own messages (a PlainValidator keeps the key path clean of union tags)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pct_or_auto(v: Any) -> int | Literal["auto"]:
    if v == "auto":
        return "auto"
    if not _is_int(v):
        raise ValueError(f"must be an integer 1..100 or 'auto', got {v!r}")
    if not 1 <= v <= 100:
        raise ValueError(f"must be in 1..100 (percent of one GPU) or 'auto', got {v}")
    return int(v)


def _count_or_auto(v: Any) -> int | Literal["auto"]:
    if v == "auto":
        return "auto"
    if not _is_int(v):
        raise ValueError(f"must be an integer >= 1 or 'auto', got {v!r}")
    if v < 1:
        raise ValueError(f"must be >= 1 or 'auto', got {v}")
    return int(v)


def _ports(v: Any) -> tuple[int, ...]:
    items = v if isinstance(v, list | tuple) else [v]
    if not items:
        raise ValueError("must be a port or a non-empty list of ports")
    out: list[int] = []
    for p in items:
        if not _is_int(p) or not 0 <= p <= 65535:
            raise ValueError(f"ports must be integers in 0..65535 (0 = ephemeral), got {p!r}")
        if p in out and p != 0:
            raise ValueError(f"port {p} is listed twice")
        out.append(int(p))
    return tuple(out)


def _gpus(v: Any) -> tuple[int, ...] | Literal["all"]:
    if v == "all":
        return "all"
    if not isinstance(v, list | tuple) or not v:
        raise ValueError(f"must be 'all' or a non-empty list of device indices, got {v!r}")
    seen: list[int] = []
    for d in v:
        if not _is_int(d) or d < 0:
            raise ValueError(f"device indices must be integers >= 0, got {d!r}")
        if d in seen:
            raise ValueError(f"device {d} is listed twice")
        seen.append(int(d))
    return tuple(seen)


def _shape(v: Any) -> tuple[int, int, int]:
    if not isinstance(v, list | tuple) or len(v) != 3:
        raise ValueError(f"must be a list [C, H, W] of three positive integers, got {v!r}")
    if not all(_is_int(d) and d > 0 for d in v):
        raise ValueError(f"dimensions must be positive integers, got {list(v)!r}")
    return (int(v[0]), int(v[1]), int(v[2]))


def _metrics_port(v: Any) -> int:
    if v is None:
        return 0
    if not _is_int(v) or not 0 <= v <= 65535:
        raise ValueError(f"must be a port 1..65535, or 0 / null to disable, got {v!r}")
    return int(v)


def _service_port(v: Any) -> int:
    if v is None:
        return 0
    if not _is_int(v) or not 0 <= v <= 65535:
        raise ValueError(f"must be a TCP port 1..65535, or 0 / null to turn it off, got {v!r}")
    return int(v)


def _log_level(v: Any) -> str:
    levels = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    if not isinstance(v, str) or v.upper() not in levels:
        raise ValueError(f"must be one of {', '.join(levels)} (any case), got {v!r}")
    return v.upper()


def _model_ref(v: Any) -> str:
    if not isinstance(v, str) or not (_ZOO_RE.match(v) or _USER_MODEL_RE.match(v) or is_model_file(v)):
        raise ValueError(
            f"must be a zoo model name such as 'mobilenet_v2', a user model 'module:factory' or a model file "
            f"({', '.join(MODEL_FILE_SUFFIXES)}), got {v!r}")
    return v


def _stage_model_ref(v: Any) -> str:
    v = _model_ref(v)
    if is_model_file(v):
        raise ValueError(f"a DAG stage takes a zoo model or 'module:factory'; model files are served as apps "
                         f"of their own, got {v!r}")
    return v


class EngineChoice(BaseModel):
    """An app's (or stage's) ``engine:``: the kind (``gpuprims.engines.KINDS``) and its options. In YAML
    either a name (``engine: onnxruntime``) or a mapping with ``kind`` and the options
    (``engine: {kind: onnxruntime, provider: cpu}``)."""

    model_config = ConfigDict(frozen=True)

    kind: str = "eager"
    options: dict[str, Any] = Field(default_factory=dict)

    def to_yaml(self) -> str | dict[str, Any]:
        """The form the file had: the name alone when there are no options."""
        return {"kind": self.kind, **self.options} if self.options else self.kind


def _engine_ref(v: Any) -> EngineChoice:
    if isinstance(v, EngineChoice):
        return v
    if isinstance(v, str):
        kind, options = v, {}
    elif isinstance(v, dict):
        if not isinstance(v.get("kind"), str):
            raise ValueError(f"a mapping needs 'kind' (an engine name) beside its options, got {v!r}")
        kind, options = v["kind"], {k: o for k, o in v.items() if k != "kind"}
        if not all(isinstance(k, str) for k in options):
            raise ValueError(f"option names must be strings, got {list(options)!r}")
    else:
        raise ValueError(f"must be an engine name such as 'eager' or 'onnxruntime', or a mapping "
                         f"{{kind: NAME, option: value, ...}}, got {v!r}")
    try:
        engine_kind(kind).validate_options(options)  # the kind and its options (no engine module imported)
    except EngineError as e:
        # A kind that only runs model files (torchscript, torch_export), or a file kind's own options: the
        # app checks it against its model (AppConfig._check).
        try:
            file_engine_kind(kind).validate_options(options)
        except EngineError:
            raise ValueError(str(e)) from None
    return EngineChoice(kind=kind, options=options)


#: ``shadow:`` of an app: ``warm`` keeps a shadow ready for the next change; ``cold`` keeps none, and a
#: change starts one then (still overlapped: the old active serves until it is ready). YAML true and
#: false are ``warm`` and ``cold`` (what false always did).
SHADOW_MODES = ("warm", "cold")


def _shadow(v: Any) -> str:
    if isinstance(v, bool):
        return "warm" if v else "cold"
    if v not in SHADOW_MODES:
        raise ValueError(f"must be warm, cold, true (warm) or false (cold), got {v!r}")
    return str(v)


def _plain(v: Any) -> Any:
    # Serialise validated tuples as lists (JSON arrays); a PlainValidator has no serialiser of its own.
    return list(v) if isinstance(v, tuple) else v


_AS_PLAIN = PlainSerializer(_plain, return_type=Any)

def _name(v: Any) -> str:
    if not isinstance(v, str) or not _NAME_RE.match(v):
        raise ValueError(f"must be 1-64 characters of [a-z0-9_-], got {v!r}")
    return v


PctOrAuto = Annotated[int | Literal["auto"], PlainValidator(_pct_or_auto)]
CountOrAuto = Annotated[int | Literal["auto"], PlainValidator(_count_or_auto)]
Ports = Annotated[tuple[int, ...], PlainValidator(_ports), _AS_PLAIN]
Gpus = Annotated[tuple[int, ...] | Literal["all"], PlainValidator(_gpus), _AS_PLAIN]
Shape = Annotated[tuple[int, int, int], PlainValidator(_shape), _AS_PLAIN]
MetricsPort = Annotated[int, PlainValidator(_metrics_port)]
ServicePort = Annotated[int, PlainValidator(_service_port)]
LogLevel = Annotated[str, PlainValidator(_log_level)]
ModelRef = Annotated[str, PlainValidator(_model_ref)]
StageModelRef = Annotated[str, PlainValidator(_stage_model_ref)]
Name = Annotated[str, PlainValidator(_name)]  # an app's or a stage's
ShadowMode = Annotated[Literal["warm", "cold"], PlainValidator(_shadow)]
EngineRef = Annotated[EngineChoice, PlainValidator(_engine_ref),
                      PlainSerializer(lambda v: v.to_yaml(), return_type=Any)]

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=False)


class ListenConfig(BaseModel):
    """Where the UDP ingest listens: one host, one or more ports."""

    model_config = _STRICT

    host: str = "127.0.0.1"
    port: Ports = (9000,)

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v):
            raise ValueError(f"must be an IP address or host name, got {v!r}")
        return v

    @property
    def ports(self) -> tuple[int, ...]:
        """The listen ports, always as a tuple."""
        return self.port


class PoolConfig(BaseModel):
    """The shared packet pool the ingest writes into and app instances read from."""

    model_config = _STRICT

    slot_count: int = Field(32768, ge=1, le=1 << 24)
    record_count: int = Field(1024, ge=1, le=1 << 20)
    max_payload: int = Field(DEFAULT_MAX_PAYLOAD, ge=1, le=_MAX_DATAGRAM_PAYLOAD)
    max_chunks: int = Field(1024, ge=1, le=1 << 20)
    #: Each instance's answer ring (KiB, a power of two): results wait there for the ingest to send
    #: them; one result may take at most half of it.
    answer_ring_kb: int = Field(1024, ge=4, le=262144)

    @model_validator(mode="after")
    def _fits(self) -> PoolConfig:
        if self.answer_ring_kb & (self.answer_ring_kb - 1):
            raise _problem("answer_ring_kb", f"must be a power of two (KiB), got {self.answer_ring_kb}")
        if self.max_chunks > self.slot_count:
            raise _problem("max_chunks", f"{self.max_chunks} chunks per request do not fit a pool of "
                                         f"slot_count={self.slot_count} slots")
        return self

    @property
    def max_request_bytes(self) -> int:
        """Largest request body the pool accepts, in bytes."""
        return self.max_chunks * self.max_payload


_LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


class TokenSource(BaseModel):
    """Where a bearer token is read when the node starts: the file ``token_file`` or the environment
    variable ``token_env`` (one of them, or neither: no token)."""

    model_config = _STRICT

    token_file: str | None = None
    token_env: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> TokenSource:
        if self.token_file is not None and self.token_env is not None:
            raise _problem("token_env", "give token_file or token_env, not both")
        for key in ("token_file", "token_env"):
            v = getattr(self, key)
            if v is not None and not v.strip():
                raise _problem(key, "must not be empty")
        return self

    @property
    def has_token(self) -> bool:
        return self.token_file is not None or self.token_env is not None


class RepositoryConfig(TokenSource):
    """``node.repository``: the OIP model-repository API (load/unload apps at run time) on the front door.

    Off unless ``enabled``. A load can name a user model (``module:factory``), code the node imports,
    so the API takes a bearer token (read from ``token_file`` or the environment variable
    ``token_env``); without one it is refused on any address but loopback (docs/oip.md)."""

    enabled: bool = False


class TlsConfig(BaseModel):
    """``node.tls``: the front door serves HTTPS and gRPC over TLS with the PEM certificate (chain)
    ``cert`` and its private key ``key``; with ``ca`` it also requires a client certificate signed by
    that CA (mutual TLS). The files are read when the node starts (docs/oip.md, "TLS and tokens")."""

    model_config = _STRICT

    cert: str
    key: str
    ca: str | None = None

    @field_validator("cert", "key", "ca")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must be a PEM file path")
        return v


class NodeSettings(BaseModel):
    """The ``node:`` section."""

    model_config = _STRICT

    listen: ListenConfig = ListenConfig()
    backend: Literal["auto", "cpu", "cuda"] = "auto"
    metrics_port: MetricsPort = 0
    # Open Inference Protocol front door (orchestrator/frontdoor) on listen.host; 0 = off.
    http_port: ServicePort = 0
    grpc_port: ServicePort = 0
    run_dir: str | None = None
    log_level: LogLevel = "INFO"
    log_format: Literal["json", "text"] = "text"
    pool: PoolConfig = PoolConfig()
    reassembly_timeout_ms: float = Field(100.0, gt=0, le=60_000)
    gpus: Gpus = "all"
    allow_oversubscribe: bool = False
    # CPU backend: the node's own threads run on the cores no instance holds, when there are any.
    pin_node_threads: bool = True
    mps: Literal["require", "best_effort", "off"] = "best_effort"
    scheduler: Literal["spatial", "spatiotemporal", "temporal"] = "spatial"
    round_ms: float = Field(30.0, gt=0, le=10_000)
    # Directory of profiles (gpuprims-profile output) that size apps whose instances/gpu_pct are auto.
    profiles: str | None = None
    # Supervision: an active instance that sends no heartbeat for this long is killed as hung (what it
    # holds is answered or requeued) and replaced; a change of share gives up a phase after change_timeout_s.
    hang_timeout_s: float = Field(30.0, gt=0, le=3600)
    change_timeout_s: float = Field(180.0, gt=0, le=3600)
    # After a change switches an app to its shadow, the next shadow of that app starts only this much
    # later: a process starting (interpreter, torch) beside the new active would take the cores it was
    # just given, at the moment it starts serving on them.
    shadow_settle_s: float = Field(10.0, ge=0, le=3600)
    # Monitoring and detection: change an app's GPU% when it is overloaded or under-uses its share.
    autoscale: bool = True
    # CPU co-execution: cores no overflow pool may take (the ingest loop and the orchestrator), and the
    # directory of CPU profiles (gpuprims-profile MODEL --device cpu) of the overflowing apps' models.
    overflow_reserved_cores: int = Field(1, ge=0, le=1024)
    overflow_profiles: str | None = None
    # Where engines (apps' ``engine:``) keep what they build; null: gpuprims.engines.default_root(), per user.
    engine_cache: str | None = None
    # The model-repository API on the front door (load/unload apps at run time; docs/oip.md).
    repository: RepositoryConfig = RepositoryConfig()
    # The front door's TLS (HTTP and gRPC) and the bearer token inference calls must carry (docs/oip.md).
    tls: TlsConfig | None = None
    auth: TokenSource = TokenSource()
    # A Triton model repository (docs/apps-yaml.md, "Model files"): every model in it becomes an app, after
    # the apps listed under ``apps:``. ``model_control_mode`` as Triton's: none (serve every model),
    # explicit (only those in ``load_models``), poll (also look for new versions and changed files every
    # ``repository_poll_s``). ``repository_slo_ms`` is the SLO of a model whose config names none.
    model_repository: str | None = None
    model_control_mode: Literal["none", "explicit", "poll"] = "none"
    load_models: tuple[str, ...] = ()
    repository_poll_s: float = Field(15.0, gt=0, le=86_400)
    repository_slo_ms: float = Field(100.0, gt=0, le=3_600_000)
    # A fleet's routing table (http://host:routes_port of agents; docs/fleet.md): the front door forwards a
    # request for an app this node does not host to its owner over the wire format. A fleet's agent sets it.
    fleet_routes: tuple[str, ...] = ()

    @field_validator("mps", mode="before")
    @classmethod
    def _mps_off(cls, v: Any) -> Any:
        # YAML reads a bare `off` as false: `mps: off` means what it says.
        return "off" if v is False else v

    @field_validator("run_dir", "engine_cache")
    @classmethod
    def _run_dir(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must be a directory path or null")
        return v

    @model_validator(mode="after")
    def _distinct_tcp_ports(self) -> NodeSettings:
        seen: dict[int, str] = {}
        for key in ("metrics_port", "http_port", "grpc_port"):
            port = getattr(self, key)
            if port and port in seen:
                raise _problem(key, f"port {port} is also node.{seen[port]}; each TCP service needs its own port")
            seen.setdefault(port, key)
        return self

    @field_validator("fleet_routes", "load_models", mode="before")
    @classmethod
    def _fleet_routes_list(cls, v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v

    @model_validator(mode="after")
    def _model_control(self) -> NodeSettings:
        if self.model_repository is None:
            if self.model_control_mode != "none":
                raise _problem("model_control_mode", "applies only with node.model_repository")
            if self.load_models:
                raise _problem("load_models", "applies only with node.model_repository")
        if self.load_models and self.model_control_mode != "explicit":
            raise _problem("load_models", "names the models to load in model_control_mode: explicit")
        return self

    @field_validator("fleet_routes")
    @classmethod
    def _fleet_routes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for url in v:
            if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
                raise ValueError(f"{url!r} is not a routes URL (http://host:routes_port of a fleet agent)")
        return v

    @model_validator(mode="after")
    def _forwarding_needs_a_front_door(self) -> NodeSettings:
        if self.fleet_routes and not (self.http_port or self.grpc_port):
            raise _problem("fleet_routes", "forwarding is done by the OIP front door; set node.http_port or grpc_port")
        return self

    @model_validator(mode="after")
    def _repository_guarded(self) -> NodeSettings:
        r = self.repository
        if r.enabled and not self.http_port:
            raise _problem("repository.enabled", "the repository API is served by the HTTP front door; set "
                                                 "node.http_port")
        if r.enabled and not r.has_token and not is_loopback(self.listen.host):
            raise _problem("repository", f"the repository API loads code into the node; on "
                                         f"{self.listen.host!r} (not loopback) it needs token_file or token_env")
        return self

    @model_validator(mode="after")
    def _security_needs_a_front_door(self) -> NodeSettings:
        for key, on in (("tls", self.tls is not None), ("auth", self.auth.has_token)):
            if on and not self.frontdoor_enabled:
                raise _problem(key, "applies to the OIP front door; set node.http_port or grpc_port")
        return self

    @property
    def frontdoor_enabled(self) -> bool:
        """True when the OIP front door serves HTTP or gRPC."""
        return bool(self.http_port or self.grpc_port)

    @property
    def metrics_enabled(self) -> bool:
        """True when a Prometheus endpoint should be served."""
        return self.metrics_port != 0

    @property
    def default_gpu(self) -> int:
        """The device an app without ``gpu`` lands on: the first listed, or 0 with ``gpus: all``."""
        return 0 if self.gpus == "all" else self.gpus[0]


class QueuePolicyConfig(BaseModel):
    """``admission.default_queue_policy`` of an app: Triton's ``ModelQueuePolicy`` (docs/oip.md, "Admission")."""

    model_config = _STRICT

    max_queue_size: int = Field(0, ge=0, le=2**31 - 1)
    default_timeout_microseconds: int = Field(0, ge=0, le=2**32 - 1)
    timeout_action: Literal["REJECT", "DELAY"] = "REJECT"
    allow_timeout_override: bool = False


class AdmissionConfig(BaseModel):
    """``admission:`` of an app: the front door's queue policy and priority levels, as Triton's
    ``dynamic_batching`` names them, and the HTTP code of a refusal (503, or 429). A model file's
    config.pbtxt ``dynamic_batching`` gives the same keys; this section, where given, overrides them."""

    model_config = _STRICT

    default_queue_policy: QueuePolicyConfig = QueuePolicyConfig()
    priority_levels: int = Field(0, ge=0, le=255)
    default_priority_level: int = Field(0, ge=0, le=255)
    refuse_status: Literal[503, 429] = 503

    @model_validator(mode="after")
    def _levels(self) -> AdmissionConfig:
        if self.priority_levels and not 1 <= self.default_priority_level <= self.priority_levels:
            raise _problem("default_priority_level", f"must be 1..{self.priority_levels} (priority_levels), "
                                                     f"got {self.default_priority_level}")
        if not self.priority_levels and self.default_priority_level:
            raise _problem("default_priority_level", "needs priority_levels")
        return self


class StageConfig(BaseModel):
    """One model of a DAG app; ``routes`` names the stages its output may go to."""

    model_config = _STRICT

    name: Name
    model: StageModelRef
    gpu_pct: PctOrAuto = "auto"
    routes: tuple[str, ...] = ()
    engine: EngineRef | None = None  # this stage's engine; the app's when not given

    @field_validator("routes", mode="before")
    @classmethod
    def _routes(cls, v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v


class FileModel(BaseModel):
    """The model file an app serves and its completed config.pbtxt (``gpuprims.modelrepo.ModelConfig``,
    carried as its JSON: the one message from the repository to the instance). Filled in by the loader
    from ``model: <file>`` (and ``config:``) or from ``node.model_repository``, never written in a file."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    path: str
    config_json: str
    version: int = Field(1, ge=0)
    fingerprint: str = ""
    repository: str | None = None

    @functools.cached_property
    def config(self) -> ModelConfig:
        return ModelConfig.from_json(self.config_json)

    def triton_json(self) -> dict[str, Any]:
        """The completed config in Triton's JSON form (GET /v2/models/<name>/config)."""
        return self.config.to_dict()


class UnavailableModel(BaseModel):
    """A model of ``node.model_repository`` that cannot be served, and why (the repository index says so)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str
    version: str = ""
    reason: str


class AppConfig(BaseModel):
    """One inference app (``apps:`` entry)."""

    model_config = _STRICT

    name: Name
    model: ModelRef | None = None
    seed: int = Field(0, ge=0, le=2**32 - 1)
    input_shape: Shape = (3, 224, 224)
    dtype: Literal["float32", "uint8"] = "float32"
    num_classes: int | None = Field(None, ge=1)
    slo_ms: float = Field(gt=0, le=3_600_000)
    gpu_pct: PctOrAuto = "auto"
    instances: CountOrAuto = 1
    max_batch: int = Field(8, ge=1, le=512)  # 512: the GPU-DMA gather's launch limit
    max_wait_ms: float = Field(2.0, ge=0)
    #: 0 only before NodeConfig assigns it; a loaded config always has 1..65535.
    app_id: int = Field(0, ge=1, le=65535)
    port: int | None = Field(None, ge=1, le=65535)
    gpu: int | None = Field(None, ge=0)
    stages: tuple[StageConfig, ...] | None = None
    shadow: ShadowMode = "warm"
    # CPU co-execution (SIR+): requests may overflow to a CPU instance on ``overflow_cores`` cores
    # when that finishes sooner (gpuprims.coexec.OverflowRouter; orchestrator/node/cpu_overflow.py).
    overflow: Literal["none", "cpu"] = "none"
    overflow_cores: int | None = Field(None, ge=1, le=1024)
    overflow_alpha_ms: float = Field(0.1, ge=0, le=1000)
    # The model runner (gpuprims.engines): eager (torch, the default), onnxruntime, compile, ... with
    # its options; the CPU overflow instance's may differ (default: the app's where it runs on the cpu
    # backend, else eager).
    engine: EngineRef = EngineChoice()
    overflow_engine: EngineRef | None = None
    # A model file's config.pbtxt keys as a mapping (``model: path/to/model.onnx``): they override what
    # the file says (inputs, outputs, max_batch_size, dynamic_batching, parameters...).
    config: dict[str, Any] | None = None
    # What the loader made of a model file (FileModel); None for a zoo or module:factory model.
    file: FileModel | None = None
    # The front door's admission: queue policy, priority levels, refusal code (docs/oip.md, "Admission").
    admission: AdmissionConfig | None = None

    @field_validator("stages", mode="before")
    @classmethod
    def _stages_list(cls, v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        if self.model is not None and is_model_file(self.model):
            for key in ("input_shape", "dtype", "num_classes", "seed"):
                # (a running app's config dumped and read again sets every key, at its default)
                if key in self.model_fields_set and getattr(self, key) != type(self).model_fields[key].default:
                    raise _problem(key, "a model file's inputs and outputs come from the file; override them "
                                        "under 'config' with config.pbtxt's keys (input, output, ...)")
            if self.overflow != "none":
                raise _problem("overflow", "CPU overflow does not take model files yet")
            try:
                file_engine_kind(resolve_file_kind(self.engine.kind, self.model)).validate_options(self.engine.options)
            except EngineError as e:
                raise _problem("engine", str(e)) from None
            if self.file is None:
                raise _problem("model", "a model file is read by load_config (its path is relative to the YAML "
                                        "file); this config was not")
        else:
            if self.config is not None:
                raise _problem("config", "applies only to a model file (model: path/to/model.onnx)")
            for key, eng in self.engines():
                try:
                    engine_kind(eng.kind).validate_options(eng.options)
                except EngineError as e:
                    raise _problem(key, f"{e} (a zoo or module:factory model; the file engines take model files)") \
                        from None
        if self.stages is None:
            if self.model is None:
                raise _problem("model", "is required (or give 'stages' for a DAG app)")
        else:
            if self.model is not None:
                raise _problem("model", "give either 'model' or 'stages', not both")
            if "gpu_pct" in self.model_fields_set and self.gpu_pct != "auto":
                raise _problem("gpu_pct", "a DAG app takes gpu_pct on each stage, not on the app")
            _check_dag(self.stages)
        if self.overflow == "none" and self.overflow_cores is not None:
            raise _problem("overflow_cores", "applies only with overflow: cpu")
        if self.overflow == "none" and self.overflow_engine is not None:
            raise _problem("overflow_engine", "applies only with overflow: cpu")
        if self.overflow_engine is not None:
            try:
                check_engine(self.overflow_engine.kind, "cpu", self.overflow_engine.options)
            except EngineError as e:
                raise _problem("overflow_engine", f"app {self.name!r}: {e} (the overflow instance runs on the cpu)") from None
        if self.max_wait_ms >= self.slo_ms:
            raise _problem("max_wait_ms", f"{self.max_wait_ms} ms batching wait leaves no time within "
                                          f"slo_ms={self.slo_ms}; it must be less than slo_ms")
        return self

    @property
    def input_nbytes(self) -> int:
        """Bytes of one request body: C x H x W x element size (a model file's: its inputs' bytes when
        every dimension is fixed, else 0: bounded only by the pool)."""
        if self.file is not None:
            sizes = [t.fixed_bytes() for t in self.file.config.signature.inputs]
            return 0 if any(b is None for b in sizes) else sum(b or 0 for b in sizes)
        return math.prod(self.input_shape) * _DTYPE_SIZE[self.dtype]

    def chunk_count(self, max_payload: int = DEFAULT_MAX_PAYLOAD) -> int:
        """Datagrams one request takes at ``max_payload`` bytes per datagram."""
        if max_payload < 1:
            raise ValueError(f"max_payload must be >= 1, got {max_payload}")
        return -(-self.input_nbytes // max_payload)

    @property
    def cpu_overflow_cores(self) -> int:
        """Cores of this app's CPU overflow pool: ``overflow_cores`` (1 if not given), 0 without overflow."""
        if self.overflow != "cpu":
            return 0
        return self.overflow_cores or 1

    @property
    def warm_shadow(self) -> bool:
        """True when the node keeps a shadow of the app ready (``shadow: warm``)."""
        return self.shadow == "warm"

    @property
    def is_dag(self) -> bool:
        """True for a multi-stage app."""
        return self.stages is not None

    def stage_engine(self, stage: StageConfig) -> EngineChoice:
        """A DAG stage's engine: its own ``engine:``, else the app's."""
        return stage.engine if stage.engine is not None else self.engine

    @property
    def cpu_overflow_engine(self) -> EngineChoice:
        """The engine of the CPU overflow instance: ``overflow_engine``, else the app's engine where it
        runs on the cpu backend, else eager."""
        if self.overflow_engine is not None:
            return self.overflow_engine
        try:
            check_engine(self.engine.kind, "cpu", self.engine.options)
        except EngineError:
            return EngineChoice()
        return self.engine

    def engines(self) -> list[tuple[str, EngineChoice]]:
        """(key path within the app, engine) of every engine the app's instances run on its backend."""
        if self.stages is None:
            return [("engine", self.engine)]
        return [(f"stages[{j}].engine" if st.engine is not None else "engine", self.stage_engine(st))
                for j, st in enumerate(self.stages)]

    def fixed_pct_per_instance(self) -> int:
        """GPU% one instance claims when fixed in the file (sum over stages for a DAG); 0 if auto."""
        if self.stages is not None:
            return sum(s.gpu_pct for s in self.stages if s.gpu_pct != "auto")
        return 0 if self.gpu_pct == "auto" else self.gpu_pct

    def entry_stages(self) -> tuple[str, ...]:
        """Names of the DAG stages no other stage routes to (where requests enter); () for one model."""
        if self.stages is None:
            return ()
        targets = {r for s in self.stages for r in s.routes}
        return tuple(s.name for s in self.stages if s.name not in targets)


def _check_dag(stages: tuple[StageConfig, ...]) -> None:
    if not stages:
        raise _problem("stages", "must list at least one stage")
    index: dict[str, int] = {}
    for i, s in enumerate(stages):
        if s.name in index:
            raise _problem(f"stages[{i}].name", f"duplicate stage name {s.name!r} "
                                                f"(also stages[{index[s.name]}])")
        index[s.name] = i
    for i, s in enumerate(stages):
        for r in s.routes:
            if r not in index:
                raise _problem(f"stages[{i}].routes", f"route to unknown stage {r!r} "
                                                      f"(stages: {', '.join(index)})")
    # Depth-first search with colours; the first back edge found is reported as the cycle.
    colour = dict.fromkeys(index, 0)
    graph = {s.name: s.routes for s in stages}

    def visit(n: str, path: list[str]) -> None:
        colour[n] = 1
        for m in graph[n]:
            if colour[m] == 1:
                cycle = [*path[path.index(m):], m] if m in path else [n, m]
                raise _problem(f"stages[{index[n]}].routes", f"routes form a cycle: {' -> '.join(cycle)}")
            if colour[m] == 0:
                visit(m, [*path, m])
        colour[n] = 2

    for s in stages:
        if colour[s.name] == 0:
            visit(s.name, [s.name])


class NodeConfig(BaseModel):
    """A whole apps.yaml: node settings plus the apps. App ids are always assigned."""

    model_config = _STRICT

    node: NodeSettings = NodeSettings()
    apps: tuple[AppConfig, ...]
    # The models of node.model_repository that cannot be served, with the reason (filled by the loader).
    unavailable: tuple[UnavailableModel, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _assign_app_ids(cls, data: Any) -> Any:
        # Defaults go to apps in file order, skipping ids other apps claim explicitly.
        if not isinstance(data, dict) or not isinstance(data.get("apps"), list | tuple):
            return data
        apps = list(data["apps"])

        def explicit(a: Any) -> Any:
            if isinstance(a, dict):
                return a.get("app_id")
            return a.app_id if isinstance(a, AppConfig) and a.app_id else None

        taken = {explicit(a) for a in apps if _is_int(explicit(a))}
        nxt = 1
        for i, a in enumerate(apps):
            if explicit(a) is not None:
                continue
            while nxt in taken:
                nxt += 1
            if isinstance(a, dict):
                apps[i] = {**a, "app_id": nxt}
            elif isinstance(a, AppConfig):
                apps[i] = a.model_copy(update={"app_id": nxt})
            else:
                continue
            taken.add(nxt)
        return {**data, "apps": apps}

    @field_validator("apps", "unavailable", mode="before")
    @classmethod
    def _apps_list(cls, v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v

    @model_validator(mode="after")
    def _cross_check(self) -> NodeConfig:
        problems = list(self._cross_problems())
        if problems:
            raise _problems(problems)
        return self

    def _cross_problems(self) -> Iterator[tuple[str, str]]:
        if not self.apps and not self.node.repository.enabled and self.node.model_repository is None:
            # A node whose apps come through the repository API (a fleet's agent) may start with none, and so
            # may one whose model repository has no model it can serve (each is listed as unavailable).
            yield ("apps", "must list at least one app (or enable node.repository to load them at run time, or "
                           "give node.model_repository)")
        first: dict[tuple[str, Any], int] = {}
        listen_ports = set(self.node.listen.ports)
        for i, a in enumerate(self.apps):
            for field in ("name", "app_id", "port"):
                value = getattr(a, field)
                if value is None:
                    continue
                j = first.setdefault((field, value), i)
                if j != i:
                    yield (f"apps[{i}].{field}", f"duplicate {field} {value!r} (also apps[{j}], "
                                                 f"{self.apps[j].name!r})")
            if a.port is not None and a.port in listen_ports:
                yield (f"apps[{i}].port", f"port {a.port} is also a node.listen port; an app's own port "
                                          "must differ from the shared listen ports")
            if a.gpu is not None and self.node.gpus != "all" and a.gpu not in self.node.gpus:
                yield (f"apps[{i}].gpu", f"device {a.gpu} is not in node.gpus {list(self.node.gpus)}")
            pool = self.node.pool
            if a.file is not None and self.node.scheduler != "spatial":
                yield (f"apps[{i}].model", f"node.scheduler {self.node.scheduler} does not take model files yet "
                                           "(each is served by its own instance's batching: scheduler spatial)")
            if a.input_nbytes > pool.max_request_bytes:
                yield (f"apps[{i}].input_shape",
                       f"a request of {list(a.input_shape)} {a.dtype} is {a.input_nbytes} bytes, more than "
                       f"node.pool.max_chunks * node.pool.max_payload = {pool.max_chunks} * "
                       f"{pool.max_payload} = {pool.max_request_bytes} bytes")
        if self.node.backend != "auto":
            yield from engine_problems(self, self.node.backend)
        # Under a live scheduler (spatiotemporal, temporal) shares may add up to more than 100: the
        # scheduler keeps the GPU% of what runs at any instant within 100.
        if not self.node.allow_oversubscribe and self.node.scheduler == "spatial":
            per_gpu: dict[int, list[tuple[str, int]]] = {}
            for a in self.apps:
                pct = a.fixed_pct_per_instance()
                if pct:
                    n = a.instances if a.instances != "auto" else 1
                    per_gpu.setdefault(self.gpu_of(a), []).append((a.name, pct * n))
            for dev, claims in sorted(per_gpu.items()):
                total = sum(p for _, p in claims)
                if total > 100:
                    parts = ", ".join(f"{name} {p}%" for name, p in claims)
                    yield ("apps", f"GPU {dev} is oversubscribed: gpu_pct x instances sums to {total}% > 100% "
                                   f"({parts}); lower them or set node.allow_oversubscribe: true")

    def app_by_id(self, app_id: int) -> AppConfig:
        """The app with this wire app id, or KeyError naming the known ids."""
        for a in self.apps:
            if a.app_id == app_id:
                return a
        raise KeyError(f"no app with app_id {app_id} (known: {sorted(a.app_id for a in self.apps)})")

    def app_by_name(self, name: str) -> AppConfig:
        """The app with this name, or KeyError naming the known apps."""
        for a in self.apps:
            if a.name == name:
                return a
        raise KeyError(f"no app named {name!r} (known: {', '.join(a.name for a in self.apps)})")

    def gpu_of(self, app: AppConfig) -> int:
        """The device index the app is placed on."""
        return self.node.default_gpu if app.gpu is None else app.gpu

    def chunks_for(self, app: AppConfig) -> int:
        """Datagrams one request of ``app`` takes with this node's pool payload size."""
        return app.chunk_count(self.node.pool.max_payload)


def engine_problems(cfg: NodeConfig, backend: str) -> list[tuple[str, str]]:
    """(key path, reason) for every app engine that cannot run on ``backend`` (the resolved one: a
    node with ``backend: auto`` is checked at start, once the backend is known). Builds nothing."""
    out: list[tuple[str, str]] = []
    for i, a in enumerate(cfg.apps):
        seen: set[str] = set()
        for key, eng in a.engines():
            try:
                if a.file is not None:
                    file_engine_kind(resolve_file_kind(eng.kind, a.file.path)).check(backend, eng.options)
                else:
                    check_engine(eng.kind, backend, eng.options)
            except EngineError as e:
                if key not in seen:
                    out.append((f"apps[{i}].{key}", f"app {a.name!r}: {e}"))
                    seen.add(key)
    return out


# ---- loading and error formatting


def _key_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _join_key(base: str, sub: str) -> str:
    if not sub:
        return base
    if not base:
        return sub
    return base + sub if sub.startswith("[") else f"{base}.{sub}"


def _allowed_keys(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str] | None:
    """The keys the model at ``loc`` (the parent of an unknown key) accepts."""
    current: type[BaseModel] = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = current.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        nested = next((t for t in _model_types(ann)), None)
        if nested is None:
            return None
        current = nested
    return list(current.model_fields)


def _model_types(ann: Any) -> Iterator[type[BaseModel]]:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        yield ann
        return
    for arg in getattr(ann, "__args__", ()) or ():
        yield from _model_types(arg)


_PLAIN_MESSAGES = {
    "tuple_type": "must be a list",
    "list_type": "must be a list",
    "model_type": "must be a mapping of keys to values",
    "model_attributes_type": "must be a mapping of keys to values",
    "dict_type": "must be a mapping of keys to values",
}


def _problems_from(err: ValidationError, model: type[BaseModel]) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for e in err.errors(include_url=False):
        loc = tuple(e["loc"])
        key = _key_path(loc)
        kind = e["type"]
        if kind == _ERROR_TYPE:
            ctx = e.get("ctx") or {}
            problems.extend((_join_key(key, str(sub)), str(msg)) for sub, msg in ctx.get("items", ()))
        elif kind == "extra_forbidden":
            allowed = _allowed_keys(model, loc[:-1]) or []
            name = str(loc[-1])
            hint = difflib.get_close_matches(name, allowed, n=1)
            msg = f"unknown key {name!r}"
            msg += f" (did you mean {hint[0]!r}?)" if hint else ""
            msg += f"; allowed: {', '.join(allowed)}" if allowed else ""
            problems.append((key, msg))
        elif kind == "missing":
            problems.append((key, "required key is missing"))
        else:
            msg = _PLAIN_MESSAGES.get(kind, e["msg"].removeprefix("Value error, "))
            got = e.get("input")
            if "got " not in msg and not isinstance(got, dict | list):
                msg += f", got {got!r:.80}"
            problems.append((key, msg))
    return problems


#: Share of the host's free memory the overflow pools may plan to take.
OVERFLOW_MEM_FRACTION = 0.8


def _zoo_model_mb(ref: str, input_shape: tuple[int, int, int], num_classes: int | None) -> float | None:
    """Parameter and buffer memory (MB) of a zoo model (meta build: nothing allocated); None for a user
    model or a name the zoo does not know (those are checked elsewhere)."""
    if ":" in ref:
        return None
    from apps.zoo.registry import build_model, model_info  # torch: imported only when overflow is asked for

    try:
        return model_info(build_model(ref, device="meta", input_shape=input_shape,
                                      num_classes=num_classes))["total_bytes"] / 2**20
    except ValueError:
        return None


def overflow_problems(cfg: NodeConfig, host: HostResources,
                      model_mb: Any = _zoo_model_mb) -> list[tuple[str, str]]:
    """Why the CPU overflow pools of ``cfg`` cannot fit ``host`` (empty when they fit).

    Cores: every app's ``overflow_cores`` together, plus ``node.overflow_reserved_cores``, must not
    exceed the host's cores. Memory: each overflow app holds one CPU copy of its model(s) plus
    ``max_batch`` requests in and out; together at most ``OVERFLOW_MEM_FRACTION`` of the free memory.
    ``model_mb(ref, input_shape, num_classes)`` sizes a model (None: unknown, not counted).
    """
    apps = [(i, a) for i, a in enumerate(cfg.apps) if a.overflow == "cpu"]
    if not apps:
        return []
    problems: list[tuple[str, str]] = []
    reserved = cfg.node.overflow_reserved_cores
    total = sum(a.cpu_overflow_cores for _, a in apps)
    if total + reserved > host.cores:
        parts = ", ".join(f"{a.name} {a.cpu_overflow_cores}" for _, a in apps)
        problems.append(("apps", f"CPU overflow pools need {total} cores ({parts}) plus "
                                 f"node.overflow_reserved_cores={reserved}, but this host has {host.cores}; "
                                 f"lower overflow_cores or turn overflow off for an app"))
    for i, a in apps:
        if a.cpu_overflow_cores + reserved > host.cores:
            problems.append((f"apps[{i}].overflow_cores",
                             f"{a.cpu_overflow_cores} cores plus node.overflow_reserved_cores={reserved} exceed "
                             f"the host's {host.cores}"))
    need = 0.0
    sized: list[str] = []
    for _, a in apps:
        refs = [a.model] if a.stages is None else [s.model for s in a.stages]
        mb = [model_mb(r, a.input_shape, a.num_classes) for r in refs if r is not None]
        known = [m for m in mb if m is not None]
        if known:
            io_mb = 2 * a.max_batch * a.input_nbytes / 2**20
            need += sum(known) + io_mb
            sized.append(f"{a.name} {sum(known) + io_mb:.0f} MB")
    budget = OVERFLOW_MEM_FRACTION * host.mem_available_mb
    if need > budget:
        problems.append(("apps", f"CPU overflow pools need {need:.0f} MB of host memory ({', '.join(sized)}), more "
                                 f"than {OVERFLOW_MEM_FRACTION:.0%} of the {host.mem_available_mb:.0f} MB available"))
    return problems


def _model_files(data: dict[str, Any], source: str, base_dir: Path | None, scan_repository: bool) -> dict[str, Any]:
    """``data`` with every model file read: an app whose ``model`` is a file (relative to ``base_dir``, the
    YAML file's directory) gets its ``file`` (the completed config, from the file and its ``config:``) and
    the app keys the config sets; every model of ``node.model_repository`` becomes an app after them, or
    an entry of ``unavailable`` with the reason. A file or config that cannot be read is a ConfigError
    naming the key (an app's) or the model (the repository's, which only that model pays for)."""
    apps = data.get("apps")
    node = data.get("node")
    repo = node.get("model_repository") if isinstance(node, dict) else None
    if not isinstance(apps, list | tuple) and repo is None:
        return data
    problems: list[tuple[str, str]] = []
    out_apps: list[Any] = []
    # A file's engine is picked for the backend the node names (cpu when it says auto: see docs/apps-yaml.md).
    backend = "cuda" if isinstance(node, dict) and node.get("backend") == "cuda" else "cpu"
    for i, a in enumerate(apps or []):
        if isinstance(a, dict) and a.get("file") is None and isinstance(a.get("model"), str) \
                and is_model_file(a["model"]):
            try:
                a = model_files.file_app(a, base_dir, backend)
            except model_files.ModelFileError as e:
                problems.append((f"apps[{i}].{e.key}", str(e)))
        out_apps.append(a)
    unavailable: list[dict[str, str]] = []
    if isinstance(repo, str) and scan_repository:
        mode = node.get("model_control_mode", "none") if isinstance(node, dict) else "none"
        load = node.get("load_models") or () if isinstance(node, dict) else ()
        slo = node.get("repository_slo_ms", 100.0) if isinstance(node, dict) else 100.0
        taken = {a.get("name") for a in out_apps if isinstance(a, dict)}
        root = Path(repo).expanduser()
        if not root.is_absolute() and base_dir is not None:
            root = base_dir / root
        try:
            found, bad = model_files.repository_apps(root, mode=str(mode), load=list(load), slo_ms=slo,
                                                     taken=taken, backend=backend)
        except model_files.ModelFileError as e:
            problems.append(("node.model_repository", str(e)))
            found, bad = [], []
        out_apps.extend(found)
        unavailable.extend(bad)
        data = {**data, "node": {**node, "model_repository": str(root.absolute())}}  # type: ignore[dict-item]
    if problems:
        raise ConfigError(source, problems)
    return {**data, "apps": out_apps, **({"unavailable": unavailable} if unavailable else {})}


def parse_config(data: Any, *, source: str = "<config>",
                 known_models: Collection[str] | None = None, host: HostResources | None = None,
                 base_dir: Path | None = None, scan_repository: bool = True) -> NodeConfig:
    """Validate an already-parsed mapping; ``source`` names it in errors. Model files (an app's
    ``model: <file>``, ``node.model_repository``) are read here; relative paths are taken from
    ``base_dir`` (the YAML file's directory; default: the working directory). An app whose ``file`` is
    given was read before (a running node's app); ``scan_repository`` off takes the apps as given without
    adding node.model_repository's (a node's running config checked again).

    With ``known_models`` (the zoo's names), a model that is neither one of them nor ``module:factory``
    is refused here instead of when the instance starts. Apps with ``overflow: cpu`` are checked
    against ``host`` (default: this machine, ``HostResources.probe()``): their CPU pools must fit
    its cores and memory (``overflow_problems``).
    """
    if data is None:
        raise ConfigError(source, [("", "the file is empty; it needs at least an 'apps:' list")])
    if not isinstance(data, dict):
        raise ConfigError(source, [("", f"the top level must be a mapping with 'node:' and 'apps:', "
                                        f"got {type(data).__name__}")])
    data = _model_files(data, source, base_dir, scan_repository)
    try:
        cfg = NodeConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(source, _problems_from(err, NodeConfig)) from None
    if known_models is not None:
        problems = []
        for i, a in enumerate(cfg.apps):
            if a.file is not None:
                continue
            refs = [("model", a.model)] if a.stages is None else [
                (f"stages[{j}].model", s.model) for j, s in enumerate(a.stages)]
            for key, ref in refs:
                if ref is not None and ":" not in ref and ref not in known_models:
                    hint = difflib.get_close_matches(ref, list(known_models), n=1)
                    problems.append((f"apps[{i}].{key}", f"unknown zoo model {ref!r}"
                                     + (f" (did you mean {hint[0]!r}?)" if hint else "")
                                     + f"; zoo: {', '.join(sorted(known_models))}"))
        if problems:
            raise ConfigError(source, problems)
    if any(a.overflow == "cpu" for a in cfg.apps):
        problems = overflow_problems(cfg, host or HostResources.probe())
        if problems:
            raise ConfigError(source, problems)
    return cfg


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML would keep the last silently)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key].start_mark.line + 1})", mark)
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_config(path: str | os.PathLike[str], *, known_models: Collection[str] | None = None,
                host: HostResources | None = None, node_overrides: dict[str, Any] | None = None) -> NodeConfig:
    """Read and validate one apps.yaml; raise ConfigError naming the file, key path and problem.
    ``node_overrides`` replace keys of its ``node:`` section (the command line's, such as
    ``model_repository``)."""
    p = Path(path)
    source = str(p)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(source, [("", "no such file")]) from None
    except IsADirectoryError:
        raise ConfigError(source, [("", "is a directory, not a YAML file")]) from None
    except PermissionError:
        raise ConfigError(source, [("", "permission denied")]) from None
    except UnicodeDecodeError as e:
        raise ConfigError(source, [("", f"not UTF-8 text ({e.reason} at byte {e.start})")]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        what = " ".join(str(x) for x in (e.context, e.problem) if x)
        raise ConfigError(source, [("", f"YAML syntax error at {where}: {what}")]) from None
    except yaml.YAMLError as e:
        raise ConfigError(source, [("", f"YAML error: {e}")]) from None
    if node_overrides and isinstance(data, dict):
        node = data.get("node") if isinstance(data.get("node"), dict) else {}
        data = {**data, "node": {**node, **node_overrides}}
    return parse_config(data, source=source, known_models=known_models, host=host, base_dir=p.parent.absolute())
