// latte.LinearAttention, latte.CosFormer and latte.LeaPformer from Python (mechanism.hpp does
// the calls): LinearAttention<Causal | Bidirectional, Relu | EluPlusOne |
// Identity> (elu + 1 also with RoPE), CosFormer<Causal | Bidirectional> and
// LeaPformer<Causal | Bidirectional> with LeaP modules.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"
#include "latte/mechanisms/cosformer.hpp"
#include "latte/mechanisms/leapformer.hpp"
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

/// A LeaP module's weights as Python gives them: (w1 [hidden, Dk], b1 [hidden],
/// w2 [hidden], b2), float64; kept flat for pickling.
struct ModuleWeights {
  index_t hidden = 0, input_dim = 0;
  std::vector<double> w1, b1, w2;
  double b2 = 0;

  [[nodiscard]] LeaPModule module() const {
    LeaPModule m;
    m.w1 = Tensor<double, 2>({hidden, input_dim});
    std::copy(w1.begin(), w1.end(), m.w1.data());
    m.b1 = Tensor<double, 1>({hidden});
    std::copy(b1.begin(), b1.end(), m.b1.data());
    m.w2 = Tensor<double, 1>({hidden});
    std::copy(w2.begin(), w2.end(), m.w2.data());
    m.b2 = b2;
    return m;
  }
  [[nodiscard]] nb::tuple to_tuple() const { return nb::make_tuple(hidden, input_dim, w1, b1, w2, b2); }
  static ModuleWeights from_tuple(nb::tuple t) {
    return {nb::cast<index_t>(t[0]), nb::cast<index_t>(t[1]), nb::cast<std::vector<double>>(t[2]),
            nb::cast<std::vector<double>>(t[3]), nb::cast<std::vector<double>>(t[4]), nb::cast<double>(t[5])};
  }
};

/// (w1, b1, w2, b2) from Python; the shapes are LeaPModule::validate's to check
/// (through the attention's constructor), against D / leap_factor hidden units.
ModuleWeights module_weights(nb::tuple weights, const char* argument) {
  if (weights.size() != 4)
    throw Error(argument, detail::expected_given("weights", "(w1, b1, w2, b2)", std::to_string(weights.size()) + " items"));
  auto flat = [&](nb::handle item, const char* part, std::size_t rank, index_t& rows, index_t& columns) {
    const std::string name = std::string(argument) + "." + part;
    const AnyArray array = nb::cast<AnyArray>(item);
    if (dtype_of(array, name.c_str()) != Dtype::float64 || array.ndim() != rank)
      throw Error(name, detail::expected_given("array", rank == 2 ? "float64 [hidden, D]" : "float64 [hidden]",
                                               dtype_name(array.dtype()) + " of rank " + std::to_string(array.ndim())));
    std::vector<double> values;
    rows = static_cast<index_t>(array.shape(0));
    columns = rank == 2 ? static_cast<index_t>(array.shape(1)) : 1;
    const auto* data = static_cast<const double*>(array.data());
    for (index_t i = 0; i < rows; ++i)
      for (index_t j = 0; j < columns; ++j)
        values.push_back(data[i * array.stride(0) + (rank == 2 ? j * array.stride(1) : 0)]);
    return values;
  };
  ModuleWeights m;
  index_t rows = 0, columns = 0, unused = 0;
  m.w1 = flat(weights[0], "w1", 2, m.hidden, m.input_dim);
  m.b1 = flat(weights[1], "b1", 1, rows, unused);
  m.w2 = flat(weights[2], "w2", 1, columns, unused);
  // Other lengths of b1 / w2 than w1's rows: built at w1's size, which
  // LeaPModule::validate then refuses, naming the part.
  m.b1.resize(static_cast<std::size_t>(rows));
  m.w2.resize(static_cast<std::size_t>(columns));
  m.b2 = nb::cast<double>(weights[3]);
  return m;
}

struct LeaPTraits : LinearFamilyTraits {
  struct Config {
    index_t heads = 0, key_dim = 0, value_dim = 0;
    bool causal = true;
    ModuleWeights query_module, key_module;
    index_t leap_factor = 4;
    NormaliserArgument normaliser;
  };
  using Any = std::variant<LeaPformer<Causal>, LeaPformer<Bidirectional>>;
  template <class A>
  static A build(const Config& c) {
    typename A::Options options;
    options.reweight.query_module = c.query_module.module();
    options.reweight.key_module = c.key_module.module();
    options.reweight.leap_factor = c.leap_factor;
    return A(LinearDims{.heads = c.heads, .key_dim = c.key_dim, .value_dim = c.value_dim},
             with_normaliser(std::move(options), c.normaliser));
  }
  static Any make(const Config& c) {
    if (c.causal) return build<LeaPformer<Causal>>(c);
    return build<LeaPformer<Bidirectional>>(c);
  }
  static index_t value_dim(const Config& c) { return c.value_dim; }
  static bool causal(const Config& c) { return c.causal; }

  /// The two modules' weight gradients (accumulated from 0, in float64).
  struct ModuleGradients {
    LeaPModule query, key;
  };
  template <Real T>
  static ModuleGradients parameter_gradients(const Config& c) {
    return {c.query_module.module().zeros_like(), c.key_module.module().zeros_like()};
  }
  template <Real T, class A>
  static LinearGradients<T> gradients(const std::array<TensorView<T, 4>, 3>& d, ModuleGradients& p) {
    return {.d_queries = d[0], .d_keys = d[1], .d_values = d[2], .d_query_module = &p.query,
            .d_key_module = &p.key};
  }
  static void append_parameter_gradients(nb::list& result, const ModuleGradients& p) {
    for (const LeaPModule* m : {&p.query, &p.key}) {
      auto w1 = new_array<double, 2>({m->w1.extent(0), m->w1.extent(1)});
      auto b1 = new_array<double, 1>({m->b1.extent(0)});
      auto w2 = new_array<double, 1>({m->w2.extent(0)});
      std::copy_n(m->w1.data(), m->w1.size(), w1.data());
      std::copy_n(m->b1.data(), m->b1.size(), b1.data());
      std::copy_n(m->w2.data(), m->w2.size(), w2.data());
      result.append(nb::make_tuple(std::move(w1), std::move(b1), std::move(w2), m->b2));
    }
  }

  static nb::tuple to_tuple(const Config& c) {
    return nb::make_tuple(c.heads, c.key_dim, c.value_dim, c.causal, c.query_module.to_tuple(),
                          c.key_module.to_tuple(), c.leap_factor, c.normaliser);
  }
  static Config from_tuple(nb::tuple t) {
    return {nb::cast<index_t>(t[0]),
            nb::cast<index_t>(t[1]),
            nb::cast<index_t>(t[2]),
            nb::cast<bool>(t[3]),
            ModuleWeights::from_tuple(nb::cast<nb::tuple>(t[4])),
            ModuleWeights::from_tuple(nb::cast<nb::tuple>(t[5])),
            nb::cast<index_t>(t[6]),
            nb::cast<NormaliserArgument>(t[7])};
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

  using PyLeaP = PyMechanism<LeaPTraits>;
  bind_state<LeaPTraits>(m, "LeaPformerState",
                         "A causal LeaPformer's decode state: the two sin / cos streams' S and z per "
                         "(sequence, head), and the next position. Picklable.");
  nb::class_<PyLeaP> leap(m, "LeaPformer",
                          "LeaPformer (paper 004): cosFormer's re-weighting cos(pi/2 (P_q - P_k)) with "
                          "proportions P = sigmoid(w2 . relu(w1 relu(x) + b1) + b2) from two LeaP modules on "
                          "the ReLU features of the queries and of the keys (shared across heads; hidden = "
                          "Dk / leap_factor). Modules are (w1 [hidden, Dk], b1 [hidden], w2 [hidden], b2) in "
                          "float64. backward returns (d_queries, d_keys, d_values, d_query_module, "
                          "d_key_module), each module gradient a (d_w1, d_b1, d_w2, d_b2) tuple.");
  leap.def(
          "__init__",
          [](PyLeaP* self, index_t heads, index_t key_dim, index_t value_dim, nb::tuple query_module,
             nb::tuple key_module, bool causal, index_t leap_factor, NormaliserArgument normaliser) {
            new (self) PyLeaP(LeaPTraits::Config{heads, key_dim, value_dim, causal,
                                                 module_weights(query_module, "query_module"),
                                                 module_weights(key_module, "key_module"), leap_factor,
                                                 std::move(normaliser)});
          },
          nb::arg("heads"), nb::arg("key_dim"), nb::arg("value_dim"), nb::kw_only(), nb::arg("query_module"),
          nb::arg("key_module"), nb::arg("causal") = true, nb::arg("leap_factor") = 4,
          nb::arg("normaliser") = nb::none())
      .def_prop_ro("causal", [](const PyLeaP& a) { return a.config().causal; });
  bind_make_state<LeaPTraits>(leap);
  bind_calls<LeaPTraits>(leap);
}

}  // namespace latte::python
