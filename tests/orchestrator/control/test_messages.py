from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.control.messages import (
    MAX_BLOBS,
    MAX_HEADER_BYTES,
    MESSAGE_TYPES,
    BatchDone,
    Ended,
    Error,
    Finish,
    Heartbeat,
    InitGpu,
    Message,
    ProtocolError,
    Ready,
    Result,
    RunBatch,
    SetGpuRequest,
    Shutdown,
    StatsReply,
    StatsRequest,
    StatusReply,
    StatusRequest,
    StopRequest,
    decode,
    encode,
    encode_header,
)
from orchestrator.control.records import InstanceStats

TOKEN = b"t" * 64

SAMPLES: list[Message] = [
    Ready(instance="a-0", pid=42, info={"device": "cpu", "params": 3}, blobs=(b"\x00" * 100, b"ipc")),
    Finish(instance="a-0"),
    Ended(instance="a-0", drained_count=7),
    Heartbeat(instance="a-0", stats=InstanceStats(received=3, p50_ms=1.5, batch_sizes={"2": 1},
                                                  engine={"kind": "eager"}, mps_pct="30")),
    StatsRequest(instance="a-0"),
    StatsReply(instance="a-0", stats=InstanceStats(ok=1)),
    InitGpu(instance="a-1", gpu_pct=60),
    Shutdown(instance="a-0", drain=False),
    Error(instance="a-0", kind="cuda_oom", message="out of memory"),
    StatusRequest(),
    StatusReply(status={"apps": [], "node": {"backend": "cpu"}}),
    StopRequest(drain=True),
    SetGpuRequest(app="detect", gpu_pct=30),
    Result(ok=False, message="no such app", data={"known": ["a"]}),
    RunBatch(instance="a-0", id=7, stage="router", batch=4, gpu_pct=25),
    BatchDone(instance="a-0", id=7, taken=4, measured_ms=3.5, routed={"face": [1.5, 2.5]}),
]


def test_every_type_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES.values())


def test_paper_tags() -> None:
    assert Finish.TAG == 2 and Ended.TAG == 3
    assert len({cls.TAG for cls in MESSAGE_TYPES.values()}) == len(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    frames = encode(msg, TOKEN)
    assert frames[0] == TOKEN and frames[1][0] == type(msg).TAG
    assert len(frames) == 2 + len(msg.blobs)
    token, back = decode(frames)
    assert token == TOKEN and back == msg and back.blobs == msg.blobs


def test_blobs_are_not_in_the_header() -> None:
    big = b"x" * (2 * MAX_HEADER_BYTES)
    frames = encode(Ready(instance="a", pid=1, blobs=(big,)), TOKEN)
    assert len(frames[1]) < 100 and frames[2] == big


def test_numpy_scalars_encode() -> None:
    np = pytest.importorskip("numpy")
    _, back = decode(encode(Heartbeat(instance="a", stats=InstanceStats(ok=np.int64(3), p50_ms=np.float32(0.5))),
                            TOKEN))
    assert back.stats == InstanceStats(ok=3, p50_ms=0.5)  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad", [0, 101, True, 50.0])
def test_gpu_pct_validated_at_construction(bad: object) -> None:
    with pytest.raises(ValueError, match="gpu_pct"):
        SetGpuRequest(app="a", gpu_pct=bad)  # type: ignore[arg-type]


def test_encode_refuses_unserialisable() -> None:
    with pytest.raises(ValueError, match="cannot encode Heartbeat"):
        encode(Heartbeat(instance="a", stats=InstanceStats(engine={"x": object()})), TOKEN)
    with pytest.raises(ValueError, match="cannot encode"):
        encode(Heartbeat(instance="a", stats=InstanceStats(p50_ms=float("nan"))), TOKEN)


def test_encode_refuses_oversized_header_and_too_many_blobs() -> None:
    with pytest.raises(ValueError, match="blobs"):
        encode(Heartbeat(instance="a", stats=InstanceStats(engine={"x": "y" * MAX_HEADER_BYTES})), TOKEN)
    with pytest.raises(ValueError, match="blobs"):
        encode(Finish(instance="a", blobs=(b"",) * (MAX_BLOBS + 1)), TOKEN)


def test_encode_refuses_unregistered_type() -> None:
    with pytest.raises(TypeError, match="not a registered"):
        encode_header(Message())


def _hdr(tag: int, body: object) -> bytes:
    return bytes([tag]) + json.dumps(body).encode()


@pytest.mark.parametrize(("frames", "reason", "fragment"), [
    ([TOKEN], "malformed", "at least 2 frames"),
    ([], "malformed", "at least 2 frames"),
    ([TOKEN, b""], "malformed", "empty header"),
    ([TOKEN, b"\xff{}"], "unknown_tag", "unknown message tag 255"),
    ([TOKEN, b"\x00{}"], "unknown_tag", "tag 0"),
    ([TOKEN, b"\x02not json"], "malformed", "not UTF-8 JSON"),
    ([TOKEN, b"\x02\xff\xfe"], "malformed", "not UTF-8 JSON"),
    ([TOKEN, _hdr(2, [1, 2])], "malformed", "JSON object"),
    ([TOKEN, _hdr(2, {"instance": "a", "extra": 1})], "malformed", "unknown fields ['extra']"),
    ([TOKEN, _hdr(3, {"instance": "a"})], "malformed", "lacks fields ['drained_count']"),
    ([TOKEN, _hdr(3, {"instance": "a", "drained_count": "7"})], "malformed", "drained_count must be int"),
    ([TOKEN, _hdr(3, {"instance": "a", "drained_count": True})], "malformed", "must be int"),
    ([TOKEN, _hdr(2, {"instance": 5})], "malformed", "instance must be str"),
    ([TOKEN, _hdr(4, {"instance": "a", "stats": [1]})], "malformed", "stats must be InstanceStats"),
    # A heartbeat's body is checked field by field (a counted drop, never a crash in the node's loop).
    ([TOKEN, _hdr(4, {"instance": "a", "stats": {"okk": 1}})], "malformed", "unknown fields ['okk']"),
    ([TOKEN, _hdr(4, {"instance": "a", "stats": {"ok": "lots"}})], "malformed", "InstanceStats.ok must be"),
    ([TOKEN, _hdr(4, {"instance": "a", "stats": {"ok": -3}})], "malformed", "InstanceStats.ok must be"),
    ([TOKEN, _hdr(4, {"instance": "a", "stats": {"received": True}})], "malformed", "InstanceStats.received"),
    ([TOKEN, _hdr(4, {"instance": "a", "stats": {"p50_ms": "1"}})], "malformed", "InstanceStats.p50_ms"),
    ([TOKEN, _hdr(4, {"instance": "a", "stats": {"batch_sizes": [1]}})], "malformed", "batch_sizes"),
    ([TOKEN, _hdr(6, {"instance": "a", "stats": {"engine": 3}})], "malformed", "InstanceStats.engine"),
    ([TOKEN, _hdr(14, {"app": "a", "gpu_pct": 0})], "malformed", "gpu_pct must be an integer in 1..100"),
    ([TOKEN, _hdr(9, {"instance": "a", "drain": 1})], "malformed", "drain must be bool"),
    ([TOKEN, b"\x02" + b" " * MAX_HEADER_BYTES], "oversized", "header frame"),
    ([TOKEN, _hdr(2, {"instance": "a"}), *([b""] * (MAX_BLOBS + 1))], "oversized", "blob frames"),
])
def test_decode_rejects(frames: list[bytes], reason: str, fragment: str) -> None:
    with pytest.raises(ProtocolError) as ei:
        decode(frames)
    assert ei.value.reason == reason
    assert fragment in str(ei.value)


def test_protocol_error_pickles() -> None:
    import pickle

    e = pickle.loads(pickle.dumps(ProtocolError("malformed", "x")))
    assert e.reason == "malformed" and e.detail == "x"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_decode_never_crashes_on_garbage(frames: list[bytes]) -> None:
    try:
        decode(frames)
    except ProtocolError as e:
        assert e.reason in {"malformed", "unknown_tag", "oversized"}


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(MESSAGE_TYPES)), st.dictionaries(st.sampled_from(
    ["instance", "pid", "info", "drained_count", "stats", "gpu_pct", "drain", "kind", "message", "status",
     "app", "ok", "data"]), st.one_of(st.integers(-5, 200), st.text(max_size=5), st.booleans(), st.none(),
                                      st.dictionaries(st.text(max_size=3), st.integers()))))
def test_decode_never_crashes_on_wrong_bodies(tag: int, body: dict) -> None:
    try:
        _, msg = decode([TOKEN, _hdr(tag, body)])
    except ProtocolError as e:
        assert e.reason == "malformed"
    else:
        assert tag == type(msg).TAG


@pytest.mark.parametrize(("kw", "needle"), [
    ({"id": -1}, "id >= 0"), ({"batch": 0}, "batch >= 1"), ({"action": "skip"}, "action"),
    ({"gpu_pct": 0}, "gpu_pct"),
])
def test_run_batch_validates(kw: dict, needle: str) -> None:
    args = {"instance": "a-0", "id": 1, "stage": "s", "batch": 2, **kw}
    with pytest.raises(ValueError, match=needle):
        RunBatch(**args)
