"""The instance's serving mode is chosen from its spec (orchestrator/worker/loops/__init__.py), and each
mode refuses the entry point of the other."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpuprims.pool import PacketPool
from orchestrator.control.messages import RunBatch
from orchestrator.control.spec import InstanceSpec
from orchestrator.worker.loops import AdaptiveLoop, DispatchedLoop, TensorLoop, loop_class, serving_loop
from orchestrator.worker.zoo_runner import AppRunner


@pytest.fixture
def pool() -> Iterator[PacketPool]:
    p = PacketPool.create(slot_count=64, record_count=16, max_chunks=8, consumer_count=1)
    yield p
    p.close()


def _spec(pool: PacketPool, **kw: object) -> InstanceSpec:
    return InstanceSpec(name="a-0", app="a", app_id=1, model="mobilenet_v2", pool=pool.name, consumer=0,
                        input_shape=(3, 32, 32), num_classes=10, warmup=False, **kw)  # type: ignore[arg-type]


def test_the_spec_picks_one_loop_class_per_serving_mode(pool: PacketPool) -> None:
    assert loop_class(_spec(pool)) is AdaptiveLoop
    assert loop_class(_spec(pool, dispatched=True)) is DispatchedLoop
    assert loop_class(_spec(pool, model_config="{}")) is TensorLoop  # a model file: its own batch step


def test_the_adaptive_loop_refuses_a_run_batch(pool: PacketPool) -> None:
    spec = _spec(pool)
    loop = serving_loop(spec, pool, AppRunner(spec))
    try:
        assert type(loop) is AdaptiveLoop
        with pytest.raises(ValueError, match="not served in dispatched mode"):
            loop.run_batch(RunBatch(instance=spec.name, id=0, stage="main", batch=1))
    finally:
        loop.close()


def test_a_model_file_spec_is_not_served_through_a_zoo_runner(pool: PacketPool) -> None:
    with pytest.raises(TypeError, match="a model file is served through a FileRunner, got AppRunner"):
        serving_loop(_spec(pool, model_config="{}"), pool, AppRunner(_spec(pool)))
