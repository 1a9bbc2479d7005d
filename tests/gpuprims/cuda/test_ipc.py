from __future__ import annotations

import dataclasses
import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gpuprims.cuda import ParameterHandles, export_parameters, share_parameters
from gpuprims.cuda.ipc import ENV_OWNER_PID
from tests.gpuprims.cuda.workers import (
    Big,
    build_tied,
    import_cpu,
    import_cuda,
    import_fake_cuda,
    run_spawned,
)


@pytest.mark.real  # a spawned importer process
def test_cpu_share_across_spawn_process_gives_identical_output() -> None:
    model = build_tied(seed=1)
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        ref = model(x)
    exp = export_parameters(model)
    try:
        with torch.no_grad():
            assert torch.equal(model(x), ref)  # the exporter now reads the shared copy
        assert model.enc.weight is model.dec.weight
        names = {n for e in exp.handles.entries for n in e.names}
        assert {"enc.weight", "dec.weight", "bn.running_mean", "bn.num_batches_tracked"} <= names
        shm = Path("/dev/shm") / exp.handles.handle.decode()
        assert shm.exists() and shm.stat().st_size == exp.handles.nbytes
        report = run_spawned(import_cpu, exp.to_bytes(), x)
        assert torch.equal(torch.from_numpy(report["out"]), ref)
        assert report["tied"] and report["in_shm"] and report["no_grad"]
        assert report["meta_after_close"] and report["closed"]
    finally:
        exp.close()
    assert not shm.exists()
    exp.close()  # idempotent


def test_cpu_segment_is_named_after_its_owner(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's instances name their segments after the node (GPUPRIMS_SHM_OWNER_PID), so a sweep
    keeps them while the node runs; a program's after itself."""
    model = build_tied(seed=3)
    with export_parameters(model) as exp:
        assert exp.handles.handle.decode().startswith(f"gpuprims-params-{os.getpid()}-")
    monkeypatch.setenv(ENV_OWNER_PID, "4242")
    with export_parameters(model) as exp:
        assert exp.handles.handle.decode().startswith("gpuprims-params-4242-")


def test_handles_round_trip_and_reject_garbage() -> None:
    model = build_tied(seed=2)
    with export_parameters(model) as exp:
        h = exp.handles
        back = ParameterHandles.from_bytes(exp.to_bytes())
        assert back == h
        assert h.weights_nbytes <= h.nbytes
        assert all(e.offset % 256 == 0 for e in h.entries)
        blob = h.to_bytes()
        with pytest.raises(ValueError, match="bad magic"):
            ParameterHandles.from_bytes(b"nope" + blob)
        with pytest.raises(ValueError, match="malformed"):
            ParameterHandles.from_bytes(blob[:-5])
        with pytest.raises(TypeError, match="expected bytes"):
            ParameterHandles.from_bytes("text")  # type: ignore[arg-type]
        bad = dataclasses.replace(h, backend="cuda")
        with pytest.raises(ValueError, match="64 bytes"):
            ParameterHandles.from_bytes(bad.to_bytes())
        entry = dataclasses.replace(h.entries[0], offset=h.nbytes)
        with pytest.raises(ValueError, match="outside"):
            ParameterHandles.from_bytes(dataclasses.replace(h, entries=(entry,)).to_bytes())
        with pytest.raises(ValueError, match="backend"):
            ParameterHandles.from_bytes(dataclasses.replace(h, backend="tpu").to_bytes())  # type: ignore[arg-type]


@pytest.mark.real  # a spawned importer process
def test_cuda_share_on_the_fake_runtime_goes_through_its_ipc(fake_cuda: Any) -> None:
    """On the fake runtime a model on the CPU exports into fake device memory (backend="cuda"), so a node
    there runs CUDA's IPC path: the importer maps it with cudaIpcOpenMemHandle and computes the same."""
    model = build_tied(seed=4)
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        ref = model(x)
    exp = export_parameters(model, backend="cuda", gpu=0)
    assert exp.handles.backend == "cuda" and exp.handles.handle.startswith(b"FAKEIPC")
    (arena,) = fake_cuda.live("device")
    assert arena.nbytes == exp.handles.nbytes
    with torch.no_grad():
        assert torch.equal(model(x), ref)  # the exporter reads the arena now
    report = run_spawned(import_fake_cuda, exp.to_bytes(), x)
    assert torch.equal(torch.from_numpy(report["out"]), ref)
    assert (report["mapped"], report["closed_after"]) == (1, 0)
    exp.close()
    del model
    gc.collect()
    assert exp.released and fake_cuda.live("device") == []  # freed with the exporting model's tensors


def test_cpu_tensors_go_to_a_cuda_arena_only_on_the_fake_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUPRIMS_FAKE_CUDA", raising=False)
    with pytest.raises(ValueError, match="only on the fake CUDA runtime"):
        export_parameters(build_tied(seed=5), backend="cuda")


def test_exporting_process_is_refused() -> None:
    model = build_tied(seed=3)
    with export_parameters(model) as exp:
        for handles in (exp, exp.handles, exp.to_bytes()):
            with pytest.raises(ValueError, match="exported by this process"):
                share_parameters(handles, build_tied(seed=4))


def test_mismatched_model_is_refused_and_close_detaches() -> None:
    model = build_tied(seed=5)
    x = torch.randn(1, 3, 10, 10)
    with torch.no_grad():
        ref = model(x)
    with export_parameters(model) as exp:
        # A copy of the handles under another token stands for an importing process here.
        foreign = dataclasses.replace(exp.handles, token="f" * 32)
        with pytest.raises(ValueError, match="missing"):
            share_parameters(foreign, nn.Linear(3, 3))
        wrong = build_tied(seed=6)
        wrong.enc = nn.Linear(16, 8, bias=False)
        wrong.dec.weight = wrong.enc.weight
        with pytest.raises(ValueError, match="differ"):
            share_parameters(foreign, wrong)
        with pytest.raises(TypeError, match=r"nn\.Module"):
            share_parameters(foreign, lambda t: t)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="ParameterHandles"):
            share_parameters(42, build_tied(seed=7))  # type: ignore[arg-type]
        other = build_tied(seed=8)
        shared = share_parameters(foreign, other)
        with torch.no_grad():
            assert torch.equal(other(x), ref)
        assert other.conv.weight.data_ptr() != model.conv.weight.data_ptr()  # its own mapping
        view = other.conv.weight.detach()
        shared.close()
        shared.close()
        assert all(p.is_meta for p in other.parameters())
        with pytest.raises((NotImplementedError, RuntimeError)):
            other(x)
        gc.collect()
        assert not shared.closed  # a view still holds the mapping
        del view
        gc.collect()
        assert shared.closed
    with pytest.raises(ValueError, match="do not exist"):
        share_parameters(foreign, build_tied(seed=9))


def test_export_validation() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module"):
        export_parameters(object())
    with pytest.raises(ValueError, match="no parameters"):
        export_parameters(nn.ReLU())
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        export_parameters(mixed)
    with pytest.raises(ValueError, match="CUDA device or the CPU"):
        export_parameters(nn.Linear(2, 2, device="meta"))


def test_exporter_memory_is_released_with_its_model() -> None:
    model = build_tied(seed=10)
    exp = export_parameters(model)
    exp.close()
    assert not exp.released
    del model
    gc.collect()
    assert exp.released


@pytest.mark.gpu
def test_cuda_ipc_share_across_spawn_processes() -> None:
    torch.manual_seed(0)
    model = Big().to("cuda:0")
    x = torch.randn(4, 4096)
    with torch.no_grad():
        ref = model(x.to("cuda:0")).cpu()
    exp = export_parameters(model)
    try:
        assert exp.handles.backend == "cuda" and len(exp.handles.handle) == 64
        with torch.no_grad():
            assert torch.equal(model(x.to("cuda:0")).cpu(), ref)
        with pytest.raises(ValueError, match="exported by this process"):
            share_parameters(exp.to_bytes(), Big())
        report = run_spawned(import_cuda, exp.to_bytes(), x, timeout_s=300)
        assert torch.equal(torch.from_numpy(report["out"]), ref)
        # The importer's added device memory excludes the 128 MiB of weights.
        assert report["added_bytes"] < exp.handles.weights_nbytes // 2, report["added_bytes"]
    finally:
        exp.close()
        del model
        gc.collect()
