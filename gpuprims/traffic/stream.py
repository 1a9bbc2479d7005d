"""Stream definitions and the send plan built from them.

An `AppStream` says what one app's requests look like (shape, dtype, image) and when they are sent
(rate in requests/s or packets/s, constant or Poisson, or intervals from a file; a request count or a
duration). A `Stream` is one run: several apps, a seed, a warm-up. `Stream.plan()` turns it into a
`Plan`: a pool holding each distinct request's datagrams once, and one event per request (send
time, request id, destination). The native sender walks the plan; pcap files are written from it.

Times in a plan are ns from the run's start (t0). Send time of request k of a constant-rate app is
k / rate exactly (rounded to the ns); Poisson arrival gaps are exponential, drawn from the seed.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpuprims import tensorwire, wire
from gpuprims.traffic.images import request_body

PROCESSES = ("constant", "poisson")
#: Request ids must stay below this so (app_id, request_id) packs into one u64 key for matching.
MAX_REQUEST_ID = 1 << 48


def parse_addr(text: str | tuple[str, int], default_host: str = "127.0.0.1") -> tuple[str, int]:
    """'host:port', ':port' or 'port' -> (ipv4, port), resolving a host name once."""
    if isinstance(text, tuple):
        host, port = text
    else:
        host, _, port_s = str(text).rpartition(":")
        host = host or default_host
        try:
            port = int(port_s)
        except ValueError:
            raise ValueError(f"address {text!r} is not HOST:PORT") from None
    if not 0 < int(port) < 65536:
        raise ValueError(f"port must be in 1..65535, got {port} in {text!r}")
    try:
        ip = str(ipaddress.IPv4Address(host))
    except ValueError:
        try:
            ip = socket.gethostbyname(host)
        except OSError:
            raise ValueError(f"cannot resolve host {host!r} (IPv4 only)") from None
    return ip, int(port)


def read_intervals(path: str | Path) -> np.ndarray:
    """Inter-request intervals in seconds, one number a line ('#' comments and blank lines skipped).

    A number may end in a unit: 'ns', 'us', 'ms' or 's' (default seconds).
    """
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
    out = []
    for lineno, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        unit = next((u for u in ("ns", "us", "ms", "s") if line.endswith(u)), None)
        num = line[: -len(unit)] if unit else line
        try:
            v = float(num) * scale[unit or "s"]
        except ValueError:
            raise ValueError(f"{path}: line {lineno}: {raw.strip()!r} is not an interval") from None
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{path}: line {lineno}: interval must be finite and >= 0, got {raw.strip()!r}")
        out.append(v)
    if not out:
        raise ValueError(f"{path}: no intervals in the file")
    return np.asarray(out, dtype=np.float64)


@dataclass(frozen=True)
class AppStream:
    """The requests of one app and when they are sent.

    Give exactly one of `rate` (requests/s), `pps` (packets/s; the request rate follows from the
    packets a request takes) or `intervals_s`; and `count` or `duration_s` (with intervals, neither
    means one pass over them).
    """

    app_id: int
    shape: tuple[int, ...] = (224, 224, 3)
    dtype: str = "float32"
    rate: float | None = None
    pps: float | None = None
    process: str = "constant"
    count: int | None = None
    duration_s: float | None = None
    intervals_s: Sequence[float] | None = None
    to: tuple[str, int] = ("127.0.0.1", 9000)
    image: str = "astronaut"
    variants: int = 1
    chunk_payload: int = wire.DEFAULT_CHUNK_PAYLOAD
    deadline_us: int = 0
    body: np.ndarray | None = field(default=None, compare=False, repr=False)
    #: A multi-tensor app's inputs, (name, shape, dtype) each: its requests are TENSORS bodies
    #: (gpuprims.tensorwire) of seeded random values, and ``shape``/``dtype``/``image`` do not apply.
    tensors: tuple[tuple[str, tuple[int, ...], str], ...] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.app_id <= 0xFFFF:
            raise ValueError(f"app_id must be in 0..65535, got {self.app_id}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "to", parse_addr(self.to))
        given = [n for n in ("rate", "pps", "intervals_s") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"app {self.app_id}: give exactly one of rate, pps, intervals_s (got {given or 'none'})")
        for n in ("rate", "pps"):
            v = getattr(self, n)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"app {self.app_id}: {n} must be positive, got {v}")
        if self.process not in PROCESSES:
            raise ValueError(f"app {self.app_id}: process must be one of {PROCESSES}, got {self.process!r}")
        if self.count is not None and self.count < 0:
            raise ValueError(f"app {self.app_id}: count must be >= 0, got {self.count}")
        if self.duration_s is not None and not self.duration_s >= 0:
            raise ValueError(f"app {self.app_id}: duration_s must be >= 0, got {self.duration_s}")
        if self.count is not None and self.duration_s is not None:
            raise ValueError(f"app {self.app_id}: give count or duration_s, not both")
        if self.count is None and self.duration_s is None and self.intervals_s is None:
            raise ValueError(f"app {self.app_id}: give count or duration_s")
        if self.intervals_s is not None:
            iv = np.asarray(self.intervals_s, dtype=np.float64)
            if iv.ndim != 1 or iv.size == 0 or (iv < 0).any() or not np.isfinite(iv).all():
                raise ValueError(f"app {self.app_id}: intervals_s must be a non-empty list of finite times >= 0")
            object.__setattr__(self, "intervals_s", tuple(iv.tolist()))
        if self.variants < 1:
            raise ValueError(f"app {self.app_id}: variants must be >= 1, got {self.variants}")
        wire.chunk_count_for(1, self.chunk_payload)  # validates chunk_payload
        if not 0 <= self.deadline_us < 2**32:
            raise ValueError(f"app {self.app_id}: deadline_us must be a u32, got {self.deadline_us}")
        if self.tensors is not None:
            if self.body is not None:
                raise ValueError(f"app {self.app_id}: give body or tensors, not both")
            object.__setattr__(self, "tensors", _tensor_specs(self.app_id, self.tensors))
        if self.body is not None:
            b = np.ascontiguousarray(self.body)
            if b.nbytes == 0:
                raise ValueError(f"app {self.app_id}: body is empty")
            object.__setattr__(self, "body", b)
            object.__setattr__(self, "shape", tuple(b.shape))
            object.__setattr__(self, "dtype", str(b.dtype))

    @property
    def body_bytes(self) -> int:
        if self.tensors is not None:  # every variant encodes to the same length: same names, shapes, dtypes
            return len(self.bodies()[0])
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize

    @property
    def wire_dtype(self) -> int:
        """The wire dtype of this app's requests: TENSORS for a multi-tensor app, else its array's."""
        return int(wire.DType.TENSORS if self.tensors is not None else wire.DType.from_numpy(np.dtype(self.dtype)))

    @property
    def packets_per_request(self) -> int:
        return wire.chunk_count_for(self.body_bytes, self.chunk_payload)

    @property
    def request_rate(self) -> float | None:
        """Target requests/s (None for intervals from a file)."""
        if self.rate is not None:
            return float(self.rate)
        if self.pps is not None:
            return float(self.pps) / self.packets_per_request
        return None

    def bodies(self) -> list[np.ndarray]:
        """The distinct request bodies this app rotates through."""
        if self.body is not None:
            return [self.body]
        if self.tensors is not None:
            return [np.frombuffer(tensorwire.encode_arrays(tensor_values(self.tensors, seed=v)), np.uint8)
                    for v in range(self.variants)]

        return [request_body(self.shape, self.dtype, self.image, variant=v) for v in range(self.variants)]

    def arrivals_ns(self, rng: np.random.Generator, warmup_s: float = 0.0) -> np.ndarray:
        """Send offsets (ns from t0) of this app's requests: warm-up requests, then the measured ones."""
        if self.intervals_s is not None:
            iv = np.asarray(self.intervals_s)
            if self.count is None and self.duration_s is None:
                t = np.concatenate([[0.0], np.cumsum(iv)])
                return _warm_then(t, warmup_s, len(t), None)
            gaps_for = lambda n: np.resize(iv, n)  # noqa: E731 - cycles the file's intervals
        elif self.process == "constant":
            r = self.request_rate
            assert r is not None
            n_warm = math.ceil(warmup_s * r - 1e-9) if warmup_s > 0 else 0
            if self.count is not None:
                n = n_warm + self.count
            else:  # every grid point before the horizon: the sender sends none at or after it
                n = max(n_warm, math.ceil((warmup_s + (self.duration_s or 0.0)) * r - 1e-9))
            return np.round(np.arange(n, dtype=np.float64) * (1e9 / r)).astype(np.int64)
        else:
            r = self.request_rate
            assert r is not None
            gaps_for = lambda n: rng.exponential(1.0 / r, n)  # noqa: E731
        return _warm_then_gen(gaps_for, warmup_s, self.count, self.duration_s)


def _tensor_specs(app_id: int, specs: Sequence[tuple[str, Sequence[int], str]]
                  ) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """``specs`` checked (a name once, dims >= 0, a dtype the tensor body carries) and made hashable."""
    out: list[tuple[str, tuple[int, ...], str]] = []
    for name, shape, dtype in specs:
        if not isinstance(name, str) or not name:
            raise ValueError(f"app {app_id}: a tensor needs a name, got {name!r}")
        if any(n == name for n, _, _ in out):
            raise ValueError(f"app {app_id}: tensor {name!r} given twice")
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"app {app_id}: tensor {name!r}: dims must be >= 0, got {list(dims)}")
        try:
            np_dtype = np.dtype(dtype)
        except TypeError:
            raise ValueError(f"app {app_id}: tensor {name!r}: {dtype!r} is not a dtype") from None
        out.append((name, dims, str(np_dtype)))
    if not out:
        raise ValueError(f"app {app_id}: tensors lists no tensor")
    try:  # what the wire cannot carry is refused here, naming the tensor, not when the plan is sent
        tensorwire.encode_arrays(tensor_values(tuple(out), seed=0))
    except tensorwire.TensorBodyError as e:
        raise ValueError(f"app {app_id}: {e}") from None
    return tuple(out)


def tensor_values(specs: Sequence[tuple[str, tuple[int, ...], str]], seed: int) -> dict[str, np.ndarray]:
    """One request's named tensors for ``specs``, seeded: floats standard normal, integers in -3..3 (0..3
    unsigned), booleans fair coins; the same ``seed`` gives the same values."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape, dtype in specs:
        dt = np.dtype(dtype)
        if dt.kind == "f":
            a = rng.standard_normal(shape).astype(dt)
        elif dt.kind == "b":
            a = rng.integers(0, 2, size=shape).astype(bool)
        elif dt.kind in "iu":
            a = rng.integers(0 if dt.kind == "u" else -3, 4, size=shape).astype(dt)
        else:
            a = np.zeros(shape, dt)  # the wire refuses it, naming the tensor
        out[name] = np.ascontiguousarray(a)
    return out


def _warm_then(t_s: np.ndarray, warmup_s: float, count: int | None, duration_s: float | None) -> np.ndarray:
    ns = np.round(t_s * 1e9).astype(np.int64)
    warm_ns = round(warmup_s * 1e9)
    n_warm = int(np.searchsorted(ns, warm_ns, side="left"))
    if count is not None:
        ns = ns[: n_warm + count]
    if duration_s is not None:
        ns = ns[ns < warm_ns + round(duration_s * 1e9)]
    return ns


def _warm_then_gen(gaps_for, warmup_s: float, count: int | None, duration_s: float | None) -> np.ndarray:
    """Arrivals at 0, g0, g0+g1, ... until `count` measured ones or the end of warm-up + duration."""
    horizon = warmup_s + (duration_s or 0.0)
    chunks = [np.zeros(1)]
    total = 1
    last = 0.0
    n_want = 1024
    while True:
        t = np.asarray(chunks[-1])
        last = float(t[-1])
        if count is not None:
            n_meas = sum(int((np.asarray(c) >= warmup_s).sum()) for c in chunks)
            if n_meas >= count:
                break
        elif last >= horizon:
            break
        g = np.cumsum(gaps_for(n_want)) + last
        chunks.append(g)
        total += n_want
        n_want = min(n_want * 2, 1 << 22)
    t = np.concatenate(chunks)
    return _warm_then(t, warmup_s, count, duration_s if count is None else None)


@dataclass
class Plan:
    """What the sender sends: a packet pool, request units over it, and timed events.

    Packet p is `pool[pkt_off[p]:pkt_off[p] + pkt_len[p]]`; `pkt_patch[p]` says it carries our header
    (request id and client_ts_ns are written at send time). Unit u is packets
    `unit_first[u]:unit_first[u] + unit_count[u]`. Event e sends unit `ev_unit[e]` at `ev_time_ns[e]`
    with request id `ev_rid[e]` to `dests[ev_dest[e]]`. `ev_app[e]` is the app id, -1 for a datagram
    sent as it is (not a request).
    """

    pool: np.ndarray
    pkt_off: np.ndarray
    pkt_len: np.ndarray
    pkt_patch: np.ndarray
    unit_first: np.ndarray
    unit_count: np.ndarray
    dests: list[tuple[str, int]]
    ev_time_ns: np.ndarray
    ev_unit: np.ndarray
    ev_rid: np.ndarray
    ev_dest: np.ndarray
    ev_app: np.ndarray
    ev_warmup: np.ndarray
    span_ns: int
    stop_at_ns: int = 0
    warmup_ns: int = 0
    target_rps: float | None = None
    target_pps: float | None = None
    app_targets: dict[int, dict[str, float | None]] = field(default_factory=dict)
    description: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pool = np.ascontiguousarray(self.pool, dtype=np.uint8)
        self.pkt_off = np.ascontiguousarray(self.pkt_off, dtype=np.uint64)
        self.pkt_len = np.ascontiguousarray(self.pkt_len, dtype=np.uint32)
        self.pkt_patch = np.ascontiguousarray(self.pkt_patch, dtype=np.uint8)
        self.unit_first = np.ascontiguousarray(self.unit_first, dtype=np.uint32)
        self.unit_count = np.ascontiguousarray(self.unit_count, dtype=np.uint32)
        self.ev_time_ns = np.ascontiguousarray(self.ev_time_ns, dtype=np.int64)
        self.ev_unit = np.ascontiguousarray(self.ev_unit, dtype=np.uint32)
        self.ev_rid = np.ascontiguousarray(self.ev_rid, dtype=np.uint64)
        self.ev_dest = np.ascontiguousarray(self.ev_dest, dtype=np.uint16)
        self.ev_app = np.ascontiguousarray(self.ev_app, dtype=np.int32)
        self.ev_warmup = np.ascontiguousarray(self.ev_warmup, dtype=bool)
        n = len(self.ev_time_ns)
        for name in ("ev_unit", "ev_rid", "ev_dest", "ev_app", "ev_warmup"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"plan: {name} has {len(getattr(self, name))} entries, ev_time_ns {n}")
        if n and (np.diff(self.ev_time_ns) < 0).any():
            raise ValueError("plan: event times must not decrease")
        if len(self.dests) > 0xFFFF:
            raise ValueError("plan: at most 65535 destinations")

    @property
    def n_events(self) -> int:
        return len(self.ev_time_ns)

    @property
    def ev_packets(self) -> np.ndarray:
        """Packets each event sends."""
        return self.unit_count[self.ev_unit].astype(np.int64)

    @property
    def ev_bytes(self) -> np.ndarray:
        """Bytes (UDP payload) each event sends."""
        unit_bytes = np.add.reduceat(self.pkt_len.astype(np.int64), self.unit_first.astype(np.int64)) \
            if len(self.unit_first) else np.zeros(0, np.int64)
        # reduceat sums to the next unit's first packet: units are contiguous and in order here.
        return unit_bytes[self.ev_unit]

    @property
    def ev_is_request(self) -> np.ndarray:
        return self.ev_app >= 0

    def dest_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(ip as the u32 that holds its network-order bytes, port) per destination."""
        ips = np.array([int.from_bytes(socket.inet_aton(h), "little") for h, _ in self.dests], dtype=np.uint32)
        ports = np.array([p for _, p in self.dests], dtype=np.uint16)
        return ips, ports

    def slice_events(self, keep: np.ndarray) -> Plan:
        """The same plan with only the events where `keep` is true."""
        return dataclasses.replace(
            self, ev_time_ns=self.ev_time_ns[keep], ev_unit=self.ev_unit[keep], ev_rid=self.ev_rid[keep],
            ev_dest=self.ev_dest[keep], ev_app=self.ev_app[keep], ev_warmup=self.ev_warmup[keep])


class PlanBuilder:
    """Accumulates packets and units into one pool."""

    def __init__(self) -> None:
        self._chunks: list[bytes | memoryview] = []
        self._size = 0
        self.pkt_off: list[int] = []
        self.pkt_len: list[int] = []
        self.pkt_patch: list[int] = []
        self.unit_first: list[int] = []
        self.unit_count: list[int] = []
        self._dests: dict[tuple[str, int], int] = {}

    def add_unit(self, datagrams: Sequence[bytes], patch: bool) -> int:
        if not datagrams:
            raise ValueError("a unit needs at least one datagram")
        self.unit_first.append(len(self.pkt_off))
        self.unit_count.append(len(datagrams))
        for d in datagrams:
            if not 0 < len(d) <= 65507:
                raise ValueError(f"datagram of {len(d)} bytes cannot be sent over UDP/IPv4")
            self.pkt_off.append(self._size)
            self.pkt_len.append(len(d))
            self.pkt_patch.append(1 if patch else 0)
            self._chunks.append(d)
            self._size += len(d)
        return len(self.unit_first) - 1

    def dest(self, addr: tuple[str, int]) -> int:
        return self._dests.setdefault(addr, len(self._dests))

    def build(self, **events) -> Plan:
        pool = np.frombuffer(b"".join(self._chunks), dtype=np.uint8) if self._chunks else np.zeros(0, np.uint8)
        return Plan(pool=pool, pkt_off=self.pkt_off, pkt_len=self.pkt_len, pkt_patch=self.pkt_patch,
                    unit_first=self.unit_first, unit_count=self.unit_count, dests=list(self._dests), **events)


@dataclass
class Stream:
    """One run's traffic: several apps with their own rates, a seed, and a warm-up.

    Requests sent in the first `warmup_s` seconds are excluded from the report; `count` and
    `duration_s` of each app count after the warm-up. Request ids of each app are
    `request_id_base, request_id_base + 1, ...` in send order.
    """

    apps: list[AppStream]
    seed: int = 0
    warmup_s: float = 0.0
    request_id_base: int = 1

    def __post_init__(self) -> None:
        if not self.apps:
            raise ValueError("a stream needs at least one app")
        ids = [a.app_id for a in self.apps]
        if len(set(ids)) != len(ids):
            raise ValueError(f"app ids must differ within a stream, got {ids}")
        if not self.warmup_s >= 0:
            raise ValueError(f"warmup_s must be >= 0, got {self.warmup_s}")
        if not 0 <= self.request_id_base < MAX_REQUEST_ID:
            raise ValueError(f"request_id_base must be in 0..2**48, got {self.request_id_base}")

    def plan(self) -> Plan:
        b = PlanBuilder()
        times, units, rids, dests, apps, warm = [], [], [], [], [], []
        targets: dict[int, dict[str, float | None]] = {}
        for i, app in enumerate(self.apps):
            rng = np.random.default_rng([self.seed, i])
            variant_units = []
            for body in app.bodies():
                dg = wire.encode_request(app.app_id, 0, body, chunk_payload=app.chunk_payload,
                                         deadline_us=app.deadline_us, dtype=app.wire_dtype)
                variant_units.append(b.add_unit(dg, patch=True))
            t = app.arrivals_ns(rng, self.warmup_s)
            n = len(t)
            if self.request_id_base + n >= MAX_REQUEST_ID:
                raise ValueError(f"app {app.app_id}: {n} requests overflow the request id space")
            times.append(t)
            units.append(np.asarray(variant_units, dtype=np.uint32)[np.arange(n) % len(variant_units)])
            rids.append(self.request_id_base + np.arange(n, dtype=np.uint64))
            dests.append(np.full(n, b.dest(app.to), dtype=np.uint16))
            apps.append(np.full(n, app.app_id, dtype=np.int32))
            warm.append(t < round(self.warmup_s * 1e9))
            r = app.request_rate
            targets[app.app_id] = {"rps": r, "pps": None if r is None else r * app.packets_per_request}
        t = np.concatenate(times)
        order = np.argsort(t, kind="stable")
        warm_ns = round(self.warmup_s * 1e9)
        span = _span_ns(self.apps, times, warm_ns)
        rps = [v["rps"] for v in targets.values()]
        total_rps = None if any(r is None for r in rps) else float(sum(rps))  # type: ignore[arg-type]
        pps = [v["pps"] for v in targets.values()]
        total_pps = None if any(p is None for p in pps) else float(sum(pps))  # type: ignore[arg-type]
        durations = [a.duration_s for a in self.apps]
        stop_at = 0
        if all(d is not None for d in durations):
            stop_at = warm_ns + round(max(durations) * 1e9)  # type: ignore[type-var]
        return b.build(ev_time_ns=t[order], ev_unit=np.concatenate(units)[order], ev_rid=np.concatenate(rids)[order],
                       ev_dest=np.concatenate(dests)[order], ev_app=np.concatenate(apps)[order],
                       ev_warmup=np.concatenate(warm)[order], span_ns=span, stop_at_ns=stop_at, warmup_ns=warm_ns,
                       target_rps=total_rps, target_pps=total_pps, app_targets=targets,
                       description={"apps": [describe(a) for a in self.apps], "seed": self.seed,
                                    "warmup_s": self.warmup_s})


def describe(app: AppStream) -> dict:
    d = {k: v for k, v in dataclasses.asdict(app).items() if k not in ("body", "intervals_s", "tensors")}
    d["to"] = f"{app.to[0]}:{app.to[1]}"
    d["shape"] = list(app.shape)
    if app.tensors is not None:  # its body is the named tensors, not one array of shape and dtype
        d["tensors"] = [{"name": n, "shape": list(sh), "dtype": dt} for n, sh, dt in app.tensors]
        d["shape"], d["dtype"] = [app.body_bytes], "tensors"
        d.pop("image", None)
    d["packets_per_request"] = app.packets_per_request
    d["body_bytes"] = app.body_bytes
    if app.intervals_s is not None:
        d["intervals"] = len(app.intervals_s)
    return d


def _span_ns(apps: list[AppStream], times: list[np.ndarray], warm_ns: int) -> int:
    """Length of the measured part of the schedule: from the end of warm-up to one interval past the
    last request (so N requests at rate r span N / r), or the duration where one is given."""
    spans = []
    for app, t in zip(apps, times):
        if app.duration_s is not None:
            spans.append(round(app.duration_s * 1e9))
            continue
        meas = t[t >= warm_ns]
        if len(meas) == 0:
            spans.append(0)
            continue
        r = app.request_rate
        if r is not None:
            gap = 1e9 / r
        elif len(t) > 1:
            gap = float(np.mean(np.diff(t)))
        else:
            gap = 0.0
        spans.append(round(int(meas[-1]) - warm_ns + gap))
    return max(spans) if spans else 0
