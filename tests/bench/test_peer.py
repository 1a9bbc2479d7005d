"""bench/peer's own logic, without any peer installed: rate schedule, stats, process-tree CPU, result assembly."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import psutil
import pytest

from bench import peer
from orchestrator.config.schema import parse_config


def test_schedule_interleaves_and_alternates_who_goes_first() -> None:
    s = peer.schedule(["light", "overload"], ["gpuprims", "ray"], 3)
    assert s == [("light", "gpuprims", 0), ("light", "ray", 0), ("light", "ray", 1), ("light", "gpuprims", 1),
                 ("light", "gpuprims", 2), ("light", "ray", 2),
                 ("overload", "gpuprims", 0), ("overload", "ray", 0), ("overload", "ray", 1),
                 ("overload", "gpuprims", 1), ("overload", "gpuprims", 2), ("overload", "ray", 2)]
    # every system runs every block of every level exactly once
    assert sorted(s) == sorted({(lv, sy, k) for lv in ("light", "overload") for sy in ("gpuprims", "ray")
                                for k in range(3)})
    with pytest.raises(ValueError, match="blocks"):
        peer.schedule(["light"], ["gpuprims"], 0)


def test_rates_and_send_offsets() -> None:
    assert peer.rates(100.0, {"light": 0.25, "medium": 0.6, "overload": 1.5}) == \
        {"light": 25.0, "medium": 60.0, "overload": 150.0}
    assert peer.rates(1.0, {"tiny": 0.01}) == {"tiny": 0.5}  # never below 0.5 req/s
    with pytest.raises(ValueError):
        peer.rates(0.0, {"light": 0.25})
    off, n_warm = peer.send_offsets(20.0, 0.5, 2.0)
    assert n_warm == 10 and len(off) == 50
    assert np.allclose(np.diff(off), 0.05) and off[0] == 0.0
    with pytest.raises(ValueError):
        peer.send_offsets(0.0, 0.5, 1.0)


def _block(lat: list[float], status: list[str], span: float = 2.0, cpu: float = 1.0, total: int | None = None) -> dict:
    return {"latency_ms": lat, "status": status, "span_s": span, "cpu_s": cpu,
            "sent_total": total if total is not None else len(status), "lag_ms": [0.1] * len(status),
            "driver_cpu_s": 0.5}


def test_summarise_counts_slo_lost_errors_and_cpu_over_blocks() -> None:
    b1 = _block([10.0, 20.0, 150.0, 2000.0], ["ok", "ok", "ok", "lost"], total=5)
    b2 = _block([30.0, 1.0], ["ok", "DEADLINE_MISSED"], cpu=0.5, total=2)
    st = peer.summarise([b1, b2], slo_ms=100.0)
    assert st["sent"] == 6 and st["ok"] == 4 and st["lost"] == 1
    assert st["errors"] == {"DEADLINE_MISSED": 1}
    assert st["slo_attainment"] == round(3 / 6, 4)  # 10, 20, 30 within 100 ms; 150 is late
    assert st["throughput_rps"] == 1.0 and st["goodput_rps"] == 0.75  # 4 and 3 over 4 s
    assert st["p50_ms"] == 25.0  # OK answers only: 10, 20, 30, 150
    assert st["cpu_s"] == 1.5 and st["cpu_ms_per_request"] == round(1.5e3 / 7, 3)
    none = peer.summarise([_block([5.0], ["lost"])], slo_ms=100.0)
    assert none["p50_ms"] is None and none["slo_attainment"] == 0.0 and none["lost"] == 1


def test_assemble_orients_ratios_so_above_one_means_gpuprims_ahead() -> None:
    ours = {"throughput_rps": 100.0, "goodput_rps": 90.0, "p50_ms": 10.0, "p99_ms": 20.0, "slo_attainment": 0.9,
            "lost": 0, "cpu_s": 1.0, "cpu_ms_per_request": 2.0}
    theirs = {"throughput_rps": 50.0, "goodput_rps": 30.0, "p50_ms": 25.0, "p99_ms": 80.0, "slo_attainment": 0.3,
              "lost": 7, "cpu_s": 5.0, "cpu_ms_per_request": 5.0}
    out = peer.assemble({"m": {"light": {"gpuprims": ours, "ray": theirs}}})
    assert out["m.light.ray.throughput_ratio"] == 2.0
    assert out["m.light.ray.goodput_ratio"] == 3.0
    assert out["m.light.ray.slo_attainment_ratio"] == 3.0
    assert out["m.light.ray.p50_ratio"] == 2.5 and out["m.light.ray.p99_ratio"] == 4.0
    assert out["m.light.ray.cpu_ratio"] == 2.5
    assert out["m.light.ray.lost"] == 7 and out["m.light.gpuprims.p99_ms"] == 20.0
    # a peer with nothing answered: its ratio is undefined, not a crash
    dead = {**theirs, "throughput_rps": 0.0, "p50_ms": None}
    out = peer.assemble({"m": {"overload": {"gpuprims": ours, "ray": dead}}})
    assert out["m.overload.ray.throughput_ratio"] is None and out["m.overload.ray.p50_ratio"] is None
    with pytest.raises(ValueError, match="no result for gpuprims"):
        peer.assemble({"m": {"light": {"ray": theirs}}})
    json.dumps(out)  # flat and serialisable


class _FakeProc:
    """A psutil.Process stand-in with scripted CPU times; raises NoSuchProcess once 'gone'."""

    def __init__(self, pid: int, cpu: list[float], kids: list[_FakeProc] | None = None) -> None:
        self.pid, self._cpu, self.kids, self.gone = pid, cpu, kids or [], False

    def oneshot(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def _check(self) -> None:
        if self.gone:
            raise psutil.NoSuchProcess(self.pid)

    def create_time(self) -> float:
        self._check()
        return 1000.0 + self.pid

    def cpu_times(self) -> Any:
        self._check()
        # children_* would double count what each child reports itself: the meter must ignore them
        return SimpleNamespace(user=self._cpu[0] / 2, system=self._cpu[0] / 2, children_user=99.0, children_system=99.0)

    def name(self) -> str:
        return f"p{self.pid}"

    def nice(self) -> int:
        return self.pid % 20

    def children(self, recursive: bool = False) -> list[_FakeProc]:
        out = []
        for k in self.kids:
            out.append(k)
            if recursive:
                out += k.children(True)
        return [k for k in out if not k.gone]


def test_cpu_meter_sums_the_tree_and_keeps_what_exited_processes_used() -> None:
    worker = _FakeProc(3, [2.0])
    raylet = _FakeProc(2, [1.0], [worker])
    root = _FakeProc(1, [0.5], [raylet])
    fake = SimpleNamespace(Process=lambda pid: {1: root, 2: raylet, 3: worker}[pid])
    m = peer.CpuMeter(1, proc=fake)
    assert m.sample() == pytest.approx(3.5)
    worker._cpu[0] = 4.0
    root._cpu[0] = 1.0
    assert m.sample() == pytest.approx(6.0)
    worker.gone = True  # exited: keeps its last sample
    newcomer = _FakeProc(4, [0.25])
    raylet.kids.append(newcomer)
    assert m.sample() == pytest.approx(6.25)
    assert {p["pid"] for p in m.processes()} == {1, 2, 3, 4}
    assert next(p for p in m.processes() if p["pid"] == 3) == {"pid": 3, "name": "p3", "nice": 3, "cpu_s": 4.0}
    root.gone = True  # the whole tree gone: total stays
    assert m.sample() == pytest.approx(6.25)


def test_cpu_meter_on_a_real_process_tree(tmp_path: Any) -> None:
    """A parent that spins a child: the child's CPU shows in the tree, and is not counted twice once reaped."""
    child = tmp_path / "child.py"
    child.write_text("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"
                     "open(sys.argv[1], 'w').close()\ntime.sleep(60)\n")
    code = ("import subprocess, sys\n"
            f"c = subprocess.Popen([sys.executable, {str(child)!r}, {str(tmp_path / 'spun')!r}])\n"
            "sys.stdin.readline()\nc.kill()\nc.wait()\nsys.stdin.readline()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True)
    try:
        m = peer.CpuMeter(p.pid)
        deadline = time.monotonic() + 60
        while not (tmp_path / "spun").exists() and time.monotonic() < deadline:
            m.sample()
            time.sleep(0.02)
        assert (tmp_path / "spun").exists()
        with_child = m.sample()
        assert len(m.processes()) == 2
        assert with_child >= 0.3  # the child's spin, seen from its own /proc entry
        p.stdin.write("\n")  # parent reaps the child: its children_* times grow, the meter must not add them
        p.stdin.flush()
        end = time.monotonic() + 30
        while psutil.Process(p.pid).children() and time.monotonic() < end:
            time.sleep(0.02)
        assert m.sample() < with_child + 0.25
    finally:
        p.kill()
        p.wait()


def test_result_document_shape(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """write_result gets the flat summary, the caveats as notes and the raw samples in a sibling file."""
    import bench.common as common

    monkeypatch.setattr(common, "results_dir", lambda backend: tmp_path)
    st = peer.summarise([_block([10.0], ["ok"])], 100.0)
    summary = peer.assemble({"m": {"light": {"gpuprims": st, "ray": st}}})
    path = common.write_result("peer", "cpu", summary, {"m": {"raw": [1, 2]}}, notes=peer.CAVEATS,
                               large_samples=True, load_avg_before=os.getloadavg())
    doc = json.loads(path.read_text())
    assert doc["experiment"] == "peer" and doc["summary"]["m.light.ray.throughput_ratio"] == 1.0
    assert "load_avg_after" in doc["machine"] and "UDP" in doc["notes"] and "niceness" in doc["notes"]
    assert json.loads((tmp_path / doc["samples"]).read_text()) == {"m": {"raw": [1, 2]}}


def test_renice_tree_lowers_only_the_processes_above_zero() -> None:
    class _Niced(_FakeProc):
        def __init__(self, pid: int, nice: int) -> None:
            super().__init__(pid, [0.0])
            self._nice = nice

        def nice(self, value: int | None = None) -> int:  # type: ignore[override]
            if value is not None:
                self._nice = value
            return self._nice

    worker, gcs = _Niced(2, 15), _Niced(3, 0)
    root = _Niced(1, 0)
    root.kids = [worker, gcs]
    m = peer.CpuMeter(1, proc=SimpleNamespace(Process=lambda pid: root))
    assert peer.renice_tree(m, 0) == [{"pid": 2, "name": "p2", "nice_before": 15, "nice_after": 0}]
    assert (root.nice(), worker.nice(), gcs.nice()) == (0, 0, 0)
    assert peer.renice_tree(m, 0) == []


def test_litserve_request_is_json_with_the_raw_tensor_in_base64() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 2, 2) / 7
    doc = json.loads(peer.litserve_body(x))
    assert set(doc) == {"x"}
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(doc["x"]), np.float32).reshape(x.shape), x)


def test_three_systems_are_interleaved_and_each_peer_gets_its_ratios() -> None:
    order = peer.schedule(["light"], ["gpuprims", "ray", "litserve"], 3)
    assert [s for _, s, k in order if k == 0] == ["gpuprims", "ray", "litserve"]
    assert [s for _, s, k in order if k == 1] == ["ray", "litserve", "gpuprims"]
    ours = peer.summarise([_block([10.0, 20.0], ["ok", "ok"])], 100.0)
    slow = peer.summarise([_block([40.0, 80.0], ["ok", "lost"])], 100.0)
    out = peer.assemble({"m": {"light": {"gpuprims": ours, "ray": slow, "litserve": ours}}})
    assert out["m.light.ray.p50_ratio"] > 1 and out["m.light.litserve.p50_ratio"] == 1.0
    assert out["m.light.ray.slo_attainment_ratio"] == 2.0


@pytest.mark.slow
def test_the_plot_draws_any_number_of_systems(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    st = peer.summarise([_block([10.0], ["ok"])], 100.0) | {"rate_rps": 5.0}
    res = {"m": {"results": {lv: {s: st for s in peer.SYSTEMS} for lv in peer.LEVELS}, "systems": list(peer.SYSTEMS)}}
    peer.plot(res, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


class _Totals:
    """A CpuMeter stand-in whose cumulative CPU follows a list, one value per sample."""

    def __init__(self, totals: list[float]) -> None:
        self.totals = totals

    def sample(self) -> float:
        return self.totals.pop(0) if len(self.totals) > 1 else self.totals[0]


def test_wait_quiet_waits_until_every_tree_is_below_the_level_or_gives_up() -> None:
    slept: list[float] = []
    # One tree busy (1 core) for two steps of 0.5 s, then idle; the other idle throughout.
    busy, idle = _Totals([0.0, 0.5, 1.0, 1.05, 1.05]), _Totals([0.0])
    assert peer.wait_quiet([busy, idle], level=0.5, max_s=10, step_s=0.5, sleep=slept.append) == 1.5  # type: ignore[list-item]
    assert slept == [0.5, 0.5, 0.5]
    # Never quiet: gives up at max_s.
    always = _Totals([float(i) for i in range(100)])
    assert peer.wait_quiet([always], level=0.5, max_s=2.0, step_s=0.5, sleep=lambda s: None) == 2.0  # type: ignore[list-item]
    with pytest.raises(ValueError):
        peer.wait_quiet([], level=0, sleep=lambda s: None)


def test_engine_mode_runs_the_same_engine_in_the_node_and_in_litserve(tmp_path: Path) -> None:
    cache = tmp_path / "engines"
    cfg = parse_config(peer.gpuprims_config("mobilenet_v2", 100.0, 9000, "onnxruntime", cache), source="peer test")
    assert cfg.apps[0].engine.kind == "onnxruntime" and cfg.node.engine_cache == str(cache)
    assert cfg.apps[0].max_batch == peer.MAX_BATCH and cfg.apps[0].gpu_pct == peer.GPU_PCT
    argv = peer.litserve_argv("mobilenet_v2", 8124, [0], 1, "onnxruntime", cache)
    assert argv[argv.index("--engine") + 1] == "onnxruntime" and argv[argv.index("--engine-cache") + 1] == str(cache)
    assert argv[argv.index("--max-batch") + 1] == str(peer.MAX_BATCH)
    eager = peer.litserve_argv("mobilenet_v2", 8124, [0], 1)
    assert eager[eager.index("--engine") + 1] == "eager" and "--engine-cache" not in eager
    plain = parse_config(peer.gpuprims_config("mobilenet_v2", 100.0, 9000), source="peer test")
    assert plain.apps[0].engine.kind == "eager" and plain.node.engine_cache is None


@pytest.mark.slow
def test_the_native_driver_counts_every_request_once_with_its_status() -> None:
    from gpuprims.traffic.echo import EchoServer
    from gpuprims.wire import Status

    with EchoServer(drop_every=7) as echo:  # every 7th answer never comes: lost
        r = peer._drive_native(echo.port, rate=200.0, duration_s=0.5, warmup_s=0.1, timeout_s=2.0)
    n = len(r["status"])
    assert n == 100 and r["sent_total"] == 120 and r["span_s"] == 0.5  # 0.1 s of warm-up left out
    lost = r["status"].count("lost")
    assert r["status"].count("ok") + lost == n and lost >= n // 7 - 1  # (a late answer is lost too)
    assert len(r["latency_ms"]) == n and all((s == "ok") == (v == v) for s, v in zip(r["status"], r["latency_ms"]))
    assert len(r["lag_ms"]) == n and min(r["lag_ms"]) >= 0 and r["driver_cpu_s"] >= 0
    with EchoServer(status=Status.DEADLINE_MISSED) as echo:  # an error status is counted under its name
        r = peer._drive_native(echo.port, rate=100.0, duration_s=0.2, warmup_s=0.0, timeout_s=1.0)
    assert set(r["status"]) == {"DEADLINE_MISSED"}
    summary = peer.summarise([{**r, "cpu_s": 0.0}], slo_ms=100.0)
    assert summary["ok"] == 0 and summary["errors"] == {"DEADLINE_MISSED": 20}
    # A rate whose grid misses the warm-up's end: the same count as the asyncio driver's schedule.
    offsets, n_warm = peer.send_offsets(233.5, 0.1, 0.3)
    with EchoServer() as echo:
        r = peer._drive_native(echo.port, rate=233.5, duration_s=0.3, warmup_s=0.1, timeout_s=2.0)
    assert (len(r["status"]), r["sent_total"]) == (len(offsets) - n_warm, len(offsets)) == (70, 93)


def test_native_result_counts_a_request_never_sent_apart() -> None:
    samples = {"app_id": np.array([1, 1, 1, 1]), "warmup": np.array([True, False, False, False]),
               "state": np.array([1, 1, 0, 0]), "status": np.array([0, 0, 0, 0]),
               "latency_ns": np.array([1_000_000, 2_000_000, -1, -1]),
               "sent_ns": np.array([100, 200, 300, -1]), "sched_ns": np.array([0, 90, 190, 290])}
    r = peer.native_result(samples, duration_s=1.0, driver_cpu_s=0.5)
    assert r["status"] == ["ok", "lost", "unsent"] and r["sent_total"] == 4
    assert r["latency_ms"][0] == 2.0 and r["latency_ms"][1] != r["latency_ms"][1]  # NaN: not answered
    assert r["lag_ms"] == [0.0, 0.0]  # the sent ones, from the earliest


def test_paused_stops_a_tree_for_the_block_and_continues_it_even_on_error() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])

    def status_becomes(want: bool) -> bool:  # a signal is delivered asynchronously: wait for /proc to show it
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if (proc.status() == psutil.STATUS_STOPPED) == want:
                return True
            time.sleep(0.01)
        return False

    try:
        meter = peer.CpuMeter(child.pid)
        proc = psutil.Process(child.pid)
        with pytest.raises(RuntimeError, match="block failed"), peer.paused([meter]) as pids:
            assert pids == [child.pid]
            assert status_becomes(True)
            assert peer.idle_cpu({"x": meter}, window_s=0.5, sleep=time.sleep) == {"x": 0.0}  # stopped: no CPU
            raise RuntimeError("block failed")
        assert status_becomes(False)
    finally:
        child.kill()
        child.wait(10)


def test_gpuprims_over_http_and_grpc_are_rows_of_their_own_with_ratios_against_every_peer() -> None:
    def st(p50: float) -> dict[str, Any]:
        return {"throughput_rps": 10.0, "goodput_rps": 10.0, "p50_ms": p50, "p99_ms": 2 * p50,
                "slo_attainment": 1.0, "lost": 0, "cpu_s": 1.0, "cpu_ms_per_request": 1.0}

    out = peer.assemble({"m": {"light": {"gpuprims": st(1.0), "gpuprims-http": st(2.0), "gpuprims-grpc": st(4.0),
                                         "litserve": st(4.0)}}})
    assert out["m.light.litserve.p50_ratio"] == 4.0  # over UDP, the keys as before
    assert out["m.light.litserve.p50_ratio_http"] == 2.0 and out["m.light.litserve.p50_ratio_grpc"] == 1.0
    assert out["m.light.gpuprims-http.p50_ms"] == 2.0
    assert not any(k.startswith(("m.light.gpuprims-http.", "m.light.gpuprims-grpc.")) and "ratio" in k for k in out)
    cfg = parse_config(peer.gpuprims_config("mobilenet_v2", 100.0, 9000, http_port=8123, grpc_port=8124),
                       source="peer test")
    assert (cfg.node.http_port, cfg.node.grpc_port) == (8123, 8124)


def test_the_oip_request_carries_the_tensor_as_binary_data_after_its_json_header() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    body, headers = peer.oip_body(x)
    n = int(headers["Inference-Header-Content-Length"])
    head = json.loads(body[:n])
    assert head["inputs"][0]["shape"] == [1, 3, 2, 2] and head["inputs"][0]["parameters"]["binary_data_size"] == 48
    assert head["outputs"][0]["parameters"]["binary_data"] is True
    assert np.array_equal(np.frombuffer(body[n:], np.float32), x.reshape(-1))
    assert np.array_equal(peer.oip_output(b"{}" + x.tobytes(), 2), x.reshape(-1))


@pytest.mark.slow
def test_the_http_and_grpc_drivers_count_every_request_of_a_real_front_door_once(tmp_path: Path) -> None:
    """The drivers of gpuprims' OIP rows against a real node's front door: every request answered OK,
    the same logits on both ways in as on the UDP wire."""
    import asyncio

    from bench import serving as sv
    from orchestrator.node.node import Node

    http, grpc = peer.free_port(socket.SOCK_STREAM), peer.free_port(socket.SOCK_STREAM)
    raw = peer.gpuprims_config("mobilenet_v2", 2000.0, 0, http_port=http, grpc_port=grpc)
    raw["node"]["run_dir"] = str(tmp_path / "run")
    node = Node(parse_config(raw, source="peer test"), warmup=False)
    with node:
        x = peer.inputs()[0]
        ref = peer.ask_gpuprims(sv.port_of(node), x)
        assert ref is not None
        for system, port in (("gpuprims-http", http), ("gpuprims-grpc", grpc)):
            got = peer.ASK_OIP[system]("mobilenet_v2", port, x)
            assert got is not None and np.allclose(got, ref, atol=1e-5)
            r = asyncio.run(peer._drive_async(system, port, rate=40.0, duration_s=0.5, warmup_s=0.1, timeout_s=10.0,
                                              model="mobilenet_v2"))
            assert r["status"] == ["ok"] * 20 and r["sent_total"] == 24
            assert all(v == v for v in r["latency_ms"])  # every one timed


def test_mlserver_is_a_peer_by_default_and_its_repository_batches_and_confines_like_the_node(tmp_path: Path) -> None:
    assert "mlserver" in peer.PEERS and peer.ASK_OIP["mlserver"] is peer.ask_gpuprims_grpc
    cache = tmp_path / "engines"
    root = peer.mlserver_repository(tmp_path / "repo", "mobilenet_v2", 9001, 9002, [1], 1, "onnxruntime", cache)
    settings = json.loads((root / "settings.json").read_text())
    assert settings["grpc_port"] == 9001 and settings["http_port"] == 9002 and settings["host"] == "127.0.0.1"
    assert settings["parallel_workers"] == 1 and settings["metrics_endpoint"] is None and settings["debug"] is False
    model = json.loads((root / "mobilenet_v2" / "model-settings.json").read_text())
    assert model["name"] == "mobilenet_v2" and model["implementation"] == "bench.peer_mlserver.ZooModel"
    assert model["max_batch_size"] == peer.MAX_BATCH and model["max_batch_time"] == pytest.approx(peer.MAX_WAIT_MS / 1e3)
    extra = model["parameters"]["extra"]
    assert extra == {"model": "mobilenet_v2", "shape": list(peer.SHAPE), "cores": [1], "threads": 1,
                     "max_batch": peer.MAX_BATCH, "engine": "onnxruntime", "engine_cache": str(cache)}
    assert [i["name"] for i in model["inputs"]] == ["input"] and [o["name"] for o in model["outputs"]] == ["logits"]
    # the class the worker loads is where the settings say (the module imports mlserver, so not imported here)
    assert (Path(peer.ROOT) / "bench" / "peer_mlserver.py").read_text().count("class ZooModel(MLModel)") == 1


def test_without_mlservers_environment_the_bench_says_how_to_make_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPRIMS_MLSERVER_VENV", str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit, match=r"scripts/setup-mlserver\.sh"):
        peer.mlserver_venv()


def _mlserver_missing() -> str | None:
    venv = Path(os.environ.get("GPUPRIMS_MLSERVER_VENV") or peer.MLSERVER_VENV)
    return None if (venv / "bin" / "mlserver").exists() else \
        f"MLServer's environment is not at {venv} (scripts/setup-mlserver.sh makes it; make test does not)"


@pytest.mark.slow
@pytest.mark.skipif(_mlserver_missing() is not None, reason=str(_mlserver_missing()))
def test_mlserver_peer_answers_each_batched_request_with_its_own_logits(tmp_path: Path) -> None:
    """MLServer started as the bench starts it answers over gRPC like torch, and requests its adaptive
    batcher merges each get their own row back."""
    import concurrent.futures

    import torch

    from apps.zoo import load_model

    xs = peer.inputs()[:8]
    with torch.inference_mode():
        ref = load_model("mobilenet_v2", seed=0, input_shape=peer.SHAPE).eval()(torch.from_numpy(xs)).numpy()
    port = peer.free_port(socket.SOCK_STREAM)
    proc = peer.start_mlserver("mobilenet_v2", port, [0], 1, tmp_path)
    try:
        first = peer.wait_ready(proc, lambda x: peer.ask_gpuprims_grpc("mobilenet_v2", port, x), xs[0], timeout_s=240)
        np.testing.assert_allclose(first, ref[0], atol=1e-4)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda x: peer.ask_gpuprims_grpc("mobilenet_v2", port, x), xs))
        for k, out in enumerate(outs):
            assert out is not None, f"request {k} unanswered"
            np.testing.assert_allclose(out, ref[k], atol=1e-4)
        tree = proc.meter._tree()
        assert len(tree) >= 2, "MLServer's inference worker is a process of its own"
    finally:
        proc.stop()
    assert not proc.alive() and not [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
