// Host-side entry points of the CUDA kernels in native/cuda/*.cu. Included only where
// GPUPRIMS_HAVE_CUDA is defined (the .cu files and cuda_bind.cpp).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "gpuprims/cuda_dma.h"

namespace gpuprims::dma {

// Everything one GPU-DMA launch needs, passed to the kernel by value (about 2.2 KiB of kernel
// parameters, under the 4 KiB every architecture accepts), so a launch copies nothing first.
struct LaunchParams {
  const uint8_t* pool;  // device-accessible address of the mapped pinned pool (cudaHostGetDevicePointer)
  uint64_t slots_offset;
  uint64_t records_offset;
  uint64_t chunkmap_offset;
  uint32_t slot_size;
  uint32_t slot_count;
  uint32_t record_count;
  uint32_t n;           // rows in this launch, <= kMaxBatch
  Geometry geo;
  uint8_t* out;         // device batch buffer, row i at out + i * row_stride
  uint64_t row_stride;  // bytes between rows of out
  int32_t* status;      // device array of kMaxBatch row verdicts, zero on entry (left zero on exit)
  uint32_t mode;        // kModeCopy / kModeU8ToF32
  uint32_t channels;    // 1..kMaxChannels, for kModeU8ToF32
  float a[kMaxChannels];  // kModeU8ToF32: y = (x * a[ch] + b[ch]) / d[ch], three roundings
  float b[kMaxChannels];
  float d[kMaxChannels];
  uint32_t records[kMaxBatch];
};

// Launches the gather kernel and the finalize kernel on `stream`. The finalize kernel writes
// result[0] = rows placed with status kOk and result[1 + i] = status of row i, through `result`, a
// device pointer to mapped pinned host memory (so the host reads it once the stream passes it).
// Returns the launch status (cudaGetLastError) without synchronising.
cudaError_t launch_gather(const LaunchParams& p, uint32_t blocks_per_row, int32_t* result, cudaStream_t stream);

// What the driver loaded for the current device (cudaFuncGetAttributes on both kernels). Fails with
// cudaErrorNoKernelImageForDevice / cudaErrorInvalidDeviceFunction when the build has no image the
// device can run, and cudaErrorUnsupportedPtxVersion when only PTX newer than the driver is there.
struct KernelInfo {
  int gather_regs;
  int gather_local_bytes;
  int gather_ptx_version;
  int gather_binary_version;
  int finalize_regs;
};
cudaError_t kernel_info(KernelInfo* out);

}  // namespace gpuprims::dma
