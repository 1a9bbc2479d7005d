// libFuzzer harness of the native ingest's per-datagram step (header checks, reassembly,
// admission, delivery, releases, timeouts, reclaim of a dead consumer), driven without a receive
// thread through Ingest::feed/housekeeping on a fake clock. After every step it checks
// Ingest::check_invariants (every slot free or held by exactly one request, reservations equal the
// chunks still awaited, every datagram accepted or dropped for one reason) and that each request a
// consumer pops is complete and assembled only from its own chunks. Rows placed in-process through a
// local port (Ingest::submit, the front door's way in) are requests like any other, and each gets
// exactly one answer at its port: one never submitted or answered twice aborts at once, one never
// answered by the end of the input aborts then. At the end of an input every
// consumer hands back what it holds and the clock jumps past the reassembly timeout and the dedup
// window, after which the pool must be entirely free again: each input starts from a clean state.
//
// Consumers also answer through their answer rings (Pool::answer, with right or stale generations),
// and write raw fuzz bytes into them (entries, fillers, lengths, a tail anywhere); answers to one
// client may be refused as by a full send buffer (Ingest::set_blocked_port) and held until sent or
// expired. With the same invariants: each answer or refused entry is counted, the ingest goes on, a
// held request ends only through its consumer's answer or release (once: afterwards a stale answer
// is refused), and at the end of an input nothing is held or waiting to be sent.
//
// An input is a list of operations (see `run_op`). Build and run: bench/fuzz.py, or
// scripts/build-fuzz.sh then `build/fuzz/fuzz_ingest tests/fuzz/corpus`.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "../src/ingest.h"

namespace {

using gpuprims::Ingest;
using gpuprims::Pool;
namespace w = gpuprims::wire;

// Small on purpose: a few requests fill the pool, the request table and the consumer rings.
constexpr uint32_t kSlots = 40, kPayload = 64, kRecords = 6, kMaxChunks = 12, kConsumers = 3;
constexpr uint64_t kTimeoutNs = 5000000, kDedupNs = 20000000, kAnswerHoldNs = 8000000;
constexpr uint32_t kAnswerRing = 4096;  // bytes per consumer (the least a pool takes): a few answers fill it
constexpr int kSources = 4;

uint64_t g_now = 1000000000ull;
const bool g_trace = std::getenv("GPUPRIMS_FUZZ_TRACE") != nullptr;  // each op on stderr (a crash's story)
uint64_t fake_clock() { return g_now; }

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "fuzz_ingest: invariant broken: %s\n", what.c_str());
  std::abort();
}

struct Side {  // one pool + ingest (with and without UDP GRO)
  Pool* pool = nullptr;
  Ingest* ingest = nullptr;
  std::vector<uint32_t> held[kConsumers];  // records each consumer popped and has not released
  int port = -1;                           // the local port rows are submitted through
  uint64_t next_token = 1;
  std::set<uint64_t> outstanding;          // tokens submitted and not answered yet
  std::vector<uint32_t> gen[kConsumers];   // and their generations when popped
};

struct World {
  Side side[2];
  int sink = -1;  // where status answers to IPv4 sources go (never read; the kernel drops the excess)
  sockaddr_in6 src[kSources]{};
  socklen_t src_len[kSources]{};
};

World* make_world() {
  auto* wd = new World;
  wd->sink = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (wd->sink < 0 || bind(wd->sink, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) die("cannot bind the sink");
  socklen_t al = sizeof a;
  getsockname(wd->sink, reinterpret_cast<sockaddr*>(&a), &al);
  // Three IPv4 clients (distinct ports of loopback: distinct request keys) and one IPv6 one (an
  // answer to it fails to send from the IPv4 socket, and is counted as a send error).
  for (int i = 0; i < 3; ++i) {
    sockaddr_in s = a;
    s.sin_port = htons(uint16_t(ntohs(a.sin_port) + i));
    std::memcpy(&wd->src[i], &s, sizeof s);
    wd->src_len[i] = sizeof s;
  }
  sockaddr_in6 s6{};
  s6.sin6_family = AF_INET6;
  s6.sin6_addr = in6addr_loopback;
  s6.sin6_port = a.sin_port;
  wd->src[3] = s6;
  wd->src_len[3] = sizeof s6;

  for (int g = 0; g < 2; ++g) {
    gpuprims::PoolParams pp;
    pp.slot_count = kSlots;
    pp.max_payload = kPayload;
    pp.record_count = kRecords;
    pp.max_chunks = kMaxChunks;
    pp.consumer_count = kConsumers;
    pp.answer_ring_bytes = kAnswerRing;
    const std::string name = "/gpuprims-fuzz-" + std::to_string(getpid()) + "-" + std::to_string(g);
    wd->side[g].pool = Pool::create(name, pp);
    gpuprims::IngestOptions o;
    o.timeout_ns = kTimeoutNs;
    o.dedup_window_ns = kDedupNs;
    o.rcvbuf_bytes = 1 << 16;
    o.gro = g == 1;
    o.answer_hold_ns = kAnswerHoldNs;
    o.answer_hold_bytes = 4096;  // a few held datagrams fill it: the overflow path is reached too
    // Socket 0 serves every app, socket 1 only app 2.
    std::vector<gpuprims::ListenSpec> listen{{"127.0.0.1", 0, -1}, {"127.0.0.1", 0, 2}};
    wd->side[g].ingest = new Ingest(wd->side[g].pool, listen, o);
    wd->side[g].ingest->set_clock(fake_clock);
    wd->side[g].port = wd->side[g].ingest->local_open();
  }
  return wd;
}

World* g_world = nullptr;

void close_world() {
  // The creator's close unlinks the shared memory, so a run leaves nothing in /dev/shm.
  for (Side& s : g_world->side) {
    delete s.ingest;
    s.pool->close();
  }
  ::close(g_world->sink);
}

World& world() {
  if (!g_world) {
    g_world = make_world();
    std::atexit(close_world);
  }
  return *g_world;
}

struct Reader {
  const uint8_t* p;
  size_t n;
  bool empty() const { return n == 0; }
  uint8_t u8() {
    if (!n) return 0;
    --n;
    return *p++;
  }
  uint16_t u16() { return uint16_t(u8() | (u8() << 8)); }
  uint32_t u32() { return uint32_t(u16() | (uint32_t(u16()) << 16)); }
};

void check(Side& s) {
  const std::string err = s.ingest->check_invariants();
  if (!err.empty()) die(err);
}

// A consumer popped record r: it must be a complete request owned by c, every chunk in its own slot
// holding that request's header for that chunk.
void check_delivered(Side& s, uint32_t c, uint32_t r) {
  const gpuprims::pool::View& v = s.pool->view();
  if (r >= v.hdr->record_count) die("delivered record index out of range");
  const gpuprims::pool::Record* rec = v.record(r);
  if (rec->state.load() != gpuprims::pool::kRecDelivered || rec->owner != c)
    die("popped record " + std::to_string(r) + " is not delivered to consumer " + std::to_string(c));
  if (rec->chunks_received != rec->chunk_count) die("popped an incomplete request");
  const uint32_t* map = v.chunkmap(r);
  for (uint32_t i = 0; i < rec->chunk_count; ++i) {
    w::Header h;
    std::memcpy(&h, v.slot(map[i]), sizeof h);
    const uint32_t want_len = i + 1 < rec->chunk_count ? rec->stride : rec->total_len - rec->stride * (rec->chunk_count - 1);
    if (h.request_id != rec->request_id || h.app_id != rec->app_id || h.chunk_index != i ||
        h.chunk_count != rec->chunk_count || h.total_len != rec->total_len || h.payload_len != want_len ||
        h.dtype != rec->dtype)
      die("request " + std::to_string(rec->request_id) + " chunk " + std::to_string(i) + " holds another datagram");
  }
}

void reset_routes(Side& s) {
  s.ingest->set_route(1, {0, 1});
  s.ingest->set_route(2, {2});
  s.ingest->set_route(3, {});
  s.ingest->set_route(4, {1});
  s.ingest->housekeeping();
}

// A syntactically plausible request chunk built from a few fuzz bytes, so the fuzzer reaches
// reassembly without having to find the magic and a consistent length first.
std::vector<uint8_t> make_chunk(Reader& in, uint32_t index_override = UINT32_MAX, uint32_t* count_out = nullptr) {
  const uint8_t b0 = in.u8(), b1 = in.u8(), b2 = in.u8(), b3 = in.u8(), b4 = in.u8(), b5 = in.u8();
  const uint16_t app = uint16_t(1 + b0 % 5);
  const uint64_t rid = b1 % 4;
  const uint32_t count = 1 + b2 % (kMaxChunks + 2);
  const uint32_t stride = 1 + b3 % (kPayload + 8);
  const uint32_t last = 1 + b4 % stride;
  uint32_t index = index_override != UINT32_MAX ? index_override : b5 % (count + 1);
  w::Header h{};
  h.magic = w::kMagic;
  h.version = w::kVersion;
  h.kind = w::kKindRequest;
  h.app_id = app;
  h.dtype = uint8_t((b0 >> 4) % (w::kDTypeMax + 2));  // every wire dtype and one past the last
  h.chunk_index = index;
  h.chunk_count = count;
  h.request_id = rid;
  h.total_len = stride * (count - 1) + last;
  if (b2 & 0x80) h.total_len += uint32_t((b4 >> 6) % 3) - 1;  // now and then an inconsistent total
  h.payload_len = index + 1 < count ? stride : last;
  h.deadline_us = b5;
  h.client_ts_ns = g_now;
  std::vector<uint8_t> d(w::kHeaderSize + h.payload_len);
  std::memcpy(d.data(), &h, sizeof h);
  for (size_t k = w::kHeaderSize; k < d.size(); ++k) d[k] = uint8_t(rid * 31 + index * 7 + k);
  if (count_out) *count_out = count;
  return d;
}

std::vector<uint8_t> g_last;
int g_last_src = 0, g_last_sock = 0;

void feed(Side& s, int src, int sock, const std::vector<uint8_t>& d, size_t seg) {
  World& wd = world();
  s.ingest->feed(sock, d.data(), d.size(), seg, wd.src[src], wd.src_len[src]);
  g_last = d;
  g_last_src = src;
  g_last_sock = sock;
}

void pop(Side& s, uint32_t c, size_t n) {
  uint32_t out[kRecords + 1];
  const size_t got = s.pool->poll(c, out, n, 0, 0);
  for (size_t i = 0; i < got; ++i) {
    check_delivered(s, c, out[i]);
    s.held[c].push_back(out[i]);
    s.gen[c].push_back(s.pool->view().record(out[i])->generation);
  }
}

void release(Side& s, uint32_t c, size_t n) {
  auto& h = s.held[c];
  n = std::min(n, h.size());
  const size_t done = s.pool->release(c, h.data(), n);
  h.erase(h.begin(), h.begin() + long(done));
  s.gen[c].erase(s.gen[c].begin(), s.gen[c].begin() + long(done));
}

// Every answer at the local port must be of a row submitted and not answered yet.
void take_local(Side& s) {
  for (const auto& a : s.ingest->take_local(s.port)) {
    if (!s.outstanding.erase(a.token)) die("token " + std::to_string(a.token) + " answered twice or never submitted");
  }
}

// What consumer c holds is still delivered to it with the generation it popped; a record that is not
// has ended, which only an answer of c may do (`may_end`): it is dropped from the held list then, so
// it can never be answered or released a second time by this consumer's book-keeping.
void sync_held(Side& s, uint32_t c, bool may_end) {
  const gpuprims::pool::View& v = s.pool->view();
  size_t keep = 0;
  for (size_t i = 0; i < s.held[c].size(); ++i) {
    const gpuprims::pool::Record* rec = v.record(s.held[c][i]);
    const bool mine = rec->state.load() == gpuprims::pool::kRecDelivered && rec->owner == c &&
                      rec->generation == s.gen[c][i];
    if (!mine && !may_end) die("record " + std::to_string(s.held[c][i]) + " held by consumer " + std::to_string(c) +
                               " ended without its answer or release");
    if (mine) {
      s.held[c][keep] = s.held[c][i];
      s.gen[c][keep] = s.gen[c][i];
      ++keep;
    }
  }
  s.held[c].resize(keep);
  s.gen[c].resize(keep);
}

bool ring_corrupt(Side& s, uint32_t c) {
  const gpuprims::pool::AnswerCtl& a = s.pool->view().consumer(c)->answer;
  const uint64_t tail = a.tail.load(), head = a.head.load();
  return tail % gpuprims::pool::kAnswerAlign || tail - head > kAnswerRing;
}

uint64_t counter(Side& s, int c) { return s.ingest->counters()[size_t(c)]; }

void run_op(Side& s, Reader& in) {
  const uint8_t op = in.u8();
  const uint8_t a = in.u8();
  if (g_trace) std::fprintf(stderr, "op %d a=%d (c=%d)\n", op % 16, a, a % kConsumers);
  switch (op % 16) {
    case 0: {  // a raw datagram (the header checks), maybe a coalesced GRO buffer
      const size_t len = in.u16() % 1400;
      std::vector<uint8_t> d(len);
      for (auto& x : d) x = in.u8();
      const uint8_t segb = in.u8();
      feed(s, a % kSources, (a >> 2) % 2, d, segb < 200 ? 0 : size_t(segb - 199) * 16);
      break;
    }
    case 1: case 2: {  // one plausible chunk
      const auto d = make_chunk(in);
      feed(s, a % kSources, (a >> 2) % 2, d, 0);
      break;
    }
    case 3: {  // every chunk of a request, some left out, in rotated or reversed order
      Reader peek = in;
      uint32_t count = 0;
      (void)make_chunk(peek, 0, &count);
      const uint16_t leave_out = in.u16();
      const uint32_t rot = a % count;
      Reader base = in;
      for (uint32_t k = 0; k < count; ++k) {
        const uint32_t i = (a & 0x80) ? count - 1 - k : (k + rot) % count;
        if (i < 16 && (leave_out >> i & 1) && (leave_out & 0x8000)) continue;
        Reader r = base;
        const auto d = make_chunk(r, i);
        feed(s, (a >> 3) % kSources, (a >> 5) % 2, d, 0);
      }
      (void)make_chunk(in);  // consume the request's bytes
      break;
    }
    case 4: {  // several equal-size chunks of one request in one coalesced (GRO) buffer
      Reader base = in;
      uint32_t count = 0;
      const auto first = make_chunk(base, 0, &count);
      std::vector<uint8_t> buf;
      const uint32_t n = 1 + a % std::max<uint32_t>(1, count);
      for (uint32_t i = 0; i < n; ++i) {
        Reader r = in;
        const auto d = make_chunk(r, i);
        buf.insert(buf.end(), d.begin(), d.end());
      }
      (void)make_chunk(in);
      feed(s, (a >> 4) % kSources, 0, buf, first.size());
      break;
    }
    case 5:  // time passes; the loop's chores run
      g_now += uint64_t(a) * 250000;
      s.ingest->housekeeping();
      break;
    case 6:  // a consumer takes delivered requests
      pop(s, a % kConsumers, 1 + (a >> 2) % 4);
      break;
    case 7:  // a consumer hands requests back
      release(s, a % kConsumers, 1 + (a >> 2) % 4);
      s.ingest->housekeeping();
      break;
    case 8: {  // a buggy consumer releases one of its records twice, or one it does not own
      const uint32_t c = a % kConsumers;
      if ((a & 4) && !s.held[c].empty()) {
        const uint32_t r = s.held[c].back();
        s.held[c].pop_back();
        s.gen[c].pop_back();
        const uint32_t twice[2] = {r, r};
        s.pool->release(c, twice, 2);
      } else {
        const uint32_t r = (a >> 3) % kRecords;
        const gpuprims::pool::Record* rec = s.pool->view().record(r);
        if (!(rec->state.load() == gpuprims::pool::kRecDelivered && rec->owner == c)) s.pool->release(c, &r, 1);
      }
      s.ingest->housekeeping();
      break;
    }
    case 9: {  // a consumer dies: what it holds is requeued or answered INSTANCE_FAILED
      const uint32_t c = a % kConsumers;
      s.ingest->reclaim(c, (a >> 2) & 1, 1000);
      s.held[c].clear();
      s.gen[c].clear();
      break;
    }
    case 10: {  // routes change
      std::vector<uint32_t> cons;
      for (uint32_t c = 0; c < kConsumers; ++c)
        if ((a >> (2 + c)) & 1) cons.push_back(c);
      s.ingest->set_route(uint16_t(1 + a % 4), cons);
      s.ingest->housekeeping();
      break;
    }
    case 11:  // the last datagram again (a duplicate), maybe from another client
      if (!g_last.empty()) feed(s, (a & 1) ? g_last_src : a % kSources, g_last_sock, g_last, 0);
      break;
    case 12: {  // a consumer answers some of what it holds (OK with a result, or an error status)
      const uint32_t c = a % kConsumers;
      const size_t n = std::min<size_t>(1 + (a >> 2) % 3, s.held[c].size());
      const uint8_t b = in.u8(), blen = in.u8();
      std::vector<uint32_t> gens(s.gen[c].begin(), s.gen[c].begin() + long(n));
      if (a & 0x80)
        for (auto& g : gens) g -= 1;  // stale: the ingest must refuse these and keep the records held
      std::vector<uint16_t> statuses(n, uint16_t(b & 1 ? w::kStatusOk : 1 + b % 8));
      std::vector<uint8_t> body(size_t(blen) * std::max<size_t>(n, 1), uint8_t(b));
      const uint64_t answered0 = counter(s, gpuprims::kRequestsAnswered), bad0 = counter(s, gpuprims::kBadAnswers);
      size_t published = 0;
      try {
        published = s.pool->answer(c, s.held[c].data(), gens.data(), n, statuses.data(), body.data(), blen,
                                   w::kDTypeBytes, 0);
      } catch (const std::runtime_error&) {  // its ring's control words are corrupt (case 13): it gives up
        if (!ring_corrupt(s, c)) die("Pool::answer refused a sound ring");
      }
      s.ingest->housekeeping();
      sync_held(s, c, !(a & 0x80));
      const uint64_t answered = counter(s, gpuprims::kRequestsAnswered) - answered0;
      const uint64_t bad = counter(s, gpuprims::kBadAnswers) - bad0;
      // Every published answer is counted once: sent (its record ended) or refused.
      if (answered + bad != published)
        die("published " + std::to_string(published) + " answers, " + std::to_string(answered) + " answered and " +
            std::to_string(bad) + " refused");
      if ((a & 0x80) && answered) die("a stale answer was taken");
      break;
    }
    case 13: {  // raw bytes into a consumer's answer ring, and a tail published anywhere
      const uint32_t c = a % kConsumers;
      gpuprims::pool::AnswerCtl& actl = s.pool->view().consumer(c)->answer;
      uint8_t* data = s.pool->view().answer_data(c);
      const uint64_t tail = actl.tail.load();
      const size_t n = in.u8() % 96;
      for (size_t k = 0; k < n; ++k) data[(tail + k) % kAnswerRing] = in.u8();
      if (a & 0x40 && !s.held[c].empty()) {  // now and then a well-formed entry naming a held record
        gpuprims::pool::AnswerEntry e{};
        e.record = s.held[c][a % s.held[c].size()];
        e.generation = s.gen[c][a % s.held[c].size()] + ((a & 0x20) ? 1 : 0);
        e.entry_len = gpuprims::pool::kAnswerAlign * (1 + in.u8() % 3);
        e.body_len = in.u8() % 48;
        e.status = uint16_t(in.u8() % 10);
        if (tail % gpuprims::pool::kAnswerAlign == 0 && kAnswerRing - tail % kAnswerRing >= sizeof e)
          std::memcpy(data + tail % kAnswerRing, &e, sizeof e);
      }
      const uint16_t adv = in.u16();
      actl.tail.store(tail + ((a & 0x10) ? adv : (adv % 8) * gpuprims::pool::kAnswerAlign));
      s.ingest->housekeeping();
      sync_held(s, c, true);
      break;
    }
    case 14: {  // answers to one client are refused as by a full send buffer, or no longer; time passes
      World& wd = world();
      const int src = a % (kSources + 1);
      s.ingest->set_blocked_port(src < kSources ? ntohs(wd.src[src].sin6_port) : 0);
      g_now += uint64_t(a >> 4) * 1000000;
      s.ingest->housekeeping();
      break;
    }
    case 15: {  // rows placed in-process (some too large for a record, some of apps without a route)
      const size_t n = 1 + a % 3;
      const size_t row = 1 + in.u16() % (kPayload * (kMaxChunks + 4));
      std::vector<uint8_t> rows(n * row);
      for (size_t k = 0; k < rows.size(); ++k) rows[k] = uint8_t(k * 13 + a);
      s.ingest->submit(s.port, uint16_t(1 + (a >> 2) % 5), rows.data(), n, row, uint8_t((a >> 5) % 3), a, s.next_token);
      for (size_t i = 0; i < n; ++i) s.outstanding.insert(s.next_token + i);
      s.next_token += n;
      break;
    }
  }
  take_local(s);
  for (uint32_t c = 0; c < kConsumers; ++c) sync_held(s, c, false);
  check(s);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  World& wd = world();
  Reader in{data, size};
  if (g_trace) std::fprintf(stderr, "input of %zu bytes\n", size);
  Side& s = wd.side[in.u8() & 1];
  g_last.clear();
  reset_routes(s);
  for (int steps = 0; !in.empty() && steps < 256; ++steps) run_op(s, in);
  // Clean up as live consumers and time would: everything must come back.
  for (uint32_t c = 0; c < kConsumers; ++c) {
    pop(s, c, kRecords);
    release(s, c, s.held[c].size());
    if (!s.held[c].empty()) die("a release ring refused records it must hold");
  }
  s.ingest->set_blocked_port(0);
  s.ingest->housekeeping();
  g_now += kTimeoutNs + kDedupNs + kAnswerHoldNs + 1;
  s.ingest->housekeeping();
  check(s);
  if (s.ingest->held_answers() != 0)
    die(std::to_string(s.ingest->held_answers()) + " answers still held after their deadline");
  // A consumer that scribbled over its ring's control words is taken back, as the node would, so the
  // next input starts with sound rings.
  for (uint32_t c = 0; c < kConsumers; ++c)
    if (ring_corrupt(s, c)) s.ingest->reclaim(c, false, 1000);
  take_local(s);
  if (!s.outstanding.empty())
    die(std::to_string(s.outstanding.size()) + " submitted rows never answered, first token " +
        std::to_string(*s.outstanding.begin()));
  const auto free_slots = s.ingest->free_slots();
  const auto free_recs = s.ingest->free_records();
  if (free_slots != kSlots || free_recs != kRecords || s.ingest->filling() != 0)
    die("after the input: " + std::to_string(free_slots) + " free slots of " + std::to_string(kSlots) + ", " +
        std::to_string(free_recs) + " free records of " + std::to_string(kRecords));
  return 0;
}
