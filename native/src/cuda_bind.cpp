// CUDA part of gpuprims._native. Without nvcc at build time it still defines the functions, which
// report that the kernels were not built.
#include "bindings.h"

namespace gpuprims {

void bind_cuda(nb::module_& m) {}

}  // namespace gpuprims
