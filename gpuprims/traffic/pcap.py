"""pcap files of request streams: writing valid Ethernet/IPv4/UDP frames, and reading them back.

`write_pcap` writes a `Plan` as a classic pcap (microsecond or nanosecond timestamps) whose frames
tcpreplay and tshark accept: Ethernet II with locally administered MACs, IPv4 with a correct header
checksum, UDP with a correct checksum. Headers are built for many packets at once with numpy.

`read_pcap` reads classic pcap (either byte order, us or ns) and pcapng (through dpkt), with link
types Ethernet, Linux cooked (SLL) and raw IPv4, and refuses what it cannot use with a `PcapError`
naming the file and the 1-based frame number. `replay_plan` turns a capture into a `Plan`.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import dpkt
import numpy as np

from gpuprims import wire
from gpuprims.traffic.stream import MAX_REQUEST_ID, PROCESSES, Plan, PlanBuilder, parse_addr

LINKTYPE_ETHERNET = 1
LINKTYPE_RAW = 101
LINKTYPE_RAW_OLD = 12  # DLT_RAW as some BSD-era writers number it
LINKTYPE_LINUX_SLL = 113
LINK_NAMES = {LINKTYPE_ETHERNET: "Ethernet", LINKTYPE_RAW: "raw IP", LINKTYPE_RAW_OLD: "raw IP",
              LINKTYPE_LINUX_SLL: "Linux cooked (SLL)"}

_MAGIC_US = 0xA1B2C3D4
_MAGIC_NS = 0xA1B23C4D
_PCAPNG = 0x0A0D0D0A

#: MACs of written frames. The destination is the loopback device's own address (all zeros): a frame
#: injected into `lo` (tcpreplay -i lo) is dropped as PACKET_OTHERHOST unless it is addressed to lo.
#: For a real NIC, rewrite them (tcprewrite --enet-dmac/--enet-smac) or pass src_mac/dst_mac.
SRC_MAC = bytes.fromhex("020000000001")
DST_MAC = bytes(6)
#: Timestamps of a written pcap start here (fixed, so a seeded stream gives the same file).
DEFAULT_START_EPOCH_S = 1_700_000_000


class PcapError(ValueError):
    """A pcap that cannot be replayed; the message names the file and the frame."""


# ---------------------------------------------------------------------------------------------- write


def _ones_sum(words: np.ndarray) -> np.ndarray:
    """Fold 32/64-bit sums of 16-bit words into 16 bits (one's complement, end-around carry)."""
    s = words.astype(np.uint64)
    for _ in range(4):
        s = (s & 0xFFFF) + (s >> 16)
    return s


def _be16_sum(buf: np.ndarray) -> int:
    """Sum of big-endian 16-bit words of a byte array (zero-padded to even length)."""
    if len(buf) % 2:
        buf = np.concatenate([buf, np.zeros(1, np.uint8)])
    return int(buf.view(">u2").astype(np.uint64).sum())


def _be_words(x: np.ndarray, nbytes: int) -> np.ndarray:
    """Per value, the sum of the big-endian 16-bit words of its first `nbytes` little-endian bytes
    (a u64 header field as it lies in the datagram), as a u64 vector."""
    b = x.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :nbytes]
    return (b[:, 0::2].astype(np.uint64) << 8).sum(axis=1) + b[:, 1::2].astype(np.uint64).sum(axis=1)


@dataclass
class _Frames:
    """Per-packet frame headers for a run of the plan's packets, in send order."""

    pkt: np.ndarray  # packet index into the plan
    event: np.ndarray  # event index
    hdr: np.ndarray  # (n, 42) Ethernet + IPv4 + UDP headers


def frame_headers(plan: Plan, ev: np.ndarray, src_ip: str, sport: np.ndarray, ip_id0: int,
                  rid: np.ndarray, ts: np.ndarray, src_mac: bytes = SRC_MAC, dst_mac: bytes = DST_MAC) -> _Frames:
    """Ethernet/IPv4/UDP headers for every packet of events `ev` (with request ids and stamps)."""
    cnt = plan.unit_count[plan.ev_unit[ev]].astype(np.int64)
    first = plan.unit_first[plan.ev_unit[ev]].astype(np.int64)
    ev_rep = np.repeat(ev, cnt)
    within = np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    pkt = np.repeat(first, cnt) + within
    n = len(pkt)
    ln = plan.pkt_len[pkt].astype(np.uint64)
    ips, ports = plan.dest_arrays()
    dst_ip = ips[plan.ev_dest[ev_rep]]  # network-order bytes in a little-endian u32
    dport = ports[plan.ev_dest[ev_rep]].astype(np.uint64)
    sp = np.repeat(sport, cnt).astype(np.uint64)
    src = int.from_bytes(bytes(map(int, src_ip.split("."))), "big")
    dst_be = dst_ip.astype("<u4").view(np.uint8).reshape(-1, 4)
    dst_hi = (dst_be[:, 0].astype(np.uint64) << 8) | dst_be[:, 1]
    dst_lo = (dst_be[:, 2].astype(np.uint64) << 8) | dst_be[:, 3]
    ip_len = ln + 28
    ip_id = (np.arange(n, dtype=np.uint64) + ip_id0) & 0xFFFF
    # IPv4 header checksum: version/ihl/tos, total length, id, flags (DF), ttl/proto, src, dst.
    ip_sum = (0x4500 + ip_len + ip_id + 0x4000 + 0x4011 + (src >> 16) + (src & 0xFFFF) + dst_hi + dst_lo)
    ip_ck = (~_ones_sum(ip_sum)) & 0xFFFF
    # UDP checksum: pseudo header + UDP header + data, where data = the packet's bytes with the request
    # id and stamp fields replaced for patched packets (the sum is linear in 16-bit words).
    udp_len = ln + 8
    pool_sum = _packet_sums(plan)[pkt]
    patch = plan.pkt_patch[pkt].astype(bool)
    fixed = _packet_field_sums(plan)[pkt]
    var = _be_words(np.repeat(rid, cnt), 8) + _be_words(np.repeat(ts, cnt).astype(np.uint64), 8)
    data_sum = np.where(patch, pool_sum - fixed + var, pool_sum)
    u_sum = ((src >> 16) + (src & 0xFFFF) + dst_hi + dst_lo + 17 + udp_len + sp + dport + udp_len + data_sum)
    u_ck = (~_ones_sum(u_sum)) & 0xFFFF
    u_ck = np.where(u_ck == 0, 0xFFFF, u_ck)
    hdr = np.zeros((n, 42), np.uint8)
    hdr[:, 0:6] = np.frombuffer(dst_mac, np.uint8)
    hdr[:, 6:12] = np.frombuffer(src_mac, np.uint8)
    hdr[:, 12:14] = (0x08, 0x00)
    ip = hdr[:, 14:34]
    ip[:, 0] = 0x45
    _put16(ip, 2, ip_len)
    _put16(ip, 4, ip_id)
    ip[:, 6] = 0x40  # don't fragment
    ip[:, 8] = 64
    ip[:, 9] = 17
    _put16(ip, 10, ip_ck)
    ip[:, 12:16] = np.frombuffer(struct.pack(">I", src), np.uint8)
    ip[:, 16:20] = dst_be
    udp = hdr[:, 34:42]
    _put16(udp, 0, sp)
    _put16(udp, 2, dport)
    _put16(udp, 4, udp_len)
    _put16(udp, 6, u_ck)
    return _Frames(pkt=pkt, event=ev_rep, hdr=hdr)


def _put16(a: np.ndarray, off: int, v: np.ndarray) -> None:
    a[:, off] = (v >> 8) & 0xFF
    a[:, off + 1] = v & 0xFF


def _packet_sums(plan: Plan) -> np.ndarray:
    """Big-endian word sum of every packet in the pool (cached on the plan)."""
    cached = plan.description.get("_pkt_sums")
    if cached is None:
        cached = np.array([_be16_sum(plan.pool[o:o + n]) for o, n in zip(plan.pkt_off.tolist(),
                                                                           plan.pkt_len.tolist())], np.uint64)
        plan.description["_pkt_sums"] = cached
    return cached


def _packet_field_sums(plan: Plan) -> np.ndarray:
    """Word sum of the request_id and client_ts_ns fields as they stand in the pool (patched packets)."""
    out = np.zeros(len(plan.pkt_off), np.uint64)
    patched = np.flatnonzero(plan.pkt_patch)
    if len(patched):
        off = plan.pkt_off[patched].astype(np.int64)
        rid_off = wire.FIELDS["request_id"][0]
        ts_off = wire.FIELDS["client_ts_ns"][0]
        rid = plan.pool[off[:, None] + rid_off + np.arange(8)].copy().view("<u8").ravel()
        ts = plan.pool[off[:, None] + ts_off + np.arange(8)].copy().view("<u8").ravel()
        out[patched] = _be_words(rid, 8) + _be_words(ts, 8)
    return out


def write_pcap(path: str | Path, plan: Plan, *, src_ip: str = "127.0.0.1",
               sports: Sequence[int] = (40000,), start_epoch_s: float = DEFAULT_START_EPOCH_S,
               nanosecond: bool = False, stamp: str = "schedule", src_mac: str | bytes = SRC_MAC,
               dst_mac: str | bytes = DST_MAC, batch_events: int = 4096) -> dict:
    """Write every event of `plan` as Ethernet/IPv4/UDP frames; returns counts.

    Request ids come from the plan; client_ts_ns holds the scheduled send offset in ns (stamp =
    'schedule') or 0 ('zero'). Requests take source ports from `sports` in turn, as the sender does.
    """
    src_mac, dst_mac = _mac(src_mac), _mac(dst_mac)
    if stamp not in ("schedule", "zero"):
        raise ValueError(f"stamp must be 'schedule' or 'zero', got {stamp!r}")
    src_ip = parse_addr((src_ip, 1))[0]
    sports_a = np.asarray(list(sports), dtype=np.int64)
    if len(sports_a) == 0 or (sports_a <= 0).any() or (sports_a > 65535).any():
        raise ValueError(f"source ports must be in 1..65535, got {list(sports)}")
    path = Path(path)
    n_pkts = 0
    n_bytes = 0
    magic = _MAGIC_NS if nanosecond else _MAGIC_US
    start_ns = round(start_epoch_s * 1e9)
    pool = memoryview(plan.pool.data).cast("B") if len(plan.pool) else memoryview(b"")
    with path.open("wb") as f:
        f.write(struct.pack("<IHHiIII", magic, 2, 4, 0, 0, 65535, LINKTYPE_ETHERNET))
        for lo in range(0, plan.n_events, batch_events):
            ev = np.arange(lo, min(plan.n_events, lo + batch_events))
            rid = plan.ev_rid[ev]
            ts = plan.ev_time_ns[ev] if stamp == "schedule" else np.zeros(len(ev), np.int64)
            fr = frame_headers(plan, ev, src_ip, sports_a[ev % len(sports_a)], n_pkts, rid, ts, src_mac, dst_mac)
            n = len(fr.pkt)
            ln = plan.pkt_len[fr.pkt].astype(np.int64)
            # Record headers: seconds, fraction, captured length, original length.
            t = start_ns + plan.ev_time_ns[fr.event]
            rec = np.zeros((n, 4), "<u4")
            rec[:, 0] = t // 1_000_000_000
            rec[:, 1] = (t % 1_000_000_000) if nanosecond else (t % 1_000_000_000) // 1000
            rec[:, 2] = ln + 42
            rec[:, 3] = ln + 42
            wh = np.zeros((n, wire.HEADER_SIZE), np.uint8)
            patch = plan.pkt_patch[fr.pkt].astype(bool)
            offs = plan.pkt_off[fr.pkt].astype(np.int64)
            if patch.any():
                po = offs[patch]
                wh[patch] = plan.pool[po[:, None] + np.arange(wire.HEADER_SIZE)]
                hv = wh.view(wire.HEADER_DTYPE).ravel()
                ev_of = fr.event - lo
                hv["request_id"][patch] = rid[ev_of[patch]]
                hv["client_ts_ns"][patch] = ts[ev_of[patch]].astype(np.uint64)
            head = np.concatenate([rec.view(np.uint8).reshape(n, 16), fr.hdr], axis=1)
            parts: list[bytes | memoryview] = []
            for i in range(n):
                o, L = int(offs[i]), int(ln[i])
                parts.append(head[i].tobytes())
                if patch[i]:
                    parts.append(wh[i].tobytes())
                    parts.append(pool[o + wire.HEADER_SIZE:o + L])
                else:
                    parts.append(pool[o:o + L])
            f.writelines(parts)
            n_pkts += n
            n_bytes += int(ln.sum())
    return {"path": str(path), "frames": n_pkts, "requests": int((plan.ev_app >= 0).sum()),
            "udp_payload_bytes": n_bytes}


def _mac(m: str | bytes) -> bytes:
    if isinstance(m, str):
        try:
            b = bytes.fromhex(m.replace(":", "").replace("-", ""))
        except ValueError:
            b = b""
    else:
        b = bytes(m)
    if len(b) != 6:
        raise ValueError(f"a MAC address has 6 bytes (like 02:00:00:00:00:01), got {m!r}")
    return b


def write_datagrams(path: str | Path, datagrams: Sequence[bytes], *, dst: str | tuple[str, int] = "127.0.0.1:9000",
                    interval_s: float = 1e-3, **kw) -> dict:
    """Write raw datagrams (any bytes, valid or not) as frames `interval_s` apart; for tests and tooling."""
    b = PlanBuilder()
    d = b.dest(parse_addr(dst))
    units = [b.add_unit([bytes(x)], patch=False) for x in datagrams]
    n = len(units)
    plan = b.build(ev_time_ns=np.round(np.arange(n) * interval_s * 1e9).astype(np.int64), ev_unit=units,
                   ev_rid=np.zeros(n, np.uint64), ev_dest=np.full(n, d), ev_app=np.full(n, -1),
                   ev_warmup=np.zeros(n, bool), span_ns=round(n * interval_s * 1e9))
    return write_pcap(path, plan, **kw)


# ----------------------------------------------------------------------------------------------- read


@dataclass
class Frame:
    """One UDP datagram of a capture."""

    index: int  # 1-based frame number, as tshark numbers frames
    ts_ns: int
    src: tuple[str, int]
    dst: tuple[str, int]
    payload: bytes


@dataclass
class Capture:
    """The UDP datagrams of a pcap, with what was skipped."""

    path: str
    linktype: int
    frames: list[Frame]
    skipped: dict[str, int] = field(default_factory=dict)


def _records(path: Path) -> Iterator[tuple[int, int, bytes, int]]:
    """(frame number, ts_ns, bytes, link type) of every record, raising PcapError on damage."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PcapError(f"{path}: cannot read: {e.strerror}") from None
    if len(data) < 4:
        raise PcapError(f"{path}: not a pcap file (only {len(data)} bytes)")
    magic_le = struct.unpack_from("<I", data)[0]
    if magic_le == _PCAPNG:
        yield from _pcapng_records(path, data)
        return
    if len(data) < 24:
        raise PcapError(f"{path}: truncated pcap file header ({len(data)} of 24 bytes)")
    for endian in ("<", ">"):
        magic = struct.unpack_from(endian + "I", data)[0]
        if magic in (_MAGIC_US, _MAGIC_NS):
            break
    else:
        raise PcapError(f"{path}: not a pcap file (magic 0x{magic_le:08x}; expected classic pcap or pcapng)")
    scale = 1 if magic == _MAGIC_NS else 1000
    linktype = struct.unpack_from(endian + "I", data, 20)[0] & 0x0FFFFFFF
    rec = struct.Struct(endian + "IIII")
    pos, n = 24, 0
    while pos < len(data):
        n += 1
        if pos + 16 > len(data):
            raise PcapError(f"{path}: frame {n}: truncated record header ({len(data) - pos} of 16 bytes at offset {pos})")
        sec, frac, caplen, origlen = rec.unpack_from(data, pos)
        pos += 16
        if caplen > 262144:
            raise PcapError(f"{path}: frame {n}: record claims {caplen} bytes; the file is damaged")
        if pos + caplen > len(data):
            raise PcapError(f"{path}: frame {n}: truncated: record says {caplen} bytes, the file has "
                            f"{len(data) - pos} left")
        if caplen < origlen:
            raise PcapError(f"{path}: frame {n}: only {caplen} of {origlen} bytes were captured (snap length); "
                            "capture with -s 0")
        yield n, sec * 1_000_000_000 + frac * scale, data[pos:pos + caplen], linktype
        pos += caplen


def _pcapng_records(path: Path, data: bytes) -> Iterator[tuple[int, int, bytes, int]]:
    try:
        reader = dpkt.pcapng.Reader(io.BytesIO(data))
    except (ValueError, dpkt.dpkt.Error, struct.error) as e:
        raise PcapError(f"{path}: not a readable pcapng file: {e}") from None
    linktype = reader.datalink()
    n = 0
    it = iter(reader)
    while True:
        n += 1
        try:
            ts, buf = next(it)
        except StopIteration:
            return
        except (ValueError, dpkt.dpkt.Error, struct.error) as e:
            raise PcapError(f"{path}: frame {n}: truncated or damaged pcapng block: {e}") from None
        yield n, round(ts * 1e9), bytes(buf), linktype


def _udp_of(path: Path, n: int, buf: bytes, linktype: int) -> tuple[str, int, str, int, bytes] | str:
    """The UDP datagram in one frame, or a reason string for a frame that holds none."""
    if linktype == LINKTYPE_ETHERNET:
        if len(buf) < 14:
            raise PcapError(f"{path}: frame {n}: Ethernet frame of {len(buf)} bytes is too short")
        etype = struct.unpack_from(">H", buf, 12)[0]
        off = 14
        while etype in (0x8100, 0x88A8) and len(buf) >= off + 4:  # VLAN tags
            etype = struct.unpack_from(">H", buf, off + 2)[0]
            off += 4
        if etype != 0x0800:
            return "ipv6" if etype == 0x86DD else "not_ip"
        ip = buf[off:]
    elif linktype == LINKTYPE_LINUX_SLL:
        if len(buf) < 16:
            raise PcapError(f"{path}: frame {n}: cooked (SLL) frame of {len(buf)} bytes is too short")
        etype = struct.unpack_from(">H", buf, 14)[0]
        if etype != 0x0800:
            return "ipv6" if etype == 0x86DD else "not_ip"
        ip = buf[16:]
    elif linktype in (LINKTYPE_RAW, LINKTYPE_RAW_OLD):
        ip = buf
        if ip and ip[0] >> 4 == 6:
            return "ipv6"
    else:
        raise PcapError(f"{path}: frame {n}: link type {linktype} is not supported "
                        f"(supported: {', '.join(sorted(set(LINK_NAMES.values())))})")
    if len(ip) < 20 or ip[0] >> 4 != 4:
        raise PcapError(f"{path}: frame {n}: not an IPv4 packet")
    ihl = (ip[0] & 0x0F) * 4
    total = struct.unpack_from(">H", ip, 2)[0]
    if ihl < 20 or total < ihl or total > len(ip):
        raise PcapError(f"{path}: frame {n}: IPv4 header is damaged or the packet is truncated "
                        f"(total length {total}, {len(ip)} bytes present)")
    frag = struct.unpack_from(">H", ip, 6)[0]
    if ip[9] != 17:
        return "not_udp"
    if frag & 0x3FFF:
        raise PcapError(f"{path}: frame {n}: IPv4 fragment; reassemble the capture first (datagrams larger "
                        "than the MTU were fragmented)")
    src = ".".join(map(str, ip[12:16]))
    dst = ".".join(map(str, ip[16:20]))
    udp = ip[ihl:total]
    if len(udp) < 8:
        raise PcapError(f"{path}: frame {n}: truncated UDP header")
    sport, dport, ulen = struct.unpack_from(">HHH", udp, 0)
    if ulen < 8 or ulen > len(udp):
        raise PcapError(f"{path}: frame {n}: UDP length {ulen} disagrees with the {len(udp)} bytes present")
    return src, sport, dst, dport, bytes(udp[8:ulen])


def read_pcap(path: str | Path, *, skip_foreign: bool = False) -> Capture:
    """Every UDP datagram of a pcap/pcapng file.

    Frames that carry no UDP/IPv4 datagram (ARP, ICMP, IPv6, ...) raise a PcapError naming the frame,
    or are counted in `skipped` with `skip_foreign`. Damaged files always raise.
    """
    path = Path(path)
    frames: list[Frame] = []
    skipped: dict[str, int] = {}
    linktype = -1
    for n, ts, buf, lt in _records(path):
        linktype = lt
        got = _udp_of(path, n, buf, lt)
        if isinstance(got, str):
            if not skip_foreign:
                raise PcapError(f"{path}: frame {n}: not a UDP/IPv4 datagram ({got.replace('_', ' ')}); "
                                "use skip_foreign (--skip-foreign) to skip such frames")
            skipped[got] = skipped.get(got, 0) + 1
            continue
        src, sport, dst, dport, payload = got
        frames.append(Frame(n, ts, (src, sport), (dst, dport), payload))
    if linktype == -1:
        # An empty capture: check the header's link type anyway.
        raw = path.read_bytes()
        if len(raw) >= 24 and struct.unpack_from("<I", raw)[0] in (_MAGIC_US, _MAGIC_NS):
            lt = struct.unpack_from("<I", raw, 20)[0]
            if lt not in LINK_NAMES:
                raise PcapError(f"{path}: link type {lt} is not supported")
        linktype = LINKTYPE_ETHERNET
    return Capture(str(path), linktype, frames, skipped)


def _verdict(payload: bytes) -> int:
    try:
        from gpuprims import _native

        return int(_native.check_request(payload))
    except ImportError:  # pragma: no cover - the extension is always built
        return int(wire.check_request(payload))


def replay_plan(capture: Capture, *, to: str | tuple[str, int] | None = None, rate: float | None = None,
                pps: float | None = None, process: str = "constant", speed: float = 1.0, loops: int = 1,
                count: int | None = None, duration_s: float | None = None, seed: int = 0,
                raw: bool = False, warmup_s: float = 0.0) -> Plan:
    """A Plan that replays a capture's requests.

    Datagrams of one request (same source, app id and request id) form one unit, sent together.
    Timing: as captured (divided by `speed`) unless `rate` (requests/s) or `pps` (packets/s) is
    given, at constant or Poisson spacing. `loops` repeats the capture, shifting request ids by
    (largest id + 1) each loop so every sent request stays distinct. Datagrams that are not valid
    requests raise a PcapError naming the frame, or with `raw` are sent as they are (for testing
    a receiver's handling of bad input). Response datagrams in the capture are skipped.
    """
    path = capture.path
    if loops < 1:
        raise ValueError(f"loops must be >= 1, got {loops}")
    if not speed > 0:
        raise ValueError(f"speed must be positive, got {speed}")
    if rate is not None and pps is not None:
        raise ValueError("give rate or pps, not both")
    if process not in PROCESSES:
        raise ValueError(f"process must be one of {PROCESSES}, got {process!r}")
    if count is not None and duration_s is not None:
        raise ValueError("give count or duration_s, not both")
    dest = parse_addr(to) if to is not None else None
    groups: dict[tuple, list[Frame]] = {}
    keys: list[tuple] = []
    skipped = dict(capture.skipped)
    for fr in capture.frames:
        v = _verdict(fr.payload)
        if v == 0:
            h = wire.unpack_header(fr.payload)
            key: tuple = ("req", fr.src, fr.dst, h.app_id, h.request_id)
        else:
            if v == wire.Verdict.BAD_KIND and len(fr.payload) >= wire.HEADER_SIZE:
                h = wire.unpack_header(fr.payload)
                if h.magic == wire.MAGIC and h.kind == wire.KIND_RESPONSE:
                    skipped["responses"] = skipped.get("responses", 0) + 1
                    continue
            if not raw:
                raise PcapError(f"{path}: frame {fr.index}: UDP payload is not a gpuprims request "
                                f"({wire.Verdict(v).name.lower()}); use raw (--raw) to send such datagrams as they are")
            key = ("raw", fr.index)
        if key not in groups:
            groups[key] = []
            keys.append(key)
        groups[key].append(fr)
    if not keys:
        raise PcapError(f"{path}: no requests to replay")
    b = PlanBuilder()
    n = len(keys)
    units = np.zeros(n, np.uint32)
    rid = np.zeros(n, np.uint64)
    app = np.full(n, -1, np.int32)
    dst = np.zeros(n, np.uint16)
    t_cap = np.zeros(n, np.int64)
    n_pkts = np.zeros(n, np.int64)
    for i, key in enumerate(keys):
        frs = groups[key]
        is_req = key[0] == "req"
        if is_req:
            frs = sorted(frs, key=lambda f: wire.unpack_header(f.payload).chunk_index)
            # Drop duplicated chunks of the capture: one unit sends each chunk once.
            seen: dict[int, Frame] = {}
            for f in frs:
                seen.setdefault(wire.unpack_header(f.payload).chunk_index, f)
            frs = list(seen.values())
        units[i] = b.add_unit([f.payload for f in frs], patch=is_req)
        if is_req:
            app[i], rid[i] = key[3], key[4]
        dst[i] = b.dest(dest or frs[0].dst)
        t_cap[i] = min(f.ts_ns for f in groups[key])
        n_pkts[i] = len(frs)
    t_cap -= t_cap.min()
    order = np.argsort(t_cap, kind="stable")
    units, rid, app, dst, t_cap, n_pkts = (a[order] for a in (units, rid, app, dst, t_cap, n_pkts))
    if (app >= 0).any() and int(rid[app >= 0].max()) * loops >= MAX_REQUEST_ID:
        raise PcapError(f"{path}: request ids too large to loop {loops} times")
    stride = int(rid[app >= 0].max()) + 1 if (app >= 0).any() else 0
    mean_pkts = float(n_pkts.mean())
    if pps is not None:
        rate = pps / mean_pkts
    rng = np.random.default_rng(seed)
    if rate is not None:
        if not rate > 0:
            raise ValueError(f"rate must be positive, got {rate}")
        # Requests in capture order, looped as often as needed, at the chosen spacing.
        loops_needed = loops
        if count is not None or duration_s is not None:
            want = count if count is not None else int(np.ceil(((duration_s or 0) + warmup_s) * rate * 2)) + 16
            want += int(np.ceil(warmup_s * rate)) if count is not None else 0
            loops_needed = max(1, -(-want // n))
        total = n * loops_needed
        if process == "constant":
            t_all = np.round(np.arange(total) * (1e9 / rate)).astype(np.int64)
        else:
            t_all = np.round(np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, total - 1))]) * 1e9
                             ).astype(np.int64)
        gap = 1e9 / rate
    else:
        loops_needed = loops
        if count is not None or duration_s is not None:
            loops_needed = max(1, 1 + int(((duration_s or 0) + warmup_s) * 1e9 // max(1, t_cap[-1] + 1))) \
                if duration_s is not None else max(1, -(-(count or 0) // n))
            loops_needed = max(loops_needed, 1)
        cap = (t_cap / speed).astype(np.int64)
        gap = float(np.mean(np.diff(cap))) if n > 1 else 1e6
        period = int(cap[-1] + round(gap))
        t_all = (cap[None, :] + period * np.arange(loops_needed)[:, None]).ravel()
        total = n * loops_needed
    loop_of = np.arange(total) // n
    idx = np.arange(total) % n
    ev_rid = rid[idx] + np.where(app[idx] >= 0, loop_of * stride, 0).astype(np.uint64)
    if (app >= 0).any() and int(ev_rid.max()) >= MAX_REQUEST_ID:
        raise PcapError(f"{path}: request ids too large to loop {loops_needed} times")
    warm_ns = round(warmup_s * 1e9)
    keep = np.ones(total, bool)
    if count is not None:
        n_warm = int(np.searchsorted(t_all, warm_ns))
        keep[n_warm + count:] = False
    if duration_s is not None:
        keep &= t_all < warm_ns + round(duration_s * 1e9)
    t_all, idx, ev_rid = t_all[keep], idx[keep], ev_rid[keep]
    if duration_s is not None:
        span = round(duration_s * 1e9)
    else:
        meas = t_all[t_all >= warm_ns]
        span = int(meas[-1] - warm_ns + round(gap)) if len(meas) else 0
    targets = {"rps": rate, "pps": None if rate is None else rate * mean_pkts}
    return b.build(ev_time_ns=t_all, ev_unit=units[idx], ev_rid=ev_rid, ev_dest=dst[idx], ev_app=app[idx],
                   ev_warmup=t_all < warm_ns, span_ns=span, warmup_ns=warm_ns,
                   stop_at_ns=warm_ns + round(duration_s * 1e9) if duration_s is not None else 0,
                   target_rps=targets["rps"], target_pps=targets["pps"],
                   app_targets={int(a): {"rps": None, "pps": None} for a in np.unique(app[app >= 0])},
                   description={"pcap": path, "frames": len(capture.frames), "requests": int((app >= 0).sum()),
                                "raw_datagrams": int((app < 0).sum()), "skipped": skipped, "loops": loops_needed,
                                "speed": speed, "seed": seed})
