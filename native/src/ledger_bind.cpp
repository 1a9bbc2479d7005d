// Bindings of the serving loop's native local queue (ledger.h); gpuprims.pool.LocalQueue wraps it.
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "ledger.h"

namespace gpuprims {

namespace {
using ByteRows = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using ByteRowsOut = nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using ByteVec = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using F64Out = nb::ndarray<double, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U32Out = nb::ndarray<uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using F64In = nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I64Out = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
}  // namespace

void bind_ledger(nb::module_& m) {
  m.attr("LEDGER_ANY_SIZE") = Ledger::kAnySize;
  nb::class_<Ledger>(m, "Ledger")
      .def(nb::init<Pool*, uint32_t>(), nb::arg("pool"), nb::arg("consumer"), nb::keep_alive<1, 2>())
      .def("__len__", &Ledger::size)
      .def(
          "pull",
          [](Ledger& l, size_t max_n, int64_t timeout_us, int64_t spin_us) {
            std::vector<double> arrivals;
            {
              nb::gil_scoped_release nogil;
              l.pull(max_n, timeout_us, spin_us, &arrivals);
            }
            return arrivals;
          },
          nb::arg("max_n"), nb::arg("timeout_us"), nb::arg("spin_us") = 50,
          "Queue copies of up to max_n delivered records (waiting up to timeout_us); their completion "
          "times in ms.")
      .def("first_ns", &Ledger::first_ns, nb::arg("i"))
      .def("set_first_ns", &Ledger::set_first_ns, nb::arg("i"), nb::arg("ns"))
      .def("deadline_ms", &Ledger::deadline_ms, nb::arg("i"), nb::arg("default_ms"))
      .def("flags", &Ledger::flags, nb::arg("i"))
      .def(
          "expire",
          [](Ledger& l, uint64_t now_ns, double default_ms, double need_ms, int64_t timeout_us) {
            nb::gil_scoped_release nogil;
            return l.expire(now_ns, default_ms, need_ms, timeout_us);
          },
          nb::arg("now_ns"), nb::arg("default_ms"), nb::arg("need_ms"), nb::arg("timeout_us"))
      .def(
          "fail_head",
          [](Ledger& l, size_t k, uint16_t status, int64_t timeout_us) {
            nb::gil_scoped_release nogil;
            return l.fail_head(k, status, timeout_us);
          },
          nb::arg("k"), nb::arg("status"), nb::arg("timeout_us"))
      .def(
          "take",
          [](Ledger& l, size_t k, uint32_t row_bytes, ByteVec dtype_ok, int64_t timeout_us, U32Out recs_out,
             std::optional<ByteRowsOut> rows) {
            if (dtype_ok.shape(0) != 256) throw std::invalid_argument("dtype_ok needs one entry per wire dtype (256)");
            const size_t want = std::min(k, l.size());
            if (recs_out.shape(0) < want) throw std::invalid_argument("recs_out needs room for every request taken");
            uint8_t* dst = nullptr;
            if (row_bytes == Ledger::kAnySize && rows)
              throw std::invalid_argument("rows must be None with row_bytes ANY_SIZE (bodies of any size have no row)");
            if (rows) {
              if (rows->shape(0) < want || rows->shape(1) != row_bytes)
                throw std::invalid_argument("rows needs room for every request taken, row_bytes each");
              dst = rows->data();
            }
            const uint8_t* ok = dtype_ok.data();
            size_t n;
            {
              nb::gil_scoped_release nogil;
              n = l.take(k, row_bytes, ok, timeout_us, dst);
            }
            std::copy(l.batch_recs(), l.batch_recs() + n, recs_out.data());
            return n;
          },
          nb::arg("k"), nb::arg("row_bytes"), nb::arg("dtype_ok"), nb::arg("timeout_us"), nb::arg("recs_out"),
          nb::arg("rows").none() = nb::none(),
          "Take the oldest k queued requests as the current batch (bodies that are not row_bytes of a "
          "dtype dtype_ok allows are answered BAD_REQUEST; row_bytes LEDGER_ANY_SIZE takes any size, without "
          "rows); its record indices go to recs_out and, with rows, its payloads to rows (the CPU gather). "
          "Its size.")
      .def(
          "batch_recs",
          [](nb::handle self) {
            Ledger& l = nb::cast<Ledger&>(self);
            size_t shape[1] = {l.batch_size()};
            return nb::ndarray<nb::numpy, const uint32_t, nb::ndim<1>>(l.batch_recs(), 1, shape, self);
          },
          "The current batch's record indices (a read-only view, valid until the next take).")
      .def(
          "batch_records",
          [](nb::handle self) {
            Ledger& l = nb::cast<Ledger&>(self);
            size_t shape[2] = {l.batch_size(), sizeof(RecordCopy)};
            return nb::ndarray<nb::numpy, const uint8_t, nb::ndim<2>>(
                reinterpret_cast<const uint8_t*>(l.batch_records()), 2, shape, self);
          },
          "The current batch's record copies as bytes (a read-only view, valid until the next take).")
      .def(
          "answer_batch",
          [](Ledger& l, ByteRows body, uint8_t dtype, double default_ms, int64_t timeout_us, F64Out lat_ms,
             double compute_s, F64In bounds, I64Out request, I64Out queue, I64Out compute) {
            const size_t n = l.batch_size();
            if (body.shape(0) != n) throw std::invalid_argument("need one body row per request of the batch");
            if (lat_ms.shape(0) < n) throw std::invalid_argument("lat_ms needs one entry per request of the batch");
            const size_t nbounds = bounds.shape(0);
            if (request.shape(0) != nbounds + 1 || queue.shape(0) != nbounds + 1 || compute.shape(0) != nbounds + 1)
              throw std::invalid_argument("each histogram needs one count per bound and one for +Inf");
            const uint8_t* b = body.data();
            const size_t row = body.shape(1);
            double* lat = lat_ms.data();
            Histograms h;
            h.bounds = bounds.data();
            h.bounds_n = nbounds;
            h.request = request.data();
            h.queue = queue.data();
            h.compute = compute.data();
            h.compute_s = compute_s > 0 ? compute_s : 0.0;
            Answered a;
            {
              nb::gil_scoped_release nogil;
              a = l.answer_batch(b, row, dtype, default_ms, timeout_us, lat, &h);
            }
            return nb::make_tuple(a.within, a.done_ns, a.oldest_first_ns, a.oldest_complete_ns, h.request_sum,
                                  h.queue_sum, h.compute_sum);
          },
          nb::arg("body"), nb::arg("dtype"), nb::arg("default_ms"), nb::arg("timeout_us"), nb::arg("lat_ms"),
          nb::arg("compute_s"), nb::arg("bounds"), nb::arg("request"), nb::arg("queue"), nb::arg("compute"),
          "Answer the current batch OK with one row each, each latency (ms) to lat_ms and each request counted "
          "in the request, queue and compute histograms over bounds (seconds): (answered within their "
          "deadline, done_ns, the oldest request's first_ns and complete_ns, and the three histograms' added "
          "sums).")
      .def("clear_batch", &Ledger::clear_batch);
}

}  // namespace gpuprims
