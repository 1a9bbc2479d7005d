// The ingest's per-queue cost model (CPU overflow, issue 18): a setter and a getter, bound as module
// functions so that they stay out of the Ingest class binding in pool_bind.cpp.
#include <nanobind/stl/pair.h>

#include "bindings.h"
#include "ingest.h"

namespace gpuprims {

void bind_ingest_cost(nb::module_& m) {
  m.def(
      "ingest_set_cost",
      [](Ingest& ing, uint32_t consumer, double fixed_us, double per_request_us) {
        ing.set_cost(consumer, fixed_us, per_request_us);
      },
      nb::arg("ingest"), nb::arg("consumer"), nb::arg("fixed_us"), nb::arg("per_request_us"),
      "Set consumer's cost model: predicted finish = fixed_us + per_request_us * (queued + 1); "
      "fixed_us < 0 clears it.");
  m.def(
      "ingest_cost", [](const Ingest& ing, uint32_t consumer) { return ing.cost(consumer); }, nb::arg("ingest"),
      nb::arg("consumer"), "(fixed_us, per_request_us) of consumer; fixed_us < 0 when it has none.");
}

}  // namespace gpuprims
