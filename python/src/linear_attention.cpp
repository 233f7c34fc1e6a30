// latte.LinearAttention and latte.CosFormer from Python (mechanism.hpp does
// the calls): LinearAttention<Causal | Bidirectional, Relu | EluPlusOne |
// Identity> (elu + 1 also with RoPE) and CosFormer<Causal | Bidirectional>.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"
#include "latte/mechanisms/cosformer.hpp"
#include "latte/mechanisms/linear_attention.hpp"
#include "mechanism.hpp"

namespace latte::python {
namespace {

/// ("additive", epsilon) or ("clamp_min", minimum); None: the mechanism's default.
using NormaliserArgument = std::optional<std::tuple<std::string, double>>;

std::optional<Normaliser> parse_normaliser(const NormaliserArgument& argument) {
  if (!argument) return std::nullopt;
  const auto& [kind, value] = *argument;
  if (kind == "additive") return Normaliser::additive(value);
  if (kind == "clamp_min") return Normaliser::clamp_min(value);
  throw Error("normaliser", detail::expected_given("kind", "\"additive\" or \"clamp_min\"", "\"" + kind + "\""));
}

template <class Options>
Options with_normaliser(Options options, const NormaliserArgument& argument) {
  if (const auto normaliser = parse_normaliser(argument)) options.normaliser = *normaliser;
  return options;
}

constexpr std::array<InputSpec, 3> kLinearInputs{{{"queries", "[B, T, H, Dk]", "[B, H, Dk]"},
                                                  {"keys", "[B, T, H, Dk]", "[B, H, Dk]"},
                                                  {"values", "[B, T, H, Dv]", "[B, H, Dv]"}}};

/// What the linear family's traits share: states, gradients, no parameters.
struct LinearFamilyTraits {
  template <Real T>
  using State = LinearState<T>;
  static constexpr std::array<InputSpec, 3> inputs = kLinearInputs;
  template <Real T>
  static std::vector<NumpyArray<T>> parameter_gradients(const auto&) {
    return {};
  }
  template <Real T, class A>
  static LinearGradients<T> gradients(const std::array<TensorView<T, 4>, 3>& d, std::vector<NumpyArray<T>>&) {
    return {.d_queries = d[0], .d_keys = d[1], .d_values = d[2]};
  }
  template <Real T>
  static LinearStateGradients<T> state_gradients(const LinearState<T>* initial) {
    return {.initial = initial};
  }
};

struct LinearTraits : LinearFamilyTraits {
  struct Config {
    index_t heads = 0, key_dim = 0, value_dim = 0;
    bool causal = true;
    std::string feature_map = "elu_plus_one";
    NormaliserArgument normaliser;
    bool rope = false;
    double rope_base = 10000.0;
  };
  template <class Dir, class Map>
  using Plain = LinearAttention<Dir, Map>;
  template <class Dir>
  using Rope = LinearAttention<Dir, EluPlusOne, NoReweight, RoPE>;
  using Any = std::variant<Plain<Causal, EluPlusOne>, Plain<Causal, Relu>, Plain<Causal, Identity>,
                           Plain<Bidirectional, EluPlusOne>, Plain<Bidirectional, Relu>, Plain<Bidirectional, Identity>,
                           Rope<Causal>, Rope<Bidirectional>>;

  template <class A>
  static A build(const Config& c) {
    typename A::Options options;
    if constexpr (std::is_same_v<typename A::positional, RoPE>) options.positional.base = c.rope_base;
    return A(LinearDims{.heads = c.heads, .key_dim = c.key_dim, .value_dim = c.value_dim},
             with_normaliser(std::move(options), c.normaliser));
  }
  template <class Dir>
  static Any make_in(const Config& c) {
    if (c.rope) {
      if (c.feature_map != "elu_plus_one")
        throw Error("feature_map", detail::expected_given("feature map with rope=True", "\"elu_plus_one\"",
                                                          "\"" + c.feature_map + "\""));
      return build<Rope<Dir>>(c);
    }
    if (c.feature_map == "elu_plus_one") return build<Plain<Dir, EluPlusOne>>(c);
    if (c.feature_map == "relu") return build<Plain<Dir, Relu>>(c);
    if (c.feature_map == "identity") return build<Plain<Dir, Identity>>(c);
    throw Error("feature_map", detail::expected_given("feature map", "\"elu_plus_one\", \"relu\" or \"identity\"",
                                                      "\"" + c.feature_map + "\""));
  }
  static Any make(const Config& c) { return c.causal ? make_in<Causal>(c) : make_in<Bidirectional>(c); }
  static index_t value_dim(const Config& c) { return c.value_dim; }
  static bool causal(const Config& c) { return c.causal; }
  static nb::tuple to_tuple(const Config& c) {
    return nb::make_tuple(c.heads, c.key_dim, c.value_dim, c.causal, c.feature_map, c.normaliser, c.rope, c.rope_base);
  }
  static Config from_tuple(nb::tuple t) {
    return {nb::cast<index_t>(t[0]),      nb::cast<index_t>(t[1]),           nb::cast<index_t>(t[2]),
            nb::cast<bool>(t[3]),         nb::cast<std::string>(t[4]),       nb::cast<NormaliserArgument>(t[5]),
            nb::cast<bool>(t[6]),         nb::cast<double>(t[7])};
  }
};

struct CosFormerTraits : LinearFamilyTraits {
  struct Config {
    index_t heads = 0, key_dim = 0, value_dim = 0;
    bool causal = true;
    std::optional<index_t> length;  // M; None: T in a forward (decode needs it)
    NormaliserArgument normaliser;
  };
  using Any = std::variant<CosFormer<Causal>, CosFormer<Bidirectional>>;
  template <class A>
  static A build(const Config& c) {
    typename A::Options options;
    options.reweight.length = c.length;
    return A(LinearDims{.heads = c.heads, .key_dim = c.key_dim, .value_dim = c.value_dim},
             with_normaliser(std::move(options), c.normaliser));
  }
  static Any make(const Config& c) {
    if (c.causal) return build<CosFormer<Causal>>(c);
    return build<CosFormer<Bidirectional>>(c);
  }
  static index_t value_dim(const Config& c) { return c.value_dim; }
  static bool causal(const Config& c) { return c.causal; }
  static nb::tuple to_tuple(const Config& c) {
    return nb::make_tuple(c.heads, c.key_dim, c.value_dim, c.causal, c.length, c.normaliser);
  }
  static Config from_tuple(nb::tuple t) {
    return {nb::cast<index_t>(t[0]), nb::cast<index_t>(t[1]), nb::cast<index_t>(t[2]), nb::cast<bool>(t[3]),
            nb::cast<std::optional<index_t>>(t[4]), nb::cast<NormaliserArgument>(t[5])};
  }
};

/// make_state(batch, *, first_position=0, dtype="float32") of a linear-family class.
template <class Traits, class Class>
void bind_make_state(Class& cls) {
  cls.def(
      "make_state",
      [](const PyMechanism<Traits>& a, index_t batch, std::int64_t first_position, const std::string& dtype) {
        return a.new_state("make_state", dtype, [&]<Real T>(const auto& attention) {
          return attention.template make_state<T>(batch, first_position);
        });
      },
      nb::arg("batch"), nb::kw_only(), nb::arg("first_position") = 0, nb::arg("dtype") = "float32",
      "A fresh decode state (S [F, Dv] and z [F] per head and stream) for `batch` sequences whose first "
      "token sits at `first_position` (causal only).");
}

}  // namespace

void bind_linear_attention(nb::module_& m) {
  using PyLinear = PyMechanism<LinearTraits>;
  bind_state<LinearTraits>(m, "LinearState",
                           "A causal LinearAttention's decode state: S = sum phi(k) v^T and z = sum phi(k) "
                           "per (sequence, head), and the next position. Picklable.");
  nb::class_<PyLinear> linear(m, "LinearAttention",
                              "Linear attention (paper 001 eq. 4): o_t = phi(q_t)^T S_t / N(phi(q_t)^T z_t) with "
                              "S, z summed over the (past, if causal) keys; feature_map phi in "
                              "\"elu_plus_one\", \"relu\", \"identity\"; rope=True rotates phi(q), phi(k) "
                              "(RoPE, elu + 1). normaliser: (\"additive\", eps) or (\"clamp_min\", minimum). "
                              "backward returns (d_queries, d_keys, d_values).");
  linear
      .def(
          "__init__",
          [](PyLinear* self, index_t heads, index_t key_dim, index_t value_dim, bool causal, std::string feature_map,
             NormaliserArgument normaliser, bool rope, double rope_base) {
            new (self) PyLinear(LinearTraits::Config{heads, key_dim, value_dim, causal, std::move(feature_map),
                                                     std::move(normaliser), rope, rope_base});
          },
          nb::arg("heads"), nb::arg("key_dim"), nb::arg("value_dim"), nb::kw_only(), nb::arg("causal") = true,
          nb::arg("feature_map") = "elu_plus_one", nb::arg("normaliser") = nb::none(), nb::arg("rope") = false,
          nb::arg("rope_base") = 10000.0)
      .def_prop_ro("feature_map", [](const PyLinear& a) { return a.config().feature_map; })
      .def_prop_ro("causal", [](const PyLinear& a) { return a.config().causal; });
  bind_make_state<LinearTraits>(linear);
  bind_calls<LinearTraits>(linear);

  using PyCosFormer = PyMechanism<CosFormerTraits>;
  bind_state<CosFormerTraits>(m, "CosFormerState",
                              "A causal CosFormer's decode state: the two sin / cos streams' S and z per "
                              "(sequence, head), and the next position. Picklable.");
  nb::class_<PyCosFormer> cosformer(m, "CosFormer",
                                    "cosFormer: linear attention with ReLU features re-weighted by "
                                    "cos(pi/2 (P_q - P_k)), P = (i + 1) / M, as two sin / cos streams. `length` M "
                                    "defaults to T in a forward; decode needs it (M >= every position + 1).");
  cosformer
      .def(
          "__init__",
          [](PyCosFormer* self, index_t heads, index_t key_dim, index_t value_dim, bool causal,
             std::optional<index_t> length, NormaliserArgument normaliser) {
            new (self) PyCosFormer(
                CosFormerTraits::Config{heads, key_dim, value_dim, causal, length, std::move(normaliser)});
          },
          nb::arg("heads"), nb::arg("key_dim"), nb::arg("value_dim"), nb::kw_only(), nb::arg("causal") = true,
          nb::arg("length") = nb::none(), nb::arg("normaliser") = nb::none())
      .def_prop_ro("length", [](const PyCosFormer& a) { return a.config().length; })
      .def_prop_ro("causal", [](const PyCosFormer& a) { return a.config().causal; });
  bind_make_state<CosFormerTraits>(cosformer);
  bind_calls<CosFormerTraits>(cosformer);
}

}  // namespace latte::python
