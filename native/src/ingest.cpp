#include "ingest.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/un.h>
#include <netinet/udp.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <future>

#ifndef UDP_GRO
#define UDP_GRO 104
#endif

namespace gpuprims {

namespace {
constexpr size_t kGroBuffer = 65536;
constexpr size_t kAnswerBatch = 64;  // answer datagrams per sendmmsg
// Would-block sends tried per flush or retry pass before the rest is held untried: a socket whose
// buffer is full refuses them all, and trying each costs a system call.
constexpr int kMaxBlockedTries = 4;
constexpr uint64_t kRetryIntervalNs = 200000;  // held datagrams are retried at most this often
constexpr size_t kHeldMax = 1u << 16;          // and at most this many are held

bool would_block(int err) { return err == EAGAIN || err == EWOULDBLOCK || err == ENOBUFS; }

int dest_port(const msghdr& mh) {
  // sin_port and sin6_port sit at the same offset.
  return ntohs(static_cast<const sockaddr_in*>(mh.msg_name)->sin_port);
}

const char* kCounterNames[kCounterCount] = {
    "packets_received",
    "bytes_received",
    "packets_accepted",
    "drop_truncated",
    "drop_bad_magic",
    "drop_bad_version",
    "drop_bad_kind",
    "drop_bad_length",
    "drop_bad_chunk",
    "drop_bad_total",
    "drop_bad_dtype",
    "drop_oversize",
    "drop_too_many_chunks",
    "drop_unknown_app",
    "drop_duplicate",
    "drop_late",
    "drop_inconsistent",
    "drop_pool_full",
    "drop_no_record",
    "requests_started",
    "requests_completed",
    "requests_delivered",
    "requests_timed_out",
    "requests_rejected_pool_full",
    "requests_rejected_no_record",
    "requests_rejected_queue_full",
    "requests_reclaimed_failed",
    "requests_requeued",
    "requests_released",
    "bad_releases",
    "responses_sent",
    "response_send_errors",
    "kernel_drops",
    "recv_calls",
    "gro_buffers",
    "requests_answered",
    "bad_answers",
    "local_submitted",
    "local_answered",
    "local_dropped",
    "answers_expired",
};

int open_socket(const ListenSpec& spec, int rcvbuf, bool gro, int* bound_port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(spec.port);
  int rc = getaddrinfo(spec.host.empty() ? nullptr : spec.host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) throw std::runtime_error("cannot resolve listen address '" + spec.host + "': " + gai_strerror(rc));
  int fd = socket(res->ai_family, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
  }
  // SO_RCVBUFFORCE passes rmem_max where we may (root); otherwise take what SO_RCVBUF allows.
  if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof rcvbuf) != 0)
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_RXQ_OVFL, &one, sizeof one);
  if (gro && setsockopt(fd, SOL_UDP, UDP_GRO, &one, sizeof one) != 0) {
    ::close(fd);
    freeaddrinfo(res);
    throw std::runtime_error(std::string("setsockopt(UDP_GRO): ") + std::strerror(errno) +
                             " (pass gro=False on kernels without UDP GRO)");
  }
  if (bind(fd, res->ai_addr, res->ai_addrlen) != 0) {
    std::string msg = "cannot bind " + spec.host + ":" + port + ": " + std::strerror(errno);
    freeaddrinfo(res);
    ::close(fd);
    throw std::runtime_error(msg);
  }
  freeaddrinfo(res);
  sockaddr_storage ss{};
  socklen_t sl = sizeof ss;
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &sl);
  *bound_port = ss.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port)
                                        : ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return fd;
}
}  // namespace

const char* counter_name(int c) { return (c >= 0 && c < kCounterCount) ? kCounterNames[c] : "unknown"; }

Ingest::Ingest(Pool* pool, const std::vector<ListenSpec>& listen, const IngestOptions& opts)
    : pool_(pool), v_(pool->view()), opt_(opts) {
  if (listen.empty()) throw std::invalid_argument("ingest needs at least one listen address");
  if (opt_.batch == 0 || opt_.batch > 1024)
    throw std::invalid_argument("batch must be in 1..1024, got " + std::to_string(opt_.batch));
  if (opt_.timeout_ns == 0) throw std::invalid_argument("timeout must be positive");
  for (auto& c : cnt_) c.store(0);
  try {
    for (const auto& spec : listen) {
      if (spec.app_id > 0xFFFF) throw std::invalid_argument("listen app_id must be a u16");
      int port = 0;
      socks_.push_back(open_socket(spec, opt_.rcvbuf_bytes, opt_.gro, &port));
      sock_app_.push_back(spec.app_id);
      ports_.push_back(port);
    }
    epfd_ = epoll_create1(EPOLL_CLOEXEC);
    wakefd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (epfd_ < 0 || wakefd_ < 0) throw std::runtime_error(std::string("epoll/eventfd: ") + std::strerror(errno));
    // The consumers' wake-up socket: autobound to a unique abstract name, published in the pool.
    answer_wake_fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (answer_wake_fd_ < 0) throw std::runtime_error(std::string("answer wake socket: ") + std::strerror(errno));
    {
      sockaddr_un a{};
      a.sun_family = AF_UNIX;
      socklen_t alen = sizeof(sa_family_t);
      if (bind(answer_wake_fd_, reinterpret_cast<sockaddr*>(&a), alen) != 0)
        throw std::runtime_error(std::string("answer wake socket bind: ") + std::strerror(errno));
      alen = sizeof a;
      if (getsockname(answer_wake_fd_, reinterpret_cast<sockaddr*>(&a), &alen) != 0)
        throw std::runtime_error(std::string("answer wake socket name: ") + std::strerror(errno));
      const size_t len = size_t(alen) - offsetof(sockaddr_un, sun_path);
      pool::PoolHeader* h = v_.hdr;
      if (len == 0 || len > sizeof h->wake_name) throw std::runtime_error("answer wake socket: unexpected name");
      std::memcpy(h->wake_name, a.sun_path, len);
      h->wake_len = uint32_t(len);
      h->ingest_idle.store(0);
    }
    for (size_t i = 0; i <= socks_.size() + 1; ++i) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u32 = uint32_t(i);
      const int fd = i < socks_.size() ? socks_[i] : i == socks_.size() ? wakefd_ : answer_wake_fd_;
      epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev);
    }
    out_hdrs_.resize(kAnswerBatch);
    out_iov_.resize(2 * kAnswerBatch);
    out_msgs_.resize(kAnswerBatch);
    out_addrs_.resize(kAnswerBatch);
    out_expires_.resize(kAnswerBatch);
  } catch (...) {
    for (int fd : socks_) ::close(fd);
    if (epfd_ >= 0) ::close(epfd_);
    if (wakefd_ >= 0) ::close(wakefd_);
    if (answer_wake_fd_ >= 0) ::close(answer_wake_fd_);
    throw;
  }

  const pool::PoolHeader* h = v_.hdr;
  free_slots_.reserve(h->slot_count);
  for (uint32_t s = h->slot_count; s-- > 0;) free_slots_.push_back(s);
  free_count_ = h->slot_count;
  free_records_.reserve(h->record_count);
  for (uint32_t r = h->record_count; r-- > 0;) free_records_.push_back(r);
  bitmap_words_ = (h->max_chunks + 63) / 64;
  bitmaps_.assign(size_t(h->record_count) * bitmap_words_, 0);
  rec_sock_.assign(h->record_count, 0);
  rec_deliver_pos_.assign(h->record_count, 0);
  rec_key_.assign(h->record_count, Key{0, 0, 0});
  filling_pos_.assign(h->record_count, -1);
  routes_.assign(65536, {});
  routes_pending_.assign(65536, {});
  rr_.assign(65536, 0);
  wake_.assign(h->consumer_count, 0);
  cost_fixed_us_.reset(new std::atomic<double>[h->consumer_count]);
  cost_per_us_.reset(new std::atomic<double>[h->consumer_count]);
  for (uint32_t c = 0; c < h->consumer_count; ++c) {
    cost_fixed_us_[c].store(-1.0);
    cost_per_us_[c].store(0.0);
  }
  active_.reserve(h->record_count * 2);
  publish_gauges();
}

Ingest::~Ingest() {
  stop();
  for (int fd : socks_) ::close(fd);
  if (epfd_ >= 0) ::close(epfd_);
  if (wakefd_ >= 0) ::close(wakefd_);
  for (auto& lp : local_)
    if (lp.fd >= 0) ::close(lp.fd);
  if (answer_wake_fd_ >= 0) ::close(answer_wake_fd_);
  if (!pool_->closed()) v_.hdr->wake_len = 0;
}

void Ingest::start() {
  if (running_.exchange(true)) throw std::runtime_error("ingest already started");
  stop_.store(false);
  v_.hdr->ingest_pid.store(uint32_t(getpid()));
  thread_ = std::thread([this] { run(); });
}

void Ingest::stop() {
  if (!running_.load()) return;
  stop_.store(true);
  uint64_t one = 1;
  (void)!write(wakefd_, &one, sizeof one);
  if (thread_.joinable()) thread_.join();
  running_.store(false);
  // A submit that saw the thread running but queued its command after the loop's last look.
  run_commands();
  v_.hdr->ingest_pid.store(0);
}

void Ingest::set_route(uint16_t app_id, const std::vector<uint32_t>& consumers) {
  for (uint32_t c : consumers) pool_->check_consumer(c);
  std::lock_guard<std::mutex> g(mu_);
  routes_pending_[app_id] = consumers;
  routes_dirty_.push_back(app_id);
  if (!consumers.empty() && std::find(routed_.begin(), routed_.end(), app_id) == routed_.end())
    routed_.push_back(app_id);
  routes_version_.fetch_add(1, std::memory_order_release);
}

std::vector<uint32_t> Ingest::route(uint16_t app_id) {
  std::lock_guard<std::mutex> g(mu_);
  return routes_pending_[app_id];
}

void Ingest::set_cost(uint32_t consumer, double fixed_us, double per_request_us) {
  pool_->check_consumer(consumer);
  if (!std::isfinite(fixed_us) || !std::isfinite(per_request_us) || per_request_us < 0)
    throw std::invalid_argument("cost: fixed_us and per_request_us must be finite, per_request_us >= 0");
  // Two relaxed stores: a delivery may see one updated and not the other, which only shifts a guess.
  cost_per_us_[consumer].store(per_request_us, std::memory_order_relaxed);
  cost_fixed_us_[consumer].store(fixed_us < 0 ? -1.0 : fixed_us, std::memory_order_relaxed);
}

std::pair<double, double> Ingest::cost(uint32_t consumer) const {
  pool_->check_consumer(consumer);
  return {cost_fixed_us_[consumer].load(std::memory_order_relaxed), cost_per_us_[consumer].load(std::memory_order_relaxed)};
}

std::array<uint64_t, kCounterCount> Ingest::counters() const {
  std::array<uint64_t, kCounterCount> out{};
  // packets_received first, with acquire: it pairs with handle_packet's release (see there).
  out[kPacketsReceived] = cnt_[kPacketsReceived].load(std::memory_order_acquire);
  for (int i = 0; i < kCounterCount; ++i)
    if (i != kPacketsReceived) out[i] = cnt_[i].load(std::memory_order_relaxed);
  return out;
}

void Ingest::apply_routes() {
  const uint64_t ver = routes_version_.load(std::memory_order_acquire);
  if (ver == routes_seen_) return;
  std::lock_guard<std::mutex> g(mu_);
  // Only the apps whose routes changed are copied (the ingest thread does this between batches).
  for (uint16_t app : routes_dirty_) routes_[app] = routes_pending_[app];
  routes_dirty_.clear();
  routes_seen_ = routes_version_.load(std::memory_order_acquire);
}

void Ingest::run_commands() {
  if (!has_commands_.load(std::memory_order_acquire)) return;
  std::vector<Command> cmds;
  {
    std::lock_guard<std::mutex> g(mu_);
    cmds.swap(commands_);
    has_commands_.store(false, std::memory_order_release);
  }
  for (auto& c : cmds) c.fn();
}

std::pair<uint64_t, uint64_t> Ingest::reclaim(uint32_t consumer, bool requeue, int timeout_ms) {
  pool_->check_consumer(consumer);
  {
    // Stop routing to it first, so nothing new lands in its ring.
    std::lock_guard<std::mutex> g(mu_);
    for (uint16_t app : routed_) {
      auto& r = routes_pending_[app];
      auto end = std::remove(r.begin(), r.end(), consumer);
      if (end == r.end()) continue;
      r.erase(end, r.end());
      routes_dirty_.push_back(app);
    }
    routes_version_.fetch_add(1, std::memory_order_release);
  }
  auto done = std::make_shared<std::promise<std::pair<uint64_t, uint64_t>>>();
  auto fut = done->get_future();
  auto work = [this, consumer, requeue, done] {
    apply_routes();
    drain_releases();
    // Every answer the consumer published before it went is sent now, and its record freed; what
    // it had not published is unanswered, so the scan below requeues or fails those records.
    drain_answers();
    uint64_t failed = 0, requeued = 0;
    pool::ConsumerBlock* cb = v_.consumer(consumer);
    // Reset the dead consumer's rings; the records it held are found by owner below.
    cb->deliver.head.store(cb->deliver.tail.load());
    cb->release.head.store(cb->release.tail.load());
    // (Aligned, so that a consumer which left nonsense in its tail does not leave it to the next one.)
    const uint64_t answer_tail = pool::align_up(cb->answer.tail.load(), pool::kAnswerAlign);
    cb->answer.tail.store(answer_tail);
    cb->answer.head.store(answer_tail);
    for (uint32_t r = 0; r < v_.hdr->record_count; ++r) {
      pool::Record* rec = v_.record(r);
      if (rec->state.load(std::memory_order_acquire) != pool::kRecDelivered || rec->owner != consumer) continue;
      bool moved = false;
      if (requeue) {
        const auto& cands = routes_[rec->app_id];
        for (uint32_t c : cands) {
          if (c == consumer) continue;
          pool::ConsumerBlock* ob = v_.consumer(c);
          rec->owner = c;
          rec_deliver_pos_[r] = ob->deliver.tail.load(std::memory_order_relaxed);
          if (ring_push(ob->deliver, v_.deliver_entries(c), r)) {
            wake_[c] = 1;
            moved = true;
            break;
          }
        }
      }
      if (moved) {
        ++requeued;
        bump(kRequestsRequeued);
      } else {
        ++failed;
        bump(kRequestsReclaimedFailed);
        if (opt_.answer_drops || rec_sock_[r] < 0) send_status(rec_sock_[r], *rec, wire::kStatusInstanceFailed);
        free_record(r, false);
      }
    }
    cb->epoch.fetch_add(1);
    cb->attached_pid.store(0);
    for (uint32_t c = 0; c < wake_.size(); ++c) {
      if (wake_[c]) {
        ring_signal(v_.consumer(c)->deliver);
        wake_[c] = 0;
      }
    }
    done->set_value({failed, requeued});
  };
  if (!running_.load()) {
    work();
  } else {
    {
      std::lock_guard<std::mutex> g(mu_);
      commands_.push_back(Command{work});
      has_commands_.store(true, std::memory_order_release);
    }
    uint64_t one = 1;
    (void)!write(wakefd_, &one, sizeof one);
  }
  if (fut.wait_for(std::chrono::milliseconds(timeout_ms)) != std::future_status::ready)
    throw std::runtime_error("ingest did not complete the reclaim within " + std::to_string(timeout_ms) + " ms");
  return fut.get();
}

Ingest::LocalPort& Ingest::local_port(int port) {
  if (port < 0 || port >= kLocalPorts) throw std::out_of_range("no local port " + std::to_string(port));
  return local_[size_t(port)];
}

int Ingest::local_open() {
  std::lock_guard<std::mutex> g(local_open_mu_);
  for (int p = 0; p < kLocalPorts; ++p) {
    LocalPort& lp = local_[size_t(p)];
    std::lock_guard<std::mutex> q(lp.mu);
    if (lp.open) continue;
    lp.fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (lp.fd < 0) throw std::runtime_error(std::string("local port eventfd: ") + std::strerror(errno));
    lp.answers.clear();
    lp.open = true;
    return p;
  }
  throw std::runtime_error("all " + std::to_string(kLocalPorts) + " local ports of the ingest are open");
}

void Ingest::local_close(int port) {
  LocalPort& lp = local_port(port);
  std::lock_guard<std::mutex> q(lp.mu);
  if (!lp.open) return;
  lp.open = false;
  ::close(lp.fd);
  lp.fd = -1;
  bump(kLocalDropped, lp.answers.size());
  lp.answers.clear();
}

int Ingest::local_fd(int port) {
  LocalPort& lp = local_port(port);
  std::lock_guard<std::mutex> q(lp.mu);
  if (!lp.open) throw std::runtime_error("local port " + std::to_string(port) + " is closed");
  return lp.fd;
}

void Ingest::push_local(int port, LocalAnswer&& a) {
  LocalPort& lp = local_[size_t(port) % kLocalPorts];
  std::lock_guard<std::mutex> q(lp.mu);
  if (!lp.open) {
    bump(kLocalDropped);
    return;
  }
  const bool was_empty = lp.answers.empty();
  lp.answers.push_back(std::move(a));
  bump(kLocalAnswered);
  if (was_empty) {
    uint64_t one = 1;
    (void)!write(lp.fd, &one, sizeof one);
  }
}

std::vector<LocalAnswer> Ingest::take_local(int port) {
  LocalPort& lp = local_port(port);
  std::vector<LocalAnswer> out;
  std::lock_guard<std::mutex> q(lp.mu);
  if (!lp.open) throw std::runtime_error("local port " + std::to_string(port) + " is closed");
  // Under the lock a push cannot come between the reset and the swap: whatever is pushed after the
  // swap finds the queue empty and signals again.
  uint64_t v;
  (void)!read(lp.fd, &v, sizeof v);
  out.swap(lp.answers);
  return out;
}

void Ingest::place_local(int port, uint16_t app_id, const uint8_t* row, size_t row_bytes, uint8_t dtype,
                         uint32_t deadline_us, uint64_t token, uint64_t now, uint8_t flags) {
  bump(kLocalSubmitted);
  auto refuse = [&](uint16_t status) {
    push_local(port, LocalAnswer{token, status, uint8_t(wire::kDTypeBytes), 0, clock_(), {}});
  };
  if (routes_[app_id].empty()) return refuse(wire::kStatusUnknownApp);
  const uint32_t stride = v_.hdr->max_payload;
  const uint64_t chunks = (uint64_t(row_bytes) + stride - 1) / stride;
  if (row_bytes == 0 || row_bytes > 0xFFFFFFFFull || chunks > v_.hdr->max_chunks)
    return refuse(wire::kStatusBadRequest);
  // The same admission as a received request: all its slots or nothing.
  if (free_count_ - reserved_ < chunks) {
    bump(kRequestsRejectedPoolFull);
    return refuse(wire::kStatusOverloaded);
  }
  if (free_records_.empty()) {
    bump(kRequestsRejectedNoRecord);
    return refuse(wire::kStatusOverloaded);
  }
  const uint32_t r = free_records_.back();
  free_records_.pop_back();
  pool::Record* rec = v_.record(r);
  rec->owner = UINT32_MAX;
  rec->app_id = app_id;
  rec->dtype = dtype;
  rec->chunk_count = uint32_t(chunks);
  rec->chunks_received = uint32_t(chunks);
  rec->stride = stride;
  rec->total_len = uint32_t(row_bytes);
  rec->deadline_us = deadline_us;
  rec->request_id = token;
  rec->client_ts_ns = 0;
  rec->flags = flags;
  rec->first_ns = now;
  rec->complete_ns = now;
  std::memset(rec->addr, 0, sizeof rec->addr);
  rec->addr_len = 0;
  rec_sock_[r] = -(port + 1);
  // Each chunk is a slot as the receive loop would have left it (a valid request header, then the
  // payload), so every reader of the pool (CPU gather, the GPU-DMA kernel) sees no difference.
  uint32_t* map = v_.chunkmap(r);
  for (uint32_t c = 0; c < chunks; ++c) {
    const uint32_t s = free_slots_.back();
    free_slots_.pop_back();
    const uint32_t len = uint32_t(std::min<uint64_t>(stride, row_bytes - uint64_t(c) * stride));
    wire::Header h{};
    h.magic = wire::kMagic;
    h.version = wire::kVersion;
    h.kind = wire::kKindRequest;
    h.app_id = app_id;
    h.dtype = dtype;
    h.chunk_index = c;
    h.chunk_count = uint32_t(chunks);
    h.payload_len = len;
    h.request_id = token;
    h.total_len = uint32_t(row_bytes);
    h.deadline_us = deadline_us;
    uint8_t* slot = v_.slot(s);
    std::memcpy(slot, &h, sizeof h);
    std::memcpy(slot + wire::kHeaderSize, row + size_t(c) * stride, len);
    map[c] = s;
  }
  free_count_ -= chunks;
  bump(kRequestsStarted);
  bump(kRequestsCompleted);
  deliver(r);
}

void Ingest::submit(int port, uint16_t app_id, const uint8_t* data, size_t n, size_t row_bytes, uint8_t dtype,
                    uint32_t deadline_us, uint64_t token0) {
  local_fd(port);  // throws for a port that is not open
  if (dtype > wire::kDTypeMax) throw std::invalid_argument("submit: dtype " + std::to_string(dtype) + " is no wire dtype");
  if (n == 0) return;
  // The rows are copied here, in the caller's thread, so the caller's buffer is free when this returns.
  auto rows = std::make_shared<std::vector<uint8_t>>(data, data + n * row_bytes);
  auto work = [this, port, rows, app_id, n, row_bytes, dtype, deadline_us, token0] {
    apply_routes();
    const uint64_t now = clock_();
    for (size_t i = 0; i < n; ++i)
      place_local(port, app_id, rows->data() + i * row_bytes, row_bytes, dtype, deadline_us, token0 + i, now,
                  i + 1 < n ? wire::kFlagMore : uint8_t(0));  // the rows of one call are one query
    signal_consumers();
    publish_gauges();
  };
  if (!running_.load()) {
    work();
    return;
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    commands_.push_back(Command{work});
    has_commands_.store(true, std::memory_order_release);
  }
  uint64_t one = 1;
  (void)!write(wakefd_, &one, sizeof one);
}

uint64_t Ingest::src_key(const sockaddr_in6& a, socklen_t len) {
  if (a.sin6_family == AF_INET) {
    const auto& a4 = reinterpret_cast<const sockaddr_in&>(a);
    return (uint64_t(a4.sin_addr.s_addr) << 16) | a4.sin_port;
  }
  uint64_t h = 1469598103934665603ull;
  const uint8_t* b = a.sin6_addr.s6_addr;
  for (int i = 0; i < 16; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return (h << 16) ^ a.sin6_port ^ (1ull << 63);
}

void Ingest::remember(const Key& k, int reason, uint64_t now) {
  // Bounded: past this many remembered keys, older ones are forgotten at the next purge.
  if (gone_.size() > (1u << 20)) return;
  gone_[k] = Gone{now + opt_.dedup_window_ns, reason};
}

void Ingest::send_status(int sock, const pool::Record& rec, uint16_t status) {
  if (sock < 0) {
    push_local(-sock - 1, LocalAnswer{rec.request_id, status, uint8_t(wire::kDTypeBytes), rec.first_ns, clock_(), {}});
    return;
  }
  wire::Header h{};
  h.magic = wire::kMagic;
  h.version = wire::kVersion;
  h.kind = wire::kKindResponse;
  h.status = status;
  h.app_id = rec.app_id;
  h.dtype = wire::kDTypeBytes;
  h.chunk_index = 0;
  h.chunk_count = 1;
  h.payload_len = 0;
  h.request_id = rec.request_id;
  h.total_len = 0;
  h.client_ts_ns = rec.client_ts_ns;
  sockaddr_in6 to{};
  std::memcpy(&to, rec.addr, std::min<size_t>(rec.addr_len, sizeof to));
  iovec iov{&h, sizeof h};
  mmsghdr m{};
  m.msg_hdr.msg_name = &to;
  m.msg_hdr.msg_namelen = rec.addr_len;
  m.msg_hdr.msg_iov = &iov;
  m.msg_hdr.msg_iovlen = 1;
  int rc;
  do {
    rc = send_some(sock, &m, 1);
  } while (rc < 0 && errno == EINTR);
  if (rc == 1)
    bump(kResponsesSent);
  else if (rc < 0 && would_block(errno))
    hold(sock, m.msg_hdr, answer_expiry(rec));
  else
    bump(kResponseSendErrors);
}

uint64_t Ingest::answer_expiry(const pool::Record& rec) const {
  // first_ns is 0 for a status about a request that never got a record (refused at its first datagram).
  const uint64_t from = rec.first_ns ? rec.first_ns : clock_();
  return from + (rec.deadline_us ? uint64_t(rec.deadline_us) * 1000 : opt_.answer_hold_ns);
}

int Ingest::send_some(int sock, mmsghdr* msgs, unsigned n) {
  const int blocked = blocked_port_.load(std::memory_order_relaxed);
  if (blocked) {
    unsigned k = 0;
    while (k < n && dest_port(msgs[k].msg_hdr) != blocked) ++k;
    if (k == 0) {
      errno = EAGAIN;
      return -1;
    }
    n = k;
  }
  return sendmmsg(socks_[size_t(sock)], msgs, n, MSG_DONTWAIT);
}

void Ingest::hold(int sock, const msghdr& mh, uint64_t expires_ns) {
  size_t len = 0;
  for (size_t i = 0; i < mh.msg_iovlen; ++i) len += mh.msg_iov[i].iov_len;
  if (clock_() >= expires_ns) {
    bump(kAnswersExpired);
    return;
  }
  if (held_.size() >= kHeldMax || held_bytes_ + len > opt_.answer_hold_bytes) {
    bump(kResponseSendErrors);  // the held store is full: counted as not sent
    return;
  }
  Held h;
  h.expires_ns = expires_ns;
  h.sock = sock;
  h.addr_len = mh.msg_namelen;
  std::memcpy(&h.addr, mh.msg_name, std::min<size_t>(mh.msg_namelen, sizeof h.addr));
  h.bytes.resize(len);
  size_t off = 0;
  for (size_t i = 0; i < mh.msg_iovlen; ++i) {
    std::memcpy(h.bytes.data() + off, mh.msg_iov[i].iov_base, mh.msg_iov[i].iov_len);
    off += mh.msg_iov[i].iov_len;
  }
  held_bytes_ += len;
  held_.push_back(std::move(h));
  held_pub_.store(held_.size(), std::memory_order_relaxed);
}

void Ingest::retry_held() {
  if (held_.empty()) return;
  const uint64_t now = clock_();
  if (now < next_retry_ns_) return;
  next_retry_ns_ = now + kRetryIntervalNs;
  int blocked_tries = 0;
  std::vector<int> blocked_ports;  // destinations that refused in this pass: their later datagrams wait
  size_t keep = 0;
  for (size_t i = 0; i < held_.size(); ++i) {
    Held& h = held_[i];
    bool done = false;
    if (now >= h.expires_ns) {
      bump(kAnswersExpired);
      done = true;
    } else if (blocked_tries < kMaxBlockedTries &&
               std::find(blocked_ports.begin(), blocked_ports.end(), int(ntohs(h.addr.sin6_port))) ==
                   blocked_ports.end()) {
      iovec iov{h.bytes.data(), h.bytes.size()};
      mmsghdr m{};
      m.msg_hdr.msg_name = &h.addr;
      m.msg_hdr.msg_namelen = h.addr_len;
      m.msg_hdr.msg_iov = &iov;
      m.msg_hdr.msg_iovlen = 1;
      int rc;
      do {
        rc = send_some(h.sock, &m, 1);
      } while (rc < 0 && errno == EINTR);
      if (rc == 1) {
        bump(kResponsesSent);
        done = true;
      } else if (rc < 0 && would_block(errno)) {
        ++blocked_tries;
        blocked_ports.push_back(ntohs(h.addr.sin6_port));
      } else {
        bump(kResponseSendErrors);
        done = true;
      }
    }
    if (done) {
      held_bytes_ -= h.bytes.size();
    } else {
      if (keep != i) held_[keep] = std::move(h);
      ++keep;
    }
  }
  held_.resize(keep);
  held_pub_.store(held_.size(), std::memory_order_relaxed);
}

void Ingest::free_record(uint32_t r, bool received_only) {
  pool::Record* rec = v_.record(r);
  const uint32_t* map = v_.chunkmap(r);
  if (received_only) {
    const uint64_t* bm = &bitmaps_[size_t(r) * bitmap_words_];
    for (uint32_t c = 0; c < rec->chunk_count; ++c) {
      if (bm[c >> 6] & (1ull << (c & 63))) free_slots_.push_back(map[c]);
    }
    free_count_ += rec->chunks_received;
    reserved_ -= rec->chunk_count - rec->chunks_received;
  } else {
    for (uint32_t c = 0; c < rec->chunk_count; ++c) free_slots_.push_back(map[c]);
    free_count_ += rec->chunk_count;
  }
  if (filling_pos_[r] >= 0) {
    const int32_t pos = filling_pos_[r];
    const uint32_t last = filling_list_.back();
    filling_list_[size_t(pos)] = last;
    filling_pos_[last] = pos;
    filling_list_.pop_back();
    filling_pos_[r] = -1;
  }
  rec->generation++;
  rec->state.store(pool::kRecFree, std::memory_order_release);
  free_records_.push_back(r);
}

bool Ingest::taken(uint32_t c, uint32_t r) const {
  return v_.consumer(c)->deliver.head.load(std::memory_order_acquire) > rec_deliver_pos_[r];
}

void Ingest::drain_releases() {
  uint32_t buf[256];
  for (uint32_t c = 0; c < v_.hdr->consumer_count; ++c) {
    pool::ConsumerBlock* cb = v_.consumer(c);
    const uint32_t* entries = v_.release_entries(c);
    for (;;) {
      const size_t n = ring_pop(cb->release, entries, buf, 256);
      if (!n) break;
      for (size_t i = 0; i < n; ++i) {
        const uint32_t r = buf[i];
        pool::Record* rec = r < v_.hdr->record_count ? v_.record(r) : nullptr;
        if (!rec || rec->state.load(std::memory_order_acquire) != pool::kRecDelivered || rec->owner != c ||
            !taken(c, r)) {
          bump(kBadReleases);
          continue;
        }
        // A submitted request is answered whatever happens: given back unanswered is an error.
        if (rec_sock_[r] < 0) send_status(rec_sock_[r], *rec, wire::kStatusInternal);
        free_record(r, false);
        bump(kRequestsReleased);
      }
    }
  }
}

bool Ingest::answers_pending() const {
  for (uint32_t c = 0; c < v_.hdr->consumer_count; ++c) {
    const pool::AnswerCtl& a = v_.consumer(c)->answer;
    if (a.tail.load() != a.head.load(std::memory_order_relaxed)) return true;
  }
  return false;
}

void Ingest::drain_answers() {
  const uint64_t cap = v_.hdr->answer_ring_bytes;
  for (uint32_t c = 0; c < v_.hdr->consumer_count; ++c) {
    pool::AnswerCtl& a = v_.consumer(c)->answer;
    uint64_t head = a.head.load(std::memory_order_relaxed);
    const uint64_t tail = a.tail.load(std::memory_order_acquire);
    if (head == tail) continue;
    const uint8_t* data = v_.answer_data(c);
    if (tail - head > cap) {  // a consumer wrote nonsense into its control words
      bump(kBadAnswers);
      a.head.store(tail, std::memory_order_release);
      continue;
    }
    while (head < tail) {
      const uint64_t pos = head & (cap - 1);
      if (pos % pool::kAnswerAlign || tail - head < sizeof(pool::AnswerEntry)) {
        // Entries start aligned and are whole: an unaligned position or a tail short of a header is
        // the consumer's nonsense (and reading a header there could run past the ring's end).
        bump(kBadAnswers);
        head = tail;
        break;
      }
      pool::AnswerEntry e;
      std::memcpy(&e, data + pos, sizeof e);
      if (e.entry_len < sizeof e || e.entry_len % pool::kAnswerAlign || e.entry_len > cap - pos ||
          e.entry_len > tail - head || (e.record != pool::kAnswerFiller && e.body_len > e.entry_len - sizeof e)) {
        // Nothing after a corrupt entry can be trusted; its records stay held until reclaimed.
        bump(kBadAnswers);
        head = tail;
        break;
      }
      if (e.record != pool::kAnswerFiller) queue_answer(c, e, data + pos + sizeof e);
      head += e.entry_len;
    }
    // The queued datagrams point into the ring: send them before giving the room back.
    flush_answers();
    a.head.store(head, std::memory_order_release);
  }
}

void Ingest::queue_answer(uint32_t c, const pool::AnswerEntry& e, const uint8_t* body) {
  pool::Record* rec = e.record < v_.hdr->record_count ? v_.record(e.record) : nullptr;
  if (!rec || rec->state.load(std::memory_order_acquire) != pool::kRecDelivered || rec->owner != c ||
      rec->generation != e.generation || !taken(c, e.record)) {
    bump(kBadAnswers);  // taken back (requeued or failed) before the answer came: it has its answer
    return;
  }
  const int sock = rec_sock_[e.record];
  if (sock < 0) {
    // A submitted request: its answer goes back in-process, with the result bytes copied out of the ring.
    const bool ok = e.status == wire::kStatusOk;
    push_local(-sock - 1, LocalAnswer{rec->request_id, e.status, ok ? e.dtype : uint8_t(wire::kDTypeBytes), rec->first_ns,
                           clock_(), ok ? std::string(reinterpret_cast<const char*>(body), e.body_len) : std::string()});
    free_record(e.record, false);
    bump(kRequestsAnswered);
    return;
  }
  const uint32_t payload = std::min<uint32_t>(v_.hdr->max_payload, 65507 - uint32_t(wire::kHeaderSize));
  const uint32_t total = e.status == wire::kStatusOk ? e.body_len : 0;
  const uint32_t chunks = total ? (total + payload - 1) / payload : 1;
  for (uint32_t k = 0; k < chunks; ++k) {
    if (out_n_ == kAnswerBatch || (out_n_ && out_sock_ != sock)) flush_answers();
    out_sock_ = sock;
    const uint32_t len = total ? std::min<uint32_t>(payload, total - k * payload) : 0;
    wire::Header& h = out_hdrs_[out_n_];
    h = wire::Header{};
    h.magic = wire::kMagic;
    h.version = wire::kVersion;
    h.kind = wire::kKindResponse;
    h.status = e.status;
    h.app_id = rec->app_id;
    h.dtype = total ? e.dtype : uint8_t(wire::kDTypeBytes);
    h.chunk_index = k;
    h.chunk_count = chunks;
    h.payload_len = len;
    h.request_id = rec->request_id;
    h.total_len = total;
    h.client_ts_ns = rec->client_ts_ns;
    std::memcpy(&out_addrs_[out_n_], rec->addr, std::min<size_t>(rec->addr_len, sizeof(sockaddr_in6)));
    out_expires_[out_n_] = answer_expiry(*rec);
    out_iov_[2 * out_n_] = iovec{&h, sizeof h};
    out_iov_[2 * out_n_ + 1] = iovec{const_cast<uint8_t*>(body + size_t(k) * payload), len};
    msghdr& mh = out_msgs_[out_n_].msg_hdr;
    mh = msghdr{};
    mh.msg_name = &out_addrs_[out_n_];
    mh.msg_namelen = rec->addr_len;
    mh.msg_iov = &out_iov_[2 * out_n_];
    mh.msg_iovlen = len ? 2 : 1;
    ++out_n_;
  }
  free_record(e.record, false);
  bump(kRequestsAnswered);
}

void Ingest::flush_answers() {
  // Never waits: what the socket will not take now is copied out of the answer ring and held (the
  // ring's room is given back after this returns), retried by the loop until sent or expired.
  size_t off = 0;
  int blocked_tries = 0;
  while (off < out_n_) {
    if (blocked_tries >= kMaxBlockedTries) {
      hold(out_sock_, out_msgs_[off].msg_hdr, out_expires_[off]);
      ++off;
      continue;
    }
    const int rc = send_some(out_sock_, out_msgs_.data() + off, unsigned(out_n_ - off));
    if (rc > 0) {
      off += size_t(rc);
      bump(kResponsesSent, uint64_t(rc));
      continue;
    }
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0 && would_block(errno)) {
      ++blocked_tries;
      hold(out_sock_, out_msgs_[off].msg_hdr, out_expires_[off]);
    } else {
      bump(kResponseSendErrors);  // unreachable client, dead link: this datagram is lost, counted
    }
    ++off;
  }
  out_n_ = 0;
}

size_t Ingest::pick(const std::vector<uint32_t>& cands, uint16_t app_id) {
  // Earliest predicted finish (fixed + per_request * (queued + 1)) when every candidate has a cost
  // model; otherwise the least-loaded queue. Round-robin among equals; full queues are skipped.
  const size_t n = cands.size();
  bool costed = n > 0;
  for (uint32_t c : cands) costed = costed && cost_fixed_us_[c].load(std::memory_order_relaxed) >= 0;
  size_t best = SIZE_MAX;
  double best_score = 0;
  const uint32_t start = rr_[app_id]++;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t c = cands[(start + i) % n];
    const pool::Ring& ring = v_.consumer(c)->deliver;
    const uint64_t depth = ring.tail.load(std::memory_order_relaxed) - ring.head.load(std::memory_order_acquire);
    if (depth >= ring.capacity) continue;
    const double score = costed ? cost_fixed_us_[c].load(std::memory_order_relaxed) +
                                      cost_per_us_[c].load(std::memory_order_relaxed) * double(depth + 1)
                                : double(depth);
    if (best == SIZE_MAX || score < best_score) {
      best_score = score;
      best = (start + i) % n;
    }
  }
  return best;
}

void Ingest::deliver(uint32_t r) {
  pool::Record* rec = v_.record(r);
  const auto& cands = routes_[rec->app_id];
  if (!cands.empty()) {
    const size_t best = pick(cands, rec->app_id);
    if (best != SIZE_MAX) {
      const uint32_t c = cands[best];
      rec->owner = c;
      rec_deliver_pos_[r] = v_.consumer(c)->deliver.tail.load(std::memory_order_relaxed);
      rec->state.store(pool::kRecDelivered, std::memory_order_release);
      ring_push(v_.consumer(c)->deliver, v_.deliver_entries(c), r);
      wake_[c] = 1;
      bump(kRequestsDelivered);
      return;
    }
  }
  bump(kRequestsRejectedQueueFull);
  if (opt_.answer_drops || rec_sock_[r] < 0) send_status(rec_sock_[r], *rec, wire::kStatusOverloaded);
  free_record(r, false);
}

void Ingest::signal_consumers() {
  for (uint32_t c = 0; c < wake_.size(); ++c) {
    if (wake_[c]) {
      ring_signal(v_.consumer(c)->deliver);
      wake_[c] = 0;
    }
  }
}

void Ingest::handle_buffer(int sock, uint8_t* data, size_t len, int msg_flags, size_t seg, const sockaddr_in6& addr,
                           socklen_t addrlen, bool real_slot, uint32_t slot) {
  const size_t slot_size = v_.hdr->slot_size;
  if (seg == 0 || seg >= len) {
    // Received into scratch: larger than a slot means it cannot be kept.
    if (!real_slot && len > slot_size) msg_flags |= MSG_TRUNC;
    handle_packet(sock, data, len, msg_flags, addr, addrlen, real_slot, slot);
    return;
  }
  // A coalesced buffer: datagrams of `seg` bytes back to back, the last one possibly shorter. Each is
  // copied into a slot of its own, so a slot it was received into goes back to the free stack.
  if (real_slot) free_slots_.push_back(slot);
  bump(kGroBuffers);
  for (size_t off = 0; off < len; off += seg) {
    const size_t n = std::min(seg, len - off);
    handle_packet(sock, data + off, n, n > slot_size ? MSG_TRUNC : 0, addr, addrlen, false, 0);
  }
}

void Ingest::feed(int sock, const uint8_t* data, size_t len, size_t gro_seg, const sockaddr_in6& from,
                  socklen_t fromlen) {
  if (running_.load()) throw std::logic_error("Ingest::feed while the receive thread runs");
  if (sock < 0 || size_t(sock) >= socks_.size()) throw std::out_of_range("Ingest::feed: no such socket");
  // As the receive loop: the buffer is scratch (the largest a receive buffer holds), not a pool slot.
  const size_t cap = opt_.gro ? kGroBuffer : v_.hdr->slot_size;
  feed_buf_.assign(data, data + std::min(len, cap));
  handle_buffer(sock, feed_buf_.data(), feed_buf_.size(), len > cap ? MSG_TRUNC : 0, opt_.gro ? gro_seg : 0, from,
                fromlen, false, 0);
  signal_consumers();
  publish_gauges();
}

void Ingest::housekeeping() {
  if (running_.load()) throw std::logic_error("Ingest::housekeeping while the receive thread runs");
  apply_routes();
  run_commands();
  drain_releases();
  drain_answers();
  retry_held();
  signal_consumers();
  expire(clock_());
  publish_gauges();
}

void Ingest::handle_packet(int sock, uint8_t* data, size_t len, int msg_flags, const sockaddr_in6& addr,
                           socklen_t addrlen, bool real_slot, uint32_t slot) {
  // Returns the slot to the free stack when the packet is not kept.
  auto drop = [&](int counter) {
    bump(counter);
    if (real_slot) free_slots_.push_back(slot);
  };
  // packets_received is published last, with release, when the packet has been handled whichever
  // way it leaves: a reader that sees N received (counters() loads it with acquire, first) also sees
  // every other counter that the N packets moved (accepted or the drop, the refusal, the completion).
  struct Received {
    std::atomic<uint64_t>& c;
    ~Received() { c.store(c.load(std::memory_order_relaxed) + 1, std::memory_order_release); }
  } received{cnt_[kPacketsReceived]};
  bump(kBytesReceived, len);
  if (msg_flags & MSG_TRUNC) return drop(kDropOversize);
  wire::Header h;
  const int verdict = wire::check_request(data, len, &h);
  if (verdict != wire::kOk) return drop(kDropTruncated + verdict - 1);
  const int port_app = sock_app_[size_t(sock)];
  const uint32_t stride = wire::chunk_stride(h);
  const Key key{h.request_id, src_key(addr, addrlen), h.app_id};
  // A request the node cannot serve at all is answered once with a status (unless answer_drops is
  // off) and its key remembered, so its other chunks are dropped for the same reason in silence:
  // one answer per request, never one per datagram.
  auto refuse = [&](int counter, uint16_t status) {
    const uint64_t now = clock_();  // the ingest's clock (a fake one under the fuzz harness), never the wall
    auto g = gone_.find(key);
    if (g != gone_.end() && g->second.expires_ns > now) return drop(g->second.reason);
    remember(key, counter, now);
    if (opt_.answer_drops) {
      pool::Record tmp{};
      tmp.app_id = h.app_id;
      tmp.request_id = h.request_id;
      tmp.client_ts_ns = h.client_ts_ns;
      std::memcpy(tmp.addr, &addr, std::min<size_t>(addrlen, sizeof tmp.addr));
      tmp.addr_len = uint8_t(addrlen);
      send_status(sock, tmp, status);
    }
    return drop(counter);
  };
  if ((port_app >= 0 && port_app != h.app_id) || routes_[h.app_id].empty())
    return refuse(kDropUnknownApp, wire::kStatusUnknownApp);
  uint32_t r;
  auto it = active_.find(key);
  if (it == active_.end()) {
    const uint64_t now = clock_();
    auto g = gone_.find(key);
    if (g != gone_.end()) {
      if (g->second.expires_ns > now) return drop(g->second.reason);
      gone_.erase(g);
    }
    if (h.chunk_count > v_.hdr->max_chunks) return refuse(kDropTooManyChunks, wire::kStatusBadRequest);
    if (stride > v_.hdr->max_payload) return refuse(kDropOversize, wire::kStatusBadRequest);
    // Admission: reserve every slot the request will need, so admitted requests always complete
    // and a flood cannot wedge the pool with partial requests.
    if (free_count_ - reserved_ < h.chunk_count) {
      bump(kRequestsRejectedPoolFull);
      return refuse(kDropPoolFull, wire::kStatusOverloaded);
    }
    if (free_records_.empty()) {
      bump(kRequestsRejectedNoRecord);
      return refuse(kDropNoRecord, wire::kStatusOverloaded);
    }
    r = free_records_.back();
    free_records_.pop_back();
    pool::Record* rec = v_.record(r);
    rec->owner = UINT32_MAX;
    rec->app_id = h.app_id;
    rec->dtype = h.dtype;
    rec->chunk_count = h.chunk_count;
    rec->chunks_received = 0;
    rec->stride = stride;
    rec->total_len = h.total_len;
    rec->deadline_us = h.deadline_us;
    rec->request_id = h.request_id;
    rec->client_ts_ns = h.client_ts_ns;
    rec->flags = uint8_t(h.flags & wire::kFlagsKnown);
    rec->first_ns = now;
    rec->complete_ns = 0;
    std::memcpy(rec->addr, &addr, std::min<size_t>(addrlen, sizeof rec->addr));
    rec->addr_len = uint8_t(addrlen);
    rec->state.store(pool::kRecFilling, std::memory_order_release);
    std::fill_n(&bitmaps_[size_t(r) * bitmap_words_], (h.chunk_count + 63) / 64, 0ull);
    rec_sock_[r] = sock;
    rec_key_[r] = key;
    reserved_ += h.chunk_count;
    filling_pos_[r] = int32_t(filling_list_.size());
    filling_list_.push_back(r);
    active_.emplace(key, r);
    bump(kRequestsStarted);
  } else {
    r = it->second;
    const pool::Record* rec = v_.record(r);
    if (rec->chunk_count != h.chunk_count || rec->total_len != h.total_len || rec->stride != stride ||
        rec->dtype != h.dtype)
      return drop(kDropInconsistent);
  }

  pool::Record* rec = v_.record(r);
  uint64_t& word = bitmaps_[size_t(r) * bitmap_words_ + (h.chunk_index >> 6)];
  const uint64_t bit = 1ull << (h.chunk_index & 63);
  if (word & bit) return drop(kDropDuplicate);
  word |= bit;

  uint32_t dst = slot;
  if (!real_slot) {
    // Received into scratch (the pool lent fewer slots than the batch); the reservation
    // guarantees a free slot exists.
    dst = free_slots_.back();
    free_slots_.pop_back();
    std::memcpy(v_.slot(dst), data, len);
  }
  v_.chunkmap(r)[h.chunk_index] = dst;
  --free_count_;
  --reserved_;
  bump(kPacketsAccepted);
  if (++rec->chunks_received == rec->chunk_count) {
    rec->complete_ns = clock_();
    active_.erase(rec_key_[r]);
    remember(rec_key_[r], kDropDuplicate, rec->complete_ns);
    const int32_t pos = filling_pos_[r];
    const uint32_t last = filling_list_.back();
    filling_list_[size_t(pos)] = last;
    filling_pos_[last] = pos;
    filling_list_.pop_back();
    filling_pos_[r] = -1;
    bump(kRequestsCompleted);
    deliver(r);
  }
}

void Ingest::expire(uint64_t now) {
  for (size_t i = 0; i < filling_list_.size();) {
    const uint32_t r = filling_list_[i];
    pool::Record* rec = v_.record(r);
    if (now - rec->first_ns < opt_.timeout_ns) {
      ++i;
      continue;
    }
    active_.erase(rec_key_[r]);
    remember(rec_key_[r], kDropLate, now);
    bump(kRequestsTimedOut);
    if (opt_.answer_drops) send_status(rec_sock_[r], *rec, wire::kStatusDeadlineMissed);
    free_record(r, true);  // moves the last filling entry into position i
  }
  if (now >= next_gone_purge_ns_) {
    for (auto it = gone_.begin(); it != gone_.end();) {
      if (it->second.expires_ns <= now)
        it = gone_.erase(it);
      else
        ++it;
    }
    next_gone_purge_ns_ = now + opt_.dedup_window_ns / 4 + 1;
  }
}

void Ingest::publish_gauges() {
  free_count_pub_.store(free_count_ - reserved_, std::memory_order_relaxed);
  free_records_pub_.store(free_records_.size(), std::memory_order_relaxed);
  filling_pub_.store(filling_list_.size(), std::memory_order_relaxed);
}

void Ingest::run() {
  const uint32_t B = opt_.batch;
  const size_t slot_size = v_.hdr->slot_size;
  // With GRO every message gets a buffer big enough for a coalesced run of datagrams.
  const size_t buf_size = opt_.gro ? kGroBuffer : slot_size;
  std::vector<mmsghdr> msgs(B);
  std::vector<iovec> iov(B);
  std::vector<sockaddr_in6> addrs(B);
  constexpr size_t kCmsgSpace = CMSG_SPACE(sizeof(uint32_t)) + CMSG_SPACE(sizeof(int));
  std::vector<uint8_t> cbufs(B * kCmsgSpace);
  std::vector<uint8_t> scratch(B * buf_size);
  std::vector<uint32_t> lent(B);
  std::vector<uint32_t> kernel_drops(socks_.size(), 0);
  epoll_event events[16];

  while (!stop_.load(std::memory_order_acquire)) {
    apply_routes();
    run_commands();
    drain_releases();
    drain_answers();
    retry_held();
    size_t got_total = 0;
    for (size_t s = 0; s < socks_.size(); ++s) {
      // Without GRO, lend free slots to the kernel so datagrams land in the pool with no copy.
      const uint32_t m = opt_.gro ? 0u : uint32_t(std::min<size_t>(B, free_slots_.size()));
      for (uint32_t i = 0; i < m; ++i) {
        lent[i] = free_slots_.back();
        free_slots_.pop_back();
      }
      for (uint32_t i = 0; i < B; ++i) {
        iov[i].iov_base = i < m ? v_.slot(lent[i]) : &scratch[size_t(i) * buf_size];
        iov[i].iov_len = i < m ? slot_size : buf_size;
        msghdr& mh = msgs[i].msg_hdr;
        mh.msg_name = &addrs[i];
        mh.msg_namelen = sizeof(sockaddr_in6);
        mh.msg_iov = &iov[i];
        mh.msg_iovlen = 1;
        mh.msg_control = &cbufs[i * kCmsgSpace];
        mh.msg_controllen = kCmsgSpace;
        mh.msg_flags = 0;
        msgs[i].msg_len = 0;
      }
      const int n = recvmmsg(socks_[s], msgs.data(), B, MSG_DONTWAIT, nullptr);
      bump(kRecvCalls);
      const uint32_t got = n > 0 ? uint32_t(n) : 0;
      // Routes again, after the receive: a datagram sent after set_route() returned is routed by it,
      // even when this thread was between the top of the loop and recvmmsg when the route changed.
      if (got > 0) apply_routes();
      for (uint32_t i = 0; i < got; ++i) {
        msghdr& mh = msgs[i].msg_hdr;
        size_t seg = 0;
        for (cmsghdr* cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
          if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SO_RXQ_OVFL) {
            uint32_t d;
            std::memcpy(&d, CMSG_DATA(cm), sizeof d);
            if (d > kernel_drops[s]) {
              bump(kKernelDrops, d - kernel_drops[s]);
              kernel_drops[s] = d;
            }
          } else if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == UDP_GRO) {
            int g;
            std::memcpy(&g, CMSG_DATA(cm), sizeof g);
            seg = g > 0 ? size_t(g) : 0;
          }
        }
        handle_buffer(int(s), static_cast<uint8_t*>(iov[i].iov_base), msgs[i].msg_len, mh.msg_flags, seg, addrs[i],
                      mh.msg_namelen, i < m, i < m ? lent[i] : 0);
      }
      for (uint32_t i = got; i < m; ++i) free_slots_.push_back(lent[i]);
      got_total += got;
    }
    signal_consumers();
    const uint64_t now = clock_();
    if (now >= next_expire_ns_) {
      expire(now);
      next_expire_ns_ = now + 1000000;  // every millisecond
    }
    publish_gauges();
    if (got_total == 0) {
      // Nothing pending: sleep until a datagram, a command, an answer, or the next housekeeping
      // tick. Sequentially consistent: the idle flag is set before the answer rings are looked at
      // again, and a consumer publishes before it reads the flag (see Pool::answer).
      v_.hdr->ingest_idle.store(1);
      if (!answers_pending()) {
        const int nev = epoll_wait(epfd_, events, 16, 1);
        for (int i = 0; i < nev; ++i) {
          if (events[i].data.u32 == socks_.size()) {
            uint64_t v;
            (void)!read(wakefd_, &v, sizeof v);
          } else if (events[i].data.u32 == socks_.size() + 1) {
            char b[64];
            while (recv(answer_wake_fd_, b, sizeof b, MSG_DONTWAIT) > 0) {
            }
          }
        }
      }
      v_.hdr->ingest_idle.store(0);
    }
  }
  apply_routes();
  run_commands();
  drain_releases();
  drain_answers();
  next_retry_ns_ = 0;
  retry_held();
  // The node is stopping: what the sockets still refuse is counted as not sent.
  bump(kResponseSendErrors, held_.size());
  held_.clear();
  held_bytes_ = 0;
  held_pub_.store(0, std::memory_order_relaxed);
  publish_gauges();
}

}  // namespace gpuprims
