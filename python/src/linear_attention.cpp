// latte.LinearAttention, latte.CosFormer and latte.LeaPformer from Python (mechanism.hpp does
// the calls): LinearAttention<Causal | Bidirectional, Relu | EluPlusOne |
// Identity> (elu + 1 also with RoPE), CosFormer<Causal | Bidirectional> and
// LeaPformer<Causal | Bidirectional> with LeaP modules or given proportions
// (LinearCalls: those calls, and every class's cross_forward / cross_backward).
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
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "arrays.hpp"
#include "kernel_call.hpp"
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
  template <Real T, class A>
  static LinearState<T> blank_state(const A& attention, index_t batch, std::int64_t position) {
    return attention.template make_state<T>(batch, position);
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
    std::optional<ModuleWeights> query_module, key_module;  // none: proportions given per call
    index_t leap_factor = 4;
    NormaliserArgument normaliser;
  };
  using Any = std::variant<LeaPformer<Causal>, LeaPformer<Bidirectional>>;
  template <class A>
  static A build(const Config& c) {
    typename A::Options options;
    if (c.query_module) options.reweight.query_module = c.query_module->module();
    if (c.key_module) options.reweight.key_module = c.key_module->module();
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

  /// The two modules' weight gradients (accumulated from 0, in float64); none without modules.
  struct ModuleGradients {
    std::optional<LeaPModule> query, key;
  };
  template <Real T>
  static ModuleGradients parameter_gradients(const Config& c) {
    if (!c.query_module || !c.key_module) return {};
    return {c.query_module->module().zeros_like(), c.key_module->module().zeros_like()};
  }
  template <Real T, class A>
  static LinearGradients<T> gradients(const std::array<TensorView<T, 4>, 3>& d, ModuleGradients& p) {
    return {.d_queries = d[0], .d_keys = d[1], .d_values = d[2], .d_query_module = p.query ? &*p.query : nullptr,
            .d_key_module = p.key ? &*p.key : nullptr};
  }
  static void append_parameter_gradients(nb::list& result, const ModuleGradients& p) {
    for (const auto* m : {&p.query, &p.key}) {
      if (!*m) continue;
      const LeaPModule& module = **m;
      auto w1 = new_array<double, 2>({module.w1.extent(0), module.w1.extent(1)});
      auto b1 = new_array<double, 1>({module.b1.extent(0)});
      auto w2 = new_array<double, 1>({module.w2.extent(0)});
      std::copy_n(module.w1.data(), module.w1.size(), w1.data());
      std::copy_n(module.b1.data(), module.b1.size(), b1.data());
      std::copy_n(module.w2.data(), module.w2.size(), w2.data());
      result.append(nb::make_tuple(std::move(w1), std::move(b1), std::move(w2), module.b2));
    }
  }

  static nb::tuple to_tuple(const Config& c) {
    auto module = [](const std::optional<ModuleWeights>& m) { return m ? nb::object(m->to_tuple()) : nb::none(); };
    return nb::make_tuple(c.heads, c.key_dim, c.value_dim, c.causal, module(c.query_module), module(c.key_module),
                          c.leap_factor, c.normaliser);
  }
  static Config from_tuple(nb::tuple t) {
    auto module = [](nb::handle m) {
      return m.is_none() ? std::nullopt : std::optional(ModuleWeights::from_tuple(nb::cast<nb::tuple>(m)));
    };
    return {nb::cast<index_t>(t[0]), nb::cast<index_t>(t[1]), nb::cast<index_t>(t[2]), nb::cast<bool>(t[3]),
            module(t[4]),            module(t[5]),            nb::cast<index_t>(t[6]), nb::cast<NormaliserArgument>(t[7])};
  }
};

/// P_q and P_k as Python gives them: both, or neither (None).
struct GivenProportions {
  std::optional<AnyArray> queries, keys;
  explicit operator bool() const { return queries.has_value(); }
};
GivenProportions given_proportions(std::optional<AnyArray> queries, std::optional<AnyArray> keys) {
  if (queries.has_value() != keys.has_value())
    throw Error(queries ? "key_proportions" : "query_proportions",
                "expected the proportions of the queries and of the keys, or neither; given one");
  return {std::move(queries), std::move(keys)};
}

/// The calls mechanism.hpp's generic binding does not make: cross-attention
/// (bidirectional: queries [B, T, H, Dk] over keys [B, S, H, Dk] and values
/// [B, S, H, Dv]) and LeaPformer's with given proportions [B, T, H] ([B, H] in a step).
template <class Traits>
struct LinearCalls {
  using M = PyMechanism<Traits>;
  using S = PyState<Traits>;

  static void require_bidirectional(const M& m, bool cross) {
    if (cross && Traits::causal(m.config()))
      throw Error("cross_forward", "a causal attention has no cross-attention (causal=False has)");
  }

  /// forward (self, LeaP with proportions, optionally from a state) or cross_forward.
  static nb::object forward(const M& m, bool cross, const AnyArray& q, const AnyArray& k, const AnyArray& v,
                            const GivenProportions& given, std::optional<nb::handle> out, S* state,
                            const std::string& exec) {
    require_bidirectional(m, cross);
    if (state) m.require_causal("state");
    return dtype_of(q, "queries") == Dtype::float32 ? forward_as<float>(m, cross, q, k, v, given, out, state, exec)
                                                     : forward_as<double>(m, cross, q, k, v, given, out, state, exec);
  }

  template <Real T>
  static nb::object forward_as(const M& m, bool cross, const AnyArray& q_array, const AnyArray& k_array,
                               const AnyArray& v_array, const GivenProportions& given,
                               std::optional<nb::handle> out_object, S* state, const std::string& exec) {
    const auto q = view_of<T, 4>(q_array, "queries", "[B, T, H, Dk]", dtype_v<T>);
    const auto k = view_of<T, 4>(k_array, "keys", cross ? "[B, S, H, Dk]" : "[B, T, H, Dk]", dtype_v<T>);
    const auto v = view_of<T, 4>(v_array, "values", cross ? "[B, S, H, Dv]" : "[B, T, H, Dv]", dtype_v<T>);
    const auto proportions = sequence_proportions<T>(given, cross);
    const Backend backend = parse_exec(exec);
    typename Traits::template State<T>* native_state = state ? &state->template as<T>("state", dtype_v<T>) : nullptr;
    auto [result, out] = output_array<T, 4>(out_object, {v.extent(0), q.extent(1), v.extent(2), Traits::value_dim(m.config())},
                                      "[B, T, H, Dv]");
    std::visit(
        [&](const auto& attention) {
          using A = std::decay_t<decltype(attention)>;
          KernelCall kernel_call;
          with_backend(backend, [&](auto e) {
            if constexpr (!A::direction::is_causal) {
              if (cross) {
                if constexpr (A::learned_proportions)
                  if (given) return attention.cross_forward(e, q, k, v, proportions, out);
                return attention.cross_forward(e, q, k, v, out);
              }
            }
            if constexpr (A::learned_proportions) {  // self-attention with given proportions
              if constexpr (A::direction::is_causal)
                if (native_state) return attention.forward(e, q, k, v, proportions, out, *native_state);
              attention.forward(e, q, k, v, proportions, out);
            }
          });
        },
        m.attention());
    return result;
  }

  /// LeaPformer's step with this token's proportions [B, H].
  static nb::object step(const M& m, S& state, const AnyArray& q, const AnyArray& k, const AnyArray& v,
                         const GivenProportions& given, std::optional<nb::handle> out, const std::string& exec) {
    m.require_causal("step");
    return state.dtype() == Dtype::float32 ? step_as<float>(m, state, q, k, v, given, out, exec)
                                           : step_as<double>(m, state, q, k, v, given, out, exec);
  }

  template <Real T>
  static nb::object step_as(const M& m, S& state, const AnyArray& q_array, const AnyArray& k_array,
                            const AnyArray& v_array, const GivenProportions& given,
                            std::optional<nb::handle> out_object, const std::string& exec) {
    const auto q = view_of<T, 3>(q_array, "queries", "[B, H, Dk]", dtype_v<T>);
    const auto k = view_of<T, 3>(k_array, "keys", "[B, H, Dk]", dtype_v<T>);
    const auto v = view_of<T, 3>(v_array, "values", "[B, H, Dv]", dtype_v<T>);
    const StepProportions<T> proportions{view_of<T, 2>(*given.queries, "query_proportions", "[B, H]", dtype_v<T>),
                                         view_of<T, 2>(*given.keys, "key_proportions", "[B, H]", dtype_v<T>)};
    const Backend backend = parse_exec(exec);
    auto& native_state = state.template as<T>("state", dtype_v<T>);
    auto [result, out] = output_array<T, 3>(out_object, {native_state.batch(), v.extent(1), Traits::value_dim(m.config())},
                                      "[B, H, Dv]");
    std::visit(
        [&](const auto& attention) {
          using A = std::decay_t<decltype(attention)>;
          if constexpr (A::direction::is_causal) {
            KernelCall kernel_call;
            with_backend(backend, [&](auto e) { attention.step(e, native_state, q, k, v, proportions, out); });
          }
        },
        m.attention());
    return result;
  }

  /// backward (self, LeaP with proportions, optionally from a state) or cross_backward: the
  /// inputs' gradients, then the proportions' (given) or the modules' (LeaP modules).
  static nb::tuple backward(const M& m, bool cross, const AnyArray& q, const AnyArray& k, const AnyArray& v,
                            const GivenProportions& given, const AnyArray& d_out, const S* initial_state,
                            const std::string& exec) {
    require_bidirectional(m, cross);
    if (initial_state) m.require_causal("initial_state");
    return dtype_of(q, "queries") == Dtype::float32
               ? backward_as<float>(m, cross, q, k, v, given, d_out, initial_state, exec)
               : backward_as<double>(m, cross, q, k, v, given, d_out, initial_state, exec);
  }

  template <Real T>
  static nb::tuple backward_as(const M& m, bool cross, const AnyArray& q_array, const AnyArray& k_array,
                               const AnyArray& v_array, const GivenProportions& given, const AnyArray& d_out_array,
                               const S* initial_state, const std::string& exec) {
    const auto q = view_of<T, 4>(q_array, "queries", "[B, T, H, Dk]", dtype_v<T>);
    const auto k = view_of<T, 4>(k_array, "keys", cross ? "[B, S, H, Dk]" : "[B, T, H, Dk]", dtype_v<T>);
    const auto v = view_of<T, 4>(v_array, "values", cross ? "[B, S, H, Dv]" : "[B, T, H, Dv]", dtype_v<T>);
    const auto d_out = view_of<T, 4>(d_out_array, "d_out", "[B, T, H, Dv]", dtype_v<T>);
    const auto proportions = sequence_proportions<T>(given, cross);
    const Backend backend = parse_exec(exec);
    const typename Traits::template State<T>* initial =
        initial_state ? &initial_state->template as<T>("initial_state", dtype_v<T>) : nullptr;
    std::vector<NumpyArray<T>> d;  // d_queries, d_keys, d_values[, d_query_proportions, d_key_proportions]
    for (const auto* x : {&q, &k, &v}) d.push_back(new_array<T, 4>(x->extents()));
    if (given)
      for (const auto* p : {&proportions.queries, &proportions.keys}) {
        d.push_back(new_array<T, 3>(p->extents()));
        std::fill_n(d.back().data(), d.back().size(), T(0));
      }
    auto parameters = Traits::template parameter_gradients<T>(m.config());
    std::visit(
        [&](const auto& attention) {
          using A = std::decay_t<decltype(attention)>;
          LinearGradients<T> gradients = Traits::template gradients<T, A>(
              {view_of_new<T, 4>(d[0]), view_of_new<T, 4>(d[1]), view_of_new<T, 4>(d[2])}, parameters);
          if (given) {
            gradients.d_query_module = gradients.d_key_module = nullptr;
            gradients.d_query_proportions = view_of_new<T, 3>(d[3]);
            gradients.d_key_proportions = view_of_new<T, 3>(d[4]);
          }
          KernelCall kernel_call;
          with_backend(backend, [&](auto e) {
            if constexpr (!A::direction::is_causal) {
              if (cross) {
                if constexpr (A::learned_proportions)
                  if (given) return attention.cross_backward(e, q, k, v, proportions, d_out, gradients);
                return attention.cross_backward(e, q, k, v, d_out, gradients);
              }
            }
            if constexpr (A::learned_proportions) {  // self-attention with given proportions
              if constexpr (A::direction::is_causal)
                return attention.backward(e, q, k, v, proportions, d_out, gradients,
                                          Traits::template state_gradients<T>(initial));
              else
                attention.backward(e, q, k, v, proportions, d_out, gradients);
            }
          });
        },
        m.attention());
    nb::list result;
    for (auto& array : d) result.append(nb::cast(std::move(array)));
    if (!given) {
      if constexpr (requires { Traits::append_parameter_gradients(result, parameters); })
        Traits::append_parameter_gradients(result, parameters);
    }
    return nb::tuple(result);
  }

  template <Real T>
  static SequenceProportions<T> sequence_proportions(const GivenProportions& given, bool cross) {
    if (!given) return {};
    return {view_of<T, 3>(*given.queries, "query_proportions", "[B, T, H]", dtype_v<T>),
            view_of<T, 3>(*given.keys, "key_proportions", cross ? "[B, S, H]" : "[B, T, H]", dtype_v<T>)};
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

/// cross_forward / cross_backward of a linear-family class (bidirectional only);
/// LeaPformer's also take given proportions P_q [B, T, H], P_k [B, S, H].
template <class Traits, class Class>
void bind_cross(Class& cls) {
  using C = LinearCalls<Traits>;
  using M = PyMechanism<Traits>;
  constexpr const char* forward_doc =
      "Cross-attention (causal=False): queries [B, T, H, Dk] over keys [B, S, H, Dk] and values [B, S, H, Dv] "
      "(S may differ from T), every source token visible. The output [B, T, H, Dv] (written into `out` when "
      "given).";
  constexpr const char* backward_doc =
      "Gradients of cross_forward for a loss whose gradient with respect to its output is d_out: "
      "(d_queries [B, T, H, Dk], d_keys [B, S, H, Dk], d_values [B, S, H, Dv]), then as backward gives the "
      "learned parameters' (or the given proportions').";
  if constexpr (std::is_same_v<Traits, LeaPTraits>) {
    cls.def(
           "cross_forward",
           [](const M& m, const AnyArray& q, const AnyArray& k, const AnyArray& v, std::optional<nb::handle> out,
              std::optional<AnyArray> pq, std::optional<AnyArray> pk, const std::string& exec) {
             return C::forward(m, true, q, k, v, given_proportions(pq, pk), out, nullptr, exec);
           },
           nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("out") = nb::none(), nb::kw_only(),
           nb::arg("query_proportions") = nb::none(), nb::arg("key_proportions") = nb::none(),
           nb::arg("exec") = "cpu", forward_doc)
        .def(
            "cross_backward",
            [](const M& m, const AnyArray& q, const AnyArray& k, const AnyArray& v, const AnyArray& d_out,
               std::optional<AnyArray> pq, std::optional<AnyArray> pk, const std::string& exec) {
              return C::backward(m, true, q, k, v, given_proportions(pq, pk), d_out, nullptr, exec);
            },
            nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("d_out"), nb::kw_only(),
            nb::arg("query_proportions") = nb::none(), nb::arg("key_proportions") = nb::none(),
            nb::arg("exec") = "cpu", backward_doc);
  } else {
    cls.def(
           "cross_forward",
           [](const M& m, const AnyArray& q, const AnyArray& k, const AnyArray& v, std::optional<nb::handle> out,
              const std::string& exec) { return C::forward(m, true, q, k, v, {}, out, nullptr, exec); },
           nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("out") = nb::none(), nb::kw_only(),
           nb::arg("exec") = "cpu", forward_doc)
        .def(
            "cross_backward",
            [](const M& m, const AnyArray& q, const AnyArray& k, const AnyArray& v, const AnyArray& d_out,
               const std::string& exec) { return C::backward(m, true, q, k, v, {}, d_out, nullptr, exec); },
            nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("d_out"), nb::kw_only(),
            nb::arg("exec") = "cpu", backward_doc);
  }
}

/// LeaPformer's forward / step / backward with given proportions: overloads
/// after mechanism.hpp's, chosen when query_proportions / key_proportions are passed.
template <class Class>
void bind_given_proportions(Class& cls) {
  using C = LinearCalls<LeaPTraits>;
  using M = PyMechanism<LeaPTraits>;
  using S = PyState<LeaPTraits>;
  cls.def(
         "forward",
         [](const M& m, const AnyArray& q, const AnyArray& k, const AnyArray& v, std::optional<nb::handle> out,
            std::optional<AnyArray> pq, std::optional<AnyArray> pk, S* state, const std::string& exec) {
           return C::forward(m, false, q, k, v, given_proportions(pq, pk), out, state, exec);
         },
         nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("out") = nb::none(), nb::kw_only(),
         nb::arg("query_proportions") = nb::none(), nb::arg("key_proportions") = nb::none(),
         nb::arg("state") = nb::none(), nb::arg("exec") = "cpu",
         "With query_proportions P_q and key_proportions P_k [B, T, H] in [0, 1]: the proportions given, "
         "not the LeaP modules'.")
      .def(
          "step",
          [](const M& m, S& state, const AnyArray& q, const AnyArray& k, const AnyArray& v,
             std::optional<nb::handle> out, std::optional<AnyArray> pq, std::optional<AnyArray> pk,
             const std::string& exec) { return C::step(m, state, q, k, v, given_proportions(pq, pk), out, exec); },
          nb::arg("state"), nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("out") = nb::none(),
          nb::kw_only(), nb::arg("query_proportions") = nb::none(), nb::arg("key_proportions") = nb::none(),
          nb::arg("exec") = "cpu", "With this token's proportions P_q, P_k [B, H].")
      .def(
          "backward",
          [](const M& m, const AnyArray& q, const AnyArray& k, const AnyArray& v, const AnyArray& d_out,
             std::optional<AnyArray> pq, std::optional<AnyArray> pk, const S* initial_state,
             const std::string& exec) {
            return C::backward(m, false, q, k, v, given_proportions(pq, pk), d_out, initial_state, exec);
          },
          nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("d_out"), nb::kw_only(),
          nb::arg("query_proportions") = nb::none(), nb::arg("key_proportions") = nb::none(),
          nb::arg("initial_state") = nb::none(), nb::arg("exec") = "cpu",
          "With given proportions: (d_queries, d_keys, d_values, d_query_proportions, d_key_proportions).");
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
  bind_cross<LinearTraits>(linear);

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
  bind_cross<CosFormerTraits>(cosformer);

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
                          "d_key_module), each module gradient a (d_w1, d_b1, d_w2, d_b2) tuple. Without "
                          "modules (query_module=key_module=None), every call takes the proportions instead "
                          "(paper 004 eq. 8): query_proportions and key_proportions, [B, T, H] in [0, 1] "
                          "([B, H] in a step); backward then returns (d_queries, d_keys, d_values, "
                          "d_query_proportions, d_key_proportions). Given proportions also override the "
                          "modules when there are modules.");
  leap.def(
          "__init__",
          [](PyLeaP* self, index_t heads, index_t key_dim, index_t value_dim, std::optional<nb::tuple> query_module,
             std::optional<nb::tuple> key_module, bool causal, index_t leap_factor, NormaliserArgument normaliser) {
            auto module = [](const std::optional<nb::tuple>& weights, const char* argument) {
              return weights ? std::optional(module_weights(*weights, argument)) : std::nullopt;
            };
            new (self) PyLeaP(LeaPTraits::Config{heads, key_dim, value_dim, causal,
                                                 module(query_module, "query_module"),
                                                 module(key_module, "key_module"), leap_factor,
                                                 std::move(normaliser)});
          },
          nb::arg("heads"), nb::arg("key_dim"), nb::arg("value_dim"), nb::kw_only(),
          nb::arg("query_module") = nb::none(), nb::arg("key_module") = nb::none(), nb::arg("causal") = true,
          nb::arg("leap_factor") = 4, nb::arg("normaliser") = nb::none())
      .def_prop_ro("causal", [](const PyLeaP& a) { return a.config().causal; });
  bind_make_state<LeaPTraits>(leap);
  bind_calls<LeaPTraits>(leap);
  bind_given_proportions(leap);
  bind_cross<LeaPTraits>(leap);
}

}  // namespace latte::python
