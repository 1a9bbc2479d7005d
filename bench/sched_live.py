"""bench/sched_live: the paper's Table III mix served live by a node under both schedulers.

The live half of ``bench/sched`` (which simulates): ``examples/apps-table3.yaml`` on this machine's backend (the CPU backend
here: "GPU%" is a share of the cores, threads = round(cores x GPU%)) runs

- DNN-Recog: ``recog_router`` (MobileNetV2, 25%) routing person -> ``vgg_face`` (VGG-16, 40%) and
  vehicle -> ``resnet_car`` (ResNet-50, 50%), one instance holding the three stages;
- a YOLO-class app at 60%: the zoo has no YOLO, so ResNet-50 stands in (labelled ``yolo_standin``);
- ResNeXt-50 32x4d at 50%;

all on 3x32x32 float32 requests (the paper's 224x224 models would not meet any interactive deadline
on two CPU cores) with one end-to-end deadline ``DEADLINE_MS`` and scheduling rounds of the same
length (the paper: 30 ms for both on a V100). The traffic tool sends the Table III proportions (8
DNN-Recog : 2 YOLO : 1 ResNeXt requests per round) times a load factor, as Poisson arrivals, under
``node.scheduler: spatiotemporal`` and then ``temporal`` (exclusive access, round-robin, the largest
batch within the deadline). Reported per scheduler and load: goodput (requests answered OK within the
deadline, per second), miss rate (1 - goodput/offered: late, rejected or lost), p50/p99 of the OK
answers, the scheduler's own counters (runs, mean batch, rejects, probes) and its learned corrections.

Where the misses come from, per scheduler and load: the client's view per app (OK in time, OK but
late, DEADLINE_MISSED answers, lost) and the node's run log (``LiveScheduler.run_log``) per stage:
model time measured vs the prediction the plan used (profile error), the round trip the node adds
around the model (RunBatch sent to BatchDone received, minus the model time: messaging, gather,
answer, control-loop waits), and the slack the plan left.

The simulator on the same mix (``sim_*``): the same scheduler class, the profiles this live node used
(its instances' warm-up measurements), the model times it really measured (per model the median of
measured / profiled latency as ``true_scale``, the spread of that ratio as log-normal jitter), the
route split DNN-Recog's router really made, Poisson arrivals at the same rates, same deadline and
rounds. So ``sim_throughput_ratio`` is what this scheduler would reach here if running a batch cost
only its model time; the gap to live is the node's overhead and the contention the shares do not isolate.

Run: ``python3 -m bench.sched_live [--quick]``. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench import serving as sv
from bench.common import results_dir, write_result
from gpuprims import wire
from gpuprims.sched.scheduler import make_scheduler
from gpuprims.sched.sim import Arrival, Workload, simulate
from orchestrator.config.schema import parse_config
from orchestrator.node.dispatch import PROBE_MS, RunRecord
from orchestrator.node.node import Node

SHAPE = (3, 32, 32)
DEADLINE_MS = 400.0
PER_ROUND = {"dnn_recog": 8, "yolo_standin": 2, "resnext": 1}  # paper Table III: requests per round
APP_IDS = {"dnn_recog": 11, "yolo_standin": 12, "resnext": 13}


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "apps-table3.yaml"


def config(scheduler: str) -> Any:
    """``examples/apps-table3.yaml`` under ``scheduler``, on an ephemeral loopback port."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data["node"].update({"scheduler": scheduler, "round_ms": DEADLINE_MS, "log_level": "WARNING", "autoscale": False,
                         "listen": {"host": "127.0.0.1", "port": [0]}})
    for a in data["apps"]:
        assert a["slo_ms"] == DEADLINE_MS and tuple(a["input_shape"]) == SHAPE, "bench and example disagree"
    return parse_config(data, source=str(EXAMPLE))


def client_breakdown(rep: Any, app_id: int) -> dict[str, int]:
    """Measured requests of one app: OK within the deadline, OK but late, DEADLINE_MISSED, other, lost."""
    s = rep.samples
    m = (s["app_id"] == app_id) & ~s["warmup"] & (s["sent_ns"] >= 0)
    ans = m & (s["state"] == 1)
    ok = ans & (s["status"] == int(wire.Status.OK))
    in_time = ok & (s["latency_ns"] <= DEADLINE_MS * 1e6)
    dm = ans & (s["status"] == int(wire.Status.DEADLINE_MISSED))
    return {"ok_in_time": int(in_time.sum()), "ok_late": int((ok & ~in_time).sum()), "deadline_missed": int(dm.sum()),
            "other_error": int((ans & ~ok & ~dm).sum()), "lost": int((m & ~ans).sum())}


def run_log_breakdown(records: list[RunRecord]) -> dict[str, dict[str, Any]]:
    """Per stage: runs, requests, measured/predicted model time, node overhead and slack (p50/p99), late heads."""
    out: dict[str, dict[str, Any]] = {}
    for key in sorted({r.key for r in records}):
        rs = [r for r in records if r.key == key]
        ratio = np.array([r.measured_ms / r.predicted_ms for r in rs if r.predicted_ms > 0])
        over = np.array([r.overhead_ms for r in rs])
        slack = np.array([r.slack_ms for r in rs])
        out[key] = {"runs": len(rs), "requests": sum(r.batch for r in rs),
                    "measured_over_predicted_p50": round(float(np.median(ratio)), 3) if ratio.size else None,
                    "measured_over_predicted_p90": round(float(np.percentile(ratio, 90)), 3) if ratio.size else None,
                    "model_ms_p50": round(float(np.median([r.measured_ms for r in rs])), 2),
                    "overhead_ms_p50": round(float(np.median(over)), 2),
                    "overhead_ms_p99": round(float(np.percentile(over, 99)), 2),
                    "slack_ms_p50": round(float(np.nanmedian(slack)), 2),
                    "late_heads": sum(r.late for r in rs)}
    return out


def simulate_same_mix(node: Node, scheduler: str, load: float, duration_s: float, records: list[RunRecord],
                      seed: int) -> dict[str, Any]:
    """The simulator on this run's mix, with the profiles the live node used and the times it measured."""
    live = node.dispatcher
    sapps = list(live.sapps.values())
    profiles = live.scheduler.profiles
    ratios: dict[str, list[float]] = {}
    for a in sapps:
        for st in a.stages:
            pct = 100 if scheduler == "temporal" else st.gpu_pct
            for r in records:
                if r.key == a.key(st.name):
                    base = profiles[st.model].latency_ms(r.batch, pct)
                    if base > 0 and r.measured_ms > 0:
                        ratios.setdefault(st.model, []).append(r.measured_ms / base)
    scale = {m: float(np.median(v)) for m, v in ratios.items()}
    logs = np.concatenate([np.log(np.asarray(v) / scale[m]) for m, v in ratios.items()]) if ratios else np.zeros(1)
    jitter = float(np.std(logs))
    routes: dict[str, dict[str, float]] = {}
    for a in sapps:
        if len(a.stages) > 1:
            entry = a.entry.name
            n_in = sum(r.batch for r in records if r.key == a.key(entry))
            probs = {}
            for label, nxt in a.entry.routes.items():
                n = sum(r.batch for r in records if r.key == a.key(nxt))
                probs[label] = min(1.0, n / n_in) if n_in else 0.5
            total = sum(probs.values())
            routes[entry] = {k: v / total for k, v in probs.items()} if total > 1 else probs
    instances = ({a.key(st.name): a.name for a in sapps for st in a.stages}
                 if any(len(a.stages) > 1 for a in sapps) else None)
    sched = make_scheduler(scheduler, sapps, profiles, round_ms=DEADLINE_MS, instances=instances,
                           max_batch=max(a.max_batch for a in live.apps.values()), probe_ms=PROBE_MS,
                           exclusive=live.exclusive)
    workloads = [Workload(a, Arrival("poisson", PER_ROUND[a.name] * load * 1000.0 / DEADLINE_MS),
                          routes if len(a.stages) > 1 else {}) for a in sapps]
    res = simulate(sched, workloads, duration_ms=duration_s * 1000.0 + 1000.0, warmup_ms=1000.0, seed=seed,
                   jitter_sigma=jitter, true_scale=scale)
    tot = res["total"]
    return {"goodput_rps": round(tot["throughput_rps"], 2), "miss_rate": round(tot["miss_rate"], 4),
            "late": tot["late"], "rejected": tot["rejected"], "offered": tot["offered"],
            "true_scale": {m: round(v, 3) for m, v in scale.items()}, "jitter_sigma": round(jitter, 3),
            "route_probs": routes, "apps": {k: {"throughput_rps": round(v["throughput_rps"], 2),
                                                "miss_rate": round(v["miss_rate"], 4),
                                                "mean_entry_batch": v["mean_entry_batch"]}
                                            for k, v in res["apps"].items()}}


def measure(node: Node, scheduler: str, load: float, duration_s: float,
            start_s: float) -> tuple[dict[str, Any], list[RunRecord]]:
    """One live run of the mix at `load` on a started node, with its breakdown and the simulator beside it."""
    streams = [sv.stream(APP_IDS[a], SHAPE, n * load * 1000.0 / DEADLINE_MS, duration_s, sv.port_of(node),
                         process="poisson") for a, n in PER_ROUND.items()]
    before = dict(node.dispatcher.status())
    log_before = len(node.dispatcher.run_log)
    rep = sv.drive(node, streams, timeout_s=duration_s + 30, slo_ms=DEADLINE_MS, seed=int(load * 100))
    end = time.monotonic() + 5
    while node.dispatcher.inflight and time.monotonic() < end:
        node.step(10)
    after = node.dispatcher.status()
    records = list(node.dispatcher.run_log)[log_before:]
    apps = {a: sv.app_stats(rep, APP_IDS[a], DEADLINE_MS) for a in PER_ROUND}
    for a in PER_ROUND:
        apps[a]["breakdown"] = client_breakdown(rep, APP_IDS[a])
    sim = simulate_same_mix(node, scheduler, load, duration_s, records, seed=int(load * 100))
    offered = sum(s["offered_rps"] for s in apps.values())
    good = sum(s["goodput_rps"] for s in apps.values())
    runs = after["runs"] - before["runs"]
    row = {
        "scheduler": scheduler, "load": load, "duration_s": duration_s, "node_start_s": start_s,
        "offered_rps": offered, "goodput_rps": good, "miss_rate": 1 - good / offered if offered else None,
        "apps": apps, "runs": runs,
        "mean_batch": (after["run_requests"] - before["run_requests"]) / runs if runs else None,
        "rejected_requests": after["rejected_requests"] - before["rejected_requests"],
        "plans": after["plans"] - before["plans"], "corrections": after["corrections"],
        "probes": after["probes"] - before["probes"], "exclusive": after["exclusive"], "backend": node.backend,
        "run_log": run_log_breakdown(records), "sim": sim, "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    print(f"{scheduler:>14} load {load:4.2f}: offered {offered:6.1f} rps, goodput {good:6.1f} rps, "
          f"miss {row['miss_rate']:.3f}, mean batch {row['mean_batch']}; simulated goodput "
          f"{sim['goodput_rps']} rps, miss {sim['miss_rate']}", flush=True)
    return row, records


def sim_knee_load(node: Node, scheduler: str, records: list[RunRecord], duration_s: float) -> float:
    """The highest load (x Table III, steps of 0.05) the simulator, calibrated with the node's measured
    times, serves with <= 1 % misses: this machine's capacity for the mix under this scheduler."""
    best = 0.0
    for load in np.arange(0.05, 1.55, 0.05):
        sim = simulate_same_mix(node, scheduler, float(load), max(duration_s, 30.0), records, seed=7)
        if sim["miss_rate"] <= 0.01:
            best = round(float(load), 2)
    return best


def run_scheduler(scheduler: str, loads: list[float], duration_s: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The mix at each load, then at 0.8 x the capacity the calibrated simulator finds (``sim_knee_load``)."""
    node = Node(config(scheduler), heartbeat_ms=100)
    out = []
    try:
        t0 = time.monotonic()
        node.start()
        start_s = time.monotonic() - t0
        all_records: list[RunRecord] = []
        for load in loads:
            row, records = measure(node, scheduler, load, duration_s, start_s)
            out.append(row)
            all_records += records
        knee = sim_knee_load(node, scheduler, all_records, duration_s)
        rel: dict[str, Any] = {"sim_knee_load": knee}
        if knee > 0:
            row, _ = measure(node, scheduler, round(0.8 * knee, 3), duration_s, start_s)
            row["of_capacity"] = 0.8
            rel["live_at_0.8_knee"] = row
    finally:
        node.stop()
    return out, rel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one load, short runs")
    args = ap.parse_args()
    loads = [0.5] if args.quick else [0.25, 0.5, 0.8, 1.0, 1.5]
    load_before = os.getloadavg()
    duration_s = 6.0 if args.quick else 10.0
    both = {s: run_scheduler(s, loads, duration_s) for s in ("spatiotemporal", "temporal")}
    rows = {s: r[0] for s, r in both.items()}
    rel = {s: r[1] for s, r in both.items()}
    by_load = []
    for st, tp in zip(rows["spatiotemporal"], rows["temporal"]):
        by_load.append({"load": st["load"], "offered_rps": st["offered_rps"],
                        "spatiotemporal_goodput_rps": st["goodput_rps"], "temporal_goodput_rps": tp["goodput_rps"],
                        "throughput_ratio": st["goodput_rps"] / tp["goodput_rps"] if tp["goodput_rps"] else None,
                        "spatiotemporal_miss_rate": st["miss_rate"], "temporal_miss_rate": tp["miss_rate"],
                        "sim_spatiotemporal_goodput_rps": st["sim"]["goodput_rps"],
                        "sim_temporal_goodput_rps": tp["sim"]["goodput_rps"],
                        "sim_throughput_ratio": (st["sim"]["goodput_rps"] / tp["sim"]["goodput_rps"]
                                                 if tp["sim"]["goodput_rps"] else None),
                        "sim_spatiotemporal_miss_rate": st["sim"]["miss_rate"],
                        "sim_temporal_miss_rate": tp["sim"]["miss_rate"],
                        "live_over_sim_goodput": (st["goodput_rps"] / st["sim"]["goodput_rps"]
                                                  if st["sim"]["goodput_rps"] else None)})
    # Headline: the load where spatio-temporal scheduling serves the most within the deadline.
    best = max(by_load, key=lambda r: r["spatiotemporal_goodput_rps"])
    backend = rows["spatiotemporal"][0]["backend"]
    summary: dict[str, Any] = {
        "mode": "live",
        "backend": backend,
        "deadline_ms": DEADLINE_MS,
        "input_shape": "x".join(map(str, SHAPE)),
        "load": best["load"],
        "throughput_ratio": best["throughput_ratio"],
        "miss_rate": best["spatiotemporal_miss_rate"],
        "temporal_miss_rate": best["temporal_miss_rate"],
        "spatiotemporal_throughput_rps": best["spatiotemporal_goodput_rps"],
        "temporal_throughput_rps": best["temporal_goodput_rps"],
        "offered_rps": best["offered_rps"],
        "machine_load_avg_1min": os.getloadavg()[0],
    }
    for r in by_load:
        lv = f"{r['load']:g}"
        summary[f"throughput_ratio_load_{lv}"] = r["throughput_ratio"]
        summary[f"sim_throughput_ratio_load_{lv}"] = r["sim_throughput_ratio"]
        summary[f"miss_rate_load_{lv}"] = r["spatiotemporal_miss_rate"]
        summary[f"sim_miss_rate_load_{lv}"] = r["sim_spatiotemporal_miss_rate"]
        summary[f"live_over_sim_goodput_load_{lv}"] = r["live_over_sim_goodput"]
    summary["sim_throughput_ratio"] = best["sim_throughput_ratio"]
    for s, r in rel.items():
        summary[f"{s}_sim_knee_load"] = r["sim_knee_load"]
        row = r.get("live_at_0.8_knee")
        if row is not None:
            summary[f"{s}_miss_rate_at_0.8_knee"] = row["miss_rate"]
            summary[f"{s}_sim_miss_rate_at_0.8_knee"] = row["sim"]["miss_rate"]
            summary[f"{s}_goodput_rps_at_0.8_knee"] = row["goodput_rps"]
    notes = (f"Live on the {backend} backend of this machine: the schedulers, instances, ingest, traffic tool "
             "and this process share its cores. YOLO is not in the zoo: ResNet-50 stands in. 3x32x32 inputs, "
             f"{DEADLINE_MS:.0f} ms deadline and rounds (the paper: 224x224, 30 ms on a V100). Throughput counts "
             "requests answered OK within the deadline (client-measured); miss rate = 1 - that / offered.")
    notes += (" *_sim_knee_load = the highest load the calibrated simulator serves with <= 1 % misses (this "
              "machine's capacity for the mix; load is relative to the paper's Table III rates, not to this "
              "machine); *_at_0.8_knee = a live run at 0.8 x that.")
    notes += (" sim_* = the simulator on the same mix with this node's own profiles, measured model times "
              "(true_scale, jitter) and route split (see the module docstring); it charges no time for dispatch, "
              "gather or answer, nor contention beyond what the measured model times contain.")
    path = write_result("sched_live", backend, summary, {"by_load": by_load, "runs": rows, "capacity": rel}, notes=notes,
                        load_avg_before=load_before)
    plot(by_load, results_dir(backend) / "sched_live.png")
    print(f"wrote {path}")
    for k, v in summary.items():
        print(f"  {k}: {v}")


def plot(by_load: list[dict[str, Any]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    loads = [r["load"] for r in by_load]
    a1.plot(loads, [r["offered_rps"] for r in by_load], "k:", label="offered")
    a1.plot(loads, [r["spatiotemporal_goodput_rps"] for r in by_load], "o-", label="spatio-temporal")
    a1.plot(loads, [r["temporal_goodput_rps"] for r in by_load], "s--", label="temporal (Triton-like)")
    if "sim_spatiotemporal_goodput_rps" in by_load[0]:
        a1.plot(loads, [r["sim_spatiotemporal_goodput_rps"] for r in by_load], "C0:", marker="o", mfc="none",
                label="spatio-temporal, simulated (this node's times)")
        a1.plot(loads, [r["sim_temporal_goodput_rps"] for r in by_load], "C1:", marker="s", mfc="none",
                label="temporal, simulated (this node's times)")
    a1.set_xlabel("load (x Table III proportions)")
    a1.set_ylabel(f"requests/s OK within {DEADLINE_MS:.0f} ms")
    a1.set_title("Table III mix, live")
    a1.legend(fontsize=8)
    a1.grid(True, alpha=0.3)
    a2.plot(loads, [r["spatiotemporal_miss_rate"] for r in by_load], "o-", label="spatio-temporal")
    a2.plot(loads, [r["temporal_miss_rate"] for r in by_load], "s--", label="temporal")
    if "sim_spatiotemporal_miss_rate" in by_load[0]:
        a2.plot(loads, [r["sim_spatiotemporal_miss_rate"] for r in by_load], "C0:", marker="o", mfc="none",
                label="spatio-temporal, simulated")
        a2.plot(loads, [r["sim_temporal_miss_rate"] for r in by_load], "C1:", marker="s", mfc="none",
                label="temporal, simulated")
    a2.set_xlabel("load")
    a2.set_ylabel("deadline-miss rate")
    a2.legend(fontsize=8)
    a2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
