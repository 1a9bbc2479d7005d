"""Versioned JSON profile of one model: latency and memory over batch size x GPU%.

A profile holds one measured point for every (batch size, gpu_pct) pair of a full grid. Latency
between measured points is interpolated piecewise-linearly (bilinear on the grid); asking for a batch
size or GPU% outside the measured grid raises ``ValueError`` naming the model, the value and the
measured range, because extrapolating a latency curve past its knee is exactly the guess a
deadline-aware scheduler must not make.

File layout (``format_version`` 2; version 1 files, which lack the optional keys marked (v2), load
unchanged)::

    {"format_version": 2, "model": "resnet50", "source": "measured" | "paper" | "synthetic",
     "source_note": "...", "backend": "cpu" | "cuda", "device": "...",
     "versions": {"torch": "...", "gpuprims": "..."},
     "conditions": {"input_shape": [3, 224, 224], "dtype": "float32", "date": "...", "repeats": 20},
     "points": [{"batch_size": 1, "gpu_pct": 25, "latency_p50_ms": .., "latency_p99_ms": ..,
                 "peak_mem_mb": .., "throughput_rps": ..}, ...],
     "device_kind": "accelerator" | "cpu",                                              (v2, optional)
     "cpu_cores": 2,                                                                    (v2, optional)
     "stages": [{"name": "rnn", "deps": ["flatten"], "latency_ms": {"cpu": 0.4, "gpu": 6.4},
                 "out_mb": 0.0001, "mem_mb": 0.5, "source": "measured"}, ...]}                 (v2, optional)

Per-device latency model (CPU co-execution, ``gpuprims.coexec``): ``device_kind`` says which device
of a node the grid describes: the accelerator (its axis is GPU%) or the CPU overflow pool (its axis
is the share of ``cpu_cores`` cores). Absent (version 1), it follows ``backend``: ``cuda`` is the
accelerator, ``cpu`` the CPU. ``stages`` optionally break the model into operators or subgraphs with
a latency per device kind (``"gpu"`` for the accelerator, ``"cpu"``), the size of their output and
their accelerator memory, which is what the co-execution planners take (``Profile.task_graph``).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from gpuprims.coexec.graph import Task, TaskGraph

FORMAT_VERSION = 2

Stat = Literal["p50", "p99"]


class ProfileError(ValueError):
    """A profile file is missing, not JSON, or fails validation; the message names file and key."""


class ProfilePoint(BaseModel):
    """One measured (batch size, GPU%) point."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: int = Field(ge=1)
    gpu_pct: int = Field(ge=1, le=100)
    latency_p50_ms: float = Field(gt=0)
    latency_p99_ms: float = Field(gt=0)
    peak_mem_mb: float = Field(ge=0)
    throughput_rps: float = Field(ge=0)

    @model_validator(mode="after")
    def _p99_not_below_p50(self) -> ProfilePoint:
        if self.latency_p99_ms < self.latency_p50_ms:
            raise ValueError(f"latency_p99_ms {self.latency_p99_ms} < latency_p50_ms {self.latency_p50_ms}")
        return self


class StageEntry(BaseModel):
    """One operator or subgraph of the model with its latency on each device kind (v2)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    deps: tuple[str, ...] = ()
    latency_ms: dict[Literal["gpu", "cpu"], float] = Field(min_length=1)
    out_mb: float = Field(default=0.0, ge=0)
    mem_mb: float = Field(default=0.0, ge=0)
    source: str = ""

    @model_validator(mode="after")
    def _positive(self) -> StageEntry:
        bad = {d: v for d, v in self.latency_ms.items() if not v >= 0 or v != v or v == float("inf")}
        if bad:
            raise ValueError(f"stage {self.name!r}: latencies must be finite and >= 0, got {bad}")
        return self


class Conditions(BaseModel):
    """What the points were measured on: input shape (one sample), dtype, date, repeats per point."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input_shape: tuple[int, ...]
    dtype: str = "float32"
    date: str
    repeats: int | None = Field(default=None, ge=1)


class Profile(BaseModel):
    """A model's latency/memory profile over a full batch-size x GPU% grid (see module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Literal[1, 2] = FORMAT_VERSION
    model: str = Field(min_length=1)
    source: Literal["measured", "paper", "synthetic"]
    source_note: str = ""
    backend: Literal["cpu", "cuda"]
    device: str
    versions: dict[str, str] = Field(default_factory=dict)
    conditions: Conditions
    points: tuple[ProfilePoint, ...] = Field(min_length=1)
    device_kind: Literal["accelerator", "cpu"] | None = None
    cpu_cores: int | None = Field(default=None, ge=1)
    stages: tuple[StageEntry, ...] = ()
    _tables: dict[str, dict[tuple[int, int], float]] = PrivateAttr(default_factory=dict)
    _axes: dict[str, list[int]] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _full_grid(self) -> Profile:
        seen: set[tuple[int, int]] = set()
        for p in self.points:
            key = (p.batch_size, p.gpu_pct)
            if key in seen:
                raise ValueError(f"duplicate point batch_size={key[0]} gpu_pct={key[1]}")
            seen.add(key)
        batches = sorted({b for b, _ in seen})
        pcts = sorted({g for _, g in seen})
        missing = [(b, g) for b in batches for g in pcts if (b, g) not in seen]
        if missing:
            raise ValueError(f"points do not form a full grid; missing (batch_size, gpu_pct) {missing[:5]}")
        names = [st.name for st in self.stages]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate stage names {dup}")
        for st in self.stages:
            unknown = [d for d in st.deps if d not in names]
            if unknown:
                raise ValueError(f"stage {st.name!r} depends on unknown stages {unknown}")
        if self.format_version == 1 and (self.device_kind or self.cpu_cores or self.stages):
            raise ValueError("device_kind, cpu_cores and stages need format_version 2")
        # One canonical order (batch size, then GPU%), so equal profiles compare equal.
        object.__setattr__(self, "points", tuple(sorted(self.points, key=lambda p: (p.batch_size, p.gpu_pct))))
        return self

    def __eq__(self, other: object) -> bool:
        # Field values only: the interpolation cache is not part of a profile's identity.
        if not isinstance(other, Profile):
            return NotImplemented
        return self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash((self.model, self.points))

    # --- devices (v2) -----------------------------------------------------------------------------
    @property
    def kind(self) -> Literal["accelerator", "cpu"]:
        """The device this profile's grid describes (``device_kind``, else from ``backend``)."""
        if self.device_kind is not None:
            return self.device_kind
        return "accelerator" if self.backend == "cuda" else "cpu"

    def stage_latency_ms(self, stage: str, device: Literal["gpu", "cpu"]) -> float:
        """A stage's latency on a device kind; ValueError naming what is known otherwise."""
        for st in self.stages:
            if st.name == stage:
                if device not in st.latency_ms:
                    raise ValueError(f"model {self.model!r} stage {stage!r} has no {device} latency "
                                     f"(has {sorted(st.latency_ms)})")
                return st.latency_ms[device]
        raise ValueError(f"model {self.model!r} has no stage {stage!r} (stages: {[s.name for s in self.stages]})")

    def task_graph(self) -> TaskGraph:
        """The stages as a co-execution ``TaskGraph``; ValueError if the profile has none."""
        if not self.stages:
            raise ValueError(f"model {self.model!r}: the profile has no stages (measure with --stages)")
        return TaskGraph(tuple(Task(st.name, dict(st.latency_ms), st.deps, st.out_mb, st.mem_mb)
                               for st in self.stages))

    # --- grid accessors -------------------------------------------------------------------------
    @property
    def batch_sizes(self) -> list[int]:
        """Measured batch sizes, ascending."""
        if "batch_sizes" not in self._axes:
            self._axes["batch_sizes"] = sorted({p.batch_size for p in self.points})
        return list(self._axes["batch_sizes"])

    @property
    def gpu_pcts(self) -> list[int]:
        """Measured GPU percentages, ascending."""
        if "gpu_pcts" not in self._axes:
            self._axes["gpu_pcts"] = sorted({p.gpu_pct for p in self.points})
        return list(self._axes["gpu_pcts"])

    def point(self, batch_size: int, gpu_pct: int) -> ProfilePoint:
        """The measured point at exactly (batch_size, gpu_pct); ValueError if it was not measured."""
        for p in self.points:
            if p.batch_size == batch_size and p.gpu_pct == gpu_pct:
                return p
        raise ValueError(f"model {self.model!r}: no measured point at batch_size={batch_size} "
                         f"gpu_pct={gpu_pct} (batches {self.batch_sizes}, gpu_pcts {self.gpu_pcts})")

    def covers(self, batch_size: float, gpu_pct: float) -> bool:
        """True if (batch_size, gpu_pct) lies inside the measured grid (interpolation is defined)."""
        b, g = self.batch_sizes, self.gpu_pcts
        return b[0] <= batch_size <= b[-1] and g[0] <= gpu_pct <= g[-1]

    def latency_ms(self, batch_size: float, gpu_pct: float, *, stat: Stat = "p50") -> float:
        """Latency in ms at (batch_size, gpu_pct), bilinear between the measured grid points.

        Raises ValueError naming the model, the value and the measured range when the request lies
        outside the grid, and for an unknown ``stat``.
        """
        if stat not in _STAT_FIELDS:
            raise ValueError(f"stat must be 'p50' or 'p99', got {stat!r}")
        return self._interp(batch_size, gpu_pct, _STAT_FIELDS[stat])

    def peak_mem_mb(self, batch_size: float, gpu_pct: float) -> float:
        """Peak memory in MB at (batch_size, gpu_pct), interpolated like ``latency_ms``."""
        return self._interp(batch_size, gpu_pct, "peak_mem_mb")

    def _interp(self, batch_size: float, gpu_pct: float, field: str) -> float:
        bs, gs = self.batch_sizes, self.gpu_pcts
        if not bs[0] <= batch_size <= bs[-1]:
            raise ValueError(f"model {self.model!r}: batch_size {batch_size} is outside the measured "
                             f"range [{bs[0]}, {bs[-1]}]")
        if not gs[0] <= gpu_pct <= gs[-1]:
            raise ValueError(f"model {self.model!r}: gpu_pct {gpu_pct} is outside the measured "
                             f"range [{gs[0]}, {gs[-1]}]")
        table = self._table(field)
        b0, b1, tb = _bracket(bs, batch_size)
        g0, g1, tg = _bracket(gs, gpu_pct)
        lo = table[(b0, g0)] * (1 - tg) + table[(b0, g1)] * tg
        hi = table[(b1, g0)] * (1 - tg) + table[(b1, g1)] * tg
        return lo * (1 - tb) + hi * tb

    def _table(self, field: str) -> dict[tuple[int, int], float]:
        if field not in self._tables:
            self._tables[field] = {(p.batch_size, p.gpu_pct): float(getattr(p, field)) for p in self.points}
        return self._tables[field]


_STAT_FIELDS = {"p50": "latency_p50_ms", "p99": "latency_p99_ms"}


def _bracket(grid: list[int], x: float) -> tuple[int, int, float]:
    """Grid neighbours (lo, hi) of x and the weight of hi; x must lie within the grid."""
    i = bisect.bisect_left(grid, x)
    if i < len(grid) and grid[i] == x:
        return grid[i], grid[i], 0.0
    lo, hi = grid[i - 1], grid[i]
    return lo, hi, (x - lo) / (hi - lo)


def with_stages(profile: Profile, stages: Iterable[StageEntry | Mapping[str, object]], *,
                device_kind: Literal["accelerator", "cpu"] | None = None, cpu_cores: int | None = None) -> Profile:
    """A version 2 copy of ``profile`` carrying ``stages`` (and the device fields when given)."""
    data = profile.model_dump()
    data.update(format_version=2, stages=[dict(s) if isinstance(s, Mapping) else s.model_dump() for s in stages])
    if device_kind is not None:
        data["device_kind"] = device_kind
    if cpu_cores is not None:
        data["cpu_cores"] = cpu_cores
    return profile_from_dict(data, origin=f"profile of {profile.model!r}")


def merge_stage_latencies(base: Profile, other: Profile) -> Profile:
    """``base`` with each stage's latencies on ``other``'s devices added (same stage names required).

    This is how a node joins its accelerator profile and its CPU profile into one per-device model.
    """
    theirs = {s.name: s for s in other.stages}
    missing = [s.name for s in base.stages if s.name not in theirs]
    if missing or len(theirs) != len(base.stages):
        raise ValueError(f"stages differ: {base.model!r} has {[s.name for s in base.stages]}, "
                         f"{other.model!r} has {sorted(theirs)}")
    merged = [s.model_copy(update={"latency_ms": {**s.latency_ms, **theirs[s.name].latency_ms}}) for s in base.stages]
    return with_stages(base, merged)


def profile_from_dict(data: Mapping[str, object], *, origin: str = "<dict>") -> Profile:
    """Validate a decoded profile; ProfileError names ``origin`` and each bad key."""
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or '<root>'}: {err['msg']}" for err in e.errors()
        )
        raise ProfileError(f"{origin}: invalid profile: {problems}") from None


def load_profile(path: str | Path) -> Profile:
    """Read and validate one profile file; ProfileError names the file and the offending key."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ProfileError(f"{p}: cannot read profile: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{p}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{p}: a profile must be a JSON object, got {type(data).__name__}")
    return profile_from_dict(data, origin=str(p))


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Write ``profile`` as indented JSON (points sorted by batch size, then GPU%); returns the path."""
    p = Path(path)
    doc = profile.model_dump(mode="json")
    doc["points"] = sorted(doc["points"], key=lambda x: (x["batch_size"], x["gpu_pct"]))
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=1) + "\n")
    return p


def load_profiles(paths: Iterable[str | Path]) -> dict[str, Profile]:
    """Load several profile files (a directory means every ``*.json`` in it), keyed by model name.

    Two files for the same model raise ProfileError naming both.
    """
    out: dict[str, Profile] = {}
    origin: dict[str, Path] = {}
    for path in paths:
        p = Path(path)
        files = sorted(p.glob("*.json")) if p.is_dir() else [p]
        for f in files:
            prof = load_profile(f)
            if prof.model in out:
                raise ProfileError(f"{f}: model {prof.model!r} is already profiled in {origin[prof.model]}")
            out[prof.model] = prof
            origin[prof.model] = f
    return out


PAPER_MODELS = ("alexnet", "mobilenet", "recog_router", "resnet50", "vgg19", "resnext50", "vgg_face", "resnet_car",
                "yolov3")


def paper_profile(model: str) -> Profile:
    """The bundled profile approximated from the paper's figures/tables (``source == "paper"``)."""
    if model not in PAPER_MODELS:
        raise ValueError(f"no paper profile for model {model!r}; have {list(PAPER_MODELS)}")
    ref = resources.files("gpuprims.profile").joinpath("paper", f"{model}.json")
    with resources.as_file(ref) as f:
        return load_profile(f)


def paper_profiles() -> dict[str, Profile]:
    """All bundled paper-derived profiles, keyed by model name."""
    return {m: paper_profile(m) for m in PAPER_MODELS}
