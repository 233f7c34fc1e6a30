// latte.SoftmaxAttention: SoftmaxAttention<Causal | Bidirectional, NoWindow |
// SlidingWindow> from Python (mechanism.hpp does the calls): exact scaled
// dot-product attention, the baseline, with a KV cache for decode.
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
#include "latte/mechanisms/softmax_attention.hpp"
#include "mechanism.hpp"

namespace latte::python {
namespace {

struct SoftmaxTraits {
  struct Config {
    index_t heads = 0, key_dim = 0, value_dim = 0;
    bool causal = true;
    std::optional<std::tuple<index_t, index_t>> window;  // (left, right), FlashAttention's convention
    std::optional<double> scale;                          // None: 1 / sqrt(Dk)
  };
  using Any = std::variant<SoftmaxAttention<Causal>, SoftmaxAttention<Causal, SlidingWindow>,
                           SoftmaxAttention<Bidirectional>, SoftmaxAttention<Bidirectional, SlidingWindow>>;
  template <Real T>
  using State = KVCache<T>;
  static constexpr std::array<InputSpec, 3> inputs{{{"queries", "[B, T, H, Dk]", "[B, H, Dk]"},
                                                    {"keys", "[B, T, H, Dk]", "[B, H, Dk]"},
                                                    {"values", "[B, T, H, Dv]", "[B, H, Dv]"}}};

  static Any make(const Config& c) {
    const SoftmaxDims dims{.heads = c.heads, .key_dim = c.key_dim, .value_dim = c.value_dim};
    if (!c.window) {
      if (c.causal) return SoftmaxAttention<Causal>(dims, {}, c.scale);
      return SoftmaxAttention<Bidirectional>(dims, {}, c.scale);
    }
    const SlidingWindow window{.left = std::get<0>(*c.window), .right = std::get<1>(*c.window)};
    if (c.causal) return SoftmaxAttention<Causal, SlidingWindow>(dims, window, c.scale);
    return SoftmaxAttention<Bidirectional, SlidingWindow>(dims, window, c.scale);
  }
  static index_t value_dim(const Config& c) { return c.value_dim; }
  static bool causal(const Config& c) { return c.causal; }

  template <Real T>
  static std::vector<NumpyArray<T>> parameter_gradients(const Config&) {
    return {};
  }
  template <Real T, class A>
  static SoftmaxGradients<T> gradients(const std::array<TensorView<T, 4>, 3>& d, std::vector<NumpyArray<T>>&) {
    return {.d_queries = d[0], .d_keys = d[1], .d_values = d[2]};
  }

  static nb::tuple to_tuple(const Config& c) {
    return nb::make_tuple(c.heads, c.key_dim, c.value_dim, c.causal, c.window, c.scale);
  }
  static Config from_tuple(nb::tuple t) {
    return {nb::cast<index_t>(t[0]),
            nb::cast<index_t>(t[1]),
            nb::cast<index_t>(t[2]),
            nb::cast<bool>(t[3]),
            nb::cast<std::optional<std::tuple<index_t, index_t>>>(t[4]),
            nb::cast<std::optional<double>>(t[5])};
  }
};

using PySoftmax = PyMechanism<SoftmaxTraits>;

}  // namespace

void bind_softmax_attention(nb::module_& m) {
  bind_state<SoftmaxTraits>(m, "KVCache",
                            "A causal SoftmaxAttention's decode state: the keys and values seen so far, in a "
                            "ring of `capacity` slots per (sequence, head) (left + 1 with a window). "
                            "Picklable; save() gives latte's checksummed bytes.");
  nb::class_<PySoftmax> cls(m, "SoftmaxAttention",
                            "Exact scaled dot-product attention (the baseline): softmax(q k^T * scale) v over "
                            "the (past, if causal) keys, optionally within a sliding window (left, right) "
                            "as FlashAttention counts it. Arrays are [B, T, H, Dk] queries and keys and "
                            "[B, T, H, Dv] values, float32 or float64, read in place. backward returns "
                            "(d_queries, d_keys, d_values).");
  cls.def(
         "__init__",
         [](PySoftmax* self, index_t heads, index_t key_dim, index_t value_dim, bool causal,
            std::optional<std::tuple<index_t, index_t>> window, std::optional<double> scale) {
           new (self) PySoftmax(SoftmaxTraits::Config{heads, key_dim, value_dim, causal, window, scale});
         },
         nb::arg("heads"), nb::arg("key_dim"), nb::arg("value_dim"), nb::kw_only(), nb::arg("causal") = true,
         nb::arg("window") = nb::none(), nb::arg("scale") = nb::none())
      .def_prop_ro("heads", [](const PySoftmax& a) { return a.config().heads; })
      .def_prop_ro("key_dim", [](const PySoftmax& a) { return a.config().key_dim; })
      .def_prop_ro("value_dim", [](const PySoftmax& a) { return a.config().value_dim; })
      .def_prop_ro("causal", [](const PySoftmax& a) { return a.config().causal; })
      .def_prop_ro("window", [](const PySoftmax& a) { return a.config().window; })
      .def(
          "make_state",
          [](const PySoftmax& a, index_t batch, index_t capacity, const std::string& dtype) {
            return a.new_state("make_state", dtype, [&]<Real T>(const auto& attention) {
              return attention.template make_state<T>(batch, capacity);
            });
          },
          nb::arg("batch"), nb::kw_only(), nb::arg("capacity") = 0, nb::arg("dtype") = "float32",
          "A fresh KV cache for `batch` sequences: `capacity` tokens (0: what the window needs; "
          "without a window it must be given: the cache grows no further).");
  bind_calls<SoftmaxTraits>(cls);
}

}  // namespace latte::python
