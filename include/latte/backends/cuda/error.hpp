#pragma once
// CUDA runtime errors as latte::Error: the argument names what was being done
// ("exec::cuda"), the message carries CUDA's own name and text, e.g.
//   "latte: argument 'exec::cuda': latte_chunk_outputs launch failed:
//    cudaErrorInvalidConfiguration (invalid configuration argument)".
// A failing call is reported where it happens; a launch is checked with
// cudaGetLastError right after it (asynchronous faults surface at the next
// synchronising call the caller makes, as with any CUDA library).
#include <cuda_runtime_api.h>

#include <string>
#include <string_view>

#include "latte/core/error.hpp"

namespace latte::cuda {

/// Throws latte::Error("exec::cuda", "<what> failed: <cuda name> (<cuda text>)")
/// unless `status` is cudaSuccess.
inline void check(cudaError_t status, std::string_view what) {
  if (status == cudaSuccess) return;
  throw Error("exec::cuda", std::string(what) + " failed: " + cudaGetErrorName(status) + " (" +
                                cudaGetErrorString(status) + ")");
}

/// Checks the launch that was just queued (bad configuration, missing device, ...).
inline void check_launch(std::string_view kernel) {
  check(cudaGetLastError(), std::string(kernel) + " launch");
}

}  // namespace latte::cuda
