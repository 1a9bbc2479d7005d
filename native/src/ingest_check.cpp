// Ingest::check_invariants: the accounting of slots, records and requests, checked from outside the
// receive loop (tests and the fuzz harness, native/fuzz/). In a file of its own so the fuzz build
// leaves it out of the coverage it measures.
#include <string>
#include <vector>

#include "ingest.h"

namespace gpuprims {

std::string Ingest::check_invariants() const {
  if (running_.load()) return "check_invariants while the receive thread runs";
  const pool::PoolHeader* hdr = v_.hdr;
  const uint64_t nslots = hdr->slot_count, nrec = hdr->record_count;
  if (free_count_ != free_slots_.size())
    return ("free_count " + std::to_string(free_count_) + " != free slot stack " + std::to_string(free_slots_.size()));
  // Every slot is free exactly once, or holds a received chunk of exactly one filling/delivered record.
  std::vector<uint8_t> seen(nslots, 0);
  for (uint32_t s : free_slots_) {
    if (s >= nslots || seen[s]++) return ("free slot " + std::to_string(s) + " out of range or listed twice");
  }
  uint64_t reserved = 0, filling = 0, free_recs = 0;
  std::vector<uint8_t> rec_free(nrec, 0);
  for (uint32_t r : free_records_) {
    if (r >= nrec || rec_free[r]++) return ("free record " + std::to_string(r) + " out of range or listed twice");
  }
  for (uint32_t r = 0; r < nrec; ++r) {
    const pool::Record* rec = v_.record(r);
    const uint32_t st = rec->state.load(std::memory_order_relaxed);
    auto who = [r] { return "record " + std::to_string(r); };
    if (st == pool::kRecFree) {
      if (!rec_free[r]) return (who() + " is free but not on the free list");
      if (filling_pos_[r] >= 0) return (who() + " is free but on the filling list");
      ++free_recs;
      continue;
    }
    if (rec_free[r]) return (who() + " is on the free list in state " + std::to_string(st));
    if (rec->chunk_count == 0 || rec->chunk_count > hdr->max_chunks) return (who() + " has a bad chunk_count");
    const uint32_t* map = v_.chunkmap(r);
    if (st == pool::kRecFilling) {
      ++filling;
      const int32_t pos = filling_pos_[r];
      if (pos < 0 || size_t(pos) >= filling_list_.size() || filling_list_[size_t(pos)] != r)
        return (who() + " is filling but not on the filling list");
      auto it = active_.find(rec_key_[r]);
      if (it == active_.end() || it->second != r) return (who() + " is filling but not active under its key");
      if (rec->chunks_received >= rec->chunk_count) return (who() + " is filling with every chunk received");
      reserved += rec->chunk_count - rec->chunks_received;
      const uint64_t* bm = &bitmaps_[size_t(r) * bitmap_words_];
      uint32_t got = 0;
      for (uint32_t c = 0; c < rec->chunk_count; ++c) {
        if (!(bm[c >> 6] & (1ull << (c & 63)))) continue;
        ++got;
        if (map[c] >= nslots || seen[map[c]]++) return (who() + " chunk " + std::to_string(c) + " shares a slot");
      }
      if (got != rec->chunks_received) return (who() + " bitmap disagrees with chunks_received");
    } else if (st == pool::kRecDelivered) {
      if (filling_pos_[r] >= 0) return (who() + " is delivered but on the filling list");
      if (rec->chunks_received != rec->chunk_count) return (who() + " is delivered incomplete");
      if (rec->owner >= hdr->consumer_count) return (who() + " is delivered to no consumer");
      for (uint32_t c = 0; c < rec->chunk_count; ++c) {
        if (map[c] >= nslots || seen[map[c]]++) return (who() + " chunk " + std::to_string(c) + " shares a slot");
      }
    } else {
      return (who() + " in unknown state " + std::to_string(st));
    }
  }
  for (uint64_t s = 0; s < nslots; ++s) {
    if (!seen[s]) return ("slot " + std::to_string(s) + " is neither free nor held (leaked)");
  }
  if (free_recs != free_records_.size()) return ("free records disagree with the free list");
  if (filling != filling_list_.size()) return ("filling records disagree with the filling list");
  if (active_.size() != filling_list_.size()) return ("active keys disagree with the filling list");
  if (reserved != reserved_) return ("reserved " + std::to_string(reserved_) + " != unreceived chunks " +
                                         std::to_string(reserved));
  if (reserved_ > free_count_) return ("more slots reserved than free");
  // Every delivered request ends once: released, answered through its consumer's ring, or failed at a
  // reclaim (a requeued one stays delivered), or it is still delivered.
  uint64_t delivered_now = 0;
  for (uint32_t r = 0; r < nrec; ++r)
    if (v_.record(r)->state.load(std::memory_order_relaxed) == pool::kRecDelivered) ++delivered_now;
  const uint64_t ended = cnt_[kRequestsReleased].load() + cnt_[kRequestsAnswered].load() +
                         cnt_[kRequestsReclaimedFailed].load();
  if (cnt_[kRequestsDelivered].load() != ended + delivered_now)
    return ("delivered " + std::to_string(cnt_[kRequestsDelivered].load()) + " != ended " + std::to_string(ended) +
            " + still delivered " + std::to_string(delivered_now));
  size_t held_bytes = 0;
  for (const Held& h : held_) held_bytes += h.bytes.size();
  if (held_bytes != held_bytes_ || held_pub_.load() != held_.size()) return ("held answer book-keeping broken");
  // Every received datagram is accepted or dropped for exactly one reason.
  uint64_t drops = 0;
  for (int c = kDropTruncated; c <= kDropNoRecord; ++c) drops += cnt_[c].load(std::memory_order_relaxed);
  if (cnt_[kPacketsReceived].load() != cnt_[kPacketsAccepted].load() + drops) return ("packet balance broken");
  return "";
}

}  // namespace gpuprims
