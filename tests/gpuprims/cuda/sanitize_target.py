"""Runs every GPU-DMA kernel path once, for compute-sanitizer (memcheck, racecheck) to inspect.

``python -m tests.gpuprims.cuda.sanitize_target`` (needs a GPU); test_dma runs it under the tool.
"""

from __future__ import annotations

import numpy as np
import torch

from gpuprims.cuda import Normalize, PinnedPool, cuda_copy_gather, gpu_dma
from gpuprims.testing.synthetic import SyntheticPool


def main() -> None:
    rng = np.random.default_rng(0)
    sp = SyntheticPool(slot_count=1024, max_payload=1024, record_count=16, max_chunks=128)
    bodies = [rng.integers(0, 256, size=(30, 31, 3), dtype=np.uint8) for _ in range(4)]
    recs = [sp.add_request(1, i, b, chunk_payload=1000) for i, b in enumerate(bodies)]
    sp.set_header_field(recs[2], 1, "request_id", 12345)  # one refused packet
    sp.chunkmap[recs[3], 0] = 10_000_000  # one slot out of range
    with PinnedPool(sp, backend="cuda") as pp:
        out = torch.zeros((4, 30, 31, 3), dtype=torch.uint8, device="cuda:0")
        assert gpu_dma(pp.packets(recs), 4, out, 0) == 2
        f = torch.zeros((4, 30, 31, 3), dtype=torch.float32, device="cuda:0")
        assert gpu_dma(pp.packets(recs), 4, f, 0, normalize=Normalize(mean=(0.4, 0.5, 0.6), std=(0.2, 0.2, 0.2))) == 2
        odd = torch.zeros((3, 30 * 31 * 3 + 1), dtype=torch.uint8, device="cuda:0")[:, 1:].contiguous()
        assert gpu_dma(pp.packets(recs[:2]), 2, odd, 0) == 2  # 2790-byte rows: row 1 is not 16-byte aligned (byte path)
        assert cuda_copy_gather(pp.packets(recs), 4, out, 0) == 2
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
