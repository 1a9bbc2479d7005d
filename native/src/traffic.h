// Internal C++ API of the traffic-tool helpers (not part of the Python surface): a paced batch sender
// (sendmmsg, UDP GSO) and a batch receiver (recvmmsg) for gpuprims.traffic. Python builds the plan
// (packet pool, requests, schedule) once; these loops then run without touching any Python object.
// Plain C++: traffic_bind.cpp converts to and from Python and releases the GIL around run().
#pragma once
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace gpuprims {
namespace traffic {

// CLOCK_MONOTONIC in ns: the clock of Python's time.monotonic_ns().
int64_t mono_ns();

// A borrowed 1-D array: data and length, owned by the caller for the duration of a call.
template <typename T>
struct Span {
  T* data = nullptr;
  size_t size = 0;
  T& operator[](size_t i) const { return data[i]; }
};

// One run of the sender: the packet pool and the tables Python built (gpuprims.traffic.stream.Plan).
// ev_sent is written: each event's send time (it must hold -1 for events not yet sent).
struct SendPlan {
  Span<const uint8_t> pool;
  Span<const uint64_t> pkt_off;
  Span<const uint32_t> pkt_len;
  Span<const uint8_t> pkt_patch;
  Span<const uint32_t> unit_first;
  Span<const uint32_t> unit_count;
  Span<const uint32_t> dest_ip;  // network order
  Span<const uint16_t> dest_port;
  Span<const int64_t> ev_time;
  Span<const uint32_t> ev_unit;
  Span<const uint64_t> ev_rid;
  Span<const uint16_t> ev_sock;
  Span<const uint16_t> ev_dest;
  Span<int64_t> ev_sent;
  int64_t t0_ns = 0;
  int64_t stop_at_ns = 0;  // 0 = no limit
};

struct SenderProgress {
  uint64_t events, packets, bytes;
};

struct SenderStats {
  uint64_t events, packets, bytes, syscalls, send_errors, failed_packets;
  int last_errno;
  bool gso;
  int64_t cpu_ns;
};

// Paced sender. run() sends the events of a plan at absolute times t0 + ev_time_ns[i]; each event
// is one request (a unit: a run of consecutive packets of the pool). Packets that carry our header
// (patch = 1) get the event's request id and the send time as client_ts_ns, stamped right before
// the system call that sends the request's first packet.
class Sender {
 public:
  // Throws std::invalid_argument for no sockets or max_batch_pkts > 8192.
  Sender(std::vector<int> fds, bool gso, uint32_t max_batch_pkts, int64_t spin_ns);

  void stop() { stop_.store(true, std::memory_order_relaxed); }
  bool stopped() const { return stop_.load(std::memory_order_relaxed); }

  // Validates the plan (std::invalid_argument), then sends; blocks until done, stopped or
  // stop_at_ns. Returns the number of events started (stamped) before the run ended.
  uint64_t run(const SendPlan& plan);

  SenderProgress progress() const { return {events_.load(), packets_.load(), bytes_.load()}; }
  SenderStats stats() const;

 private:
  // One packet of the current batch.
  struct Slot {
    uint32_t event;  // index into the events of this run
    uint32_t pkt;    // index into the packet table
  };
  // Raw views of one run's plan arrays.
  struct Plan {
    const uint8_t* base;
    const uint64_t* pkt_off;
    const uint32_t* pkt_len;
    const uint8_t* pkt_patch;
    const uint64_t* ev_rid;
    const uint16_t* ev_dest;
    int64_t* ev_sent;
  };

  void wait_until(int64_t due);
  void send_group(int sock, const Slot* s, uint32_t n, const Plan& pl, const std::vector<sockaddr_in>& addrs,
                  std::vector<uint8_t>& scratch, std::vector<iovec>& iov, std::vector<mmsghdr>& msgs,
                  std::vector<char>& ctl, std::vector<uint32_t>& msg_pkts, std::vector<uint16_t>& msg_seg,
                  uint64_t& started);
  void account(const mmsghdr& m, uint32_t pkts);
  void resend_unsegmented(int sock, const mmsghdr& m, uint32_t pkts);

  std::vector<int> fds_;
  bool gso_;
  uint32_t max_batch_;
  int64_t spin_ns_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> events_{0}, packets_{0}, bytes_{0}, syscalls_{0}, errors_{0}, failed_{0};
  std::atomic<int> last_errno_{0};
  int64_t cpu_ns_ = 0;
};

// One received datagram, as the receiver records it (RECORD_DTYPE in gpuprims/traffic/receiver.py).
#pragma pack(push, 1)
struct Record {
  int64_t recv_ns;
  uint64_t request_id;
  uint64_t client_ts_ns;
  uint64_t aux0;  // first 16 bytes of the body (an echo server's own timestamps), 0 if shorter
  uint64_t aux1;
  uint64_t payload_off;  // into the payload blob when payloads are kept
  uint32_t chunk_index;
  uint32_t chunk_count;
  uint32_t payload_len;
  uint32_t total_len;
  uint16_t app_id;
  uint16_t status;
  uint16_t sock;
  uint8_t verdict;  // 0 = a valid v1 response, else a wire Verdict
  uint8_t dtype;
};
#pragma pack(pop)
static_assert(sizeof(Record) == 72, "Record layout is mirrored in Python");

// What drain() hands over: the records and the payload bytes they point into (payload_off).
struct Drained {
  std::vector<Record> records;
  std::vector<uint8_t> payload;
};

struct ReceiverStats {
  uint64_t datagrams, bytes, invalid, syscalls;
  int64_t cpu_ns;
  uint64_t socket_drops;
  bool kernel_timestamps;
  uint64_t kernel_stamped;
};

// Batch receiver: recvmmsg on every socket it is given, recording each datagram's header (or only
// counting, record = false) with its receive time on CLOCK_MONOTONIC: the kernel's receive timestamp
// where the socket gives one (kernel_ts), else the time recvmmsg returned.
class Receiver {
 public:
  // Throws std::invalid_argument for no sockets or batch > 1024, std::runtime_error if gro is asked
  // for and the socket refuses it.
  Receiver(std::vector<int> fds, uint32_t batch, bool record, bool keep_payloads, bool gro, bool kernel_ts);

  void stop() { stop_.store(true, std::memory_order_relaxed); }

  // Receives until stop() or until the monotonic time until_ns (0 = no limit).
  void run(int64_t until_ns);

  // Records (and payload bytes) received since the last drain.
  Drained drain();

  ReceiverStats stats() const;

 private:
  void handle(const mmsghdr& m, const uint8_t* data, int64_t now, int64_t rt_offset, uint16_t sock,
              std::vector<Record>& out, std::vector<uint8_t>& payload);
  void handle_one(const uint8_t* data, size_t len, int64_t now, uint16_t sock, std::vector<Record>& out,
                  std::vector<uint8_t>& payload);

  std::vector<int> fds_;
  uint32_t batch_;
  bool record_, keep_, kernel_ts_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> kernel_stamped_{0};
  std::mutex mu_;
  std::vector<Record> records_;
  std::vector<uint8_t> payload_;
  std::vector<uint32_t> ovfl_;
  std::atomic<uint64_t> datagrams_{0}, bytes_{0}, invalid_{0}, syscalls_{0};
  int64_t cpu_ns_ = 0;
};

}  // namespace traffic
}  // namespace gpuprims
