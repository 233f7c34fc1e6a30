#pragma once
// The two 16-bit floating-point formats activations are stored in:
//   bfloat16  fp32's sign and 8 exponent bits, 7 stored significand bits
//             (unit roundoff 2^-8), range that of fp32;
//   float16   IEEE 754 binary16: 5 exponent bits, 10 stored significand bits
//             (unit roundoff 2^-11), largest finite 65504, subnormals to 2^-24.
// They are storage types: arithmetic happens in fp32 (or wider) after an exact
// widening, and results come back by one rounding to nearest, ties to even.
// Scalar conversions here; the CPU backend's vectorised rows are in
// backends/cpu/half_conversion.hpp and give the same bits.
#include <bit>
#include <concepts>
#include <cstdint>
#include <type_traits>

#include "latte/core/types.hpp"

namespace latte {

/// bfloat16 storage: the upper half of an fp32.
class bfloat16 {
 public:
  bfloat16() = default;
  /// Rounds to nearest, ties to even; overflow gives +-inf, NaN stays a (quiet) NaN.
  constexpr explicit bfloat16(float value) noexcept : bits_(round(value)) {}
  /// Exact.
  constexpr explicit operator float() const noexcept {
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits_) << 16);
  }
  [[nodiscard]] static constexpr bfloat16 from_bits(std::uint16_t bits) noexcept {
    bfloat16 x;
    x.bits_ = bits;
    return x;
  }
  [[nodiscard]] constexpr std::uint16_t bits() const noexcept { return bits_; }
  /// Unit roundoff of the format: the largest relative error of one rounding.
  static constexpr double unit_roundoff = 1.0 / 256;  // 2^-8

 private:
  static constexpr std::uint16_t round(float value) noexcept {
    const std::uint32_t x = std::bit_cast<std::uint32_t>(value);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x0040u);
    // Adding 0x7fff plus the kept part's lowest bit carries into the kept part
    // exactly when the dropped half is above one half, or one half with an odd
    // kept part; a carry out of the significand bumps the exponent (to inf at the top).
    return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
  }
  std::uint16_t bits_;
};

/// IEEE 754 binary16 storage.
class float16 {
 public:
  float16() = default;
  /// Rounds to nearest, ties to even, subnormals included; overflow gives +-inf,
  /// NaN stays a (quiet) NaN.
  constexpr explicit float16(float value) noexcept : bits_(round(value)) {}
  /// Exact.
  constexpr explicit operator float() const noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(bits_ & 0x8000u) << 16;
    std::uint32_t exponent = (bits_ >> 10) & 0x1fu, significand = bits_ & 0x3ffu;
    if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (significand << 13));
    if (exponent == 0) {
      if (significand == 0) return std::bit_cast<float>(sign);
      exponent = 113;  // significand * 2^-24, normalised: 0x400 * 2^-24 = 2^(113 - 127)
      while ((significand & 0x400u) == 0) {
        significand <<= 1;
        --exponent;
      }
      return std::bit_cast<float>(sign | (exponent << 23) | ((significand & 0x3ffu) << 13));
    }
    return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (significand << 13));
  }
  [[nodiscard]] static constexpr float16 from_bits(std::uint16_t bits) noexcept {
    float16 x;
    x.bits_ = bits;
    return x;
  }
  [[nodiscard]] constexpr std::uint16_t bits() const noexcept { return bits_; }
  /// Unit roundoff of the format (normal range; a subnormal result errs by up
  /// to 2^-25 absolute instead).
  static constexpr double unit_roundoff = 1.0 / 2048;  // 2^-11

 private:
  static constexpr std::uint16_t round(float value) noexcept {
    const std::uint32_t x = std::bit_cast<std::uint32_t>(value);
    const std::uint32_t sign = (x >> 16) & 0x8000u, magnitude = x & 0x7fffffffu;
    if (magnitude > 0x7f800000u)  // NaN: quiet, top payload bits kept
      return static_cast<std::uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
    if (magnitude >= 0x47800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 2^16, inf
    if (magnitude >= 0x38800000u) {  // a normal float16 (>= 2^-14): rebias the exponent by 112
      const std::uint32_t r = magnitude - 0x38000000u;
      // Same carry trick as bfloat16 over 13 dropped bits; the top rounds to 0x7c00 (inf).
      return static_cast<std::uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
    }
    if (magnitude <= 0x33000000u) return static_cast<std::uint16_t>(sign);  // <= 2^-25: ties to 0
    // Subnormal: significand * 2^-24 with the 24-bit fp32 significand shifted
    // right by 126 - exponent (14..24 bits), rounded to nearest even.
    const std::uint32_t exponent = magnitude >> 23;
    const std::uint32_t full = (magnitude & 0x7fffffu) | 0x800000u, shift = 126 - exponent;
    std::uint32_t kept = full >> shift;
    const std::uint32_t dropped = full & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (dropped > half || (dropped == half && (kept & 1u))) ++kept;  // 0x400: the least normal
    return static_cast<std::uint16_t>(sign | kept);
  }
  std::uint16_t bits_;
};

static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>);
static_assert(sizeof(float16) == 2 && std::is_trivially_copyable_v<float16>);

/// The 16-bit activation types: read and written by the CPU kernels'
/// half-precision entry points (serving/half_precision.hpp), summed in fp32.
template <class T>
concept HalfFloat = std::same_as<std::remove_const_t<T>, bfloat16> ||
                    std::same_as<std::remove_const_t<T>, float16>;

/// What an activation (an input or output view) may hold.
template <class T>
concept Activation = Real<T> || HalfFloat<T>;

/// The type an activation type is computed (summed, kept in states) in.
template <Activation T>
using compute_type_t = std::conditional_t<HalfFloat<T>, float, std::remove_const_t<T>>;

template <HalfFloat T>
constexpr const char* half_dtype_name() noexcept {
  if constexpr (std::same_as<std::remove_const_t<T>, bfloat16>) return "bfloat16";
  else return "float16";
}

}  // namespace latte
