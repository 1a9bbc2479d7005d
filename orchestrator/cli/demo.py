"""The main job's demo: a node on examples/apps.yaml, replayed traffic, a per-app report, then stop.

``python -m orchestrator.cli.demo [--config examples/apps.yaml] [--duration 20] [--rate 30]`` starts the
orchestrator (CPU backend where there is no GPU), sends every app a Poisson stream of real image
requests for ``--duration`` seconds with the traffic tool, prints per app: requests sent, answered,
lost, throughput, latency p50/p99/p99.9 and SLO attainment as the client measured them, then the
node's own status (instances, shares, drops by reason), and stops everything.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from gpuprims.interrupt import ctrl_c_interrupts
from orchestrator.config.schema import ConfigError, NodeConfig, load_config, parse_config
from orchestrator.control.records import NodeView

ROOT = Path(__file__).resolve().parents[2]


def _with_free_port(cfg: NodeConfig) -> NodeConfig:
    """The same config listening on an ephemeral port, so the demo never collides with a running node
    (the HTTP/gRPC front door, on fixed ports in the example, is left off: the demo replays UDP)."""
    data = cfg.model_dump()
    data["node"]["listen"]["port"] = [0]
    data["node"]["run_dir"] = None
    data["node"]["http_port"] = data["node"]["grpc_port"] = 0
    return parse_config(data, source="demo")


def per_app_report(report: Any, cfg: NodeConfig) -> dict[str, dict[str, Any]]:
    s = report.samples
    out = {}
    for app in cfg.apps:
        m = (s["app_id"] == app.app_id) & ~s["warmup"]
        sent = int((s["sent_ns"][m] >= 0).sum())
        answered = int((s["state"][m] > 0).sum())
        ok = int(((s["state"][m] > 0) & (s["status"][m] == 0)).sum())
        lat = s["latency_ns"][m & (s["state"] == 1)] / 1e6
        within = int((lat <= app.slo_ms).sum()) if lat.size else 0
        dur = max(report.summary.get("duration_s") or 1e-9, 1e-9)
        out[app.name] = {
            "sent": sent, "answered": answered, "ok": ok, "lost": sent - answered,
            "throughput_rps": round(answered / dur, 1),
            "p50_ms": round(float(np.percentile(lat, 50)), 2) if lat.size else None,
            "p99_ms": round(float(np.percentile(lat, 99)), 2) if lat.size else None,
            "p99.9_ms": round(float(np.percentile(lat, 99.9)), 2) if lat.size else None,
            "slo_ms": app.slo_ms,
            "slo_attainment": round(within / sent, 4) if sent else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    """The demo (module docstring); Ctrl-C ends it with a partial report, however it was started."""
    with ctrl_c_interrupts():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "apps.yaml"))
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of traffic")
    ap.add_argument("--rate", type=float, default=30.0, help="requests/s per app (Poisson)")
    ap.add_argument("--json", default=None, help="also write the report here")
    args = ap.parse_args(argv)

    from gpuprims.traffic.runner import run
    from gpuprims.traffic.stream import AppStream, Stream
    from orchestrator.control.channel import ControlError
    from orchestrator.control.logs import setup_logging
    from orchestrator.control.status_format import format_status
    from orchestrator.node.node import Node, StartError

    try:
        cfg = _with_free_port(load_config(args.config))
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    setup_logging(cfg.node.log_level, cfg.node.log_format)
    log = logging.getLogger("gpuprims.demo")
    monitor = None
    if cfg.node.autoscale:
        from orchestrator.node.monitor import Monitor

        monitor = Monitor()
    node = Node(cfg, monitor=monitor)
    # Ctrl-C stays a KeyboardInterrupt in this (main) thread: the traffic runner turns it into a
    # partial report; SIGTERM stops the same way.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        node.start()
    except (StartError, ControlError) as e:  # ControlError: its control socket cannot be made (a long path)
        print(f"node did not start: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted while the node was starting; everything it started is stopped", file=sys.stderr)
        return 130
    interrupted = False
    try:
        port = node.ingest.ports[0]  # type: ignore[union-attr]
        stream = Stream([AppStream(app_id=a.app_id, shape=tuple(a.input_shape), dtype=a.dtype, rate=args.rate,
                                   process="poisson", duration_s=args.duration, to=("127.0.0.1", port), variants=4)
                         for a in cfg.apps], seed=1, warmup_s=1.0)
        log.info("replaying %.0f s of Poisson traffic at %.0f requests/s per app to port %d (Ctrl-C ends it early "
                 "with a partial report)", args.duration, args.rate, port)
        done = threading.Event()

        def control_loop() -> None:
            while not done.is_set():
                node.step(100)

        loop = threading.Thread(target=control_loop, name="node-control")
        loop.start()
        try:
            report = run(stream, timeout_s=max(a.slo_ms for a in cfg.apps) / 1000 * 2,
                         slo_ms=min(a.slo_ms for a in cfg.apps), progress=sys.stderr.isatty())
        except KeyboardInterrupt:  # before the runner's own handling began
            report = None
        finally:
            done.set()
            loop.join()
        # From here on a Ctrl-C only says to wait: the report and a clean stop come next.
        signal.signal(signal.SIGINT, _be_patient)
        signal.signal(signal.SIGTERM, _be_patient)
        if report is None:
            print("interrupted before any traffic was sent; stopping", file=sys.stderr)
            interrupted = True
            return 130
        interrupted = report.interrupted
        for _ in range(10):
            node.step(100)  # collect the last heartbeats
        apps = per_app_report(report, cfg)
        status = node.status()  # the status reply's body: the view's JSON and the loop's duties
        title = "client-side report (traffic tool)" + (", PARTIAL: interrupted" if interrupted else "")
        print(f"\n== {title} ==")
        hdr = f"{'app':<12}{'sent':>7}{'answered':>10}{'lost':>6}{'rps':>8}{'p50 ms':>9}{'p99 ms':>9}{'p99.9':>9}{'SLO':>8}"
        print(hdr)
        for name, a in apps.items():
            att = f"{a['slo_attainment']:.1%}" if a["slo_attainment"] is not None else "-"
            print(f"{name:<12}{a['sent']:>7}{a['answered']:>10}{a['lost']:>6}{a['throughput_rps']:>8}"
                  f"{a['p50_ms'] or '-':>9}{a['p99_ms'] or '-':>9}{a['p99.9_ms'] or '-':>9}{att:>8}")
        print(f"send rate achieved: {report.summary['rate']['achieved']} "
              f"({report.summary['rate']['achieved_rps']:.1f} of {report.summary['rate']['target_rps']:.1f} req/s)")
        print("\n== node status ==")
        print(format_status(NodeView.from_dict(status)))
        if args.json:
            Path(args.json).write_text(json.dumps({"apps": apps, "traffic": report.to_dict(), "node": status,
                                                   "interrupted": interrupted}, indent=1, default=str))
    finally:
        signal.signal(signal.SIGINT, _be_patient)
        t0 = time.monotonic()
        node.stop(drain=True)
        logging.getLogger("gpuprims.demo").info("stopped in %.1f s", time.monotonic() - t0)
    return 130 if interrupted else 0


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def _be_patient(signum: int, _frame: Any) -> None:
    logging.getLogger("gpuprims.demo").warning("%s: stopping already; the node is draining",
                                               signal.Signals(signum).name)


if __name__ == "__main__":
    sys.exit(main())
