// Packet pool: POSIX shared memory mapping, consumer rings, CPU gather.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

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
  if (p.answer_ring_bytes < pool::kPage || p.answer_ring_bytes > (1u << 28) ||
      (p.answer_ring_bytes & (p.answer_ring_bytes - 1)))
    throw std::invalid_argument("answer_ring_bytes must be a power of two in 4096..268435456, got " +
                                std::to_string(p.answer_ring_bytes));

  const uint32_t slot_size = uint32_t(pool::align_up(wire::kHeaderSize + p.max_payload, pool::kCacheLine));
  // The release ring must hold every record a consumer can own, so it never blocks a consumer.
  const uint32_t ring_capacity = next_pow2(p.record_count);
  const pool::Layout l =
      pool::compute_layout(p.slot_count, slot_size, p.record_count, p.max_chunks, p.consumer_count, ring_capacity,
                           p.answer_ring_bytes);

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
  hdr->answers_offset = l.answers_offset;
  hdr->answer_ring_bytes = p.answer_ring_bytes;
  hdr->ingest_idle.store(0);
  hdr->wake_len = 0;

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
    cb->answer.head.store(0);
    cb->answer.tail.store(0);
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
  if (wake_fd_ >= 0) {
    ::close(wake_fd_);
    wake_fd_ = -1;
  }
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

size_t Pool::max_answer_bytes() const {
  check_open();
  // An answer may take at most half the ring, so a filler plus one answer always fit.
  return view_.hdr->answer_ring_bytes / 2 - sizeof(pool::AnswerEntry);
}

void Pool::wake_ingest() {
  const pool::PoolHeader* h = view_.hdr;
  const uint32_t len = h->wake_len;
  if (len == 0 || len > sizeof h->wake_name) return;
  if (wake_fd_ < 0) wake_fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (wake_fd_ < 0) return;  // the ingest still finds the answers on its next millisecond tick
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, h->wake_name, len);
  const char b = 1;
  // A full socket buffer means the ingest has wake-ups pending already: nothing to do.
  (void)!::sendto(wake_fd_, &b, 1, MSG_DONTWAIT, reinterpret_cast<const sockaddr*>(&a),
                  socklen_t(offsetof(sockaddr_un, sun_path) + len));
}

size_t Pool::answer(uint32_t consumer, const uint32_t* recs, const uint32_t* gens, size_t n,
                    const uint16_t* statuses, const uint8_t* body, size_t row_bytes, uint8_t dtype,
                    int64_t timeout_us) {
  check_consumer(consumer);
  const pool::PoolHeader* h = view_.hdr;
  for (size_t i = 0; i < n; ++i) {
    if (recs[i] >= h->record_count)
      throw std::out_of_range("record index " + std::to_string(recs[i]) + " out of range");
  }
  if (body && row_bytes > max_answer_bytes())
    throw std::length_error("a result of " + std::to_string(row_bytes) + " bytes does not fit the answer ring (" +
                            std::to_string(h->answer_ring_bytes) + " bytes per instance; at most " +
                            std::to_string(max_answer_bytes()) + " per answer): raise node.pool.answer_ring_kb");
  pool::AnswerCtl& a = view_.consumer(consumer)->answer;
  uint8_t* data = view_.answer_data(consumer);
  const uint64_t cap = h->answer_ring_bytes;
  uint64_t tail = a.tail.load(std::memory_order_relaxed);
  if (tail % pool::kAnswerAlign || tail - a.head.load(std::memory_order_acquire) > cap)
    throw std::runtime_error("the answer ring's control words are corrupt (tail " + std::to_string(tail) +
                             "); the node answers what this consumer holds when it reclaims it");
  const uint64_t start = now_ns();
  const uint64_t deadline = timeout_us < 0 ? UINT64_MAX : start + uint64_t(timeout_us) * 1000;
  size_t done = 0, published = 0;
  auto publish = [&]() {
    if (published == done) return;
    // Sequentially consistent: pairs with the ingest's store of ingest_idle and its re-check of
    // every ring before it sleeps (a store-load handshake), so a sleeping ingest is always woken.
    a.tail.store(tail);
    published = done;
    if (h->ingest_idle.load()) wake_ingest();
  };
  while (done < n) {
    const bool ok = statuses[done] == wire::kStatusOk && body != nullptr;
    const size_t blen = ok ? row_bytes : 0;
    const uint64_t need = pool::align_up(sizeof(pool::AnswerEntry) + blen, pool::kAnswerAlign);
    const uint64_t pos = tail & (cap - 1);
    const uint64_t filler = cap - pos < need ? cap - pos : 0;
    const uint64_t head = a.head.load(std::memory_order_acquire);
    if (cap - (tail - head) < filler + need) {
      // No room: publish what is written, let the ingest send it, and wait for it to free room.
      publish();
      if (h->ingest_idle.load()) wake_ingest();
      if (h->shutting_down.load(std::memory_order_acquire) || now_ns() >= deadline) break;
      timespec ts{0, 50000};
      nanosleep(&ts, nullptr);
      continue;
    }
    if (filler) {
      pool::AnswerEntry f{};
      f.record = pool::kAnswerFiller;
      f.entry_len = uint32_t(filler);
      std::memcpy(data + pos, &f, sizeof f);
      tail += filler;
    }
    pool::AnswerEntry e{};
    e.record = recs[done];
    e.generation = gens[done];
    e.entry_len = uint32_t(need);
    e.body_len = uint32_t(blen);
    e.status = statuses[done];
    e.dtype = ok ? dtype : uint8_t(wire::kDTypeBytes);
    uint8_t* dst = data + (tail & (cap - 1));
    std::memcpy(dst, &e, sizeof e);
    if (blen) std::memcpy(dst + sizeof e, body + done * row_bytes, blen);
    tail += need;
    ++done;
  }
  publish();
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
