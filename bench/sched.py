"""bench/sched: spatio-temporal scheduling with Batch-Latency vs temporal round-robin (paper Table III).

Mode ``simulated``: the paper's Table III mix (DNN-Recog = mobilenet -> vgg_face | resnet_car, a
YOLO-class model at 60% GPU (simulated only: the zoo has no YOLO), ResNeXt-50 at 50%; 30 ms deadline, 30 ms rounds) runs through the
simulator with the paper-derived profiles (``gpuprims/profile/paper``), under both schedulers:

- at the load the paper's Table III implies (8 DNN-Recog, 2 Yolo, 1 ResNext request per 30 ms
  round, delivered as one burst per round like synchronised 30 fps cameras), the headline;
- a sweep over load multipliers, with in-step bursts and with Poisson arrivals;
- with 10% log-normal execution jitter and a 20%-optimistic profile (true latency 1.2x the
  profile), with and without learning from measured latencies.

It also reports the simulator's speed: simulated requests per wall second for 8 GPUs x 32 apps.
Every figure here is simulated (no model runs); bench/sched_live serves the same mix live.

Run: ``python3 -m bench.sched [--quick]``. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from bench.common import results_dir, write_result
from gpuprims.profile import paper_profiles
from gpuprims.sched.scenarios import TABLE3_PER_ROUND, many_apps, paper_table3
from gpuprims.sched.scheduler import make_scheduler
from gpuprims.sched.sim import simulate, simulate_sharded

# Paper Table III (V100): throughput (rps) and batch size per app, temporal (Triton) vs Batch-Latency.
PAPER_TABLE3 = {
    "dnn_recog": {"temporal_rps": 67, "spatiotemporal_rps": 266, "temporal_batch": 2, "spatiotemporal_batch": 8},
    "yolo": {"temporal_rps": 15, "spatiotemporal_rps": 60, "temporal_batch": 0.5, "spatiotemporal_batch": 2},
    "resnext": {"temporal_rps": 15, "spatiotemporal_rps": 30, "temporal_batch": 0.5, "spatiotemporal_batch": 1},
}


def run_pair(workloads: list, duration_ms: float, **kw: Any) -> dict[str, dict[str, Any]]:
    ps = paper_profiles()
    sim_kw = {k: kw.pop(k) for k in ("jitter_sigma", "true_scale", "seed") if k in kw}
    out = {}
    for name in ("temporal", "spatiotemporal"):
        sch = make_scheduler(name, [w.app for w in workloads], ps, **kw)
        out[name] = simulate(sch, workloads, duration_ms=duration_ms, warmup_ms=min(1000.0, duration_ms / 10),
                             **sim_kw)
    return out


def speed_run(name: str, workloads: list, duration_ms: float) -> dict[str, Any]:
    """Wall and CPU seconds to simulate ``workloads`` under scheduler ``name`` on 8 GPUs."""
    sch = make_scheduler(name, [w.app for w in workloads], paper_profiles(), num_gpus=8)
    t0 = time.perf_counter()
    r = simulate(sch, workloads, duration_ms=duration_ms)
    wall = time.perf_counter() - t0
    return {"simulated_s": duration_ms / 1000, "wall_s": wall, "cpu_s": r["cpu_s"],
            "requests": r["total"]["offered"], "requests_per_wall_s": r["total"]["offered"] / wall,
            "requests_per_cpu_s": r["sim_requests_per_cpu_s"], "plans": r["plans"],
            "one_hour_trace_wall_s_est": wall * 3_600_000.0 / duration_ms,
            "one_hour_trace_cpu_s_est": r["cpu_s"] * 3_600_000.0 / duration_ms,
            "miss_rate": r["total"]["miss_rate"], "gpu_util_mean": sum(r["gpu_util"]) / 8}


def ratio(pair: dict[str, dict[str, Any]]) -> float | None:
    t = pair["temporal"]["total"]["throughput_rps"]
    return pair["spatiotemporal"]["total"]["throughput_rps"] / t if t else None


def slim(res: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in res.items() if k not in ("dispatches",)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short simulated durations")
    args = ap.parse_args()
    dur_ms = 5_000.0 if args.quick else 60_000.0
    samples: dict[str, Any] = {"simulated": True, "paper_table3": PAPER_TABLE3,
                               "requests_per_round_at_load_1": TABLE3_PER_ROUND}

    head = run_pair(paper_table3(load=1.0, kind="constant"), dur_ms)
    samples["table3_load1_constant"] = {k: slim(v) for k, v in head.items()}
    head_p = run_pair(paper_table3(load=1.0, kind="poisson"), dur_ms)
    samples["table3_load1_poisson"] = {k: slim(v) for k, v in head_p.items()}

    sweep: list[dict[str, Any]] = []
    loads = (0.5, 1.0, 2.0) if args.quick else (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
    for kind in ("constant", "poisson"):
        for load in loads:
            pair = run_pair(paper_table3(load=load, kind=kind), dur_ms / 2)
            sweep.append({"kind": kind, "load": load, "throughput_ratio": ratio(pair),
                          **{f"{n}_throughput_rps": pair[n]["total"]["throughput_rps"] for n in pair},
                          **{f"{n}_miss_rate": pair[n]["total"]["miss_rate"] for n in pair}})
    samples["load_sweep"] = sweep

    noisy = {}
    for learn in (0.0, 0.2):
        noisy[f"learn_rate_{learn}"] = {k: slim(v) for k, v in run_pair(
            paper_table3(load=1.0, kind="constant"), dur_ms, jitter_sigma=0.1,
            true_scale={"vgg_face": 1.2, "resnet_car": 1.2, "yolov3": 1.2, "resnext50": 1.2, "recog_router": 1.2},
            learn_rate=learn, seed=1).items()}
    samples["jitter10_profile_20pct_optimistic"] = noisy

    # Simulator speed: 8 GPUs x 32 apps, Poisson 50 rps per app (1600 rps offered in all), and at
    # 200 rps per app, where batches grow and one plan serves more requests.
    speed: dict[str, Any] = {}
    speed_200: dict[str, Any] = {}
    speed_ms = 10_000.0 if args.quick else 60_000.0
    for rate, into in ((50.0, speed), (200.0, speed_200)):
        wl = many_apps(num_gpus=8, num_apps=32, rate_rps=rate)
        for name in ("spatiotemporal", "temporal"):
            into[name] = speed_run(name, wl, speed_ms * 50.0 / rate)
    samples["sim_speed_8gpu_32apps_50rps"] = speed
    samples["sim_speed_8gpu_32apps_200rps"] = speed_200
    # The same 50 rps node split by GPU over this machine's cores (simulate_sharded).
    procs = min(8, os.cpu_count() or 1)
    wl = many_apps(num_gpus=8, num_apps=32, rate_rps=50.0)
    sharded: dict[str, Any] = {"processes": procs}
    for name in ("spatiotemporal", "temporal"):
        t0 = time.perf_counter()
        r = simulate_sharded(name, wl, paper_profiles(), num_gpus=8, processes=procs, duration_ms=speed_ms)
        wall = time.perf_counter() - t0
        sharded[name] = {"wall_s": wall, "requests": r["total"]["offered"],
                         "requests_per_wall_s": r["total"]["offered"] / wall,
                         "one_hour_trace_wall_s_est": wall * 3_600_000.0 / speed_ms}
    samples["sim_speed_8gpu_32apps_50rps_sharded"] = sharded

    st, tp = head["spatiotemporal"], head["temporal"]
    summary: dict[str, Any] = {
        "mode": "simulated",
        "throughput_ratio": ratio(head),
        "miss_rate": st["total"]["miss_rate"],
        "temporal_miss_rate": tp["total"]["miss_rate"],
        "throughput_ratio_poisson": ratio(head_p),
        "miss_rate_poisson": head_p["spatiotemporal"]["total"]["miss_rate"],
        "spatiotemporal_throughput_rps": st["total"]["throughput_rps"],
        "temporal_throughput_rps": tp["total"]["throughput_rps"],
        "paper_throughput_ratio": sum(v["spatiotemporal_rps"] for v in PAPER_TABLE3.values())
        / sum(v["temporal_rps"] for v in PAPER_TABLE3.values()),
        "sim_requests_per_wall_s": min(v["requests_per_wall_s"] for v in speed.values()),
        "sim_one_hour_trace_wall_s_est": max(v["one_hour_trace_wall_s_est"] for v in speed.values()),
        "sim_requests_per_cpu_s": min(v["requests_per_cpu_s"] for v in speed.values()),
        "sim_one_hour_trace_cpu_s_est": max(v["one_hour_trace_cpu_s_est"] for v in speed.values()),
        "sim_requests_per_cpu_s_200rps": min(v["requests_per_cpu_s"] for v in speed_200.values()),
        "sim_one_hour_trace_cpu_s_est_200rps": max(v["one_hour_trace_cpu_s_est"] for v in speed_200.values()),
        "sim_sharded_processes": procs,
        "sim_sharded_one_hour_trace_wall_s_est": max(sharded[n]["one_hour_trace_wall_s_est"]
                                                     for n in ("spatiotemporal", "temporal")),
        "machine_load_avg_1min": os.getloadavg()[0],
    }
    for app in PAPER_TABLE3:
        for n, res in head.items():
            summary[f"{app}_{n}_throughput_rps"] = res["apps"][app]["throughput_rps"]
            summary[f"{app}_{n}_mean_batch"] = res["apps"][app]["mean_entry_batch"]
            summary[f"{app}_{n}_p99_ms"] = res["apps"][app]["latency_p99_ms"]
    notes = ("Simulated with paper-derived profiles (approximations of the paper's figures; see each profile's "
             "source_note); CSS isolation assumed (no interference between concurrent slices). DNN-Recog routing "
             "assumed 50% person / 40% vehicle / 10% neither. Deadline counts from arrival; throughput counts "
             "requests that met it.")
    path = write_result("sched", "cpu", summary, samples, notes=notes)
    plot(head, sweep, results_dir("cpu") / "sched.png")
    print(f"wrote {path}")
    for k in ("throughput_ratio", "miss_rate", "temporal_miss_rate", "throughput_ratio_poisson",
              "sim_requests_per_wall_s", "sim_requests_per_cpu_s", "sim_one_hour_trace_cpu_s_est",
              "sim_requests_per_cpu_s_200rps", "sim_one_hour_trace_cpu_s_est_200rps",
              "sim_sharded_one_hour_trace_wall_s_est", "machine_load_avg_1min"):
        print(f"  {k}: {summary[k]}")


def plot(head: dict[str, dict[str, Any]], sweep: list[dict[str, Any]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    apps = list(PAPER_TABLE3)
    x = range(len(apps))
    w = 0.2
    for i, (label, vals) in enumerate([
        ("temporal (sim)", [head["temporal"]["apps"][a]["throughput_rps"] for a in apps]),
        ("spatio-temporal (sim)", [head["spatiotemporal"]["apps"][a]["throughput_rps"] for a in apps]),
        ("temporal (paper)", [PAPER_TABLE3[a]["temporal_rps"] for a in apps]),
        ("Batch-Latency (paper)", [PAPER_TABLE3[a]["spatiotemporal_rps"] for a in apps]),
    ]):
        a1.bar([j + (i - 1.5) * w for j in x], vals, w, label=label)
    a1.set_xticks(list(x), apps)
    a1.set_ylabel("requests/s meeting the 30 ms deadline")
    a1.set_title("Table III mix, load 1.0 (simulated)")
    a1.legend(fontsize=8)
    for kind, style in (("constant", "o-"), ("poisson", "s--")):
        pts = [(s["load"], s["throughput_ratio"]) for s in sweep if s["kind"] == kind and s["throughput_ratio"]]
        a2.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{kind} arrivals")
    a2.axhline(1.0, color="grey", lw=0.8)
    a2.set_xlabel("load (x Table III rates)")
    a2.set_ylabel("throughput ratio spatio-temporal / temporal")
    a2.set_title("Load sweep (simulated)")
    a2.legend(fontsize=8)
    a2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
