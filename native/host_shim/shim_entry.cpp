// C entry point of the host-run GPU-DMA kernel (native/cuda/dma.cu built with the shim beside this
// file), loaded with ctypes by gpuprims.testing.hostsim. It fills LaunchParams as the extension's
// dma_launch does and calls the real launch_gather.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gpuprims/cuda_kernels.h"

namespace d = gpuprims::dma;

extern "C" {

// Returns the launch status (0 = cudaSuccess), or -1 if the kernels left the row verdict scratch
// dirty (the finalize kernel must re-zero it for the next launch). `stale_error` is put in the
// thread's last-error slot first, as an earlier failed call would leave it.
int gp_shim_launch(const uint8_t* pool, uint64_t slots_offset, uint64_t records_offset, uint64_t chunkmap_offset,
                   uint32_t slot_size, uint32_t slot_count, uint32_t record_count, uint32_t max_chunks,
                   const uint32_t* records, uint32_t n, uint8_t* out, uint64_t row_stride, uint64_t row_src_bytes,
                   int32_t expect_dtype, uint32_t mode, uint32_t channels, const float* a, const float* b,
                   const float* dv, uint32_t blocks_per_row, int32_t* result, int stale_error) {
  if (n > d::kMaxBatch) return int(cudaErrorInvalidValue);
  std::vector<int32_t> status(d::kMaxBatch, 0);
  d::LaunchParams p{};
  p.pool = pool;
  p.slots_offset = slots_offset;
  p.records_offset = records_offset;
  p.chunkmap_offset = chunkmap_offset;
  p.slot_size = slot_size;
  p.slot_count = slot_count;
  p.record_count = record_count;
  p.n = n;
  p.geo = d::Geometry{max_chunks, slot_size - uint32_t(gpuprims::wire::kHeaderSize), row_src_bytes, expect_dtype};
  p.out = out;
  p.row_stride = row_stride;
  p.status = status.data();
  p.mode = mode;
  p.channels = channels;
  for (uint32_t i = 0; i < d::kMaxChannels; ++i) {
    p.a[i] = a[i];
    p.b[i] = b[i];
    p.d[i] = dv[i];
  }
  std::memcpy(p.records, records, n * sizeof(uint32_t));
  gpshim::set_last_error(static_cast<cudaError_t>(stale_error));
  const cudaError_t err = d::launch_gather(p, blocks_per_row, result, nullptr);
  gpshim::set_last_error(cudaSuccess);
  if (err != cudaSuccess) return int(err);
  for (int32_t s : status)
    if (s != 0) return -1;
  return 0;
}

int gp_shim_kernel_info(int* regs) {
  d::KernelInfo info{};
  const cudaError_t err = d::kernel_info(&info);
  *regs = info.gather_regs;
  return int(err);
}
}
