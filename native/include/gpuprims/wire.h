// Wire format v1: the one definition of the datagram header layout used by the native code.
// gpuprims/wire.py mirrors it for tools and tests; tests/gpuprims/test_wire.py checks the two
// against each other through _native.wire_layout(). docs/wire-format.md is the byte-level table.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace gpuprims::wire {

constexpr uint32_t kMagic = 0x4D525047u;  // bytes "GPRM" on the wire (little-endian u32)
constexpr uint8_t kVersion = 1;
constexpr uint8_t kKindRequest = 0;
constexpr uint8_t kKindResponse = 1;

// All multi-byte fields are little-endian (the byte order of every host and GPU we target), so the
// GPU-DMA kernel reads them without swapping.
struct Header {
  uint32_t magic;         //  0
  uint8_t version;        //  4
  uint8_t kind;           //  5 kKindRequest / kKindResponse
  uint16_t status;        //  6 response status (Status); 0 in requests
  uint16_t app_id;        //  8
  uint8_t dtype;          // 10 element type of the body (DType)
  uint8_t flags;          // 11 request hints (kFlag*); 0 in responses
  uint32_t chunk_index;   // 12
  uint32_t chunk_count;   // 16
  uint32_t payload_len;   // 20 bytes of body in this datagram
  uint64_t request_id;    // 24 chosen by the client, unique per client and app
  uint32_t total_len;     // 32 bytes of the whole body
  uint32_t deadline_us;   // 36 budget from the first chunk's arrival; 0 = the app's SLO
  uint64_t client_ts_ns;  // 40 client clock, echoed in the response
};
static_assert(sizeof(Header) == 48, "wire header must be 48 bytes");
static_assert(offsetof(Header, request_id) == 24 && offsetof(Header, client_ts_ns) == 40, "layout");

constexpr size_t kHeaderSize = sizeof(Header);

// Request flags (Header::flags). kFlagMore: another request of the same query follows from this
// client (every request of a query but its last carries it), so the instance's batcher may hold this
// one for it (gpuprims.batching, MultiStream). A hint only: no check rejects a request for its flags,
// and bits not named here are ignored.
constexpr uint8_t kFlagMore = 1;
constexpr uint8_t kFlagsKnown = kFlagMore;

// kDTypeTensors: the body is a multi-tensor body (named tensors of any datatype, laid out as
// docs/wire-format.md "Multi-tensor bodies" says; gpuprims/tensorwire.py encodes and decodes it). The
// native code moves it as opaque bytes: only its size and this code matter here.
enum DType : uint8_t {
  kDTypeBytes = 0,
  kDTypeFloat32 = 1,
  kDTypeUint8 = 2,
  kDTypeFloat16 = 3,
  kDTypeInt64 = 4,
  kDTypeTensors = 5,
};
constexpr uint8_t kDTypeMax = kDTypeTensors;

enum Status : uint16_t {
  kStatusOk = 0,
  kStatusDeadlineMissed = 1,  // could not be served within its deadline; answered without result
  kStatusOverloaded = 2,      // dropped at admission (queue or pool full)
  kStatusInstanceFailed = 3,  // the instance holding it crashed
  kStatusBadRequest = 4,      // body does not fit the app's input (size, dtype)
  kStatusUnknownApp = 5,
  kStatusInternal = 6,
  kStatusShuttingDown = 7,
};

// Verdict of the stateless header check; the Python decoder returns the same codes.
enum Verdict : int {
  kOk = 0,
  kTruncated = 1,       // shorter than a header
  kBadMagic = 2,
  kBadVersion = 3,
  kBadKind = 4,         // not a request (or an unknown kind)
  kBadLength = 5,       // payload_len disagrees with the datagram's size
  kBadChunk = 6,        // chunk_count == 0 or chunk_index >= chunk_count
  kBadTotal = 7,        // total_len inconsistent with chunk_count and payload_len
  kBadDType = 8,
  kVerdictCount = 9,
};

inline const char* verdict_name(int v) {
  static const char* names[] = {"ok",        "truncated", "bad_magic", "bad_version", "bad_kind",
                                "bad_length", "bad_chunk", "bad_total", "bad_dtype"};
  return (v >= 0 && v < kVerdictCount) ? names[v] : "unknown";
}

// Chunk payload size P implied by one chunk: every chunk but the last carries P bytes, the last
// carries total_len - (chunk_count - 1) * P, with 0 < last <= P. Returns 0 if inconsistent.
inline uint32_t chunk_stride(const Header& h) {
  if (h.payload_len == 0 || h.total_len == 0 || h.payload_len > h.total_len) return 0;
  if (h.chunk_count == 1) return h.payload_len == h.total_len ? h.payload_len : 0;
  if (h.chunk_index + 1 < h.chunk_count) {
    const uint64_t p = h.payload_len;
    const uint64_t need = (static_cast<uint64_t>(h.total_len) + p - 1) / p;
    return need == h.chunk_count ? h.payload_len : 0;
  }
  const uint64_t rest = static_cast<uint64_t>(h.total_len) - h.payload_len;
  if (rest % (h.chunk_count - 1) != 0) return 0;
  const uint64_t p = rest / (h.chunk_count - 1);
  if (p < h.payload_len || p > 0xFFFFFFFFull) return 0;
  return static_cast<uint32_t>(p);
}

// Stateless check of one request datagram of `len` bytes. On kOk, *out holds the header.
inline int check_request(const void* data, size_t len, Header* out) {
  if (len < kHeaderSize) return kTruncated;
  Header h;
  std::memcpy(&h, data, kHeaderSize);
  if (h.magic != kMagic) return kBadMagic;
  if (h.version != kVersion) return kBadVersion;
  if (h.kind != kKindRequest) return kBadKind;
  if (h.payload_len != len - kHeaderSize) return kBadLength;
  if (h.chunk_count == 0 || h.chunk_index >= h.chunk_count) return kBadChunk;
  if (h.dtype > kDTypeMax) return kBadDType;
  if (chunk_stride(h) == 0) return kBadTotal;
  if (out) *out = h;
  return kOk;
}

}  // namespace gpuprims::wire
