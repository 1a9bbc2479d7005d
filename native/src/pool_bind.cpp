#include "bindings.h"

namespace gpuprims {

void bind_pool(nb::module_& m) {}

}  // namespace gpuprims
