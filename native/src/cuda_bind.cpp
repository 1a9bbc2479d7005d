// CUDA part of gpuprims._native: a thin layer over the CUDA runtime API (statically linked, so the
// module imports where there is no driver; calls then fail with cudaErrorInsufficientDriver or
// cudaErrorNoDevice) plus the GPU-DMA launch and its CPU reference. The public, documented API is
// gpuprims.cuda (STYLE.md 1). Every CUDA status passes through check(), which throws CudaStatusError;
// the translator registered below turns it into gpuprims.cuda.errors.CudaError (STYLE.md 2).
//
// Without nvcc at build time only the CPU parts are defined (dma_gather_cpu, the layout checks), and
// _native.CUDA_KERNELS_BUILT is False.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "gpuprims/cuda_dma.h"
#include "gpuprims/pool.h"
#include "gpuprims/wire.h"

#include <sys/prctl.h>

#ifdef GPUPRIMS_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <time.h>

#include <cerrno>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "gpuprims/cuda_kernels.h"
#endif

namespace gpuprims {
namespace {

namespace d = dma;
using RecordArray = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using StatusArray = nb::ndarray<int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// The kernel reads Record fields by byte offset; these pin the offsets to pool.h.
static_assert(sizeof(pool::Record) == d::kRecordSize, "Record size");
static_assert(offsetof(pool::Record, state) == d::kRecState, "Record.state");
static_assert(offsetof(pool::Record, app_id) == d::kRecAppId, "Record.app_id");
static_assert(offsetof(pool::Record, dtype) == d::kRecAppId + 2, "Record.dtype shares app_id's word");
static_assert(offsetof(pool::Record, chunk_count) == d::kRecChunkCount, "Record.chunk_count");
static_assert(offsetof(pool::Record, stride) == d::kRecStride, "Record.stride");
static_assert(offsetof(pool::Record, total_len) == d::kRecTotalLen, "Record.total_len");
static_assert(offsetof(pool::Record, request_id) == d::kRecRequestId, "Record.request_id");
static_assert(pool::kRecDelivered == d::kStateDelivered, "delivered state");

// Linux timer slack of the calling thread (PR_SET_TIMERSLACK): how far the kernel may postpone a
// sleep's wake-up to batch timers. 50 us by default, which stretches every short poll sleep.
constexpr int64_t kPollSlackNs = 1000;

int64_t get_timer_slack_ns() { return int64_t(prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)); }

void set_timer_slack_ns(int64_t ns) {
  if (ns < 0) throw std::invalid_argument("timer slack must be >= 0 ns, got " + std::to_string(ns));
  // 0 would mean "the default"; 1 ns is the smallest explicit value.
  if (prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(ns == 0 ? 1 : ns), 0, 0, 0) != 0)
    throw std::runtime_error("prctl(PR_SET_TIMERSLACK) failed");
}

// Lowers the thread's timer slack for a scope and restores it.
struct SlackGuard {
  int64_t prev;
  explicit SlackGuard(int64_t ns) : prev(get_timer_slack_ns()) {
    if (prev > ns) prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(ns), 0, 0, 0);
  }
  ~SlackGuard() {
    if (prev > 0) prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(prev), 0, 0, 0);
  }
  SlackGuard(const SlackGuard&) = delete;
  SlackGuard& operator=(const SlackGuard&) = delete;
};

// Where a pool's regions lie; validated once so the gathers can trust it.
struct PoolGeometry {
  uint64_t nbytes, slots_offset, records_offset, chunkmap_offset;
  uint32_t slot_size, slot_count, record_count, max_chunks;

  PoolGeometry(uint64_t nbytes_, uint64_t slots_offset_, uint64_t records_offset_, uint64_t chunkmap_offset_,
               uint32_t slot_size_, uint32_t slot_count_, uint32_t record_count_, uint32_t max_chunks_)
      : nbytes(nbytes_), slots_offset(slots_offset_), records_offset(records_offset_),
        chunkmap_offset(chunkmap_offset_), slot_size(slot_size_), slot_count(slot_count_),
        record_count(record_count_), max_chunks(max_chunks_) {
    if (slot_size <= wire::kHeaderSize || slot_size % 16 != 0)
      throw std::invalid_argument("slot_size must be a multiple of 16 larger than the 48-byte header, got " +
                                  std::to_string(slot_size));
    if (slots_offset % 16 != 0) throw std::invalid_argument("slots_offset must be 16-byte aligned");
    if (records_offset % 8 != 0 || chunkmap_offset % 4 != 0)
      throw std::invalid_argument("records/chunkmap offsets are misaligned");
    if (max_chunks == 0) throw std::invalid_argument("max_chunks must be positive");
    auto fits = [&](uint64_t off, uint64_t len, const char* what) {
      if (off > nbytes || len > nbytes - off)
        throw std::invalid_argument(std::string(what) + " region runs past the pool's " + std::to_string(nbytes) +
                                    " bytes");
    };
    fits(slots_offset, uint64_t(slot_count) * slot_size, "slots");
    fits(records_offset, uint64_t(record_count) * d::kRecordSize, "records");
    fits(chunkmap_offset, uint64_t(record_count) * max_chunks * 4, "chunk map");
  }
  uint32_t max_payload() const { return slot_size - uint32_t(wire::kHeaderSize); }
};

void check_rows(uint64_t n, uintptr_t out, uint64_t out_nbytes, uint64_t row_stride, uint64_t row_src_bytes,
                uint32_t mode, uint32_t channels, size_t na, size_t nb_, size_t nd) {
  if (n > d::kMaxBatch)
    throw std::invalid_argument("at most " + std::to_string(d::kMaxBatch) + " rows per launch, got " +
                                std::to_string(n));
  if (mode != d::kModeCopy && mode != d::kModeU8ToF32) throw std::invalid_argument("unknown mode");
  if (channels < 1 || channels > d::kMaxChannels || na < channels || nb_ < channels || nd < channels)
    throw std::invalid_argument("channels must be 1..4 with that many scale/offset/divisor values");
  // The kernel stores float32 elements: a row that starts off a 4-byte boundary would be a
  // misaligned-address fault on the GPU (and undefined behaviour in the reference).
  if (mode == d::kModeU8ToF32 && (row_stride % 4 != 0 || out % 4 != 0))
    throw std::invalid_argument("uint8->float32 rows must start on 4-byte boundaries (row_stride " +
                                std::to_string(row_stride) + ", destination offset " + std::to_string(out % 4) +
                                ")");
  const uint64_t row_dst = row_src_bytes * (mode == d::kModeU8ToF32 ? 4 : 1);
  if (row_src_bytes == 0 || row_stride < row_dst)
    throw std::invalid_argument("row_stride is smaller than a row");
  if (n > 0 && (n - 1) * row_stride + row_dst > out_nbytes)
    throw std::invalid_argument("destination holds fewer than the rows asked for");
}

d::RecordView read_record(const uint8_t* base, const PoolGeometry& g, uint32_t r) {
  const uint8_t* rp = base + g.records_offset + uint64_t(r) * d::kRecordSize;
  d::RecordView v{};
  uint32_t word = 0;
  std::memcpy(&v.state, rp + d::kRecState, 4);
  std::memcpy(&word, rp + d::kRecAppId, 4);
  v.app_id = word & 0xFFFFu;
  v.dtype = (word >> 16) & 0xFFu;
  std::memcpy(&v.chunk_count, rp + d::kRecChunkCount, 4);
  std::memcpy(&v.stride, rp + d::kRecStride, 4);
  std::memcpy(&v.total_len, rp + d::kRecTotalLen, 4);
  std::memcpy(&v.request_id, rp + d::kRecRequestId, 8);
  return v;
}

// CPU reference of gather_kernel: same order of checks, same verdicts, same bytes written.
int64_t gather_cpu(const uint8_t* base, const PoolGeometry& g, const uint32_t* records, uint32_t n, uint8_t* out,
                   uint64_t row_stride, const d::Geometry& geo, uint32_t mode, uint32_t channels, const float* a,
                   const float* b, const float* dv, int32_t* status) {
  int64_t placed = 0;
  for (uint32_t row = 0; row < n; ++row) {
    const uint32_t r = records[row];
    int32_t worst = d::kBadRecord;
    d::RecordView rec{};
    if (r < g.record_count) {
      rec = read_record(base, g, r);
      worst = d::record_verdict(rec, geo);
    }
    if (worst == d::kOk) {
      const uint32_t* chunkmap =
          reinterpret_cast<const uint32_t*>(base + g.chunkmap_offset) + uint64_t(r) * g.max_chunks;
      uint8_t* row_out = out + uint64_t(row) * row_stride;
      for (uint32_t c = 0; c < rec.chunk_count; ++c) {
        const uint32_t slot = chunkmap[c];
        if (slot >= g.slot_count) {
          worst = std::max(worst, int32_t(d::kBadSlot));
          continue;
        }
        const uint8_t* s = base + g.slots_offset + uint64_t(slot) * g.slot_size;
        uint32_t w[12];
        std::memcpy(w, s, sizeof(w));
        const int32_t v = d::chunk_verdict(w, rec, c);
        if (v != d::kOk) {
          worst = std::max(worst, v);
          continue;
        }
        const uint32_t len = w[5];
        const uint64_t at = uint64_t(c) * rec.stride;
        const uint8_t* payload = s + wire::kHeaderSize;
        if (mode == d::kModeCopy) {
          std::memcpy(row_out + at, payload, len);
        } else {
          float* dst = reinterpret_cast<float*>(row_out) + at;
          uint32_t ch = uint32_t(at % channels);
          for (uint32_t i = 0; i < len; ++i) {
            // Three roundings, as the kernel's __fmul_rn/__fadd_rn/__fdiv_rn: this file is built with
            // -ffp-contract=off (CMakeLists.txt), so no compiler fuses the multiply and the add.
            const float m = float(payload[i]) * a[ch];
            const float s = m + b[ch];
            dst[i] = s / dv[ch];
            if (++ch == channels) ch = 0;
          }
        }
      }
    }
    if (status) status[row] = worst;
    placed += worst == d::kOk;
  }
  return placed;
}

#ifdef GPUPRIMS_HAVE_CUDA

struct CudaStatusError : std::exception {
  int status;
  std::string call;
  CudaStatusError(int s, std::string c) : status(s), call(std::move(c)) {}
  const char* what() const noexcept override { return call.c_str(); }
};

// The one choke point for CUDA statuses in native code.
inline void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear the sticky last-error slot of non-sticky errors
    throw CudaStatusError(int(status), call);
  }
}

// Makes `dev` current for one call and restores the caller's device (torch's, typically) after it.
struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int dev) {
    int cur = 0;
    check(cudaGetDevice(&cur), "cudaGetDevice");
    if (cur != dev) {
      check(cudaSetDevice(dev), "cudaSetDevice");
      prev = cur;
    }
  }
  ~DeviceGuard() {
    if (prev >= 0) cudaSetDevice(prev);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
};

inline cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
inline cudaEvent_t as_event(uintptr_t e) { return reinterpret_cast<cudaEvent_t>(e); }
inline void* as_ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

constexpr int64_t kCallbackSliceUs = 10000;  // how often a callback wait checks the stream for a fault

int64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void sleep_until_ns(int64_t t_ns) {
  timespec ts{};
  ts.tv_sec = t_ns / 1000000000;
  ts.tv_nsec = t_ns % 1000000000;
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {
  }
}

void sleep_for_us(int64_t us) {
  if (us <= 0) return;
  sleep_until_ns(monotonic_ns() + us * 1000);
}

// Polls cudaEventQuery: first sleeps until wake_at_ns (CLOCK_MONOTONIC; 0 = not at all), then polls
// every interval_us (0 = spin). Returns the number of queries, negated if timeout_us passed first.
// The thread's timer slack (50 us by default on Linux) is lowered to 1 us for the wait, so a 20 us
// sleep is not stretched to 70 us; the caller's slack is restored afterwards.
int64_t event_poll_impl(uintptr_t ev, int64_t wake_at_ns, int64_t interval_us, int64_t timeout_us) {
  const int64_t t0 = monotonic_ns();
  const int64_t deadline = timeout_us < 0 ? INT64_MAX : t0 + timeout_us * 1000;
  int64_t polls = 0;
  if (wake_at_ns > t0) {
    // A first query first: no point sleeping on work that is already done.
    ++polls;
    const cudaError_t st = cudaEventQuery(as_event(ev));
    if (st == cudaSuccess) return polls;
    if (st != cudaErrorNotReady) check(st, "cudaEventQuery");
    sleep_until_ns(std::min(wake_at_ns, deadline));
  }
  for (;;) {
    ++polls;
    const cudaError_t st = cudaEventQuery(as_event(ev));
    if (st == cudaSuccess) return polls;
    if (st != cudaErrorNotReady) check(st, "cudaEventQuery");
    if (monotonic_ns() >= deadline) return -polls;
    sleep_for_us(interval_us);
  }
}

// (polls, elapsed_ns): the count (negative on timeout) and the wall time the wait took, from which
// the caller reports the interval it achieved.
nb::tuple event_poll(uintptr_t ev, int64_t wake_at_ns, int64_t interval_us, int64_t timeout_us) {
  int64_t polls = 0, elapsed = 0;
  {
    nb::gil_scoped_release release;
    SlackGuard slack(kPollSlackNs);
    const int64_t t0 = monotonic_ns();
    polls = event_poll_impl(ev, wake_at_ns, interval_us, timeout_us);
    elapsed = monotonic_ns() - t0;
  }
  return nb::make_tuple(polls, elapsed);
}

// State shared by a cudaLaunchHostFunc callback and the thread waiting for it; whichever of the two
// lets go last frees it, so a wait that times out leaves nothing dangling.
struct HostSignal {
  std::mutex m;
  std::condition_variable cv;
  bool fired = false;
  std::atomic<int> refs{2};
  void release() {
    if (refs.fetch_sub(1) == 1) delete this;
  }
};

void CUDART_CB host_signal_fn(void* arg) {
  auto* s = static_cast<HostSignal*>(arg);
  {
    std::lock_guard<std::mutex> lock(s->m);
    s->fired = true;
  }
  s->cv.notify_one();
  s->release();
}

// Waits for the host function enqueued behind the work on `stream`. CUDA never runs a host function
// once the context has faulted, so the wait is sliced: between slices cudaStreamQuery is asked, and
// an error there (the fault) is raised instead of waiting forever. timeout_us < 0 waits without a
// deadline but still stops on a fault. Returns false on timeout.
bool callback_wait(uintptr_t stream, int64_t timeout_us) {
  auto* s = new HostSignal;
  const cudaError_t err = cudaLaunchHostFunc(as_stream(stream), host_signal_fn, s);
  if (err != cudaSuccess) {
    delete s;
    check(err, "cudaLaunchHostFunc");
  }
  bool fired = false;
  cudaError_t fault = cudaSuccess;
  {
    nb::gil_scoped_release release;
    const int64_t deadline = timeout_us < 0 ? INT64_MAX : monotonic_ns() + timeout_us * 1000;
    std::unique_lock<std::mutex> lock(s->m);
    for (;;) {
      const int64_t left_us = (deadline - monotonic_ns()) / 1000;
      if (left_us <= 0 && deadline != INT64_MAX) break;
      const int64_t slice_us = std::min<int64_t>(kCallbackSliceUs, deadline == INT64_MAX ? kCallbackSliceUs : left_us);
      if (s->cv.wait_for(lock, std::chrono::microseconds(slice_us), [s] { return s->fired; })) {
        fired = true;
        break;
      }
      lock.unlock();
      const cudaError_t st = cudaStreamQuery(as_stream(stream));
      lock.lock();
      if (st != cudaSuccess && st != cudaErrorNotReady) {
        fault = st;
        break;
      }
      if (s->fired) {
        fired = true;
        break;
      }
    }
  }
  s->release();  // the callback, if it ever runs, frees the signal after us
  if (fault != cudaSuccess) check(fault, "cudaStreamQuery (while waiting for cudaLaunchHostFunc)");
  return fired;
}

void bind_runtime(nb::module_& m) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const CudaStatusError& e) {
      const auto st = static_cast<cudaError_t>(e.status);
      try {
        nb::object cls = nb::module_::import_("gpuprims.cuda.errors").attr("CudaError");
        nb::object exc = cls(e.status, cudaGetErrorName(st), cudaGetErrorString(st), e.call);
        PyErr_SetObject(cls.ptr(), exc.ptr());
      } catch (nb::python_error& pe) {
        pe.restore();
      }
    }
  });

  m.def("cuda_error_name", [](int s) { return std::string(cudaGetErrorName(static_cast<cudaError_t>(s))); });
  m.def("cuda_error_string", [](int s) { return std::string(cudaGetErrorString(static_cast<cudaError_t>(s))); });
  m.def("cuda_raise", [](int s, const std::string& call) { check(static_cast<cudaError_t>(s), call.c_str()); },
        "Raises CudaError for status s (no-op for cudaSuccess): the choke point, for tests.");
  m.def("cuda_runtime_version", [] {
    int v = 0;
    check(cudaRuntimeGetVersion(&v), "cudaRuntimeGetVersion");
    return v;
  });
  m.def("cuda_driver_version", [] {
    int v = 0;
    check(cudaDriverGetVersion(&v), "cudaDriverGetVersion");
    return v;  // 0 where no driver is installed
  });
  m.def("cuda_kernel_image", [](int dev) {
    DeviceGuard g(dev);
    d::KernelInfo info{};
    check(d::kernel_info(&info), "cudaFuncGetAttributes (GPU-DMA kernels for this device)");
    nb::dict out;
    out["gather_regs"] = info.gather_regs;
    out["gather_local_bytes"] = info.gather_local_bytes;
    out["gather_ptx_version"] = info.gather_ptx_version;
    out["gather_binary_version"] = info.gather_binary_version;
    out["finalize_regs"] = info.finalize_regs;
    return out;
  }, "Loads the GPU-DMA kernels for device dev (cudaFuncGetAttributes): their registers, local memory and "
     "the PTX/binary versions of the image the driver picked; raises CudaError (cudaErrorNoKernelImageForDevice, "
     "cudaErrorUnsupportedPtxVersion, ...) if none can run there.");
  m.def("cuda_device_capability", [](int dev) {
    int major = 0, minor = 0;
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "cudaDeviceGetAttribute");
    return nb::make_tuple(major, minor);
  });
  m.def("cuda_device_name", [](int dev) {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
    return std::string(prop.name);
  });
  m.def("cuda_device_count", [] {
    int n = 0;
    check(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
    return n;
  });
  m.def("cuda_get_device", [] {
    int d = 0;
    check(cudaGetDevice(&d), "cudaGetDevice");
    return d;
  });
  m.def("cuda_set_device_flags", [](int dev, unsigned flags) {
    DeviceGuard g(dev);
    check(cudaSetDeviceFlags(flags), "cudaSetDeviceFlags");
  });
  m.def("cuda_get_device_flags", [](int dev) {
    DeviceGuard g(dev);
    unsigned flags = 0;
    check(cudaGetDeviceFlags(&flags), "cudaGetDeviceFlags");
    return flags;
  });
  m.def("cuda_device_synchronize", [](int dev) {
    DeviceGuard g(dev);
    nb::gil_scoped_release release;
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  });
  m.def("cuda_mem_get_info", [](int dev) {
    DeviceGuard g(dev);
    size_t free_b = 0, total_b = 0;
    check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    return nb::make_tuple(free_b, total_b);
  });
  m.def("cuda_pci_bus_id", [](int dev) {
    char buf[32] = {0};
    check(cudaDeviceGetPCIBusId(buf, sizeof(buf), dev), "cudaDeviceGetPCIBusId");
    return std::string(buf);
  });
  m.def("cuda_device_by_pci_bus_id", [](const std::string& bus) {
    int dev = -1;
    check(cudaDeviceGetByPCIBusId(&dev, bus.c_str()), "cudaDeviceGetByPCIBusId");
    return dev;
  });

  // Streams and events: handles are ints (the cudaStream_t / cudaEvent_t pointer values).
  m.def("cuda_stream_create", [](int dev, unsigned flags, int priority) {
    DeviceGuard g(dev);
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithPriority(&s, flags, priority), "cudaStreamCreateWithPriority");
    return reinterpret_cast<uintptr_t>(s);
  });
  m.def("cuda_stream_destroy", [](uintptr_t s) { check(cudaStreamDestroy(as_stream(s)), "cudaStreamDestroy"); });
  m.def("cuda_stream_synchronize", [](uintptr_t s) {
    nb::gil_scoped_release release;
    check(cudaStreamSynchronize(as_stream(s)), "cudaStreamSynchronize");
  });
  m.def("cuda_stream_query", [](uintptr_t s) {
    const cudaError_t st = cudaStreamQuery(as_stream(s));
    if (st == cudaErrorNotReady) return false;
    check(st, "cudaStreamQuery");
    return true;
  });
  m.def("cuda_stream_wait_event", [](uintptr_t s, uintptr_t e) {
    check(cudaStreamWaitEvent(as_stream(s), as_event(e), 0), "cudaStreamWaitEvent");
  });
  m.def("cuda_event_create", [](int dev, unsigned flags) {
    DeviceGuard g(dev);
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, flags), "cudaEventCreateWithFlags");
    return reinterpret_cast<uintptr_t>(e);
  });
  m.def("cuda_event_destroy", [](uintptr_t e) { check(cudaEventDestroy(as_event(e)), "cudaEventDestroy"); });
  m.def("cuda_event_record", [](uintptr_t e, uintptr_t s) {
    check(cudaEventRecord(as_event(e), as_stream(s)), "cudaEventRecord");
  });
  m.def("cuda_event_query", [](uintptr_t e) {
    const cudaError_t st = cudaEventQuery(as_event(e));
    if (st == cudaErrorNotReady) return false;
    check(st, "cudaEventQuery");
    return true;
  });
  m.def("cuda_event_synchronize", [](uintptr_t e) {
    nb::gil_scoped_release release;
    check(cudaEventSynchronize(as_event(e)), "cudaEventSynchronize");
  });
  m.def("cuda_event_elapsed_ms", [](uintptr_t start, uintptr_t end) {
    float ms = 0;
    check(cudaEventElapsedTime(&ms, as_event(start), as_event(end)), "cudaEventElapsedTime");
    return ms;
  });
  m.def("cuda_event_poll", &event_poll, nb::arg("event"), nb::arg("wake_at_ns"), nb::arg("interval_us"),
        nb::arg("timeout_us"),
        "cudaEventQuery every interval_us (after sleeping until wake_at_ns, CLOCK_MONOTONIC) with the GIL "
        "released and the thread's timer slack at 1 us; returns (queries, elapsed_ns), queries negative if "
        "timeout_us passed first.");
  m.def("cuda_callback_wait", &callback_wait, nb::arg("stream"), nb::arg("timeout_us"),
        "Enqueues cudaLaunchHostFunc on stream and blocks (GIL released) until it runs; False on timeout; "
        "raises CudaError if the stream faults meanwhile (CUDA then never runs the function).");
  m.def("monotonic_ns", &monotonic_ns);

  // Memory.
  m.def("cuda_host_register", [](uintptr_t p, size_t n, unsigned flags) {
    check(cudaHostRegister(as_ptr(p), n, flags), "cudaHostRegister");
  });
  m.def("cuda_host_unregister", [](uintptr_t p) { check(cudaHostUnregister(as_ptr(p)), "cudaHostUnregister"); });
  m.def("cuda_host_get_device_pointer", [](uintptr_t p, int dev) {
    DeviceGuard g(dev);
    void* dp = nullptr;
    check(cudaHostGetDevicePointer(&dp, as_ptr(p), 0), "cudaHostGetDevicePointer");
    return reinterpret_cast<uintptr_t>(dp);
  });
  m.def("cuda_host_alloc", [](size_t n, unsigned flags) {
    void* p = nullptr;
    check(cudaHostAlloc(&p, n, flags), "cudaHostAlloc");
    return reinterpret_cast<uintptr_t>(p);
  });
  m.def("cuda_free_host", [](uintptr_t p) { check(cudaFreeHost(as_ptr(p)), "cudaFreeHost"); });
  m.def("cuda_malloc", [](int dev, size_t n) {
    DeviceGuard g(dev);
    void* p = nullptr;
    check(cudaMalloc(&p, n), "cudaMalloc");
    return reinterpret_cast<uintptr_t>(p);
  });
  m.def("cuda_free", [](int dev, uintptr_t p) {
    DeviceGuard g(dev);
    check(cudaFree(as_ptr(p)), "cudaFree");
  });
  m.def("cuda_memset", [](int dev, uintptr_t p, int value, size_t n) {
    DeviceGuard g(dev);
    nb::gil_scoped_release release;
    check(cudaMemset(as_ptr(p), value, n), "cudaMemset");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  });
  m.def("cuda_memcpy_async", [](uintptr_t dst, uintptr_t src, size_t n, uintptr_t s) {
    check(cudaMemcpyAsync(as_ptr(dst), as_ptr(src), n, cudaMemcpyDefault, as_stream(s)), "cudaMemcpyAsync");
  });

  // IPC.
  m.def("cuda_ipc_get_mem_handle", [](int dev, uintptr_t p) {
    DeviceGuard g(dev);
    cudaIpcMemHandle_t h{};
    check(cudaIpcGetMemHandle(&h, as_ptr(p)), "cudaIpcGetMemHandle");
    return nb::bytes(h.reserved, sizeof(h.reserved));
  });
  m.def("cuda_ipc_open_mem_handle", [](int dev, nb::bytes handle) {
    if (handle.size() != sizeof(cudaIpcMemHandle_t))
      throw std::invalid_argument("a CUDA IPC memory handle is 64 bytes, got " + std::to_string(handle.size()));
    cudaIpcMemHandle_t h{};
    std::memcpy(h.reserved, handle.c_str(), sizeof(h.reserved));
    DeviceGuard g(dev);
    void* p = nullptr;
    check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
    return reinterpret_cast<uintptr_t>(p);
  });
  m.def("cuda_ipc_close_mem_handle", [](int dev, uintptr_t p) {
    DeviceGuard g(dev);
    check(cudaIpcCloseMemHandle(as_ptr(p)), "cudaIpcCloseMemHandle");
  });

  // GPU-DMA launch: records of the pool at pool_dev (device pointer of the registered mapping) into
  // `out`; verdicts through `result` (device pointer of mapped pinned host memory, 1 + kMaxBatch int32).
  m.def(
      "dma_launch",
      [](int dev, uintptr_t stream, const PoolGeometry& g, uintptr_t pool_dev, RecordArray records, uintptr_t out,
         uint64_t out_nbytes, uint64_t row_stride, uint64_t row_src_bytes, int32_t expect_dtype, uint32_t mode,
         uint32_t channels, const std::vector<float>& a, const std::vector<float>& b,
         const std::vector<float>& dv, uintptr_t status_dev,
         uintptr_t result_dev, uint32_t blocks_per_row) {
        const uint64_t n = records.shape(0);
        check_rows(n, out, out_nbytes, row_stride, row_src_bytes, mode, channels, a.size(), b.size(), dv.size());
        d::LaunchParams p{};
        p.pool = reinterpret_cast<const uint8_t*>(pool_dev);
        p.slots_offset = g.slots_offset;
        p.records_offset = g.records_offset;
        p.chunkmap_offset = g.chunkmap_offset;
        p.slot_size = g.slot_size;
        p.slot_count = g.slot_count;
        p.record_count = g.record_count;
        p.n = uint32_t(n);
        p.geo = d::Geometry{g.max_chunks, g.max_payload(), row_src_bytes, expect_dtype};
        p.out = reinterpret_cast<uint8_t*>(out);
        p.row_stride = row_stride;
        p.status = reinterpret_cast<int32_t*>(status_dev);
        p.mode = mode;
        p.channels = channels;
        for (uint32_t i = 0; i < d::kMaxChannels; ++i) {
          p.a[i] = i < a.size() ? a[i] : 0.f;
          p.b[i] = i < b.size() ? b[i] : 0.f;
          p.d[i] = i < dv.size() ? dv[i] : 1.f;
        }
        std::memcpy(p.records, records.data(), n * sizeof(uint32_t));
        DeviceGuard guard(dev);
        check(d::launch_gather(p, blocks_per_row, reinterpret_cast<int32_t*>(result_dev), as_stream(stream)),
              "launch_gather");
      },
      nb::arg("device"), nb::arg("stream"), nb::arg("geometry"), nb::arg("pool_dev"), nb::arg("records"),
      nb::arg("out"), nb::arg("out_nbytes"), nb::arg("row_stride"), nb::arg("row_src_bytes"),
      nb::arg("expect_dtype"), nb::arg("mode"), nb::arg("channels"), nb::arg("a"), nb::arg("b"), nb::arg("d"),
      nb::arg("status_dev"), nb::arg("result_dev"), nb::arg("blocks_per_row"));
}

#endif  // GPUPRIMS_HAVE_CUDA

}  // namespace

void bind_cuda(nb::module_& m) {
  m.attr("DMA_MAX_BATCH") = d::kMaxBatch;
  m.attr("DMA_MODE_COPY") = d::kModeCopy;
  m.attr("DMA_MODE_U8_TO_F32") = d::kModeU8ToF32;
  m.attr("DMA_MAX_CHANNELS") = d::kMaxChannels;

  m.def("get_timer_slack_ns", &get_timer_slack_ns, "This thread's Linux timer slack (PR_GET_TIMERSLACK), ns.");
  m.def("set_timer_slack_ns", &set_timer_slack_ns, nb::arg("ns"),
        "Set this thread's Linux timer slack (PR_SET_TIMERSLACK), ns (0 is taken as 1).");
  m.def("dma_record_layout", [] {
    nb::dict dd;
#define GP_FIELD(name) dd[#name] = nb::make_tuple(offsetof(pool::Record, name), sizeof(pool::Record::name))
    GP_FIELD(state);
    GP_FIELD(app_id);
    GP_FIELD(dtype);
    GP_FIELD(chunk_count);
    GP_FIELD(stride);
    GP_FIELD(total_len);
    GP_FIELD(request_id);
#undef GP_FIELD
    dd["size"] = sizeof(pool::Record);
    return dd;
  }, "Record field name -> (offset, size) as the GPU-DMA kernel reads them.");

  nb::class_<PoolGeometry>(m, "PoolGeometry")
      .def(nb::init<uint64_t, uint64_t, uint64_t, uint64_t, uint32_t, uint32_t, uint32_t, uint32_t>(),
           nb::arg("nbytes"), nb::arg("slots_offset"), nb::arg("records_offset"), nb::arg("chunkmap_offset"),
           nb::arg("slot_size"), nb::arg("slot_count"), nb::arg("record_count"), nb::arg("max_chunks"))
      .def_ro("nbytes", &PoolGeometry::nbytes)
      .def_ro("slot_size", &PoolGeometry::slot_size)
      .def_ro("slot_count", &PoolGeometry::slot_count)
      .def_ro("record_count", &PoolGeometry::record_count)
      .def_ro("max_chunks", &PoolGeometry::max_chunks)
      .def_prop_ro("max_payload", &PoolGeometry::max_payload);

  m.def(
      "dma_gather_cpu",
      [](uintptr_t base, const PoolGeometry& g, RecordArray records, uintptr_t out, uint64_t out_nbytes,
         uint64_t row_stride, uint64_t row_src_bytes, int32_t expect_dtype, uint32_t mode, uint32_t channels,
         const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& dv,
         StatusArray status) {
        const uint64_t n = records.shape(0);
        check_rows(n, out, out_nbytes, row_stride, row_src_bytes, mode, channels, a.size(), b.size(), dv.size());
        if (status.shape(0) < n) throw std::invalid_argument("status array is shorter than the record list");
        const d::Geometry geo{g.max_chunks, g.max_payload(), row_src_bytes, expect_dtype};
        const uint32_t* recs = records.data();
        int32_t* st = status.data();
        nb::gil_scoped_release release;
        return gather_cpu(reinterpret_cast<const uint8_t*>(base), g, recs, uint32_t(n),
                          reinterpret_cast<uint8_t*>(out), row_stride, geo, mode, channels, a.data(), b.data(),
                          dv.data(), st);
      },
      nb::arg("base"), nb::arg("geometry"), nb::arg("records"), nb::arg("out"), nb::arg("out_nbytes"),
      nb::arg("row_stride"), nb::arg("row_src_bytes"), nb::arg("expect_dtype"), nb::arg("mode"),
      nb::arg("channels"), nb::arg("a"), nb::arg("b"), nb::arg("d"), nb::arg("status"),
      "CPU reference of the GPU-DMA kernel: same checks, verdicts and bytes. Returns rows placed.");

#ifdef GPUPRIMS_HAVE_CUDA
  bind_runtime(m);
#endif
}

}  // namespace gpuprims
