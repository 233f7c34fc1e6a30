// latte.ConvCompressedAttention from Python (mechanism.hpp does the calls):
// convolutional-compression attention (paper 003 §4),
// ConvCompressedAttention<Causal | Bidirectional>, with its learned
// convolutions and projections (ConvCompressedParams) and their gradients.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"
#include "latte/mechanisms/conv_compressed_attention.hpp"
#include "mechanism.hpp"

namespace latte::python {
namespace {

/// ConvCompressedParams' fields as Python names them (keyword arguments,
/// the `params` dict, backward's gradient dict): per-level lists, then arrays.
constexpr std::array<const char*, 5> kLevelFields{"conv_weight", "conv_bias", "level_query", "level_key",
                                                  "level_value"};
constexpr std::array<const char*, 3> kCrossFields{"cross_query", "cross_key", "cross_value"};

/// Calls visit(name, tensor, layout) for every weight tensor of `p`; the per-level
/// lists' entries are named "conv_weight[0]", ...
template <class Params, class Visit>
void for_each_weight(Params& p, Visit&& visit) {
  auto list = [&](const char* field, auto& tensors, const char* layout) {
    for (std::size_t l = 0; l < tensors.size(); ++l)
      visit(std::string(field) + "[" + std::to_string(l) + "]", tensors[l], layout);
  };
  list("conv_weight", p.conv_weight, "[H, M, Dv, Dv]");
  list("conv_bias", p.conv_bias, "[H, Dv]");
  list("level_query", p.level_query, "[H, Dk, Dv]");
  list("level_key", p.level_key, "[H, Dk, Dv]");
  list("level_value", p.level_value, "[H, Dv, Dv]");
  visit(std::string("cross_query"), p.cross_query, "[H, Dk, Dv]");
  visit(std::string("cross_key"), p.cross_key, "[H, Dk, Dv]");
  visit(std::string("cross_value"), p.cross_value, "[H, Dv, Dv]");
}

/// `object`, a float64 array of exactly `into`'s shape, copied into it (any strides).
template <std::size_t N>
void copy_weight(nb::handle object, Tensor<double, N>& into, const std::string& name, const char* layout) {
  AnyArray array;
  if (!nb::try_cast(object, array))
    throw Error(name, "expected a float64 array " + std::string(layout) + ", given " +
                          nb::cast<std::string>(nb::str(object.type())));
  const auto view = view_of<double, N>(array, name.c_str(), layout, Dtype::float64);
  if (view.extents() != into.extents())
    throw Error(name, detail::expected_given(std::string("shape ") + layout, format_extents(into.extents()),
                                             format_extents(view.extents())));
  copy_elements<double>(array, into.data());
}

/// Weights as Python gives them: a dict {field: array, or list of arrays (one per
/// level)}; a field left out (or None) stays zero, as ConvCompressedParams::zeros has it.
ConvCompressedParams params_from(const ConvCompressedDims& dims, nb::dict given) {
  ConvCompressedParams params = ConvCompressedParams::zeros(dims);
  for (auto [key, value] : given) {
    const std::string field = nb::cast<std::string>(key);
    const bool is_list = std::ranges::find(kLevelFields, field) != kLevelFields.end();
    if (!is_list && std::ranges::find(kCrossFields, field) == kCrossFields.end())
      throw Error(field, "not a weight of ConvCompressedAttention");
    if (value.is_none()) continue;
    if (is_list) {
      // One entry per level (levels - 1 for the level projections).
      const std::size_t expected = field.starts_with("conv") ? dims.levels : dims.levels - 1;
      if (!nb::isinstance<nb::list>(value) && !nb::isinstance<nb::tuple>(value))
        throw Error(field, "expected a list of float64 arrays (one per level), given " +
                               nb::cast<std::string>(nb::str(value.type())));
      if (nb::len(value) != expected)
        throw Error(field, detail::expected_given("number of arrays", expected, nb::len(value)));
    }
    for_each_weight(params, [&](const std::string& name, auto& tensor, const char* layout) {
      if (name == field) copy_weight(value, tensor, name, layout);
      else if (is_list && name.starts_with(field + "["))
        copy_weight(value[std::stoul(name.substr(field.size() + 1))], tensor, name, layout);
    });
  }
  return params;
}

/// The weights as a dict of float64 NumPy arrays (per-level fields: lists).
nb::dict params_dict(const ConvCompressedParams& params) {
  nb::dict out;
  for (const char* field : kLevelFields) out[field] = nb::list();
  for_each_weight(params, [&](const std::string& name, const auto& tensor, const char*) {
    auto array = new_array<double, std::tuple_size_v<std::decay_t<decltype(tensor.extents())>>>(tensor.extents());
    std::memcpy(array.data(), tensor.data(), sizeof(double) * static_cast<std::size_t>(tensor.size()));
    const std::string field = name.substr(0, name.find('['));
    if (field == name) out[field.c_str()] = std::move(array);
    else nb::cast<nb::list>(out[field.c_str()]).append(std::move(array));
  });
  return out;
}

struct ConvCompressedTraits {
  struct Config {
    ConvCompressedDims dims;
    bool causal = true;
    std::optional<double> scale;  // None: 1 / sqrt(Dk)
    ConvCompressedParams params;
  };
  using Any = std::variant<ConvCompressedAttention<Causal>, ConvCompressedAttention<Bidirectional>>;
  template <Real T>
  using State = ConvCompressedState<T>;
  static constexpr std::array<InputSpec, 3> inputs{{{"queries", "[B, T, H, Dk]", "[B, H, Dk]"},
                                                    {"keys", "[B, T, H, Dk]", "[B, H, Dk]"},
                                                    {"values", "[B, T, H, Dv]", "[B, H, Dv]"}}};

  static Any make(const Config& c) {
    if (c.causal) return ConvCompressedAttention<Causal>(c.dims, c.params, c.scale);
    return ConvCompressedAttention<Bidirectional>(c.dims, c.params, c.scale);
  }
  static index_t value_dim(const Config& c) { return c.dims.value_dim; }
  static bool causal(const Config& c) { return c.causal; }

  /// Every weight's gradient, float64, accumulated from 0.
  template <Real T>
  static ConvCompressedParams parameter_gradients(const Config& c) {
    return ConvCompressedParams::zeros(c.dims);
  }
  template <Real T, class A>
  static ConvCompressedGradients<T> gradients(const std::array<TensorView<T, 4>, 3>& d, ConvCompressedParams& p) {
    return {.d_queries = d[0], .d_keys = d[1], .d_values = d[2], .d_params = &p};
  }
  template <Real T>
  static ConvCompressedStateGradients<T> state_gradients(const ConvCompressedState<T>* initial) {
    return {.initial = initial};
  }
  /// A fresh state at `position` holding up to `context_capacity` tokens (state_from_fields fills it).
  template <Real T, class A>
  static ConvCompressedState<T> blank_state(const A& attention, index_t batch, std::int64_t position,
                                            std::optional<index_t> context_capacity) {
    if (!context_capacity)
      throw Error("context_capacity",
                  "expected the tokens the state can hold (they size its compressed store), given None");
    if (position < 0 || position > *context_capacity)
      throw Error("position", detail::expected_given("position", "0 .. context_capacity " +
                                                                     std::to_string(*context_capacity),
                                                     position));
    ConvCompressedState<T> state = attention.template make_state<T>(batch, *context_capacity);
    state.advance(position);
    return state;
  }
  static void append_parameter_gradients(nb::list& result, const ConvCompressedParams& p) {
    result.append(params_dict(p));
  }

  static nb::tuple to_tuple(const Config& c) {
    const ConvCompressedDims& d = c.dims;
    return nb::make_tuple(d.heads, d.key_dim, d.value_dim, d.group_size, d.levels, d.window_left, d.window_right,
                          c.causal, c.scale, params_dict(c.params));
  }
  static Config from_tuple(nb::tuple t) {
    Config c{.dims = {.heads = nb::cast<index_t>(t[0]),
                      .key_dim = nb::cast<index_t>(t[1]),
                      .value_dim = nb::cast<index_t>(t[2]),
                      .group_size = nb::cast<index_t>(t[3]),
                      .levels = nb::cast<index_t>(t[4]),
                      .window_left = nb::cast<std::optional<index_t>>(t[5]),
                      .window_right = nb::cast<std::optional<index_t>>(t[6])},
             .causal = nb::cast<bool>(t[7]),
             .scale = nb::cast<std::optional<double>>(t[8]),
             .params = {}};
    c.params = params_from(c.dims, nb::cast<nb::dict>(t[9]));
    return c;
  }
};

using PyConvCompressed = PyMechanism<ConvCompressedTraits>;

}  // namespace

void bind_conv_compressed(nb::module_& m) {
  bind_state<ConvCompressedTraits>(m, "ConvCompressedState",
                                   "A causal ConvCompressedAttention's decode state: per (sequence, head) the "
                                   "window rings of every level, the open groups' partial convolution sums and "
                                   "the compressed tokens' keys / values (room for context_capacity tokens), and "
                                   "the next position. Picklable.");
  nb::class_<PyConvCompressed> cls(
      m, "ConvCompressedAttention",
      "Convolutional-compression attention (paper 003 §4): y0 = sliding-window softmax attention over "
      "queries, keys [B, T, H, Dk] and values [B, T, H, Dv]; every complete group of M (group_size) tokens "
      "of y0 is compressed by a learned convolution, c1_j = conv_bias[0] + sum_i conv_weight[0][:, i] "
      "y0_{jM+i}; with levels L > 1 each level l < L runs window attention over (level_query[l-1] c_l, "
      "level_key[l-1] c_l, level_value[l-1] c_l) and compresses that again; query t then attends to the "
      "top-level tokens (keys cross_key c_L, values cross_value c_L, query cross_query y0_t) with "
      "j < floor(t / M^L) under causal; o_t = y0_t + that. Weights, one set per head, are float64 arrays "
      "(matrices [out, in]): conv_weight (L of [H, M, Dv, Dv]), conv_bias (L of [H, Dv]), level_query / "
      "level_key (L - 1 of [H, Dk, Dv]), level_value (L - 1 of [H, Dv, Dv]), cross_query / cross_key "
      "[H, Dk, Dv], cross_value [H, Dv, Dv]; one left out is zero. Window: t - window_left <= s <= t + "
      "window_right (defaults M - 1 and 0 causal / M - 1 bidirectional). backward returns (d_queries, "
      "d_keys, d_values, d_params), d_params a dict of the weights' float64 gradients shaped as `params`; "
      "causal, with initial_state / d_final_state, then d_initial_state (every level's ring, the open "
      "groups' sums and the compressed store; slots that hold no token get 0).");
  cls.def(
         "__init__",
         [](PyConvCompressed* self, index_t heads, index_t key_dim, index_t value_dim, index_t group_size,
            index_t levels, bool causal, std::optional<index_t> window_left, std::optional<index_t> window_right,
            std::optional<double> scale, nb::kwargs weights) {
           ConvCompressedTraits::Config c{.dims = {.heads = heads,
                                                   .key_dim = key_dim,
                                                   .value_dim = value_dim,
                                                   .group_size = group_size,
                                                   .levels = levels,
                                                   .window_left = window_left,
                                                   .window_right = window_right},
                                          .causal = causal,
                                          .scale = scale,
                                          .params = {}};
           c.params = params_from(c.dims, weights);
           new (self) PyConvCompressed(std::move(c));
         },
         nb::arg("heads"), nb::arg("key_dim"), nb::arg("value_dim"), nb::arg("group_size"), nb::kw_only(),
         nb::arg("levels") = 1, nb::arg("causal") = true, nb::arg("window_left") = nb::none(),
         nb::arg("window_right") = nb::none(), nb::arg("scale") = nb::none(), nb::arg("weights"),
         "Weights as keyword arguments: conv_weight=[...], conv_bias=[...], level_query=[...], level_key=[...], "
         "level_value=[...], cross_query=..., cross_key=..., cross_value=... (see the class).")
      .def_prop_ro("causal", [](const PyConvCompressed& a) { return a.config().causal; })
      .def_prop_ro("group_size", [](const PyConvCompressed& a) { return a.config().dims.group_size; })
      .def_prop_ro("levels", [](const PyConvCompressed& a) { return a.config().dims.levels; })
      .def_prop_ro(
          "window",
          [](const PyConvCompressed& a) {
            return std::visit([](const auto& c) { return std::make_tuple(c.window().left, c.window().right); },
                              a.attention());
          },
          "(window_left, window_right) in use.")
      .def_prop_ro(
          "scale", [](const PyConvCompressed& a) { return std::visit([](const auto& c) { return c.scale(); }, a.attention()); },
          "The softmax scale in use.")
      .def_prop_ro(
          "params", [](const PyConvCompressed& a) { return params_dict(a.config().params); },
          "The weights in use, a dict of float64 arrays (per-level fields: lists) that the constructor takes "
          "back as keyword arguments.")
      .def(
          "make_state",
          [](const PyConvCompressed& a, index_t batch, index_t context_capacity, const std::string& dtype) {
            return a.new_state("make_state", dtype, [&]<Real T>(const auto& attention) {
              return attention.template make_state<T>(batch, context_capacity);
            });
          },
          nb::arg("batch"), nb::arg("context_capacity"), nb::kw_only(), nb::arg("dtype") = "float32",
          "A fresh decode state for `batch` sequences of up to `context_capacity` tokens (causal only).");
  bind_calls<ConvCompressedTraits>(cls);
}

}  // namespace latte::python
