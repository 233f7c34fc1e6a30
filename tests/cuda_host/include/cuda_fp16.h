#pragma once
// The CUDA host emulation of the tests stands in for the toolkit's <cuda_fp16.h>.
#include "cuda_host_emulation.hpp"
