#pragma once
// CPU backend for the linear-attention family: the forward scans and GEMMs
// (linear/forward.hpp) and their backward (linear/backward.hpp).
#include "latte/backends/cpu/linear/backward.hpp"
#include "latte/backends/cpu/linear/forward.hpp"
