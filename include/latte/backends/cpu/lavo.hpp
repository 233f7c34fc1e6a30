#pragma once
// CPU backend for LAVO: the blocked forward and decode step (lavo/forward.hpp)
// and their backward (lavo/backward.hpp).
#include "latte/backends/cpu/lavo/backward.hpp"
#include "latte/backends/cpu/lavo/forward.hpp"
