#pragma once
// latte — header-only linear-time attention. This umbrella header is the
// whole public API; it only includes.
#include "latte/core/eigen.hpp"
#include "latte/core/error.hpp"
#include "latte/core/orthonormal_basis.hpp"
#include "latte/core/tensor.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/mechanisms/conv_compressed_attention.hpp"
#include "latte/mechanisms/latte_attention.hpp"
#include "latte/mechanisms/lavo.hpp"
#include "latte/mechanisms/softmax_attention.hpp"
#include "latte/policies/direction.hpp"
#include "latte/policies/execution.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/stabilizer.hpp"
#include "latte/policies/window.hpp"
#include "latte/version.hpp"
