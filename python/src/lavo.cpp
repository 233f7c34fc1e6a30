// latte.Lavo from Python (mechanism.hpp does the calls): LAVO (paper 002),
// Lavo<Causal | Bidirectional>, with its learned bases and relative bias and
// their gradients, and its cross-attention (LavoCross).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "arrays.hpp"
#include "kernel_call.hpp"
#include "bindings.hpp"
#include "latte/mechanisms/lavo.hpp"
#include "mechanism.hpp"

namespace latte::python {
namespace {

struct LavoTraits {
  struct Config {
    index_t heads = 0, dim = 0, bases = 0, window = 0;
    bool causal = true;
    std::vector<double> basis;          // [H * r * d] as given; empty: orthonormal from basis_seed
    std::uint64_t basis_seed = 0;
    std::vector<double> relative_bias;  // [H * (2w - 1)] as given; empty: zeros
    std::optional<double> scale;
    std::string empty_memory = "zero";
  };
  using Any = std::variant<Lavo<Causal>, Lavo<Bidirectional>>;
  template <Real T>
  using State = LavoState<T>;
  static constexpr std::array<InputSpec, 3> inputs{{{"queries", "[B, T, H, d]", "[B, H, d]"},
                                                    {"keys", "[B, T, H, d]", "[B, H, d]"},
                                                    {"values", "[B, T, H, d]", "[B, H, d]"}}};

  static LavoParams params(const Config& c) {
    LavoParams p;
    if (!c.basis.empty()) {
      p.bases = Tensor<double, 3>({c.heads, c.bases, c.dim});
      std::copy(c.basis.begin(), c.basis.end(), p.bases.data());
    }
    p.basis_seed = c.basis_seed;
    if (!c.relative_bias.empty()) {
      p.relative_bias = Tensor<double, 2>({c.heads, 2 * c.window - 1});
      std::copy(c.relative_bias.begin(), c.relative_bias.end(), p.relative_bias.data());
    }
    p.scale = c.scale;
    if (c.empty_memory == "zero") p.empty_memory = LavoEmptyMemory::zero;
    else if (c.empty_memory == "local_only") p.empty_memory = LavoEmptyMemory::local_only;
    else
      throw Error("empty_memory", detail::expected_given("rule", "\"zero\" or \"local_only\"",
                                                         "\"" + c.empty_memory + "\""));
    return p;
  }
  static Any make(const Config& c) {
    const LavoDims dims{.heads = c.heads, .dim = c.dim, .bases = c.bases, .window = c.window};
    if (c.causal) return Lavo<Causal>(dims, params(c));
    return Lavo<Bidirectional>(dims, params(c));
  }
  static index_t value_dim(const Config& c) { return c.dim; }
  static bool causal(const Config& c) { return c.causal; }

  /// d_relative_bias [H, 2w - 1] and d_bases [H, r, d], accumulated from 0.
  template <Real T>
  static std::vector<NumpyArray<T>> parameter_gradients(const Config& c) {
    std::vector<NumpyArray<T>> out;
    out.push_back(new_array<T, 2>({c.heads, 2 * c.window - 1}));
    out.push_back(new_array<T, 3>({c.heads, c.bases, c.dim}));
    for (auto& array : out) std::fill_n(array.data(), array.size(), T(0));
    return out;
  }
  template <Real T, class A>
  static LavoGradients<T> gradients(const std::array<TensorView<T, 4>, 3>& d, std::vector<NumpyArray<T>>& p) {
    return {.d_queries = d[0], .d_keys = d[1], .d_values = d[2], .d_relative_bias = view_of_new<T, 2>(p[0]),
            .d_bases = view_of_new<T, 3>(p[1])};
  }
  template <Real T>
  static LavoStateGradients<T> state_gradients(const LavoState<T>* initial) {
    return {.initial = initial};
  }
  template <Real T, class A>
  static LavoState<T> blank_state(const A& attention, index_t batch, std::int64_t position) {
    return attention.template make_state<T>(batch, position);
  }

  static nb::tuple to_tuple(const Config& c) {
    return nb::make_tuple(c.heads, c.dim, c.bases, c.window, c.causal, c.basis, c.basis_seed, c.relative_bias,
                          c.scale, c.empty_memory);
  }
  static Config from_tuple(nb::tuple t) {
    return {nb::cast<index_t>(t[0]),
            nb::cast<index_t>(t[1]),
            nb::cast<index_t>(t[2]),
            nb::cast<index_t>(t[3]),
            nb::cast<bool>(t[4]),
            nb::cast<std::vector<double>>(t[5]),
            nb::cast<std::uint64_t>(t[6]),
            nb::cast<std::vector<double>>(t[7]),
            nb::cast<std::optional<double>>(t[8]),
            nb::cast<std::string>(t[9])};
  }
};

using PyLavo = PyMechanism<LavoTraits>;

/// A float64 array of exactly `extents` as a flat vector (`argument` names it).
template <std::size_t N>
std::vector<double> flat_copy(const std::optional<AnyArray>& array, const char* argument, const char* layout,
                              const std::array<index_t, N>& extents) {
  if (!array) return {};
  const auto view = view_of<double, N>(*array, argument, layout, Dtype::float64);
  if (view.extents() != extents)
    throw Error(argument, detail::expected_given(std::string("shape ") + layout, format_extents(extents),
                                                 format_extents(view.extents())));
  std::vector<double> flat;
  flat.reserve(static_cast<std::size_t>(view.size()));
  if constexpr (N == 2) {
    for (index_t i = 0; i < extents[0]; ++i)
      for (index_t j = 0; j < extents[1]; ++j) flat.push_back(view(i, j));
  } else {
    for (index_t i = 0; i < extents[0]; ++i)
      for (index_t j = 0; j < extents[1]; ++j)
        for (index_t k = 0; k < extents[2]; ++k) flat.push_back(view(i, j, k));
  }
  return flat;
}

template <std::size_t N>
nb::object to_numpy(const Tensor<double, N>& tensor) {
  std::array<index_t, N> extents{};
  for (std::size_t d = 0; d < N; ++d) extents[d] = tensor.extent(d);
  auto array = new_array<double, N>(extents);
  std::memcpy(array.data(), tensor.data(), sizeof(double) * static_cast<std::size_t>(tensor.size()));
  return nb::cast(std::move(array));
}

/// Lavo's cross-attention (paper 002 §3.4), on either direction: queries
/// [B, Tq, H, d] read the orthogonal memory of `source` [B, Ts, H, d].
struct LavoCross {

  static nb::object forward(const PyLavo& a, const AnyArray& q, const AnyArray& source,
                            std::optional<nb::handle> out, const std::string& exec) {
    return dtype_of(q, "queries") == Dtype::float32 ? forward_as<float>(a, q, source, out, exec)
                                                     : forward_as<double>(a, q, source, out, exec);
  }
  static nb::tuple backward(const PyLavo& a, const AnyArray& q, const AnyArray& source, const AnyArray& d_out,
                            const std::string& exec) {
    return dtype_of(q, "queries") == Dtype::float32 ? backward_as<float>(a, q, source, d_out, exec)
                                                     : backward_as<double>(a, q, source, d_out, exec);
  }

 private:
  template <Real T>
  static nb::object forward_as(const PyLavo& a, const AnyArray& q_array, const AnyArray& source_array,
                               std::optional<nb::handle> out_object, const std::string& exec) {
    const auto q = view_of<T, 4>(q_array, "queries", "[B, Tq, H, d]", dtype_v<T>);
    const auto source = view_of<T, 4>(source_array, "source", "[B, Ts, H, d]", dtype_v<T>);
    const Backend backend = parse_exec(exec);
    auto output =
        output_array<T, 4>(out_object, {q.extent(0), q.extent(1), q.extent(2), a.config().dim}, "[B, Tq, H, d]");
    const TensorView<T, 4> out = output.second;
    std::visit(
        [&](const auto& lavo) {
          KernelCall kernel_call;
          with_backend(backend, [&](auto e) { lavo.cross_forward(e, q, source, out); });
        },
        a.attention());
    return output.first;
  }

  template <Real T>
  static nb::tuple backward_as(const PyLavo& a, const AnyArray& q_array, const AnyArray& source_array,
                               const AnyArray& d_out_array, const std::string& exec) {
    const auto q = view_of<T, 4>(q_array, "queries", "[B, Tq, H, d]", dtype_v<T>);
    const auto source = view_of<T, 4>(source_array, "source", "[B, Ts, H, d]", dtype_v<T>);
    const auto d_out = view_of<T, 4>(d_out_array, "d_out", "[B, Tq, H, d]", dtype_v<T>);
    const Backend backend = parse_exec(exec);
    const LavoTraits::Config& c = a.config();
    auto d_queries = new_array<T, 4>(q.extents());
    auto d_source = new_array<T, 4>(source.extents());
    auto d_bases = new_array<T, 3>({c.heads, c.bases, c.dim});
    std::fill_n(d_bases.data(), d_bases.size(), T(0));  // accumulated
    const LavoCrossGradients<T> gradients{.d_queries = view_of_new<T, 4>(d_queries),
                                          .d_source = view_of_new<T, 4>(d_source),
                                          .d_bases = view_of_new<T, 3>(d_bases)};
    std::visit(
        [&](const auto& lavo) {
          KernelCall kernel_call;
          with_backend(backend, [&](auto e) { lavo.cross_backward(e, q, source, d_out, gradients); });
        },
        a.attention());
    return nb::make_tuple(std::move(d_queries), std::move(d_source), std::move(d_bases));
  }
};

}  // namespace

void bind_lavo(nb::module_& m) {
  bind_state<LavoTraits>(m, "LavoState",
                         "A causal Lavo's decode state (make_state / load_state / state_from_fields): the "
                         "last w keys / values and the memory's 3r sums per (sequence, head), and the next "
                         "position. fields() gives keys [B, H, w, d] and values [B, H, w, d] (token s in slot "
                         "s % w), window_sum [B, H, r] (the bases' projections summed over the current, "
                         "incomplete window), memory_sum [B, H, r] (over all complete windows) and "
                         "memory_compensation [B, H, r] (memory_sum's compensated low part). Picklable.");
  nb::class_<PyLavo> cls(m, "Lavo",
                         "LAVO (paper 002): a local softmax over the last w tokens with a relative bias, and "
                         "an orthogonal memory of the older ones read through r orthonormal bases per head. "
                         "queries, keys, values [B, T, H, d]. basis [H, r, d] (default: orthonormal from "
                         "basis_seed) and relative_bias [H, 2w - 1] (default zeros) are float64 arrays. "
                         "backward returns (d_queries, d_keys, d_values, d_relative_bias, d_bases).");
  cls.def(
         "__init__",
         [](PyLavo* self, index_t heads, index_t dim, index_t bases, index_t window, bool causal,
            std::optional<AnyArray> basis, std::uint64_t basis_seed, std::optional<AnyArray> relative_bias,
            std::optional<double> scale, std::string empty_memory) {
           LavoTraits::Config config{heads, dim, bases, window, causal, {}, basis_seed, {}, scale,
                                     std::move(empty_memory)};
           config.basis = flat_copy<3>(basis, "basis", "[H, r, d]", {heads, bases, dim});
           config.relative_bias = flat_copy<2>(relative_bias, "relative_bias", "[H, 2w - 1]",
                                               {heads, 2 * window - 1});
           new (self) PyLavo(std::move(config));
         },
         nb::arg("heads"), nb::arg("dim"), nb::arg("bases"), nb::arg("window"), nb::kw_only(),
         nb::arg("causal") = true, nb::arg("basis") = nb::none(), nb::arg("basis_seed") = 0,
         nb::arg("relative_bias") = nb::none(), nb::arg("scale") = nb::none(), nb::arg("empty_memory") = "zero")
      .def_prop_ro("causal", [](const PyLavo& a) { return a.config().causal; })
      .def_prop_ro("window", [](const PyLavo& a) { return a.config().window; })
      .def_prop_ro(
          "basis", [](const PyLavo& a) { return std::visit([](const auto& l) { return to_numpy(l.bases()); }, a.attention()); },
          "The bases B [H, r, d] in use (float64).")
      .def_prop_ro(
          "relative_bias",
          [](const PyLavo& a) { return std::visit([](const auto& l) { return to_numpy(l.relative_bias()); }, a.attention()); },
          "The relative bias P [H, 2w - 1] in use (float64; index (s - t) + w - 1).")
      .def(
          "make_state",
          [](const PyLavo& a, index_t batch, std::int64_t first_position, const std::string& dtype) {
            return a.new_state("make_state", dtype, [&]<Real T>(const auto& attention) {
              return attention.template make_state<T>(batch, first_position);
            });
          },
          nb::arg("batch"), nb::kw_only(), nb::arg("first_position") = 0, nb::arg("dtype") = "float32",
          "A fresh decode state for `batch` sequences whose first token sits at `first_position` (causal "
          "only; window borders are counted from position 0, so a state started later is a slice's, whose "
          "ring and sums state_from_fields fills).");
  bind_calls<LavoTraits>(cls);
  cls.def("cross_forward", &LavoCross::forward, nb::arg("queries"), nb::arg("source"), nb::arg("out") = nb::none(),
          nb::kw_only(), nb::arg("exec") = "cpu",
          "Cross-attention (paper 002 §3.4, either direction): queries [B, Tq, H, d] read the orthogonal memory "
          "of `source` [B, Ts, H, d] (the projected source features; Ts = 0 reads zero): "
          "o_t = sum_i softmax_i(scale X~[i] . q_t) X~[i], X~ = CODE(source); no local part, no causal limit. "
          "The output [B, Tq, H, d] (written into `out` when given).")
      .def("cross_backward", &LavoCross::backward, nb::arg("queries"), nb::arg("source"), nb::arg("d_out"),
           nb::kw_only(), nb::arg("exec") = "cpu",
           "Gradients of cross_forward for a loss whose gradient with respect to its output is d_out: "
           "(d_queries, d_source, d_bases [H, r, d]).");
}

}  // namespace latte::python
