// Host shim of the CUDA runtime for running native/cuda/dma.cu, unchanged, on the CPU with g++ (and
// under ASan/UBSan). Only what the kernel source uses is here:
//
// * __global__/__device__/__launch_bounds__/__grid_constant__ vanish; __shared__ becomes `static`,
//   which is right because the blocks of a launch run one after another (threads of one block run
//   concurrently, on real threads, so __syncthreads really synchronises them).
// * threadIdx/blockIdx are thread-locals set per thread and block; blockDim/gridDim are globals.
// * __syncthreads is a std::barrier of the block's threads; __syncthreads_count counts the predicate
//   in one of three rotating counters (a counter is reset two barriers after its last use, so no
//   thread can still be reading it).
// * __ldcv is a plain load through the typed pointer (so UBSan checks its alignment); __fmul_rn and
//   friends are single float operations (build with -ffp-contract=off so none fuse); atomicMax is an
//   atomic compare-exchange loop.
// * cudaLaunchKernelEx(config, kernel, args...) copies the arguments (kernel parameters are copied at
//   launch) and runs the grid on a persistent pool of threads, one per thread of a block.
// * cudaGetLastError returns and clears a thread-local slot that a test may preset
//   (gpshim::set_last_error), to check that a launch does not report an earlier call's error.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static
#define CUDART_CB

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorNoKernelImageForDevice = 209,
  cudaErrorLaunchFailure = 719,
};
using cudaError = cudaError_t;
struct CUstream_st;
using cudaStream_t = CUstream_st*;

struct cudaLaunchConfig_t {
  dim3 gridDim;
  dim3 blockDim;
  size_t dynamicSmemBytes = 0;
  cudaStream_t stream = nullptr;
  void* attrs = nullptr;
  unsigned numAttrs = 0;
};

struct cudaFuncAttributes {
  size_t sharedSizeBytes = 0, constSizeBytes = 0, localSizeBytes = 0;
  int maxThreadsPerBlock = 1024, numRegs = 0, ptxVersion = 0, binaryVersion = 0;
};

// The built-in variables, as globals (threads and blocks as thread-locals).
inline thread_local dim3 threadIdx{0, 0, 0};
inline thread_local dim3 blockIdx{0, 0, 0};
inline dim3 blockDim;
inline dim3 gridDim;

namespace gpshim {

inline thread_local unsigned tl_count_phase = 0;
inline thread_local cudaError_t tl_last_error = cudaSuccess;

inline void set_last_error(cudaError_t e) { tl_last_error = e; }

// One launch's block-level synchronisation.
struct BlockSync {
  explicit BlockSync(std::ptrdiff_t n) : bar(n) {}
  std::barrier<> bar;
  std::atomic<int> counts[3] = {0, 0, 0};
};
inline BlockSync* g_sync = nullptr;

// Persistent workers: worker i is thread i of every block of a launch.
class Pool {
 public:
  static Pool& get() {
    static Pool pool;
    return pool;
  }

  void run(dim3 grid, dim3 block, const std::function<void()>& body) {
    std::lock_guard<std::mutex> one_launch(launch_m_);
    const unsigned n = block.x * block.y * block.z;
    while (workers_.size() < n) {
      const unsigned id = unsigned(workers_.size());
      workers_.emplace_back([this, id] { loop(id); });
    }
    BlockSync sync(n);
    g_sync = &sync;
    ::blockDim = block;
    ::gridDim = grid;
    {
      std::lock_guard<std::mutex> lk(m_);
      body_ = &body;
      active_ = n;
      remaining_ = n;
      ++generation_;
    }
    cv_.notify_all();
    std::unique_lock<std::mutex> lk(m_);
    done_cv_.wait(lk, [this] { return remaining_ == 0; });
    g_sync = nullptr;
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
      ++generation_;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

 private:
  void loop(unsigned id) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void()>* body = nullptr;
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return stop_ || (generation_ != seen && id < active_); });
        if (stop_) return;
        seen = generation_;
        body = body_;
      }
      const dim3 b = ::blockDim, g = ::gridDim;
      ::threadIdx = dim3(id % b.x, (id / b.x) % b.y, id / (b.x * b.y));
      tl_count_phase = 0;
      for (unsigned z = 0; z < g.z; ++z)
        for (unsigned y = 0; y < g.y; ++y)
          for (unsigned x = 0; x < g.x; ++x) {
            ::blockIdx = dim3(x, y, z);
            (*body)();
            g_sync->bar.arrive_and_wait();  // the block's __shared__ statics are reused by the next block
          }
      {
        std::lock_guard<std::mutex> lk(m_);
        if (--remaining_ == 0) done_cv_.notify_one();
      }
    }
  }

  std::mutex launch_m_, m_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void()>* body_ = nullptr;
  unsigned active_ = 0, remaining_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace gpshim

inline void __syncthreads() { gpshim::g_sync->bar.arrive_and_wait(); }

inline int __syncthreads_count(int predicate) {
  gpshim::BlockSync& s = *gpshim::g_sync;
  const unsigned k = gpshim::tl_count_phase++;
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) s.counts[(k + 1) % 3].store(0);
  if (predicate) s.counts[k % 3].fetch_add(1);
  s.bar.arrive_and_wait();
  return s.counts[k % 3].load();
}

inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <typename T>
inline T __ldcv(const T* p) {
  return *p;
}

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }

inline int atomicMax(int* addr, int v) {
  std::atomic_ref<int> a(*addr);
  int old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}

inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = gpshim::tl_last_error;
  gpshim::tl_last_error = cudaSuccess;
  return e;
}

template <typename... Exp, typename... Act>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* cfg, void (*kernel)(Exp...), Act&&... args) {
  const dim3 b = cfg->blockDim, g = cfg->gridDim;
  const uint64_t threads = uint64_t(b.x) * b.y * b.z;
  if (threads == 0 || threads > 1024 || g.x == 0 || g.y == 0 || g.z == 0 || g.y > 65535 || g.z > 65535) {
    gpshim::tl_last_error = cudaErrorInvalidConfiguration;
    return cudaErrorInvalidConfiguration;
  }
  std::tuple<std::decay_t<Exp>...> params(std::forward<Act>(args)...);  // copied, as kernel parameters are
  const std::function<void()> body = [&] { std::apply(kernel, params); };
  gpshim::Pool::get().run(g, b, body);
  return cudaSuccess;
}

template <typename... Exp>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, void (*)(Exp...)) {
  *attr = cudaFuncAttributes{};
  return cudaSuccess;
}
