#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "bindings.h"
#include "gpuprims/wire.h"

namespace gpuprims {
namespace w = wire;

void bind_wire(nb::module_& m) {
  m.attr("WIRE_MAGIC") = w::kMagic;
  m.attr("WIRE_VERSION") = w::kVersion;
  m.attr("WIRE_HEADER_SIZE") = w::kHeaderSize;

  m.def(
      "wire_layout",
      []() {
        nb::dict d;
#define GP_FIELD(name) d[#name] = nb::make_tuple(offsetof(w::Header, name), sizeof(w::Header::name))
        GP_FIELD(magic);
        GP_FIELD(version);
        GP_FIELD(kind);
        GP_FIELD(status);
        GP_FIELD(app_id);
        GP_FIELD(dtype);
        GP_FIELD(flags);
        GP_FIELD(chunk_index);
        GP_FIELD(chunk_count);
        GP_FIELD(payload_len);
        GP_FIELD(request_id);
        GP_FIELD(total_len);
        GP_FIELD(deadline_us);
        GP_FIELD(client_ts_ns);
#undef GP_FIELD
        return d;
      },
      "Field name -> (offset, size) of the wire header as compiled into the native code.");

  m.def(
      "check_request",
      [](nb::bytes data) { return w::check_request(data.c_str(), data.size(), nullptr); },
      nb::arg("datagram"),
      "Stateless verdict (0 = ok) of one request datagram, as the ingest computes it.");

  m.def("verdict_name", [](int v) { return std::string(w::verdict_name(v)); }, nb::arg("verdict"));
}

}  // namespace gpuprims
