// Bindings of the traffic-tool helpers (traffic.h): TrafficSender, TrafficReceiver, monotonic_ns and
// TRAFFIC_RECORD_SIZE. Converts ndarrays, dicts and bytes to and from the plain C++ types, and
// releases the GIL around the sender's and receiver's run loops.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "traffic.h"

namespace gpuprims {
namespace {

using traffic::Receiver;
using traffic::Sender;
using traffic::Span;

template <typename T>
using Arr = nb::ndarray<T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

template <typename T>
Span<T> span(const Arr<T>& a) {
  return {a.data(), a.shape(0)};
}

uint64_t sender_run(Sender& s, Arr<const uint8_t> pool, Arr<const uint64_t> pkt_off, Arr<const uint32_t> pkt_len,
                    Arr<const uint8_t> pkt_patch, Arr<const uint32_t> unit_first, Arr<const uint32_t> unit_count,
                    Arr<const uint32_t> dest_ip, Arr<const uint16_t> dest_port, Arr<const int64_t> ev_time,
                    Arr<const uint32_t> ev_unit, Arr<const uint64_t> ev_rid, Arr<const uint16_t> ev_sock,
                    Arr<const uint16_t> ev_dest, Arr<int64_t> ev_sent, int64_t t0_ns, int64_t stop_at_ns) {
  traffic::SendPlan plan;
  plan.pool = span(pool);
  plan.pkt_off = span(pkt_off);
  plan.pkt_len = span(pkt_len);
  plan.pkt_patch = span(pkt_patch);
  plan.unit_first = span(unit_first);
  plan.unit_count = span(unit_count);
  plan.dest_ip = span(dest_ip);
  plan.dest_port = span(dest_port);
  plan.ev_time = span(ev_time);
  plan.ev_unit = span(ev_unit);
  plan.ev_rid = span(ev_rid);
  plan.ev_sock = span(ev_sock);
  plan.ev_dest = span(ev_dest);
  plan.ev_sent = span(ev_sent);
  plan.t0_ns = t0_ns;
  plan.stop_at_ns = stop_at_ns;
  nb::gil_scoped_release release;  // the ndarray arguments keep the arrays alive meanwhile
  return s.run(plan);
}

std::tuple<uint64_t, uint64_t, uint64_t> sender_progress(const Sender& s) {
  const traffic::SenderProgress p = s.progress();
  return {p.events, p.packets, p.bytes};
}

nb::dict sender_stats(const Sender& s) {
  const traffic::SenderStats st = s.stats();
  nb::dict d;
  d["events"] = st.events;
  d["packets"] = st.packets;
  d["bytes"] = st.bytes;
  d["syscalls"] = st.syscalls;
  d["send_errors"] = st.send_errors;
  d["failed_packets"] = st.failed_packets;
  d["last_errno"] = st.last_errno;
  d["gso"] = st.gso;
  d["cpu_ns"] = st.cpu_ns;
  return d;
}

void receiver_run(Receiver& r, int64_t until_ns) {
  nb::gil_scoped_release release;
  r.run(until_ns);
}

std::tuple<nb::bytes, nb::bytes> receiver_drain(Receiver& r) {
  const traffic::Drained d = r.drain();
  return {nb::bytes(reinterpret_cast<const char*>(d.records.data()), d.records.size() * sizeof(traffic::Record)),
          nb::bytes(reinterpret_cast<const char*>(d.payload.data()), d.payload.size())};
}

nb::dict receiver_stats(const Receiver& r) {
  const traffic::ReceiverStats st = r.stats();
  nb::dict d;
  d["datagrams"] = st.datagrams;
  d["bytes"] = st.bytes;
  d["invalid"] = st.invalid;
  d["syscalls"] = st.syscalls;
  d["cpu_ns"] = st.cpu_ns;
  d["socket_drops"] = st.socket_drops;
  d["kernel_timestamps"] = st.kernel_timestamps;
  d["kernel_stamped"] = st.kernel_stamped;
  return d;
}

}  // namespace

void bind_traffic(nb::module_& m) {
  m.def("monotonic_ns", &traffic::mono_ns, "CLOCK_MONOTONIC in ns (the clock of time.monotonic_ns()).");
  m.attr("TRAFFIC_RECORD_SIZE") = sizeof(traffic::Record);

  nb::class_<Sender>(m, "TrafficSender", "Paced batch sender (sendmmsg, UDP GSO) for gpuprims.traffic.")
      .def(nb::init<std::vector<int>, bool, uint32_t, int64_t>(), nb::arg("fds"), nb::arg("gso") = true,
           nb::arg("max_batch_pkts") = 1024, nb::arg("spin_ns") = 20000)
      .def("run", &sender_run, nb::arg("pool"), nb::arg("pkt_off"), nb::arg("pkt_len"), nb::arg("pkt_patch"),
           nb::arg("unit_first"), nb::arg("unit_count"), nb::arg("dest_ip"), nb::arg("dest_port"), nb::arg("ev_time"),
           nb::arg("ev_unit"), nb::arg("ev_rid"), nb::arg("ev_sock"), nb::arg("ev_dest"), nb::arg("ev_sent"),
           nb::arg("t0_ns"), nb::arg("stop_at_ns") = 0,
           "Send events at t0_ns + ev_time[i] (GIL released); ev_sent[i] receives each request's send time.")
      .def("stop", &Sender::stop)
      .def("progress", &sender_progress, "(events, packets, bytes) sent so far.")
      .def("stats", &sender_stats);

  nb::class_<Receiver>(m, "TrafficReceiver", "Batch receiver (recvmmsg) of response datagrams.")
      .def(nb::init<std::vector<int>, uint32_t, bool, bool, bool, bool>(), nb::arg("fds"), nb::arg("batch") = 256,
           nb::arg("record") = true, nb::arg("keep_payloads") = false, nb::arg("gro") = false,
           nb::arg("kernel_ts") = true)
      .def("run", &receiver_run, nb::arg("until_ns") = 0, "Receive until stop() or until_ns (GIL released).")
      .def("stop", &Receiver::stop)
      .def("drain", &receiver_drain, "(records, payload bytes) received since the last drain.")
      .def("stats", &receiver_stats);
}

}  // namespace gpuprims
