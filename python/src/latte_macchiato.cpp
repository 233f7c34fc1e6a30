// latte.LatteMacchiato from Python (mechanism.hpp does the calls):
// LatteMacchiato<Causal | Bidirectional, RunningMax, NoPositional | VAPOR,
// NoPositional | RoPE>: one softmax over L + 1 states mixing a sliding-window
// softmax with Latte's latent states.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"
#include "latte/mechanisms/latte_macchiato.hpp"
#include "mechanism.hpp"

namespace latte::python {
namespace {

struct MacchiatoTraits {
  struct Config {
    index_t heads = 0, latents = 0, key_dim = 0, value_dim = 0, window = 0;
    bool causal = true;
    bool vapor = false;
    bool rope = false;
    std::string vapor_scope = "latent_states";
    std::optional<double> scale;
    std::vector<double> angles;  // VAPOR's [H * Dv/2] as given; empty: the RoPE schedule
  };
  template <class Dir, class LatentPos, class WindowPos>
  using M = LatteMacchiato<Dir, RunningMax, LatentPos, WindowPos>;
  using Any = std::variant<M<Causal, NoPositional, NoPositional>, M<Causal, NoPositional, RoPE>,
                           M<Causal, VAPOR, NoPositional>, M<Causal, VAPOR, RoPE>,
                           M<Bidirectional, NoPositional, NoPositional>, M<Bidirectional, NoPositional, RoPE>,
                           M<Bidirectional, VAPOR, NoPositional>, M<Bidirectional, VAPOR, RoPE>>;
  template <Real T>
  using State = MacchiatoState<T>;
  static constexpr std::array<InputSpec, 5> inputs{{{"query_logits", "[B, T, H, L + 1]", "[B, H, L + 1]"},
                                                    {"key_logits", "[B, T, H, L]", "[B, H, L]"},
                                                    {"window_queries", "[B, T, H, Dk]", "[B, H, Dk]"},
                                                    {"window_keys", "[B, T, H, Dk]", "[B, H, Dk]"},
                                                    {"values", "[B, T, H, Dv]", "[B, H, Dv]"}}};

  static VaporScope scope(const Config& c) {
    if (c.vapor_scope == "latent_states") return VaporScope::latent_states;
    if (c.vapor_scope == "all_states") return VaporScope::all_states;
    throw Error("vapor_scope", detail::expected_given("scope", "\"latent_states\" or \"all_states\"",
                                                      "\"" + c.vapor_scope + "\""));
  }
  template <class A>
  static A build(const Config& c) {
    typename A::latent_positional::Params latent{};
    if constexpr (std::is_same_v<typename A::latent_positional, VAPOR>) {
      if (!c.angles.empty()) {
        const index_t pairs = c.value_dim / 2;
        latent = VAPOR::params_from(TensorView<const double, 2>(
            c.angles.data(), {static_cast<index_t>(c.angles.size()) / pairs, pairs}));
      }
    }
    return A(MacchiatoDims{.heads = c.heads, .latents = c.latents, .key_dim = c.key_dim, .value_dim = c.value_dim,
                           .window = c.window},
             MacchiatoOptions{.scale = c.scale, .vapor_scope = scope(c)}, latent);
  }
  template <class Dir>
  static Any make_in(const Config& c) {
    if (c.vapor) {
      if (c.rope) return build<M<Dir, VAPOR, RoPE>>(c);
      return build<M<Dir, VAPOR, NoPositional>>(c);
    }
    if (c.rope) return build<M<Dir, NoPositional, RoPE>>(c);
    return build<M<Dir, NoPositional, NoPositional>>(c);
  }
  static Any make(const Config& c) { return c.causal ? make_in<Causal>(c) : make_in<Bidirectional>(c); }
  static index_t value_dim(const Config& c) { return c.value_dim; }
  static bool causal(const Config& c) { return c.causal; }

  /// VAPOR's angles [H, Dv/2] when VAPOR rotates (the window's RoPE angles are fixed).
  template <Real T>
  static std::vector<NumpyArray<T>> parameter_gradients(const Config& c) {
    return vapor_angle_gradients<T>(c);
  }
  template <Real T, class A>
  static MacchiatoGradients<T> gradients(const std::array<TensorView<T, 4>, 5>& d, std::vector<NumpyArray<T>>& p) {
    MacchiatoGradients<T> g{.d_query_logits = d[0], .d_key_logits = d[1], .d_window_queries = d[2],
                            .d_window_keys = d[3], .d_values = d[4]};
    if (!p.empty()) g.d_angles = view_of_new<T, 2>(p[0]);
    return g;
  }
  template <Real T>
  static MacchiatoStateGradients<T> state_gradients(const MacchiatoState<T>* initial) {
    return {.initial = initial};
  }
  template <Real T, class A>
  static MacchiatoState<T> blank_state(const A& attention, index_t batch, std::int64_t position) {
    return attention.template make_state<T>(batch, position);
  }

  static nb::tuple to_tuple(const Config& c) {
    return nb::make_tuple(c.heads, c.latents, c.key_dim, c.value_dim, c.window, c.causal, c.vapor, c.rope,
                          c.vapor_scope, c.scale, c.angles);
  }
  static Config from_tuple(nb::tuple t) {
    return {nb::cast<index_t>(t[0]), nb::cast<index_t>(t[1]),     nb::cast<index_t>(t[2]),
            nb::cast<index_t>(t[3]), nb::cast<index_t>(t[4]),     nb::cast<bool>(t[5]),
            nb::cast<bool>(t[6]),    nb::cast<bool>(t[7]),        nb::cast<std::string>(t[8]),
            nb::cast<std::optional<double>>(t[9]), nb::cast<std::vector<double>>(t[10])};
  }
};

using PyMacchiato = PyMechanism<MacchiatoTraits>;

}  // namespace

void bind_latte_macchiato(nb::module_& m) {
  bind_state<MacchiatoTraits>(m, "MacchiatoState",
                              "A causal LatteMacchiato's decode state (make_state / load_state / "
                              "state_from_fields): Latte's carry and a ring of the last w + 1 window keys / "
                              "values per (sequence, head), and the next position. fields() gives running_max "
                              "[B, H, L], normaliser [B, H, L], memory [B, H, L, Dv] (the sums stored scaled by "
                              "exp(-running_max)), normaliser_low, memory_low (their compensated low parts), "
                              "window_keys [B, H, w + 1, Dk], window_values [B, H, w + 1, Dv] (token s in slot "
                              "s % (w + 1), stored as the window reads them: R^s k_s under RoPE, R^-s v_s when "
                              "VAPOR acts on the window) and window_fill [1] (ring slots holding tokens, at "
                              "most min(w + 1, position)). Picklable; save() gives latte's checksummed bytes.");
  nb::class_<PyMacchiato> cls(m, "LatteMacchiato",
                              "Latte Macchiato (paper 000 §2.3, paper 001 §4.1): one softmax over L + 1 "
                              "states per query, state 0 a sliding-window softmax over its own window "
                              "queries / keys (w tokens each side allowed; rope=True rotates them), states "
                              "1..L Latte's latent states (vapor=True rotates their values; vapor_scope "
                              "\"all_states\" the window's too). Inputs: query_logits [B, T, H, L + 1], "
                              "key_logits [B, T, H, L], window_queries / window_keys [B, T, H, Dk], values "
                              "[B, T, H, Dv]. `angles` [H, Dv/2] (float64, with vapor=True) replace VAPOR's "
                              "RoPE schedule. backward returns the five inputs' gradients, and d_angles "
                              "[H, Dv/2] with VAPOR.");
  cls.def(
         "__init__",
         [](PyMacchiato* self, index_t heads, index_t latents, index_t key_dim, index_t value_dim, index_t window,
            bool causal, bool vapor, bool rope, std::string vapor_scope, std::optional<double> scale,
            std::optional<AnyArray> angles) {
           new (self) PyMacchiato(MacchiatoTraits::Config{heads, latents, key_dim, value_dim, window, causal,
                                                          vapor, rope, std::move(vapor_scope), scale,
                                                          vapor_angles(angles, vapor, heads, value_dim)});
         },
         nb::arg("heads"), nb::arg("latents"), nb::arg("key_dim"), nb::arg("value_dim"), nb::arg("window"),
         nb::kw_only(), nb::arg("causal") = true, nb::arg("vapor") = false, nb::arg("rope") = false,
         nb::arg("vapor_scope") = "latent_states", nb::arg("scale") = nb::none(), nb::arg("angles") = nb::none())
      .def_prop_ro("causal", [](const PyMacchiato& a) { return a.config().causal; })
      .def_prop_ro("vapor", [](const PyMacchiato& a) { return a.config().vapor; })
      .def_prop_ro("rope", [](const PyMacchiato& a) { return a.config().rope; })
      .def_prop_ro("window", [](const PyMacchiato& a) { return a.config().window; })
      .def(
          "make_state",
          [](const PyMacchiato& a, index_t batch, std::int64_t first_position, const std::string& dtype) {
            return a.new_state("make_state", dtype, [&]<Real T>(const auto& attention) {
              return attention.template make_state<T>(batch, first_position);
            });
          },
          nb::arg("batch"), nb::kw_only(), nb::arg("first_position") = 0, nb::arg("dtype") = "float32",
          "A fresh decode state for `batch` sequences whose first token sits at `first_position` (causal only).");
  bind_calls<MacchiatoTraits>(cls);
}

}  // namespace latte::python
