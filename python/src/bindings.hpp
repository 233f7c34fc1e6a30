#pragma once
// What the binding files of latte's Python module share: the execution tag
// named by `exec` and the dtype named by a string. Each mechanism's file
// defines one bind_* function, which module.cpp declares and calls.
#include <nanobind/nanobind.h>

#include <string>

#include "arrays.hpp"
#include "latte/core/error.hpp"
#include "latte/policies/execution.hpp"

namespace latte::python {

enum class Backend { cpu, reference };

/// "cpu" or "reference" (exec::cpu, exec::reference); CUDA is not in the Python build.
[[nodiscard]] inline Backend parse_exec(const std::string& exec) {
  if (exec == "cpu") return Backend::cpu;
  if (exec == "reference") return Backend::reference;
  throw Error("exec", detail::expected_given("backend", "\"cpu\" or \"reference\"", "\"" + exec + "\""));
}

/// Calls f(exec::cpu) or f(exec::reference).
template <class F>
void with_backend(Backend backend, F&& f) {
  if (backend == Backend::cpu) f(exec::cpu);
  else f(exec::reference);
}

[[nodiscard]] inline Dtype parse_dtype(const std::string& dtype) {
  if (dtype == "float32") return Dtype::float32;
  if (dtype == "float64") return Dtype::float64;
  throw Error("dtype", detail::expected_given("dtype", "\"float32\" or \"float64\"", "\"" + dtype + "\""));
}

}  // namespace latte::python
