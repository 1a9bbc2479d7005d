// GPU-DMA (paper V-B): GPU threads read packet headers and payloads straight from the packet pool,
// which the host registered as mapped pinned memory (cudaHostRegister), and write each payload to its
// place in a contiguous device batch buffer. The CPU only launches: it copies no payload and no list
// of packets (the record indices travel in the kernel parameters; the chunk map is read by the GPU).
//
// Work split: blockIdx.y is the batch row; the blocks of a row share its chunks, one warp per chunk.
// A warp loads the 48-byte header (same address in every lane: one transaction), checks it against the
// record, then copies the payload with 16-byte loads, 512 contiguous bytes per warp instruction.
// Loads from the pool use ld.global.cv (__ldcv): the slots are rewritten by the host between batches,
// so no cached line of them may be trusted.
#include <cuda_runtime.h>

#include <cstdint>

#include "gpuprims/cuda_dma.h"
#include "gpuprims/cuda_kernels.h"

namespace gpuprims::dma {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ uint32_t ld_u32(const uint8_t* p) {
  return __ldcv(reinterpret_cast<const unsigned int*>(p));
}

__device__ __forceinline__ uint64_t ld_u64(const uint8_t* p) {
  return __ldcv(reinterpret_cast<const unsigned long long*>(p));
}

// ch is the element's channel (0..channels-1). Three roundings, no fused multiply-add, so the CPU
// reference computes the same bits: (x * a + b) / d. d is 1 for an affine normalisation (exact) and
// 255 for the apps' x / 255 (what torch's div computes on the host).
__device__ __forceinline__ float convert(uint32_t byte, uint32_t ch, const LaunchParams& p) {
  return __fdiv_rn(__fadd_rn(__fmul_rn(float(byte), p.a[ch]), p.b[ch]), p.d[ch]);
}

// Word i of a 16-byte load, selected without indexing an array: a dynamically indexed local array
// lives in local memory (stack), which ptxas reports as spills on sm_100.
__device__ __forceinline__ uint32_t word_of(const uint4& v, uint32_t i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint32_t byte_of(const uint4& v, uint32_t k) {  // k in 0..15
  return (word_of(v, k / 4) >> (8 * (k % 4))) & 0xFFu;
}

__device__ __forceinline__ uint32_t next_channel(uint32_t ch, uint32_t k, uint32_t channels) {
  // 32-bit only: ch < channels <= 4 and k <= 16, so the sum never wraps.
  return (ch + k) % channels;
}

// Host (pool) memory is only ever read with 16-byte loads: the payload starts 48 bytes into a slot
// and slots are 16-byte aligned with a 16-byte multiple of room, so the load that covers the tail
// stays inside the slot. Stores go to device memory and follow the destination's alignment.
__device__ void copy_bytes(const uint8_t* src, uint8_t* dst, uint32_t len, int lane) {
  const uint4* s4 = reinterpret_cast<const uint4*>(src);
  const uint32_t vecs = (len + 15) / 16;
  if ((reinterpret_cast<uintptr_t>(dst) & 15u) == 0) {
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    const uint32_t full = len / 16;
    for (uint32_t i = lane; i < full; i += 32) d4[i] = __ldcv(s4 + i);
    if (full < vecs && lane == 0) {
      const uint4 v = __ldcv(s4 + full);
      for (uint32_t j = full * 16; j < len; ++j) dst[j] = uint8_t(byte_of(v, j % 16));
    }
  } else {
    for (uint32_t i = lane; i < vecs; i += 32) {
      const uint4 v = __ldcv(s4 + i);
      const uint32_t base = i * 16, end = min(len, base + 16u);
      for (uint32_t j = base; j < end; ++j) dst[j] = uint8_t(byte_of(v, j - base));
    }
  }
}

// uint8 payload -> float32 row elements; ch0 is the channel of the payload's first element.
__device__ void convert_bytes(const uint8_t* src, float* dst, uint32_t ch0, uint32_t len, int lane,
                              const LaunchParams& p) {
  const uint4* s4 = reinterpret_cast<const uint4*>(src);
  const uint32_t vecs = (len + 15) / 16;
  const bool dst16 = (reinterpret_cast<uintptr_t>(dst) & 15u) == 0;
  for (uint32_t i = lane; i < vecs; i += 32) {
    const uint4 v = __ldcv(s4 + i);
    const uint32_t base = i * 16;
    // 16 * i % channels without a 64-bit (or any per-element) division: 16 % 3 == 1, else 0.
    const uint32_t ch = next_channel(ch0, (p.channels == 3 ? i % 3 : 0), p.channels);
    if (dst16 && base + 16 <= len) {
      float4* d4 = reinterpret_cast<float4*>(dst + base);
#pragma unroll
      for (uint32_t k = 0; k < 4; ++k) {
        const uint32_t w = word_of(v, k);
        const uint32_t c = next_channel(ch, 4 * k, p.channels);
        d4[k] = make_float4(convert(w & 0xFFu, c, p), convert((w >> 8) & 0xFFu, next_channel(c, 1, p.channels), p),
                            convert((w >> 16) & 0xFFu, next_channel(c, 2, p.channels), p),
                            convert(w >> 24, next_channel(c, 3, p.channels), p));
      }
    } else {
      const uint32_t end = min(len, base + 16u);
      for (uint32_t j = base; j < end; ++j) {
        const uint32_t k = j - base;
        dst[j] = convert(byte_of(v, k), next_channel(ch, k, p.channels), p);
      }
    }
  }
}

// minBlocksPerMultiprocessor 2 gives ptxas an explicit register budget (up to 128 per thread); with
// the thread count alone, ptxas 13 settles on 48 registers for sm_80 and later and spills.
// scripts/check_cuda_archs.py holds the result (no spills, no stack) for every architecture.
__global__ void __launch_bounds__(kThreads, 2) gather_kernel(const __grid_constant__ LaunchParams p) {
  __shared__ RecordView rec;
  __shared__ int32_t rec_verdict;
  const uint32_t row = blockIdx.y;
  const uint32_t r = p.records[row];
  if (threadIdx.x == 0) {
    int32_t v = kBadRecord;
    if (r < p.record_count) {
      const uint8_t* rp = p.pool + p.records_offset + uint64_t(r) * kRecordSize;
      rec.state = ld_u32(rp + kRecState);
      rec.app_id = ld_u32(rp + kRecAppId) & 0xFFFFu;
      rec.dtype = (ld_u32(rp + kRecAppId) >> 16) & 0xFFu;  // app_id(2) dtype(1) addr_len(1) share a word
      rec.chunk_count = ld_u32(rp + kRecChunkCount);
      rec.stride = ld_u32(rp + kRecStride);
      rec.total_len = ld_u32(rp + kRecTotalLen);
      rec.request_id = ld_u64(rp + kRecRequestId);
      v = record_verdict(rec, p.geo);
    }
    rec_verdict = v;
    if (v != kOk && blockIdx.x == 0) atomicMax(p.status + row, v);
  }
  __syncthreads();
  if (rec_verdict != kOk) return;

  const int lane = threadIdx.x & 31;
  const uint32_t warp = threadIdx.x >> 5;
  const uint32_t* chunkmap =
      reinterpret_cast<const uint32_t*>(p.pool + p.chunkmap_offset) + uint64_t(r) * p.geo.max_chunks;
  uint8_t* row_out = p.out + uint64_t(row) * p.row_stride;
  int32_t worst = kOk;
  for (uint32_t c = blockIdx.x * kWarps + warp; c < rec.chunk_count; c += gridDim.x * kWarps) {
    const uint32_t slot = __ldcv(chunkmap + c);
    if (slot >= p.slot_count) {
      worst = max(worst, int32_t(kBadSlot));
      continue;
    }
    const uint8_t* s = p.pool + p.slots_offset + uint64_t(slot) * p.slot_size;
    uint32_t w[12];
    const uint4* h4 = reinterpret_cast<const uint4*>(s);  // slots are 64-byte aligned
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const uint4 v = __ldcv(h4 + k);
      w[4 * k] = v.x;
      w[4 * k + 1] = v.y;
      w[4 * k + 2] = v.z;
      w[4 * k + 3] = v.w;
    }
    const int32_t v = chunk_verdict(w, rec, c);
    if (v != kOk) {
      worst = max(worst, v);
      continue;
    }
    const uint32_t len = w[5];
    const uint64_t at = uint64_t(c) * rec.stride;
    const uint8_t* payload = s + wire::kHeaderSize;
    if (p.mode == kModeCopy) {
      copy_bytes(payload, row_out + at, len, lane);
    } else {
      // One 64-bit remainder per chunk (not per element) gives the channel of its first element.
      const uint32_t ch0 = p.channels == 1 ? 0u : uint32_t(at % p.channels);
      convert_bytes(payload, reinterpret_cast<float*>(row_out) + at, ch0, len, lane, p);
    }
  }
  // Every lane of a warp saw the same headers, so lane 0 speaks for it.
  if (lane == 0 && worst != kOk) atomicMax(p.status + row, worst);
}

// One block of kMaxBatch threads: publishes the verdicts to the host and re-zeroes them for the next
// launch (same stream, so it runs after gather_kernel has finished).
__global__ void __launch_bounds__(kMaxBatch) finalize_kernel(int32_t* status, uint32_t n, int32_t* result) {
  const uint32_t i = threadIdx.x;
  int32_t s = kOk;
  if (i < n) {
    s = status[i];
    status[i] = kOk;
    result[1 + i] = s;
  }
  const int placed = __syncthreads_count(i < n && s == kOk);
  if (i == 0) result[0] = placed;
  __threadfence_system();
}

}  // namespace

cudaError_t launch_gather(const LaunchParams& p, uint32_t blocks_per_row, int32_t* result, cudaStream_t stream) {
  if (p.n > kMaxBatch) return cudaErrorInvalidValue;
  // A launch reports its own failure only: an earlier call's non-sticky error still waiting in the
  // thread's last-error slot would otherwise be returned by the cudaGetLastError below as ours.
  // A sticky (context) error is returned again by every later call, so it is not hidden by this.
  (void)cudaGetLastError();
  // cudaLaunchKernelEx (CUDA 11.8+) with the typed variadic form: the same call on every toolkit,
  // and plain C++, so the host shim (tests/native/cuda_host_shim.h) compiles this file unchanged.
  cudaLaunchConfig_t cfg{};
  cfg.stream = stream;
  if (p.n > 0) {
    cfg.gridDim = dim3(blocks_per_row == 0 ? 1 : blocks_per_row, p.n, 1);
    cfg.blockDim = dim3(kThreads, 1, 1);
    const cudaError_t err = cudaLaunchKernelEx(&cfg, gather_kernel, p);
    if (err != cudaSuccess) return err;
  }
  cfg.gridDim = dim3(1, 1, 1);
  cfg.blockDim = dim3(kMaxBatch, 1, 1);
  const cudaError_t err = cudaLaunchKernelEx(&cfg, finalize_kernel, p.status, p.n, result);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

cudaError_t kernel_info(KernelInfo* out) {
  cudaFuncAttributes g{}, f{};
  cudaError_t err = cudaFuncGetAttributes(&g, gather_kernel);
  if (err != cudaSuccess) return err;
  err = cudaFuncGetAttributes(&f, finalize_kernel);
  if (err != cudaSuccess) return err;
  out->gather_regs = g.numRegs;
  out->gather_local_bytes = int(g.localSizeBytes);
  out->gather_ptx_version = g.ptxVersion;
  out->gather_binary_version = g.binaryVersion;
  out->finalize_regs = f.numRegs;
  return cudaSuccess;
}

}  // namespace gpuprims::dma
