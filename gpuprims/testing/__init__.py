"""gpuprims' test rig, shipped as a public testing package (as ``torch.testing`` ships with torch).

* :mod:`gpuprims.testing.fake`: the fake CUDA runtime, selected at run time with
  ``GPUPRIMS_FAKE_CUDA=1`` (:func:`gpuprims.cuda.runtime.cuda` then loads it by name); ``gpuprims
  doctor --fake`` and a node on a machine without a GPU run on it.
* :mod:`gpuprims.testing.synthetic`: a packet-pool memory image filled as the ingest would leave it
  (GPU-DMA's tests and benchmarks, and ``gpuprims doctor``'s GPU-DMA check on a real GPU).
* :mod:`gpuprims.testing.hostsim`: the GPU-DMA kernel source built with g++ against a host shim and
  compared with the CPU reference. It compiles ``native/`` sources, so it runs from a source checkout
  only and is left out of the wheel (``wheel.exclude`` in pyproject.toml).

Nothing in ``gpuprims`` below this package imports it; it sits above ``gpuprims.cuda`` (its fake
raises that layer's :class:`~gpuprims.cuda.errors.CudaError`). The played instance of the node's tests
stays in ``tests/orchestrator/fake_launcher.py``: it speaks the orchestrator's control messages, and
the library never imports the orchestrator.
"""
