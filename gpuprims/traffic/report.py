"""What a run did: counts, rates, latency percentiles, per app, with the raw per-request samples.

Counting rules (docs/traffic.md): `sent` counts measured requests whose first datagram was sent
(warm-up requests are reported apart); `answered` those answered within the timeout; `late` those
first answered after it; `lost = sent - answered` (late answers included), of which `never_answered`
had no answer at all; `duplicates` counts answers beyond the first; `unmatched` answers to no sent
request; `invalid` datagrams that are not valid v1 responses, by reason. Latency is receive time
minus the request's send time (the client_ts_ns the response echoes), over answered requests.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpuprims import wire
from gpuprims.traffic.receiver import ANSWERED, LATE

#: Achieved rate within this fraction of the target counts as achieved.
RATE_TOLERANCE = 0.02


def _pct(a: np.ndarray, scale: float) -> dict[str, float | None]:
    if len(a) == 0:
        return {"p50": None, "p90": None, "p99": None, "p99.9": None, "mean": None, "min": None, "max": None}
    a = a.astype(np.float64) * scale
    p = np.percentile(a, [50, 90, 99, 99.9])
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2]), "p99.9": float(p[3]),
            "mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}


@dataclass
class Report:
    """The summary of a run (`summary`, JSON-ready) and its raw per-request `samples`.

    `samples` holds one entry per scheduled request or raw datagram, in send order: app_id (-1 for a
    raw datagram), request_id, sched_ns (offset from t0), sent_ns and recv_ns (CLOCK_MONOTONIC, -1
    if not), latency_ns (-1 if unanswered), status, state (0 none, 1 answered, 2 late), answers,
    warmup, packets.
    """

    summary: dict[str, Any]
    samples: dict[str, np.ndarray] = field(repr=False)
    bodies: dict[int, bytes] = field(default_factory=dict, repr=False)

    def __getitem__(self, key: str) -> Any:
        return self.summary[key]

    @property
    def interrupted(self) -> bool:
        return bool(self.summary.get("interrupted"))

    def latencies_ms(self, app_id: int | None = None, *, include_warmup: bool = False) -> np.ndarray:
        """Latency (ms) of every answered request (optionally of one app)."""
        s = self.samples
        m = s["state"] == ANSWERED
        if not include_warmup:
            m &= ~s["warmup"]
        if app_id is not None:
            m &= s["app_id"] == app_id
        return s["latency_ns"][m] / 1e6

    def body(self, event: int) -> bytes | None:
        """Response body of event `event` (runs with keep_payloads)."""
        return self.bodies.get(event)

    def to_dict(self) -> dict[str, Any]:
        return _clean(self.summary)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path, *, samples: bool = False) -> Path:
        """Write the summary as JSON (and the samples beside it as .npz when asked)."""
        path = Path(path)
        path.write_text(self.to_json() + "\n")
        if samples:
            np.savez_compressed(path.with_suffix(".samples.npz"), **self.samples)
        return path

    def plot_cdf(self, path: str | Path) -> Path:
        """Latency CDF per app (and of all apps) as an image."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        apps = sorted(int(a) for a in np.unique(self.samples["app_id"]) if a >= 0)
        series = [(f"app {a}", self.latencies_ms(a)) for a in apps]
        if len(apps) > 1:
            series.insert(0, ("all", self.latencies_ms()))
        for label, lat in series:
            if len(lat) == 0:
                continue
            x = np.sort(lat)
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=f"{label} (n={len(x)})")
        slo = self.summary.get("slo_ms")
        if slo:
            ax.axvline(slo, color="k", linestyle="--", linewidth=1, label=f"SLO {slo:g} ms")
        ax.set_xlabel("latency (ms)")
        ax.set_ylabel("fraction of answered requests")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.01)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right")
        s = self.summary
        ax.set_title(f"sent {s['sent']}, answered {s['answered']}, lost {s['lost']}", fontsize=10)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def plot_timeline(self, path: str | Path, bin_ms: float = 10.0) -> Path:
        """Send and answer rate per bin, and latency over time."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        s = self.samples
        t0 = s["sent_ns"][s["sent_ns"] >= 0].min() if (s["sent_ns"] >= 0).any() else 0
        sent_t = (s["sent_ns"][s["sent_ns"] >= 0] - t0) / 1e9
        ans = s["state"] == ANSWERED
        recv_t = (s["recv_ns"][ans] - t0) / 1e9
        fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
        end = max(sent_t.max() if len(sent_t) else 0, recv_t.max() if len(recv_t) else 0)
        bins = np.arange(0, end + bin_ms / 1e3, bin_ms / 1e3)
        if len(bins) > 1:
            a1.hist(sent_t, bins=bins, histtype="step", label="sent", weights=np.full(len(sent_t), 1e3 / bin_ms))
            a1.hist(recv_t, bins=bins, histtype="step", label="answered", weights=np.full(len(recv_t), 1e3 / bin_ms))
        a1.set_ylabel("requests/s")
        a1.legend()
        a2.plot((s["sent_ns"][ans] - t0) / 1e9, s["latency_ns"][ans] / 1e6, ".", markersize=2)
        a2.set_ylabel("latency (ms)")
        a2.set_xlabel("time since first send (s)")
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _clean(o: Any) -> Any:
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items() if not str(k).startswith("_")}
    if isinstance(o, list | tuple):
        return [_clean(v) for v in o]
    if isinstance(o, np.generic):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def _counts(m: np.ndarray, s: dict[str, np.ndarray], timeout_ms: float, slo_ms: float | None) -> dict[str, Any]:
    sent_m = m & (s["sent_ns"] >= 0)
    sent = int(sent_m.sum())
    answered_m = sent_m & (s["state"] == ANSWERED)
    answered = int(answered_m.sum())
    late = int((sent_m & (s["state"] == LATE)).sum())
    lat = s["latency_ns"][answered_m]
    status: dict[str, int] = {}
    for v, c in zip(*np.unique(s["status"][answered_m], return_counts=True)):
        name = wire.Status(int(v)).name if v <= max(wire.Status) else f"STATUS_{v}"
        status[name] = int(c)
    out: dict[str, Any] = {
        "scheduled": int(m.sum()), "sent": sent, "answered": answered, "lost": sent - answered, "late": late,
        "never_answered": sent - answered - late,
        "duplicates": int(np.maximum(s["answers"][sent_m].astype(np.int64) - 1, 0).sum()),
        "status": status, "ok": status.get("OK", 0), "errors": answered - status.get("OK", 0),
        "packets_sent": int(s["packets"][sent_m].sum()),
        "latency_ms": _pct(lat, 1e-6),
    }
    if slo_ms is not None:
        good = answered_m & (s["status"] == wire.Status.OK) & (s["latency_ns"] <= slo_ms * 1e6)
        out["slo_attained"] = int(good.sum())
        out["slo_attainment"] = float(good.sum() / sent) if sent else None
    return out


def build_report(plan, sender, tracker, receiver_stats: dict, *, timeout_s: float, slo_ms: float | None,
                 interrupted: bool, listen_end_ns: int, extra: dict | None = None) -> Report:
    """Summarise one run (see the module docstring for the counting rules)."""
    t0 = sender.t0_ns
    n = plan.n_events
    sent_ns = sender.sent_ns.copy()
    lat = np.where(tracker.state != 0, tracker.recv_ns - sent_ns, -1)
    samples = {
        "app_id": plan.ev_app.copy(), "request_id": plan.ev_rid.copy(), "sched_ns": plan.ev_time_ns.copy(),
        "sent_ns": sent_ns, "recv_ns": tracker.recv_ns.copy(), "latency_ns": lat, "status": tracker.status.copy(),
        "state": tracker.state.copy(), "answers": tracker.answers.copy(), "warmup": plan.ev_warmup.copy(),
        "packets": plan.ev_packets, "echo_aux0": tracker.aux[:, 0].copy(), "echo_aux1": tracker.aux[:, 1].copy(),
    }
    req = plan.ev_app >= 0
    meas = ~plan.ev_warmup
    warm_ns = plan.warmup_ns
    summary: dict[str, Any] = {}
    c = _counts(req & meas, samples, timeout_s * 1e3, slo_ms)
    summary.update(c)
    summary["unmatched"] = tracker.unmatched
    summary["invalid"] = dict(tracker.invalid)
    summary["invalid_total"] = int(sum(tracker.invalid.values()))
    summary["incomplete_responses"] = tracker.incomplete()
    summary["echo_mismatch"] = tracker.echo_mismatch
    summary["raw_datagrams_sent"] = int(((~req) & meas & (sent_ns >= 0)).sum())

    # Rate: measured events over the measured window. The window is the schedule's span, stretched
    # by however late the last measured event went out (or cut short by an interruption).
    meas_all = meas & (sent_ns >= 0)
    meas_start = t0 + warm_ns
    n_sent_events = int(meas_all.sum())
    pk = plan.ev_packets
    complete = not interrupted and n_sent_events == int(meas.sum())
    if n_sent_events:
        last = int(np.flatnonzero(meas_all)[-1])
        lateness = int(sent_ns[last] - (t0 + plan.ev_time_ns[last]))
        window_ns = plan.span_ns + max(0, lateness) if complete else max(1, int((sender.end_ns or time.monotonic_ns()) - meas_start))
    else:
        window_ns = max(1, int((sender.end_ns or meas_start) - meas_start))
    window_s = max(window_ns, 1) / 1e9
    lag = (sent_ns[meas_all] - (t0 + plan.ev_time_ns[meas_all])) / 1e3
    achieved_rps = int((meas_all & req).sum()) / window_s
    achieved_pps = int(pk[meas_all].sum()) / window_s
    rate: dict[str, Any] = {"target_rps": plan.target_rps, "target_pps": plan.target_pps,
                            "achieved_rps": achieved_rps, "achieved_pps": achieved_pps,
                            "window_s": window_s, "tolerance": RATE_TOLERANCE,
                            "send_lag_us": _pct(lag, 1.0)}
    # The sender is judged against what its schedule asked for: for a constant stream that is the
    # target rate; a Poisson stream's realised count differs from rate x duration by chance.
    span_s = max(plan.span_ns, 1) / 1e9
    sched_rps = int((meas & req).sum()) / span_s
    sched_pps = int(pk[meas].sum()) / span_s
    rate["scheduled_rps"], rate["scheduled_pps"] = sched_rps, sched_pps
    if plan.target_pps:
        rate["achieved_fraction"] = achieved_pps / sched_pps if sched_pps else 0.0
        rate["achieved"] = bool(achieved_pps >= sched_pps * (1 - RATE_TOLERANCE))
    elif plan.target_rps:
        rate["achieved_fraction"] = achieved_rps / sched_rps if sched_rps else 0.0
        rate["achieved"] = bool(achieved_rps >= sched_rps * (1 - RATE_TOLERANCE))
    else:
        rate["achieved"] = None
    summary["rate"] = rate
    summary["throughput"] = {"answered_rps": c["answered"] / window_s, "ok_rps": c["ok"] / window_s,
                             "sent_pps": achieved_pps,
                             "sent_mbps": float((plan.ev_bytes[meas_all]).sum()) * 8 / window_s / 1e6}
    summary["timeout_s"] = timeout_s
    summary["slo_ms"] = slo_ms
    summary["warmup"] = _counts(req & plan.ev_warmup, samples, timeout_s * 1e3, None) if plan.ev_warmup.any() \
        else None
    if summary["warmup"] is not None:
        summary["warmup"] = {k: summary["warmup"][k] for k in ("sent", "answered", "lost", "duplicates")}
    apps = {}
    app_ids = sorted(int(a) for a in np.unique(plan.ev_app[req]))
    if len(app_ids) > 1:
        for a in app_ids:
            m = req & meas & (plan.ev_app == a)
            ca = _counts(m, samples, timeout_s * 1e3, slo_ms)
            tgt = plan.app_targets.get(a, {})
            ca["rate"] = {"target_rps": tgt.get("rps"), "achieved_rps": ca["sent"] / window_s}
            apps[str(a)] = ca
        summary["apps"] = apps
    st = sender.stats()
    cpu_s = st["cpu_ns"] / 1e9
    summary["sender"] = {"requests": int((req & (sent_ns >= 0)).sum()), "packets": st["packets"], "bytes": st["bytes"],
                         "syscalls": st["syscalls"], "send_errors": st["send_errors"],
                         "failed_packets": st["failed_packets"], "last_errno": st["last_errno"], "gso": st["gso"],
                         "sockets": len(sender.sockets), "cpu_s": cpu_s,
                         "cpu_s_per_mpkt": cpu_s / st["packets"] * 1e6 if st["packets"] else None}
    summary["receiver"] = {"datagrams": receiver_stats.get("datagrams"), "socket_drops": receiver_stats.get("socket_drops"),
                           "kernel_timestamps": receiver_stats.get("kernel_stamped", 0),
                           "cpu_s": receiver_stats.get("cpu_ns", 0) / 1e9}
    summary["duration_s"] = ((listen_end_ns or sender.end_ns) - t0) / 1e9
    summary["interrupted"] = interrupted
    summary["plan"] = {k: v for k, v in plan.description.items() if not k.startswith("_")}
    if extra:
        summary.update(extra)
    assert len(samples["app_id"]) == n
    return Report(summary=summary, samples=samples, bodies=dict(tracker.bodies))
