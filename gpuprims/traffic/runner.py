"""One run: send a plan, receive the answers, and report. What the CLI's `replay` and the tests use."""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

from tqdm import tqdm

from gpuprims.traffic.receiver import Receiver, Tracker
from gpuprims.traffic.report import Report, build_report
from gpuprims.traffic.sender import Sender, SocketSet, parse_port_range
from gpuprims.traffic.stream import AppStream, Plan, Stream


def as_plan(source: Stream | AppStream | Plan) -> Plan:
    if isinstance(source, Plan):
        return source
    if isinstance(source, AppStream):
        source = Stream([source])
    if isinstance(source, Stream):
        return source.plan()
    raise TypeError(f"cannot send a {type(source).__name__}; give a Stream, AppStream or Plan")


def run(source: Stream | AppStream | Plan, *, ports: str | Sequence[int] | None = None,
        bind_host: str = "127.0.0.1", sockets: Sequence[socket.socket] | None = None, timeout_s: float = 1.0,
        linger_s: float | None = None, slo_ms: float | None = None, progress: bool = False,
        keep_payloads: bool = False, gso: bool = True, max_batch_pkts: int = 1024, spin_us: float = 20.0,
        start_delay_s: float = 0.005) -> Report:
    """Send `source` from client `ports` (or the given sockets), receive the answers, and report.

    After the last request the run listens for answers until every sent request is answered or
    `linger_s` (default 1.5 x `timeout_s`) has passed; an answer more than `timeout_s` after its
    request is counted late. Ctrl-C (KeyboardInterrupt) ends the run early and returns the partial
    report, with `interrupted` set.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    linger_s = 1.5 * timeout_s if linger_s is None else linger_s
    if linger_s < 0:
        raise ValueError(f"linger_s must be >= 0, got {linger_s}")
    plan = as_plan(source)
    owned = None
    if sockets is None:
        owned = SocketSet(parse_port_range(ports), bind_host)
        sockets = owned.sockets
    try:
        return _run(plan, list(sockets), timeout_s=timeout_s, linger_s=linger_s, slo_ms=slo_ms, progress=progress,
                    keep_payloads=keep_payloads, gso=gso, max_batch_pkts=max_batch_pkts, spin_us=spin_us,
                    start_delay_s=start_delay_s)
    finally:
        if owned is not None:
            owned.close()


def _run(plan: Plan, sockets: list[socket.socket], *, timeout_s: float, linger_s: float, slo_ms: float | None,
         progress: bool, keep_payloads: bool, gso: bool, max_batch_pkts: int, spin_us: float,
         start_delay_s: float) -> Report:
    sender = Sender(plan, sockets, gso=gso, max_batch_pkts=max_batch_pkts, spin_us=spin_us)
    tracker = Tracker(plan, sender.sent_ns, timeout_ns=round(timeout_s * 1e9), keep_payloads=keep_payloads)
    receiver = Receiver(sockets, keep_payloads=keep_payloads)
    bar = None
    if progress:
        bar = tqdm(total=plan.n_events, unit="req", desc="sending", dynamic_ncols=True, leave=True)
    interrupted = False
    receiver.start()
    stopped = False
    try:
        sender.start(time.monotonic_ns() + round(start_delay_s * 1e9))
        try:
            while not sender.join(0.05):
                _pump(receiver, tracker, sender, bar)
            _pump(receiver, tracker, sender, bar)
            if bar is not None:
                bar.set_description("waiting for answers")
            deadline = time.monotonic_ns() + round(linger_s * 1e9)
            settle = None
            n_sent = int(((sender.sent_ns >= 0) & (plan.ev_app >= 0)).sum())
            while time.monotonic_ns() < deadline:
                time.sleep(0.005)
                _pump(receiver, tracker, sender, bar)
                if tracker.outstanding(n_sent) == 0 and tracker.incomplete() == 0:
                    # Everything answered: listen a moment longer for duplicates, then stop.
                    settle = settle or time.monotonic_ns() + 20_000_000
                    if time.monotonic_ns() >= min(settle, deadline):
                        break
        except KeyboardInterrupt:
            interrupted = True
            sender.stop()
            try:
                sender.join()
                end = time.monotonic_ns() + round(min(linger_s, 0.25) * 1e9)
                while time.monotonic_ns() < end and tracker.outstanding():
                    time.sleep(0.005)
                    _pump(receiver, tracker, sender, bar)
            except KeyboardInterrupt:
                pass
        listen_end = time.monotonic_ns()
        receiver.stop()
        stopped = True
        _pump(receiver, tracker, sender, bar)
    finally:
        if not stopped:
            sender.stop()
            receiver.stop()
        if bar is not None:
            bar.close()
    return build_report(plan, sender, tracker, receiver.stats(), timeout_s=timeout_s, slo_ms=slo_ms,
                        interrupted=interrupted, listen_end_ns=listen_end)


def _pump(receiver: Receiver, tracker: Tracker, sender: Sender, bar) -> None:
    recs, payload = receiver.drain()
    tracker.feed(recs, payload)
    if bar is not None:
        ev, _pk, _b = sender.progress()
        bar.n = ev
        bar.set_postfix(answered=tracker.answered, refresh=False)
        bar.refresh()
