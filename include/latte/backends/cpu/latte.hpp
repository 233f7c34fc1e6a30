#pragma once
// CPU backend for Latte: the forward scans and contractions (latte/forward.hpp)
// and their backward (latte/backward.hpp).
#include "latte/backends/cpu/latte/backward.hpp"
#include "latte/backends/cpu/latte/forward.hpp"
