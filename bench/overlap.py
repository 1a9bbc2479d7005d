"""bench/overlap: a change of GPU% under steady load, Overlapped-Execution vs kill-and-restart (Fig. 8).

One app (MobileNetV2, 3x32x32 float32 requests, ``shadow: true``) serves a constant load of about 70 %
of what it can serve at its starting share. Mid-run its GPU% goes from 50 to 100 (on the CPU backend:
one core to two), each method on a fresh node:

- ``overlap``: ``change_gpu_pct``. The shadow loaded and warmed its model ahead of the change at nice 19
  scheduling priority (the bench waits until it reports warm before the traffic starts), so the
  change is: apply the share, re-time the served batch sizes, flip the route, drain the old instance.
- ``restart``: ``restart_gpu_pct``: the active is killed and a new instance started at the new share
  (what it held is requeued to the new one, which serves it once it has loaded).

The capacity at the starting share is measured first, end to end on this machine (client, ingest and
node included: the highest step of a staircase of constant rates answered >= 99 % within the SLO,
``capacity_rps``), and the rate is ``LOAD`` times that.

Reported per method, from the client's per-request samples: throughput (OK answers per second by
completion time) and SLO attainment (of the requests sent in each bin, the fraction answered OK within
the SLO) over time in ``BIN_MS`` bins, the change marked; SLO attainment of the requests sent from
``AROUND_S[0]`` s before the change started to ``AROUND_S[1]`` s after (``through_change``) and over the
whole run; lost (sent, warm-up included, and never answered within the client's timeout) and
duplicated (answers beyond one per request id) over every request id; the switch downtime from the
data path as the node recorded it in the change (``downtime_ms``: the part of the pause between the old
instance's last answer and the new one's first during which a request waited on the new instance; see
``Change.observe_data_path``), and the client-side longest gap between OK answers around the change
minus the median gap before it.

Run: ``python3 -m bench.overlap [--quick] [--rate R]``. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

from bench import serving as sv
from bench.common import write_result
from gpuprims import wire
from gpuprims.traffic.stream import AppStream
from orchestrator.node.node import Node
from orchestrator.node.reconfig import change_gpu_pct, restart_gpu_pct

SHAPE = (3, 32, 32)
MODEL = "mobilenet_v2"
MAX_BATCH = 8
SLO_MS = 150.0
FROM_PCT, TO_PCT = 50, 100
LOAD = 0.7
BIN_MS = 100.0
AROUND_S = (2.0, 5.0)
TIMEOUT_S = 5.0  # the client waits this long for an answer: a restart answers late rather than never
METHODS = ("overlap", "restart")


def capacity_rps(pct: int = FROM_PCT, segment_s: float = 3.0) -> dict[str, Any]:
    """What the app at ``pct`` serves end to end on this machine (client, ingest and node included):
    the highest step of a staircase of constant rates answered >= 99 % within the SLO. The staircase is
    fractions of the model's own bound (max_batch / its latency at max_batch on one core)."""
    lat = sv.torch_latency_ms(MODEL, SHAPE, MAX_BATCH, cores=[0], threads=1, reps=30)
    med = float(np.median(lat))
    bound = MAX_BATCH * 1e3 / med
    rates = [round(f * bound, 1) for f in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)]
    cfg = sv.node_config([sv.app("mnet", MODEL, 1, shape=SHAPE, slo_ms=SLO_MS, gpu_pct=pct, max_batch=MAX_BATCH,
                                 max_wait_ms=0.0)])
    intervals, bounds = sv.ramp(rates, segment_s, warmup_rps=rates[0])
    with sv.running_node(cfg) as node:
        st = AppStream(app_id=1, shape=SHAPE, dtype="float32", intervals_s=intervals, to=("127.0.0.1", sv.port_of(node)))
        rep = sv.drive(node, [st], timeout_s=TIMEOUT_S, slo_ms=SLO_MS)
    steps = sv.ramp_stats(rep, 1, SLO_MS, bounds)
    best = sv.held_rate(steps)
    held = float(best["rate_rps"]) if best else rates[0]
    return {"model_ms_at_max_batch": round(med, 3), "model_bound_rps": round(bound, 1), "capacity_rps": held,
            "held_top_step": bool(best is not None and best is steps[-1]), "steps": steps, "samples_ms": lat}


def _wait_warm_shadow(node: Node, app: str, timeout_s: float = 600.0) -> float:
    """Pump the node until the app's shadow reports its pre-warm done; returns how long that took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        sh = node.shadow_of(app)
        if sh is not None and (sh.info.get("warm") or sh.info.get("prewarm") == "failed"):
            return time.monotonic() - t0
        node.step(50)
    raise RuntimeError(f"the shadow of {app} did not finish its pre-warm within {timeout_s:.0f} s")


def one(method: str, rate: float, duration_s: float, change_at_s: float) -> dict[str, Any]:
    """One run on a fresh node: steady `rate`, the change `change_at_s` into the measured traffic."""
    cfg = sv.node_config([sv.app("mnet", MODEL, 1, shape=SHAPE, slo_ms=SLO_MS, gpu_pct=FROM_PCT,
                                 max_batch=MAX_BATCH, max_wait_ms=0.0, shadow=True)])
    change: dict[str, Any] = {}
    with sv.running_node(cfg) as node:
        warm_s = _wait_warm_shadow(node, "mnet")
        shadow_info = dict(node.shadow_of("mnet").info) if node.shadow_of("mnet") is not None else {}
        warmup_s = 1.0

        def during(n: Node, _sending: Any) -> None:
            t_at = time.monotonic() + warmup_s + change_at_s
            while time.monotonic() < t_at:
                n.step(20)
            change["t_start"] = time.monotonic()
            fn = change_gpu_pct if method == "overlap" else restart_gpu_pct
            change["ok"], change["message"] = fn(n, "mnet", TO_PCT)
            change["t_end"] = time.monotonic()

        rep = sv.drive(node, [sv.stream(1, SHAPE, rate, duration_s, sv.port_of(node))], timeout_s=TIMEOUT_S,
                       slo_ms=SLO_MS, warmup_s=warmup_s, during=during)
        # The data-path downtime is filled in once the new instance's heartbeat reports its first answer.
        deadline = time.monotonic() + 5.0
        while node.changes.measuring and time.monotonic() < deadline:
            node.step(50)
        ch = node.changes.finished[-1].to_dict() if node.changes.finished else {}
        inst = sv.instance_stats(node, "mnet")
    return analyse(method, rep, change, ch, inst, rate, warm_s, shadow_info)


def analyse(method: str, rep: Any, change: dict[str, Any], ch: dict[str, Any], inst: dict[str, Any], rate: float,
            warm_s: float, shadow_info: dict[str, Any]) -> dict[str, Any]:
    s = rep.samples
    every = (s["app_id"] == 1) & (s["sent_ns"] >= 0)  # every request id sent, warm-up included
    meas = every & ~s["warmup"]
    answered = s["state"] > 0  # late answers (after the client's timeout) included
    ok = answered & (s["status"] == int(wire.Status.OK))
    good = ok & (s["state"] == 1) & (s["latency_ns"] <= SLO_MS * 1e6)
    t0_ns = int(s["sent_ns"][meas].min())
    end_ns = int(s["sent_ns"][meas].max())
    c0_ns, c1_ns = change["t_start"] * 1e9, change["t_end"] * 1e9
    nbins = int(np.ceil((end_ns - t0_ns) / 1e6 / BIN_MS)) + 1
    edges = t0_ns + np.arange(nbins + 1) * BIN_MS * 1e6
    sent_bin = np.histogram(s["sent_ns"][meas], edges)[0]
    good_bin = np.histogram(s["sent_ns"][meas & good], edges)[0]
    done_bin = np.histogram(s["recv_ns"][meas & ok], edges)[0]
    attain_bin = np.where(sent_bin > 0, good_bin / np.maximum(sent_bin, 1), np.nan)

    lo_ns, hi_ns = c0_ns - AROUND_S[0] * 1e9, c0_ns + AROUND_S[1] * 1e9
    around = meas & (s["sent_ns"] >= lo_ns) & (s["sent_ns"] < hi_ns)
    done_ns = np.sort(s["recv_ns"][meas & ok])
    gaps = np.diff(done_ns) / 1e6
    steady = gaps[done_ns[1:] < c0_ns]
    steady_ms = float(np.median(steady)) if steady.size else float("nan")
    win = (done_ns[1:] >= c0_ns) & (done_ns[:-1] <= c1_ns + 1e9)
    client_gap = float(gaps[win].max()) if win.any() else float("nan")
    sw = (ch.get("switched") or [{}])[0]
    n_every = int(every.sum())
    out: dict[str, Any] = {
        "method": method, "rate_rps": rate, "requests": n_every, "measured": int(meas.sum()),
        "lost": int((every & ~answered).sum()),
        "late": int((every & (s["state"] == 2)).sum()),
        "duplicated": int(np.maximum(s["answers"][every].astype(np.int64) - 1, 0).sum()),
        "failed": int((every & answered & ~ok).sum()),
        "slo_attainment": round(float(good[meas].mean()), 4),
        "through_change_attainment": round(float(good[around].mean()), 4) if around.any() else None,
        "through_change_requests": int(around.sum()),
        "change_ok": change.get("ok"), "change_message": change.get("message"),
        "change_total_ms": round((c1_ns - c0_ns) / 1e6, 1),
        "downtime_ms": sw.get("downtime_ms"), "answer_gap_ms": sw.get("answer_gap_ms"),
        "new_first_wait_ms": sw.get("new_first_wait_ms"), "data_path": sw.get("data_path"),
        "init_ms": sw.get("init_ms"), "route_switch_ms": sw.get("route_switch_ms"),
        "prewarmed": sw.get("prewarmed"),
        "client_max_gap_ms": round(client_gap, 3), "steady_gap_ms": round(steady_ms, 3),
        "client_downtime_ms": round(client_gap - steady_ms, 3),
        "shadow_warm_wait_s": round(warm_s, 2), "shadow": shadow_info,
        "change_ms": [round((c0_ns - t0_ns) / 1e6, 1), round((c1_ns - t0_ns) / 1e6, 1)],
        "switch_ms": round((sw["switch_ns"] - t0_ns) / 1e6, 1) if sw.get("switch_ns") else None,
        "bin_ms": BIN_MS,
        "bins": {"sent": sent_bin, "good": good_bin, "ok_done": done_bin,
                 "attainment": [None if np.isnan(a) else round(float(a), 4) for a in attain_bin]},
        "change": ch, "node": inst, "t0_ns": t0_ns,
    }
    print(f"  {method:>8}: attainment through the change {out['through_change_attainment']}, whole run "
          f"{out['slo_attainment']}, downtime {out['downtime_ms']} ms (data path), client gap "
          f"{out['client_downtime_ms']:.1f} ms over steady, lost {out['lost']}, duplicated {out['duplicated']}, "
          f"failed {out['failed']}; {out['change_message']}", flush=True)
    return out


def run(quick: bool, rate: float | None) -> dict[str, Any]:
    duration_s = 12.0 if quick else 20.0
    change_at_s = 5.0 if quick else 8.0
    cap = capacity_rps()
    rate = rate if rate is not None else round(LOAD * cap["capacity_rps"], 1)
    print(f"capacity at {FROM_PCT}%: {cap['capacity_rps']} req/s held at the SLO (model alone "
          f"{cap['model_ms_at_max_batch']} ms at batch {MAX_BATCH}: bound {cap['model_bound_rps']} req/s); "
          f"rate {rate} req/s", flush=True)
    runs = {m: one(m, rate, duration_s, change_at_s) for m in METHODS}
    ov, rs = runs["overlap"], runs["restart"]
    summary: dict[str, Any] = {
        "rate_rps": rate, "load": round(rate / cap["capacity_rps"], 3), "capacity_rps": cap["capacity_rps"],
        "model_ms_at_max_batch": cap["model_ms_at_max_batch"], "slo_ms": SLO_MS,
        "through_change_window_s": list(AROUND_S),
    }
    for m, r in runs.items():
        for k in ("through_change_attainment", "slo_attainment", "downtime_ms", "answer_gap_ms", "new_first_wait_ms",
                  "client_downtime_ms", "lost", "duplicated", "late", "failed", "requests", "change_total_ms",
                  "init_ms", "prewarmed"):
            summary[f"{m}_{k}"] = r[k]
    summary.update(from_pct=FROM_PCT, to_pct=TO_PCT, model=MODEL, input_shape="x".join(map(str, SHAPE)),
                   max_batch=MAX_BATCH, restart_visibly_worse=bool(
                       (rs["through_change_attainment"] or 0) < (ov["through_change_attainment"] or 0) - 0.01))
    return {"summary": summary, "samples": {"capacity": cap, **runs}}


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {m: result["samples"][m] for m in METHODS}
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    colours = {"overlap": "tab:blue", "restart": "tab:red"}
    names = {"overlap": "Overlapped-Execution", "restart": "kill and restart"}
    for m, r in runs.items():
        b = r["bins"]
        t = (np.arange(len(b["sent"])) + 0.5) * r["bin_ms"] / 1e3
        a1.plot(t, np.asarray(b["ok_done"]) * 1e3 / r["bin_ms"], color=colours[m], label=names[m], linewidth=1.2)
        att = np.array([np.nan if a is None else a for a in b["attainment"]], dtype=float)
        a2.plot(t, att * 100, color=colours[m], label=f"{names[m]}: {r['through_change_attainment']:.1%} through "
                f"the change", linewidth=1.2)
        for ax in (a1, a2):
            ax.axvspan(r["change_ms"][0] / 1e3, max(r["change_ms"][1], r["change_ms"][0] + 20) / 1e3,
                       color=colours[m], alpha=0.15)
    s = result["summary"]
    a1.axhline(s["rate_rps"], color="grey", linestyle=":", linewidth=1)
    a1.set_ylabel("OK answers/s")
    a1.legend(fontsize=8, loc="lower left")
    a1.set_title(f"{MODEL} {s['input_shape']}, {s['rate_rps']:g} req/s (~{s['load']:.0%} of capacity at "
                 f"{FROM_PCT}%), GPU% {FROM_PCT} -> {TO_PCT} (shaded: the change)", fontsize=9)
    a2.set_ylabel(f"SLO attainment (%), {SLO_MS:g} ms")
    a2.set_ylim(-5, 105)
    a2.legend(fontsize=8, loc="lower left")
    a2.set_xlabel(f"seconds since the first measured request ({BIN_MS:g} ms bins)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument("--rate", type=float, default=None, help="requests/s (default: LOAD x the measured capacity)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    res = run(args.quick, args.rate)
    busy = load_before[0] > 1.5 or os.getloadavg()[0] > 1.5
    notes = (f"CPU backend (no GPU): GPU% {FROM_PCT} -> {TO_PCT} is one core -> two (plan_cpu_shares). Load: "
             f"{LOAD:.0%} of the capacity at {FROM_PCT}% measured just before, end to end (the highest step of a "
             "staircase answered >= 99 % within the SLO; samples.capacity.steps). The shadow pre-warms (loads its model and runs the served batch sizes) in "
             "a nice-19 thread before the traffic starts, so Overlapped-Execution's change is: apply the share, "
             "re-time the batch sizes, flip the route. downtime_ms is the node's data-path figure "
             "(Change.observe_data_path: min(new first answer - old last answer, the wait of the new instance's "
             "first request), >= 0); client_downtime_ms the longest gap between OK answers during the change "
             "minus the median gap before it (includes gaps with no arrivals). through_change_attainment: "
             f"requests sent from {AROUND_S[0]:g} s before the change to {AROUND_S[1]:g} s after. lost / "
             "duplicated over every request id (warm-up included). The restart baseline answers what the "
             "killed instance held once its replacement has loaded (requeued), or DEADLINE_MISSED.")
    if busy:
        notes += (f" The machine was shared and busy during this run (1-min load average {load_before[0]:.1f} "
                  f"before, {os.getloadavg()[0]:.1f} after, on 2 cores): latencies and the capacity are inflated "
                  "and noisy; rerun on a quiet machine for clean figures.")
    path = write_result("overlap", "cpu", res["summary"], res["samples"], notes=notes, load_avg_before=load_before)
    plot(res, str(path.with_suffix(".png")))
    print(path)
    for k, v in res["summary"].items():
        print(f"{k:>36}: {v}")


if __name__ == "__main__":
    main()
