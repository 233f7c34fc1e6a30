#pragma once
// KernelCall: what every binding holds while a latte kernel runs. It releases
// the GIL (other Python threads run meanwhile) and adds the call's wall time
// to a process-wide total, latte.kernel_seconds(): the C++ calls' own time, so
// that the rest of a Python call's time (argument checks, output arrays,
// torch's dispatch and autograd) is measured on the same call, not against a
// separate C++ run on a shared machine (bench/peers/latte_torch.py).
//
// Cost: two steady_clock reads and one atomic add per call (~50 ns).
#include <nanobind/nanobind.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace latte::python {

/// Nanoseconds spent inside latte kernels called from Python, all threads.
[[nodiscard]] inline std::atomic<std::int64_t>& kernel_nanoseconds() noexcept {
  static std::atomic<std::int64_t> total{0};
  return total;
}

/// Held around one kernel call: the GIL released, the wall time counted.
class KernelCall {
 public:
  KernelCall() = default;
  KernelCall(const KernelCall&) = delete;
  KernelCall& operator=(const KernelCall&) = delete;
  ~KernelCall() {
    const auto elapsed = std::chrono::steady_clock::now() - start_;
    kernel_nanoseconds().fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count(),
                                   std::memory_order_relaxed);
  }

 private:
  nanobind::gil_scoped_release released_;  // released first, taken back last
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace latte::python
