"""DAG apps: an inference app as a tree of model stages with routing on a stage's output.

The paper's DNN-Recog (Fig. 10) is a MobileNet router (zoo model ``recog_router``, 25% GPU) routing
"person" to ``vgg_face`` (40%) and "vehicle" to ``resnet_car`` (50%); any other label ends the
request after the first stage. A
single-model app is a DAG with one stage.

Each stage has a fixed GPU% (the share of the instance that runs it) and its share of the app's
end-to-end deadline. Shares not given are split in proportion to the profiled latency (batch 1 at the
stage's GPU%): a stage's share is ``deadline_ms * L(stage) / max(L(path))`` over the root-to-leaf paths
through it, so that every path's shares add up to at most the app deadline. Given shares are checked
the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpuprims.profile.format import Profile


@dataclass(frozen=True)
class Stage:
    """One model stage: ``routes`` maps an output label of this stage to the next stage's name."""

    name: str
    model: str
    gpu_pct: int
    routes: Mapping[str, str] = field(default_factory=dict)
    deadline_ms: float | None = None

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"stage name must be non-empty and contain no '/', got {self.name!r}")
        if not self.model:
            raise ValueError(f"stage {self.name!r}: model must be non-empty")
        if not 1 <= self.gpu_pct <= 100:
            raise ValueError(f"stage {self.name!r}: gpu_pct must be in 1..100, got {self.gpu_pct}")
        if self.deadline_ms is not None and not self.deadline_ms > 0:
            raise ValueError(f"stage {self.name!r}: deadline_ms must be > 0, got {self.deadline_ms}")
        object.__setattr__(self, "routes", dict(self.routes))


@dataclass(frozen=True)
class App:
    """An app: its stages (the first is the entry), end-to-end ``deadline_ms`` and optional GPU index.

    Construction validates: unique stage names, routes to known stages, no cycles, every stage
    reachable from the entry, and (where stage deadlines are given) that they add up to at most
    ``deadline_ms`` along every path. Each problem raises ValueError naming the app and the culprit.
    """

    name: str
    stages: tuple[Stage, ...]
    deadline_ms: float
    gpu: int | None = None

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"app name must be non-empty and contain no '/', got {self.name!r}")
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise ValueError(f"app {self.name!r}: needs at least one stage")
        if not self.deadline_ms > 0:
            raise ValueError(f"app {self.name!r}: deadline_ms must be > 0, got {self.deadline_ms}")
        if self.gpu is not None and self.gpu < 0:
            raise ValueError(f"app {self.name!r}: gpu must be >= 0, got {self.gpu}")
        names = [s.name for s in self.stages]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"app {self.name!r}: duplicate stage names {dup}")
        known = set(names)
        for s in self.stages:
            for label, nxt in s.routes.items():
                if nxt not in known:
                    raise ValueError(f"app {self.name!r}: stage {s.name!r} routes {label!r} to unknown "
                                     f"stage {nxt!r} (stages: {names})")
        self._check_acyclic()
        reach = set(self._order())
        unreachable = [n for n in names if n not in reach]
        if unreachable:
            raise ValueError(f"app {self.name!r}: stages {unreachable} are not reachable from the entry "
                             f"stage {names[0]!r}")
        if all(s.deadline_ms is not None for s in self.stages):
            for path in self.paths():
                total = sum(self.stage(n).deadline_ms or 0.0 for n in path)
                if total > self.deadline_ms * (1 + 1e-9):
                    raise ValueError(f"app {self.name!r}: stage deadlines along {' -> '.join(path)} add "
                                     f"up to {total:g} ms, more than the app deadline {self.deadline_ms:g} ms")
        elif any(s.deadline_ms is not None for s in self.stages):
            missing = [s.name for s in self.stages if s.deadline_ms is None]
            raise ValueError(f"app {self.name!r}: give deadline_ms for every stage or for none; missing "
                             f"for {missing}")

    # --- structure --------------------------------------------------------------------------------
    @property
    def entry(self) -> Stage:
        """The first stage, where requests enter."""
        return self.stages[0]

    def stage(self, name: str) -> Stage:
        """The stage called ``name``; ValueError if there is none."""
        for s in self.stages:
            if s.name == name:
                return s
        raise ValueError(f"app {self.name!r}: no stage {name!r}")

    def successors(self, name: str) -> list[str]:
        """Distinct next stages of ``name`` in route order."""
        return list(dict.fromkeys(self.stage(name).routes.values()))

    def key(self, stage: str) -> str:
        """The queue key of a stage: ``"<app>/<stage>"``."""
        return f"{self.name}/{stage}"

    def paths(self) -> list[list[str]]:
        """Every root-to-leaf path of stage names."""
        out: list[list[str]] = []

        def walk(n: str, acc: list[str]) -> None:
            nxt = self.successors(n)
            if not nxt:
                out.append(acc)
            for m in nxt:
                walk(m, [*acc, m])

        walk(self.entry.name, [self.entry.name])
        return out

    def _order(self) -> list[str]:
        seen: list[str] = []
        stack = [self.entry.name]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.append(n)
            stack.extend(reversed(self.successors(n)))
        return seen

    def _check_acyclic(self) -> None:
        state: dict[str, int] = {}

        def visit(n: str, trail: list[str]) -> None:
            if state.get(n) == 1:
                cyc = [*trail[trail.index(n):], n]
                raise ValueError(f"app {self.name!r}: stages form a cycle {' -> '.join(cyc)}")
            if state.get(n) == 2:
                return
            state[n] = 1
            for m in self.successors(n):
                visit(m, [*trail, n])
            state[n] = 2

        for s in self.stages:
            visit(s.name, [])

    # --- deadlines --------------------------------------------------------------------------------
    def with_deadline_split(self, profiles: Mapping[str, Profile], *, batch_size: int = 1) -> App:
        """A copy whose stages carry deadline shares proportional to profiled latency (module docstring).

        Stages that already have shares are kept as given. Raises ValueError when a stage's model has
        no profile.
        """
        if all(s.deadline_ms is not None for s in self.stages):
            return self
        lat = {s.name: stage_latency_ms(s, profiles, batch_size) for s in self.stages}
        worst: dict[str, float] = {}
        for path in self.paths():
            total = sum(lat[n] for n in path)
            for n in path:
                worst[n] = max(worst.get(n, 0.0), total)
        stages = tuple(replace(s, deadline_ms=self.deadline_ms * lat[s.name] / worst[s.name]) for s in self.stages)
        return replace(self, stages=stages)


def stage_latency_ms(stage: Stage, profiles: Mapping[str, Profile], batch_size: int = 1) -> float:
    """Profiled p50 latency of ``stage`` at its GPU%; ValueError when its model has no profile."""
    prof = profiles.get(stage.model)
    if prof is None:
        raise ValueError(f"stage {stage.name!r}: no profile for model {stage.model!r} "
                         f"(have {sorted(profiles)})")
    return prof.latency_ms(batch_size, stage.gpu_pct)


def single(name: str, model: str, gpu_pct: int, deadline_ms: float, *, gpu: int | None = None) -> App:
    """A one-stage app running ``model`` at ``gpu_pct``."""
    return App(name, (Stage(model, model, gpu_pct),), deadline_ms, gpu)


def dnn_recog(name: str = "dnn_recog", deadline_ms: float = 30.0, *, router_pct: int = 25,
              face_pct: int = 40, car_pct: int = 50, gpu: int | None = None) -> App:
    """The paper's DNN-Recog (Fig. 10): recog_router (a MobileNetV2) routes "person" to vgg_face and
    "vehicle" to resnet_car; "other" ends the request. Model names are the zoo's (``apps.zoo``)."""
    return App(name, (
        Stage("router", "recog_router", router_pct, {"person": "face", "vehicle": "car"}),
        Stage("face", "vgg_face", face_pct),
        Stage("car", "resnet_car", car_pct),
    ), deadline_ms, gpu)


def validate_apps(apps: Sequence[App], profiles: Mapping[str, Profile]) -> None:
    """Check a set of apps together: unique names and a profile for every stage's model and GPU%."""
    names = [a.name for a in apps]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"duplicate app names {dup}")
    for a in apps:
        for s in a.stages:
            prof = profiles.get(s.model)
            if prof is None:
                raise ValueError(f"app {a.name!r} stage {s.name!r}: no profile for model {s.model!r} "
                                 f"(have {sorted(profiles)})")
            if not prof.gpu_pcts[0] <= s.gpu_pct <= prof.gpu_pcts[-1]:
                raise ValueError(f"app {a.name!r} stage {s.name!r}: gpu_pct {s.gpu_pct} is outside the "
                                 f"measured range [{prof.gpu_pcts[0]}, {prof.gpu_pcts[-1]}] of {s.model!r}")
