// latte.LatteAttention: LatteAttention<Causal | Bidirectional, RunningMax,
// NoPositional | VAPOR> from Python (mechanism.hpp does the calls).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstring>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"
#include "latte/mechanisms/latte_attention.hpp"
#include "mechanism.hpp"

namespace latte::python {
namespace {

struct LatteTraits {
  struct Config {
    index_t heads = 0, latents = 0, value_dim = 0;
    bool causal = true;
    bool vapor = false;
    std::vector<double> angles;  // [H * Dv/2] as given; empty: the RoPE schedule
  };
  using Any = std::variant<LatteAttention<Causal, RunningMax, NoPositional>, LatteAttention<Causal, RunningMax, VAPOR>,
                           LatteAttention<Bidirectional, RunningMax, NoPositional>,
                           LatteAttention<Bidirectional, RunningMax, VAPOR>>;
  template <Real T>
  using State = LatteState<T>;
  static constexpr std::array<InputSpec, 3> inputs{{{"query_logits", "[B, T, H, L]", "[B, H, L]"},
                                                    {"key_logits", "[B, T, H, L]", "[B, H, L]"},
                                                    {"values", "[B, T, H, Dv]", "[B, H, Dv]"}}};

  static Any make(const Config& c) {
    const LatteDims dims{.heads = c.heads, .latents = c.latents, .value_dim = c.value_dim};
    if (!c.vapor) {
      if (c.causal) return LatteAttention<Causal>(dims);
      return LatteAttention<Bidirectional>(dims);
    }
    VAPOR::Params params;
    if (!c.angles.empty()) {
      const index_t pairs = c.value_dim / 2;
      params = VAPOR::params_from(TensorView<const double, 2>(
          c.angles.data(), {static_cast<index_t>(c.angles.size()) / pairs, pairs}));
    }
    if (c.causal) return LatteAttention<Causal, RunningMax, VAPOR>(dims, params);
    return LatteAttention<Bidirectional, RunningMax, VAPOR>(dims, params);
  }
  static index_t value_dim(const Config& c) { return c.value_dim; }
  static bool causal(const Config& c) { return c.causal; }

  /// VAPOR's angles [H, Dv/2] when VAPOR rotates; none otherwise.
  template <Real T>
  static std::vector<NumpyArray<T>> parameter_gradients(const Config& c) {
    return vapor_angle_gradients<T>(c);
  }
  template <Real T, class A>
  static LatteGradients<T> gradients(const std::array<TensorView<T, 4>, 3>& d, std::vector<NumpyArray<T>>& p) {
    LatteGradients<T> g{.d_query_logits = d[0], .d_key_logits = d[1], .d_values = d[2]};
    if (!p.empty()) g.d_angles = view_of_new<T, 2>(p[0]);
    return g;
  }
  template <Real T>
  static LatteStateGradients<T> state_gradients(const LatteState<T>* initial) {
    return {.initial = initial};
  }
  template <Real T, class A>
  static LatteState<T> blank_state(const A& attention, index_t batch, std::int64_t position) {
    return attention.template make_state<T>(batch, position);
  }

  static nb::tuple to_tuple(const Config& c) {
    return nb::make_tuple(c.heads, c.latents, c.value_dim, c.causal, c.vapor, c.angles);
  }
  static Config from_tuple(nb::tuple t) {
    return {nb::cast<index_t>(t[0]), nb::cast<index_t>(t[1]), nb::cast<index_t>(t[2]), nb::cast<bool>(t[3]),
            nb::cast<bool>(t[4]), nb::cast<std::vector<double>>(t[5])};
  }
};

using PyLatte = PyMechanism<LatteTraits>;

}  // namespace

void bind_latte_attention(nb::module_& m) {
  bind_state<LatteTraits>(m, "LatteState",
                          "A causal LatteAttention's decode state (make_state / load_state / state_from_fields): "
                          "per (sequence, head) and latent, the running maximum m and the normaliser and "
                          "memory stored scaled by exp(-m), with their compensated low parts; and the "
                          "position of the next token. fields() gives running_max [B, H, L], normaliser "
                          "[B, H, L], memory [B, H, L, Dv], normaliser_low, memory_low. Picklable; save() "
                          "gives latte's checksummed bytes.");
  nb::class_<PyLatte> cls(m, "LatteAttention",
                          "Latte attention (paper 000): every query reads L latent states through "
                          "p(l|t) = softmax(query_logits[t]), each latent a softmax over key_logits[:, l] of "
                          "the (past, if causal) values; VAPOR rotates the values by position. Arrays are "
                          "[B, T, H, L] logits and [B, T, H, Dv] values, float32 or float64, any strides "
                          "with a unit last one; nothing is copied. backward returns (d_query_logits, "
                          "d_key_logits, d_values), and d_angles [H, Dv/2] with VAPOR, then d_initial_state when "
                          "a state is given (training in chunks).");
  cls.def(
         "__init__",
         [](PyLatte* self, index_t heads, index_t latents, index_t value_dim, bool causal, bool vapor,
            std::optional<AnyArray> angles) {
           new (self) PyLatte(LatteTraits::Config{heads, latents, value_dim, causal, vapor,
                                                   vapor_angles(angles, vapor, heads, value_dim)});
         },
         nb::arg("heads"), nb::arg("latents"), nb::arg("value_dim"), nb::kw_only(), nb::arg("causal") = true,
         nb::arg("vapor") = false, nb::arg("angles") = nb::none())
      .def_prop_ro("heads", [](const PyLatte& a) { return a.config().heads; })
      .def_prop_ro("latents", [](const PyLatte& a) { return a.config().latents; })
      .def_prop_ro("value_dim", [](const PyLatte& a) { return a.config().value_dim; })
      .def_prop_ro("causal", [](const PyLatte& a) { return a.config().causal; })
      .def_prop_ro("vapor", [](const PyLatte& a) { return a.config().vapor; })
      .def_prop_ro(
          "angles",
          [](const PyLatte& a) -> nb::object {
            return std::visit(
                [](const auto& attention) -> nb::object {
                  const auto view = attention.angles();
                  if (view.extent(0) == 0) return nb::none();
                  auto array = new_array<double, 2>({view.extent(0), view.extent(1)});
                  std::memcpy(array.data(), view.data(), sizeof(double) * static_cast<std::size_t>(view.size()));
                  return nb::cast(std::move(array));
                },
                a.attention());
          },
          "VAPOR's angles [H, Dv/2] as used (None without VAPOR).")
      .def(
          "make_state",
          [](const PyLatte& a, index_t batch, std::int64_t first_position, const std::string& dtype) {
            return a.new_state("make_state", dtype, [&]<Real T>(const auto& attention) {
              return attention.template make_state<T>(batch, first_position);
            });
          },
          nb::arg("batch"), nb::kw_only(), nb::arg("first_position") = 0, nb::arg("dtype") = "float32",
          "A fresh decode state for `batch` sequences whose first token sits at `first_position` (causal only).");
  bind_calls<LatteTraits>(cls);
}

}  // namespace latte::python
