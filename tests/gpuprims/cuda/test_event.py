from __future__ import annotations

import threading
import time

import pytest
import torch

from gpuprims.cuda import CpuEvent, CpuStream, Event, Stream, stream_handle


def test_cpu_stream_runs_in_order_and_reports_completion() -> None:
    s = CpuStream()
    try:
        assert s.query() and s.done
        gate = threading.Event()
        seen: list[int] = []
        s.submit(gate.wait)
        futs = [s.submit(seen.append, i) for i in range(5)]
        assert not s.query()
        gate.set()
        s.synchronize()
        assert s.query() and seen == [0, 1, 2, 3, 4] and all(f.done() for f in futs)
        boom = s.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            boom.result()
        assert s.submit(lambda: 5).result() == 5  # an error does not stop the stream
    finally:
        s.close()
    with pytest.raises(ValueError, match="closed"):
        s.submit(print)


def test_cpu_event_marks_the_work_before_it() -> None:
    s = CpuStream()
    try:
        ev = CpuEvent()
        assert ev.query()  # never recorded: complete, like a fresh cudaEvent
        gate = threading.Event()
        s.submit(gate.wait)
        ev.record(s)
        assert not ev.query() and not ev.done
        with pytest.raises(TimeoutError):
            ev.wait(50, timeout_s=0.02)
        gate.set()
        polls = ev.wait(50)
        assert ev.done and polls >= 1
        ev.synchronize()
        start, end = CpuEvent(), CpuEvent()
        start.record(s)
        s.submit(time.sleep, 0.002)
        end.record(s)
        end.synchronize()
        assert start.elapsed_time(end) >= 0
        pending = CpuEvent()
        gate2 = threading.Event()
        s.submit(gate2.wait)
        pending.record(s)
        with pytest.raises(ValueError, match="completed"):
            start.elapsed_time(pending)
        gate2.set()
        pending.wait(0, wake_at_ns=time.monotonic_ns() + 1_000_000)
    finally:
        s.close()


def test_cpu_event_validation() -> None:
    ev = CpuEvent()
    with pytest.raises(TypeError, match="CpuStream"):
        ev.record(0)  # type: ignore[arg-type]
    for bad in (-1, "1", True, float("nan")):
        with pytest.raises(ValueError, match="interval_us"):
            ev.wait(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        ev.wait(10, timeout_s=-1)


def test_stream_handle_conversions() -> None:
    assert stream_handle(None) == 0
    assert stream_handle(0x1234) == 0x1234

    class FakeTorchStream:
        cuda_stream = 0xABC

    assert stream_handle(FakeTorchStream()) == 0xABC
    assert stream_handle(Stream.from_handle(0x55)) == 0x55
    with pytest.raises(ValueError, match="non-negative"):
        stream_handle(-1)
    with pytest.raises(TypeError, match="not a stream"):
        stream_handle(True)
    with pytest.raises(TypeError, match="not a CUDA stream"):
        stream_handle("s")
    borrowed = Stream.from_handle(0x77, device=1)
    borrowed.close()  # borrowed: never destroyed
    assert repr(borrowed) == "Stream(handle=0x77, device=1)"


def test_event_flag_validation() -> None:
    with pytest.raises(ValueError, match="interprocess"):
        Event(0, interprocess=True, timing=True)


@pytest.mark.gpu
def test_cuda_event_and_stream() -> None:
    s = Stream(0)
    ts = torch.cuda.ExternalStream(s.handle, device="cuda:0")
    start, end = Event(0, timing=True), Event(0, timing=True)
    x = torch.randn(2048, 2048, device="cuda:0")
    torch.cuda.synchronize()
    with torch.cuda.stream(ts):
        start.record(s)
        for _ in range(10):
            x = x @ x / 2048
        end.record(s)
    polls = end.wait(10, timeout_s=30)
    assert polls >= 1 and end.done and end.query() and s.query()
    assert start.elapsed_time(end) > 0
    ev = Event(0, blocking=True)
    with torch.cuda.stream(ts):
        x = x @ x
    ev.record(ts)
    ev.synchronize()
    assert ev.done
    s.synchronize()
    other = Stream(0)
    other.wait_event(ev)
    other.synchronize()
    assert "0x" in repr(ev) and "0x" in repr(s)
    for obj in (ev, start, end, s, other):
        obj.close()




def test_polling_lowers_the_timer_slack_and_restores_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 6: a 50 us default timer slack stretches every short poll sleep; the wait lowers the
    polling thread's slack (PR_SET_TIMERSLACK) while it sleeps between polls, puts it back, and
    reports the interval it achieved."""
    import types

    from gpuprims import _native
    from gpuprims.cuda import event as event_module

    _native.set_timer_slack_ns(50_000)  # the Linux default, whatever this thread had
    slack_while_sleeping: list[int] = []

    def sleep(seconds: float) -> None:
        slack_while_sleeping.append(_native.get_timer_slack_ns())
        time.sleep(seconds)

    monkeypatch.setattr(event_module, "time", types.SimpleNamespace(
        sleep=sleep, monotonic=time.monotonic, monotonic_ns=time.monotonic_ns, perf_counter_ns=time.perf_counter_ns))
    s = CpuStream()
    ev = CpuEvent()
    s.submit(time.sleep, 0.05)
    ev.record(s)
    polls = ev.wait(200, timeout_s=10)
    s.close()
    assert slack_while_sleeping and set(slack_while_sleeping) == {1000}
    assert polls >= 2 and ev.achieved_interval_us >= 200
    assert _native.get_timer_slack_ns() == 50_000  # restored
    with pytest.raises(ValueError):
        _native.set_timer_slack_ns(-1)
