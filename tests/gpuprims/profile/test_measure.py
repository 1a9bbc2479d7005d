from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuprims.profile import load_profile
from gpuprims.profile.cli import main
from gpuprims.profile.measure import _submit_shielded, measure_profile, parse_int_list, plot_profile
from tests.gpuprims.sched._profiles import grid

TINY = ["mobilenet", "--batch", "2", "--gpu-pct", "50,100", "--input-shape", "3,32,32", "--width", "0.25",
        "--repeats", "3", "--warmup", "1", "--backend", "cpu", "--no-progress"]


@pytest.mark.slow
def test_cli_measures_each_point_in_its_own_process(tmp_path: Path) -> None:
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    res = CliRunner().invoke(main, [*TINY, "--out", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    p = load_profile(out)
    assert p.source == "measured" and p.backend == "cpu" and p.model == "mobilenet"
    assert p.batch_sizes == [2] and p.gpu_pcts == [50, 100]
    assert p.conditions.input_shape == (3, 32, 32) and p.conditions.repeats == 3
    for pt in p.points:
        assert 0 < pt.latency_p50_ms <= pt.latency_p99_ms
        assert pt.throughput_rps == pytest.approx(2000 / pt.latency_p50_ms)
        assert pt.peak_mem_mb >= 0
    # the first point (50%) ran confined to its core share, set before torch started its thread pool
    from gpuprims.cpushare import available_cores, cores_for_pct

    k = cores_for_pct(50, len(available_cores()))
    assert p.device.endswith(f"this share: {k} cores, {k} threads)")
    assert png.stat().st_size > 1000


@pytest.mark.real
def test_child_failure_names_the_point() -> None:
    with pytest.raises(RuntimeError, match="batch=1 gpu_pct=100 failed: ValueError: unknown model"):
        measure_profile("no_such_net", batch_sizes=[1], gpu_pcts=[100], backend="cpu", repeats=2,
                        progress=False)


@pytest.mark.parametrize(("kw", "needle"), [
    ({"batch_sizes": [0]}, "batch sizes"), ({"batch_sizes": []}, "batch sizes"),
    ({"gpu_pcts": [0]}, "gpu_pcts"), ({"gpu_pcts": [101]}, "gpu_pcts"),
    ({"repeats": 1}, "repeats"), ({"warmup": -1}, "warmup"), ({"input_shape": (3, 0, 4)}, "input_shape"),
    ({"timeout_s": 0}, "timeout_s"), ({"backend": "tpu"}, "backend"),
])
def test_measure_bad_input(kw: dict, needle: str) -> None:
    args = {"batch_sizes": [1], "gpu_pcts": [100], "backend": "cpu", "progress": False} | kw
    with pytest.raises(ValueError, match=needle):
        measure_profile("mobilenet", **args)
    with pytest.raises(ValueError, match="model"):
        measure_profile("", batch_sizes=[1], gpu_pcts=[1])


def test_parse_int_list() -> None:
    assert parse_int_list("4, 1,2,2", label="x") == [1, 2, 4]
    assert parse_int_list("3,32,32", label="x", ordered=True) == [3, 32, 32]
    with pytest.raises(ValueError, match="x: 'a' is not an integer"):
        parse_int_list("1,a", label="x")
    with pytest.raises(ValueError, match="x: 0 must be >= 1"):
        parse_int_list("0", label="x")
    with pytest.raises(ValueError, match=r"must be in 1\.\.100"):
        parse_int_list("101", label="x", hi=100)


@pytest.mark.parametrize(("args", "needle"), [
    (["m", "--out", "x.json", "--batch", "1,x"], "--batch: 'x' is not an integer"),
    (["m", "--out", "x.json", "--gpu-pct", "0"], "--gpu-pct: 0 must be in 1..100"),
    (["m", "--out", "x.json", "--repeats", "1"], "repeats"),
    (["m", "--out", "x.json", "--backend", "tpu"], "backend"),
    (["m"], "--out"),
])
def test_cli_bad_input(args: list[str], needle: str) -> None:
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and needle in res.output


@pytest.mark.slow
def test_plot_marks_the_knee(tmp_path: Path) -> None:
    p = grid("toy", {25: {1: 8.0, 4: 20.0}, 50: {1: 4.0, 4: 10.0}, 100: {1: 3.8, 4: 6.0}})
    out = plot_profile(p, tmp_path / "k.png")
    assert out.stat().st_size > 1000


@pytest.mark.slow


def _as_a_background_job() -> None:
    """Start the child as a shell without job control starts `cmd &`: with SIGINT ignored. A Ctrl-C
    (SIGINT to its process group) must still end it with its partial result."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.real
def test_ctrl_c_keeps_the_points_measured(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    # Eight points, each its own worker process: after the first, the rest take far longer than any
    # delay between seeing "1/8" and the Ctrl-C landing on a busy machine, so the run is interrupted.
    args = [sys.executable, "-m", "gpuprims.profile.cli", "mobilenet", "--batch", "1,2,3,4,5,6,7,8", "--gpu-pct",
            "100", "--input-shape", "3,32,32", "--width", "0.25", "--repeats", "3", "--warmup", "1", "--backend",
            "cpu", "--out", str(out)]
    err_path = tmp_path / "err.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                preexec_fn=_as_a_background_job,
                                cwd=Path(__file__).resolve().parents[3])
    try:
        deadline = time.monotonic() + 120  # one point: a spawn process importing torch on a busy machine
        while "1/8" not in err_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = err_path.read_text()
    m = re.search(r"interrupted after (\d+) of 8 points", text)
    assert "Traceback" not in text and m is not None, text
    done = int(m.group(1))
    assert 1 <= done < 8
    raw = json.loads(out.with_suffix(".partial.json").read_text())
    assert raw["measured"] == done and [pt["batch_size"] for pt in raw["points"]] == list(range(1, done + 1))
    p = load_profile(out)
    assert p.batch_sizes == list(range(1, done + 1)) and p.gpu_pcts == [100]


class _Worker:
    def __init__(self) -> None:
        self.killed = False

    def kill(self) -> None:
        self.killed = True


class _PoolHitByCtrlC:
    """A pool whose submit is hit by a Ctrl-C half-way, as when the signal lands while the worker
    process is being started (between its start and the write of its start-up data)."""

    def __init__(self) -> None:
        self.worker = _Worker()
        self._processes = {1: self.worker}
        self.steps: list[str] = []

    def submit(self, fn: object, *args: object) -> str:
        self.steps.append("started")
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # bytecodes after the signal, where an unshielded submit is interrupted
            pass
        self.steps.append("data written")
        return "future"


def test_a_ctrl_c_during_a_submit_lets_it_finish_then_kills_the_worker_and_interrupts() -> None:
    # pytest's own process may ignore SIGINT (run as a background job, as beside busy loops): the
    # test installs the handler an interactive CLI has, and puts back whatever was there.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        pool = _PoolHitByCtrlC()
        with pytest.raises(KeyboardInterrupt):
            _submit_shielded(pool, print)  # type: ignore[arg-type]
        assert pool.steps == ["started", "data written"] and pool.worker.killed
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
        assert _submit_shielded(_PoolQuiet(), print) == "future"  # type: ignore[arg-type]
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_process_that_ignores_ctrl_c_keeps_ignoring_it_during_a_submit() -> None:
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pool = _PoolHitByCtrlC()
        assert _submit_shielded(pool, print) == "future"  # type: ignore[arg-type]
        assert pool.steps == ["started", "data written"] and not pool.worker.killed
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


class _PoolQuiet:
    def __init__(self) -> None:
        self._processes: dict[int, _Worker] = {}

    def submit(self, fn: object, *args: object) -> str:
        return "future"


@pytest.mark.real
def test_cli_device_cpu_records_the_pool_and_the_stages(tmp_path: Path) -> None:
    out = tmp_path / "siamese-cpu.json"
    res = CliRunner().invoke(main, ["siamese", "--device", "cpu", "--cores", "1", "--stages", "--batch", "1",
                                    "--gpu-pct", "100", "--input-shape", "2,8,16", "--width", "0.25",
                                    "--repeats", "3", "--warmup", "1", "--no-progress", "--out", str(out)])
    assert res.exit_code == 0, res.output
    p = load_profile(out)
    assert p.format_version == 2 and p.kind == "cpu" and p.cpu_cores == 1 and p.backend == "cpu"
    assert [s.name for s in p.stages] == ["left", "right", "merge"]
    assert p.task_graph().task("merge").deps == ("left", "right")
    assert all(s.latency_ms["cpu"] > 0 for s in p.stages)
    assert "3 stages" in res.output


@pytest.mark.parametrize(("args", "needle"), [
    (["m", "--out", "x.json", "--cores", "2"], "--cores applies to --device cpu"),
    (["m", "--out", "x.json", "--device", "cpu", "--cores", "999"], "only"),
    (["m", "--out", "x.json", "--device", "gpu"], "device"),
])
def test_cli_bad_device_input(args: list[str], needle: str) -> None:
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and needle in res.output


def test_measure_refuses_an_accelerator_profile_without_a_gpu() -> None:
    from gpuprims.backend import cuda_available

    if not cuda_available():  # with a GPU the accelerator profile is measurable (test_cli_... on a GPU host)
        with pytest.raises(ValueError, match="needs a GPU"):
            measure_profile("mobilenet", batch_sizes=[1], gpu_pcts=[100], device_kind="accelerator")
    with pytest.raises(ValueError, match="CPU backend"):
        measure_profile("mobilenet", batch_sizes=[1], gpu_pcts=[100], device_kind="cpu", backend="cuda")


ENGINE_TINY = ["mobilenet_v2", "--batch", "2", "--gpu-pct", "100", "--input-shape", "3,32,32", "--repeats", "3",
               "--warmup", "1", "--backend", "cpu", "--no-progress"]


@pytest.mark.slow
def test_profile_taken_with_an_engine_says_so_and_builds_it_once(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    from gpuprims.engines import EngineCache

    out, cache = tmp_path / "p.json", tmp_path / "cache"
    args = [*ENGINE_TINY, "--out", str(out), "--engine", "onnxruntime", "--engine-option", "provider=cpu",
            "--engine-cache", str(cache)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    p = load_profile(out)
    assert "engine onnxruntime provider=cpu" in p.device and p.points[0].latency_p50_ms > 0
    assert len(EngineCache(cache).entries()) == 1


@pytest.mark.parametrize(("extra", "fragment"), [
    (["--engine", "onnxruntime", "--engine-option", "provider=cuda"], "needs the cuda backend"),
    (["--engine", "no_such_engine"], "unknown engine 'no_such_engine'"),
    (["--engine", "onnxruntime", "--engine-option", "threads=2"], "has no option(s) ['threads']"),
    (["--engine", "onnxruntime", "--width", "0.5"], "drop --width 0.5"),
    (["--engine", "onnxruntime", "--engine-option", "provider"], "KEY=VALUE"),
])
def test_profile_engine_arguments_are_checked_before_measuring(tmp_path: Path, extra: list[str],
                                                               fragment: str) -> None:
    res = CliRunner().invoke(main, [*ENGINE_TINY, "--out", str(tmp_path / "p.json"), *extra])
    assert res.exit_code != 0 and fragment in res.output, res.output
    assert not (tmp_path / "p.json").exists()
