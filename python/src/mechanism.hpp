#pragma once
// One Python class per mechanism family, from a traits struct: the C++ types
// (a std::variant over the compile-time choices the Python arguments make),
// the inputs' names and layouts, and the few hooks where families differ
// (parameter gradients, state gradients). Everything Python-facing is here
// once: dtype dispatch, `exec`, views of the arrays in place, `out`, the GIL
// released around the kernel, states and their pickling.
//
// A Traits provides
//   Config                      what a Python object was built from (pickled)
//   Any                         std::variant of the C++ attention types
//   static Any make(const Config&)
//   template <Real T> State     the decode state type (all causal types share it)
//   static constexpr std::array<InputSpec, N> inputs
//   static index_t value_dim(const Config&)
//   static bool causal(const Config&)
//   template <Real T> static P parameter_gradients(const Config&)   the learned parameters'
//                               gradients, zeroed (std::vector<NumpyArray<T>>, or any type P
//                               with static append_parameter_gradients(nb::list&, P&))
//   template <Real T, class A> static auto gradients(std::array<TensorView<T, 4>, N>, P&)
//                               A::Gradients<T> pointing at the inputs' and parameters' gradients
//   template <Real T> static auto state_gradients(const State<T>* initial)   (optional: causal
//                               backward from an initial state)
//   static nb::tuple to_tuple(const Config&), static Config from_tuple(nb::tuple)
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <array>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"

namespace latte::python {

/// One input of a mechanism: its name (the C++ argument's) and layouts.
struct InputSpec {
  const char* name;
  const char* sequence_layout;  // "[B, T, H, L]"
  const char* step_layout;      // "[B, H, L]"
};

template <class Traits>
struct PyState {
  using Config = typename Traits::Config;
  template <Real T>
  using State = typename Traits::template State<T>;

  std::shared_ptr<const Config> config;
  std::variant<State<float>, State<double>> state;

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
  template <Real T>
  [[nodiscard]] State<T>& as(const char* argument, Dtype expected) {
    if (dtype() != expected)
      throw Error(argument, detail::expected_given("dtype (that of the inputs)", dtype_name(expected),
                                                   dtype_name(dtype())));
    return std::get<State<T>>(state);
  }
  template <Real T>
  [[nodiscard]] const State<T>& as(const char* argument, Dtype expected) const {
    return const_cast<PyState*>(this)->template as<T>(argument, expected);
  }
};

template <class Traits>
class PyMechanism {
 public:
  using Config = typename Traits::Config;
  using Any = typename Traits::Any;
  using StateObject = PyState<Traits>;
  static constexpr std::size_t N = Traits::inputs.size();

  explicit PyMechanism(Config config)
      : config_(std::make_shared<const Config>(std::move(config))), attention_(Traits::make(*config_)) {}

  [[nodiscard]] const Config& config() const { return *config_; }
  [[nodiscard]] const Any& attention() const { return attention_; }

  /// forward(inputs..., out=None, *, state=None, exec="cpu")
  nb::object forward(const std::array<AnyArray, N>& inputs, std::optional<nb::handle> out,
                     StateObject* state, const std::string& exec) const {
    return dtype_of(inputs[0], Traits::inputs[0].name) == Dtype::float32
               ? forward_as<float>(inputs, out, state, exec)
               : forward_as<double>(inputs, out, state, exec);
  }

  nb::object step(StateObject& state, const std::array<AnyArray, N>& inputs, std::optional<nb::handle> out,
                  const std::string& exec) const {
    require_causal("step");
    return state.dtype() == Dtype::float32 ? step_as<float>(state, inputs, out, exec)
                                           : step_as<double>(state, inputs, out, exec);
  }

  nb::tuple backward(const std::array<AnyArray, N>& inputs, const AnyArray& d_out,
                     const StateObject* initial_state, const std::string& exec) const {
    return dtype_of(inputs[0], Traits::inputs[0].name) == Dtype::float32
               ? backward_as<float>(inputs, d_out, initial_state, exec)
               : backward_as<double>(inputs, d_out, initial_state, exec);
  }

  /// Calls make(attention) -> State<T> for the causal type held, wrapped.
  template <class Make>
  StateObject new_state(const char* what, const std::string& dtype, Make&& make) const {
    require_causal(what);
    return std::visit(
        [&](const auto& attention) -> StateObject {
          using A = std::decay_t<decltype(attention)>;
          if constexpr (A::direction::is_causal) {
            if (parse_dtype(dtype) == Dtype::float32) return {config_, make.template operator()<float>(attention)};
            return {config_, make.template operator()<double>(attention)};
          } else {
            throw Error(what, "unreachable: not causal");
          }
        },
        attention_);
  }

  StateObject load_state(nb::bytes bytes, const std::string& dtype) const {
    const std::span<const std::byte> span(reinterpret_cast<const std::byte*>(bytes.c_str()), bytes.size());
    return new_state("load_state", dtype, [&]<Real T>(const auto& attention) {
      return attention.template load_state<T>(span);
    });
  }

  std::string kind(const std::string& dtype) const {
    return std::visit(
        [&](const auto& attention) {
          return parse_dtype(dtype) == Dtype::float32 ? attention.template kind<float>()
                                                      : attention.template kind<double>();
        },
        attention_);
  }

  void require_causal(const char* what) const {
    if (!Traits::causal(*config_))
      throw Error(what, "a bidirectional attention has no decode state (causal=True has)");
  }

 private:
  template <Real T>
  static constexpr Dtype dtype_v = std::is_same_v<T, float> ? Dtype::float32 : Dtype::float64;

  template <Real T, std::size_t R>
  static std::array<TensorView<const T, R>, N> views(const std::array<AnyArray, N>& inputs) {
    std::array<TensorView<const T, R>, N> out;
    for (std::size_t i = 0; i < N; ++i)
      out[i] = view_of<T, R>(inputs[i], Traits::inputs[i].name,
                             R == 4 ? Traits::inputs[i].sequence_layout : Traits::inputs[i].step_layout,
                             dtype_v<T>);
    return out;
  }

  /// `out` as given, or a new array of `extents`.
  template <Real T, std::size_t R>
  static std::pair<nb::object, TensorView<T, R>> output(std::optional<nb::handle> out,
                                                        const std::array<index_t, R>& extents,
                                                        const char* layout) {
    if (out) return {nb::borrow(*out), writable_view_of<T, R>(*out, "out", layout, dtype_v<T>)};
    auto array = new_array<T, R>(extents);
    const auto view = view_of_new<T, R>(array);
    return {nb::cast(std::move(array)), view};
  }

  template <Real T>
  nb::object forward_as(const std::array<AnyArray, N>& inputs, std::optional<nb::handle> out_object,
                        StateObject* state, const std::string& exec) const {
    const auto in = views<T, 4>(inputs);
    const Backend backend = parse_exec(exec);
    typename Traits::template State<T>* native_state = nullptr;
    if (state != nullptr) {
      require_causal("state");
      native_state = &state->template as<T>("state", dtype_v<T>);
    }
    const auto& last = in[N - 1];  // the values: [B, T, H, Dv]
    auto [result, out] = output<T, 4>(
        out_object, {last.extent(0), last.extent(1), last.extent(2), Traits::value_dim(*config_)}, "[B, T, H, Dv]");
    std::visit(
        [&](const auto& attention) {
          using A = std::decay_t<decltype(attention)>;
          nb::gil_scoped_release released;
          with_backend(backend, [&](auto e) {
            std::apply(
                [&](const auto&... x) {
                  if constexpr (A::direction::is_causal) {
                    if (native_state != nullptr) {
                      attention.forward(e, x..., out, *native_state);
                      return;
                    }
                  }
                  attention.forward(e, x..., out);
                },
                in);
          });
        },
        attention_);
    return result;
  }

  template <Real T>
  nb::object step_as(StateObject& state, const std::array<AnyArray, N>& inputs,
                     std::optional<nb::handle> out_object, const std::string& exec) const {
    const auto in = views<T, 3>(inputs);
    const Backend backend = parse_exec(exec);
    auto& native_state = std::get<typename Traits::template State<T>>(state.state);
    auto [result, out] = output<T, 3>(
        out_object, {native_state.batch(), in[N - 1].extent(1), Traits::value_dim(*config_)}, "[B, H, Dv]");
    std::visit(
        [&](const auto& attention) {
          using A = std::decay_t<decltype(attention)>;
          if constexpr (A::direction::is_causal) {
            nb::gil_scoped_release released;
            with_backend(backend, [&](auto e) {
              std::apply([&](const auto&... x) { attention.step(e, native_state, x..., out); }, in);
            });
          }
        },
        attention_);
    return result;
  }

  template <Real T>
  nb::tuple backward_as(const std::array<AnyArray, N>& inputs, const AnyArray& d_out_array,
                        const StateObject* initial_state, const std::string& exec) const {
    const auto in = views<T, 4>(inputs);
    const auto d_out = view_of<T, 4>(d_out_array, "d_out", "[B, T, H, Dv]", dtype_v<T>);
    const Backend backend = parse_exec(exec);
    const typename Traits::template State<T>* initial = nullptr;
    if (initial_state != nullptr) {
      require_causal("initial_state");
      initial = &initial_state->template as<T>("initial_state", dtype_v<T>);
    }
    // The inputs' gradients take the inputs' shapes (a shape latte refuses is
    // refused before anything is written); parameter gradients start at 0.
    std::vector<NumpyArray<T>> d_inputs;
    std::array<TensorView<T, 4>, N> d_views;
    for (std::size_t i = 0; i < N; ++i) {
      d_inputs.push_back(new_array<T, 4>(in[i].extents()));
      d_views[i] = view_of_new<T, 4>(d_inputs.back());
    }
    auto parameters = Traits::template parameter_gradients<T>(*config_);
    std::visit(
        [&](const auto& attention) {
          using A = std::decay_t<decltype(attention)>;
          const auto gradients = Traits::template gradients<T, A>(d_views, parameters);
          nb::gil_scoped_release released;
          with_backend(backend, [&](auto e) {
            std::apply(
                [&](const auto&... x) {
                  if constexpr (requires { Traits::template state_gradients<T>(initial); }) {
                    if constexpr (A::direction::is_causal) {
                      attention.backward(e, x..., d_out, gradients, Traits::template state_gradients<T>(initial));
                      return;
                    }
                  }
                  attention.backward(e, x..., d_out, gradients);
                },
                in);
          });
        },
        attention_);
    nb::list result;
    for (auto& array : d_inputs) result.append(nb::cast(std::move(array)));
    if constexpr (requires { Traits::append_parameter_gradients(result, parameters); })
      Traits::append_parameter_gradients(result, parameters);
    else
      for (auto& array : parameters) result.append(nb::cast(std::move(array)));
    return nb::tuple(result);
  }

  std::shared_ptr<const Config> config_;
  Any attention_;
};

/// The Python state class of a family: position, batch, dtype, save, copy, pickle.
template <class Traits>
void bind_state(nb::module_& m, const char* name, const char* doc) {
  using S = PyState<Traits>;
  nb::class_<S>(m, name, doc)
      .def_prop_ro("position", &S::position, "Absolute position of the next token.")
      .def_prop_ro("batch", &S::batch)
      .def_prop_ro("dtype", [](const S& s) { return std::string(dtype_name(s.dtype())); })
      .def("save", &S::save, "The state as latte's saved-state bytes (format, sizes, checksum).")
      .def("copy", [](const S& s) { return S(s); }, "An independent copy.")
      .def("__copy__", [](const S& s) { return S(s); })
      .def("__deepcopy__", [](const S& s, nb::handle) { return S(s); }, nb::arg("memo"))
      .def("__getstate__",
           [](const S& s) {
             return nb::make_tuple(Traits::to_tuple(*s.config), std::string(dtype_name(s.dtype())), s.save());
           })
      .def("__setstate__", [](S& s, nb::tuple t) {
        const PyMechanism<Traits> attention(Traits::from_tuple(nb::cast<nb::tuple>(t[0])));
        new (&s) S(attention.load_state(nb::cast<nb::bytes>(t[2]), nb::cast<std::string>(t[1])));
      });
}

template <std::size_t>
using ArrayArgument = const AnyArray&;

template <class Traits, class Class, std::size_t... I>
void bind_calls(Class& cls, std::index_sequence<I...>) {
  using M = PyMechanism<Traits>;
  using S = PyState<Traits>;
  constexpr auto& in = Traits::inputs;
  cls.def(
         "forward",
         [](const M& m, ArrayArgument<I>... x, std::optional<nb::handle> out, S* state, const std::string& exec) {
           return m.forward({x...}, out, state, exec);
         },
         nb::arg(in[I].name)..., nb::arg("out") = nb::none(), nb::kw_only(), nb::arg("state") = nb::none(),
         nb::arg("exec") = "cpu",
         "The output [B, T, H, Dv] (written into `out` when given). With `state` (causal), the sequence "
         "continues from it and the state is left at its end.")
      .def(
          "step",
          [](const M& m, S& state, ArrayArgument<I>... x, std::optional<nb::handle> out, const std::string& exec) {
            return m.step(state, {x...}, out, exec);
          },
          nb::arg("state"), nb::arg(in[I].name)..., nb::arg("out") = nb::none(), nb::kw_only(),
          nb::arg("exec") = "cpu", "One token for every sequence of `state`: inputs [B, H, D]; output [B, H, Dv].")
      .def(
          "backward",
          [](const M& m, ArrayArgument<I>... x, const AnyArray& d_out, const S* initial_state,
             const std::string& exec) { return m.backward({x...}, d_out, initial_state, exec); },
          nb::arg(in[I].name)..., nb::arg("d_out"), nb::kw_only(), nb::arg("initial_state") = nb::none(),
          nb::arg("exec") = "cpu",
          "Gradients of a loss whose gradient with respect to the output is d_out: the inputs' "
          "gradients, in call order, then the learned parameters' (see the class). `initial_state`: "
          "the state the forward continued from, as it was before it (causal).")
      .def("load_state", &M::load_state, nb::arg("data"), nb::kw_only(), nb::arg("dtype") = "float32",
           "A state from save()'s bytes, checked whole first.")
      .def("kind", &M::kind, nb::arg("dtype") = "float32", "The C++ type's name, as states record it.")
      .def("__getstate__", [](const M& m) { return Traits::to_tuple(m.config()); })
      .def("__setstate__", [](M& m, nb::tuple t) { new (&m) M(Traits::from_tuple(t)); });
}

/// forward / step / backward / load_state / kind / pickling of a family's class.
/// `cls` is the nb::class_ the caller made (with its constructor and
/// properties); the inputs' names come from Traits::inputs.
template <class Traits, class Class>
void bind_calls(Class& cls) {
  bind_calls<Traits>(cls, std::make_index_sequence<Traits::inputs.size()>{});
}

}  // namespace latte::python
