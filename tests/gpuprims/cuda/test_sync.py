from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from gpuprims.cuda import AdaptiveWait, CpuStream, Stream, sync_blocking, sync_callback, sync_lite


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).eval()


class Slow(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x * 2


def test_cpu_backend_all_schemes_equal_eager() -> None:
    model = small_model()
    batch = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = model(batch)
    assert torch.equal(sync_lite(model, batch), ref)
    assert torch.equal(sync_lite(model, batch, interval_us=0), ref)
    for how in ("device", "stream", "event"):
        assert torch.equal(sync_blocking(model, batch, how=how), ref)
    assert torch.equal(sync_callback(model, batch), ref)
    s = CpuStream()
    try:
        assert torch.equal(sync_lite(model, batch, stream=s), ref)
        assert torch.equal(sync_callback(model, batch, stream=s, timeout_s=30), ref)
    finally:
        s.close()


def test_cpu_backend_runs_without_autograd() -> None:
    lin = nn.Linear(4, 2)
    out = sync_lite(lin, torch.randn(3, 4))
    assert not out.requires_grad


def test_adaptive_wait_learns_then_sleeps_first() -> None:
    aw = AdaptiveWait(fine_interval_us=5, margin_us=1000, warmup=3)
    assert aw.wake_at(123) == 0
    model = Slow(0.004)
    batch = torch.ones(2)
    for _ in range(4):
        assert torch.equal(sync_lite(model, batch, adaptive=aw), batch * 2)
    t0 = 1_000_000_000
    wake = aw.wake_at(t0)
    assert t0 < wake < t0 + 10_000_000  # about 4 ms minus the 1 ms margin after the start
    aw.observe(0)  # ignored
    assert len(aw._samples) == 4


def test_timeouts_raise() -> None:
    model = Slow(0.2)
    with pytest.raises(TimeoutError):
        sync_lite(model, torch.ones(1), timeout_s=0.01)
    with pytest.raises(TimeoutError):
        sync_callback(model, torch.ones(1), timeout_s=0.01)


def test_validation() -> None:
    model = small_model()
    batch = torch.randn(1, 3, 8, 8)
    with pytest.raises(TypeError, match="callable"):
        sync_lite(42, batch)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        sync_lite(model, [1, 2])
    for bad in (-1, "5", True):
        with pytest.raises(ValueError, match="interval_us"):
            sync_lite(model, batch, interval_us=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        sync_lite(model, batch, timeout_s=-0.1)
    with pytest.raises(ValueError, match="timeout_s"):
        sync_callback(model, batch, timeout_s="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="AdaptiveWait"):
        sync_lite(model, batch, adaptive=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="how must be"):
        sync_blocking(model, batch, how="spin")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CpuStream"):
        sync_lite(model, batch, stream=Stream.from_handle(1))
    with pytest.raises(TypeError, match="CpuStream"):
        sync_blocking(model, batch, stream=7)
    for kwargs, match in (({"fine_interval_us": -1}, "fine_interval_us"), ({"margin_us": "x"}, "margin_us"),
                          ({"quantile": 101}, "quantile"), ({"window": 0}, "window"),
                          ({"warmup": 0}, "warmup"), ({"window": 4, "warmup": 5}, "warmup")):
        with pytest.raises(ValueError, match=match):
            AdaptiveWait(**kwargs)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("device", [0, -1])
def test_gpu_all_schemes_equal_eager(device: int) -> None:
    dev = torch.cuda.device_count() - 1 if device < 0 else device
    model = small_model().to(f"cuda:{dev}")
    batch = torch.randn(4, 3, 32, 32, device=f"cuda:{dev}")
    with torch.no_grad():
        ref = model(batch)
    torch.cuda.synchronize(dev)
    assert torch.equal(sync_lite(model, batch), ref)
    assert torch.equal(sync_lite(model, batch, interval_us=0), ref)
    aw = AdaptiveWait(warmup=2)
    for _ in range(4):
        assert torch.equal(sync_lite(model, batch, adaptive=aw), ref)
    for how in ("device", "stream", "event"):
        assert torch.equal(sync_blocking(model, batch, how=how), ref)
    assert torch.equal(sync_callback(model, batch, timeout_s=30), ref)
    ts = torch.cuda.Stream(device=dev)
    assert torch.equal(sync_lite(model, batch, stream=ts), ref)
    assert torch.equal(sync_lite(model, batch, stream=ts.cuda_stream), ref)
    ours = Stream(dev)
    assert torch.equal(sync_lite(model, batch, stream=ours), ref)
    assert torch.equal(sync_callback(model, batch, stream=ours), ref)
    assert torch.equal(sync_blocking(model, batch, stream=ours, how="stream"), ref)
    with pytest.raises(TypeError, match="stream must be"):
        sync_lite(model, batch, stream=CpuStream())
