"""`gpuprims doctor` on a machine without a GPU (says so, checks what it can) and on the fake CUDA
runtime (every GPU check runs), plus the MPS client check with a stand-in daemon."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuprims.backend import cuda_available
from gpuprims.testing import fake
from orchestrator.cli import doctor


@pytest.mark.skipif(cuda_available(), reason="checks what a machine without a GPU reports")
def test_without_a_gpu_it_says_so_and_checks_what_it_can(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fake.FAKE_ENV, raising=False)
    r = CliRunner().invoke(doctor.main, ["doctor", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "NO GPU" in r.output and "--fake" in r.output
    doc = json.loads((tmp_path / "doctor.json").read_text())
    s = doc["summary"]
    assert s["extension"]["ok"] is True
    assert s["runtime_driver"]["ok"] is None and "driver" in s["runtime_driver"]["skipped"]
    assert all(s[k]["ok"] is None for k in ("pinned_mapped", "events", "ipc", "gpu_dma", "sync_lite"))
    assert all("proves" in v for v in s.values())
    assert doc["machine"]["device"].startswith("cpu-") and "load_avg_before" in doc["machine"]


@pytest.mark.slow
def test_on_the_fake_runtime_every_gpu_check_runs(tmp_path: Path, fake_cuda: object) -> None:
    r = CliRunner().invoke(doctor.main, ["doctor", "--fake", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "doctor-fake.json").read_text())["summary"]
    for k in ("runtime_driver", "pinned_mapped", "events", "ipc", "gpu_dma", "sync_lite", "engines"):
        assert s[k]["ok"] is True, (k, s[k])
    assert s["engines"]["cudagraph_matches_eager_b1"] and s["engines"]["cudagraph_matches_eager_b4"]
    assert s["gpu_dma"]["gpu_dma_exact"] and s["gpu_dma"]["cuda_copy_exact"]
    assert s["events"]["achieved_interval_us"] >= 0
    assert json.loads((tmp_path / "doctor-fake.json").read_text())["machine"]["fake_runtime"] is True


def test_a_driver_too_old_for_the_runtime_fails_with_the_reason(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fake.FAKE_ENV, "driver=12020,runtime=13000")
    fake.reset()
    try:
        r = CliRunner().invoke(doctor.main, ["doctor", "--out", str(tmp_path)])
    finally:
        fake.reset("1")
    assert r.exit_code == 1
    s = json.loads((tmp_path / "doctor-fake.json").read_text())["summary"]
    assert s["runtime_driver"]["ok"] is False and "rebuild" in s["runtime_driver"]["reason"]
    assert s["gpu_dma"]["ok"] is None  # skipped with the same reason, not failed obscurely


def test_instances_not_served_by_mps_fail_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    binary = tmp_path / "bin" / "nvidia-cuda-mps-control"
    binary.parent.mkdir()
    binary.write_text('#!/bin/sh\nread cmd args\ncase "$cmd" in get_server_list) echo 77 ;; '
                      'get_client_list) echo 1001 ;; esac\n')
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{binary.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    ok = doctor.check_mps({1001: 40})
    assert ok["ok"] and ok["servers"] == {77: [1001]}
    bad = doctor.check_mps({1001: 40, 1002: 60})
    assert not bad["ok"] and "pid 1002 (GPU% 60)" in bad["why"]


def test_instance_option_is_validated(tmp_path: Path) -> None:
    r = CliRunner().invoke(doctor.main, ["doctor", "--instance", "12", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "PID:PCT" in r.output


def test_the_engines_check_builds_tensorrt_where_installed(fake_cuda: object, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from tests.gpuprims.engines import trt_standin

    monkeypatch.setitem(sys.modules, "tensorrt", trt_standin.make())
    out = doctor.check_engines()
    assert out["ok"] is True, out
    assert out["tensorrt_matches_eager_b1"] and out["tensorrt_matches_eager_b4"] and out["cudagraph_matches_eager_b4"]
