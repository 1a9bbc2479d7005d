// Packet pool: POSIX shared memory mapping, consumer rings, CPU gather.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <new>

#include "pool_impl.h"

namespace gpuprims {

namespace {

uint32_t next_pow2(uint32_t v) {
  uint32_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

std::string errno_msg(const std::string& what, const std::string& name) {
  return what + " '" + name + "': " + std::strerror(errno);
}

void init_ring(pool::Ring& r, uint32_t capacity) {
  r.head.store(0);
  r.tail.store(0);
  r.seq.store(0);
  r.sleepers.store(0);
  r.capacity = capacity;
  r.mask = capacity - 1;
}

}  // namespace

Pool* Pool::create(const std::string& name, const PoolParams& p) {
  if (name.empty() || name[0] != '/' || name.find('/', 1) != std::string::npos || name.size() > 250)
    throw std::invalid_argument("pool name must look like '/name' (one leading slash), got '" + name + "'");
  if (p.slot_count == 0 || p.slot_count > (1u << 26))
    throw std::invalid_argument("slot_count must be in 1..67108864, got " + std::to_string(p.slot_count));
  if (p.max_payload == 0 || p.max_payload > 65507 - wire::kHeaderSize)
    throw std::invalid_argument("max_payload must be in 1..65459, got " + std::to_string(p.max_payload));
  if (p.record_count == 0 || p.record_count > (1u << 20))
    throw std::invalid_argument("record_count must be in 1..1048576, got " + std::to_string(p.record_count));
  if (p.max_chunks == 0 || p.max_chunks > (1u << 20))
    throw std::invalid_argument("max_chunks must be in 1..1048576, got " + std::to_string(p.max_chunks));
  if (p.consumer_count == 0 || p.consumer_count > 1024)
    throw std::invalid_argument("consumer_count must be in 1..1024, got " + std::to_string(p.consumer_count));

  const uint32_t slot_size = uint32_t(pool::align_up(wire::kHeaderSize + p.max_payload, pool::kCacheLine));
  // The release ring must hold every record a consumer can own, so it never blocks a consumer.
  const uint32_t ring_capacity = next_pow2(p.record_count);
  const pool::Layout l =
      pool::compute_layout(p.slot_count, slot_size, p.record_count, p.max_chunks, p.consumer_count, ring_capacity);

  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(errno_msg("cannot create shared memory", name));
  if (ftruncate(fd, off_t(l.total_size)) != 0) {
    std::string msg = errno_msg("cannot size shared memory", name);
    ::close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error(msg);
  }
  void* base = mmap(nullptr, l.total_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    std::string msg = errno_msg("cannot map shared memory", name);
    shm_unlink(name.c_str());
    throw std::runtime_error(msg);
  }

  auto* hdr = new (base) pool::PoolHeader();
  hdr->magic = pool::kPoolMagic;
  hdr->layout_version = pool::kLayoutVersion;
  hdr->header_size = sizeof(pool::PoolHeader);
  hdr->slot_count = p.slot_count;
  hdr->slot_size = slot_size;
  hdr->max_payload = slot_size - uint32_t(wire::kHeaderSize);
  hdr->record_count = p.record_count;
  hdr->max_chunks = p.max_chunks;
  hdr->consumer_count = p.consumer_count;
  hdr->ring_capacity = ring_capacity;
  hdr->slots_offset = l.slots_offset;
  hdr->records_offset = l.records_offset;
  hdr->chunkmap_offset = l.chunkmap_offset;
  hdr->rings_offset = l.rings_offset;
  hdr->total_size = l.total_size;
  hdr->ingest_pid.store(0);
  hdr->shutting_down.store(0);

  Pool* pool = new Pool();
  pool->name_ = name;
  pool->owner_ = true;
  pool->size_ = l.total_size;
  pool->view_.base = static_cast<uint8_t*>(base);
  pool->view_.hdr = hdr;
  for (uint32_t r = 0; r < p.record_count; ++r) {
    auto* rec = new (pool->view_.record(r)) pool::Record();
    rec->state.store(pool::kRecFree);
  }
  for (uint32_t c = 0; c < p.consumer_count; ++c) {
    auto* cb = new (pool->view_.consumer(c)) pool::ConsumerBlock();
    init_ring(cb->deliver, ring_capacity);
    init_ring(cb->release, ring_capacity);
    cb->attached_pid.store(0);
    cb->epoch.store(0);
  }
  return pool;
}

Pool* Pool::attach(const std::string& name) {
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) throw std::runtime_error(errno_msg("cannot open packet pool", name));
  struct stat st;
  if (fstat(fd, &st) != 0 || size_t(st.st_size) < sizeof(pool::PoolHeader)) {
    ::close(fd);
    throw std::runtime_error("packet pool '" + name + "' is too small to be a pool");
  }
  void* base = mmap(nullptr, size_t(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) throw std::runtime_error(errno_msg("cannot map packet pool", name));
  auto* hdr = static_cast<pool::PoolHeader*>(base);
  if (hdr->magic != pool::kPoolMagic || hdr->layout_version != pool::kLayoutVersion ||
      hdr->total_size != uint64_t(st.st_size)) {
    munmap(base, size_t(st.st_size));
    throw std::runtime_error("'" + name + "' is not a gpuprims packet pool of layout version " +
                             std::to_string(pool::kLayoutVersion));
  }
  Pool* pool = new Pool();
  pool->name_ = name;
  pool->owner_ = false;
  pool->size_ = size_t(st.st_size);
  pool->view_.base = static_cast<uint8_t*>(base);
  pool->view_.hdr = hdr;
  return pool;
}

Pool::~Pool() { close(); }

void Pool::close() {
  if (!view_.base) return;
  munmap(view_.base, size_);
  view_.base = nullptr;
  view_.hdr = nullptr;
  if (owner_) shm_unlink(name_.c_str());
}

void Pool::check_consumer(uint32_t c) const {
  check_open();
  if (c >= view_.hdr->consumer_count)
    throw std::out_of_range("consumer index " + std::to_string(c) + " out of range 0.." +
                            std::to_string(view_.hdr->consumer_count - 1));
}

size_t Pool::poll(uint32_t consumer, uint32_t* out, size_t max_n, int64_t timeout_us, int64_t spin_us) {
  check_consumer(consumer);
  pool::ConsumerBlock* cb = view_.consumer(consumer);
  const uint32_t* entries = view_.deliver_entries(consumer);
  pool::Ring& r = cb->deliver;
  size_t n = ring_pop(r, entries, out, max_n);
  if (n || timeout_us == 0) return n;
  const uint64_t start = now_ns();
  const uint64_t deadline = timeout_us < 0 ? UINT64_MAX : start + uint64_t(timeout_us) * 1000;
  // A short spin catches back-to-back requests without a system call; then sleep on the futex so
  // an idle consumer costs no core.
  const uint64_t spin_end = start + uint64_t(spin_us > 0 ? spin_us : 0) * 1000;
  while (now_ns() < spin_end) {
    if (r.tail.load(std::memory_order_acquire) != r.head.load(std::memory_order_relaxed))
      return ring_pop(r, entries, out, max_n);
  }
  for (;;) {
    const uint32_t seq = r.seq.load();
    r.sleepers.fetch_add(1);
    n = ring_pop(r, entries, out, max_n);
    if (n) {
      r.sleepers.fetch_sub(1, std::memory_order_acq_rel);
      return n;
    }
    const uint64_t now = now_ns();
    if (now >= deadline) {
      r.sleepers.fetch_sub(1, std::memory_order_acq_rel);
      return 0;
    }
    // Wake at least every 100 ms so a consumer notices a pool shutting down.
    uint64_t wait = deadline - now;
    if (wait > 100000000ull) wait = 100000000ull;
    timespec ts{time_t(wait / 1000000000ull), long(wait % 1000000000ull)};
    futex_wait(&r.seq, seq, &ts);
    r.sleepers.fetch_sub(1, std::memory_order_acq_rel);
    n = ring_pop(r, entries, out, max_n);
    if (n) return n;
    if (view_.hdr->shutting_down.load(std::memory_order_acquire)) return 0;
  }
}

size_t Pool::release(uint32_t consumer, const uint32_t* recs, size_t n) {
  check_consumer(consumer);
  pool::ConsumerBlock* cb = view_.consumer(consumer);
  uint32_t* entries = view_.release_entries(consumer);
  for (size_t i = 0; i < n; ++i) {
    if (recs[i] >= view_.hdr->record_count)
      throw std::out_of_range("record index " + std::to_string(recs[i]) + " out of range");
  }
  size_t done = 0;
  // The ring holds every record, so it is full only if records are released twice; the ingest
  // counts those, and we stop rather than spin forever.
  for (; done < n; ++done) {
    if (!ring_push(cb->release, entries, recs[done])) break;
  }
  return done;
}

size_t Pool::queue_depth(uint32_t consumer) const {
  check_consumer(consumer);
  const pool::Ring& r = view_.consumer(consumer)->deliver;
  return size_t(r.tail.load(std::memory_order_acquire) - r.head.load(std::memory_order_acquire));
}

size_t Pool::peek(uint32_t consumer, uint64_t from, uint32_t* out, size_t max_n, uint64_t* head,
                  uint64_t* tail) const {
  check_consumer(consumer);
  const pool::Ring& r = view_.consumer(consumer)->deliver;
  const uint32_t* entries = view_.deliver_entries(consumer);
  // tail first: every entry below it was fully written before the producer published it.
  const uint64_t t = r.tail.load(std::memory_order_acquire);
  const uint64_t h = r.head.load(std::memory_order_acquire);
  *head = h;
  *tail = t;
  uint64_t pos = from > h ? from : h;
  size_t n = 0;
  for (; pos < t && n < max_n; ++pos, ++n) out[n] = entries[pos & r.mask];
  return n;
}

std::string Pool::gather(const uint32_t* recs, size_t n, uint8_t* out, size_t row_bytes) const {
  check_open();
  const pool::PoolHeader* h = view_.hdr;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t ri = recs[i];
    if (ri >= h->record_count) return "record index " + std::to_string(ri) + " out of range";
    const pool::Record* rec = view_.record(ri);
    if (rec->state.load(std::memory_order_acquire) != pool::kRecDelivered)
      return "record " + std::to_string(ri) + " is not a delivered request";
    if (rec->total_len != row_bytes)
      return "request " + std::to_string(rec->request_id) + " has " + std::to_string(rec->total_len) +
             " bytes but the batch row has " + std::to_string(row_bytes);
    const uint32_t* map = view_.chunkmap(ri);
    uint8_t* dst = out + i * row_bytes;
    for (uint32_t c = 0; c < rec->chunk_count; ++c) {
      const uint8_t* slot = view_.slot(map[c]);
      const uint32_t len = c + 1 < rec->chunk_count ? rec->stride : rec->total_len - c * rec->stride;
      std::memcpy(dst + size_t(c) * rec->stride, slot + wire::kHeaderSize, len);
    }
  }
  return std::string();
}

}  // namespace gpuprims
