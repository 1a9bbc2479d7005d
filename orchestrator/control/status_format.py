"""The text the CLI prints for a node's status (``gpuprims-orchestrator status``, ``make demo``).

Formatting is the CLI's: the node only produces its view (`orchestrator.control.records.NodeView`);
a status reply from another process becomes one with ``NodeView.from_dict`` at the CLI's edge. Apps,
instances and their statistics are read by field; what the view keeps as JSON (``node``, ``changes``,
``scheduler``, an app's ``overflow`` and ``memory``, an instance's ``engine``, ...) is read as mappings,
and a missing or malformed value there prints as ``-``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from orchestrator.control.records import AppView, InstanceView, NodeView
from orchestrator.control.values import as_count, as_number

__all__ = ["format_status"]


def _fmt(v: Any, spec: str = ".1f", none: str = "-") -> str:
    if v is None or isinstance(v, bool):
        return none
    if isinstance(v, int | float):
        if not math.isfinite(v):
            return none
        return format(int(v) if spec == "d" else v, spec)
    return str(v)


def _errors(deadline_missed: Any, errors: Any) -> dict[str, int]:
    """An app's or instance's non-OK answers by status (the heartbeat counts them as plain numbers)."""
    out = {"deadline_missed": as_count(deadline_missed), "error": as_count(errors)}
    return {k: v for k, v in out.items() if v}


def _mapping(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _pct(v: Any) -> str:
    n = as_number(v)
    return "-" if n is None else f"{100 * n:.1f}%"


def _counts(d: Mapping[str, Any] | None) -> str:
    if not d:
        return "-"
    return " ".join(f"{k}={v}" for k, v in sorted(d.items()))


def _app_row(a: AppView) -> list[str]:
    """An app's row: its config's figures and its totals (`orchestrator.control.stats.AppStatistics.totals`)."""
    t = a.totals
    slo = as_number(a.slo_ms)
    return [f"{a.name} (id {_fmt(a.app_id, 'd')})", "app", _dev(a.gpu), _fmt(a.gpu_pct, "d"), _fmt(t.arrival_rps),
            _fmt(t.service_rps), _fmt(t.queue_len, "d"), _fmt(t.held, "d"), _fmt(t.p50_ms, ".2f"),
            _fmt(t.p99_ms, ".2f"), "-" if slo is None else f"{slo:g} ms", _pct(t.slo_attainment),
            *_mem(a.memory), _counts(_errors(t.deadline_missed, t.errors))]


def _instance_row(i: InstanceView) -> list[str]:
    """An instance's row: its last heartbeat's figures (``-`` before its first), its share as the
    heartbeat says it (else the node's figure)."""
    s = i.stats
    if s is None:
        return ["  " + i.name, str(i.role), _dev(i.gpu), _fmt(i.gpu_pct, "d"), "-", "-", "-", "-", "-", "-", "",
                "-", *_mem(i.memory), "-"]
    pct = i.gpu_pct if s.gpu_pct is None else s.gpu_pct
    return ["  " + i.name, str(i.role), _dev(i.gpu), _fmt(pct, "d"), _fmt(s.arrival_rps), _fmt(s.service_rps),
            _fmt(s.queue_len, "d"), _fmt(s.held, "d"), _fmt(s.p50_ms, ".2f"), _fmt(s.p99_ms, ".2f"), "",
            _pct(s.slo_attainment), *_mem(i.memory), _counts(_errors(s.deadline_missed, s.errors))]


def format_status(view: NodeView) -> str:
    """The table ``gpuprims-orchestrator status`` prints, from a node's view (``Node.view()``, or
    ``NodeView.from_dict`` of a status reply).

    One line per app (its totals) followed by one line per instance, then the ingest's drops by reason.
    Values not known yet print as ``-``.
    """
    node = view.node
    head = [f"{k}={','.join(map(str, v)) if isinstance(v, list | tuple) else v}"
            for k, v in sorted(node.items()) if k not in ("uptime_s", "fork_servers") and not isinstance(v, Mapping)]
    if as_number(node.get("uptime_s")) is not None:
        head.insert(0, f"uptime={_fmt(node['uptime_s'])}s")
    lines = ["node: " + ("  ".join(head) if head else "-")]
    cols = ["APP / INSTANCE", "ROLE", "DEVICE", "GPU%", "ARR/s", "SRV/s", "QUEUE", "HELD", "P50 ms", "P99 ms", "SLO",
            "SLO att.", "PSS MB", "DEV MB", "ERRORS"]
    rows: list[list[str]] = []
    for a in view.apps.values():
        rows.append(_app_row(a))
        rows.extend(_instance_row(i) for i in a.instances)
    if rows:
        widths = [max(len(c), *(len(r[j]) for r in rows)) for j, c in enumerate(cols)]
        left = {0, 1, 2, len(cols) - 1}

        def line(cells: list[str]) -> str:
            return "  ".join(c.ljust(w) if j in left else c.rjust(w)
                             for j, (c, w) in enumerate(zip(cells, widths))).rstrip()

        lines.append(line(cols))
        lines.extend(line(r) for r in rows)
    else:
        lines.append("no apps")
    for a in view.apps.values():
        split = a.overflow
        if isinstance(split, Mapping):
            parts = []
            for dev in ("accelerator", "cpu"):
                d = split.get(dev) if isinstance(split.get(dev), Mapping) else {}
                parts.append(f"{dev} routed={_fmt(d.get('routed'), 'd')} answered={_fmt(d.get('answered'), 'd')}")
            cores = split.get("cores")
            lines.append(f"overflow {a.name}: " + "  ".join(parts)
                         + f"  cpu cores={','.join(map(str, cores)) if isinstance(cores, list) else '-'}"
                         + f"  cpu instance failures={_fmt(split.get('cpu_instance_failures'), 'd')}")
    lines.extend(_engine_lines(view.apps))
    lines.extend(_memory_lines(node.get("memory")))
    lines.extend(_fork_server_lines(node.get("fork_servers")))
    lines.extend(_duty_lines(node.get("duties")))
    lines.extend(_param_share_lines(view.param_share))
    drops = dict(view.drops)
    total = sum(as_count(v) for v in drops.values())
    lines.append(f"ingest drops: {_counts(drops)}" + (f" (total {total})" if drops else ""))
    sch = view.scheduler
    if sch.get("name") not in (None, "spatial"):
        lines.append(f"scheduler: {sch.get('name')}  round={_fmt(sch.get('round_ms'))}ms  runs={_fmt(sch.get('runs'), 'd')}"
                     f"  mean batch={_fmt(sch.get('mean_batch'))}  rejected={_fmt(sch.get('rejected_requests'), 'd')}"
                     f"  aborted={_fmt(sch.get('aborted'), 'd')}  in flight={_fmt(sch.get('inflight'), 'd')}")
        corr = sch.get("corrections")
        if isinstance(corr, Mapping) and corr:
            lines.append("  measured/predicted: " + "  ".join(f"{k}={_fmt(v)}" for k, v in sorted(corr.items())))
    lines.extend(_changes_lines(view.changes, view.decisions))
    if view.control_rejected:
        lines.append(f"control messages rejected: {_counts(dict(view.control_rejected))}")
    return "\n".join(lines)


def _changes_lines(changes: Mapping[str, Any], decisions: tuple[Mapping[str, Any], ...], keep: int = 3) -> list[str]:
    """The last few changes of share (origin, reason, how they went, the measured switch downtime)
    and the monitor's last decisions, made or not."""
    out: list[str] = []
    recent = changes.get("recent")
    for ch in (recent if isinstance(recent, list | tuple) else [])[-keep:]:
        if not isinstance(ch, Mapping):
            continue
        downs = [sw.get("downtime_ms") for sw in ch.get("switched") or [] if isinstance(sw, Mapping)]
        down = ", ".join("?" if d is None else f"{d:.3f} ms" for d in downs) or "-"
        why = f" ({ch['reason']})" if ch.get("reason") else ""
        out.append(f"change {ch.get('id')}: {ch.get('app')} {ch.get('from_pct')}% -> {ch.get('to_pct')}% "
                   f"{ch.get('method')} by {ch.get('origin')}{why}: {ch.get('phase')}, switch downtime {down}")
    for d in decisions[-keep:]:
        if isinstance(d, Mapping):
            out.append(f"monitor: {d.get('app')} {d.get('verdict')} ({d.get('reason')}): {d.get('result')}")
    return out


def _engine_line(where: str, e: Mapping[str, Any]) -> str:
    parts = [f"engine {where}: {e.get('kind', '?')}"]
    if e.get("provider"):
        parts.append(f"provider={e['provider']}")
    if e.get("fallback"):
        parts.append(f"FALLBACK to eager ({e['fallback']})")
    if e.get("fingerprint"):
        how = "cache hit" if e.get("cache_hit") else f"built in {_fmt(as_number(e.get('build_ms')), '.0f')} ms"
        parts.append(f"{how}, load {_fmt(as_number(e.get('load_ms')), '.0f')} ms, {e['fingerprint']}")
    if e.get("param_share") is False:
        parts.append("Param-Share n/a (own weights)")
    return "  ".join(parts)


def _engine_lines(apps: Mapping[str, AppView]) -> list[str]:
    """One line per instance running an engine other than eager (or one that fell back to eager):
    kind, cache hit or build time, load time, fingerprint."""
    out = []
    for a in apps.values():
        for i in a.instances:
            e = i.engine
            if not isinstance(e, Mapping) or not e:
                continue
            stages = e.get("stages")
            items = list(stages.items()) if isinstance(stages, Mapping) else [("", e)]
            for stage, d in items:
                if isinstance(d, Mapping) and (d.get("kind") != "eager" or d.get("fallback")):
                    out.append(_engine_line(f"{i.name}{f' stage {stage}' if stage else ''}", d))
    return out


def _mb(v: Any) -> str:
    n = as_number(v)
    return "-" if n is None else f"{n / 2**20:.0f}"


def _mem(v: Any) -> tuple[str, str]:
    """An app's or instance's memory cells: PSS and device memory in MiB (``-`` when not known)."""
    m = _mapping(v)
    return _mb(m.get("pss_bytes")), _mb(m.get("device_bytes"))


def _memory_lines(v: Any) -> list[str]:
    """The node's memory (orchestrator.control.memory.NodeMemory): its own processes' PSS by kind, the
    instances' sum, the whole tree's total."""
    m = _mapping(v)
    if not m:
        return []
    by_kind: dict[str, list[str]] = {}
    for p in m.get("processes") or ():
        if isinstance(p, Mapping):
            by_kind.setdefault(str(p.get("kind", "?")), []).append(f"{_mb(p.get('pss_bytes'))} (pid {p.get('pid')})")
    parts = [f"{kind.replace('_', ' ')} {', '.join(vals)}" for kind, vals in by_kind.items()]
    insts, whole = _mapping(m.get("instances")), _mapping(m.get("total"))
    parts.append(f"instances {_mb(insts.get('pss_bytes'))}")
    dev = "" if as_number(whole.get("device_bytes")) is None else f", device {_mb(whole.get('device_bytes'))}"
    unread = f"  ({_fmt(m.get('unreadable'), 'd')} unreadable reads)" if as_count(m.get("unreadable")) else ""
    return [f"memory (PSS MB): {'  '.join(parts)}  total {_mb(whole.get('pss_bytes'))}{dev}{unread}"]


def _fork_server_lines(v: Any) -> list[str]:
    """One line per fork server (orchestrator.node.launcher.ForkLauncher.describe): its pid, whether it is
    ready, what it holds (torch or not) and how long its import took, and its live instances."""
    lines = []
    for s in v if isinstance(v, list) else ():
        if not isinstance(s, Mapping):
            continue
        raw = s.get("holds")
        holds = [h for h in raw if isinstance(h, str)] if isinstance(raw, list) else []
        pid = s.get("pid") if isinstance(s.get("pid"), int) and not isinstance(s.get("pid"), bool) else None
        what = ("holds " + ", ".join(holds)) if holds else "holds no library"
        if s.get("ready") and "torch" not in holds:
            what += " (no torch)"
        lines.append(f"fork server {_fmt(pid, 'd')}: {'ready' if s.get('ready') else 'importing'}, {what}, "
                     f"import {_fmt(s.get('import_ms'), '.0f')} ms, {_fmt(s.get('children'), 'd')} instance(s)")
    return lines


def _duty_lines(v: Any) -> list[str]:
    """The node loop's duties on one line (orchestrator/node/loop.py): each one's runs and its mean and
    longest run in µs, and its failures when it had any."""
    parts = []
    for name, d in _mapping(v).items():
        if not isinstance(d, Mapping):
            continue
        failed = as_count(d.get("failures"))
        runs, mean, most = (as_number(d.get(k)) for k in ("runs", "mean_us", "max_us"))
        parts.append(f"{name} {_fmt(runs, 'd')}x {_fmt(mean, '.0f')}/{_fmt(most, '.0f')}"
                     + (f" ({failed} failed)" if failed else ""))
    return ["loop duties (runs, mean/max us): " + ", ".join(parts)] if parts else []


def _dev(v: Any) -> str:
    """A device as status names it: ``gpu 1`` for a GPU index, ``cpu``, or ``-`` when unknown."""
    if isinstance(v, int) and not isinstance(v, bool):
        return f"gpu {v}"
    return str(v) if isinstance(v, str) and v else "-"


def _param_share_lines(v: Any) -> list[str]:
    """One line per shared copy of weights (``ParamShare.describe``): its key, where it lives (a CUDA
    holder process or the node's shared-memory segment), its size and the instances that map it."""
    out = []
    for e in v if isinstance(v, list | tuple) else ():
        if not isinstance(e, Mapping):
            continue
        owner = f"holder pid {e['holder_pid']}" if e.get("holder_pid") is not None else "node segment"
        users = e.get("users")
        who = ",".join(map(str, users)) if isinstance(users, list) and users else "-"
        out.append(f"param-share {e.get('key', '?')}: {e.get('backend', '?')} {owner}  {_fmt(as_number(e.get('mb')))} MB  "
                   f"{'ready' if e.get('ready') else 'not written yet'}  users={who}")
    return out
