from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
from click.testing import CliRunner

from gpuprims.interrupt import ctrl_c_interrupts
from gpuprims.traffic import EchoServer, read_pcap
from gpuprims.traffic.cli import main, parse_app

from .conftest import ANSWER_TIMEOUT_S


@contextlib.contextmanager
def _cli(*args: str, launcher: str | None = None) -> Iterator[subprocess.Popen]:
    """The CLI in a subprocess that is always reaped, whatever the test asserts.

    `launcher`: Python code run first (`python -c launcher args...`) that execs the CLI itself.
    SIGINT reaches the child with its default handling even where this process ignores it.
    """
    cmd = [sys.executable, "-c", launcher, *args] if launcher else [sys.executable, "-m", "gpuprims.traffic.cli", *args]
    with ctrl_c_interrupts():  # a SIGINT this process ignores would be inherited ignored
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


def test_app_spec_parsing() -> None:
    a = parse_app("3:224x224x3:uint8,rate=50,to=127.0.0.1:9005", {"count": 10, "pps": 1000})
    assert (a.app_id, a.shape, a.dtype, a.rate, a.pps, a.count, a.to) == \
        (3, (224, 224, 3), "uint8", 50.0, None, 10, ("127.0.0.1", 9005))
    b = parse_app("4:16", {"rate": 5.0, "duration": 2.0, "dtype": "float32"})
    assert (b.shape, b.dtype, b.rate, b.duration_s) == ((16,), "float32", 5.0, 2.0)
    import click

    with pytest.raises(click.BadParameter, match="unknown key 'speed'"):
        parse_app("1:16:uint8,speed=3", {"count": 1, "rate": 1})
    with pytest.raises(click.BadParameter, match="expected ID:SHAPE"):
        parse_app("1", {})


def test_gen_and_pcap_commands(tmp_path) -> None:
    r = CliRunner().invoke(main, ["gen", "--app", "1:224x224x3:float32", "--app", "2:3x32x32:uint8", "-o",
                                  str(tmp_path / "r.npz")])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert [a["packets_per_request"] for a in doc["apps"]] == [588, 3]
    arrays = np.load(tmp_path / "r.npz")
    assert arrays["app1_v0"].shape == (224, 224, 3) and arrays["app2_v0"].dtype == np.uint8
    r = CliRunner().invoke(main, ["pcap", "--app", "1:8x8x3:uint8", "--rate", "100", "--count", "7", "--to",
                                  "127.0.0.1:9001", "--src-ports", "40000-40002", "-o", str(tmp_path / "s.pcap")])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["frames"] == 7
    cap = read_pcap(tmp_path / "s.pcap")
    assert {f.src[1] for f in cap.frames} == {40000, 40001, 40002}
    assert {f.dst for f in cap.frames} == {("127.0.0.1", 9001)}


@pytest.mark.slow
def test_replay_reports_json_with_plots(tmp_path) -> None:
    with EchoServer(delay_s=0.0002) as echo:
        r = CliRunner().invoke(main, ["replay", "--app", f"1:32x32x3:uint8,rate=500,to=127.0.0.1:{echo.port}",
                                      "--app", f"2:1000:uint8,rate=1000,to=127.0.0.1:{echo.port}", "--count", "100",
                                      "--warmup", "0.02", "--ports", "0", "--timeout", str(ANSWER_TIMEOUT_S),
                                      "--no-progress",
                                      "--json", str(tmp_path / "r.json"), "--cdf", str(tmp_path / "cdf.png"),
                                      "--timeline", str(tmp_path / "tl.png"), "--samples", str(tmp_path / "s.npz"),
                                      "--slo-ms", "100"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["sent"] == 200 and doc["answered"] == 200 and doc["lost"] == 0
    assert doc["apps"]["1"]["packets_sent"] == 300 and doc["warmup"]["sent"] == 10 + 20
    assert json.loads((tmp_path / "r.json").read_text())["sent"] == 200
    assert (tmp_path / "cdf.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "tl.png").exists()
    smp = np.load(tmp_path / "s.npz")
    assert len(smp["latency_ns"]) == 230
    # SLO attainment: the measured requests answered within 100 ms (how many is the machine's business).
    lat = smp["latency_ns"][~smp["warmup"]]
    assert doc["slo_attainment"] == pytest.approx(np.mean((lat >= 0) & (lat <= 100e6)))


def test_replay_of_a_pcap_looped(tmp_path) -> None:
    with EchoServer() as echo:
        r = CliRunner().invoke(main, ["pcap", "--app", "5:2000:uint8", "--rate", "1000", "--count", "10", "--to",
                                      f"127.0.0.1:{echo.port}", "-o", str(tmp_path / "s.pcap")])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(main, ["replay", "--pcap", str(tmp_path / "s.pcap"), "--loop", "3", "--speed", "2",
                                      "--timeout", str(ANSWER_TIMEOUT_S), "--no-progress"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert (doc["sent"], doc["answered"], doc["packets_sent"]) == (30, 30, 60)


def test_bad_pcap_error_names_file_and_frame(tmp_path) -> None:
    bad = tmp_path / "bad.pcap"
    r = CliRunner().invoke(main, ["pcap", "--app", "1:3000:uint8", "--rate", "10", "--count", "2",
                                  "-o", str(bad)])
    assert r.exit_code == 0
    bad.write_bytes(bad.read_bytes()[:-7])
    r = CliRunner().invoke(main, ["replay", "--pcap", str(bad), "--no-progress"])
    assert r.exit_code == 1
    assert f"Error: {bad}: frame 6: truncated" in r.output


def test_rate_not_achieved_is_said(tmp_path) -> None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sink:
        sink.bind(("127.0.0.1", 0))
        r = CliRunner().invoke(main, ["replay", "--app", f"1:1024:uint8,to=127.0.0.1:{sink.getsockname()[1]}",
                                      "--pps", "4e7", "--count", "50000", "--timeout", "0.05", "--linger", "0",
                                      "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "target rate NOT achieved" in r.stderr and "of 40,000,000 packets/s" in r.stderr
    doc = json.loads(r.stdout)
    assert doc["sent"] == 50000 and doc["rate"]["achieved"] is False and doc["rate"]["achieved_pps"] > 0


# Starts the CLI with SIGINT ignored, as a shell without job control starts a background command
# (`cmd &` in a script or CI step): exec keeps an ignored signal ignored.
_LAUNCH_WITH_SIGINT_IGNORED = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                               "os.execv(sys.executable, [sys.executable, '-m', 'gpuprims.traffic.cli', *sys.argv[1:]])")


@pytest.mark.real  # the CLI in a child process, interrupted
@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_prints_the_partial_report(inherited: str) -> None:
    duration_s, rate = 60.0, 200
    with EchoServer() as echo, _cli("replay", "--app", f"1:3x32x32:uint8,to=127.0.0.1:{echo.port}", "--rate",
                                    str(rate), "--duration", str(duration_s), "--no-progress", "--timeout", "0.2",
                                    launcher=_LAUNCH_WITH_SIGINT_IGNORED if inherited == "ignored" else None) as p:
        # Left alone, the replay ends by itself once its schedule is over: that bounds both waits. It
        # must have sent 50 requests well within its schedule, and an exit before the schedule's end
        # with a partial report can only come from the signal.
        run_end = time.monotonic() + duration_s
        while echo.counters.requests < 50 and p.poll() is None and time.monotonic() < run_end:
            time.sleep(0.05)
        assert p.poll() is None and echo.counters.requests >= 50, "the replay did not get going"
        p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=max(0.0, run_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail("the replay did not stop on SIGINT: it was still running when its schedule ended")
    assert p.returncode == 130, err
    doc = json.loads(out)
    assert doc["interrupted"] is True
    assert 50 <= doc["sent"] < doc["scheduled"] == duration_s * rate
    # Late answers (the echo shares a busy machine) still count; each sent request is accounted once.
    assert 0 < doc["answered"] <= doc["sent"] == doc["answered"] + doc["late"] + doc["never_answered"]
    assert "partial" in err


@pytest.mark.slow
def test_recv_counts_answers_to_someone_elses_requests(tmp_path) -> None:
    import socket

    from gpuprims import wire

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    r = CliRunner().invoke(main, ["pcap", "--app", "1:100:uint8", "--rate", "10", "--count", "4", "-o",
                                  str(tmp_path / "s.pcap")])
    assert r.exit_code == 0
    with _cli("recv", "--listen", f"127.0.0.1:{port}", "--pcap", str(tmp_path / "s.pcap"), "--idle", "0.5") as p:
        assert p.stderr is not None and "listening on" in p.stderr.readline()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as node:
            for rid in (1, 2, 2, 3, 99):
                for d in wire.encode_response(1, rid, wire.Status.OK, b"r" * 10):
                    node.sendto(d, ("127.0.0.1", port))
        out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    doc = json.loads(out)
    assert (doc["requests"], doc["answered"], doc["not_answered"], doc["duplicates"], doc["unmatched"]) == \
        (4, 3, 1, 1, 1)


def test_busy_client_port_is_a_clear_error() -> None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        r = CliRunner().invoke(main, ["replay", "--app", "1:64:uint8", "--rate", "10", "--count", "1", "--ports",
                                      str(port), "--no-progress"])
    assert r.exit_code == 1
    assert f"cannot bind client port 127.0.0.1:{port}" in r.output


@pytest.mark.parametrize("command", ["recv", "echo", "replay"])
def test_a_busy_port_ends_in_one_line(command: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        args = {"recv": ["recv", "--listen", f"127.0.0.1:{port}", "--duration", "0.1"],
                "echo": ["echo", "--listen", f"127.0.0.1:{port}"],
                "replay": ["replay", "--app", "1:8x8x3:uint8", "--rate", "10", "--count", "1", "--ports", str(port),
                           "--to", "127.0.0.1:9", "--no-progress"]}[command]
        r = CliRunner().invoke(main, args)
    assert r.exit_code == 1, r.output
    assert r.output.strip().splitlines()[-1].startswith("Error: ") and f"127.0.0.1:{port}" in r.output
    assert "Address already in use" in r.output and "Traceback" not in r.output
