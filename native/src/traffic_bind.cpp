// Traffic-tool helpers of gpuprims._native (batched UDP send/receive).
#include "bindings.h"

namespace gpuprims {

void bind_traffic(nb::module_& m) {}

}  // namespace gpuprims
