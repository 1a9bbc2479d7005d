"""bench/overlap: downtime while an app's GPU% changes, Overlapped-Execution vs kill-and-restart (Fig. 8).

One app (MobileNetV2, 3x32x32 float32 requests, ``shadow: true``) serves a steady constant load of
100 requests/s. A few seconds in, its GPU% goes from 100 to 50 (on the CPU backend: two cores to one,
so the new instance and the next shadow's start-up do not contend on one core) three ways, each on a
fresh node:

- ``none``: no change (the baseline timeline);
- ``overlap``: ``change_gpu_pct`` (the prepared shadow initialises at the new share while the active
  serves, then the route switches and the old active drains);
- ``restart``: ``restart_gpu_pct`` (the active is killed and a new instance started at the new share).

From the client's samples: the completion timeline, and downtime = the longest stretch without an OK
completion from the moment the old instance stops taking requests (the route switch for
Overlapped-Execution, the kill for the restart) until 0.5 s after the change completed, minus the
median gap between completions before the change. ``overlap_init_max_gap_ms`` is the largest gap while
the shadow initialised (before the switch) and ``overlap_change_*`` the largest over the whole change:
on the CPU backend the shadow's model load competes with the active for the cores. Lost = sent -
answered; duplicated = answers beyond one per request; failed = answered with a non-OK status (e.g. INSTANCE_FAILED for requests the killed
instance held).

Run: ``python3 -m bench.overlap [--quick]``. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from bench import serving as sv
from bench.common import write_result
from gpuprims import wire
from orchestrator.node import Node
from orchestrator.reconfig import change_gpu_pct, restart_gpu_pct

SHAPE = (3, 32, 32)
MODEL = "mobilenet_v2"
RATE = 100.0
SLO_MS = 200.0
FROM_PCT, TO_PCT = 100, 50
TAIL_S = 0.5
TIMEOUT_S = 5.0  # the client waits this long for an answer: a restart answers late rather than never


def _wait_shadow(node: Node, app: str, timeout_s: float = 120.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        sh = node.shadow_of(app)
        if sh is not None and sh.ready:
            return
        node.step(50)
    raise RuntimeError(f"the shadow of {app} was not ready within {timeout_s:.0f} s")


def one(mode: str, duration_s: float, change_at_s: float) -> dict[str, Any]:
    """One run on a fresh node; `mode` is none, overlap or restart."""
    cfg = sv.node_config([sv.app("mnet", MODEL, 1, shape=SHAPE, slo_ms=SLO_MS, gpu_pct=FROM_PCT, max_batch=8,
                                 max_wait_ms=0.0, shadow=True)])
    change: dict[str, Any] = {}
    with sv.running_node(cfg) as node:
        _wait_shadow(node, "mnet")
        port = sv.port_of(node)
        warmup_s = 1.0

        def during(n: Node, _sending: Any) -> None:
            # The traffic starts about now; change once the steady state has been running a while.
            t_at = time.monotonic() + warmup_s + change_at_s
            while time.monotonic() < t_at:
                n.step(20)
            if mode == "none":
                return
            change["t_start"] = time.monotonic()
            fn = change_gpu_pct if mode == "overlap" else restart_gpu_pct
            change["ok"], change["message"] = fn(n, "mnet", TO_PCT)
            change["t_end"] = time.monotonic()

        rep = sv.drive(node, [sv.stream(1, SHAPE, RATE, duration_s, port)], timeout_s=TIMEOUT_S,
                       slo_ms=SLO_MS, warmup_s=warmup_s, during=during)
        events = [dict(e) for e in node.events if e["event"] in ("switch", "changed", "restarted")]
        inst = sv.instance_stats(node, "mnet")
    s = rep.samples
    meas = ~s["warmup"] & (s["sent_ns"] >= 0) & (s["app_id"] == 1)
    # Late answers (after the client timeout) still mark when service resumed.
    ok = meas & (s["state"] > 0) & (s["status"] == int(wire.Status.OK))
    done_ns = np.sort(s["recv_ns"][ok])
    sent_ns = s["sent_ns"][meas]
    t0_ns = int(sent_ns.min())
    st = sv.app_stats(rep, 1, SLO_MS)
    out: dict[str, Any] = {
        "mode": mode, "requests": st["sent"], "answered": st["answered"], "ok": st["ok"], "lost": st["lost"],
        "duplicated": int(rep.summary["duplicates"]), "late": int(rep.summary["late"]), "failed": st["answered"] - st["ok"],
        "p50_ms": st["p50_ms"], "p99_ms": st["p99_ms"], "slo_attainment": st["slo_attainment"],
        "t0_ns": t0_ns, "completions_ms": (done_ns - t0_ns) / 1e6,
        "events": [{**e, "t_ms": (e["t"] * 1e9 - t0_ns) / 1e6} for e in events], "node": inst,
    }
    gaps = np.diff(done_ns) / 1e6
    sw = [e for e in events if e["event"] == "switch"]

    def longest_wait(anchor_ns: float, end_ns: float) -> float:
        """Longest stretch (ms) without an OK completion from anchor_ns (the moment the old instance stops
        taking requests) to end_ns, counting to the first completion after end_ns."""
        inside = done_ns[(done_ns > anchor_ns) & (done_ns <= end_ns)]
        after = done_ns[done_ns > end_ns]
        seq = np.concatenate([[anchor_ns], inside, after[:1] if after.size else [end_ns]])
        return float(np.diff(seq).max() / 1e6)

    def max_gap(lo_ns: float, hi_ns: float) -> float:
        win = (done_ns[1:] >= lo_ns) & (done_ns[:-1] <= hi_ns)
        return float(gaps[win].max()) if win.any() else float("nan")

    if mode == "none":
        # The same kind of window at the time the other runs change, for the baseline's own longest wait.
        anchor_ns = t0_ns + (change_at_s + 1.0) * 1e9
        end_ns = anchor_ns + TAIL_S * 1e9
        change_lo_ns = t0_ns + change_at_s * 1e9
    else:
        out.update(change_ok=change.get("ok"), change_message=change.get("message"),
                   change_total_ms=round((change["t_end"] - change["t_start"]) * 1e3, 1))
        change_lo_ns = change["t_start"] * 1e9
        # Overlap: from the route switch; restart: from the kill (the change's start).
        anchor_ns = sw[0]["t"] * 1e9 if mode == "overlap" and sw else change_lo_ns
        end_ns = change["t_end"] * 1e9 + TAIL_S * 1e9
        out["change_max_gap_ms"] = round(max_gap(change_lo_ns, end_ns), 3)
        if mode == "overlap" and sw:
            out["init_max_gap_ms"] = round(max_gap(change_lo_ns, sw[0]["t"] * 1e9), 3)
    steady = gaps[done_ns[1:] < change_lo_ns]
    steady_ms = float(np.median(steady)) if steady.size else float("nan")
    gap = longest_wait(anchor_ns, end_ns)
    out.update(steady_gap_ms=round(steady_ms, 3), max_gap_ms=round(gap, 3), downtime_ms=round(gap - steady_ms, 3),
               window_ms=[round((anchor_ns - t0_ns) / 1e6, 1), round((end_ns - t0_ns) / 1e6, 1)],
               switch_ms=round((sw[0]["t"] * 1e9 - t0_ns) / 1e6, 1) if sw else None)
    print(f"  {mode:>8}: max gap {gap:.1f} ms (steady {steady_ms:.2f}), lost {out['lost']}, "
          f"failed {out['failed']}, duplicated {out['duplicated']}, {change.get('message', '')}", flush=True)
    return out


def run(quick: bool) -> dict[str, Any]:
    duration_s = 7.0 if quick else 10.0
    change_at_s = 2.0 if quick else 3.0
    runs = {m: one(m, duration_s, change_at_s) for m in ("none", "overlap", "restart")}
    ov, rs = runs["overlap"], runs["restart"]
    summary = {
        "overlap_downtime_ms": ov["downtime_ms"], "restart_downtime_ms": rs["downtime_ms"],
        "overlap_lost": ov["lost"], "overlap_duplicated": ov["duplicated"], "requests": ov["requests"],
        "overlap_failed": ov["failed"], "overlap_max_gap_ms": ov["max_gap_ms"],
        "overlap_change_max_gap_ms": ov.get("change_max_gap_ms"), "overlap_init_max_gap_ms": ov.get("init_max_gap_ms"),
        "overlap_change_downtime_ms": round(ov["change_max_gap_ms"] - ov["steady_gap_ms"], 3),
        "overlap_change_total_ms": ov.get("change_total_ms"), "overlap_ok": ov.get("change_ok"),
        "restart_lost": rs["lost"], "restart_late": rs["late"], "overlap_late": ov["late"], "restart_failed": rs["failed"], "restart_duplicated": rs["duplicated"],
        "restart_max_gap_ms": rs["max_gap_ms"], "restart_requests": rs["requests"],
        "restart_change_total_ms": rs.get("change_total_ms"),
        "baseline_max_gap_ms": runs["none"]["max_gap_ms"], "steady_gap_ms": ov["steady_gap_ms"],
        "overlap_slo_attainment": ov["slo_attainment"], "restart_slo_attainment": rs["slo_attainment"],
        "rate_rps": RATE, "from_pct": FROM_PCT, "to_pct": TO_PCT, "input_shape": "x".join(map(str, SHAPE)),
        "model": MODEL,
    }
    return {"summary": summary, "samples": runs}


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["samples"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 6.5), sharex=True)
    bin_ms = 20.0
    titles = {"none": f"no change ({FROM_PCT}%)",
              "overlap": f"Overlapped-Execution {FROM_PCT}% -> {TO_PCT}%",
              "restart": f"kill and restart {FROM_PCT}% -> {TO_PCT}%"}
    end = max(float(np.max(r["completions_ms"])) for r in runs.values() if len(r["completions_ms"]))
    bins = np.arange(0, end + bin_ms, bin_ms)
    for ax, (mode, r) in zip(axes, runs.items()):
        c = np.asarray(r["completions_ms"])
        ax.hist(c, bins=bins, weights=np.full(len(c), 1e3 / bin_ms), histtype="stepfilled", alpha=0.7)
        for e in r["events"]:
            ax.axvline(e["t_ms"], color="r" if e["event"] == "switch" else "k", linestyle="--", linewidth=1)
        if mode != "none":
            ax.axvspan(*r["window_ms"], color="orange", alpha=0.15)
        ax.set_ylabel("answered/s")
        extra = "" if mode == "none" else f", downtime {r['downtime_ms']:.1f} ms, lost {r['lost']}, failed {r['failed']}"
        ax.set_title(f"{titles[mode]}{extra}", fontsize=9)
    axes[-1].set_xlabel(f"ms since the first measured request ({bin_ms:g} ms bins; red: route switch, "
                        "black: change done)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    args = ap.parse_args()
    res = run(args.quick)
    notes = ("CPU backend (no GPU): GPU% 100 -> 50 is two cores -> one core (plan_cpu_shares); the shadow's model load "
             "and warm-up at the new share compete with the active for the CPU, where on a GPU it would overlap on "
             "the device. MobileNetV2 at 3x32x32 float32, constant 100 req/s, max_batch 8, no batching wait. "
             "downtime = longest stretch without an OK completion from the moment the old instance stops taking requests "
             "(overlap: the route switch; restart: the kill) to 0.5 s after the change completed, minus the median gap "
             "before the change (near 0 = no visible interruption). overlap_init_max_gap_ms: largest gap while the shadow "
             "initialised, before the switch; overlap_change_*: largest gap over the whole change. On 2 CPU cores the "
             "shadow's model load and warm-up, and the next shadow's start-up, take CPU from the active (a two-thread "
             "instance at 100% stalls whenever a core is taken), which a GPU's spare SMs would not. baseline_max_gap_ms "
             "is the unchanged run's largest gap in the same kind of window (machine noise). failed = answered with a non-OK status (the restart "
             "baseline answers what the killed instance held INSTANCE_FAILED). Shared 2-core machine: noisy.")
    path = write_result("overlap", "cpu", res["summary"], res["samples"], notes=notes)
    plot(res, str(path.with_suffix(".png")))
    print(path)
    for k, v in res["summary"].items():
        print(f"{k:>28}: {v}")


if __name__ == "__main__":
    main()
