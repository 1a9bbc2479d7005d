// Host shim: the runtime API header is the same shim (see cuda_runtime.h beside this file).
#pragma once
#include "cuda_runtime.h"
