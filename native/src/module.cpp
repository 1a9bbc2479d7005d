// gpuprims._native: the private native layer. It maps closely onto what it wraps; the public,
// documented classes live in the Python package (STYLE.md 1).
#include "bindings.h"

NB_MODULE(_native, m) {
  m.doc() = "gpuprims private native layer (wire format, packet pool, ingest, gather, CUDA kernels)";
  m.attr("__version__") = GPUPRIMS_VERSION;
#ifdef GPUPRIMS_HAVE_CUDA
  m.attr("CUDA_KERNELS_BUILT") = true;
#else
  m.attr("CUDA_KERNELS_BUILT") = false;
#endif
  gpuprims::bind_wire(m);
  gpuprims::bind_pool(m);
  gpuprims::bind_cuda(m);
  gpuprims::bind_traffic(m);
  gpuprims::bind_ingest_cost(m);
  gpuprims::bind_ledger(m);
}
