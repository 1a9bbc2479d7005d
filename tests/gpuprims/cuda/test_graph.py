"""gpuprims.cuda.graph on the fake runtime: capture through the Capture object (single stream and a
fork/join across streams, the shape Opara's multi-stream capture takes), replay on another stream,
errors as CudaError, close() leaving nothing; and torch's text errors mapped through the choke point."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from gpuprims.cuda import graph as cuda_graph
from gpuprims.cuda.errors import CudaError, raise_from_message
from gpuprims.cuda.event import Stream
from gpuprims.cuda.graph import CudaGraph


def test_fork_join_capture_replays_every_branch(fake_cuda: Any) -> None:
    seen: list[str] = []
    s1, s2, out = Stream(0), Stream(0), Stream(0)
    before = cuda_graph.captures()
    with CudaGraph(0) as g:
        with g.capture() as cap:
            cap.launch(lambda: seen.append("stem"))
            cap.fork(s1)
            cap.fork(s2)
            cap.launch(lambda: seen.append("left"), s1)
            cap.launch(lambda: seen.append("right"), s2)
            cap.wait(s2, on=s1)  # a plan's cross-stream edge
            cap.launch(lambda: seen.append("merge"), s2)
            cap.join(s1)
            cap.join(s2)
            cap.launch(lambda: seen.append("head"))
        assert seen == [] and g.captured and g.nodes == 5 and cuda_graph.captures() == before + 1
        for _ in range(2):
            g.replay(out)
        out.synchronize()
        assert seen[0] == "stem" and seen[4] == "head" and seen[5:] == seen[:5]
        assert seen.index("merge") > seen.index("left")
        with pytest.raises(ValueError, match="already captured"), g.capture():
            pass
    with pytest.raises(CudaError, match="cudaErrorInvalidValue"):
        g.replay(out)
    for s in (s1, s2, out):
        s.close()
    assert fake_cuda.live("graph") == [] and fake_cuda.live("graph_exec") == [] and fake_cuda.live("event") == []
    assert fake_cuda.live("stream") == []


def test_an_unjoined_fork_raises_and_keeps_nothing(fake_cuda: Any) -> None:
    side = Stream(0)
    g = CudaGraph(0)
    with pytest.raises(CudaError) as ei, g.capture() as cap:
        cap.fork(side)
        cap.launch(lambda: None, side)
    assert ei.value.name == "cudaErrorStreamCaptureUnjoined"
    assert not g.captured
    g.close()
    side.close()
    assert fake_cuda.live("graph") == [] and fake_cuda.live("stream") == [] and fake_cuda.live("event") == []


def test_an_error_inside_the_block_ends_the_capture(fake_cuda: Any) -> None:
    s = Stream(0)
    g = CudaGraph(0)
    with pytest.raises(CudaError, match="cudaErrorStreamCaptureUnsupported"), g.capture(s):
        s.synchronize()  # refused while capturing
    assert fake_cuda.cuda_stream_is_capturing(s.handle) == 0
    s.synchronize()  # the stream works again
    g.close()
    s.close()
    assert fake_cuda.live("graph") == []


def test_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        CudaGraph(0, mode="loose")


def test_torch_text_errors_become_cuda_errors() -> None:
    with pytest.raises(CudaError) as ei:
        raise_from_message(RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA "
                                        "kernel errors might be asynchronously reported"), "torch.cuda.graph")
    assert ei.value.status == 900 and ei.value.name == "cudaErrorStreamCaptureUnsupported"
    assert ei.value.call == "torch.cuda.graph"
    with pytest.raises(CudaError) as ei:
        raise_from_message(RuntimeError("CUDA error: capturing stream has unjoined work"), "x")
    assert ei.value.status == 904
    other = RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError) as ri:
        raise_from_message(other, "x")
    assert ri.value is other


class _Plan:
    """A hand-made plan in the shape of Opara's StreamPlan: x -> (a on 0, b on 1, c on 2 after b) -> out.
    As in its contract, the input op ``x`` is in place before the capture begins (the forks follow it)."""

    order = ("x", "a", "b", "c", "out")
    stream_of: ClassVar[dict[str, int]] = {"x": 0, "a": 0, "b": 1, "c": 2, "out": 0}
    waits: ClassVar[dict[str, tuple[str, ...]]] = {"x": (), "a": (), "b": (), "c": ("b",), "out": ("c",)}
    num_streams = 3
    events = ("b", "c")
    join = ()


def test_a_multi_stream_plan_captures_with_its_edges_and_replays(fake_cuda: Any) -> None:
    env: dict[str, float] = {}
    ops = {"x": lambda: None, "a": lambda: env.__setitem__("a", env["x"] + 1),
           "b": lambda: env.__setitem__("b", env["x"] * 2), "c": lambda: env.__setitem__("c", env["b"] - 1),
           "out": lambda: env.__setitem__("out", env["a"] * 10 + env["c"])}
    s1, s2, out = Stream(0), Stream(0), Stream(0)
    with CudaGraph(0) as g:
        with g.capture() as cap:
            cuda_graph.capture_plan(cap, _Plan(), lambda op: ops[op](), [cap.stream, s1, s2])
        assert env == {} and g.nodes == 5
        nodes = fake_cuda.graph_nodes(g._graph)
        by_label = {n.index: n for n in nodes}
        # out (node 4) depends on a (1) through stream 0 and on c (3) through its wait; c on b (2); b forked
        # from the capture's start on its own stream
        assert set(by_label[4].deps) >= {1, 3} and by_label[3].deps == (2,) and by_label[2].deps == ()
        assert [n.stream for n in nodes] == [cap.stream.handle, cap.stream.handle, s1.handle, s2.handle,
                                             cap.stream.handle]
        env["x"] = 3.0  # the input, in place before the replay
        g.replay(out)
        out.synchronize()
        assert env["out"] == 45.0
    for s in (s1, s2, out):
        s.close()
    assert fake_cuda.live("graph") == [] and fake_cuda.live("event") == []


def test_a_plan_that_waits_for_a_later_op_is_refused(fake_cuda: Any) -> None:
    class Bad(_Plan):
        waits: ClassVar[dict[str, tuple[str, ...]]] = {"x": (), "a": ("out",), "b": (), "c": ("b",), "out": ()}

    s1, s2 = Stream(0), Stream(0)
    g = CudaGraph(0)
    with pytest.raises(ValueError, match="waits for 'out'"), g.capture() as cap:
        cuda_graph.capture_plan(cap, Bad(), lambda op: None, [cap.stream, s1, s2])
    with pytest.raises(ValueError, match="needs 3 streams"), CudaGraph(0).capture() as cap:
        cuda_graph.capture_plan(cap, _Plan(), lambda op: None, [cap.stream])
    g.close()
    for s in (s1, s2):
        s.close()
    assert fake_cuda.live("graph") == []
