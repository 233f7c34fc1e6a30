#pragma once
// The CUDA host emulation of the tests stands in for the toolkit's <cuda_runtime.h>.
#include "cuda_host_emulation.hpp"
