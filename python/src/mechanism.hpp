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
//                               backward from an initial state; a {initial, d_final, d_initial}
//                               struct, whose d_final and d_initial backward fills in)
//   template <Real T, class A> static State<T> blank_state(const A&, index_t batch, std::int64_t position)
//                               (optional: a fresh state, which state_from_fields fills), or
//                               blank_state(const A&, index_t batch, std::int64_t position,
//                               std::optional<index_t> context_capacity) for states sized by one
//   static nb::tuple to_tuple(const Config&), static Config from_tuple(nb::tuple)
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "arrays.hpp"
#include "kernel_call.hpp"
#include "bindings.hpp"

namespace latte::python {

/// One input of a mechanism: its name (the C++ argument's) and layouts.
struct InputSpec {
  const char* name;
  const char* sequence_layout;  // "[B, T, H, L]"
  const char* step_layout;      // "[B, H, L]"
};

/// One field of a state as Python sees it: name, element count, NumPy shape.
struct FieldLayout {
  std::string name;
  std::size_t count = 0;
  std::vector<std::size_t> shape;
};

/// The fields that are rows of a named size (the first of `sizes` the state
/// has), by field name, across the families' states.
struct FieldColumns {
  std::string_view field;
  std::array<std::string_view, 2> sizes;
};
inline constexpr std::array<FieldColumns, 9> kFieldColumns{{{"memory", {"value_dim", ""}},
                                                            {"memory_low", {"value_dim", ""}},
                                                            {"group_sums", {"value_dim", ""}},
                                                            {"keys", {"key_dim", "dim"}},
                                                            {"window_keys", {"key_dim", ""}},
                                                            {"compressed_keys", {"key_dim", ""}},
                                                            {"values", {"value_dim", "dim"}},
                                                            {"window_values", {"value_dim", ""}},
                                                            {"compressed_values", {"value_dim", ""}}}};
/// Fields of one value per state, not per (batch, head).
inline constexpr std::array<std::string_view, 1> kWholeStateFields{"window_fill"};

/// A state's fields, from its own field table (as saved), in order: a field of
/// n values per (batch, head) is [B, H, n], or [B, H, n / D, D] when
/// kFieldColumns gives its rows' size D; a field of kWholeStateFields is [count].
template <class State>
[[nodiscard]] std::vector<FieldLayout> field_layouts(const State& state) {
  const std::vector<std::byte> bytes = state.save();
  const auto header = State::read_header(bytes, state.kind());
  const auto B = static_cast<std::size_t>(state.batch()), H = static_cast<std::size_t>(state.size_of("heads"));
  std::vector<FieldLayout> out;
  for (const StateField& field : header.fields) {
    FieldLayout layout{field.name, field.count, {field.count}};
    const bool per_head = std::ranges::find(kWholeStateFields, field.name) == kWholeStateFields.end();
    if (per_head && B * H > 0 && field.count % (B * H) == 0) {
      const std::size_t n = field.count / (B * H);
      layout.shape = {B, H, n};
      for (const auto& [name, sizes] : kFieldColumns)
        for (const std::string_view size : sizes)
          if (name == field.name && state.size_of(size) > 0) {
            const auto D = static_cast<std::size_t>(state.size_of(size));
            if (n % D == 0) layout.shape = {B, H, n / D, D};
            break;
          }
    }
    out.push_back(std::move(layout));
  }
  return out;
}

[[nodiscard]] inline std::string describe_shape(std::span<const std::size_t> shape) {
  std::string text = "[";
  for (std::size_t d = 0; d < shape.size(); ++d) text += (d ? ", " : "") + std::to_string(shape[d]);
  return text + "]";
}

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
  /// {name: a copy of the field as a NumPy array} (field_layouts' shapes).
  [[nodiscard]] nb::dict fields() const {
    return std::visit(
        [](const auto& s) {
          using T = std::remove_cvref_t<decltype(*s.field(0))>;
          nb::dict out;
          const auto layouts = field_layouts(s);
          for (std::size_t i = 0; i < layouts.size(); ++i) {
            auto array = new_array<T>(std::span<const std::size_t>(layouts[i].shape));
            std::copy_n(s.field(i), layouts[i].count, array.data());
            out[layouts[i].name.c_str()] = nb::cast(std::move(array));
          }
          return out;
        },
        state);
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

/// Whether a Traits' blank states are sized by a context capacity (its
/// blank_state hook takes one: convolutional compression's compressed store).
template <class Traits>
constexpr bool states_have_capacity = requires(const std::variant_alternative_t<0, typename Traits::Any>& a) {
  Traits::template blank_state<float>(a, index_t{}, std::int64_t{}, std::optional<index_t>{});
};
/// Whether state_from_fields can make a Traits' states (its blank_state hook).
template <class Traits>
constexpr bool builds_states =
    states_have_capacity<Traits> || requires(const std::variant_alternative_t<0, typename Traits::Any>& a) {
      Traits::template blank_state<float>(a, index_t{}, std::int64_t{});
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

  nb::tuple backward(const std::array<AnyArray, N>& inputs, const AnyArray& d_out, const StateObject* initial_state,
                     const StateObject* d_final_state, const std::string& exec) const {
    return dtype_of(inputs[0], Traits::inputs[0].name) == Dtype::float32
               ? backward_as<float>(inputs, d_out, initial_state, d_final_state, exec)
               : backward_as<double>(inputs, d_out, initial_state, d_final_state, exec);
  }

  /// A state of the arrays' batch and dtype at `position`: a fresh one
  /// (blank_state) whose fields named in `fields` are overwritten by copies of
  /// them, each checked (name, dtype, shape: latte::Error "fields.<name>"), then
  /// its content checked as load_state checks saved bytes.
  /// `context_capacity`: the tokens the state can hold, where its fields are sized by it
  /// (states_have_capacity; the others' binding takes none).
  StateObject state_from_fields(const nb::dict& fields, std::int64_t position,
                                std::optional<index_t> context_capacity = std::nullopt) const {
    auto blank = [&](Dtype dtype, index_t batch) {
      return new_state("state_from_fields", dtype_name(dtype), [&]<Real T>(const auto& attention) {
        if constexpr (states_have_capacity<Traits>)
          return Traits::template blank_state<T>(attention, batch, position, context_capacity);
        else
          return Traits::template blank_state<T>(attention, batch, position);
      });
    };
    const StateObject probe = blank(Dtype::float64, 1);
    const auto table = std::visit([](const auto& s) { return field_layouts(s); }, probe.state);
    std::string names;
    for (const FieldLayout& layout : table) names += (names.empty() ? "" : ", ") + layout.name;
    auto array_of = [&](const std::string& name) {
      AnyArray array;
      if (!nb::try_cast(fields[name.c_str()], array))
        throw Error("fields." + name, "expected a float32 or float64 array on the CPU, given " +
                                          nb::cast<std::string>(nb::str(fields[name.c_str()].type())));
      return array;
    };
    for (const auto& [key, value] : fields) {
      const std::string name = nb::isinstance<nb::str>(key) ? nb::cast<std::string>(key) : nb::repr(key).c_str();
      if (std::ranges::none_of(table, [&](const FieldLayout& l) { return l.name == name; }))
        throw Error("fields." + name, "not a field of this state (its fields: " + names + ")");
    }
    // The dtype from the first field given, the batch from the first given per (batch, head).
    std::optional<Dtype> dtype;
    std::optional<index_t> batch;
    for (const FieldLayout& layout : table) {
      if (!fields.contains(layout.name.c_str())) continue;
      const AnyArray array = array_of(layout.name);
      if (!dtype) dtype = dtype_of(array, ("fields." + layout.name).c_str());
      if (!batch && layout.shape.size() > 1 && array.ndim() > 0) batch = static_cast<index_t>(array.shape(0));
    }
    if (!dtype || !batch)
      throw Error("fields", "expected arrays of the state's fields (" + names + "), given none per (batch, head)");
    StateObject result = blank(*dtype, *batch);
    std::visit(
        [&](auto& s) {
          using T = std::remove_cvref_t<decltype(*s.field(0))>;
          const auto layouts = field_layouts(s);
          for (std::size_t i = 0; i < layouts.size(); ++i) {
            const FieldLayout& layout = layouts[i];
            if (!fields.contains(layout.name.c_str())) continue;
            const std::string argument = "fields." + layout.name;
            const AnyArray array = array_of(layout.name);
            if (dtype_of(array, argument.c_str()) != *dtype)
              throw Error(argument, detail::expected_given("dtype (that of the first field)", dtype_name(*dtype),
                                                           dtype_name(array.dtype())));
            std::vector<std::size_t> shape(array.ndim());
            for (std::size_t d = 0; d < shape.size(); ++d) shape[d] = array.shape(d);
            if (shape != layout.shape)
              throw Error(argument,
                          detail::expected_given("shape", describe_shape(layout.shape), describe_shape(shape)));
            copy_elements<T>(array, s.field(i));
          }
          try {
            s.restore(s.save());
          } catch (const Error& error) {
            throw detail::renamed(error, "fields");
          }
        },
        result.state);
    return result;
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

  template <Real T, std::size_t R>
  static std::array<TensorView<const T, R>, N> views(const std::array<AnyArray, N>& inputs) {
    std::array<TensorView<const T, R>, N> out;
    for (std::size_t i = 0; i < N; ++i)
      out[i] = view_of<T, R>(inputs[i], Traits::inputs[i].name,
                             R == 4 ? Traits::inputs[i].sequence_layout : Traits::inputs[i].step_layout,
                             dtype_v<T>);
    return out;
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
    auto [result, out] = output_array<T, 4>(
        out_object, {last.extent(0), last.extent(1), last.extent(2), Traits::value_dim(*config_)}, "[B, T, H, Dv]");
    std::visit(
        [&](const auto& attention) {
          using A = std::decay_t<decltype(attention)>;
          KernelCall kernel_call;
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
    auto [result, out] = output_array<T, 3>(
        out_object, {native_state.batch(), in[N - 1].extent(1), Traits::value_dim(*config_)}, "[B, H, Dv]");
    std::visit(
        [&](const auto& attention) {
          using A = std::decay_t<decltype(attention)>;
          if constexpr (A::direction::is_causal) {
            KernelCall kernel_call;
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
                        const StateObject* initial_state, const StateObject* d_final_state,
                        const std::string& exec) const {
    using State = typename Traits::template State<T>;
    const auto in = views<T, 4>(inputs);
    const auto d_out = view_of<T, 4>(d_out_array, "d_out", "[B, T, H, Dv]", dtype_v<T>);
    const Backend backend = parse_exec(exec);
    constexpr bool has_state_gradients = requires(const State* s) { Traits::template state_gradients<T>(s); };
    auto state_argument = [&](const StateObject* given, const char* name) -> const State* {
      if (given == nullptr) return nullptr;
      require_causal(name);
      if (!has_state_gradients) throw Error(name, "this mechanism's backward takes no state");
      return &given->template as<T>(name, dtype_v<T>);
    };
    const State* initial = state_argument(initial_state, "initial_state");
    const State* d_final = state_argument(d_final_state, "d_final_state");
    // With either state given, the tuple ends with the initial state's gradient.
    const bool state_gradient = initial != nullptr || d_final != nullptr;
    State d_initial;
    // The inputs' gradients take the inputs' shapes (a shape latte refuses is
    // refused before anything is written); parameter gradients start at 0.
    std::vector<NumpyArray<T>> d_inputs;
    std::array<TensorView<T, 4>, N> d_views;
    for (std::size_t i = 0; i < N; ++i) {
      d_inputs.push_back(new_array<T, 4>(in[i].extents()));
      d_views[i] = view_of_new<T, 4>(d_inputs.back());
    }
    auto parameters = Traits::template parameter_gradients<T>(*config_);
    try {
      std::visit(
          [&](const auto& attention) {
            using A = std::decay_t<decltype(attention)>;
            const auto gradients = Traits::template gradients<T, A>(d_views, parameters);
            KernelCall kernel_call;
            with_backend(backend, [&](auto e) {
              std::apply(
                  [&](const auto&... x) {
                    if constexpr (has_state_gradients && A::direction::is_causal) {
                      auto states = Traits::template state_gradients<T>(initial);
                      states.d_final = d_final;
                      if (state_gradient) states.d_initial = &d_initial;
                      attention.backward(e, x..., d_out, gradients, states);
                    } else {
                      attention.backward(e, x..., d_out, gradients);
                    }
                  },
                  in);
            });
          },
          attention_);
    } catch (const Error& error) {  // the C++ names of the state arguments, as Python names them
      if (error.argument() == "states.initial") throw detail::renamed(error, "initial_state");
      if (error.argument() == "states.d_final") throw detail::renamed(error, "d_final_state");
      throw;
    }
    nb::list result;
    for (auto& array : d_inputs) result.append(nb::cast(std::move(array)));
    if constexpr (requires { Traits::append_parameter_gradients(result, parameters); })
      Traits::append_parameter_gradients(result, parameters);
    else
      for (auto& array : parameters) result.append(nb::cast(std::move(array)));
    if (state_gradient) result.append(nb::cast(StateObject{config_, std::move(d_initial)}));
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
      .def("fields", &S::fields,
           "The state's fields, {name: NumPy array} (copies), in its field order: a field held per "
           "(sequence, head) is [B, H, n], or [B, H, rows, D] when its rows have a size D of the state "
           "(a memory's value_dim, a ring's key_dim); a field of the whole state is [count]. The "
           "*_low fields are the compensated sums' low parts: a sum is its field plus its low part.")
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
             const S* d_final_state, const std::string& exec) {
            return m.backward({x...}, d_out, initial_state, d_final_state, exec);
          },
          nb::arg(in[I].name)..., nb::arg("d_out"), nb::kw_only(), nb::arg("initial_state") = nb::none(),
          nb::arg("d_final_state") = nb::none(), nb::arg("exec") = "cpu",
          "Gradients of a loss whose gradient with respect to the output is d_out: the inputs' "
          "gradients, in call order, then the learned parameters' (see the class). Causal, for training "
          "in chunks: `initial_state` is the state the forward continued from, as it was before it "
          "(None: a fresh state at position 0); `d_final_state` the loss's gradient with respect to the "
          "state the forward left (None: zero), a state whose fields hold the gradient (for Latte its "
          "running_max must be that final state's: build it with state_from_fields). When either is "
          "given, the tuple ends with d_initial_state: the gradient with respect to the initial state, "
          "as a state of the same kind whose sum fields (normaliser, memory) hold it. A state's "
          "gradient is with respect to the state as saved, a sum being its field plus its low part (a "
          "low part's gradient is its sum's; Latte's and the linear family's gradient states hold 0 "
          "there), Latte's running_max held fixed (d_initial_state carries initial_state's; the "
          "state's meaning is the sums times exp(running_max)). Chained, d_initial_state of one chunk "
          "is d_final_state of the chunk before.")
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
#define LATTE_STATE_FROM_FIELDS_DOC                                                                  \
  "A state built from arrays, the inverse of state.fields(): `fields` maps field names to arrays "   \
  "of the shapes fields() gives (batch from the arrays), all float32 or all float64; a field "       \
  "left out keeps a fresh state's value (a low part 0, Latte's running_max -inf). `position`: "      \
  "that of the next token. Checked as load_state checks saved bytes; a wrong name, dtype or "        \
  "shape raises latte.Error naming 'fields.<name>'."
  constexpr const char* doc = LATTE_STATE_FROM_FIELDS_DOC;
  if constexpr (states_have_capacity<Traits>)
    cls.def("state_from_fields", &PyMechanism<Traits>::state_from_fields, nb::arg("fields"), nb::kw_only(),
            nb::arg("position") = 0, nb::arg("context_capacity").none() = nb::none(),
            LATTE_STATE_FROM_FIELDS_DOC " `context_capacity`: the tokens the state can hold (make_state's), "
                                        "which sizes its fields; required.");
  else if constexpr (builds_states<Traits>)
    cls.def(
        "state_from_fields",
        [](const PyMechanism<Traits>& m, const nb::dict& fields, std::int64_t position) {
          return m.state_from_fields(fields, position);
        },
        nb::arg("fields"), nb::kw_only(), nb::arg("position") = 0, doc);
#undef LATTE_STATE_FROM_FIELDS_DOC
}

}  // namespace latte::python
