"""bench/coexec: CPU co-execution (issue #18): SIR+, DUET and Chrion scenarios, ours beside the papers'.

Accelerator profiles come from the papers' tables (``gpuprims/coexec/profiles/paper``); CPU profiles
were measured on this machine (``gpuprims/coexec/profiles/cpu``; ``--measure-cpu`` measures them
again: ``gpuprims-profile --device cpu --stages`` for the DUET models and ResNet-50, and the LSTM cell
time with 1..N busy cores). The three scenarios (``gpuprims.sched.coexec_scenarios``) are simulated from
these profiles: no accelerator ran here. Writes ``bench/results/<machine>/coexec.json`` (+ ``.png``).

``--live-overflow`` instead runs SIR+ request overflow LIVE on a node (CPU backend): one app whose
"accelerator" instance has one core and whose CPU overflow pool has the other, offered Poisson load
above the accelerator instance's capacity, once with ``overflow: cpu`` and once without; it records
throughput, p50/p99, SLO attainment, lost answers and the per-device split into the ``live_overflow``
section of the same ``coexec.json`` (the simulated sections are kept as they are).

Run: ``python3 -m bench.coexec [--measure-cpu] [--quick]`` or ``python3 -m bench.coexec --live-overflow
[--duration S] [--load X]``. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from bench import serving as sv
from bench.common import ROOT, git_commit, machine_info, results_dir, write_result
from gpuprims.profile import save_profile, with_stages
from gpuprims.sched.coexec_scenarios import paper_chrion, paper_duet, paper_sir
from orchestrator.config.schema import parse_config
from orchestrator.node.dispatch import measured_profile

CPU_DIR = ROOT / "gpuprims" / "coexec" / "profiles" / "cpu"

#: (model, extra gpuprims-profile arguments): the shapes the papers ran, where a 2-core CPU can.
CPU_PROFILES: tuple[tuple[str, list[str]], ...] = (
    ("siamese", ["--stages", "--input-shape", "2,64,64", "--repeats", "30", "--warmup", "5"]),
    ("wide_deep", ["--stages", "--input-shape", "1,1,152184", "--repeats", "20", "--warmup", "3"]),
    ("mt_dnn", ["--stages", "--input-shape", "1,32,768", "--width", "4", "--repeats", "20", "--warmup", "3"]),
    ("resnet50", ["--repeats", "20", "--warmup", "3"]),
)


def _loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _cell_child(batch: int, features: int, workers: int) -> dict[int, float]:
    import torch

    torch.set_num_threads(1)
    from gpuprims.coexec.fx_exec import measure_lstm_cell_ms

    return measure_lstm_cell_ms(batch=batch, features=features, max_workers=workers, repeats=300)


def measure_cpu() -> None:
    """Measure the committed CPU profiles again on this machine."""
    exe = Path(sys.executable).with_name("gpuprims-profile")
    for model, extra in CPU_PROFILES:
        cmd = [str(exe), model, "--device", "cpu", "--batch", "1", "--gpu-pct", "50,100", "--no-progress",
               "--out", str(CPU_DIR / f"{model}.json"), *extra]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, timeout=1800)
    cores = len(os.sched_getaffinity(0))
    before = _loadavg()
    with get_context("spawn").Pool(1) as pool:
        per_k = pool.apply(_cell_child, (8, 64, cores))
    doc = {"model": "lstm_cell", "source": (
        f"measured here by bench/coexec.py --measure-cpu: one nn.LSTMCell(64, 64) step at batch 8, torch 1 thread "
        f"per worker, median of 300 steps while k workers step at once (k = 1..{cores}); load average "
        f"{before} before"), "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "cell_ms_by_busy_cores": {str(k): v for k, v in per_k.items()}}
    (CPU_DIR / "lstm_cell.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"lstm cell: {per_k}")


def _plot(sir: dict[str, Any], duet_: dict[str, Any], chrion: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for name, m in sir["models"].items():
        loads = [r["load"] for r in m["by_load"]]
        ax.plot(loads, [r["gpu_only"]["latency_mean_ms"] for r in m["by_load"]], "o--", label=f"{name} GPU only")
        ax.plot(loads, [r["overflow"]["latency_mean_ms"] for r in m["by_load"]], "o-", label=f"{name} + CPU overflow")
    ax.set_yscale("log")
    ax.set_xlabel("offered load (fraction of accelerator capacity)")
    ax.set_ylabel("mean latency (ms, simulated)")
    ax.set_title("SIR+: overflow at high load")
    ax.legend(fontsize=7)
    ax = axes[1]
    names = list(duet_["models"])
    xs = range(len(names))
    for off, key, label in ((-0.25, "gpu_only_ms", "GPU only"), (0.0, "cpu_only_ms", "CPU only"),
                            (0.25, "latency_ms", "DUET")):
        ax.bar([x + off for x in xs], [duet_["models"][n]["ours"][key] for n in names], 0.25, label=label)
    ax.set_xticks(list(xs), names)
    ax.set_yscale("log")
    ax.set_ylabel("latency at batch 1 (ms, planned)")
    ax.set_title("DUET: paper GPU + this CPU")
    ax.legend(fontsize=7)
    ax = axes[2]
    modes = [("GPU", "gpu_latency_ms", "gpu_mem_mb"), ("latency-opt", "latency_optimal_latency_ms",
                                                       "latency_optimal_mem_mb"),
             ("memory-opt", "memory_optimal_latency_ms", "memory_optimal_mem_mb")]
    ax.bar([m[0] for m in modes], [chrion[m[1]] for m in modes], color="C0", label="latency (ours)")
    ax.plot([m[0] for m in modes], [chrion["paper"][m[1]] for m in modes], "k*", markersize=12, label="latency (paper)")
    ax.set_ylabel("latency (ms, planned)")
    ax2 = ax.twinx()
    ax2.plot([m[0] for m in modes], [chrion[m[2]] for m in modes], "s-", color="C3", label="GPU MB (ours)")
    ax2.plot([m[0] for m in modes], [chrion["paper"][m[2]] for m in modes], "x--", color="C3", label="GPU MB (paper)")
    ax2.set_ylabel("GPU memory (MB)")
    ax.set_title("Chrion: 12x96 LSTM")
    ax.legend(fontsize=7, loc="lower left")
    ax2.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


LIVE_MODEL = "mobilenet_v2"
LIVE_SHAPE = (3, 32, 32)
LIVE_SLO_MS = 300.0
LIVE_BATCH = 8


def _live_config(overflow: bool, profiles: Path) -> Any:
    a = sv.app("cls", LIVE_MODEL, 1, shape=LIVE_SHAPE, slo_ms=LIVE_SLO_MS, gpu_pct=50, max_batch=LIVE_BATCH)
    if overflow:
        a.update(overflow="cpu", overflow_cores=1)
    return parse_config({"node": {"backend": "cpu", "listen": {"host": "127.0.0.1", "port": [0]}, "pool": sv.POOL,
                                  "log_level": "WARNING", "autoscale": False, "overflow_profiles": str(profiles),
                                  "overflow_reserved_cores": 1},
                         "apps": [a]}, source="bench.coexec")


def _live_run(overflow: bool, profiles: Path, rate: float, duration_s: float) -> dict[str, Any]:
    with sv.running_node(_live_config(overflow, profiles)) as node:
        st = sv.stream(1, LIVE_SHAPE, rate, duration_s, sv.port_of(node), process="poisson")
        rep = sv.drive(node, [st], timeout_s=duration_s + 60, slo_ms=LIVE_SLO_MS, seed=7)
        for _ in range(10):
            node.step(50)  # the last heartbeats, for the split
        stats = sv.app_stats(rep, 1, LIVE_SLO_MS)
        window = max(float(rep.summary["rate"]["window_s"]), 1e-9)
        app = node.status()["apps"]["cls"]
        out = {"overflow": overflow, "offered_rps_target": round(rate, 2), **stats,
               "throughput_rps": round(stats["ok"] / window, 2), "split": app.get("overflow"),
               "instances": sv.instance_stats(node, "cls")["instances"],
               "latency_ms_ok": np.round(sv.latencies_ms(rep, 1), 3).tolist()}
    print(f"overflow {'on ' if overflow else 'off'}: offered {stats['offered_rps']} rps, throughput "
          f"{out['throughput_rps']} rps, p50 {stats['p50_ms']} ms, p99 {stats['p99_ms']} ms, SLO "
          f"{stats['slo_attainment']}, lost {stats['lost']}", flush=True)
    return out


def live_overflow(duration_s: float, load: float) -> Path:
    """The ``--live-overflow`` mode (module docstring); returns the file it updated."""
    load_before = _loadavg()
    cores = sorted(os.sched_getaffinity(0))
    # The CPU pool's profile, measured now on the pool's core (what `gpuprims-profile --device cpu
    # --cores 1` measures); the accelerator instance's capacity, measured the same way on core 0.
    ms = {b: float(np.median(sv.torch_latency_ms(LIVE_MODEL, LIVE_SHAPE, b, cores=[cores[-1]], threads=1, reps=20)))
          for b in (1, LIVE_BATCH // 2, LIVE_BATCH)}
    accel_ms = float(np.median(sv.torch_latency_ms(LIVE_MODEL, LIVE_SHAPE, LIVE_BATCH, cores=[cores[0]], threads=1,
                                                   reps=20)))
    capacity = LIVE_BATCH * 1000.0 / accel_ms
    rate = load * capacity
    print(f"CPU profile (1 core) {ms}; accelerator instance capacity ~{capacity:.0f} rps; offering {rate:.0f} rps",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        prof = measured_profile(LIVE_MODEL, {str(b): v for b, v in ms.items()}, 100, backend="cpu",
                                input_shape=LIVE_SHAPE, dtype="float32", note="bench.coexec --live-overflow, 1 core")
        save_profile(with_stages(prof, [], device_kind="cpu", cpu_cores=1), Path(tmp) / f"{LIVE_MODEL}.cpu.json")
        runs = [_live_run(False, Path(tmp), rate, duration_s), _live_run(True, Path(tmp), rate, duration_s)]
    off, on = runs
    split = on["split"] or {}

    def ratio(a: Any, b: Any) -> float | None:
        return round(a / b, 3) if a and b else None

    summary = {
        "mode": "live", "model": LIVE_MODEL, "input_shape": list(LIVE_SHAPE), "slo_ms": LIVE_SLO_MS,
        "duration_s": duration_s, "load_vs_accel_capacity": load, "accel_capacity_rps": round(capacity, 1),
        "cpu_profile_ms": ms, "offered_rps": on["offered_rps"],
        **{f"{k}_{tag}": r[k] for tag, r in (("off", off), ("on", on))
           for k in ("throughput_rps", "p50_ms", "p99_ms", "slo_attainment", "lost", "duplicates", "ok", "sent")},
        "throughput_ratio": ratio(on["throughput_rps"], off["throughput_rps"]),
        "split_routed_accelerator": (split.get("accelerator") or {}).get("routed"),
        "split_routed_cpu": (split.get("cpu") or {}).get("routed"),
        "split_answered_accelerator": (split.get("accelerator") or {}).get("answered"),
        "split_answered_cpu": (split.get("cpu") or {}).get("answered"),
    }
    path = results_dir("cpu") / "coexec.json"
    doc = json.loads(path.read_text()) if path.exists() else {"experiment": "coexec"}
    machine = machine_info("cpu")
    machine["load_avg_before"] = load_before
    machine["load_avg_after"] = _loadavg()
    doc["live_overflow"] = {
        "command": " ".join([Path(sys.executable).name, "-m", "bench.coexec", *sys.argv[1:]]),
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(), "git": git_commit(),
        "machine": machine, "summary": summary, "samples": {"off": off, "on": on},
        "notes": ("Live on the CPU backend: the 'accelerator' instance is the same model on one core (gpu_pct 50), "
                  "the overflow pool the other core, so this shows the mechanism (routing, split, answers) and what "
                  "a second core adds at a load above one core's capacity, not a GPU's figures. The machine was "
                  "shared with other jobs (other helpers' builds and tests): see the load averages."),
    }
    path.write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary, indent=1))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure-cpu", action="store_true", help="measure the CPU profiles again first")
    ap.add_argument("--requests", type=int, default=20000, help="simulated requests per SIR run")
    ap.add_argument("--quick", action="store_true", help="fewer simulated requests (4000 per SIR run)")
    ap.add_argument("--live-overflow", action="store_true", help="run overflow live on a node (on vs off) instead")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load per live run")
    ap.add_argument("--load", type=float, default=1.5, help="offered load / the accelerator instance's capacity")
    args = ap.parse_args()
    if args.live_overflow:
        print(f"updated {live_overflow(args.duration, args.load)}")
        return
    if args.quick:
        args.requests = min(args.requests, 4000)
    load_before = _loadavg()
    if args.measure_cpu:
        measure_cpu()
    sir = paper_sir(requests=args.requests)
    duet_ = paper_duet()
    chrion = paper_chrion()
    summary: dict[str, Any] = {"mode": "simulated", "sir": {}, "duet": {}, "chrion": {}}
    for name, m in sir["models"].items():
        summary["sir"][name] = {k: v for k, v in m.items() if k != "by_load"}
    summary["sir"]["paper_model"] = sir["paper"]["model"]
    summary["sir"].update({f"paper_{k}": v for k, v in sir["paper"].items() if k != "model"})
    for name, m in duet_["models"].items():
        o, p = m["ours"], m["paper_pair"]
        summary["duet"][name] = {
            "latency_ms": o["latency_ms"], "gpu_only_ms": o["gpu_only_ms"], "cpu_only_ms": o["cpu_only_ms"],
            "speedup_vs_gpu": o["speedup_vs_gpu"], "speedup_vs_cpu": o["speedup_vs_cpu"], "gpu": o["gpu"],
            "cpu": o["cpu"], "paper_pair_latency_ms": p["latency_ms"], "paper_pair_speedup_vs_gpu": p["speedup_vs_gpu"],
            "paper_pair_speedup_vs_cpu": p["speedup_vs_cpu"], "paper_pair_gpu": p["gpu"], "paper_pair_cpu": p["cpu"],
            "paper_gpu": m["paper_placement"]["gpu"], "paper_cpu": m["paper_placement"]["cpu"],
        }
    summary["duet"].update({f"paper_{k}": v for k, v in duet_["paper"].items()})
    summary["chrion"] = {k: v for k, v in chrion.items() if k not in ("paper", "simulated", "scenario")}
    summary["chrion"].update({f"paper_{k}": v for k, v in chrion["paper"].items()})
    out = results_dir("cpu")
    _plot(sir, duet_, chrion, out / "coexec.png")
    notes = ("Simulated/planned from profiles: accelerator times from the papers' tables (profiles/paper, source "
             "'paper'), CPU times measured on this machine (profiles/cpu) for our scaled zoo models; paper_* are the "
             "papers' own reported figures; duet paper_pair_* run our planner on the paper's own GPU+CPU times. "
             "The machine was shared with other jobs: see load averages.")
    path = write_result("coexec", "cpu", summary, {"sir": sir, "duet": duet_, "chrion": chrion}, notes=notes)
    doc = json.loads(path.read_text())
    doc["machine"]["load_avg_before"] = load_before
    doc["machine"]["load_avg_after"] = _loadavg()
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if not isinstance(vv, (dict, list))} if isinstance(v, dict)
                      else v for k, v in summary.items()}, indent=1)[:4000])


if __name__ == "__main__":
    main()
