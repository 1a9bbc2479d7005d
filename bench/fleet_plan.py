"""bench/fleet_plan: how close the fleet's planner comes to the best placement, in the simulator.

Issue 25's target: fleet goodput within the SLO within 10 % of the best placement on small cases,
found by exhaustive search in the simulator. No Ray and no processes: the planner
(``orchestrator.fleet.plan.Planner``) is the controller's own, the simulator
(``gpuprims.sched.sim``, spatio-temporal scheduler) is the one the planner scores bins with, and the
models are the bundled paper profiles (``gpuprims.profile.paper_profiles``: a GPU's latencies).

Each case draws a few apps (a model, an SLO, an expected rate between a fifth and four fifths of what
the model serves at 100 % within its SLO, ``gpu_pct: auto`` so the planner sizes them from the
profile) and a few one-GPU machines. Every app is sized once (``size_app``, as the planner does); then
every assignment of the sized apps to machines (or to none, when they cannot all fit) that keeps
each GPU at or under 100 % is simulated, and the best fleet goodput (requests answered within their
SLO over requests offered, every app's) is the reference. The planner's own placement is scored by
the same simulation. Standbys are off here: a standby holds a share but serves nothing while its
primary lives, and with standbys the search space is the square of this one.

Run: ``python -m bench.fleet_plan [--quick] [--cases N] [--seed S]`` → ``fleet_plan.json``.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import load_note, write_result
from gpuprims.profile import Profile, paper_profiles
from gpuprims.sched.dag import single
from gpuprims.sched.scheduler import make_scheduler
from gpuprims.sched.sim import Arrival, Workload, simulate
from orchestrator.fleet.plan import AppDemand, NodeView, Planner, size_app

MODELS = ("alexnet", "mobilenet", "resnet50", "vgg19", "resnext50", "yolov3")
SLOS_MS = (30.0, 50.0, 100.0)
MAX_BATCH = 8
SIM_MS = 4000.0
TARGET = 0.90  # the planner's goodput at least this fraction of the best placement's


def draw_case(rng: np.random.Generator, n_apps: int, profiles: Mapping[str, Profile]) -> list[AppDemand]:
    """``n_apps`` apps: a model, an SLO it can meet, an expected rate it can serve on a whole GPU."""
    apps = []
    for i in range(n_apps):
        model = str(rng.choice(MODELS))
        prof = profiles[model]
        fits = [s for s in SLOS_MS if prof.latency_ms(1, 100, stat="p99") <= s]
        slo = float(rng.choice(fits)) if fits else max(SLOS_MS)
        batches = [b for b in prof.batch_sizes if b <= MAX_BATCH and prof.latency_ms(b, 100, stat="p99") <= slo]
        b = max(batches) if batches else 1
        full = b * 1000.0 / prof.latency_ms(b, 100, stat="p99")
        rate = round(float(rng.uniform(0.2, 0.8)) * full, 1)
        apps.append(AppDemand(f"a{i}", {"name": f"a{i}", "model": model, "slo_ms": slo, "gpu_pct": "auto",
                                        "max_batch": MAX_BATCH, "standby": False}, rate_rps=rate))
    return apps


class Evaluator:
    """Simulated (met, offered) of one GPU holding a set of sized apps, memoised by the set."""

    def __init__(self, profiles: Mapping[str, Profile], sizes: Mapping[str, tuple[int, int]], seed: int) -> None:
        self.profiles, self.sizes, self.seed = profiles, sizes, seed
        self.memo: dict[frozenset[str], tuple[int, int]] = {}

    def gpu(self, apps: Sequence[AppDemand]) -> tuple[int, int]:
        key = frozenset(a.name for a in apps)
        if key not in self.memo:
            self.memo[key] = self._simulate(apps) if apps else (0, 0)
        return self.memo[key]

    def _simulate(self, apps: Sequence[AppDemand]) -> tuple[int, int]:
        sim_apps, loads = [], []
        for a in sorted(apps, key=lambda a: a.name):
            n, pct = self.sizes[a.name]
            for k in range(n):
                sa = single(f"{a.name}.{k}", a.model, pct, a.slo_ms, gpu=0)
                sim_apps.append(sa)
                loads.append(Workload(sa, Arrival("poisson", float(a.rate_rps or 0) / n)))
        try:
            sched = make_scheduler("spatiotemporal", sim_apps, self.profiles, num_gpus=1)
            rep = simulate(sched, loads, duration_ms=SIM_MS, warmup_ms=SIM_MS / 10, seed=self.seed)
        except (ValueError, RuntimeError):
            return 0, sum(int((a.rate_rps or 0) * SIM_MS * 0.9 / 1e3) for a in apps)
        return (sum(int(r.get("met", 0)) for r in rep["apps"].values()),
                sum(int(r.get("offered", 0)) for r in rep["apps"].values()))

    def fleet(self, apps: Sequence[AppDemand], where: Mapping[str, str | None]) -> float:
        """Fleet goodput: met over offered for every app; an app placed nowhere meets none of its
        offered requests (its offered count taken from a simulation of it alone)."""
        met = offered = 0
        for node in sorted({w for w in where.values() if w is not None}):
            m, o = self.gpu([a for a in apps if where[a.name] == node])
            met, offered = met + m, offered + o
        for a in apps:
            if where[a.name] is None:
                offered += self.gpu([a])[1]
        return met / offered if offered else 1.0


def best_placement(apps: Sequence[AppDemand], nodes: Sequence[str], ev: Evaluator) -> tuple[float, dict[str, str | None]]:
    """Every assignment of the apps to nodes (or none) within 100 % per GPU; the best fleet goodput."""
    best: tuple[float, dict[str, str | None]] = (-1.0, {})
    held = {a.name: ev.sizes[a.name][0] * ev.sizes[a.name][1] for a in apps}
    for choice in itertools.product([*nodes, None], repeat=len(apps)):
        load: dict[str, int] = {}
        for a, n in zip(apps, choice, strict=True):
            if n is not None:
                load[n] = load.get(n, 0) + held[a.name]
        if any(v > 100 for v in load.values()):
            continue
        where = {a.name: n for a, n in zip(apps, choice, strict=True)}
        g = ev.fleet(apps, where)
        if g > best[0]:
            best = (g, where)
    return best


def one_case(rng: np.random.Generator, n_apps: int, n_nodes: int, profiles: Mapping[str, Profile],
             seed: int) -> dict[str, Any]:
    apps = draw_case(rng, n_apps, profiles)
    sizes = {}
    for a in apps:
        n, pct, _ = size_app(a, profiles.get(a.model), default_pct=25)
        sizes[a.name] = (n, pct)
    nodes = [f"n{i}" for i in range(n_nodes)]
    plan = Planner(profiles).plan(apps, [NodeView(n, gpus=1) for n in nodes])
    where = {a.name: (plan.assignments[a.name].primary.node if a.name in plan.assignments else None) for a in apps}
    ev = Evaluator(profiles, sizes, seed)
    planner_g = ev.fleet(apps, where)
    best_g, best_where = best_placement(apps, nodes, ev)
    return {"apps": [{"name": a.name, "model": a.model, "slo_ms": a.slo_ms, "rate_rps": a.rate_rps,
                      "instances": sizes[a.name][0], "gpu_pct": sizes[a.name][1]} for a in apps],
            "nodes": n_nodes, "planner": where, "planner_goodput": round(planner_g, 4),
            "best": best_where, "best_goodput": round(best_g, 4),
            "ratio": round(planner_g / best_g, 4) if best_g > 0 else 1.0, "simulations": len(ev.memo)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few small cases (a smoke test, not figures)")
    ap.add_argument("--cases", type=int, default=40, help="cases per size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the results here instead of bench/results/")
    args = ap.parse_args(argv)
    sizes = [(3, 2)] if args.quick else [(3, 2), (4, 2), (4, 3), (5, 3)]
    cases_per = 3 if args.quick else args.cases
    profiles = paper_profiles()
    load_before = os.getloadavg()
    rng = np.random.default_rng(args.seed)
    cases = [one_case(rng, n_apps, n_nodes, profiles, seed=args.seed + i)
             for n_apps, n_nodes in sizes for i in range(cases_per)]
    ratios = np.array([c["ratio"] for c in cases])
    summary: dict[str, Any] = {
        "cases": len(cases), "sizes_apps_nodes": sizes, "target_ratio": TARGET,
        "ratio_min": float(ratios.min()), "ratio_p10": float(np.percentile(ratios, 10)),
        "ratio_mean": round(float(ratios.mean()), 4),
        "cases_within_target": int((ratios >= TARGET).sum()),
        "cases_planner_optimal": int((ratios >= 0.9999).sum()),
        "cases_best_at_99pct": int(sum(c["best_goodput"] >= 0.99 for c in cases)),
        "cases_planner_at_99pct_where_best_is": int(sum(c["planner_goodput"] >= 0.99 for c in cases
                                                         if c["best_goodput"] >= 0.99)),
    }
    for n_apps, n_nodes in sizes:
        rs = [c["ratio"] for c in cases if len(c["apps"]) == n_apps and c["nodes"] == n_nodes]
        summary[f"ratio_min_{n_apps}apps_{n_nodes}nodes"] = min(rs)
    notes = ("Simulator only (paper profiles, spatio-temporal scheduler, Poisson arrivals, "
             f"{SIM_MS:g} ms simulated per GPU); standbys off; exhaustive search over every app-to-machine "
             "assignment within 100 % per GPU, with the planner's own sizing." +
             (" QUICK run: a smoke test, not figures." if args.quick else "") + load_note(load_before))
    path = write_result("fleet_plan", "cpu", summary, {"cases": cases}, notes=notes, load_avg_before=load_before,
                        name="fleet_plan-quick" if args.quick else None, out_dir=args.out)
    print(path)
    for k, v in summary.items():
        print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
