// Bindings of the packet pool, ingest and gather.
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "bindings.h"
#include "ingest.h"

namespace gpuprims {

using U32Array = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U32Out = nb::ndarray<uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U16Array = nb::ndarray<const uint16_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using ByteArray2 = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using AnyOut = nb::ndarray<nb::c_contig, nb::device::cpu>;

void bind_pool(nb::module_& m) {
  m.attr("RECORD_SIZE") = sizeof(pool::Record);
  m.def("record_layout", []() {
    nb::dict d;
#define GP_FIELD(name) d[#name] = nb::make_tuple(offsetof(pool::Record, name), sizeof(pool::Record::name))
    GP_FIELD(state);
    GP_FIELD(owner);
    GP_FIELD(app_id);
    GP_FIELD(dtype);
    GP_FIELD(addr_len);
    GP_FIELD(chunk_count);
    GP_FIELD(chunks_received);
    GP_FIELD(stride);
    GP_FIELD(total_len);
    GP_FIELD(deadline_us);
    GP_FIELD(generation);
    GP_FIELD(request_id);
    GP_FIELD(client_ts_ns);
    GP_FIELD(first_ns);
    GP_FIELD(complete_ns);
    GP_FIELD(addr);
#undef GP_FIELD
    return d;
  });

  nb::class_<Pool>(m, "Pool")
      .def_static(
          "create",
          [](const std::string& name, uint32_t slot_count, uint32_t max_payload, uint32_t record_count,
             uint32_t max_chunks, uint32_t consumer_count, uint32_t answer_ring_bytes) {
            PoolParams p{slot_count, max_payload, record_count, max_chunks, consumer_count, answer_ring_bytes};
            return Pool::create(name, p);
          },
          nb::arg("name"), nb::arg("slot_count"), nb::arg("max_payload"), nb::arg("record_count"),
          nb::arg("max_chunks"), nb::arg("consumer_count"), nb::arg("answer_ring_bytes") = 1u << 20,
          nb::rv_policy::take_ownership)
      .def_static("attach", &Pool::attach, nb::arg("name"), nb::rv_policy::take_ownership)
      .def("close", &Pool::close)
      .def_prop_ro("closed", &Pool::closed)
      .def_prop_ro("name", &Pool::name)
      .def_prop_ro("owner", &Pool::owner)
      .def_prop_ro("nbytes", &Pool::nbytes)
      .def_prop_ro("address", [](const Pool& p) { return reinterpret_cast<uintptr_t>(p.view().base); })
      .def("layout",
           [](const Pool& p) {
             const pool::PoolHeader* h = p.view().hdr;
             nb::dict d;
             d["slot_count"] = h->slot_count;
             d["slot_size"] = h->slot_size;
             d["max_payload"] = h->max_payload;
             d["record_count"] = h->record_count;
             d["max_chunks"] = h->max_chunks;
             d["consumer_count"] = h->consumer_count;
             d["ring_capacity"] = h->ring_capacity;
             d["slots_offset"] = h->slots_offset;
             d["records_offset"] = h->records_offset;
             d["chunkmap_offset"] = h->chunkmap_offset;
             d["rings_offset"] = h->rings_offset;
             d["answers_offset"] = h->answers_offset;
             d["answer_ring_bytes"] = h->answer_ring_bytes;
             d["max_answer_bytes"] = p.max_answer_bytes();
             d["total_size"] = h->total_size;
             return d;
           })
      .def(
          "region",
          [](nb::handle self, const std::string& which) {
            Pool& p = nb::cast<Pool&>(self);
            const pool::View& v = p.view();
            const pool::PoolHeader* h = v.hdr;
            size_t off, len;
            if (which == "slots") {
              off = h->slots_offset;
              len = size_t(h->slot_count) * h->slot_size;
            } else if (which == "records") {
              off = h->records_offset;
              len = size_t(h->record_count) * sizeof(pool::Record);
            } else if (which == "chunkmap") {
              off = h->chunkmap_offset;
              len = size_t(h->record_count) * h->max_chunks * sizeof(uint32_t);
            } else {
              throw std::invalid_argument("region must be 'slots', 'records' or 'chunkmap', got '" + which + "'");
            }
            size_t shape[1] = {len};
            return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(v.base + off, 1, shape, self);
          },
          nb::arg("which"), "A uint8 numpy view of one region of the mapping, keeping the pool alive.")
      .def(
          "poll",
          [](Pool& p, uint32_t consumer, U32Out out, int64_t timeout_us, int64_t spin_us) {
            uint32_t* dst = out.data();
            const size_t cap = out.shape(0);
            nb::gil_scoped_release nogil;
            return p.poll(consumer, dst, cap, timeout_us, spin_us);
          },
          nb::arg("consumer"), nb::arg("out"), nb::arg("timeout_us"), nb::arg("spin_us") = 50)
      .def(
          "release",
          [](Pool& p, uint32_t consumer, U32Array recs) { return p.release(consumer, recs.data(), recs.shape(0)); },
          nb::arg("consumer"), nb::arg("recs"))
      .def(
          "answer",
          [](Pool& p, uint32_t consumer, U32Array recs, U32Array gens, U16Array statuses,
             std::optional<ByteArray2> body, uint8_t dtype, int64_t timeout_us) {
            const size_t n = recs.shape(0);
            if (gens.shape(0) != n) throw std::invalid_argument("need one generation per record");
            if (statuses.shape(0) != n) throw std::invalid_argument("need one status per record");
            const uint8_t* b = nullptr;
            size_t row = 0;
            if (body) {
              if (body->shape(0) != n) throw std::invalid_argument("need one body row per record");
              b = body->data();
              row = body->shape(1);
            }
            const uint32_t* r = recs.data();
            const uint32_t* g = gens.data();
            const uint16_t* st = statuses.data();
            nb::gil_scoped_release nogil;
            return p.answer(consumer, r, g, n, st, b, row, dtype, timeout_us);
          },
          nb::arg("consumer"), nb::arg("recs"), nb::arg("gens"), nb::arg("statuses"), nb::arg("body").none(),
          nb::arg("dtype"), nb::arg("timeout_us"),
          "Publish one answer per record to the consumer's answer ring (the ingest sends it). Returns how many.")
      .def("queue_depth", &Pool::queue_depth, nb::arg("consumer"))
      .def(
          "peek",
          [](const Pool& p, uint32_t consumer, uint64_t from, U32Out out) {
            uint64_t head = 0, tail = 0;
            const size_t n = p.peek(consumer, from, out.data(), out.shape(0), &head, &tail);
            return nb::make_tuple(n, head, tail);
          },
          nb::arg("consumer"), nb::arg("from_pos"), nb::arg("out"),
          "Copy deliver-ring entries from max(from_pos, head) without consuming them: (n, head, tail).")
      .def(
          "set_attached",
          [](Pool& p, uint32_t consumer, uint32_t pid) {
            p.check_consumer(consumer);
            p.view().consumer(consumer)->attached_pid.store(pid);
          },
          nb::arg("consumer"), nb::arg("pid"))
      .def(
          "gather",
          [](const Pool& p, U32Array recs, AnyOut out) {
            const size_t n = recs.shape(0);
            if (out.ndim() == 0 || out.shape(0) < n)
              throw std::invalid_argument("gather output needs at least " + std::to_string(n) + " rows");
            const size_t row_bytes = out.nbytes() / out.shape(0);
            uint8_t* dst = static_cast<uint8_t*>(out.data());
            std::string err;
            {
              nb::gil_scoped_release nogil;
              err = p.gather(recs.data(), n, dst, row_bytes);
            }
            if (!err.empty()) throw std::invalid_argument(err);
          },
          nb::arg("recs"), nb::arg("out"),
          "Copy each delivered record's payload into row i of out (CPU gather, GIL released).");

  nb::class_<Ingest>(m, "Ingest")
      .def(
          "__init__",
          [](Ingest* self, Pool& pool, const std::vector<std::tuple<std::string, int, int>>& listen,
             double timeout_ms, double dedup_window_ms, uint32_t batch, int rcvbuf_bytes, bool answer_drops,
             bool gro, double answer_hold_ms, size_t answer_hold_bytes) {
            if (!(timeout_ms > 0)) throw std::invalid_argument("timeout_ms must be positive");
            if (!(dedup_window_ms >= 0)) throw std::invalid_argument("dedup_window_ms must be >= 0");
            if (!(answer_hold_ms > 0)) throw std::invalid_argument("answer_hold_ms must be positive");
            std::vector<ListenSpec> specs;
            for (const auto& [host, port, app] : listen) {
              if (port < 0 || port > 65535) throw std::invalid_argument("port must be in 0..65535");
              specs.push_back(ListenSpec{host, port, app});
            }
            IngestOptions o;
            o.timeout_ns = uint64_t(timeout_ms * 1e6);
            o.dedup_window_ns = uint64_t(dedup_window_ms * 1e6);
            o.batch = batch;
            o.rcvbuf_bytes = rcvbuf_bytes;
            o.answer_drops = answer_drops;
            o.gro = gro;
            o.answer_hold_ns = uint64_t(answer_hold_ms * 1e6);
            o.answer_hold_bytes = answer_hold_bytes;
            new (self) Ingest(&pool, specs, o);
          },
          nb::arg("pool"), nb::arg("listen"), nb::arg("timeout_ms") = 500.0, nb::arg("dedup_window_ms") = 2000.0,
          nb::arg("batch") = 64, nb::arg("rcvbuf_bytes") = 32 << 20, nb::arg("answer_drops") = true,
          nb::arg("gro") = true, nb::arg("answer_hold_ms") = 1000.0, nb::arg("answer_hold_bytes") = size_t(32) << 20,
          nb::keep_alive<1, 2>())
      .def("start", &Ingest::start)
      .def("stop", &Ingest::stop, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("running", &Ingest::running)
      .def_prop_ro("ports", &Ingest::ports)
      .def("set_route", &Ingest::set_route, nb::arg("app_id"), nb::arg("consumers"))
      .def("route", &Ingest::route, nb::arg("app_id"))
      .def("reclaim", &Ingest::reclaim, nb::arg("consumer"), nb::arg("requeue"), nb::arg("timeout_ms") = 5000,
           nb::call_guard<nb::gil_scoped_release>())
      .def("local_open", &Ingest::local_open,
           "Open a local port (answer queue + eventfd) for submit(); returns its index.")
      .def("local_close", &Ingest::local_close, nb::arg("port"),
           "Close a local port; answers still coming to it are dropped (local_dropped).")
      .def("local_fd", &Ingest::local_fd, nb::arg("port"), "The port's eventfd: readable while answers wait.")
      .def(
          "submit",
          [](Ingest& ing, int port, uint16_t app_id, ByteArray2 rows, uint8_t dtype, uint32_t deadline_us,
             uint64_t token0) {
            const size_t n = rows.shape(0), row_bytes = rows.shape(1);
            const uint8_t* data = rows.data();
            nb::gil_scoped_release nogil;
            ing.submit(port, app_id, data, n, row_bytes, dtype, deadline_us, token0);
          },
          nb::arg("port"), nb::arg("app_id"), nb::arg("rows"), nb::arg("dtype"), nb::arg("deadline_us"),
          nb::arg("token0"),
          "Place each row (uint8 [n, row_bytes]) in the pool as a complete request of app_id and route it; "
          "row i is answered at the local port with token token0 + i.")
      .def(
          "take_local",
          [](Ingest& ing, int port) {
            std::vector<LocalAnswer> got;
            {
              nb::gil_scoped_release nogil;
              got = ing.take_local(port);
            }
            nb::list out;
            for (auto& a : got)
              out.append(nb::make_tuple(a.token, a.status, a.dtype, a.placed_ns, a.answered_ns,
                                        nb::bytes(a.body.data(), a.body.size())));
            return out;
          },
          nb::arg("port"),
          "Answers waiting at the local port: [(token, status, dtype, placed_ns, answered_ns, body)], oldest first.")
      .def("set_blocked_port", &Ingest::set_blocked_port, nb::arg("port"),
           "Fault seam: answers to clients with this UDP port fail as on a full send buffer (0 clears).")
      .def("counters",
           [](const Ingest& ing) {
             const auto c = ing.counters();
             nb::dict d;
             for (int i = 0; i < kCounterCount; ++i) d[counter_name(i)] = c[i];
             d["free_slots"] = ing.free_slots();
             d["free_records"] = ing.free_records();
             d["filling"] = ing.filling();
             d["held_answers"] = ing.held_answers();
             return d;
           });
}

}  // namespace gpuprims
