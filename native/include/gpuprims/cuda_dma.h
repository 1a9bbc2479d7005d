// GPU-DMA placement and validation rules, shared by the CUDA kernel (native/cuda/dma.cu) and its
// CPU reference (native/src/cuda_bind.cpp), so both give the same verdict for the same packets.
//
// A batch is a list of pool records (complete requests). Row i of the destination receives the
// payloads of record records[i]: chunk c lands at byte c * stride of the row. Every packet header
// is read from its slot and checked against the record before its payload is written; a row's
// status is the largest verdict seen for it (so the result does not depend on thread order).
// Compiles with and without nvcc: nothing here needs CUDA headers.
#pragma once
#include <cstdint>

#include "gpuprims/wire.h"

#if defined(__CUDACC__)
#define GP_HD __host__ __device__ __forceinline__
#else
#define GP_HD inline
#endif

namespace gpuprims::dma {

// Row status; larger is worse only in the sense that it wins the max. Mirrored by
// gpuprims.cuda.dma.DmaStatus.
enum Status : int32_t {
  kOk = 0,
  kBadRecord = 1,   // record index out of range or the record is not in the delivered state
  kBadShape = 2,    // total_len is not the row size, or chunk_count/stride are inconsistent
  kBadDType = 3,    // the record's dtype is not the one asked for
  kBadSlot = 4,     // the chunk map names a slot outside the pool
  kBadHeader = 5,   // a packet's magic, version or kind is wrong
  kMismatch = 6,    // a packet's app id, request id, chunk index/count, total or dtype disagree
  kBadLength = 7,   // a packet's payload_len is not the one its position implies
  kStatusCount = 8,
};

constexpr uint32_t kMaxBatch = 512;  // rows per launch (the record list travels in kernel params)
constexpr uint32_t kModeCopy = 0;    // bytes as they are
constexpr uint32_t kModeU8ToF32 = 1; // uint8 in, float32 out: x * a[ch] + b[ch], ch = element % channels
constexpr uint32_t kMaxChannels = 4;
constexpr int32_t kAnyDType = -1;

// Byte offsets of the Record fields the kernel reads (pool.h; checked by static_assert in
// cuda_bind.cpp, where pool.h's std::atomic members may be named).
constexpr uint32_t kRecState = 0;
constexpr uint32_t kRecAppId = 8;
constexpr uint32_t kRecDType = 10;
constexpr uint32_t kRecChunkCount = 12;
constexpr uint32_t kRecStride = 20;
constexpr uint32_t kRecTotalLen = 24;
constexpr uint32_t kRecRequestId = 40;
constexpr uint32_t kRecordSize = 128;
constexpr uint32_t kStateDelivered = 2;

struct RecordView {
  uint32_t state;
  uint32_t chunk_count;
  uint32_t stride;
  uint32_t total_len;
  uint64_t request_id;
  uint32_t app_id;
  uint32_t dtype;
};

// Geometry of one launch, the same on both sides.
struct Geometry {
  uint32_t max_chunks;     // pool's chunk map width
  uint32_t max_payload;    // slot_size - wire header: the most payload one slot holds
  uint64_t row_src_bytes;  // bytes of payload each request must carry (total_len)
  int32_t expect_dtype;    // wire dtype the records must have, or kAnyDType
};

GP_HD int32_t record_verdict(const RecordView& r, const Geometry& g) {
  if (r.state != kStateDelivered) return kBadRecord;
  if (r.chunk_count == 0 || r.chunk_count > g.max_chunks || r.stride == 0 || r.stride > g.max_payload)
    return kBadShape;
  if (uint64_t(r.total_len) != g.row_src_bytes) return kBadShape;
  // (n - 1) * stride < total_len <= n * stride: every chunk but the last is full.
  const uint64_t n = r.chunk_count, s = r.stride, t = r.total_len;
  if ((n - 1) * s >= t || t > n * s) return kBadShape;
  if (g.expect_dtype != kAnyDType && int32_t(r.dtype) != g.expect_dtype) return kBadDType;
  return kOk;
}

// Payload bytes chunk c of a record must carry.
GP_HD uint32_t expected_len(const RecordView& r, uint32_t c) {
  return c + 1 < r.chunk_count ? r.stride : r.total_len - (r.chunk_count - 1) * r.stride;
}

// Verdict of one packet header, given as the 12 little-endian 32-bit words of the 48-byte wire
// header (wire.h), read from slot chunkmap[record][c].
GP_HD int32_t chunk_verdict(const uint32_t w[12], const RecordView& r, uint32_t c) {
  const uint32_t magic = w[0];
  const uint32_t version = w[1] & 0xFFu, kind = (w[1] >> 8) & 0xFFu;
  if (magic != wire::kMagic || version != wire::kVersion || kind != wire::kKindRequest) return kBadHeader;
  const uint32_t app_id = w[2] & 0xFFFFu, dtype = (w[2] >> 16) & 0xFFu;
  const uint32_t chunk_index = w[3], chunk_count = w[4], payload_len = w[5];
  const uint64_t request_id = uint64_t(w[6]) | (uint64_t(w[7]) << 32);
  const uint32_t total_len = w[8];
  if (app_id != r.app_id || request_id != r.request_id || chunk_index != c || chunk_count != r.chunk_count ||
      total_len != r.total_len || dtype != r.dtype)
    return kMismatch;
  if (payload_len != expected_len(r, c)) return kBadLength;
  return kOk;
}

}  // namespace gpuprims::dma
