"""Placement and sizing: how many instances each app runs, at what GPU%, on which CPU cores.

Pure bookkeeping over the config, the apps' states and their profiles: nothing here starts a process
or talks to one. The node asks it at start (Multi-Model sizing, shares, core sets) and a change of
share asks it where the replacement instance goes.
"""

from __future__ import annotations

import logging
from pathlib import Path

from apps.zoo.names import canonical_name
from gpuprims.cpushare import CpuShare, available_cores, cores_for_pct, plan_cpu_shares
from gpuprims.profile import Profile, ProfileError, load_profile
from gpuprims.sched import multi_model
from orchestrator.config.schema import NodeConfig
from orchestrator.control.errors import PlacementError
from orchestrator.node.dispatch import stage_pcts
from orchestrator.node.state import AppState

log = logging.getLogger("gpuprims.node")



class Placement:
    """Sizing and placement of the node's apps (see the module docstring)."""

    def __init__(self, cfg: NodeConfig, apps: dict[str, AppState], *, backend: str) -> None:
        self.cfg = cfg
        self.apps = apps
        self.backend = backend
        self._profiles: dict[str, Profile] | None = None

    @property
    def scheduled(self) -> bool:
        """True when a live scheduler (``node.scheduler`` spatiotemporal or temporal) drives the instances."""
        return self.cfg.node.scheduler != "spatial"

    # -- profiles --------------------------------------------------------------------------------------
    def profiles(self) -> dict[str, Profile]:
        """The profiles in ``node.profiles`` by canonical model name (loaded once)."""
        if self._profiles is None:
            self._profiles = self._load_profiles()
        return self._profiles

    def _load_profiles(self) -> dict[str, Profile]:
        d = self.cfg.node.profiles
        if not d:
            return {}
        out = {}
        for path in sorted(Path(d).glob("*.json")):
            try:
                prof = load_profile(path)
            except ProfileError as e:
                raise PlacementError(f"node.profiles: {e}") from e
            out[model_key(prof.model)] = prof
        return out

    def profile_of(self, model: str) -> Profile | None:
        return self.profiles().get(model_key(model))

    # -- sizing ----------------------------------------------------------------------------------------
    def check_scheduled(self) -> None:
        """A live scheduler runs one dispatched instance per app and owns the shares."""
        many = [a.cfg.name for a in self.apps.values() if isinstance(a.cfg.instances, int) and a.cfg.instances > 1]
        if many:
            raise PlacementError(f"node.scheduler {self.cfg.node.scheduler!r} runs one instance per app (the "
                                 f"scheduler batches and times its runs); set instances: 1 for {', '.join(many)}")

    # -- devices -------------------------------------------------------------------------------------
    def device_of(self, name: str) -> int:
        """The device whose share the app's instances hold: its GPU on cuda (``gpu``, else the node's
        default); on the CPU backend every app shares the one CPU device (index 0)."""
        if self.backend != "cuda":
            return 0
        return self.cfg.gpu_of(self.apps[name].cfg)

    def device_load(self) -> dict[int, int]:
        """GPU% held on each device (sum of share x instances of the apps placed there)."""
        out: dict[int, int] = {}
        for name, a in self.apps.items():
            dev = self.device_of(name)
            out[dev] = out.get(dev, 0) + a.gpu_pct * a.instances
        return out

    def held_beside(self, app_name: str) -> int:
        """GPU% the other apps hold on the device of ``app_name``."""
        dev = self.device_of(app_name)
        return sum(a.gpu_pct * a.instances for name, a in self.apps.items()
                   if name != app_name and self.device_of(name) == dev)

    def size_auto_apps(self) -> None:
        """Multi-Model: apps with ``instances: auto`` get the instance count (and, with ``gpu_pct: auto``,
        the share each) that ``multi_model`` finds best within their SLO on their model's profile. The
        budget is per device: what the fixed apps on the same GPU leave, split between its auto apps."""
        autos = [a for a in self.apps.values() if a.cfg.instances == "auto" and not a.cfg.is_dag]
        if not autos:
            return
        fixed: dict[int, int] = {}
        n_autos: dict[int, int] = {}
        for name, a in self.apps.items():
            dev = self.device_of(name)
            if a.cfg.instances == "auto" and not a.cfg.is_dag:
                n_autos[dev] = n_autos.get(dev, 0) + 1
            elif isinstance(a.cfg.gpu_pct, int):
                fixed[dev] = fixed.get(dev, 0) + a.cfg.gpu_pct * a.instances
        for a in autos:
            dev = self.device_of(a.cfg.name)
            available = max(1, (100 - fixed.get(dev, 0)) // n_autos[dev])
            prof = self.profile_of(a.cfg.model or "")
            if prof is None:
                log.warning("%s: instances is auto but there is no profile of %s in node.profiles; running 1 "
                            "instance (make one with gpuprims-profile)", a.cfg.name, a.cfg.model)
                continue
            budget = a.cfg.gpu_pct if isinstance(a.cfg.gpu_pct, int) else available
            fitting = [b for b in prof.batch_sizes if b <= a.cfg.max_batch]
            batch = max(fitting) if fitting else min(prof.batch_sizes)
            n, pct = multi_model(prof, budget, a.cfg.slo_ms, batch_size=batch)
            if n < 1:
                log.warning("%s: no instance count meets %.0f ms at %d%% by its profile; running 1",
                            a.cfg.name, a.cfg.slo_ms, budget)
                continue
            a.instances = n
            if not isinstance(a.cfg.gpu_pct, int):
                a.gpu_pct = pct
            log.info("%s: Multi-Model sizing from its profile on device %d: %d instance(s) x %d%% (budget %d%%, "
                     "SLO %.0f ms)", a.cfg.name, dev, n, pct, budget, a.cfg.slo_ms)

    def assign_pcts(self) -> None:
        """Every app's GPU% per instance: as configured; a DAG app the sum of its stages' shares;
        what Multi-Model sized; the rest of ``auto`` apps split what their device has left evenly. The
        shares on each device must add up to at most 100 (unless oversubscription is allowed)."""
        for a in self.apps.values():
            if a.gpu_pct:
                continue  # sized by Multi-Model
            if isinstance(a.cfg.gpu_pct, int):
                a.gpu_pct = a.cfg.gpu_pct
            elif a.cfg.is_dag and a.cfg.fixed_pct_per_instance():
                # A DAG app runs its stages in one process, with the sum of their shares.
                a.gpu_pct = min(100, a.cfg.fixed_pct_per_instance())
        taken: dict[int, int] = {}
        auto_instances: dict[int, int] = {}
        for name, a in self.apps.items():
            dev = self.device_of(name)
            if a.gpu_pct:
                taken[dev] = taken.get(dev, 0) + a.gpu_pct * a.instances
            else:
                auto_instances[dev] = auto_instances.get(dev, 0) + a.instances
        for name, a in self.apps.items():
            if not a.gpu_pct:
                dev = self.device_of(name)
                a.gpu_pct = max(1, (100 - taken.get(dev, 0)) // auto_instances[dev])
        if self.cfg.node.allow_oversubscribe or self.scheduled:
            return
        for dev, total in sorted(self.device_load().items()):
            if total > 100:
                parts = ", ".join(f"{name} {a.gpu_pct}% x {a.instances}" for name, a in self.apps.items()
                                  if self.device_of(name) == dev)
                where = f"GPU {dev}" if self.backend == "cuda" else "the CPU device"
                raise PlacementError(f"the apps' shares on {where} add up to {total}% (> 100) after sizing "
                                     f"({parts}); set node.allow_oversubscribe or lower gpu_pct")

    def stage_pcts(self, name: str) -> dict[str, int]:
        a = self.apps[name]
        return stage_pcts(a.cfg, a.gpu_pct, self.cfg.node.scheduler)

    def instance_pct(self, name: str) -> int:
        """The share an instance of ``name`` is started with: the app's, or under a live scheduler the
        largest of its stages' (a dispatched instance runs one stage at a time)."""
        if not self.scheduled:
            return self.apps[name].gpu_pct
        return max(self.stage_pcts(name).values())

    # -- shares of the device --------------------------------------------------------------------------
    def plan_shares(self) -> dict[str, CpuShare]:
        """CPU backend: the core set and threads of every instance ``<app>-<i>``; empty on cuda."""
        if self.backend != "cpu":
            return {}
        reqs = [(f"{name}-{i}", self.instance_pct(name)) for name, a in self.apps.items() for i in range(a.instances)]
        # Under a live scheduler the shares may add up to more than 100: it keeps what runs at once within 100.
        return plan_cpu_shares(reqs, allow_oversubscribe=self.cfg.node.allow_oversubscribe or self.scheduled)

    def check_share(self, app_name: str, new_pct: int) -> None:
        """Raise ValueError if the app is unknown, the % is out of range, or the GPU would be oversubscribed."""
        if app_name not in self.apps:
            raise KeyError(f"no app named {app_name!r}; apps: {', '.join(sorted(self.apps))}")
        if isinstance(new_pct, bool) or not isinstance(new_pct, int) or not 1 <= new_pct <= 100:
            raise ValueError(f"gpu_pct must be an integer in 1..100, got {new_pct!r}")
        app = self.apps[app_name]
        gpu = self.device_of(app_name)
        others = self.held_beside(app_name)
        total = others + new_pct * app.instances
        if total > 100 and not self.cfg.node.allow_oversubscribe:
            where = f"GPU {gpu}" if self.backend == "cuda" else "the CPU device"
            raise ValueError(f"refused: {app_name} at {new_pct}% x {app.instances} instance(s) would put {where} "
                             f"at {total}% (other apps hold {others}%); the sum must stay <= 100 unless "
                             "node.allow_oversubscribe is true")

    def share_for(self, app_name: str, new_pct: int, index: int) -> CpuShare | None:
        """CPU backend: the core set of instance ``index`` of the app once it runs at ``new_pct`` (the
        other apps keep theirs); None on cuda, where the GPU% alone is the share."""
        if self.backend != "cpu":
            return None
        reqs = []
        for name, a in self.apps.items():
            pct = new_pct if name == app_name else a.gpu_pct
            reqs += [(f"{name}-{i}", pct) for i in range(a.instances)]
        shares = plan_cpu_shares(reqs, allow_oversubscribe=self.cfg.node.allow_oversubscribe)
        # An app with more live instances than configured (a replacement still starting) reuses the last plan.
        return shares.get(f"{app_name}-{index}") or shares[f"{app_name}-{self.apps[app_name].instances - 1}"]

    def capacity(self, gpu_pct: int) -> int:
        """What an instance gets at ``gpu_pct``: on the CPU backend its whole cores (and as many threads),
        on CUDA the percentage itself (MPS limits threads at that granularity)."""
        if self.backend == "cpu":
            return cores_for_pct(gpu_pct, len(available_cores()))
        return gpu_pct

    def effective_target(self, from_pct: int, to_pct: int, lo: int, hi: int) -> int | None:
        """The share to change to so that the instance really gets more (``to_pct > from_pct``) or less:
        ``to_pct`` if that changes :meth:`capacity`, else the nearest share beyond it in the same
        direction, within ``lo..hi``, that does; None when no share in range changes anything (a
        change would cost a shadow start and buy nothing)."""
        have = self.capacity(from_pct)
        if to_pct > from_pct:
            cands = range(to_pct, min(hi, 100) + 1)
            return next((p for p in cands if self.capacity(p) > have), None)
        cands = range(to_pct, max(lo, 1) - 1, -1)
        return next((p for p in cands if self.capacity(p) < have), None)

    def needed_pct(self, app_name: str, arrival_rps: float) -> int | None:
        """The smallest GPU% at which the app's instances serve ``arrival_rps`` (with 20% headroom)
        within its SLO, by its model's profile; None without a profile."""
        a = self.apps.get(app_name)
        if a is None or not a.cfg.model:
            return None
        prof = self.profile_of(a.cfg.model)
        if prof is None:
            return None
        for pct in sorted(prof.gpu_pcts):
            for b in sorted(prof.batch_sizes):
                if b > a.cfg.max_batch:
                    break
                ms = prof.latency_ms(b, pct, stat="p99")
                if ms <= a.cfg.slo_ms and a.instances * b * 1000.0 / ms >= 1.2 * arrival_rps:
                    return int(pct)
        return None


def model_key(model: str) -> str:
    """The name a model's profile is filed under: its canonical zoo name, else the name as given."""
    try:
        return canonical_name(model)
    except ValueError:
        return model

