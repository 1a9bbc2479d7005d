#include <arpa/inet.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <stdexcept>
#include <vector>

#include "bindings.h"
#include "gpuprims/wire.h"

namespace gpuprims {
namespace w = wire;

namespace {

using Bytes1 = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// The datagrams of one request (wire format v1, exactly as gpuprims.wire.encode_request makes them),
// each a header and an iovec into `body` (no copy of the payload), sent with sendmmsg: one system call
// for a request of up to 1024 datagrams instead of one sendto each (gpuprims.client's send path).
// Returns how many datagrams were sent, in order: all of them, or fewer when a non-blocking socket's
// send buffer filled (EAGAIN) and the caller is to send the rest.
size_t send_request(int fd, const std::string& host, int port, uint16_t app_id, uint64_t request_id, Bytes1 body,
                    uint32_t chunk_payload, uint8_t dtype, uint8_t flags, uint32_t deadline_us,
                    uint64_t client_ts_ns) {
  const size_t total = body.shape(0);
  if (total == 0) throw std::invalid_argument("a request needs a non-empty body");
  if (total >= (size_t(1) << 32)) throw std::invalid_argument("body does not fit a u32 total_len");
  if (chunk_payload == 0) throw std::invalid_argument("chunk_payload must be >= 1");
  if (port < 0 || port > 65535) throw std::invalid_argument("port must be in 0..65535");
  sockaddr_storage addr{};
  socklen_t addrlen = 0;
  auto* a4 = reinterpret_cast<sockaddr_in*>(&addr);
  auto* a6 = reinterpret_cast<sockaddr_in6*>(&addr);
  if (inet_pton(AF_INET, host.c_str(), &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    a4->sin_port = htons(uint16_t(port));
    addrlen = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, host.c_str(), &a6->sin6_addr) == 1) {
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons(uint16_t(port));
    addrlen = sizeof(sockaddr_in6);
  } else {
    throw std::invalid_argument("not a numeric IPv4 or IPv6 address: " + host);
  }
  const size_t n = (total + chunk_payload - 1) / chunk_payload;
  std::vector<w::Header> hdrs(n);
  std::vector<iovec> iov(2 * n);
  std::vector<mmsghdr> msgs(n);
  const uint8_t* data = body.data();
  for (size_t i = 0; i < n; ++i) {
    const size_t off = i * chunk_payload;
    const size_t len = std::min<size_t>(chunk_payload, total - off);
    w::Header& h = hdrs[i];
    h.magic = w::kMagic;
    h.version = w::kVersion;
    h.kind = w::kKindRequest;
    h.status = 0;
    h.app_id = app_id;
    h.dtype = dtype;
    h.flags = flags;
    h.chunk_index = uint32_t(i);
    h.chunk_count = uint32_t(n);
    h.payload_len = uint32_t(len);
    h.request_id = request_id;
    h.total_len = uint32_t(total);
    h.deadline_us = deadline_us;
    h.client_ts_ns = client_ts_ns;
    iov[2 * i] = iovec{&h, sizeof h};
    iov[2 * i + 1] = iovec{const_cast<uint8_t*>(data + off), len};
    msghdr& m = msgs[i].msg_hdr;
    m = msghdr{};
    m.msg_name = &addr;
    m.msg_namelen = addrlen;
    m.msg_iov = &iov[2 * i];
    m.msg_iovlen = 2;
  }
  int err = 0;
  size_t sent = 0;
  {
    nb::gil_scoped_release release;
    while (sent < n) {
      const int rc = sendmmsg(fd, msgs.data() + sent, unsigned(std::min<size_t>(n - sent, 1024)), 0);
      if (rc < 0) {
        if (errno == EINTR) continue;
        err = errno;
        break;
      }
      sent += size_t(rc);
    }
  }
  // A non-blocking socket whose send buffer is full: the caller sends the rest its own way.
  if (err == EAGAIN || err == EWOULDBLOCK) return sent;
  if (err) {
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
    throw nb::python_error();
  }
  return sent;
}

}  // namespace

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

  m.def("send_request", &send_request, nb::arg("fd"), nb::arg("host"), nb::arg("port"), nb::arg("app_id"),
        nb::arg("request_id"), nb::arg("body"), nb::arg("chunk_payload"), nb::arg("dtype"), nb::arg("flags"),
        nb::arg("deadline_us"), nb::arg("client_ts_ns"),
        "Send one request's datagrams (wire format v1, as gpuprims.wire.encode_request makes them) to "
        "host:port (numeric) through the UDP socket fd with sendmmsg; returns how many were sent (fewer than "
        "all only when a non-blocking socket's buffer filled: send the rest). OSError as sendto.");
}

}  // namespace gpuprims
