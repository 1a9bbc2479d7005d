// Internal C++ API of the packet pool, ingest and responder (not part of the Python surface).
#pragma once
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpuprims/pool.h"
#include "gpuprims/wire.h"

namespace gpuprims {

inline uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

inline long futex_wait(std::atomic<uint32_t>* addr, uint32_t expected, const timespec* rel) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, expected, rel, nullptr, 0);
}
inline long futex_wake_all(std::atomic<uint32_t>* addr) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, 0x7fffffff, nullptr, nullptr, 0);
}

struct PoolParams {
  uint32_t slot_count = 65536;
  uint32_t max_payload = 1024;
  uint32_t record_count = 1024;
  uint32_t max_chunks = 1024;
  uint32_t consumer_count = 8;
  uint32_t answer_ring_bytes = 1u << 20;  // per consumer, a power of two
};

// One process's mapping of a pool. The creator initialises it and unlinks the name on close.
class Pool {
 public:
  static Pool* create(const std::string& name, const PoolParams& p);
  static Pool* attach(const std::string& name);
  ~Pool();
  void close();
  bool closed() const { return view_.base == nullptr; }

  const pool::View& view() const { check_open(); return view_; }
  const std::string& name() const { return name_; }
  bool owner() const { return owner_; }
  size_t nbytes() const { return size_; }

  // Consumer side (any process): pop up to max_n record indices, waiting up to timeout_us.
  size_t poll(uint32_t consumer, uint32_t* out, size_t max_n, int64_t timeout_us, int64_t spin_us);
  // Consumer side: hand records back so their slots are recycled. Returns how many were queued.
  size_t release(uint32_t consumer, const uint32_t* recs, size_t n);
  // Consumer side: answer requests. For each record, publish its status (and for OK its result row
  // of row_bytes, of wire dtype `dtype`) to the consumer's answer ring; the ingest sends the
  // response and frees the record. gens are the records' generations when they were polled (from
  // a copy of the record), so an answer to a record that was taken back is refused by the ingest.
  // Waits up to timeout_us for room; returns how many were published (< n only on timeout or
  // shutdown). Throws std::length_error if one answer can never fit the ring.
  size_t answer(uint32_t consumer, const uint32_t* recs, const uint32_t* gens, size_t n, const uint16_t* statuses,
                const uint8_t* body, size_t row_bytes, uint8_t dtype, int64_t timeout_us);
  // Largest result row one answer may carry.
  size_t max_answer_bytes() const;
  size_t queue_depth(uint32_t consumer) const;
  // Observer side (any process, read-only): copy the deliver ring's entries from position
  // max(from, head) up to tail, at most max_n, without consuming them. Positions are absolute (they
  // only grow), so a caller can ask for just what arrived since its last look. Sets *head and *tail.
  size_t peek(uint32_t consumer, uint64_t from, uint32_t* out, size_t max_n, uint64_t* head, uint64_t* tail) const;
  // Copy each record's payload into row i of out (row_bytes apart). Returns "" or an error message.
  std::string gather(const uint32_t* recs, size_t n, uint8_t* out, size_t row_bytes) const;

  void check_consumer(uint32_t c) const;
  void check_open() const {
    if (!view_.base) throw std::runtime_error("packet pool is closed");
  }

 private:
  Pool() = default;
  std::string name_;
  bool owner_ = false;
  size_t size_ = 0;
  pool::View view_;
  int wake_fd_ = -1;  // this process's socket for waking a sleeping ingest (answers)
  void wake_ingest();
};

// Ring helpers shared by the ingest (producer of deliver, consumer of release) and consumers.
inline bool ring_push(pool::Ring& r, uint32_t* entries, uint32_t v) {
  const uint64_t tail = r.tail.load(std::memory_order_relaxed);
  const uint64_t head = r.head.load(std::memory_order_acquire);
  if (tail - head >= r.capacity) return false;
  entries[tail & r.mask] = v;
  r.tail.store(tail + 1, std::memory_order_release);
  return true;
}

inline size_t ring_pop(pool::Ring& r, const uint32_t* entries, uint32_t* out, size_t max_n) {
  const uint64_t head = r.head.load(std::memory_order_relaxed);
  const uint64_t tail = r.tail.load(std::memory_order_acquire);
  size_t n = size_t(tail - head);
  if (n > max_n) n = max_n;
  for (size_t i = 0; i < n; ++i) out[i] = entries[(head + i) & r.mask];
  r.head.store(head + n, std::memory_order_release);
  return n;
}

inline void ring_signal(pool::Ring& r) {
  // Sequentially consistent on purpose: the push above, this bump and the sleepers check pair with
  // the consumer's sleepers increment and ring re-check (a store-load handshake).
  r.seq.fetch_add(1);
  if (r.sleepers.load() > 0) futex_wake_all(&r.seq);
}

}  // namespace gpuprims
