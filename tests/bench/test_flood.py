"""bench/flood: a quick flood (20 MB bodies) of a real node writes a well-formed result to a private directory.

Memory figures are reported, never asserted here (the machine is shared); what is asserted is what the
node promises whatever the load: every oversized body is refused (413 / RESOURCE_EXHAUSTED), no HTTP
client had to send its whole body first, and the node answers a normal request on every transport
afterwards with the logits it gave before.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from bench import flood

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.heavy  # a real node; the same flood in-process is tests/orchestrator/frontdoor/test_http_server.py
def test_a_quick_flood_is_refused_and_the_node_still_answers(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    flood.main(["--quick", "--out-dir", str(tmp_path), "--name", "flood-test"])
    doc = json.loads((tmp_path / "flood-test.json").read_text())
    s, samples = doc["summary"], doc["samples"]
    assert doc["experiment"] == "flood" and "load_avg_before" in doc["machine"] and "load_avg_after" in doc["machine"]
    assert s["body_mb"] == 20.0 and s["clients_per_flood"] == 4
    for key in ("rss_mb_idle", "rss_mb_peak_sampled", "rss_mb_growth", "hwm_mb_idle", "hwm_mb_after", "rss_mb_end"):
        assert isinstance(s[key], float), key
    assert s["rss_mb_idle"] > 0 and s["rss_mb_peak_sampled"] >= s["rss_mb_idle"]
    assert (s["before_fix_rss_mb_idle"], s["before_fix_rss_mb_peak"]) == (278.0, 1170.0)
    assert s["rss_samples"] == len(samples["rss_kb"]) > 1 and s["rss_sample_interval_ms_median"] > 0
    assert s["http_expect.answers"] == s["http_length.answers"] == s["http_chunked.answers"] == [413] * 4
    assert s["grpc.answers"] == ["RESOURCE_EXHAUSTED"] * 4 and s["all_refused"] is True
    for mode in ("http_expect", "http_length", "http_chunked"):
        assert len(s[f"{mode}.sent_mb_each"]) == 4 and s[f"{mode}.sent_mb_max"] < s["body_mb"], mode
        assert s[f"{mode}.refused_s_max"] > 0
    # With Expect the node refuses before 100 Continue, so no body is sent unless the node took longer
    # than curl's 1 s wait to answer the head (a busy machine): then the body is refused like the others.
    assert s["http_expect.sent_mb_max"] <= s["http_length.sent_mb_max"] or s["http_expect.refused_s_max"] >= 1.0
    assert set(samples["floods"]) == set(flood.FLOODS)
    assert s["after.udp_ok"] and s["after.http_ok"] and s["after.grpc_ok"] and s["after_all_ok"] is True
    assert "transport_errors" not in s
    assert str(tmp_path / "flood-test.json") in capsys.readouterr().out
    assert not (ROOT / "bench" / "results" / "cpu-2core" / "flood-test.json").exists()


@pytest.mark.parametrize(("args", "message"), [(["--body-mb", "0"], "--body-mb must be positive, got 0"),
                                               (["--sample-ms", "-1"], "--sample-ms must be positive, got -1")])
def test_bad_arguments_are_refused_by_name(args: list[str], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        flood.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_transport_that_failed_or_changed_its_answer_is_not_ok() -> None:
    before = {"udp": [0.5, 1.0], "http": [0.5, 1.0], "grpc": [0.5, 1.0]}
    after = {"udp": [0.5, 1.0], "http": "status 503: busy", "grpc": [0.5, 2.0]}
    assert flood.same_answers(before, after) == {"udp": True, "http": False, "grpc": False}
    # A transport that failed before the flood cannot prove anything after it.
    assert flood.same_answers({**before, "udp": "error timeout"}, before) == {"udp": False, "http": False,
                                                                           "grpc": False}


def test_the_summary_says_which_flood_was_not_refused() -> None:
    replies = [{"answer": 413, "sent_bytes": 0, "refused_s": 0.01}] * 3 + [
        {"answer": "client error ConnectionResetError()", "sent_bytes": None, "refused_s": None}]
    floods = {"http_length": {"start_s": 0.0, "end_s": 1.0, "replies": replies}}
    logits = {"udp": [1.0], "http": [1.0], "grpc": [1.0]}
    res = flood.summarise(20_000_000, 100 << 10, 100 << 10, 110 << 10, 101 << 10, [(0.5, 120 << 10)], floods,
                          logits, logits)
    s = res["summary"]
    assert s["http_length.all_refused"] is False and s["all_refused"] is False
    assert s["rss_mb_growth"] == 20.0 and s["http_length.rss_mb_peak"] == 120.0 and s["after_all_ok"] is True


def test_a_node_that_is_not_up_in_time_is_said_and_reaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    children = Path(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/children")
    before = children.read_text().split()
    with pytest.raises(SystemExit) as e:
        flood.main(["--quick", "--ready-timeout", "0.001", "--out-dir", str(tmp_path)])
    assert children.read_text().split() == before  # the node it started is gone (killed and waited for)
    err = capsys.readouterr().err
    assert e.value.code == 1 and "the node did not come up within 0.001 s (--ready-timeout)" in err
    assert list(tmp_path.iterdir()) == []  # no result for a run that did not happen


def _serve_whole_body(srv: socket.socket, got: dict[str, object]) -> None:
    """A server with the old bug: it reads every byte of the body (de-chunking it), then answers 200."""
    conn, _ = srv.accept()
    with conn:
        conn.settimeout(30)
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
        if headers.get("Expect") == "100-continue":
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        buf = bytearray(rest)
        if "Content-Length" in headers:
            while len(buf) < int(headers["Content-Length"]):
                buf += conn.recv(1 << 20)
            got["body"] = len(buf)
        else:
            payload = 0
            while True:  # chunk by chunk: a broken size line raises, and the test sees no answer
                while b"\r\n" not in buf:
                    buf += conn.recv(1 << 20)
                line, _, rest2 = bytes(buf).partition(b"\r\n")
                size = int(line, 16)
                while len(rest2) < size + 2:
                    rest2 += conn.recv(1 << 20)
                assert rest2[size:size + 2] == b"\r\n"
                buf = bytearray(rest2[size + 2:])
                payload += size
                if size == 0:
                    break
            got["body"] = payload
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")


@pytest.mark.parametrize("mode", ["http_expect", "http_length", "http_chunked"])
def test_a_server_that_reads_the_whole_body_is_seen_as_not_refusing(mode: str) -> None:
    """The HTTP client streams a well-formed body to the end when nobody stops it, and says so."""
    framing = len(b"%x\r\n" % len(flood.PIECE)) + len(b"\r\n")  # a chunk's size line and its end
    body = 2 * len(flood.PIECE) + 100 if mode != "http_chunked" else 2 * (len(flood.PIECE) + framing)
    got: dict[str, object] = {}
    with socket.create_server(("127.0.0.1", 0)) as srv:
        t = threading.Thread(target=_serve_whole_body, args=(srv, got), daemon=True)
        t.start()
        r = flood.http_flood_one("127.0.0.1", srv.getsockname()[1], mode, body, timeout_s=30)
        t.join(30)
    assert not t.is_alive()
    assert r["answer"] == 200 and r["sent_bytes"] == body, r
    assert got["body"] == (body if mode != "http_chunked" else 2 * len(flood.PIECE))
