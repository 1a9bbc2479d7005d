"""Fixtures of the worker's tests: an in-process instance (tests/orchestrator/worker/inproc.py)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from gpuprims.ingest import Ingest
from orchestrator.worker.instance import Instance
from tests.orchestrator.worker.inproc import in_process_instance


@pytest.fixture
def setup() -> Iterator[tuple[Instance, Ingest, socket.socket]]:
    yield from in_process_instance()


@pytest.fixture
def waiting() -> Iterator[tuple[Instance, Ingest, socket.socket]]:
    """An instance that may wait up to 2 s to fill a batch of up to 4 (longer than a closed loop's turn
    takes on any machine, so the rule before waited on every request), with a deadline no busy machine
    misses (a minute), so only the batching rule decides what it does."""
    yield from in_process_instance(slo_ms=60_000.0, max_wait_ms=2000.0)


@pytest.fixture
def waiting16() -> Iterator[tuple[Instance, Ingest, socket.socket]]:
    """`waiting` with batches of up to 16: a MultiStream query of 8 is not a full batch, so only the
    query's own signal (wire FLAG_MORE) makes the instance hold its first samples for the rest."""
    yield from in_process_instance(slo_ms=60_000.0, max_wait_ms=2000.0, max_batch=16)
