// Traffic-tool helpers (see traffic.h): the paced batch sender (sendmmsg, UDP GSO) and the batch
// receiver (recvmmsg) for gpuprims.traffic. No Python here: the bindings are in traffic_bind.cpp.
#include "traffic.h"

#include <arpa/inet.h>
#include <netinet/udp.h>
#include <poll.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "gpuprims/wire.h"

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef SO_RXQ_OVFL
#define SO_RXQ_OVFL 40
#endif

namespace gpuprims {
namespace traffic {
namespace {

namespace w = wire;

inline int64_t thread_cpu_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

constexpr size_t kMaxGsoBytes = 65000;  // below the 65507-byte UDP/IPv4 payload limit
constexpr int kMaxGsoSegs = 64;         // UDP_MAX_SEGMENTS on every kernel with UDP GSO

// Stateless check of one response datagram (wire.check_response's rules).
inline int check_response(const uint8_t* data, size_t len, w::Header* h) {
  if (len < w::kHeaderSize) return w::kTruncated;
  std::memcpy(h, data, w::kHeaderSize);
  if (h->magic != w::kMagic) return w::kBadMagic;
  if (h->version != w::kVersion) return w::kBadVersion;
  if (h->kind != w::kKindResponse) return w::kBadKind;
  if (h->payload_len != len - w::kHeaderSize) return w::kBadLength;
  if (h->chunk_count == 0 || h->chunk_index >= h->chunk_count) return w::kBadChunk;
  if (h->total_len && w::chunk_stride(*h) == 0) return w::kBadTotal;
  return w::kOk;
}

}  // namespace

int64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);  // the clock of Python's time.monotonic_ns()
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

Sender::Sender(std::vector<int> fds, bool gso, uint32_t max_batch_pkts, int64_t spin_ns)
    : fds_(std::move(fds)), gso_(gso), max_batch_(std::max<uint32_t>(1, max_batch_pkts)),
      spin_ns_(spin_ns) {
  if (fds_.empty()) throw std::invalid_argument("Sender needs at least one socket");
  if (max_batch_ > 8192) throw std::invalid_argument("max_batch_pkts must be <= 8192");
}

uint64_t Sender::run(const SendPlan& in) {
  const size_t n_ev = in.ev_time.size;
  if (in.ev_unit.size != n_ev || in.ev_rid.size != n_ev || in.ev_sock.size != n_ev ||
      in.ev_dest.size != n_ev || in.ev_sent.size != n_ev)
    throw std::invalid_argument("event arrays differ in length");
  const size_t n_pkt = in.pkt_off.size;
  if (in.pkt_len.size != n_pkt || in.pkt_patch.size != n_pkt)
    throw std::invalid_argument("packet arrays differ in length");
  const size_t n_unit = in.unit_first.size;
  if (in.unit_count.size != n_unit) throw std::invalid_argument("unit arrays differ in length");
  const size_t n_dest = in.dest_ip.size;
  if (in.dest_port.size != n_dest) throw std::invalid_argument("dest arrays differ in length");
  const uint8_t* base = in.pool.data;
  const size_t pool_len = in.pool.size;
  for (size_t p = 0; p < n_pkt; ++p) {
    if (in.pkt_off[p] + in.pkt_len[p] > pool_len || in.pkt_len[p] == 0 || in.pkt_len[p] > 65507)
      throw std::invalid_argument("packet " + std::to_string(p) + " lies outside the pool or has a bad size");
    if (in.pkt_patch[p] && in.pkt_len[p] < w::kHeaderSize)
      throw std::invalid_argument("packet " + std::to_string(p) + " is patched but shorter than a header");
  }
  for (size_t u = 0; u < n_unit; ++u)
    if (in.unit_count[u] == 0 || static_cast<uint64_t>(in.unit_first[u]) + in.unit_count[u] > n_pkt)
      throw std::invalid_argument("unit " + std::to_string(u) + " has no packets or lies outside the table");
  for (size_t e = 0; e < n_ev; ++e) {
    if (in.ev_unit[e] >= n_unit || in.ev_sock[e] >= fds_.size() || in.ev_dest[e] >= n_dest)
      throw std::invalid_argument("event " + std::to_string(e) + " names a missing unit, socket or dest");
    if (e && in.ev_time[e] < in.ev_time[e - 1]) throw std::invalid_argument("event times must not decrease");
  }

  std::vector<sockaddr_in> addrs(n_dest);
  for (size_t d = 0; d < n_dest; ++d) {
    addrs[d] = {};
    addrs[d].sin_family = AF_INET;
    addrs[d].sin_addr.s_addr = in.dest_ip[d];  // network order already
    addrs[d].sin_port = htons(in.dest_port[d]);
  }

  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);  // precise nanosleep wake-ups for this thread
  const int64_t cpu0 = thread_cpu_ns();

  std::vector<Slot> slots;
  slots.reserve(max_batch_);
  std::vector<Slot> ordered(max_batch_);
  std::vector<uint8_t> scratch(static_cast<size_t>(max_batch_) * w::kHeaderSize);
  std::vector<iovec> iov(2 * static_cast<size_t>(max_batch_));
  std::vector<mmsghdr> msgs(max_batch_);
  std::vector<char> ctl(static_cast<size_t>(max_batch_) * CMSG_SPACE(sizeof(uint16_t)));
  std::vector<uint32_t> msg_pkts(max_batch_);  // packets in each message
  std::vector<uint16_t> msg_seg(max_batch_);   // segment size of each message
  const Plan plan{base, in.pkt_off.data, in.pkt_len.data, in.pkt_patch.data, in.ev_rid.data, in.ev_dest.data,
                  in.ev_sent.data};
  std::vector<uint32_t> sock_count(fds_.size());

  size_t ev = 0;      // next event to start or continue
  uint32_t cur = 0;   // packets of event `ev` already in a batch
  uint64_t started = 0;
  while (ev < n_ev && !stopped()) {
    const int64_t due = in.t0_ns + in.ev_time[ev];
    if (cur == 0) {
      // A duration ends the run at t0 + duration in real time: what is still unsent then (the
      // sender fell behind) stays unsent and shows in the achieved rate.
      if (in.stop_at_ns && due >= in.stop_at_ns) break;
      const int64_t now = mono_ns();
      if (in.stop_at_ns && now >= in.stop_at_ns) break;
      if (due > now) {
        wait_until(due);
        continue;  // re-check stop
      }
    }
    // Collect every packet that is due now, up to the batch size.
    const int64_t now = mono_ns();
    slots.clear();
    size_t e = ev;
    uint32_t c = cur;
    while (e < n_ev && slots.size() < max_batch_) {
      if (c == 0) {
        const int64_t d = in.t0_ns + in.ev_time[e];
        if (d > now || (in.stop_at_ns && (d >= in.stop_at_ns || now >= in.stop_at_ns)) || (e != ev && stopped())) break;
      }
      const uint32_t u = in.ev_unit[e];
      const uint32_t cnt = in.unit_count[u];
      while (c < cnt && slots.size() < max_batch_) slots.push_back({static_cast<uint32_t>(e), in.unit_first[u] + c++});
      if (c == cnt) {
        ++e;
        c = 0;
      }
    }
    ev = e;
    cur = c;
    if (slots.empty()) continue;

    // Group by socket (stable), so each socket gets one sendmmsg per batch.
    std::fill(sock_count.begin(), sock_count.end(), 0);
    for (const Slot& s : slots) ++sock_count[in.ev_sock[s.event]];
    std::vector<uint32_t> start(fds_.size() + 1, 0);
    for (size_t k = 0; k < fds_.size(); ++k) start[k + 1] = start[k] + sock_count[k];
    {
      std::vector<uint32_t> pos(start.begin(), start.end() - 1);
      for (const Slot& s : slots) ordered[pos[in.ev_sock[s.event]]++] = s;
    }
    for (size_t k = 0; k < fds_.size(); ++k) {
      if (start[k] == start[k + 1]) continue;
      send_group(static_cast<int>(k), ordered.data() + start[k], start[k + 1] - start[k], plan, addrs, scratch, iov,
                 msgs, ctl, msg_pkts, msg_seg, started);
    }
  }
  cpu_ns_ += thread_cpu_ns() - cpu0;
  return started;
}

SenderStats Sender::stats() const {
  return {events_.load(), packets_.load(), bytes_.load(), syscalls_.load(), errors_.load(), failed_.load(),
          last_errno_.load(), gso_, cpu_ns_};
}

void Sender::wait_until(int64_t due) {
  for (;;) {
    const int64_t now = mono_ns();
    const int64_t left = due - now;
    if (left <= 0 || stopped()) return;
    if (left > spin_ns_) {
      // Sleep in slices so stop() is seen within 20 ms, waking spin_ns early to spin the rest.
      const int64_t target = std::min<int64_t>(due - spin_ns_, now + 20000000LL);
      timespec ts{static_cast<time_t>(target / 1000000000LL), static_cast<long>(target % 1000000000LL)};
      clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr);
    } else {
      cpu_relax();
    }
  }
}

void Sender::send_group(int sock, const Slot* s, uint32_t n, const Plan& pl, const std::vector<sockaddr_in>& addrs,
                        std::vector<uint8_t>& scratch, std::vector<iovec>& iov, std::vector<mmsghdr>& msgs,
                        std::vector<char>& ctl, std::vector<uint32_t>& msg_pkts, std::vector<uint16_t>& msg_seg,
                        uint64_t& started) {
  // Build messages: consecutive packets to one destination of one size (the last may be shorter)
  // share a message with a UDP_SEGMENT control message.
  uint32_t n_msg = 0, n_iov = 0;
  size_t msg_bytes = 0;
  bool closed = true;
  uint16_t msg_dest = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t p = s[i].pkt;
    const uint32_t len = pl.pkt_len[p];
    const uint16_t dest = pl.ev_dest[s[i].event];
    const bool join = gso_ && !closed && dest == msg_dest && len <= msg_seg[n_msg - 1] &&
                      msg_pkts[n_msg - 1] < kMaxGsoSegs && msg_bytes + len <= kMaxGsoBytes;
    if (!join) {
      mmsghdr& m = msgs[n_msg];
      std::memset(&m, 0, sizeof(m));
      m.msg_hdr.msg_name = const_cast<sockaddr_in*>(&addrs[dest]);
      m.msg_hdr.msg_namelen = sizeof(sockaddr_in);
      m.msg_hdr.msg_iov = &iov[n_iov];
      msg_pkts[n_msg] = 0;
      msg_seg[n_msg] = static_cast<uint16_t>(len);
      ++n_msg;
      msg_bytes = 0;
      msg_dest = dest;
      closed = false;
    }
    mmsghdr& m = msgs[n_msg - 1];
    const uint8_t* pkt = pl.base + pl.pkt_off[p];
    if (pl.pkt_patch[p]) {
      std::memcpy(&scratch[i * w::kHeaderSize], pkt, w::kHeaderSize);
      iov[n_iov++] = {&scratch[i * w::kHeaderSize], w::kHeaderSize};
      if (len > w::kHeaderSize) iov[n_iov++] = {const_cast<uint8_t*>(pkt + w::kHeaderSize), len - w::kHeaderSize};
    } else {
      iov[n_iov++] = {const_cast<uint8_t*>(pkt), len};
    }
    m.msg_hdr.msg_iovlen = &iov[n_iov] - m.msg_hdr.msg_iov;
    ++msg_pkts[n_msg - 1];
    msg_bytes += len;
    if (len < msg_seg[n_msg - 1]) closed = true;  // only the last segment of a GSO message may be short
  }
  for (uint32_t k = 0; k < n_msg; ++k) {
    if (msg_pkts[k] < 2) continue;
    mmsghdr& m = msgs[k];
    char* buf = &ctl[k * CMSG_SPACE(sizeof(uint16_t))];
    std::memset(buf, 0, CMSG_SPACE(sizeof(uint16_t)));
    m.msg_hdr.msg_control = buf;
    m.msg_hdr.msg_controllen = CMSG_SPACE(sizeof(uint16_t));
    cmsghdr* cm = CMSG_FIRSTHDR(&m.msg_hdr);
    cm->cmsg_level = SOL_UDP;
    cm->cmsg_type = UDP_SEGMENT;
    cm->cmsg_len = CMSG_LEN(sizeof(uint16_t));
    std::memcpy(CMSG_DATA(cm), &msg_seg[k], sizeof(uint16_t));
  }
  // Stamp: the request's send time is taken right before the call that sends its first packet.
  const int64_t ts = mono_ns();
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t e = s[i].event;
    if (pl.ev_sent[e] < 0) {
      pl.ev_sent[e] = ts;
      ++started;
    }
    if (pl.pkt_patch[s[i].pkt]) {
      uint8_t* h = &scratch[i * w::kHeaderSize];
      const uint64_t rid = pl.ev_rid[e];
      const uint64_t stamp = static_cast<uint64_t>(pl.ev_sent[e]);
      std::memcpy(h + offsetof(w::Header, request_id), &rid, sizeof(rid));
      std::memcpy(h + offsetof(w::Header, client_ts_ns), &stamp, sizeof(stamp));
    }
  }
  uint32_t done = 0;
  while (done < n_msg) {
    const int r = sendmmsg(fds_[sock], &msgs[done], n_msg - done, 0);
    syscalls_.fetch_add(1, std::memory_order_relaxed);
    if (r > 0) {
      for (int k = 0; k < r; ++k) account(msgs[done + k], msg_pkts[done + k]);
      done += r;
      continue;
    }
    const int err = errno;
    if (err == EINTR) continue;
    if (err == ENOBUFS || err == EAGAIN) {
      timespec ts2{0, 20000};
      nanosleep(&ts2, nullptr);
      continue;
    }
    if (gso_ && msg_pkts[done] > 1 && (err == EIO || err == EINVAL || err == ENOPROTOOPT || err == EOPNOTSUPP)) {
      // This kernel or route cannot segment: send this message's packets one by one from now on.
      gso_ = false;
      resend_unsegmented(sock, msgs[done], msg_pkts[done]);
      ++done;
      continue;
    }
    errors_.fetch_add(1, std::memory_order_relaxed);
    failed_.fetch_add(msg_pkts[done], std::memory_order_relaxed);
    last_errno_.store(err);
    ++done;
  }
  events_.store(started, std::memory_order_relaxed);
}

void Sender::account(const mmsghdr& m, uint32_t pkts) {
  size_t bytes = 0;
  for (size_t j = 0; j < m.msg_hdr.msg_iovlen; ++j) bytes += m.msg_hdr.msg_iov[j].iov_len;
  packets_.fetch_add(pkts, std::memory_order_relaxed);
  bytes_.fetch_add(bytes, std::memory_order_relaxed);
}

void Sender::resend_unsegmented(int sock, const mmsghdr& m, uint32_t pkts) {
  // Split the message's iovecs back into packets: a patched packet is header + payload (2 iovecs,
  // or 1 when it has no payload), a raw one is a single iovec. Their boundaries follow msg_pkts,
  // so walk by the segment size recorded in the control message.
  uint16_t seg = 0;
  std::memcpy(&seg, CMSG_DATA(CMSG_FIRSTHDR(&m.msg_hdr)), sizeof(seg));
  size_t j = 0;
  for (uint32_t k = 0; k < pkts; ++k) {
    msghdr one{};
    one.msg_name = m.msg_hdr.msg_name;
    one.msg_namelen = m.msg_hdr.msg_namelen;
    one.msg_iov = &m.msg_hdr.msg_iov[j];
    size_t got = 0, cnt = 0;
    while (j < m.msg_hdr.msg_iovlen && got < seg) {
      got += m.msg_hdr.msg_iov[j].iov_len;
      ++j;
      ++cnt;
    }
    one.msg_iovlen = cnt;
    ssize_t r;
    do {
      r = sendmsg(fds_[sock], &one, 0);
    } while (r < 0 && errno == EINTR);
    syscalls_.fetch_add(1, std::memory_order_relaxed);
    if (r < 0) {
      errors_.fetch_add(1, std::memory_order_relaxed);
      failed_.fetch_add(1, std::memory_order_relaxed);
      last_errno_.store(errno);
    } else {
      packets_.fetch_add(1, std::memory_order_relaxed);
      bytes_.fetch_add(static_cast<uint64_t>(r), std::memory_order_relaxed);
    }
  }
}

Receiver::Receiver(std::vector<int> fds, uint32_t batch, bool record, bool keep_payloads, bool gro, bool kernel_ts)
    : fds_(std::move(fds)), batch_(std::max<uint32_t>(1, batch)), record_(record), keep_(keep_payloads),
      kernel_ts_(kernel_ts) {
  if (fds_.empty()) throw std::invalid_argument("Receiver needs at least one socket");
  if (batch_ > 1024) throw std::invalid_argument("batch must be <= 1024");
  int one = 1;
  for (int fd : fds_) {
    setsockopt(fd, SOL_SOCKET, SO_RXQ_OVFL, &one, sizeof(one));
    // Kernel receive timestamps: the time the datagram entered the host's receive path, free of
    // this thread's wake-up delay. They come on CLOCK_REALTIME and are mapped to CLOCK_MONOTONIC.
    if (kernel_ts_ && setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof(one)) != 0) kernel_ts_ = false;
    // With UDP_GRO the kernel may hand over several equal-size datagrams as one buffer (and on
    // loopback it then skips segmenting a GSO send); handle() splits them again.
    if (gro && setsockopt(fd, SOL_UDP, UDP_GRO, &one, sizeof(one)) != 0)
      throw std::runtime_error(std::string("setsockopt(UDP_GRO): ") + std::strerror(errno));
  }
  ovfl_.assign(fds_.size(), 0);
}

void Receiver::run(int64_t until_ns) {
  const int64_t cpu0 = thread_cpu_ns();
  const size_t buf_size = 65536;
  std::vector<uint8_t> bufs(static_cast<size_t>(batch_) * buf_size);
  std::vector<iovec> iov(batch_);
  std::vector<mmsghdr> msgs(batch_);
  const size_t ctl_size = CMSG_SPACE(sizeof(uint32_t)) + CMSG_SPACE(sizeof(int)) + CMSG_SPACE(sizeof(timespec)) + 64;
  std::vector<char> ctl(static_cast<size_t>(batch_) * ctl_size);
  std::vector<pollfd> pfd(fds_.size());
  for (size_t k = 0; k < fds_.size(); ++k) pfd[k] = {fds_[k], POLLIN, 0};
  std::vector<Record> local;
  std::vector<uint8_t> local_payload;
  while (!stop_.load(std::memory_order_relaxed)) {
    int timeout_ms = 5;
    if (until_ns) {
      const int64_t left = until_ns - mono_ns();
      if (left <= 0) break;
      timeout_ms = static_cast<int>(std::min<int64_t>(5, (left + 999999) / 1000000));
    }
    const int pr = poll(pfd.data(), pfd.size(), timeout_ms);
    if (pr <= 0) continue;
    for (size_t k = 0; k < fds_.size(); ++k) {
      if (!(pfd[k].revents & POLLIN)) continue;
      for (;;) {
        for (uint32_t i = 0; i < batch_; ++i) {
          iov[i] = {&bufs[i * buf_size], buf_size};
          std::memset(&msgs[i], 0, sizeof(mmsghdr));
          msgs[i].msg_hdr.msg_iov = &iov[i];
          msgs[i].msg_hdr.msg_iovlen = 1;
          msgs[i].msg_hdr.msg_control = &ctl[i * ctl_size];
          msgs[i].msg_hdr.msg_controllen = ctl_size;
        }
        const int r = recvmmsg(fds_[k], msgs.data(), batch_, MSG_DONTWAIT, nullptr);
        const int64_t now = mono_ns();
        timespec rt;
        clock_gettime(CLOCK_REALTIME, &rt);
        // CLOCK_REALTIME - CLOCK_MONOTONIC now; steady over the microseconds a stamp is old.
        const int64_t offset = static_cast<int64_t>(rt.tv_sec) * 1000000000LL + rt.tv_nsec - now;
        syscalls_.fetch_add(1, std::memory_order_relaxed);
        if (r <= 0) break;
        for (int i = 0; i < r; ++i)
          handle(msgs[i], &bufs[i * buf_size], now, offset, static_cast<uint16_t>(k), local, local_payload);
        if (record_ && !local.empty()) {
          std::lock_guard<std::mutex> lock(mu_);
          const uint64_t shift = payload_.size();
          for (Record& rec : local) rec.payload_off += shift;
          records_.insert(records_.end(), local.begin(), local.end());
          payload_.insert(payload_.end(), local_payload.begin(), local_payload.end());
        }
        local.clear();
        local_payload.clear();
        if (static_cast<uint32_t>(r) < batch_) break;
      }
    }
  }
  cpu_ns_ += thread_cpu_ns() - cpu0;
}

Drained Receiver::drain() {
  Drained d;
  std::lock_guard<std::mutex> lock(mu_);
  d.records.swap(records_);
  d.payload.swap(payload_);
  return d;
}

ReceiverStats Receiver::stats() const {
  uint64_t drops = 0;
  for (uint32_t v : ovfl_) drops += v;
  return {datagrams_.load(), bytes_.load(), invalid_.load(), syscalls_.load(), cpu_ns_, drops, kernel_ts_,
          kernel_stamped_.load()};
}

void Receiver::handle(const mmsghdr& m, const uint8_t* data, int64_t now, int64_t rt_offset, uint16_t sock,
                      std::vector<Record>& out, std::vector<uint8_t>& payload) {
  size_t seg = 0;
  for (cmsghdr* cm = CMSG_FIRSTHDR(&m.msg_hdr); cm; cm = CMSG_NXTHDR(const_cast<msghdr*>(&m.msg_hdr), cm)) {
    if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SO_RXQ_OVFL) {
      uint32_t v;
      std::memcpy(&v, CMSG_DATA(cm), sizeof(v));
      ovfl_[sock] = v;  // the socket's running count of datagrams dropped for a full buffer
    } else if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_TIMESTAMPNS) {
      timespec ts;
      std::memcpy(&ts, CMSG_DATA(cm), sizeof(ts));
      const int64_t k = static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec - rt_offset;
      if (ts.tv_sec && k <= now) {
        now = k;
        kernel_stamped_.fetch_add(1, std::memory_order_relaxed);
      }
    } else if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == UDP_GRO) {
      int v;
      std::memcpy(&v, CMSG_DATA(cm), sizeof(v));
      seg = v > 0 ? static_cast<size_t>(v) : 0;
    }
  }
  const size_t total = m.msg_len;
  if (seg == 0 || seg >= total) {
    handle_one(data, total, now, sock, out, payload);
    return;
  }
  for (size_t off = 0; off < total; off += seg) handle_one(data + off, std::min(seg, total - off), now, sock, out, payload);
}

void Receiver::handle_one(const uint8_t* data, size_t len, int64_t now, uint16_t sock, std::vector<Record>& out,
                          std::vector<uint8_t>& payload) {
  datagrams_.fetch_add(1, std::memory_order_relaxed);
  bytes_.fetch_add(len, std::memory_order_relaxed);
  w::Header h{};
  const int v = check_response(data, len, &h);
  if (v != w::kOk) invalid_.fetch_add(1, std::memory_order_relaxed);
  if (!record_) return;
  Record r{};
  r.recv_ns = now;
  r.sock = sock;
  r.verdict = static_cast<uint8_t>(v);
  if (len >= w::kHeaderSize) {
    r.request_id = h.request_id;
    r.client_ts_ns = h.client_ts_ns;
    r.chunk_index = h.chunk_index;
    r.chunk_count = h.chunk_count;
    r.payload_len = static_cast<uint32_t>(len - w::kHeaderSize);
    r.total_len = h.total_len;
    r.app_id = h.app_id;
    r.status = h.status;
    r.dtype = h.dtype;
    if (len >= w::kHeaderSize + 16) {
      std::memcpy(&r.aux0, data + w::kHeaderSize, 8);
      std::memcpy(&r.aux1, data + w::kHeaderSize + 8, 8);
    }
    if (keep_ && v == w::kOk) {
      r.payload_off = payload.size();
      payload.insert(payload.end(), data + w::kHeaderSize, data + len);
    }
  }
  out.push_back(r);
}

}  // namespace traffic
}  // namespace gpuprims
