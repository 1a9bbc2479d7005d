// The instance's local queue and per-batch bookkeeping, in native code (issue 26, item 3).
//
// A serving loop takes complete requests off its consumer's deliver ring into a local queue, answers
// those that can no longer meet their deadline, takes a batch off the head (answering bodies that are
// not the app's input BAD_REQUEST), and answers the batch with its results. Each of those steps is one
// call here, over copies of the records taken when they were polled, so the Python loop pays one call
// per step instead of a numpy operation per field.
//
// Exactly once: a request stays delivered to the consumer (the ingest's reclaim answers it if this
// process dies) until an answer naming its record and generation is published; every path that removes
// an entry from the queue either publishes its answer or hands it to the caller as the current batch.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "pool_impl.h"

namespace gpuprims {

// A plain copy of a pool::Record (the same 128 bytes, without the atomic).
struct RecordCopy {
  uint32_t state;
  uint32_t owner;
  uint16_t app_id;
  uint8_t dtype;
  uint8_t addr_len;
  uint32_t chunk_count;
  uint32_t chunks_received;
  uint32_t stride;
  uint32_t total_len;
  uint32_t deadline_us;
  uint32_t generation;
  uint64_t request_id;
  uint64_t client_ts_ns;
  uint64_t first_ns;
  uint64_t complete_ns;
  uint8_t addr[28];
  uint8_t flags;
  uint8_t reserved0[3];
  uint8_t pad[128 - 108];
};
static_assert(sizeof(RecordCopy) == sizeof(pool::Record), "RecordCopy mirrors pool::Record");
static_assert(offsetof(RecordCopy, generation) == offsetof(pool::Record, generation), "layout");
static_assert(offsetof(RecordCopy, first_ns) == offsetof(pool::Record, first_ns), "layout");
static_assert(offsetof(RecordCopy, complete_ns) == offsetof(pool::Record, complete_ns), "layout");
static_assert(offsetof(RecordCopy, deadline_us) == offsetof(pool::Record, deadline_us), "layout");
static_assert(offsetof(RecordCopy, addr) == offsetof(pool::Record, addr), "layout");
static_assert(offsetof(RecordCopy, flags) == offsetof(pool::Record, flags), "layout");

// Per-batch statistics of an answered batch, for the caller's counters and histograms.
struct Answered {
  size_t within = 0;      // answered within their deadline
  uint64_t done_ns = 0;   // CLOCK_MONOTONIC when the answers were published
  uint64_t oldest_first_ns = 0;     // the batch's oldest request: first datagram in
  uint64_t oldest_complete_ns = 0;  // and last datagram in (reassembled)
};

// Duration histograms (seconds) an answered batch adds to: counts per bucket of `bounds` (+Inf last, so
// bounds_n + 1 counts each), as gpuprims.stats.DurationHistogram.add counts (a bucket is the first bound
// >= the value; negative values count as 0). The sums are added to the *_sum fields.
struct Histograms {
  const double* bounds = nullptr;
  size_t bounds_n = 0;
  int64_t* request = nullptr;  // arrival to answer
  int64_t* queue = nullptr;    // arrival to the start of the compute (the latency less compute_s)
  int64_t* compute = nullptr;  // compute_s, once per request
  double compute_s = 0.0;
  double request_sum = 0.0, queue_sum = 0.0, compute_sum = 0.0;
};

class Ledger {
 public:
  // The local queue of `consumer` of `pool`; holds at most the pool's record count.
  Ledger(Pool* pool, uint32_t consumer);

  size_t size() const { return count_; }
  // Poll the deliver ring (waiting up to timeout_us after a spin_us spin) and queue copies of up to
  // max_n records; `arrivals_ms` gets each one's completion time (ms, CLOCK_MONOTONIC). Returns how many.
  size_t pull(size_t max_n, int64_t timeout_us, int64_t spin_us, std::vector<double>* arrivals_ms);
  // first_ns of queued request i (0 = the oldest).
  uint64_t first_ns(size_t i) const { return at(i).rec.first_ns; }
  void set_first_ns(size_t i, uint64_t ns) { at(i).rec.first_ns = ns; }
  // The wire flags of queued request i (wire::kFlagMore: more of its query follow).
  uint8_t flags(size_t i) const { return at(i).rec.flags; }
  // Deadline of queued request i in ms after its arrival (its own, else default_ms).
  double deadline_ms(size_t i, double default_ms) const;
  // Answer DEADLINE_MISSED, oldest first, the queued requests past their deadline at now_ns, or whose
  // age plus need_ms exceeds it (need_ms < 0: only those past it). Stops at the first that can make it.
  size_t expire(uint64_t now_ns, double default_ms, double need_ms, int64_t timeout_us);
  // Answer the oldest k queued requests with `status`.
  size_t fail_head(size_t k, uint16_t status, int64_t timeout_us);
  // row_bytes for take: bodies of any length (a multi-tensor body, whose size varies per request).
  static constexpr uint32_t kAnySize = UINT32_MAX;
  // Move the oldest k queued requests into the current batch; those whose body is not row_bytes long
  // (unless row_bytes is kAnySize) or whose wire dtype `dtype_ok` refuses are answered BAD_REQUEST
  // instead. Returns the batch's size. With `rows` (row_bytes apart, room for k), the batch's payloads
  // are copied there too (the CPU gather, Pool::gather); a record the pool refuses then is answered
  // BAD_REQUEST like a bad body. Throws std::invalid_argument for rows with kAnySize (no row size).
  size_t take(size_t k, uint32_t row_bytes, const uint8_t* dtype_ok, int64_t timeout_us, uint8_t* rows = nullptr);
  const uint32_t* batch_recs() const { return batch_recs_.data(); }
  const RecordCopy* batch_records() const { return batch_.data(); }
  size_t batch_size() const { return batch_n_; }
  // Answer the current batch OK with one result row each (row_bytes apart in body), then empty it.
  // lat_ms (batch_size entries) gets each request's latency in ms. Throws std::length_error if a row can
  // never fit the answer ring (nothing published then), std::runtime_error if the ingest took nothing.
  // With `hist`, each answered request is counted there too.
  Answered answer_batch(const uint8_t* body, size_t row_bytes, uint8_t dtype, double default_ms,
                        int64_t timeout_us, double* lat_ms, Histograms* hist = nullptr);
  // Forget the current batch (its requests were answered another way).
  void clear_batch() { batch_n_ = 0; }

 private:
  struct Slot {
    RecordCopy rec;
    uint32_t index;
  };
  Slot& at(size_t i);
  const Slot& at(size_t i) const;
  // Publish `statuses` for `n` records; throws std::runtime_error if not all were taken in time.
  void publish(const uint32_t* recs, const uint32_t* gens, size_t n, const uint16_t* statuses,
               const uint8_t* body, size_t row_bytes, uint8_t dtype, int64_t timeout_us);
  size_t pop_answer(size_t k, uint16_t status, int64_t timeout_us);

  Pool* pool_;
  uint32_t consumer_;
  std::vector<Slot> ring_;
  size_t head_ = 0, count_ = 0;
  std::vector<uint32_t> polled_;
  std::vector<uint32_t> batch_recs_;
  std::vector<RecordCopy> batch_;
  size_t batch_n_ = 0;
  std::vector<uint32_t> tmp_recs_, tmp_gens_;
  std::vector<uint16_t> tmp_status_;
};

}  // namespace gpuprims
