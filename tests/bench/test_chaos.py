"""The chaos bench's own checker: every request matched to its answers, losses tied to faults."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bench.chaos import Ledger, bad_control_frames, malformed_datagrams, node_pids
from gpuprims import wire


def _ledger() -> Ledger:
    want = [np.arange(4, dtype=np.float32), np.ones(4, np.float32)]
    return Ledger({1: want}, rtol=1e-3, atol=1e-4)


def test_counts_ok_errors_lost_duplicated_and_corrupted() -> None:
    led = _ledger()
    for rid, t in ((1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.5), (6, 0.6)):
        led.sent(1, rid, t, variant=rid % 2)
    led.answer(1, 1, wire.Status.OK, np.ones(4, np.float32).tobytes())           # variant 1: right
    led.answer(1, 2, wire.Status.OK, (np.arange(4, dtype=np.float32) + 1e-6).tobytes())  # close enough
    led.answer(1, 3, wire.Status.OK, np.zeros(4, np.float32).tobytes())          # wrong logits: corrupted
    led.answer(1, 4, wire.Status.INSTANCE_FAILED)
    led.answer(1, 4, wire.Status.OK, np.arange(4, dtype=np.float32).tobytes())   # a second answer
    led.answer(1, 5, wire.Status.OK, b"\x00" * 7)                                 # not float32 logits
    led.answer(1, 99, wire.Status.OK)                                             # never sent
    led.answer(2, 1, wire.Status.OK)                                              # other app, never sent
    r = led.result()
    assert (r["sent"], r["ok"], r["lost"], r["duplicated"], r["corrupted"], r["unmatched"]) == (6, 4, 1, 1, 2, 2)  # ok counts corrupted OK answers too
    assert r["errors_by_status"] == {"INSTANCE_FAILED": 1}
    assert r["ok_checked_against_torch"] == 4
    assert led.outstanding() == 1


def test_each_loss_is_tied_to_the_last_fault_before_it() -> None:
    led = _ledger()
    led.fault(1.0, "kill", "classify-0")
    led.fault(5.0, "flood", "2000 datagrams")
    for rid, t in ((1, 0.5), (2, 1.5), (3, 6.0), (4, 7.0)):
        led.sent(1, rid, t)
    led.answer(1, 4, wire.Status.OK, np.arange(4, dtype=np.float32).tobytes())
    r = led.result()
    assert r["lost"] == 3
    assert r["lost_by_preceding_fault"] == {"none": 1, "kill": 1, "flood": 1}
    assert [(x["request_id"], x["preceding_fault"], x["since_fault_s"]) for x in r["losses"]] == \
        [(1, None, None), (2, "kill", 0.5), (3, "flood", 1.0)]
    assert r["faults_by_kind"] == {"kill": 1, "flood": 1}


def test_a_request_id_is_sent_once() -> None:
    led = _ledger()
    led.sent(1, 7, 0.0)
    with pytest.raises(ValueError, match="sent twice"):
        led.sent(1, 7, 0.1)


def test_malformed_datagrams_are_never_valid_requests_of_the_resembled_app() -> None:
    body = np.arange(3000, dtype=np.uint8)
    valid = wire.encode_request(1, 5, body)
    out, kinds = malformed_datagrams(valid, 400, random.Random(0))
    assert len(out) == 400 and sum(kinds.values()) == 400 and len(kinds) == 8
    from gpuprims import _native

    served_as_is = 0
    for d in out:
        if _native.check_request(d) == 0 and d in valid:
            served_as_is += 1
    assert served_as_is == 0  # every one differs from the valid packets (bit flips may still parse)


def test_bad_control_frames_cover_every_kind() -> None:
    rng = random.Random(1)
    seen = {bad_control_frames(b"ab" * 32, rng)[0] for _ in range(400)}
    assert len(seen) == 12


def test_node_pids_from_status() -> None:
    st = {"node": {"pid": 10}, "apps": {"a": {"instances": [{"name": "a-0", "pid": 11}, {"name": "a-s", "pid": None}]}}}
    assert node_pids(st) == {"orchestrator": 10, "a-0": 11}
