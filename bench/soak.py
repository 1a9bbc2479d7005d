"""bench/soak: a node under steady load for an hour; does anything grow?

It starts a node on a private copy of ``examples/apps.yaml`` (as bench/chaos does), measures each
app's capacity (the most OK answers/s it gives, offered a doubling rate until it falls behind), then offers 70 %
of it (``--load``) as Poisson traffic for ``--duration`` seconds, changing an app's GPU% every
``--set-gpu-every`` seconds (down, then back up). Every ``--sample-s`` it samples, for the
orchestrator and each instance (by app and role, since set-gpu replaces processes): RSS, open fds,
threads and shared-memory segments mapped, plus the node's /dev/shm segments.

A series is *flat* when no sample after the first ``--baseline-s`` (five minutes) is above the range
of the samples within it (an app's active and shadow share one range, since a change makes one the
other). A series follows a role, not a pid: after a set-gpu the active is the former
shadow and a fresh shadow loads, so a step right after a change is a replacement; a leak shows as
growth that carries on across replacements. Writes ``bench/results/<machine>/soak.json`` and ``soak.png``. Every request
is also matched to its answer by bench/chaos's Ledger (lost and duplicated are reported).

The verdict ``flat`` is judged on private memory (RssAnon), fds, threads and shm segments; RSS and
the shared pool's resident pages (RssShmem) are recorded beside it. The orchestrator's RSS steps up
by about one answer ring (1 MiB) at each set-gpu until every consumer of the pool has been used once:
those are the pool's shared pages being touched for the first time, bounded by its size, not a leak.

Run: ``python -m bench.soak [--duration 3600] [--sample-s 60]``; a smoke test: ``--duration 60 --sample-s 5``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.chaos import (
    Ledger,
    LoadClient,
    NodeControl,
    make_loads,
    private_config,
    start_node,
    stop_node,
    wait_ready,
)
from bench.common import ROOT, results_dir, write_result

METRICS = ("rss_mb", "private_mb", "shared_mb", "fds", "threads", "shm_segments")
#: What "flat" is judged on. RSS also counts the shared packet pool's pages the process has touched
#: (``shared_mb``): each instance's answer ring is touched for the first time when an instance on a
#: fresh consumer starts answering, so the orchestrator's RSS steps up by about a ring per set-gpu until
#: every consumer has been used, bounded by the pool's size. A leak grows private memory.
VERDICT_METRICS = ("private_mb", "fds", "threads", "shm_segments")


def proc_sample(pid: int) -> dict[str, float] | None:
    """RSS, private (RssAnon) and shared-memory (RssShmem) resident MB, open fds, threads and distinct
    /dev/shm files mapped by one process (None if gone)."""
    try:
        rss = private = shared = threads = 0.0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("RssAnon:"):
                private = int(line.split()[1]) / 1024
            elif line.startswith("RssShmem:"):
                shared = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        shm = {ln.split(None, 5)[-1] for ln in Path(f"/proc/{pid}/maps").read_text().splitlines()
               if "/dev/shm/" in ln}
    except (OSError, ValueError, IndexError):
        return None
    return {"rss_mb": round(rss, 1), "private_mb": round(private, 1), "shared_mb": round(shared, 1), "fds": fds,
            "threads": threads, "shm_segments": len(shm)}


def process_keys(status: dict[str, Any]) -> dict[str, int]:
    """{'orchestrator': pid, '<app>/<role>[/<n>]': pid}: stable names for processes set-gpu replaces."""
    out = {"orchestrator": int(status["node"]["pid"])}
    for app, a in status["apps"].items():
        seen: dict[str, int] = {}
        for inst in sorted(a["instances"], key=lambda i: i["name"]):
            if not inst.get("pid"):
                continue
            role = inst.get("role") or "instance"
            n = seen.get(role, 0)
            seen[role] = n + 1
            out[f"{app}/{role}" + (f"/{n}" if n else "")] = int(inst["pid"])
    return out


def flatness(times_s: list[float], series: dict[str, dict[str, list[float | None]]],
             baseline_s: float) -> dict[str, dict[str, Any]]:
    """Per process and metric: the baseline window's max, the max after it, the last value, flat or not.

    An app's active and shadow roles share one baseline range: a set-gpu makes the shadow the active,
    so the active's series continues with what was the shadow's process (a pre-warmed shadow keeps
    the OpenMP workers of the thread that warmed it, one or two idle threads more than an active that
    loaded on its serving thread). A value either role had in the baseline window is not growth."""
    def role_group(key: str) -> str:
        parts = key.split("/")
        return f"{parts[0]}/instance" if len(parts) >= 2 and parts[1] in ("active", "shadow") else key

    def in_baseline(vals: list[float | None]) -> list[float]:
        return [v for t, v in zip(times_s, vals) if v is not None and t <= baseline_s]

    group_base: dict[tuple[str, str], list[float]] = {}
    for key, metrics in series.items():
        for m, vals in metrics.items():
            group_base.setdefault((role_group(key), m), []).extend(in_baseline(vals))
    out: dict[str, dict[str, Any]] = {}
    for key, metrics in series.items():
        out[key] = {}
        for m, vals in metrics.items():
            base = group_base[(role_group(key), m)] if in_baseline(vals) else []
            after = [v for t, v in zip(times_s, vals) if v is not None and t > baseline_s]
            last = next((v for v in reversed(vals) if v is not None), None)
            base_max = max(base) if base else None
            flat = None if base_max is None or not after else max(after) <= base_max
            out[key][m] = {"baseline_max": base_max, "after_max": max(after) if after else None, "end": last,
                           "flat": flat}
    return out


def plot(path: Path, times_s: list[float], series: dict[str, dict[str, list[float | None]]],
         baseline_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(METRICS), 1, figsize=(9, 2.4 * len(METRICS)), sharex=True)
    tm = [t / 60 for t in times_s]
    for ax, m in zip(axes, METRICS):
        for key, metrics in sorted(series.items()):
            ax.plot(tm, [float("nan") if v is None else v for v in metrics[m]], marker=".", label=key)
        ax.axvline(baseline_s / 60, color="k", linestyle="--", linewidth=0.8)
        ax.set_ylabel(m)
    axes[0].legend(fontsize=7, ncol=3)
    axes[-1].set_xlabel("minutes (dashed: end of the baseline window)")
    fig.suptitle("soak: per-process resources under 70% load with periodic set-gpu")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    from orchestrator.control.messages import SetGpuRequest

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=3600.0, help="Seconds of steady load.")
    ap.add_argument("--sample-s", type=float, default=60.0, help="Seconds between samples.")
    ap.add_argument("--baseline-s", type=float, default=300.0, help="The window whose range later samples must stay in.")
    ap.add_argument("--load", type=float, default=0.7, help="Fraction of the measured capacity offered.")
    ap.add_argument("--calibrate-s", type=float, default=20.0, help="Seconds of each calibration step.")
    ap.add_argument("--calibrate-rps", type=float, default=40.0, help="First requests/s per app offered to calibrate.")
    ap.add_argument("--warmup-s", type=float, default=15.0, help="Seconds of light load before calibrating.")
    ap.add_argument("--calibrate-max-rps", type=float, default=640.0, help="Most requests/s per app offered.")
    ap.add_argument("--set-gpu-every", type=float, default=300.0, help="Seconds between set-gpu changes.")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--config", default=str(ROOT / "examples" / "apps.yaml"))
    ap.add_argument("--name", default="soak", help="Result file stem.")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    load0 = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="soak-", dir="/tmp"))
    cfg_path, cfg = private_config(Path(args.config), tmp)
    loads, expected = make_loads(cfg, 4, args.seed)
    apps = [a.name for a in cfg.apps]
    proc = start_node(cfg_path, tmp / "node.log", args.ready_timeout)
    ctl = None
    try:
        st = wait_ready(tmp / "run", proc, apps, args.ready_timeout)
        ctl = NodeControl(tmp / "run")
        dest = ("127.0.0.1", st["node"]["ports"][0])
        node_pid = int(st["node"]["pid"])

        # Capacity: the most OK answers/s each app gave, offered more and more (doubling) until it
        # answers less than 90 % of what it is offered OK (or --calibrate-max-rps).
        capacity = {a.app_id: 0.0 for a in loads}
        # Warm-up at a light rate first: the first batches of a fresh instance are slow.
        warm = LoadClient(loads, dest, Ledger(expected), {a.app_id: 5.0 for a in loads}, seed=args.seed + 3)
        warm.start(time.monotonic(), args.warmup_s)
        warm.join_sender()
        warm.close()
        offer = args.calibrate_rps
        while True:
            cal = Ledger(expected)
            client = LoadClient(loads, dest, cal, {a.app_id: offer for a in loads}, seed=args.seed + 1)
            client.start(time.monotonic(), args.calibrate_s)
            client.join_sender()
            time.sleep(2.0)  # answers still in flight after the last request (a bench, not a test)
            client.close()
            ok = cal.ok_by_app()
            got = {k: ok.get(k, 0) / args.calibrate_s for k in capacity}
            capacity = {k: max(capacity[k], got[k]) for k in capacity}
            print(f"soak: offered {offer:.0f} rps per app, OK {got}", flush=True)
            if min(got.values()) < 0.9 * offer or offer * 2 > args.calibrate_max_rps:
                break
            offer *= 2
        rates = {k: max(0.5, args.load * v) for k, v in capacity.items()}
        print(f"soak: capacity {capacity} rps; offering {rates}", flush=True)

        ledger = Ledger(expected)
        client = LoadClient(loads, dest, ledger, rates, seed=args.seed + 2)
        t0 = time.monotonic()
        client.start(t0, args.duration)
        times: list[float] = []
        series: dict[str, dict[str, list[float | None]]] = {}
        node_shm: list[int] = []
        set_gpu_log: list[dict[str, Any]] = []
        next_sample, next_change, change = t0, t0 + args.set_gpu_every, 0
        end = t0 + args.duration
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_sample:
                st = ctl.status()
                sample = {k: proc_sample(p) for k, p in process_keys(st).items()}
                i = len(times)
                times.append(round(now - t0, 1))
                for key, vals in sample.items():
                    s = series.setdefault(key, {m: [None] * i for m in METRICS})
                    for m in METRICS:
                        s[m].append(None if vals is None else vals[m])
                for key, s in series.items():
                    if key not in sample:
                        for m in METRICS:
                            s[m].append(None)
                node_shm.append(len(list(Path("/dev/shm").glob(f"gpuprims-{node_pid}-*"))))
                next_sample += args.sample_s
            if now >= next_change:
                app = apps[change % len(apps)]
                cur = int(ctl.status()["apps"][app]["gpu_pct"])
                new = max(1, cur - 10) if change // len(apps) % 2 == 0 else min(100, cur + 10)
                t1 = time.monotonic()
                try:
                    reply = ctl.request(SetGpuRequest(app=app, gpu_pct=new), 300)
                    set_gpu_log.append({"t_s": round(t1 - t0, 1), "app": app, "from": cur, "to": new, "ok": reply.ok,
                                        "message": reply.message, "s": round(time.monotonic() - t1, 2)})
                except Exception as e:  # reported, not fatal
                    set_gpu_log.append({"t_s": round(t1 - t0, 1), "app": app, "to": new, "error": repr(e)})
                change += 1
                next_change += args.set_gpu_every
            time.sleep(min(0.5, max(0.0, min(next_sample, next_change, end) - time.monotonic())))
        client.join_sender()
        grace_end = time.monotonic() + 30
        while time.monotonic() < grace_end and ledger.outstanding():
            time.sleep(0.2)
        client.close()
        code = stop_node(proc, ctl)
        leftover = sorted(p.name for p in Path("/dev/shm").glob(f"gpuprims-{node_pid}-*"))
    finally:
        if proc.poll() is None:
            stop_node(proc, None, 0)
    flat = flatness(times, series, args.baseline_s)
    res = ledger.result()
    summary: dict[str, Any] = {
        "duration_s": args.duration, "sample_s": args.sample_s, "baseline_s": args.baseline_s,
        "capacity_rps": {str(k): round(v, 2) for k, v in capacity.items()},
        "offered_rps": {str(k): round(v, 2) for k, v in rates.items()},
        "sent": res["sent"], "ok": res["ok"], "errors_by_status": res["errors_by_status"], "lost": res["lost"],
        "duplicated": res["duplicated"], "corrupted": res["corrupted"],
        "flat": all(m[k]["flat"] is not False for m in flat.values() for k in VERDICT_METRICS),
        "flat_judged_on": list(VERDICT_METRICS),
        "node_shm_segments_end": node_shm[-1] if node_shm else None, "leftover_shm_segments": leftover,
        "node_exit_code": code,
        "processes": {k: {"rss_mb_first5min_max": v["rss_mb"]["baseline_max"], "rss_mb_end": v["rss_mb"]["end"],
                          "private_mb_first5min_max": v["private_mb"]["baseline_max"],
                          "private_mb_end": v["private_mb"]["end"], "shared_mb_end": v["shared_mb"]["end"],
                          "fds_end": v["fds"]["end"], "threads_end": v["threads"]["end"],
                          "shm_segments_end": v["shm_segments"]["end"],
                          "flat": {m: v[m]["flat"] for m in METRICS}} for k, v in flat.items()},
    }
    out_dir = results_dir("cpu")
    plot(out_dir / f"{args.name}.png", times, series, args.baseline_s)
    write_result("soak", "cpu", summary, {"times_s": times, "series": series, "node_shm_segments": node_shm,
                                          "set_gpu": set_gpu_log, "flatness": flat}, load_avg_before=load0,
                 name=args.name)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"soak: flat={summary['flat']} sent={res['sent']} ok={res['ok']} lost={res['lost']} "
          f"duplicated={res['duplicated']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
