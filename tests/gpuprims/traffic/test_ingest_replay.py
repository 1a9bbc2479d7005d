"""The traffic tool against the native ingest: what it sends is what the ingest counts."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from gpuprims import wire
from gpuprims.ingest import Ingest, packet_balance
from gpuprims.pool import PacketPool
from gpuprims.traffic import AppStream, Stream, read_pcap, replay_plan, run, write_datagrams, write_pcap

from .conftest import ANSWER_TIMEOUT_S, need_tool


class Node:
    """Pool + ingest on loopback, and a thread that answers every request OK (a stand-in instance)."""

    def __init__(self, apps: tuple[int, ...] = (1, 2), **ingest_kw) -> None:
        self.pool = PacketPool.create(slot_count=8192, record_count=512, max_chunks=600, consumer_count=1)
        self.ingest = Ingest(self.pool, [("127.0.0.1", 0)], **ingest_kw).start()
        for a in apps:
            self.ingest.set_route(a, [0])
        self.addr = ("127.0.0.1", self.ingest.ports[0])
        self.served = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        cons = self.pool.consumer(0)
        while not self._stop.is_set():
            recs = cons.poll(64, 20)
            if len(recs):
                info = self.pool.requests(recs)
                cons.answer_status(recs, info, wire.Status.OK)
                self.served += len(recs)

    def counters(self) -> dict[str, int]:
        return self.ingest.counters()

    def wait_received(self, packets: int) -> dict[str, int]:
        """The counters once the ingest has taken in `packets` datagrams (it may lag the run's end
        on a busy machine), allowing it as long as a run allows an answer."""
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while (c := self.counters())["packets_received"] < packets and time.monotonic() < deadline:
            time.sleep(0.005)
        return c

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.ingest.stop()
        self.pool.close()


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node()
    yield n
    n.close()


def test_generated_stream_is_counted_by_the_ingest(node: Node) -> None:
    stream = Stream([AppStream(1, (224, 224, 3), "uint8", rate=100, count=20, to=node.addr),
                     AppStream(2, (5000,), "uint8", rate=1000, count=200, to=node.addr)], seed=1)
    s = run(stream, ports="0", timeout_s=ANSWER_TIMEOUT_S).summary
    c = node.wait_received(s["packets_sent"])
    assert s["sent"] == 220 and s["answered"] == 220 and s["status"] == {"OK": 220}
    assert s["packets_sent"] == 20 * 147 + 200 * 5
    assert c["packets_received"] == c["packets_accepted"] == s["packets_sent"]
    assert c["requests_completed"] == c["requests_delivered"] == 220
    assert packet_balance(c) == 0 and node.ingest.drops() == {}
    assert s["latency_ms"]["p50"] > 0


def test_malformed_pcap_is_dropped_by_reason(node: Node, tmp_path) -> None:
    good = wire.encode_request(1, 500, np.arange(3000, dtype=np.uint16).view(np.uint8))  # 6 chunks
    bad_magic = bytearray(good[0])
    bad_magic[0] ^= 0xFF
    bad_version = bytearray(good[1])
    bad_version[4] = 9
    short = good[2][:30]
    response = wire.encode_response(1, 7, wire.Status.OK, b"x" * 20)[0]
    bad_len = good[3] + b"extra"
    datagrams = [*good, bytes(bad_magic), bytes(bad_version), short, response, bad_len, b"not ours at all"]
    path = tmp_path / "malformed.pcap"
    write_datagrams(path, datagrams, dst=node.addr, interval_s=1e-4)
    with pytest.raises(ValueError, match=r"malformed.pcap: frame 7: UDP payload is not a gpuprims request"):
        replay_plan(read_pcap(path))
    plan = replay_plan(read_pcap(path), raw=True)
    assert plan.description["skipped"] == {"responses": 1}
    s = run(plan, timeout_s=ANSWER_TIMEOUT_S).summary
    assert s["sent"] == 1 and s["answered"] == 1 and s["raw_datagrams_sent"] == 5
    c = node.wait_received(6 + 5)
    assert c["packets_received"] == 6 + 5
    assert node.ingest.drops() == {"bad_magic": 1, "bad_version": 1, "truncated": 2, "bad_length": 1}
    assert c["requests_completed"] == 1 and packet_balance(c) == 0


def test_duplicate_requests_in_a_pcap_reach_the_ingest_once(node: Node, tmp_path) -> None:
    dg = wire.encode_request(2, 42, np.zeros(2500, np.uint8))
    path = tmp_path / "dup.pcap"
    write_datagrams(path, [*dg, dg[1]], dst=node.addr)
    plan = replay_plan(read_pcap(path))  # one request of three chunks; the repeated chunk is sent once
    assert plan.n_events == 1 and plan.unit_count.tolist() == [3]
    plan2 = replay_plan(read_pcap(path), loops=2)
    s = run(plan2, timeout_s=ANSWER_TIMEOUT_S).summary
    assert s["answered"] == 2
    assert node.counters()["requests_completed"] == 2


LO_SYSCTLS = ("route_localnet", "accept_local")


@pytest.fixture
def lo_accepts_injected_frames() -> Iterator[None]:
    """Frames injected into lo (tcpreplay -i lo) carry no route; the kernel drops 127.0.0.1 sources
    and destinations on them as martians unless lo has route_localnet and accept_local. Set both for
    the test and put them back after (normal loopback traffic is unaffected either way)."""
    from pathlib import Path

    paths = [Path(f"/proc/sys/net/ipv4/conf/lo/{k}") for k in LO_SYSCTLS]
    try:
        old = [p.read_text().strip() for p in paths]
        for p in paths:
            p.write_text("1")
    except OSError as e:
        pytest.skip(f"cannot set net.ipv4.conf.lo.{{route_localnet,accept_local}} (needs root): {e}")
    yield
    for p, v in zip(paths, old):
        p.write_text(v)


@pytest.mark.tools
def test_tcpreplay_into_the_ingest_on_loopback(node: Node, tmp_path, lo_accepts_injected_frames) -> None:
    tcpreplay = need_tool("tcpreplay")
    import json
    import socket
    import sys

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # a free client port for the pcap
        probe.bind(("127.0.0.1", 0))
        sport = probe.getsockname()[1]
    path = tmp_path / "s.pcap"
    plan = Stream([AppStream(1, (3, 32, 32), "float32", rate=500, count=40, to=node.addr)], seed=4).plan()
    res = write_pcap(path, plan, sports=[sport])
    # The ingest answers to the pcap's source address: `recv` listens there and matches the answers.
    recv = subprocess.Popen([sys.executable, "-m", "gpuprims.traffic.cli", "recv", "--listen", f"127.0.0.1:{sport}",
                             "--pcap", str(path), "--idle", "1", "--duration", "20"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert recv.stderr is not None and "listening on" in recv.stderr.readline()
        out = subprocess.run([tcpreplay, "-i", "lo", "--pps", "5000", str(path)], capture_output=True, text=True,
                             timeout=120)
        if out.returncode != 0 and "Operation not permitted" in out.stderr:
            pytest.skip(f"tcpreplay cannot open lo here (needs CAP_NET_RAW): {out.stderr.strip()[:200]}")
        assert out.returncode == 0, out.stderr
        assert f"Actual: {res['frames']} packets" in out.stdout
        answers, err = recv.communicate(timeout=60)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    c = node.counters()
    assert c["packets_received"] == res["frames"] == 40 * 12
    assert c["requests_completed"] == 40 and packet_balance(c) == 0 and node.ingest.drops() == {}
    doc = json.loads(answers)
    assert (doc["requests"], doc["answered"], doc["unmatched"], doc["duplicates"]) == (40, 40, 0, 0), err
    assert doc["status"] == {"OK": 40}
