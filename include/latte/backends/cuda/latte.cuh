#pragma once
// CUDA kernels for Latte (paper 000 §2, DESIGN §3.2 and §5) with the RunningMax
// stabiliser (paper 000 App. B.2) and optional VAPOR (App. B.3).
//
// Symbols follow paper 000: q (query latent logits), k (key latent logits),
// v (values), alpha (normaliser), vtilde (latent memory), m (running maximum).
// Inputs fp32 / fp16 / bf16; every sum is fp32.
//
// Causal forward, per (batch, head), chunks of C tokens:
//   1. latte_chunk_states: each chunk's local state relative to its own maximum,
//      m_c = max_s k_s, alpha_c = sum_s exp(k_s - m_c), vtilde_c = sum_s exp(k_s - m_c) R^{-s} v_s.
//   2. latte_scan: the state entering every chunk, combining states with
//      eq. 21 in chunk form (m = max(m1, m2), sums rescaled by exp(m_i - m)).
//   3. latte_chunk_outputs: for t in the chunk,
//      o_t = R^t sum_l p(l|t) [exp(m_in - r) vtilde_in + sum_{c0<=s<=t} exp(k_s - r) R^{-s} v_s]
//                             / [exp(m_in - r) alpha_in + sum_{c0<=s<=t} exp(k_s - r)]
//      where any reference r gives the same ratio. A latent whose logits in the
//      chunk stay within kSafeSpread of the first running maximum uses the chunk's
//      final maximum M (then exp(k_s - M) is one C x L matrix and the chunk is
//      GEMM-shaped: A = W E^T masked, o = G vtilde_in + A V); a latent with a wider
//      spread falls back to the running maximum m_t of every row (exact for spreads
//      of 1e4, as in the sequential recurrence).
// Bidirectional: steps 1-2 give the state of the whole sequence; latte_read reads it.
// Decode: latte_step_kernel, one token per call, state in device memory.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "latte/backends/cuda/device.cuh"
#include "latte/backends/cuda/launch_plan.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/policies/positional.hpp"

namespace latte::cuda {

/// The decode state of causal Latte in device memory, in LatteState<float>'s
/// layout (so a host state's fields can be copied in and out as they are):
/// running_max [B, H, L], normaliser [B, H, L], memory [B, H, L, Dv], the sums
/// stored scaled by exp(-running_max). An empty state is (-inf, 0, 0).
struct LatteDeviceCarry {
  float* running_max = nullptr;
  float* normaliser = nullptr;
  float* memory = nullptr;
};

/// A chunk whose logits for a latent climb more than this above the running
/// maximum at its first token takes the per-row path: exp(-60) ~ 1e-26 is still
/// a normal float, so with the chunk maximum as reference every row keeps its
/// largest term normal and its relative precision.
inline constexpr float kSafeSpread = 60.0f;

namespace kernels {

/// Vs[s][d] = (R^{sign * position(s)} v_s)_d for the rows of a chunk; rows past
/// `rows` are zero. Pairs (2i, 2i+1) turn together; an odd last feature does not.
template <class T, bool Vapor>
__device__ void load_values(float* Vs, View4<const T> v, long long b, long long h, long long t0,
                            int rows, int C, int Dv, long long position0, const double* theta,
                            int sign) {
  const int slots = (Dv + 1) / 2;
  for (int i = threadIdx.x; i < C * slots; i += blockDim.x) {
    const int s = i / slots, p = i % slots, d = 2 * p;
    const bool pair = d + 1 < Dv;
    float x = 0.f, y = 0.f;
    if (s < rows) {
      const T* row = v.row(b, t0 + s, h);
      x = to_float(row[d]);
      if (pair) y = to_float(row[d + 1]);
      if constexpr (Vapor) {
        if (pair) rotate_pair(x, y, sign * (position0 + t0 + s), theta[p]);  // eq. 22
      }
    }
    Vs[s * Dv + d] = x;
    if (pair) Vs[s * Dv + d + 1] = y;
  }
}

/// p(l|t) = softmax_l(q_t) in place for `count` rows of stride `stride` (paper 000
/// eq. 9); a row whose logits are all -inf becomes zero (it reads nothing).
__device__ inline void softmax_rows(float* P, int count, int L, int stride) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int t = warp; t < count; t += warps) {
    float* p = P + t * stride;
    float top = kNegInf;
    for (int l = lane; l < L; l += 32) top = fmaxf(top, p[l]);
    top = warp_max(top);
    if (top == kNegInf) {
      for (int l = lane; l < L; l += 32) p[l] = 0.f;
      continue;
    }
    float total = 0.f;
    for (int l = lane; l < L; l += 32) {
      const float e = expf(p[l] - top);
      p[l] = e;
      total += e;
    }
    total = warp_sum(total);
    const float inverse = 1.f / total;
    for (int l = lane; l < L; l += 32) p[l] *= inverse;
  }
}

/// Step 1: the local state of chunk blockIdx.x of head (blockIdx.z, blockIdx.y).
template <class T, bool Vapor>
__global__ void __launch_bounds__(kBlockThreads)
    latte_chunk_states(View4<const T> k, View4<const T> v, long long Tn, int L, int Dv, int C,
                       long long first_position, const double* theta, float* ws_m_local,
                       float* ws_alpha, float* ws_mem) {
  float* const smem = dynamic_shared_floats();
  float* Ks = smem;        // [C][L]: k, then exp(k - m_c)
  float* Vs = Ks + C * L;  // [C][Dv]: R^{-s} v_s
  const int c = blockIdx.x, chunks = gridDim.x;
  const long long h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const long long t0 = static_cast<long long>(c) * C;
  const int rows = static_cast<int>(Tn - t0 < C ? Tn - t0 : C);
  for (int i = threadIdx.x; i < C * L; i += blockDim.x) {
    const int s = i / L, l = i % L;
    Ks[i] = s < rows ? to_float(k.row(b, t0 + s, h)[l]) : kNegInf;
  }
  load_values<T, Vapor>(Vs, v, b, h, t0, rows, C, Dv, first_position,
                        Vapor ? theta + h * (Dv / 2) : nullptr, -1);
  __syncthreads();
  const long long base = ((b * H + h) * chunks + c) * L;
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    float m_c = kNegInf;
    for (int s = 0; s < rows; ++s) m_c = fmaxf(m_c, Ks[s * L + l]);
    float alpha = 0.f;
    for (int s = 0; s < C; ++s) {
      const float logit = Ks[s * L + l];
      const float e = logit == kNegInf ? 0.f : expf(logit - m_c);  // finite logit => finite m_c
      Ks[s * L + l] = e;
      alpha += e;
    }
    ws_m_local[base + l] = m_c;
    ws_alpha[base + l] = alpha;
  }
  __syncthreads();
  float* memory = ws_mem + base * Dv;
  for (int i = threadIdx.x; i < L * Dv; i += blockDim.x) {
    const int l = i / Dv, d = i % Dv;
    float acc = 0.f;
    for (int s = 0; s < rows; ++s) acc = fmaf(Ks[s * L + l], Vs[s * Dv + d], acc);
    memory[i] = acc;
  }
}

/// Step 2: one thread per (latent, feature or normaliser) of a head scans the
/// chunks in order, replacing each chunk's local sums by the state entering it
/// (and writing the entering maximum to ws_m_in). `init` (nullable) is the state
/// before the first chunk; the final maximum goes to `final_max`, the final sums
/// to final_alpha / final_memory when they are not null (they may alias init's:
/// each element is read and written by one thread only).
__global__ void __launch_bounds__(kBlockThreads)
    latte_scan(int L, int Dv, int chunks, const float* ws_m_local, float* ws_m_in,
               float* ws_alpha, float* ws_mem, LatteDeviceCarry init, float* final_max,
               float* final_alpha, float* final_memory) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= L * (Dv + 1)) return;
  const long long h = blockIdx.y, b = blockIdx.z, H = gridDim.y, head = b * H + h;
  const int l = i / (Dv + 1), d = i % (Dv + 1);
  const bool is_alpha = d == Dv;
  float m = kNegInf, x = 0.f;
  if (init.running_max != nullptr) {
    m = init.running_max[head * L + l];
    x = is_alpha ? init.normaliser[head * L + l] : init.memory[(head * L + l) * Dv + d];
  }
  for (int c = 0; c < chunks; ++c) {
    const long long at = (head * chunks + c) * L + l;
    const float m_c = ws_m_local[at];
    float* slot = is_alpha ? ws_alpha + at : ws_mem + at * Dv + d;
    const float x_c = *slot;
    *slot = x;
    if (is_alpha) ws_m_in[at] = m;
    const float m_new = fmaxf(m, m_c);
    if (m_new != kNegInf) {  // eq. 21 for a whole chunk; exp(-inf) = 0 drops an empty side
      x = x * expf(m - m_new) + x_c * expf(m_c - m_new);
      m = m_new;
    }
  }
  if (is_alpha) {
    final_max[head * L + l] = m;
    if (final_alpha != nullptr) final_alpha[head * L + l] = x;
  } else if (final_memory != nullptr) {
    final_memory[(head * L + l) * Dv + d] = x;
  }
}

/// Step 3: the outputs of chunk blockIdx.x from the state entering it.
template <class T, bool Vapor>
__global__ void __launch_bounds__(kBlockThreads)
    latte_chunk_outputs(View4<const T> q, View4<const T> k, View4<const T> v, View4<T> out,
                        long long Tn, int L, int Dv, int C, long long first_position,
                        const double* theta, const float* ws_m_in, const float* ws_alpha,
                        const float* ws_mem) {
  float* const smem = dynamic_shared_floats();
  const int LP = L + 1;           // padded row stride
  float* Ks = smem;               // [C][LP]: k, then E = exp(k - M) for safe latents
  float* W = Ks + C * LP;         // [C][LP]: p(l|t), then p(l|t) / den_{t,l}
  float* Ref = W + C * LP;        // [C][LP]: row maximum (unsafe latents), then G
  float* Vs = Ref + C * LP;       // [C][Dv]: R^{-s} v_s
  float* A = Vs + C * Dv;         // [C][C]: masked within-chunk attention
  float* memory_in = A + C * C;   // [L][Dv]: vtilde entering the chunk
  float* m_in = memory_in + L * Dv;
  float* alpha_in = m_in + L;
  float* safe = alpha_in + L;
  float* unused = safe + L;
  (void)unused;
  const int c = blockIdx.x, chunks = gridDim.x;
  const long long h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const long long t0 = static_cast<long long>(c) * C;
  const int rows = static_cast<int>(Tn - t0 < C ? Tn - t0 : C);
  const long long base = ((b * H + h) * chunks + c) * L;
  const double* head_theta = Vapor ? theta + h * (Dv / 2) : nullptr;

  for (int i = threadIdx.x; i < C * L; i += blockDim.x) {
    const int s = i / L, l = i % L;
    const bool valid = s < rows;
    Ks[s * LP + l] = valid ? to_float(k.row(b, t0 + s, h)[l]) : kNegInf;
    W[s * LP + l] = valid ? to_float(q.row(b, t0 + s, h)[l]) : 0.f;
  }
  load_values<T, Vapor>(Vs, v, b, h, t0, rows, C, Dv, first_position, head_theta, -1);
  for (int i = threadIdx.x; i < L * Dv; i += blockDim.x) memory_in[i] = ws_mem[base * Dv + i];
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    m_in[l] = ws_m_in[base + l];
    alpha_in[l] = ws_alpha[base + l];
  }
  __syncthreads();
  softmax_rows(W, C, L, LP);
  __syncthreads();

  // Per latent: the reference, den_{t,l} and W = p(l|t) / den_{t,l} (eqs. 10-11).
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    const float mi = m_in[l], ai = alpha_in[l];
    float m_c = kNegInf;
    for (int s = 0; s < rows; ++s) m_c = fmaxf(m_c, Ks[s * LP + l]);
    const float M = fmaxf(mi, m_c);
    const float first = fmaxf(mi, Ks[l]);  // running maximum at the chunk's first row
    const bool is_safe = M == kNegInf || M - first <= kSafeSpread;
    safe[l] = is_safe ? 1.f : 0.f;
    if (is_safe) {
      const float carry = mi == kNegInf ? 0.f : expf(mi - M);
      float den = carry * ai;
      for (int t = 0; t < C; ++t) {
        const float logit = Ks[t * LP + l];
        const float e = logit == kNegInf ? 0.f : expf(logit - M);
        Ks[t * LP + l] = e;
        den += e;
        const float w = den > 0.f ? W[t * LP + l] / den : 0.f;  // empty latent: nothing
        W[t * LP + l] = w;
        Ref[t * LP + l] = w * carry;  // G_{t,l}: weight of the incoming memory
      }
    } else {
      float m = mi, den = ai;  // eq. 21 row by row
      for (int t = 0; t < C; ++t) {
        const float logit = Ks[t * LP + l];
        const float m_new = fmaxf(m, logit);
        if (m_new == kNegInf) {
          W[t * LP + l] = 0.f;
          Ref[t * LP + l] = kNegInf;
          continue;
        }
        den = den * expf(m - m_new) + (logit == kNegInf ? 0.f : expf(logit - m_new));
        m = m_new;
        W[t * LP + l] = W[t * LP + l] / den;
        Ref[t * LP + l] = m;
      }
    }
  }
  __syncthreads();

  // A[t][s] = sum_l W_{t,l} exp(k_{s,l} - r_{t,l}) for s <= t.
  for (int i = threadIdx.x; i < C * C; i += blockDim.x) {
    const int t = i / C, s = i % C;
    float a = 0.f;
    if (s <= t && t < rows) {
      for (int l = 0; l < L; ++l) {
        const float w = W[t * LP + l];
        if (safe[l] != 0.f) {
          a = fmaf(w, Ks[s * LP + l], a);
        } else if (w != 0.f) {
          const float logit = Ks[s * LP + l];
          if (logit != kNegInf) a = fmaf(w, expf(logit - Ref[t * LP + l]), a);
        }
      }
    }
    A[i] = a;
  }
  __syncthreads();
  // G_{t,l} = W_{t,l} exp(m_in - m_t) for the per-row latents.
  for (int i = threadIdx.x; i < C * L; i += blockDim.x) {
    const int t = i / L, l = i % L;
    if (safe[l] != 0.f) continue;
    const float w = W[t * LP + l], mi = m_in[l];
    Ref[t * LP + l] = (w == 0.f || mi == kNegInf) ? 0.f : w * expf(mi - Ref[t * LP + l]);
  }
  __syncthreads();

  // o_t = R^t (G_t vtilde_in + A_t V) (eq. 22).
  const int slots = (Dv + 1) / 2;
  for (int i = threadIdx.x; i < rows * slots; i += blockDim.x) {
    const int t = i / slots, p = i % slots, d = 2 * p;
    const bool pair = d + 1 < Dv;
    float x = 0.f, y = 0.f;
    for (int l = 0; l < L; ++l) {
      const float g = Ref[t * LP + l];
      x = fmaf(g, memory_in[l * Dv + d], x);
      if (pair) y = fmaf(g, memory_in[l * Dv + d + 1], y);
    }
    for (int s = 0; s <= t; ++s) {
      const float a = A[t * C + s];
      x = fmaf(a, Vs[s * Dv + d], x);
      if (pair) y = fmaf(a, Vs[s * Dv + d + 1], y);
    }
    if constexpr (Vapor) {
      if (pair) rotate_pair(x, y, first_position + t0 + t, head_theta[p]);
    }
    T* o = out.row(b, t0 + t, h);
    o[d] = from_float<T>(x);
    if (pair) o[d + 1] = from_float<T>(y);
  }
}

/// Bidirectional read-out (paper 000 eqs. 5-7): o_t = R^{f+t} sum_l p(l|t) vtilde_l / alpha_l
/// over the state of the whole sequence, at the absolute positions f + t that
/// latte_chunk_states rotated the values by (R^{-(f+s)}), so o_t sees R^{t-s} v_s for any
/// first position f; a latent with alpha = 0 adds nothing.
template <class T, bool Vapor>
__global__ void __launch_bounds__(kBlockThreads)
    latte_read(View4<const T> q, View4<T> out, long long Tn, int L, int Dv, int C,
               long long first_position, const double* theta, const float* alpha,
               const float* memory) {
  float* const smem = dynamic_shared_floats();
  float* P = smem;             // [C][L]
  float* ratio = P + C * L;    // [L][Dv]: vtilde / alpha
  const long long h = blockIdx.y, b = blockIdx.z, H = gridDim.y, head = b * H + h;
  const long long t0 = static_cast<long long>(blockIdx.x) * C;
  const int rows = static_cast<int>(Tn - t0 < C ? Tn - t0 : C);
  for (int i = threadIdx.x; i < C * L; i += blockDim.x) {
    const int s = i / L, l = i % L;
    P[i] = s < rows ? to_float(q.row(b, t0 + s, h)[l]) : 0.f;
  }
  for (int i = threadIdx.x; i < L * Dv; i += blockDim.x) {
    const float a = alpha[head * L + i / Dv];
    ratio[i] = a == 0.f ? 0.f : memory[head * L * Dv + i] / a;
  }
  __syncthreads();
  softmax_rows(P, C, L, L);
  __syncthreads();
  const double* head_theta = Vapor ? theta + h * (Dv / 2) : nullptr;
  const int slots = (Dv + 1) / 2;
  for (int i = threadIdx.x; i < rows * slots; i += blockDim.x) {
    const int t = i / slots, p = i % slots, d = 2 * p;
    const bool pair = d + 1 < Dv;
    float x = 0.f, y = 0.f;
    for (int l = 0; l < L; ++l) {
      const float w = P[t * L + l];
      x = fmaf(w, ratio[l * Dv + d], x);
      if (pair) y = fmaf(w, ratio[l * Dv + d + 1], y);
    }
    if constexpr (Vapor) {
      if (pair) rotate_pair(x, y, first_position + t0 + t, head_theta[p]);  // eq. 22
    }
    T* o = out.row(b, t0 + t, h);
    o[d] = from_float<T>(x);
    if (pair) o[d + 1] = from_float<T>(y);
  }
}

/// One decode step of causal Latte for head (blockIdx.y, blockIdx.x) at absolute
/// `position` (paper 000 eqs. 12 and 21, VAPOR eq. 22), the state updated in place.
template <class T, bool Vapor>
__global__ void __launch_bounds__(kBlockThreads)
    latte_step_kernel(View4<const T> q, View4<const T> k, View4<const T> v, View4<T> out, int L,
                      int Dv, long long position, const double* theta, LatteDeviceCarry state) {
  float* const smem = dynamic_shared_floats();
  float* qs = smem;              // [L]
  float* carry_scale = qs + L;   // [L]
  float* weight = carry_scale + L;
  float* gamma = weight + L;
  float* reduced = gamma + L;    // [2]: max and sum of the query logits
  float* rotated = reduced + 2;  // [Dv]: R^{-t} v_t
  float* o = rotated + Dv;       // [Dv]
  const long long h = blockIdx.x, b = blockIdx.y, H = gridDim.x, head = b * H + h;
  float* m = state.running_max + head * L;
  float* alpha = state.normaliser + head * L;
  float* memory = state.memory + head * L * Dv;
  const T* q_row = q.row(b, 0, h);
  const T* k_row = k.row(b, 0, h);
  const double* head_theta = Vapor ? theta + h * (Dv / 2) : nullptr;
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    const float logit = to_float(k_row[l]), previous = m[l];
    const float updated = fmaxf(previous, logit);
    float scale = 1.f, w = 0.f;  // nothing but -inf so far: the sums stay empty
    if (updated != kNegInf) {
      scale = expf(previous - updated);  // eq. 21
      w = expf(logit - updated);
      m[l] = updated;
    }
    carry_scale[l] = scale;
    weight[l] = w;
    alpha[l] = alpha[l] * scale + w;
    qs[l] = to_float(q_row[l]);
  }
  load_values<T, Vapor>(rotated, v, b, h, 0, 1, 1, Dv, position, head_theta, -1);
  __syncthreads();
  for (int i = threadIdx.x; i < L * Dv; i += blockDim.x) {
    const int l = i / Dv, d = i % Dv;
    memory[i] = memory[i] * carry_scale[l] + weight[l] * rotated[d];
  }
  if (threadIdx.x < 32) {
    float top = kNegInf;
    for (int l = threadIdx.x; l < L; l += 32) top = fmaxf(top, qs[l]);
    top = warp_max(top);
    float total = 0.f;
    if (top != kNegInf)
      for (int l = threadIdx.x; l < L; l += 32) total += expf(qs[l] - top);
    total = warp_sum(total);
    if (threadIdx.x == 0) {
      reduced[0] = top;
      reduced[1] = total;
    }
  }
  __syncthreads();
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    const float top = reduced[0];
    gamma[l] = (top == kNegInf || alpha[l] == 0.f)
                   ? 0.f
                   : expf(qs[l] - top) / (reduced[1] * alpha[l]);  // eq. 11
  }
  __syncthreads();
  for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
    float acc = 0.f;
    for (int l = 0; l < L; ++l) acc = fmaf(gamma[l], memory[l * Dv + d], acc);
    o[d] = acc;
  }
  __syncthreads();
  T* out_row = out.row(b, 0, h);
  const int slots = (Dv + 1) / 2;
  for (int p = threadIdx.x; p < slots; p += blockDim.x) {
    const int d = 2 * p;
    const bool pair = d + 1 < Dv;
    float x = o[d], y = pair ? o[d + 1] : 0.f;
    if constexpr (Vapor) {
      if (pair) rotate_pair(x, y, position, head_theta[p]);  // R^t
    }
    out_row[d] = from_float<T>(x);
    if (pair) out_row[d + 1] = from_float<T>(y);
  }
}

}  // namespace kernels

template <class Kernel>
void allow_shared_memory(Kernel kernel, std::size_t bytes) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes)),
        "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
}

/// Whole-sequence Latte on `stream` over validated [B, T, H, *] views of device
/// memory. `angles` is VAPOR's host table [H * Dv/2] (empty otherwise). Causal:
/// starts from `carry` at absolute position `first_position` and leaves the final
/// state there when carry.running_max is not null (else starts empty). Workspace:
/// B H ceil(T/C) L (Dv + 3) floats, stream-ordered, freed when the work is done.
template <bool Causal, Positional Pos, DeviceElement T>
void latte_forward(cudaStream_t stream, TensorView<const T, 4> q, TensorView<const T, 4> k,
                   TensorView<const T, 4> v, TensorView<T, 4> out,
                   const std::vector<double>& angles, long long first_position = 0,
                   LatteDeviceCarry carry = {}) {
  constexpr bool vapor = Pos::rotates_values;
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), L = q.extent(3);
  const index_t Dv = v.extent(3);
  if (B == 0 || Tn == 0) return;
  const LattePlan plan = plan_latte(B, Tn, H, L, Dv, shared_memory_limit());
  const std::size_t per_chunk_vectors = static_cast<std::size_t>(B * H * plan.chunks * L);
  const std::size_t head_vectors = static_cast<std::size_t>(B * H * L);
  // ws_m_local, ws_m_in, ws_alpha, ws_mem | final max, alpha, memory
  Workspace<float> workspace(plan.workspace_floats + head_vectors * (2 + Dv), stream);
  float* ws_m_local = workspace.data();
  float* ws_m_in = ws_m_local + per_chunk_vectors;
  float* ws_alpha = ws_m_in + per_chunk_vectors;
  float* ws_mem = ws_alpha + per_chunk_vectors;
  float* final_max = ws_mem + per_chunk_vectors * Dv;
  float* final_alpha = final_max + head_vectors;
  float* final_memory = final_alpha + head_vectors;
  Workspace<double> theta(vapor ? angles : std::vector<double>{}, stream);

  const auto qd = device_view(q), kd = device_view(k), vd = device_view(v);
  const auto od = device_view(out);
  const int Li = static_cast<int>(L), Dvi = static_cast<int>(Dv), C = static_cast<int>(plan.chunk);
  const dim3 chunk_grid(plan.chunk_grid.x, plan.chunk_grid.y, plan.chunk_grid.z);
  const dim3 scan_grid(plan.scan_grid.x, plan.scan_grid.y, plan.scan_grid.z);

  auto states = kernels::latte_chunk_states<T, vapor>;
  allow_shared_memory(states, plan.states_smem);
  launch(states, chunk_grid, kBlockThreads, plan.states_smem, stream,
      kd, vd, Tn, Li, Dvi, C, first_position, theta.data(), ws_m_local, ws_alpha, ws_mem);
  check_launch("latte_chunk_states");

  const bool continues = Causal && carry.running_max != nullptr;
  launch(kernels::latte_scan, scan_grid, kBlockThreads, 0, stream,
      Li, Dvi, static_cast<int>(plan.chunks), ws_m_local, ws_m_in, ws_alpha, ws_mem,
      continues ? carry : LatteDeviceCarry{}, final_max,
      continues ? carry.normaliser : final_alpha, continues ? carry.memory : final_memory);
  check_launch("latte_scan");
  if (continues)  // the maximum is read by every thread of its latent: written back after
    check(cudaMemcpyAsync(carry.running_max, final_max, head_vectors * sizeof(float),
                          cudaMemcpyDeviceToDevice, stream),
          "cudaMemcpyAsync of the final running maximum");

  if constexpr (Causal) {
    auto outputs = kernels::latte_chunk_outputs<T, vapor>;
    allow_shared_memory(outputs, plan.outputs_smem);
    launch(outputs, chunk_grid, kBlockThreads, plan.outputs_smem, stream,
        qd, kd, vd, od, Tn, Li, Dvi, C, first_position, theta.data(), ws_m_in, ws_alpha, ws_mem);
    check_launch("latte_chunk_outputs");
  } else {
    auto read = kernels::latte_read<T, vapor>;
    allow_shared_memory(read, plan.read_smem);
    launch(read, chunk_grid, kBlockThreads, plan.read_smem, stream,
        qd, od, Tn, Li, Dvi, C, first_position, theta.data(), final_alpha, final_memory);
    check_launch("latte_read");
  }
}

/// One decode step over [B, H, *] device views at absolute `position`, updating
/// `state` (LatteDeviceCarry layout, B x H heads) in place. `device_theta` is
/// VAPOR's angle table [H, Dv/2] already in device memory (null without VAPOR),
/// so that a step copies nothing from the host.
template <Positional Pos, DeviceElement T>
void latte_step(cudaStream_t stream, TensorView<const T, 3> q, TensorView<const T, 3> k,
                TensorView<const T, 3> v, TensorView<T, 3> out, const double* device_theta,
                long long position, LatteDeviceCarry state) {
  const index_t B = q.extent(0), H = q.extent(1), L = q.extent(2), Dv = v.extent(2);
  detail::check_shape(q, "query_logits", {B, H, L}, "[B, H, L]");
  detail::check_shape(k, "key_logits", {B, H, L}, "[B, H, L]");
  detail::check_shape(v, "values", {B, H, Dv}, "[B, H, Dv]");
  detail::check_shape(out, "out", {B, H, Dv}, "[B, H, Dv]");
  detail::require(state.running_max && state.normaliser && state.memory, "state",
                  "a device state needs running_max, normaliser and memory pointers");
  detail::require(!Pos::rotates_values || device_theta != nullptr, "angles",
                  "VAPOR needs the device angle table [H, Dv/2]");
  if (B == 0) return;
  const Dim3 grid = plan_step(B, H);
  const std::size_t smem = latte_step_floats(L, Dv) * sizeof(float);
  auto step = kernels::latte_step_kernel<T, Pos::rotates_values>;
  allow_shared_memory(step, smem);
  launch(step, dim3(grid.x, grid.y, grid.z), kBlockThreads, smem, stream,
      device_view(q), device_view(k), device_view(v), device_view(out), static_cast<int>(L),
      static_cast<int>(Dv), position, device_theta, state);
  check_launch("latte_step_kernel");
}

}  // namespace latte::cuda
