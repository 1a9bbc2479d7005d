from __future__ import annotations

import numpy as np
import pytest

from gpuprims import wire
from gpuprims.traffic import AppStream, Stream, read_intervals
from gpuprims.traffic.images import SAMPLE_IMAGES, request_body

TO = ("127.0.0.1", 9000)


def test_constant_schedule_is_exact() -> None:
    app = AppStream(1, (1024,), "uint8", rate=3000, count=10, to=TO)
    t = app.arrivals_ns(np.random.default_rng(0))
    assert t.tolist() == [round(k * 1e9 / 3000) for k in range(10)]


def test_duration_and_warmup() -> None:
    plan = Stream([AppStream(1, (1024,), "uint8", rate=100, duration_s=2.0, to=TO)], warmup_s=0.5).plan()
    assert plan.n_events == 250
    assert int(plan.ev_warmup.sum()) == 50
    assert plan.ev_time_ns[plan.ev_warmup].max() < 500_000_000 <= plan.ev_time_ns[~plan.ev_warmup].min()
    assert plan.span_ns == 2_000_000_000 and plan.stop_at_ns == 2_500_000_000 and plan.warmup_ns == 500_000_000


@pytest.mark.parametrize(("rate", "warmup_s", "duration_s", "measured"),
                         [(233.5, 1.0, 3.0, 700), (1401.2, 1.0, 3.0, 4203), (100.0, 0.5, 2.0, 200), (7.0, 0.3, 1.0, 7)])
def test_a_constant_schedule_ends_before_the_horizon_the_sender_stops_at(
        rate: float, warmup_s: float, duration_s: float, measured: int) -> None:
    # A rate whose grid does not land on the warm-up's end once put an event exactly at warm-up +
    # duration, which the sender (stopping there) never sent: a request scheduled, never sent.
    plan = Stream([AppStream(1, (64,), "uint8", rate=rate, duration_s=duration_s, to=TO)], warmup_s=warmup_s).plan()
    assert plan.ev_time_ns.max() < plan.stop_at_ns
    assert int((~plan.ev_warmup).sum()) == measured


def test_pps_sets_request_rate_from_packets_per_request() -> None:
    app = AppStream(1, (224, 224, 3), "float32", pps=58800, count=3, to=TO)
    assert app.packets_per_request == 588
    assert app.request_rate == pytest.approx(100.0)
    plan = Stream([app]).plan()
    assert plan.target_pps == pytest.approx(58800) and plan.target_rps == pytest.approx(100)
    assert plan.ev_packets.tolist() == [588] * 3


def test_poisson_is_seeded_and_has_the_rate() -> None:
    def times(seed: int) -> np.ndarray:
        return Stream([AppStream(1, (64,), "uint8", rate=1000, process="poisson", count=20000, to=TO)],
                      seed=seed).plan().ev_time_ns

    a, b, c = times(7), times(7), times(8)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert len(a) == 20000
    gaps = np.diff(a) / 1e9
    assert gaps.mean() == pytest.approx(1e-3, rel=0.03)
    assert gaps.std() == pytest.approx(1e-3, rel=0.05)  # exponential: std == mean


def test_poisson_duration_stops_at_the_horizon() -> None:
    plan = Stream([AppStream(1, (64,), "uint8", rate=5000, process="poisson", duration_s=1.0, to=TO)], seed=3).plan()
    assert plan.ev_time_ns.max() < 1_000_000_000
    assert abs(plan.n_events - 5000) < 5 * np.sqrt(5000)


def test_intervals_from_a_file(tmp_path) -> None:
    f = tmp_path / "iv.txt"
    f.write_text("# gaps\n0.001\n2ms\n\n500us\n")
    iv = read_intervals(f)
    np.testing.assert_allclose(iv, [1e-3, 2e-3, 5e-4])
    one_pass = AppStream(1, (64,), "uint8", intervals_s=iv, to=TO).arrivals_ns(np.random.default_rng(0))
    assert one_pass.tolist() == [0, 1_000_000, 3_000_000, 3_500_000]
    cycled = AppStream(1, (64,), "uint8", intervals_s=iv, count=6, to=TO).arrivals_ns(np.random.default_rng(0))
    assert cycled.tolist() == [0, 1_000_000, 3_000_000, 3_500_000, 4_500_000, 6_500_000]
    bad = tmp_path / "bad.txt"
    bad.write_text("0.1\nfast\n")
    with pytest.raises(ValueError, match=r"bad.txt: line 2"):
        read_intervals(bad)


def test_several_apps_merge_in_time_with_their_own_ids_and_rates() -> None:
    plan = Stream([AppStream(1, (64,), "uint8", rate=100, count=10, to=("127.0.0.1", 9001)),
                   AppStream(2, (2048,), "uint8", rate=1000, count=100, to=("127.0.0.1", 9002))],
                  request_id_base=5).plan()
    assert plan.n_events == 110
    assert (np.diff(plan.ev_time_ns) >= 0).all()
    for app, n, port in ((1, 10, 9001), (2, 100, 9002)):
        m = plan.ev_app == app
        assert plan.ev_rid[m].tolist() == list(range(5, 5 + n))
        assert {plan.dests[d][1] for d in plan.ev_dest[m]} == {port}
    assert plan.target_rps == pytest.approx(1100)
    assert plan.app_targets[2]["pps"] == pytest.approx(2000)


def test_pool_holds_each_request_once_as_valid_datagrams() -> None:
    app = AppStream(4, (3, 32, 32), "float32", rate=10, count=50, to=TO, variants=2, deadline_us=7000)
    plan = Stream([app]).plan()
    assert len(plan.unit_first) == 2 and plan.unit_count.tolist() == [12, 12]
    for p in range(len(plan.pkt_off)):
        d = bytes(plan.pool[plan.pkt_off[p]:plan.pkt_off[p] + plan.pkt_len[p]])
        assert wire.check_request(d) == wire.Verdict.OK
        h = wire.unpack_header(d)
        assert h.app_id == 4 and h.dtype == wire.DType.FLOAT32 and h.deadline_us == 7000
    assert set(plan.ev_unit.tolist()) == {0, 1}


@pytest.mark.parametrize(("kw", "msg"), [
    ({"rate": 1, "pps": 1, "count": 1}, "exactly one of rate, pps"),
    ({"count": 1}, "exactly one of rate, pps"),
    ({"rate": -5, "count": 1}, "rate must be positive"),
    ({"rate": 1}, "give count or duration_s"),
    ({"rate": 1, "count": 1, "duration_s": 1}, "not both"),
    ({"rate": 1, "count": 1, "process": "bursty"}, "process must be one of"),
    ({"rate": 1, "count": 1, "chunk_payload": 0}, "chunk_payload"),
])
def test_bad_stream_options_name_the_value(kw, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        AppStream(1, (64,), "uint8", to=TO, **kw)


def test_bad_address_and_duplicate_apps() -> None:
    with pytest.raises(ValueError, match="port must be in"):
        AppStream(1, (64,), "uint8", rate=1, count=1, to=("127.0.0.1", 0))
    a = AppStream(1, (64,), "uint8", rate=1, count=1, to=TO)
    with pytest.raises(ValueError, match="app ids must differ"):
        Stream([a, a])


@pytest.mark.parametrize(("shape", "dtype"), [((224, 224, 3), "float32"), ((3, 224, 224), "uint8"),
                                              ((1, 3, 32, 32), "float32"), ((28, 28), "uint8"), ((1024,), "uint8")])
def test_request_bodies_are_real_images(shape, dtype) -> None:
    b = request_body(shape, dtype)
    assert b.shape == shape and b.dtype == np.dtype(dtype)
    hi = 255 if dtype == "uint8" else 1.0
    assert b.min() >= 0 and b.max() <= hi
    assert b.std() > 0.05 * hi  # an image, not a constant fill
    assert not np.array_equal(b, request_body(shape, dtype, image=SAMPLE_IMAGES[1]))


def test_image_layout_resizes_the_picture() -> None:
    hwc = request_body((64, 64, 3), "float32")
    chw = request_body((3, 64, 64), "float32")
    np.testing.assert_allclose(np.moveaxis(chw, 0, 2), hwc, atol=1e-6)
