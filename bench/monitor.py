"""bench/monitor: automatic GPU% changes under steady load and under a step in load.

One app (MobileNetV2, 3x32x32 float32 requests, ``shadow: true``) starts at 50 % (on the CPU backend of
this 2-core machine: one core, one thread) on a node with the monitor on, at its default policy (what
``gpuprims-node`` runs with ``autoscale: true``). The load, relative to the capacity at 50 % measured
first end to end (``bench.overlap.capacity_rps``: the highest rate of a staircase held at 99 % within
the SLO):

1. ``steady``: ``STEADY_LOAD`` of it for ``STEADY_S``: expected no change (not overloaded; and no step
   down, since no share below 50 % gives fewer than one core: the node does not make a change that
   does not change what the instance gets);
2. ``step_up``: ``HIGH_LOAD`` (more than one core serves, less than two) for ``HIGH_S``: expected
   exactly one change, up, to the first share that gives two cores (75 %);
3. ``step_down``: back to ``STEADY_LOAD`` for ``LOW_S``: a step down is made only if the instance is
   busy less than ``underuse_util`` of the time at two cores and would be busy at most
   ``max_util_after`` at one; either outcome is reported as it happened.

Reported: every decision of the monitor (made or not, with its reason and the node's answer) and every
change (origin, reason, from/to, how it went), counted per phase; SLO attainment per phase; lost and
duplicated over every request id. On 2 cores only 1 <-> 2 cores is a real change, so this is the only
change there is to make.

Run: ``python3 -m bench.monitor [--quick]``. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

from bench import serving as sv
from bench.common import write_result
from bench.overlap import capacity_rps
from gpuprims import wire
from gpuprims.traffic.stream import AppStream
from orchestrator.node.monitor import Monitor
from orchestrator.node.node import Node

SHAPE = (3, 32, 32)
MODEL = "mobilenet_v2"
MAX_BATCH = 8
SLO_MS = 150.0
START_PCT = 50
STEADY_LOAD, HIGH_LOAD = 0.5, 1.3
WARMUP_S = 1.0


def _wait_warm_shadow(node: Node, app: str, timeout_s: float = 600.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        sh = node.shadow_of(app)
        if sh is not None and (sh.info.get("warm") or sh.info.get("prewarm") == "failed"):
            return
        node.step(50)
    raise RuntimeError(f"the shadow of {app} did not finish its pre-warm within {timeout_s:.0f} s")


def phases(quick: bool, cap: float) -> list[tuple[str, float, float]]:
    """(name, rate, seconds) of each phase."""
    scale = 0.5 if quick else 1.0
    return [("steady", STEADY_LOAD * cap, 40 * scale), ("step_up", HIGH_LOAD * cap, 40 * scale),
            ("step_down", STEADY_LOAD * cap, 50 * scale)]


def run(quick: bool) -> dict[str, Any]:
    cap = capacity_rps(START_PCT)
    plan = phases(quick, cap["capacity_rps"])
    print(f"capacity at {START_PCT}%: {cap['capacity_rps']} req/s; phases {[(n, round(r, 1), s) for n, r, s in plan]}",
          flush=True)
    times = list(np.arange(0.0, WARMUP_S, 1.0 / plan[0][1]))
    bounds = []
    t = WARMUP_S
    for name, rate, secs in plan:
        times += list(t + np.arange(0.0, secs, 1.0 / rate))
        bounds.append((name, t, t + secs, rate))
        t += secs
    cfg = sv.node_config([sv.app("mnet", MODEL, 1, shape=SHAPE, slo_ms=SLO_MS, gpu_pct=START_PCT,
                                 max_batch=MAX_BATCH, max_wait_ms=0.0, shadow=True)])
    monitor = Monitor()
    with sv.running_node(cfg) as node:
        node.monitor = monitor
        _wait_warm_shadow(node, "mnet")
        port = sv.port_of(node)
        st = AppStream(app_id=1, shape=SHAPE, dtype="float32", intervals_s=list(np.diff(times)),
                       to=("127.0.0.1", port))
        rep = sv.drive(node, [st], timeout_s=5.0, slo_ms=SLO_MS, warmup_s=WARMUP_S)
        events = [dict(e) for e in node.events if e["event"] in ("decision", "change_accepted", "changed",
                                                                  "change_failed", "switch_measured")]
        changes = [ch.to_dict() for ch in node.changes]
        status_decisions = node.status()["decisions"]
        inst = sv.instance_stats(node, "mnet")
    s = rep.samples
    every = (s["app_id"] == 1) & (s["sent_ns"] >= 0)
    t0_ns = int(np.min(s["sent_ns"][every] - s["sched_ns"][every]))
    answered = s["state"] > 0
    good = (s["state"] == 1) & (s["status"] == int(wire.Status.OK)) & (s["latency_ns"] <= SLO_MS * 1e6)
    per_phase = []
    for name, lo, hi, rate in bounds:
        m = every & (s["sched_ns"] >= lo * 1e9) & (s["sched_ns"] < hi * 1e9)
        evs = [e for e in events if lo <= e["t"] - t0_ns / 1e9 < hi]
        made = [e for e in evs if e["event"] == "change_accepted"]
        per_phase.append({
            "phase": name, "rate_rps": round(rate, 1), "seconds": round(hi - lo, 1), "sent": int(m.sum()),
            "slo_attainment": round(float(good[m].mean()), 4) if m.any() else None,
            "changes": len(made),
            "directions": ["up" if e["to_pct"] > e["from_pct"] else "down" for e in made],
            "changes_to": [(e["from_pct"], e["to_pct"]) for e in made],
            "decisions_not_made": sum(1 for e in evs if e["event"] == "decision" and not e.get("ok")),
        })
    for e in events:
        e["t_s"] = round(e["t"] - t0_ns / 1e9, 3)
    by = {p["phase"]: p for p in per_phase}
    summary = {
        "steady_changes": by["steady"]["changes"],
        "step_up_changes": by["step_up"]["changes"], "step_up_directions": by["step_up"]["directions"],
        "step_up_to": by["step_up"]["changes_to"],
        "step_down_changes": by["step_down"]["changes"], "step_down_directions": by["step_down"]["directions"],
        "steady_attainment": by["steady"]["slo_attainment"], "step_up_attainment": by["step_up"]["slo_attainment"],
        "step_down_attainment": by["step_down"]["slo_attainment"],
        "lost": int((every & ~answered).sum()),
        "duplicated": int(np.maximum(s["answers"][every].astype(np.int64) - 1, 0).sum()),
        "requests": int(every.sum()),
        "capacity_rps_at_50pct": cap["capacity_rps"], "steady_load": STEADY_LOAD, "high_load": HIGH_LOAD,
        "policy": {k: getattr(monitor.policy, k) for k in vars(monitor.policy)},
        "model": MODEL, "input_shape": "x".join(map(str, SHAPE)), "slo_ms": SLO_MS, "start_pct": START_PCT,
    }
    for p in per_phase:
        print(f"  {p['phase']:>9}: {p['rate_rps']} req/s for {p['seconds']} s: {p['changes']} change(s) "
              f"{p['changes_to']}, {p['decisions_not_made']} decision(s) not made, attainment {p['slo_attainment']}",
              flush=True)
    return {"summary": summary, "samples": {"phases": per_phase, "events": events, "changes": changes,
                                            "status_decisions": status_decisions, "node": inst, "capacity": cap}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="phases half as long")
    args = ap.parse_args()
    load_before = os.getloadavg()
    res = run(args.quick)
    notes = ("CPU backend, 2 cores: 50 % is one core, 75-100 % two (cores_for_pct), so the only change that changes "
             "what the instance gets is 1 <-> 2 cores; the monitor's own step (10 %) is widened by the node to the "
             "first share that does (Placement.effective_target), and a decision that no share can satisfy is "
             "recorded as not made. Monitor at its default policy. Phase loads are relative to the capacity at 50 % "
             "measured just before, end to end (bench.overlap.capacity_rps).")
    # Judged by the load before the run: the load after is the bench's own node and client (its step-up
    # phase runs above capacity, so it is high even on an idle machine).
    load_after = os.getloadavg()
    if load_before[0] > 1.5:
        notes += (f" The machine was shared and busy (1-min load average {load_before[0]:.1f} before, "
                  f"{load_after[0]:.1f} after, on 2 cores): the capacity figure and the attainment are noisy, "
                  "and an overload the monitor sees may come from the neighbours rather than the load step.")
    else:
        notes += (f" Nothing else was running: 1-min load average {load_before[0]:.1f} before; "
                  f"{load_after[0]:.1f} after is the bench's own node and client.")
    path = write_result("monitor", "cpu", res["summary"], res["samples"], notes=notes, load_avg_before=load_before)
    print(path)
    for k, v in res["summary"].items():
        print(f"{k:>24}: {v}")


if __name__ == "__main__":
    main()
