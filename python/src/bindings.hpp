#pragma once
// What the binding files of latte's Python module share: the execution tag
// named by `exec` and the dtype named by a string. Each mechanism's file
// defines one bind_* function, which module.cpp declares and calls.
#include <nanobind/nanobind.h>

#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <vector>

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

/// VAPOR's learned angles [H, Dv/2] (float64) as a flat [H * Dv/2] list for a
/// mechanism's config: empty when none are given (the RoPE schedule), refused
/// without vapor=True or at another shape.
[[nodiscard]] inline std::vector<double> vapor_angles(const std::optional<AnyArray>& angles, bool vapor,
                                                      index_t heads, index_t value_dim) {
  std::vector<double> flat;
  if (!angles) return flat;
  if (!vapor) throw Error("angles", "given without vapor=True (only VAPOR rotates by angles)");
  const auto view = view_of<double, 2>(*angles, "angles", "[H, Dv/2]", Dtype::float64);
  const std::array<index_t, 2> expected{heads, value_dim / 2};
  if (view.extents() != expected)
    throw Error("angles", detail::expected_given("shape [H, Dv/2]", format_extents(expected),
                                                 format_extents(view.extents())));
  for (index_t h = 0; h < expected[0]; ++h)
    for (index_t i = 0; i < expected[1]; ++i) flat.push_back(view(h, i));
  return flat;
}

/// The gradient arrays of VAPOR's angles ([H, Dv/2], zeroed: the backward adds
/// into them) when the config's mechanism rotates by VAPOR; none otherwise.
template <Real T, class Config>
[[nodiscard]] std::vector<NumpyArray<T>> vapor_angle_gradients(const Config& c) {
  std::vector<NumpyArray<T>> out;
  if (!c.vapor) return out;
  out.push_back(new_array<T, 2>({c.heads, c.value_dim / 2}));
  std::fill_n(out.back().data(), out.back().size(), T(0));
  return out;
}

}  // namespace latte::python
