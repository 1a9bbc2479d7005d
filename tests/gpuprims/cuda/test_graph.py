"""gpuprims.cuda.graph on the fake runtime: capture through the Capture object (single stream and a
fork/join across streams, the shape Opara's multi-stream capture takes), replay on another stream,
errors as CudaError, close() leaving nothing; and torch's text errors mapped through the choke point."""

from __future__ import annotations

from typing import Any

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
