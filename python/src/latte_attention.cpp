// latte.LatteAttention: LatteAttention<Causal | Bidirectional, RunningMax,
// NoPositional | VAPOR> from Python. One Python class holds whichever of the
// four C++ types its arguments name; every call dispatches on the inputs'
// dtype (float32 / float64) and on `exec` ("cpu" / "reference").
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"
#include "latte/mechanisms/latte_attention.hpp"

namespace latte::python {
namespace {

/// What a Python LatteAttention was built from: enough to build it again
/// (pickling a state rebuilds its attention).
struct LatteConfig {
  index_t heads = 0, latents = 0, value_dim = 0;
  bool causal = true;
  bool vapor = false;
  std::vector<double> angles;  // [H * Dv/2] as given, empty: the RoPE schedule
};

using CausalLatte = LatteAttention<Causal, RunningMax, NoPositional>;
using CausalVaporLatte = LatteAttention<Causal, RunningMax, VAPOR>;
using BidirectionalLatte = LatteAttention<Bidirectional, RunningMax, NoPositional>;
using BidirectionalVaporLatte = LatteAttention<Bidirectional, RunningMax, VAPOR>;
using AnyLatte = std::variant<CausalLatte, CausalVaporLatte, BidirectionalLatte, BidirectionalVaporLatte>;

AnyLatte make_latte(const LatteConfig& c) {
  const LatteDims dims{.heads = c.heads, .latents = c.latents, .value_dim = c.value_dim};
  if (!c.vapor) {
    if (c.causal) return CausalLatte(dims);
    return BidirectionalLatte(dims);
  }
  VAPOR::Params params;
  if (!c.angles.empty()) {
    const index_t pairs = c.value_dim / 2;
    // The table's size against [H, Dv/2] is the C++ constructor's to check.
    const index_t rows = pairs > 0 ? static_cast<index_t>(c.angles.size()) / pairs : 0;
    params = VAPOR::params_from(TensorView<const double, 2>(c.angles.data(), {rows, pairs}));
  }
  if (c.causal) return CausalVaporLatte(dims, params);
  return BidirectionalVaporLatte(dims, params);
}

/// A decode state of a Python LatteAttention: the C++ state of either dtype,
/// and the configuration of the attention that made it.
struct PyLatteState {
  std::shared_ptr<const LatteConfig> config;
  std::variant<LatteState<float>, LatteState<double>> state;

  [[nodiscard]] Dtype dtype() const { return state.index() == 0 ? Dtype::float32 : Dtype::float64; }
  [[nodiscard]] std::int64_t position() const {
    return std::visit([](const auto& s) { return s.position(); }, state);
  }
  [[nodiscard]] index_t batch() const {
    return std::visit([](const auto& s) { return s.batch(); }, state);
  }
  [[nodiscard]] nb::bytes save() const {
    const std::vector<std::byte> bytes = std::visit([](const auto& s) { return s.save(); }, state);
    return nb::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
};

class PyLatte {
 public:
  explicit PyLatte(LatteConfig config)
      : config_(std::make_shared<const LatteConfig>(std::move(config))), latte_(make_latte(*config_)) {}

  [[nodiscard]] const LatteConfig& config() const { return *config_; }

  nb::object forward(const AnyArray& q, const AnyArray& k, const AnyArray& v,
                     std::optional<nb::handle> out, PyLatteState* state, const std::string& exec) {
    const Dtype dtype = dtype_of(q, "query_logits");
    return dtype == Dtype::float32 ? forward_as<float>(q, k, v, out, state, exec)
                                   : forward_as<double>(q, k, v, out, state, exec);
  }

  nb::object step(PyLatteState& state, const AnyArray& q, const AnyArray& k, const AnyArray& v,
                  std::optional<nb::handle> out, const std::string& exec) {
    return state.dtype() == Dtype::float32 ? step_as<float>(state, q, k, v, out, exec)
                                           : step_as<double>(state, q, k, v, out, exec);
  }

  nb::tuple backward(const AnyArray& q, const AnyArray& k, const AnyArray& v, const AnyArray& d_out,
                     const PyLatteState* initial_state, const std::string& exec) {
    const Dtype dtype = dtype_of(q, "query_logits");
    return dtype == Dtype::float32 ? backward_as<float>(q, k, v, d_out, initial_state, exec)
                                   : backward_as<double>(q, k, v, d_out, initial_state, exec);
  }

  PyLatteState make_state(index_t batch, std::int64_t first_position, const std::string& dtype) {
    require_causal("make_state");
    return std::visit(
        [&](const auto& attention) -> PyLatteState {
          using A = std::decay_t<decltype(attention)>;
          if constexpr (A::direction::is_causal) {
            if (parse_dtype(dtype) == Dtype::float32)
              return {config_, attention.template make_state<float>(batch, first_position)};
            return {config_, attention.template make_state<double>(batch, first_position)};
          } else {
            throw Error("make_state", "unreachable");
          }
        },
        latte_);
  }

  PyLatteState load_state(nb::bytes bytes, const std::string& dtype) {
    require_causal("load_state");
    const std::span<const std::byte> span(reinterpret_cast<const std::byte*>(bytes.c_str()), bytes.size());
    return std::visit(
        [&](const auto& attention) -> PyLatteState {
          using A = std::decay_t<decltype(attention)>;
          if constexpr (A::direction::is_causal) {
            if (parse_dtype(dtype) == Dtype::float32)
              return {config_, attention.template load_state<float>(span)};
            return {config_, attention.template load_state<double>(span)};
          } else {
            throw Error("load_state", "unreachable");
          }
        },
        latte_);
  }

  /// The angles VAPOR uses, [H, Dv/2] float64 (None without VAPOR).
  nb::object angles() const {
    return std::visit(
        [](const auto& attention) -> nb::object {
          const auto view = attention.angles();
          if (view.extent(0) == 0) return nb::none();
          auto array = new_array<double, 2>({view.extent(0), view.extent(1)});
          std::memcpy(array.data(), view.data(), sizeof(double) * view.size());
          return nb::cast(array);
        },
        latte_);
  }

  std::string kind(const std::string& dtype) const {
    return std::visit(
        [&](const auto& attention) {
          using A = std::decay_t<decltype(attention)>;
          return parse_dtype(dtype) == Dtype::float32 ? A::template kind<float>() : A::template kind<double>();
        },
        latte_);
  }

 private:
  void require_causal(const char* what) const {
    if (!config_->causal)
      throw Error(what, "a bidirectional LatteAttention has no decode state (causal=True has)");
  }

  template <Real T>
  nb::object forward_as(const AnyArray& q_array, const AnyArray& k_array, const AnyArray& v_array,
                        std::optional<nb::handle> out_object, PyLatteState* state, const std::string& exec) {
    constexpr Dtype dtype = std::is_same_v<T, float> ? Dtype::float32 : Dtype::float64;
    const auto q = view_of<T, 4>(q_array, "query_logits", "[B, T, H, L]", dtype);
    const auto k = view_of<T, 4>(k_array, "key_logits", "[B, T, H, L]", dtype);
    const auto v = view_of<T, 4>(v_array, "values", "[B, T, H, Dv]", dtype);
    const Backend backend = parse_exec(exec);
    LatteState<T>* native_state = nullptr;
    if (state != nullptr) {
      require_causal("state");
      if (state->dtype() != dtype)
        throw Error("state", detail::expected_given("dtype (that of the inputs)", dtype_name(dtype),
                                                    dtype_name(state->dtype())));
      native_state = &std::get<LatteState<T>>(state->state);
    }
    nb::object result;
    TensorView<T, 4> out;
    if (out_object) {
      out = writable_view_of<T, 4>(*out_object, "out", "[B, T, H, Dv]", dtype);
      result = nb::borrow(*out_object);
    } else {
      auto array = new_array<T, 4>({v.extent(0), v.extent(1), v.extent(2), config_->value_dim});
      out = view_of_new<T, 4>(array);
      result = nb::cast(array);
    }
    std::visit(
        [&](const auto& attention) {
          using A = std::decay_t<decltype(attention)>;
          nb::gil_scoped_release released;
          with_backend(backend, [&](auto e) {
            if constexpr (A::direction::is_causal) {
              if (native_state != nullptr) {
                attention.forward(e, q, k, v, out, *native_state);
                return;
              }
            }
            attention.forward(e, q, k, v, out);
          });
        },
        latte_);
    return result;
  }

  template <Real T>
  nb::object step_as(PyLatteState& state, const AnyArray& q_array, const AnyArray& k_array,
                     const AnyArray& v_array, std::optional<nb::handle> out_object, const std::string& exec) {
    constexpr Dtype dtype = std::is_same_v<T, float> ? Dtype::float32 : Dtype::float64;
    require_causal("step");
    const auto q = view_of<T, 3>(q_array, "query_logits", "[B, H, L]", dtype);
    const auto k = view_of<T, 3>(k_array, "key_logits", "[B, H, L]", dtype);
    const auto v = view_of<T, 3>(v_array, "values", "[B, H, Dv]", dtype);
    const Backend backend = parse_exec(exec);
    auto& native_state = std::get<LatteState<T>>(state.state);
    nb::object result;
    TensorView<T, 3> out;
    if (out_object) {
      out = writable_view_of<T, 3>(*out_object, "out", "[B, H, Dv]", dtype);
      result = nb::borrow(*out_object);
    } else {
      auto array = new_array<T, 3>({native_state.batch(), config_->heads, config_->value_dim});
      out = view_of_new<T, 3>(array);
      result = nb::cast(array);
    }
    std::visit(
        [&](const auto& attention) {
          using A = std::decay_t<decltype(attention)>;
          if constexpr (A::direction::is_causal) {
            nb::gil_scoped_release released;
            with_backend(backend, [&](auto e) { attention.step(e, native_state, q, k, v, out); });
          }
        },
        latte_);
    return result;
  }

  template <Real T>
  nb::tuple backward_as(const AnyArray& q_array, const AnyArray& k_array, const AnyArray& v_array,
                        const AnyArray& d_out_array, const PyLatteState* initial_state,
                        const std::string& exec) {
    constexpr Dtype dtype = std::is_same_v<T, float> ? Dtype::float32 : Dtype::float64;
    const auto q = view_of<T, 4>(q_array, "query_logits", "[B, T, H, L]", dtype);
    const auto k = view_of<T, 4>(k_array, "key_logits", "[B, T, H, L]", dtype);
    const auto v = view_of<T, 4>(v_array, "values", "[B, T, H, Dv]", dtype);
    const auto d_out = view_of<T, 4>(d_out_array, "d_out", "[B, T, H, Dv]", dtype);
    const Backend backend = parse_exec(exec);
    const LatteState<T>* initial = nullptr;
    if (initial_state != nullptr) {
      require_causal("initial_state");
      if (initial_state->dtype() != dtype)
        throw Error("initial_state", detail::expected_given("dtype (that of the inputs)", dtype_name(dtype),
                                                            dtype_name(initial_state->dtype())));
      initial = &std::get<LatteState<T>>(initial_state->state);
    }
    // The gradients take the inputs' shapes; a shape latte refuses is refused
    // before anything is written.
    auto d_q = new_array<T, 4>(q.extents());
    auto d_k = new_array<T, 4>(k.extents());
    auto d_v = new_array<T, 4>(v.extents());
    const bool vapor = config_->vapor;
    const index_t pairs = config_->value_dim / 2;
    auto d_angles = new_array<T, 2>({vapor ? config_->heads : 0, vapor ? pairs : 0});
    auto d_angles_view = view_of_new<T, 2>(d_angles);
    for (index_t i = 0; i < d_angles_view.size(); ++i) d_angles.data()[i] = T(0);
    LatteGradients<T> gradients{.d_query_logits = view_of_new<T, 4>(d_q),
                                .d_key_logits = view_of_new<T, 4>(d_k),
                                .d_values = view_of_new<T, 4>(d_v)};
    if (vapor) gradients.d_angles = d_angles_view;
    std::visit(
        [&](const auto& attention) {
          using A = std::decay_t<decltype(attention)>;
          nb::gil_scoped_release released;
          with_backend(backend, [&](auto e) {
            if constexpr (A::direction::is_causal) {
              attention.backward(e, q, k, v, d_out, gradients, LatteStateGradients<T>{.initial = initial});
            } else {
              attention.backward(e, q, k, v, d_out, gradients);
            }
          });
        },
        latte_);
    if (vapor) return nb::make_tuple(d_q, d_k, d_v, d_angles);
    return nb::make_tuple(d_q, d_k, d_v);
  }

  std::shared_ptr<const LatteConfig> config_;
  AnyLatte latte_;
};

nb::tuple config_tuple(const LatteConfig& c) {
  return nb::make_tuple(c.heads, c.latents, c.value_dim, c.causal, c.vapor, c.angles);
}

LatteConfig config_from(nb::tuple t) {
  return LatteConfig{nb::cast<index_t>(t[0]), nb::cast<index_t>(t[1]), nb::cast<index_t>(t[2]),
                     nb::cast<bool>(t[3]), nb::cast<bool>(t[4]), nb::cast<std::vector<double>>(t[5])};
}

LatteConfig make_config(index_t heads, index_t latents, index_t value_dim, bool causal, bool vapor,
                        std::optional<AnyArray> angles) {
  LatteConfig config{heads, latents, value_dim, causal, vapor, {}};
  if (angles) {
    if (!vapor) throw Error("angles", "given without vapor=True (only VAPOR rotates by angles)");
    const auto view = view_of<double, 2>(*angles, "angles", "[H, Dv/2]", Dtype::float64);
    config.angles.resize(static_cast<std::size_t>(view.size()));
    for (index_t h = 0, at = 0; h < view.extent(0); ++h)
      for (index_t i = 0; i < view.extent(1); ++i) config.angles[static_cast<std::size_t>(at++)] = view(h, i);
    // The C++ constructor checks [H, Dv/2]; a table of another row length is caught here.
    if (view.extent(1) != value_dim / 2)
      throw Error("angles", detail::expected_given("shape [H, Dv/2]",
                                                   "[" + std::to_string(heads) + ", " + std::to_string(value_dim / 2) + "]",
                                                   "[" + std::to_string(view.extent(0)) + ", " +
                                                       std::to_string(view.extent(1)) + "]"));
  }
  return config;
}

}  // namespace

void bind_latte_attention(nb::module_& m) {
  nb::class_<PyLatteState>(m, "LatteState",
                           "A causal LatteAttention's decode state (make_state / load_state): the "
                           "running normaliser and memory of every (sequence, head) and the position "
                           "of the next token. Picklable; save() gives latte's checksummed bytes.")
      .def_prop_ro("position", &PyLatteState::position, "Absolute position of the next token.")
      .def_prop_ro("batch", &PyLatteState::batch)
      .def_prop_ro("dtype", [](const PyLatteState& s) { return std::string(dtype_name(s.dtype())); })
      .def("save", &PyLatteState::save, "The state as latte's saved-state bytes (format, sizes, checksum).")
      .def("copy", [](const PyLatteState& s) { return PyLatteState(s); }, "An independent copy.")
      .def("__copy__", [](const PyLatteState& s) { return PyLatteState(s); })
      .def("__deepcopy__", [](const PyLatteState& s, nb::handle) { return PyLatteState(s); }, nb::arg("memo"))
      .def("__getstate__",
           [](const PyLatteState& s) {
             return nb::make_tuple(config_tuple(*s.config), std::string(dtype_name(s.dtype())), s.save());
           })
      .def("__setstate__", [](PyLatteState& s, nb::tuple t) {
        PyLatte attention(config_from(nb::cast<nb::tuple>(t[0])));
        new (&s) PyLatteState(attention.load_state(nb::cast<nb::bytes>(t[2]), nb::cast<std::string>(t[1])));
      });

  nb::class_<PyLatte>(m, "LatteAttention",
                      "Latte attention (paper 000): every query reads L latent states through "
                      "p(l|t) = softmax(query_logits[t]), each latent a softmax over key_logits[:, l] "
                      "of the (past, if causal) values; VAPOR rotates the values by position. "
                      "Arrays are [B, T, H, L] logits and [B, T, H, Dv] values, float32 or float64, "
                      "any strides with a unit last one; nothing is copied.")
      .def(
          "__init__",
          [](PyLatte* self, index_t heads, index_t latents, index_t value_dim, bool causal, bool vapor,
             std::optional<AnyArray> angles) {
            new (self) PyLatte(make_config(heads, latents, value_dim, causal, vapor, std::move(angles)));
          },
          nb::arg("heads"), nb::arg("latents"), nb::arg("value_dim"), nb::kw_only(), nb::arg("causal") = true,
          nb::arg("vapor") = false, nb::arg("angles") = nb::none())
      .def_prop_ro("heads", [](const PyLatte& a) { return a.config().heads; })
      .def_prop_ro("latents", [](const PyLatte& a) { return a.config().latents; })
      .def_prop_ro("value_dim", [](const PyLatte& a) { return a.config().value_dim; })
      .def_prop_ro("causal", [](const PyLatte& a) { return a.config().causal; })
      .def_prop_ro("vapor", [](const PyLatte& a) { return a.config().vapor; })
      .def_prop_ro("angles", &PyLatte::angles, "VAPOR's angles [H, Dv/2] as used (None without VAPOR).")
      .def("kind", &PyLatte::kind, nb::arg("dtype") = "float32", "The C++ type's name, as states record it.")
      .def("forward", &PyLatte::forward, nb::arg("query_logits"), nb::arg("key_logits"), nb::arg("values"),
           nb::arg("out") = nb::none(), nb::kw_only(), nb::arg("state") = nb::none(), nb::arg("exec") = "cpu",
           "The output [B, T, H, Dv] (written into `out` when given). With `state` (causal), the "
           "sequence continues from it and the state is left at its end.")
      .def("step", &PyLatte::step, nb::arg("state"), nb::arg("query_logits"), nb::arg("key_logits"),
           nb::arg("values"), nb::arg("out") = nb::none(), nb::kw_only(), nb::arg("exec") = "cpu",
           "One token for every sequence of `state`: inputs [B, H, L], [B, H, L], [B, H, Dv]; "
           "output [B, H, Dv]. Constant time in the tokens already absorbed.")
      .def("backward", &PyLatte::backward, nb::arg("query_logits"), nb::arg("key_logits"), nb::arg("values"),
           nb::arg("d_out"), nb::kw_only(), nb::arg("initial_state") = nb::none(), nb::arg("exec") = "cpu",
           "Gradients (d_query_logits, d_key_logits, d_values[, d_angles]) of a loss whose "
           "gradient with respect to the output is d_out; d_angles [H, Dv/2] with VAPOR. "
           "`initial_state`: the state the forward continued from, as it was before it.")
      .def("make_state", &PyLatte::make_state, nb::arg("batch"), nb::kw_only(), nb::arg("first_position") = 0,
           nb::arg("dtype") = "float32", "A fresh decode state for `batch` sequences (causal only).")
      .def("load_state", &PyLatte::load_state, nb::arg("data"), nb::kw_only(), nb::arg("dtype") = "float32",
           "A state from LatteState.save()'s bytes, checked whole first.")
      .def("__getstate__", [](const PyLatte& a) { return config_tuple(a.config()); })
      .def("__setstate__", [](PyLatte& a, nb::tuple t) { new (&a) PyLatte(config_from(t)); });
}

}  // namespace latte::python
