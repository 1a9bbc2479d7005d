// Shared-memory packet pool: the layout every process that maps the pool agrees on.
//
// One POSIX shared-memory object, laid out as page-aligned regions:
//   [PoolHeader][slots][records][chunk map][consumer rings][answer rings]
// * slots: slot_count fixed-size slots; a slot holds one received datagram (wire header + payload),
//   written there directly by recvmmsg. The region is page-aligned so it can be registered with
//   cudaHostRegister and read by the GPU-DMA kernel through UVA.
// * records: one Record per request being reassembled or handed to a consumer.
// * chunk map: for record r, chunkmap[r * max_chunks + i] is the slot holding chunk i.
// * rings: per consumer, a deliver ring (ingest -> consumer, record indices of complete requests)
//   and a release ring (consumer -> ingest, records whose slots may be recycled). Both are
//   single-producer single-consumer; the ingest thread is the only one that allocates or frees.
// * answer rings: per consumer, a byte ring of answers (consumer -> ingest). A consumer answers a
//   request by writing an AnswerEntry (status, dtype, result bytes) and publishing it with one
//   store of the ring's tail; the ingest sends the response datagrams and frees the record. The
//   ingest is the only sender, so a record is answered exactly once: an answer published before its
//   consumer died is still sent (the reclaim drains the ring first), one not yet published is not,
//   and the record is requeued or answered INSTANCE_FAILED instead.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "gpuprims/wire.h"

namespace gpuprims::pool {

constexpr uint64_t kPoolMagic = 0x31304C4F4F505047ull;  // "GPPOOL01"
constexpr uint32_t kLayoutVersion = 2;
constexpr size_t kPage = 4096;
constexpr size_t kCacheLine = 64;

enum RecordState : uint32_t {
  kRecFree = 0,
  kRecFilling = 1,    // chunks arriving (ingest only)
  kRecDelivered = 2,  // complete, pushed to owner's deliver ring, owned by the consumer until released
};

struct alignas(64) Record {
  std::atomic<uint32_t> state;
  uint32_t owner;            // consumer index it was delivered to
  uint16_t app_id;
  uint8_t dtype;
  uint8_t addr_len;          // bytes of addr used (16 for IPv4, 28 for IPv6)
  uint32_t chunk_count;
  uint32_t chunks_received;
  uint32_t stride;           // payload bytes of every chunk but the last
  uint32_t total_len;
  uint32_t deadline_us;      // from the header; 0 = the app's SLO
  uint32_t generation;       // bumped each time the record is reused
  uint64_t request_id;
  uint64_t client_ts_ns;
  uint64_t first_ns;         // CLOCK_MONOTONIC ns of the first chunk's arrival
  uint64_t complete_ns;      // CLOCK_MONOTONIC ns when the last chunk arrived
  uint8_t addr[28];          // client's sockaddr_in / sockaddr_in6, for the response
  uint8_t flags;             // the request's wire flags (wire::kFlagsKnown bits of its first datagram)
  uint8_t reserved0[3];
};
static_assert(sizeof(Record) == 128, "Record is two cache lines");

// Single-producer single-consumer ring of uint32 record indices. head is written by the consumer,
// tail by the producer; seq is a futex word bumped on every push so a sleeping consumer wakes.
struct alignas(64) Ring {
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
  alignas(64) std::atomic<uint32_t> seq;
  std::atomic<uint32_t> sleepers;
  uint32_t capacity;  // power of two
  uint32_t mask;
};
static_assert(sizeof(Ring) == 192, "Ring layout");

// Control words of a consumer's answer ring: byte positions that only grow. tail is written by the
// consumer (publishing every entry before it), head by the ingest (bytes it has sent and freed).
struct alignas(64) AnswerCtl {
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
};
static_assert(sizeof(AnswerCtl) == 128, "AnswerCtl layout");

// One answer in an answer ring, followed by body_len result bytes and padding to entry_len. An
// entry never wraps: a filler entry (record == kAnswerFiller) takes the rest of the ring instead.
constexpr uint32_t kAnswerFiller = 0xFFFFFFFFu;
constexpr uint32_t kAnswerAlign = 32;  // so the space left before the end always fits a filler header
struct AnswerEntry {
  uint32_t record;
  uint32_t generation;  // the record's generation when it was delivered: stale answers are refused
  uint32_t entry_len;   // bytes of the whole entry, a multiple of kAnswerAlign
  uint32_t body_len;
  uint16_t status;
  uint8_t dtype;
  uint8_t pad0;
  uint32_t pad1;
};
static_assert(sizeof(AnswerEntry) == 24, "AnswerEntry layout");

struct alignas(64) ConsumerBlock {
  Ring deliver;
  Ring release;
  AnswerCtl answer;
  std::atomic<uint32_t> attached_pid;  // 0 when no process consumes from it
  std::atomic<uint32_t> epoch;         // bumped when the ingest resets the rings (reclaim)
  uint8_t pad[56];
};

struct alignas(4096) PoolHeader {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t header_size;
  uint32_t slot_count;
  uint32_t slot_size;        // stride between slots, multiple of 64
  uint32_t max_payload;      // largest payload a slot holds (slot_size - wire header)
  uint32_t record_count;
  uint32_t max_chunks;       // most chunks one request may have
  uint32_t consumer_count;
  uint32_t ring_capacity;
  uint32_t pad0;
  uint64_t slots_offset;
  uint64_t records_offset;
  uint64_t chunkmap_offset;
  uint64_t rings_offset;
  uint64_t total_size;
  std::atomic<uint32_t> ingest_pid;
  std::atomic<uint32_t> shutting_down;
  uint64_t answers_offset;   // consumer c's answer ring is answer_ring_bytes at answers_offset + c * that
  uint32_t answer_ring_bytes;  // power of two
  // Set by the ingest while it sleeps; a consumer that publishes an answer then wakes it with a
  // datagram to the abstract UNIX socket named wake_name (wake_len bytes, starting with a NUL).
  std::atomic<uint32_t> ingest_idle;
  uint32_t wake_len;
  char wake_name[108];
};

inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

struct Layout {
  size_t slots_offset, records_offset, chunkmap_offset, rings_offset, answers_offset, total_size;
};

inline Layout compute_layout(uint32_t slot_count, uint32_t slot_size, uint32_t record_count,
                             uint32_t max_chunks, uint32_t consumer_count, uint32_t ring_capacity,
                             uint32_t answer_ring_bytes) {
  Layout l{};
  l.slots_offset = align_up(sizeof(PoolHeader), kPage);
  l.records_offset = align_up(l.slots_offset + size_t(slot_count) * slot_size, kPage);
  l.chunkmap_offset = align_up(l.records_offset + size_t(record_count) * sizeof(Record), kPage);
  l.rings_offset =
      align_up(l.chunkmap_offset + size_t(record_count) * max_chunks * sizeof(uint32_t), kPage);
  const size_t ring_bytes = sizeof(ConsumerBlock) + 2 * size_t(ring_capacity) * sizeof(uint32_t);
  l.answers_offset = align_up(l.rings_offset + size_t(consumer_count) * align_up(ring_bytes, kCacheLine), kPage);
  l.total_size = align_up(l.answers_offset + size_t(consumer_count) * answer_ring_bytes, kPage);
  return l;
}

// Views over a mapped pool. base is the start of the mapping in this process.
struct View {
  uint8_t* base = nullptr;
  PoolHeader* hdr = nullptr;

  uint8_t* slot(uint32_t i) const { return base + hdr->slots_offset + size_t(i) * hdr->slot_size; }
  Record* record(uint32_t r) const {
    return reinterpret_cast<Record*>(base + hdr->records_offset) + r;
  }
  uint32_t* chunkmap(uint32_t r) const {
    return reinterpret_cast<uint32_t*>(base + hdr->chunkmap_offset) + size_t(r) * hdr->max_chunks;
  }
  size_t consumer_stride() const {
    return align_up(sizeof(ConsumerBlock) + 2 * size_t(hdr->ring_capacity) * sizeof(uint32_t), kCacheLine);
  }
  ConsumerBlock* consumer(uint32_t c) const {
    return reinterpret_cast<ConsumerBlock*>(base + hdr->rings_offset + size_t(c) * consumer_stride());
  }
  uint32_t* deliver_entries(uint32_t c) const {
    return reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(consumer(c)) + sizeof(ConsumerBlock));
  }
  uint32_t* release_entries(uint32_t c) const { return deliver_entries(c) + hdr->ring_capacity; }
  uint8_t* answer_data(uint32_t c) const {
    return base + hdr->answers_offset + size_t(c) * hdr->answer_ring_bytes;
  }
};

}  // namespace gpuprims::pool
