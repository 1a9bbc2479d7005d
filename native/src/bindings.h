// Each native/src/*_bind.cpp file adds its part of gpuprims._native to the module.
#pragma once
#include <nanobind/nanobind.h>

namespace nb = nanobind;

namespace gpuprims {
void bind_wire(nb::module_& m);
void bind_pool(nb::module_& m);
void bind_cuda(nb::module_& m);
void bind_traffic(nb::module_& m);
void bind_ingest_cost(nb::module_& m);
void bind_ledger(nb::module_& m);
}  // namespace gpuprims
