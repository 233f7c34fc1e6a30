#pragma once
// latte::bf16_products: permission, given after exec::cpu, for the bidirectional
// Latte forward over bf16 activations to round the operands of its two
// contractions (paper 000 eq. 7: M = E^T V and O = G M) to bf16 and multiply
// them with AVX-512 BF16 dot products, every sum still in fp32:
//
//   attention.forward(latte::exec::cpu, latte::bf16_products, q, k, v, out);
//
// The trade cuBLAS makes with CUBLAS_COMPUTE_32F_FAST_16BF and FlashAttention
// with its bf16 P V product: about twice the multiply-adds per instruction for
// an error of a few bf16 roundings of the values' magnitude, on top of the
// output's own rounding (docs/numerics.md, "bf16 products", states the bound
// and tests/test_half_precision.cpp checks it). Where the compiler does not
// target AVX-512 BF16 (cpu::bf16_products_available), the exact kernels run:
// the same call, within the tighter bound of 16-bit activations.
namespace latte {

/// The tag type of latte::bf16_products.
struct Bf16Products {
  static constexpr const char* name = "bf16-products";
};

inline constexpr Bf16Products bf16_products{};

}  // namespace latte
