from __future__ import annotations

import struct
import subprocess

import dpkt
import numpy as np
import pytest

from gpuprims import wire
from gpuprims.traffic import AppStream, PcapError, Stream, read_pcap, replay_plan, write_datagrams, write_pcap

from .conftest import need_tool

TO = ("127.0.0.1", 9123)


def _stream(count: int = 4, **kw) -> Stream:
    return Stream([AppStream(1, (3, 32, 32), "uint8", rate=100, count=count, to=TO, **kw),
                   AppStream(2, (1500,), "uint8", rate=50, count=count // 2, to=("127.0.0.1", 9124))], seed=3)


def test_written_frames_are_valid_ethernet_ipv4_udp_with_checksums(tmp_path) -> None:
    plan = _stream().plan()
    path = tmp_path / "s.pcap"
    res = write_pcap(path, plan, sports=[40000, 40001])
    assert res["frames"] == 4 * 3 + 2 * 2 and res["requests"] == 6
    with path.open("rb") as f:
        rd = dpkt.pcap.Reader(f)
        assert rd.datalink() == dpkt.pcap.DLT_EN10MB
        frames = list(rd)
    assert len(frames) == res["frames"]
    for k, (_ts, buf) in enumerate(frames):
        eth = dpkt.ethernet.Ethernet(buf)
        ip = eth.data
        assert isinstance(ip, dpkt.ip.IP) and isinstance(ip.data, dpkt.udp.UDP)
        udp = ip.data
        assert udp.sport in (40000, 40001) and udp.dport in (9123, 9124)
        # Recompute both checksums with dpkt and compare.
        got_ip, got_udp = ip.sum, udp.sum
        ip.sum = 0
        udp.sum = 0
        ip2 = dpkt.ip.IP(bytes(ip))
        assert ip2.sum == got_ip, f"frame {k + 1}: IPv4 checksum"
        assert ip2.data.sum == got_udp, f"frame {k + 1}: UDP checksum"
        assert wire.check_request(bytes(udp.data)) == wire.Verdict.OK


def test_roundtrip_keeps_requests_ids_and_schedule(tmp_path) -> None:
    plan = _stream(count=6).plan()
    path = tmp_path / "s.pcap"
    write_pcap(path, plan, nanosecond=True)
    cap = read_pcap(path)
    assert len(cap.frames) == int(plan.ev_packets.sum())
    back = replay_plan(cap)
    assert back.n_events == plan.n_events
    np.testing.assert_array_equal(back.ev_time_ns, plan.ev_time_ns - plan.ev_time_ns[0])
    assert sorted(zip(back.ev_app.tolist(), back.ev_rid.tolist())) == sorted(zip(plan.ev_app.tolist(),
                                                                                 plan.ev_rid.tolist()))
    assert {back.dests[d] for d in back.ev_dest} == {TO, ("127.0.0.1", 9124)}
    # Each unit holds the request's chunks in order, and stamps are the scheduled offsets.
    f = cap.frames[0]
    h = wire.unpack_header(f.payload)
    assert h.client_ts_ns == 0 and f.dst == TO


def test_seeded_streams_write_identical_files(tmp_path) -> None:
    def make(seed: int, name: str) -> bytes:
        s = Stream([AppStream(1, (512,), "uint8", rate=1000, process="poisson", count=50, to=TO)], seed=seed)
        write_pcap(tmp_path / name, s.plan())
        return (tmp_path / name).read_bytes()

    assert make(1, "a.pcap") == make(1, "b.pcap")
    assert make(1, "a.pcap") != make(2, "c.pcap")


def test_loops_shift_request_ids_and_rate_overrides_timing(tmp_path) -> None:
    plan = _stream(count=4).plan()
    write_pcap(tmp_path / "s.pcap", plan)
    cap = read_pcap(tmp_path / "s.pcap")
    p = replay_plan(cap, loops=3, rate=1000, to="127.0.0.1:9999")
    assert p.n_events == 3 * 6
    keys = list(zip(p.ev_app.tolist(), p.ev_rid.tolist()))
    assert len(set(keys)) == len(keys)
    assert p.ev_time_ns.tolist() == [k * 1_000_000 for k in range(18)]
    assert p.dests == [("127.0.0.1", 9999)]
    p2 = replay_plan(cap, pps=2000)  # 6 requests of mean 2.33 packets
    assert p2.target_pps == pytest.approx(2000)


def test_not_a_pcap(tmp_path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("hello, this is not a capture")
    with pytest.raises(PcapError, match=r"notes.txt: not a pcap file"):
        read_pcap(bad)


def test_truncated_pcap_names_the_frame(tmp_path) -> None:
    path = tmp_path / "s.pcap"
    write_pcap(path, _stream().plan())
    data = path.read_bytes()
    cut = tmp_path / "cut.pcap"
    cut.write_bytes(data[:-100])
    with pytest.raises(PcapError, match=r"cut.pcap: frame 16: truncated: record says 1114 bytes, the file has 1014 left"):
        read_pcap(cut)
    cut.write_bytes(data[:24 + 16 + 1114 + 5])
    with pytest.raises(PcapError, match=r"cut.pcap: frame 2: truncated record header"):
        read_pcap(cut)
    cut.write_bytes(data[:10])
    with pytest.raises(PcapError, match=r"cut.pcap: truncated pcap file header"):
        read_pcap(cut)


def test_snaplen_cut_frames_are_refused(tmp_path) -> None:
    path = tmp_path / "snap.pcap"
    with path.open("wb") as f:
        w = dpkt.pcap.Writer(f, snaplen=96)
        frame = _frame(wire.encode_request(1, 1, np.zeros(2000, np.uint8))[0])
        w.writepkt(frame[:96])  # dpkt records caplen == len; rewrite the original length below
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 24 + 12, len(frame))
    path.write_bytes(bytes(data))
    with pytest.raises(PcapError, match=r"snap.pcap: frame 1: only 96 of 1114 bytes were captured"):
        read_pcap(path)


def _frame(payload: bytes, sport: int = 40000, dport: int = 9123, proto: str = "udp") -> bytes:
    udp = dpkt.udp.UDP(sport=sport, dport=dport, data=payload)
    udp.ulen = len(udp)
    ip = dpkt.ip.IP(src=bytes([127, 0, 0, 1]), dst=bytes([127, 0, 0, 1]), p=dpkt.ip.IP_PROTO_UDP, data=udp)
    if proto == "tcp":
        ip = dpkt.ip.IP(src=bytes([127, 0, 0, 1]), dst=bytes([127, 0, 0, 1]), p=dpkt.ip.IP_PROTO_TCP,
                        data=dpkt.tcp.TCP(sport=1, dport=2))
    ip.len = len(ip)
    return bytes(dpkt.ethernet.Ethernet(src=b"\x02" * 6, dst=b"\x04" * 6, type=dpkt.ethernet.ETH_TYPE_IP, data=ip))


def _pcap(path, frames: list[bytes], linktype: int = dpkt.pcap.DLT_EN10MB) -> None:
    with path.open("wb") as f:
        w = dpkt.pcap.Writer(f, linktype=linktype)
        for i, fr in enumerate(frames):
            w.writepkt(fr, ts=1.0 + i * 1e-3)


def test_other_link_type_is_refused(tmp_path) -> None:
    path = tmp_path / "wifi.pcap"
    _pcap(path, [b"\x00" * 60], linktype=105)  # IEEE 802.11
    with pytest.raises(PcapError, match=r"wifi.pcap: frame 1: link type 105 is not supported"):
        read_pcap(path)


def test_foreign_udp_payload_is_not_ours(tmp_path) -> None:
    good = wire.encode_request(1, 1, np.zeros(100, np.uint8))[0]
    path = tmp_path / "dns.pcap"
    _pcap(path, [_frame(good), _frame(b"\x12\x34\x01\x00" + b"\x00" * 60, dport=53)])
    cap = read_pcap(path)
    with pytest.raises(PcapError, match=r"dns.pcap: frame 2: UDP payload is not a gpuprims request \(bad_magic\)"):
        replay_plan(cap)
    p = replay_plan(cap, raw=True)
    assert p.ev_app.tolist() == [1, -1]
    assert p.pkt_patch.tolist() == [1, 0]


def test_non_udp_frames_fail_or_are_skipped(tmp_path) -> None:
    good = wire.encode_request(1, 1, np.zeros(100, np.uint8))[0]
    arp = bytes(dpkt.ethernet.Ethernet(src=b"\x02" * 6, dst=b"\xff" * 6, type=dpkt.ethernet.ETH_TYPE_ARP,
                                       data=b"\x00" * 28))
    path = tmp_path / "mixed.pcap"
    _pcap(path, [_frame(good), arp, _frame(b"", proto="tcp")])
    with pytest.raises(PcapError, match=r"mixed.pcap: frame 2: not a UDP/IPv4 datagram \(not ip\)"):
        read_pcap(path)
    cap = read_pcap(path, skip_foreign=True)
    assert len(cap.frames) == 1 and cap.skipped == {"not_ip": 1, "not_udp": 1}


def test_responses_in_a_capture_are_skipped(tmp_path) -> None:
    req = wire.encode_request(1, 1, np.zeros(100, np.uint8))[0]
    resp = wire.encode_response(1, 1, wire.Status.OK, b"x" * 16)[0]
    path = tmp_path / "both.pcap"
    _pcap(path, [_frame(req), _frame(resp, sport=9123, dport=40000)])
    p = replay_plan(read_pcap(path))
    assert p.n_events == 1 and p.description["skipped"] == {"responses": 1}


def test_pcapng_and_cooked_captures_are_read(tmp_path) -> None:
    dg = wire.encode_request(3, 9, np.arange(3000, dtype=np.uint8))
    path = tmp_path / "s.pcapng"
    with path.open("wb") as f:
        w = dpkt.pcapng.Writer(f)
        for i, d in enumerate(dg):
            w.writepkt(_frame(d), ts=10.0 + i * 1e-4)
    cap = read_pcap(path)
    assert [f.payload for f in cap.frames] == dg
    sll = tmp_path / "any.pcap"
    frames = []
    for d in dg:
        eth = _frame(d)
        frames.append(struct.pack(">HHH8sH", 0, 772, 6, b"\0" * 8, 0x0800) + eth[14:])
    _pcap(sll, frames, linktype=dpkt.pcap.DLT_LINUX_SLL)
    assert [f.payload for f in read_pcap(sll).frames] == dg
    assert replay_plan(read_pcap(sll)).unit_count.tolist() == [3]


def test_datagrams_helper_writes_anything(tmp_path) -> None:
    path = tmp_path / "raw.pcap"
    res = write_datagrams(path, [b"abc", b"x" * 2000], dst="127.0.0.1:7000")
    assert res["frames"] == 2
    cap = read_pcap(path)
    assert [f.payload for f in cap.frames] == [b"abc", b"x" * 2000]
    assert cap.frames[1].dst == ("127.0.0.1", 7000)


@pytest.mark.tools
def test_tshark_decodes_our_pcap_as_udp_with_our_ports(tmp_path) -> None:
    tshark = need_tool("tshark")
    path = tmp_path / "s.pcap"
    plan = _stream(count=4).plan()
    res = write_pcap(path, plan, sports=[40000, 40001])
    out = subprocess.run([tshark, "-r", str(path), "-o", "ip.check_checksum:TRUE", "-o", "udp.check_checksum:TRUE",
                          "-T", "fields", "-E", "separator=,", "-e", "frame.protocols", "-e", "udp.srcport",
                          "-e", "udp.dstport", "-e", "udp.length", "-e", "ip.checksum.status",
                          "-e", "udp.checksum.status", "-e", "_ws.expert"],
                         capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    assert len(out) == res["frames"]
    for line in out:
        protos, sport, dport, _ulen, ipck, udpck, expert = ([*line.split(","), ""])[:7]
        assert protos.startswith("eth:ethertype:ip:udp"), line
        assert sport in ("40000", "40001") and dport in ("9123", "9124"), line
        assert ipck == "1" and udpck == "1", f"tshark says a checksum is bad: {line}"
        assert expert == "", line
