// Native UDP ingest: receives datagrams with recvmmsg straight into pool slots, validates and
// reassembles requests, and hands complete ones to consumer rings. One native thread; no Python.
#pragma once
#include <netinet/in.h>
#include <sys/socket.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "pool_impl.h"

namespace gpuprims {

// Counter indices. Packet-level: every received datagram is accepted or dropped for exactly one
// reason, so packets_received == packets_accepted + sum(drop_*). Request-level counters follow.
enum Counter : int {
  kPacketsReceived = 0,
  kBytesReceived,
  kPacketsAccepted,
  kDropTruncated,     // verdicts 1..8 map to kDropTruncated + verdict - 1
  kDropBadMagic,
  kDropBadVersion,
  kDropBadKind,
  kDropBadLength,
  kDropBadChunk,
  kDropBadTotal,
  kDropBadDType,
  kDropOversize,      // datagram larger than a slot
  kDropTooManyChunks, // request needs more chunks than a record maps
  kDropUnknownApp,    // no route for the app id (or the app is not served on this port)
  kDropDuplicate,     // chunk already received, or request already completed
  kDropLate,          // chunk of a request that timed out
  kDropInconsistent,  // disagrees with earlier chunks of its request (count, total, stride, dtype)
  kDropPoolFull,      // request refused at admission (not enough free slots), and its later chunks
  kDropNoRecord,      // request refused at admission (request table full), and its later chunks
  kRequestsStarted,
  kRequestsCompleted,
  kRequestsDelivered,
  kRequestsTimedOut,
  kRequestsRejectedPoolFull,
  kRequestsRejectedNoRecord,
  kRequestsRejectedQueueFull,
  kRequestsReclaimedFailed,  // held by a dead consumer, answered with INSTANCE_FAILED
  kRequestsRequeued,         // held by a dead consumer, handed to another
  kRequestsReleased,
  kBadReleases,              // release of a record not owned by that consumer
  kResponsesSent,            // status responses the ingest sent itself
  kResponseSendErrors,
  kKernelDrops,              // datagrams the kernel dropped on our sockets (SO_RXQ_OVFL)
  kRecvCalls,
  kGroBuffers,               // receive buffers that held more than one datagram (UDP GRO)
  kRequestsAnswered,         // answered by a consumer through its answer ring; the ingest sent it
  kBadAnswers,               // answers refused: record not held by that consumer (taken back), or a corrupt entry
  kLocalSubmitted,           // requests placed in the pool by submit() (the front door), not received
  kLocalAnswered,            // answers of submitted requests handed to their port (any status)
  kLocalDropped,             // answers of submitted requests whose port was closed
  kAnswersExpired,           // answer datagrams held for a full send buffer until their request's deadline passed
  kCounterCount
};

const char* counter_name(int c);

// The answer of a request placed with Ingest::submit(), handed back in-process instead of as datagrams.
struct LocalAnswer {
  uint64_t token;        // the request's token (submit's token0 + row)
  uint16_t status;       // wire::Status
  uint8_t dtype;         // wire::DType of body (OK only)
  uint64_t placed_ns;    // CLOCK_MONOTONIC when the ingest placed it in the pool (0: refused before)
  uint64_t answered_ns;  // CLOCK_MONOTONIC when the ingest took its answer
  std::string body;      // result bytes (OK only)
};

struct ListenSpec {
  std::string host;
  int port = 0;
  int app_id = -1;  // >= 0: only this app is served on this port
};

struct IngestOptions {
  uint64_t timeout_ns = 500000000ull;      // incomplete request timeout
  uint64_t dedup_window_ns = 2000000000ull;  // how long completed/expired keys are remembered
  uint32_t batch = 64;                     // datagrams per recvmmsg
  int rcvbuf_bytes = 32 << 20;
  bool answer_drops = true;                // send a status response for refused / timed-out requests
  // UDP_GRO: the kernel may hand over many equal-size datagrams of a flow in one buffer (loopback
  // GSO sends, NIC GRO). Each is then copied into a slot; without GRO they land in slots directly.
  bool gro = true;
  // An answer datagram the socket will not take now (a full send buffer) is held and retried, never
  // dropped, until its request's deadline (deadline_us from its first datagram) or, for a request
  // without one, this long after its first datagram; then it is counted as answers_expired.
  uint64_t answer_hold_ns = 1000000000ull;
  size_t answer_hold_bytes = 32u << 20;  // held answers beyond this are counted as response_send_errors
};

class Ingest {
 public:
  Ingest(Pool* pool, const std::vector<ListenSpec>& listen, const IngestOptions& opts);
  ~Ingest();
  void start();
  void stop();
  bool running() const { return running_.load(); }
  std::vector<int> ports() const { return ports_; }

  void set_route(uint16_t app_id, const std::vector<uint32_t>& consumers);
  std::vector<uint32_t> route(uint16_t app_id);
  // Per-queue cost model (CPU overflow, issue 18): the predicted finish of a request delivered to
  // `consumer` now is fixed_us + per_request_us * (queued + 1). An app whose candidates all have one
  // is routed to the earliest predicted finish; otherwise to the least-loaded queue. A negative
  // fixed_us clears it. Takes effect on the next delivery.
  void set_cost(uint32_t consumer, double fixed_us, double per_request_us);
  std::pair<double, double> cost(uint32_t consumer) const;
  std::array<uint64_t, kCounterCount> counters() const;
  uint64_t free_slots() const { return free_count_pub_.load(std::memory_order_relaxed); }
  uint64_t free_records() const { return free_records_pub_.load(std::memory_order_relaxed); }
  uint64_t filling() const { return filling_pub_.load(std::memory_order_relaxed); }

  // Take back everything a (dead) consumer holds: its route entries are removed; requests it held
  // are handed to `requeue_to` consumers of their app when given (and not full), else answered
  // with INSTANCE_FAILED and freed. Runs on the ingest thread; blocks until done.
  std::pair<uint64_t, uint64_t> reclaim(uint32_t consumer, bool requeue, int timeout_ms);

  // In-process requests (the Open Inference Protocol front door). A submitter opens a local port
  // (an answer queue and its eventfd; up to kLocalPorts at once) and places n requests of row_bytes
  // each (rows back to back at data, copied before submit returns) for app_id into the pool, already
  // complete, routed like reassembled ones. Row i's answer comes back to that port as a LocalAnswer
  // with token token0 + i, never as a datagram: exactly one per row, whatever happens (OK or an
  // instance's status, OVERLOADED when refused at admission, UNKNOWN_APP without a route, BAD_REQUEST
  // when too large for the pool, INSTANCE_FAILED when its instance died and no other took it,
  // INTERNAL when an instance released it unanswered). Placement runs on the ingest thread (directly
  // when it is not running). Answers for a closed port are dropped (counted in local_dropped).
  static constexpr int kLocalPorts = 16;
  int local_open();
  void local_close(int port);
  void submit(int port, uint16_t app_id, const uint8_t* data, size_t n, size_t row_bytes, uint8_t dtype,
              uint32_t deadline_us, uint64_t token0);
  // Every answer waiting at the port, oldest first; local_fd(port) (an eventfd) is readable while
  // answers wait. take_local() resets it before it takes them, so none is left unsignalled.
  std::vector<LocalAnswer> take_local(int port);
  int local_fd(int port);

  // Seams for driving the per-datagram step without the thread or a socket receive (the fuzz harness
  // in native/fuzz/ uses them; only while the thread is not running). feed() handles one received
  // buffer as the receive loop does: `gro_seg` > 0 splits a coalesced buffer of `gro_seg`-byte
  // datagrams. housekeeping() does the loop's per-batch chores (routes, commands, releases, expiry).
  // check_invariants() returns "" or what is inconsistent in the slot, record and request accounting.
  using Clock = uint64_t (*)();
  void set_clock(Clock clock) { clock_ = clock; }
  void feed(int sock, const uint8_t* data, size_t len, size_t gro_seg, const sockaddr_in6& from, socklen_t fromlen);
  void housekeeping();
  std::string check_invariants() const;
  // Fault seam (tests, fuzz harness): while set, every answer datagram to a client with this UDP
  // port fails to send as if the socket's send buffer were full (EAGAIN). 0 clears it.
  void set_blocked_port(int port) { blocked_port_.store(port, std::memory_order_relaxed); }
  uint64_t held_answers() const { return held_pub_.load(std::memory_order_relaxed); }

 private:
  struct Key {
    uint64_t request_id;
    uint64_t src;
    uint32_t app_id;
    bool operator==(const Key& o) const {
      return request_id == o.request_id && src == o.src && app_id == o.app_id;
    }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      uint64_t h = k.request_id * 0x9E3779B97F4A7C15ull ^ (k.src + 0x632BE59BD9B4E019ull + (h_rot(k.src)));
      h ^= uint64_t(k.app_id) << 48;
      h ^= h >> 29;
      return size_t(h * 0xBF58476D1CE4E5B9ull);
    }
    static uint64_t h_rot(uint64_t v) { return (v << 21) | (v >> 43); }
  };
  struct Gone {
    uint64_t expires_ns;
    int reason;  // counter index to charge later chunks to
  };
  struct Command {
    std::function<void()> fn;
  };

  void run();
  void handle_buffer(int sock, uint8_t* data, size_t len, int msg_flags, size_t gro_seg, const sockaddr_in6& addr,
                     socklen_t addrlen, bool real_slot, uint32_t slot);
  void handle_packet(int sock, uint8_t* data, size_t len, int msg_flags, const sockaddr_in6& addr,
                     socklen_t addrlen, bool real_slot, uint32_t slot);
  void signal_consumers();
  void deliver(uint32_t rec);
  size_t pick(const std::vector<uint32_t>& cands, uint16_t app_id);  // index in cands, SIZE_MAX if all full
  void free_record(uint32_t rec, bool slots_received_only);
  void drain_releases();
  // Send what consumers published in their answer rings and free the answered records.
  void drain_answers();
  void queue_answer(uint32_t consumer, const pool::AnswerEntry& e, const uint8_t* body);
  void flush_answers();
  // A datagram that would block: copied and held until it is sent or `expires_ns` passes.
  void hold(int sock, const msghdr& mh, uint64_t expires_ns);
  // Try the held datagrams again (in order per destination), count those past their deadline.
  void retry_held();
  int send_some(int sock, mmsghdr* msgs, unsigned n);
  uint64_t answer_expiry(const pool::Record& rec) const;
  bool answers_pending() const;
  void expire(uint64_t now);
  // sock < 0: a submitted request, answered through the local queue (always, whatever answer_drops).
  void send_status(int sock, const pool::Record& rec, uint16_t status);
  // A submitted request's rec_sock_ is -(port + 1).
  // flags: the record's wire flags (wire::kFlagMore on every row of a submit but its last).
  void place_local(int port, uint16_t app_id, const uint8_t* row, size_t row_bytes, uint8_t dtype,
                   uint32_t deadline_us, uint64_t token, uint64_t now, uint8_t flags);
  void push_local(int port, LocalAnswer&& a);
  struct LocalPort {
    std::mutex mu;
    bool open = false;
    int fd = -1;                      // eventfd: readable while answers is not empty
    std::vector<LocalAnswer> answers;  // waiting for take_local()
  };
  LocalPort& local_port(int port);
  void remember(const Key& k, int reason, uint64_t now);
  void apply_routes();
  void run_commands();
  void publish_gauges();
  void bump(int c, uint64_t n = 1) {
    cnt_[c].store(cnt_[c].load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }
  static uint64_t src_key(const sockaddr_in6& a, socklen_t len);

  Pool* pool_;
  pool::View v_;
  Clock clock_ = now_ns;
  std::vector<uint8_t> feed_buf_;  // feed()'s copy of a buffer, as the receive loop's scratch
  IngestOptions opt_;
  std::vector<int> socks_;
  std::vector<int> sock_app_;
  std::vector<int> ports_;
  int epfd_ = -1;
  int wakefd_ = -1;
  int answer_wake_fd_ = -1;  // abstract UNIX datagram socket consumers poke after publishing answers
  std::thread thread_;
  std::atomic<bool> running_{false};
  std::atomic<bool> stop_{false};
  std::array<std::atomic<uint64_t>, kCounterCount> cnt_{};
  std::atomic<uint64_t> free_count_pub_{0}, free_records_pub_{0}, filling_pub_{0};

  // Ingest-thread state.
  std::vector<uint32_t> free_slots_;
  uint64_t free_count_ = 0;  // free slots, counting those lent to the current recvmmsg batch
  uint64_t reserved_ = 0;    // slots promised to admitted, incomplete requests
  std::vector<uint32_t> free_records_;
  std::vector<uint64_t> bitmaps_;  // record_count x words: chunks received
  size_t bitmap_words_ = 0;
  std::vector<int> rec_sock_;      // socket each record's request arrived on
  // Where each delivered record went into its consumer's deliver ring (the ring's tail then): the
  // consumer has taken it once the ring's head is past it. Only a taken record may be answered or
  // released by its consumer; a consumer naming one still queued (garbage in its rings) is refused,
  // or the record would end while its entry waits in the ring, to be taken and served again.
  std::vector<uint64_t> rec_deliver_pos_;
  bool taken(uint32_t c, uint32_t r) const;
  std::vector<Key> rec_key_;
  std::unordered_map<Key, uint32_t, KeyHash> active_;
  std::unordered_map<Key, Gone, KeyHash> gone_;
  std::vector<uint32_t> filling_list_;  // records in kRecFilling (unordered)
  std::vector<int32_t> filling_pos_;
  std::vector<std::vector<uint32_t>> routes_;  // app_id -> consumers (ingest copy)
  std::vector<uint32_t> rr_;                   // round-robin cursor per app
  std::vector<uint8_t> wake_;                  // consumers to signal after a batch
  // Answer datagrams being built (bodies point into answer rings until flushed).
  std::vector<wire::Header> out_hdrs_;
  std::vector<iovec> out_iov_;
  std::vector<mmsghdr> out_msgs_;
  std::vector<sockaddr_in6> out_addrs_;
  std::vector<uint64_t> out_expires_;
  size_t out_n_ = 0;
  int out_sock_ = -1;
  struct Held {
    uint64_t expires_ns;
    int sock;
    socklen_t addr_len;
    sockaddr_in6 addr;
    std::vector<uint8_t> bytes;  // the whole datagram: wire header and payload
  };
  std::vector<Held> held_;  // oldest first
  size_t held_bytes_ = 0;
  uint64_t next_retry_ns_ = 0;
  std::atomic<uint64_t> held_pub_{0};
  std::atomic<int> blocked_port_{0};
  std::unique_ptr<std::atomic<double>[]> cost_fixed_us_, cost_per_us_;  // per consumer; fixed < 0: none
  uint64_t next_expire_ns_ = 0;
  uint64_t next_gone_purge_ns_ = 0;

  // Shared with Python threads.
  std::mutex mu_;
  std::vector<std::vector<uint32_t>> routes_pending_;
  std::vector<uint16_t> routes_dirty_;  // apps whose pending routes changed since the last apply
  std::vector<uint16_t> routed_;        // apps ever given a consumer (the only ones reclaim looks at)
  std::atomic<uint64_t> routes_version_{0};
  uint64_t routes_seen_ = 0;
  std::vector<Command> commands_;
  std::atomic<bool> has_commands_{false};
  std::array<LocalPort, kLocalPorts> local_;
  std::mutex local_open_mu_;
};

}  // namespace gpuprims
