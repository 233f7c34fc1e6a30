#pragma once
// The parameters a mechanism owns (not the layer's projections): LAVO's relative
// bias and bases, conv-compression's weights, VAPOR's angles (LatteAttention,
// LatteMacchiato), LeaPformer's LeaP modules. A layer's backward accumulates
// their gradients into `d_weights.attention`, whose type and plumbing come from
// MechanismParameters<Attention>:
//
//   Gradients<T>                  the type of AttentionLayer::Weights::attention
//   zeros<T>(attention)           gradients shaped as the parameters, every entry 0
//   validate<T>(d, attention, name)  throws latte::Error naming `<name>.<field>` when
//                                 a field that is not empty has another shape
//   attach<T>(d, gradients)       points the mechanism's Gradients<T> at d's fields
//
// A field left empty (default-constructed) is not wanted: nothing is accumulated
// into it, as the mechanisms' own backwards treat an empty buffer. Mechanisms
// without learned parameters (and user mechanisms without a specialisation) get
// NoMechanismParameters. The parameters' values stay the mechanism's: a training
// step rebuilds the mechanism from updated ones (docs/backward.md "Layers").
#include <array>
#include <string>
#include <string_view>
#include <type_traits>

#include "latte/core/error.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/tensor.hpp"
#include "latte/core/types.hpp"
#include "latte/mechanisms/conv_compressed_attention.hpp"
#include "latte/mechanisms/latte_attention.hpp"
#include "latte/mechanisms/latte_macchiato.hpp"
#include "latte/mechanisms/lavo.hpp"
#include "latte/mechanisms/linear_attention.hpp"
#include "latte/policies/leap_module.hpp"

namespace latte {

/// A mechanism with no learned parameters of its own.
struct NoMechanismParameters {};

/// Gradients of LAVO's relative bias P [H, 2w - 1] and bases B [H, r, d].
template <Real T>
struct LavoParameterGradients {
  Tensor<T, 2> relative_bias;
  Tensor<T, 3> bases;
};

/// Gradients of VAPOR's angles [H, Dv/2] (LatteAttention / LatteMacchiato with VAPOR).
template <Real T>
struct VaporAngleGradients {
  Tensor<T, 2> angles;
};

/// Gradients of LeaPformer's two LeaP modules (shaped as the attention's).
struct LeaPModuleGradients {
  LeaPModule query_module;
  LeaPModule key_module;
};

namespace detail {

/// No learned parameters: nothing to make, check or attach.
template <class Attention>
struct NoLearnedParameters {
  template <Real T>
  using Gradients = NoMechanismParameters;
  template <Real T>
  static Gradients<T> zeros(const Attention&) {
    return {};
  }
  template <Real T>
  static void validate(const Gradients<T>&, const Attention&, const std::string&) {}
  template <Real T>
  static void attach(Gradients<T>&, typename Attention::template Gradients<T>&) {}
};

/// `tensor` must be empty (not wanted) or have `expected`'s extents.
template <class T, std::size_t N>
void check_wanted(const Tensor<T, N>& tensor, const std::string& name,
                  const std::array<index_t, N>& expected, std::string_view layout) {
  if (tensor.size() != 0) check_shape(tensor.cview(), name, expected, layout);
}

/// VAPOR's angles [H, Dv/2], for LatteAttention and LatteMacchiato.
template <class Attention>
struct VaporAngleParameters {
  template <Real T>
  using Gradients = VaporAngleGradients<T>;
  template <Real T>
  static Gradients<T> zeros(const Attention& attention) {
    return {Tensor<T, 2>({attention.dims().heads, attention.dims().value_dim / 2})};
  }
  template <Real T>
  static void validate(const Gradients<T>& d, const Attention& attention, const std::string& name) {
    check_wanted(d.angles, name + ".angles",
                 std::array<index_t, 2>{attention.dims().heads, attention.dims().value_dim / 2},
                 "[H, Dv/2]");
  }
  template <Real T>
  static void attach(Gradients<T>& d, typename Attention::template Gradients<T>& gradients) {
    if (d.angles.size() != 0) gradients.d_angles = d.angles.view();
  }
};

}  // namespace detail

/// The default: a mechanism without learned parameters of its own.
template <class Attention>
struct MechanismParameters : detail::NoLearnedParameters<Attention> {};

template <Direction Dir, Stabilizer Stab, Positional Pos, Summation Sum>
struct MechanismParameters<LatteAttention<Dir, Stab, Pos, Sum>>
    : std::conditional_t<Pos::rotates_values,
                         detail::VaporAngleParameters<LatteAttention<Dir, Stab, Pos, Sum>>,
                         detail::NoLearnedParameters<LatteAttention<Dir, Stab, Pos, Sum>>> {};

/// VAPOR's angles on the latent states; the window's RoPE angles are fixed.
template <Direction Dir, Stabilizer Stab, Positional LatentPos, Positional WindowPos>
struct MechanismParameters<LatteMacchiato<Dir, Stab, LatentPos, WindowPos>>
    : std::conditional_t<
          LatentPos::rotates_values,
          detail::VaporAngleParameters<LatteMacchiato<Dir, Stab, LatentPos, WindowPos>>,
          detail::NoLearnedParameters<LatteMacchiato<Dir, Stab, LatentPos, WindowPos>>> {};

template <Direction Dir>
struct MechanismParameters<Lavo<Dir>> {
  template <Real T>
  using Gradients = LavoParameterGradients<T>;
  template <Real T>
  static Gradients<T> zeros(const Lavo<Dir>& attention) {
    return {Tensor<T, 2>(attention.relative_bias().extents()), Tensor<T, 3>(attention.bases().extents())};
  }
  template <Real T>
  static void validate(const Gradients<T>& d, const Lavo<Dir>& attention, const std::string& name) {
    detail::check_wanted(d.relative_bias, name + ".relative_bias", attention.relative_bias().extents(),
                         "[H, 2w - 1]");
    detail::check_wanted(d.bases, name + ".bases", attention.bases().extents(), "[H, r, d]");
  }
  template <Real T>
  static void attach(Gradients<T>& d, LavoGradients<T>& gradients) {
    if (d.relative_bias.size() != 0) gradients.d_relative_bias = d.relative_bias.view();
    if (d.bases.size() != 0) gradients.d_bases = d.bases.view();
  }
};

template <Direction Dir>
struct MechanismParameters<ConvCompressedAttention<Dir>> {
  template <Real T>
  using Gradients = ConvCompressedParams;
  template <Real T>
  static Gradients<T> zeros(const ConvCompressedAttention<Dir>& attention) {
    return ConvCompressedParams::zeros(attention.dims());
  }
  template <Real T>
  static void validate(const Gradients<T>& d, const ConvCompressedAttention<Dir>& attention,
                       const std::string& name) {
    if (!empty(d)) attention.validate_shapes(d, name);
  }
  template <Real T>
  static void attach(Gradients<T>& d, ConvCompressedGradients<T>& gradients) {
    if (!empty(d)) gradients.d_params = &d;
  }

 private:
  static bool empty(const ConvCompressedParams& d) {
    return d.conv_weight.empty() && d.conv_bias.empty() && d.level_query.empty() &&
           d.level_key.empty() && d.level_value.empty() && d.cross_query.size() == 0 &&
           d.cross_key.size() == 0 && d.cross_value.size() == 0;
  }
};

/// LeaPformer (LeaPReweight) with LeaP modules: their weights. A module left
/// empty (no w1, b1, w2) is not wanted.
template <Direction Dir, FeatureMap Map, Positional Pos, Summation Sum>
struct MechanismParameters<LinearAttention<Dir, Map, LeaPReweight, Pos, Sum>> {
  using Attention = LinearAttention<Dir, Map, LeaPReweight, Pos, Sum>;
  template <Real T>
  using Gradients = LeaPModuleGradients;
  template <Real T>
  static Gradients<T> zeros(const Attention& attention) {
    const auto& leap = attention.options().reweight;
    if (!leap.query_module || !leap.key_module) return {};  // no modules: nothing learned here
    return {leap.query_module->zeros_like(), leap.key_module->zeros_like()};
  }
  template <Real T>
  static void validate(const Gradients<T>& d, const Attention& attention, const std::string& name) {
    const auto& leap = attention.options().reweight;
    check(d.query_module, leap.query_module ? &*leap.query_module : nullptr, name + ".query_module");
    check(d.key_module, leap.key_module ? &*leap.key_module : nullptr, name + ".key_module");
  }
  template <Real T>
  static void attach(Gradients<T>& d, LinearGradients<T>& gradients) {
    if (wanted(d.query_module)) gradients.d_query_module = &d.query_module;
    if (wanted(d.key_module)) gradients.d_key_module = &d.key_module;
  }

 private:
  static bool wanted(const LeaPModule& m) {
    return m.w1.size() != 0 || m.b1.size() != 0 || m.w2.size() != 0;
  }
  static void check(const LeaPModule& d, const LeaPModule* module, const std::string& name) {
    if (!wanted(d)) return;
    detail::require(module != nullptr, name,
                    "this LeaPformer has no LeaP modules to differentiate (leave it empty)");
    auto same = [&](const auto& got, const auto& expected, const char* part) {
      detail::require(got.extents() == expected.extents(), name + "." + part,
                      detail::expected_given("shape (make it with zero_weights())",
                                             format_extents(expected.extents()),
                                             format_extents(got.extents())));
    };
    same(d.w1, module->w1, "w1");
    same(d.b1, module->b1, "b1");
    same(d.w2, module->w2, "w2");
  }
};

}  // namespace latte
