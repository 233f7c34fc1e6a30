// latte-sweep: the CPU kernels over a grid of shapes, fp32 and fp64, against this
// machine's limits (the FMA peak of each type and the memory bandwidth).
// scripts/shape-sweep.sh builds it, runs it and draws the heat maps
// (bench/plot_sweep.py).
//
//   latte-sweep [--budget-minutes M] [--seed S] [--min-time S] [--only NAME,...] [--smoke]
//
// Grid: B in {1, 4, 8}, H in {1, 2, 8, 16, 25, 32}, L in {16, 32, 63, 64, 128, 256},
// D in {32, 64, 65, 128}, T in {1K, 8K, 64K}. Mechanisms (exec::cpu, float and double):
//   latte          causal, bidirectional   LatteAttention<Dir> (RunningMax)
//   latte_vapor    causal, bidirectional   LatteAttention<Dir, RunningMax, VAPOR> (even D only:
//                                          the D = 65 shapes have no row)
//   linear_elu     causal                  LinearAttention<Causal, EluPlusOne>, Dk = L
//   cosformer      causal                  CosFormer<Causal>, Dk = L; the L column is E = 2L
//   latte_backward causal                  LatteAttention<Causal>::backward (the required
//                                          shapes (a)-(c) only; FLOPs 2x the forward's)
//   softmax_window128 causal               SoftmaxAttention<Causal, SlidingWindow>, left = 128,
//                                          q, k [B,T,H,D]; no L: one run per (B, H, D, T),
//                                          128 in the L column
//
// Which shapes (the whole grid, 1296 shapes x 14 mechanism / type pairs, would take
// hours): for every mechanism and type
//   (a) the core shape B1 H8 L64 D64 at each T;
//   (b) the core's one-axis neighbours at T = 8K (each B, each H, each L, each D);
//   (c) all 24 (L, D) pairs at B1 H8 T8K (odd L / D next to their powers of two);
// these always run, whatever the budget. Then (d): the other grid points in an order
// drawn from --seed (each point a shape, run for every mechanism and type it suits),
// until --budget-minutes (counted from the start) is spent. A point's run for one
// mechanism and type is left out when its tensors need more than 3 GiB or one call,
// at half the type's FMA peak, would take more than 1.5 s; a point whose predicted
// cost (warm-up and repeats) no longer fits in the budget left is passed over.
// --smoke: (a) at T = 1K and 3 random points (at each, only the pairs whose call is
// predicted under 2 ms), --min-time 0.02 unless given (CI: a few seconds).
// Inputs: uniform in [-sqrt 3, sqrt 3) (variance 1, as latte-compare's normal ones),
// drawn from --seed.
//
// CSV on stdout, written when the sweep ends; one progress line per row on stderr:
//   mechanism,direction,backend,dtype,B,T,H,L,D,seconds,tokens_per_s,gflops,min_bytes,
//   roofline_gflops
// Machine rows first (backend `machine`; the value in the gflops column, as
// latte-compare's fma_peak row): `threads` (OpenMP threads), `fma_peak` (fp32 FMA
// throughput, all threads, GFLOP/s), `fma_peak_fp64`, `memory_bandwidth` (GB/s);
// each the best of the samples taken before and after the sweep.
//
// Each row's time is the best of its repeats after one warm-up call (at least two
// repeats, until --min-time is spent; one when a call takes more than 2 s).
// FLOPs (multiply-add = 2), as latte-compare:
//   latte, latte_vapor:      4 * B*T*H*L*D
//   latte_backward:          8 * B*T*H*L*D (2x the forward, no credit for recomputing)
//   linear_elu, cosformer:   B*T*H*(4*E*D + 3*E), E = L (elu+1), 2L (cosFormer)
//   softmax_window128:       2 * B*H*sum_t min(t+1, 129) * (D + D)
// min_bytes: what one call must at least move, its inputs read once and its output
// written once: B*T*H*(2L + 2D)*sizeof(T) (Latte and the linear family, Dk = L: the
// inputs' own L, not cosFormer's E), B*T*H*4D*sizeof(T) (softmax),
// B*T*H*(4L + 3D)*sizeof(T) (the backward: q, k, v, d_out in, d_q, d_k, d_v out).
// roofline_gflops = min(the type's FMA peak, flops / min_bytes * memory bandwidth).
#include <latte/attention.hpp>

#include "fma_peak.hpp"
#include "name_filter.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using latte::index_t;
using Clock = std::chrono::steady_clock;

constexpr std::array<index_t, 3> grid_B{1, 4, 8};
constexpr std::array<index_t, 6> grid_H{1, 2, 8, 16, 25, 32};
constexpr std::array<index_t, 6> grid_L{16, 32, 63, 64, 128, 256};
constexpr std::array<index_t, 4> grid_D{32, 64, 65, 128};
constexpr std::array<index_t, 3> grid_T{1024, 8192, 65536};
constexpr index_t window = 128;

constexpr double max_tensor_bytes = 3.0 * 1024 * 1024 * 1024;  // random points: tensors per call
constexpr double max_call_seconds = 1.5;  // random points: one call at half the FMA peak
constexpr double smoke_call_seconds = 0.002;

struct Options {
  double budget_minutes = 30;
  std::uint64_t seed = 1;
  double min_time = 0.2;
  bool min_time_given = false;
  bool smoke = false;
  latte::bench::NameFilter only;

  [[nodiscard]] bool wanted(const std::string& mechanism) const { return only.wanted(mechanism); }
};

struct Shape {
  index_t B, T, H, L, D;
  auto operator<=>(const Shape&) const = default;
};

struct Row {
  std::string mechanism, direction, backend, dtype;
  index_t B, T, H, L, D;
  double seconds, flops, min_bytes;
};

struct Machine {
  int threads = 1;
  double peak32 = 0, peak64 = 0;  // GFLOP/s
  double bandwidth = 0;           // GB/s
  template <class T>
  [[nodiscard]] double peak() const {
    return sizeof(T) == 4 ? peak32 : peak64;
  }
};

double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// Best-of-repeats wall time of f(), after one warm-up call.
double measure(const std::function<void()>& f, double min_time) {
  const auto warm = Clock::now();
  f();
  if (since(warm) > 2.0) min_time = 0;  // long calls: the repeats below stop at two
  double best = 1e300, spent = 0;
  for (int run = 0; run < 1000 && (run < 2 || spent < min_time); ++run) {
    const auto start = Clock::now();
    f();
    const double seconds = since(start);
    best = std::min(best, seconds);
    spent += seconds;
    if (seconds > 2.0) break;  // one timed repeat is enough
  }
  return best;
}

/// This machine's memory bandwidth with every thread (GB/s): a STREAM triad,
/// a[i] = b[i] + s * c[i] over three arrays of 256 MiB of doubles, the best of
/// `passes`. Bytes counted: the three arrays once each (STREAM's convention: the
/// write-allocate read of `a` a cache would add is not counted).
double memory_bandwidth_gbs(int passes) {
  const std::int64_t n = std::int64_t{32} << 20;  // 32 Mi doubles = 256 MiB per array
  const std::unique_ptr<double[]> a(new double[static_cast<std::size_t>(n)]);
  const std::unique_ptr<double[]> b(new double[static_cast<std::size_t>(n)]);
  const std::unique_ptr<double[]> c(new double[static_cast<std::size_t>(n)]);
  double* pa = a.get();
  double* pb = b.get();
  double* pc = c.get();
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {  // first touch by the threads that stream them
    pa[i] = 0;
    pb[i] = 1.0 + double(i % 7);
    pc[i] = 2.0 - double(i % 5);
  }
  double best = 1e300;
  const double s = 0.5;
  for (int pass = 0; pass < passes; ++pass) {
    const auto start = Clock::now();
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) pa[i] = pb[i] + s * pc[i];
    best = std::min(best, since(start));
  }
  if (pa[n / 3] == -1.0) std::fprintf(stderr, " ");  // keeps the stores
  return 3.0 * double(n) * sizeof(double) / best / 1e9;
}

void sample_machine(Machine& machine, bool smoke) {
  machine.peak32 = std::max(machine.peak32, latte::bench::fma_peak_gflops<float>(smoke ? 3 : 8));
  machine.peak64 = std::max(machine.peak64, latte::bench::fma_peak_gflops<double>(smoke ? 3 : 8));
  machine.bandwidth = std::max(machine.bandwidth, memory_bandwidth_gbs(smoke ? 3 : 10));
}

std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// A tensor of uniform values in [-sqrt 3, sqrt 3) (variance 1), the same for a
/// seed whatever the thread count; filled by the threads (large shapes).
template <class T, std::size_t N>
latte::Tensor<T, N> random_tensor(std::uint64_t seed, const std::array<index_t, N>& extents) {
  latte::Tensor<T, N> x(extents);
  T* p = x.data();
  const index_t n = x.size();
  const std::uint64_t key = splitmix64(seed);
#pragma omp parallel for schedule(static)
  for (index_t i = 0; i < n; ++i) {
    const double u = double(splitmix64(key ^ static_cast<std::uint64_t>(i)) >> 11) * 0x1.0p-53;
    p[i] = T((2 * u - 1) * 1.7320508075688772);
  }
  return x;
}

// ---- the mechanisms -----------------------------------------------------------
enum class Kind { latte, latte_vapor, linear_elu, cosformer, softmax_window, latte_backward };
struct Mechanism {
  const char* name;
  const char* direction;
  Kind kind;
  bool causal;
  bool random_points = true;  // false: the required shapes (a)-(c) only
};
// The causal Latte backward (docs/backward.md) runs on the required shapes only:
// it takes ~6x its forward's time, which the budget's cost model (every call at
// half the peak) would not foresee at random points.
constexpr std::array<Mechanism, 8> mechanisms{{
    {"latte", "causal", Kind::latte, true},
    {"latte_vapor", "causal", Kind::latte_vapor, true},
    {"latte", "bidirectional", Kind::latte, false},
    {"latte_vapor", "bidirectional", Kind::latte_vapor, false},
    {"linear_elu", "causal", Kind::linear_elu, true},
    {"cosformer", "causal", Kind::cosformer, true},
    {"softmax_window128", "causal", Kind::softmax_window, true},
    {"latte_backward", "causal", Kind::latte_backward, true, false},
}};

double flops_of(const Mechanism& m, const Shape& s) {
  const double bth = double(s.B) * double(s.T) * double(s.H);
  switch (m.kind) {
    case Kind::latte:
    case Kind::latte_vapor: return 4.0 * bth * double(s.L) * double(s.D);
    case Kind::latte_backward: return 8.0 * bth * double(s.L) * double(s.D);  // 2x the forward
    case Kind::linear_elu: return bth * (4.0 * double(s.L) * double(s.D) + 3.0 * double(s.L));
    case Kind::cosformer: {
      const double E = 2.0 * double(s.L);
      return bth * (4.0 * E * double(s.D) + 3.0 * E);
    }
    case Kind::softmax_window: {
      // sum_t min(t+1, w+1) in closed form
      const double T = double(s.T), w1 = double(window + 1);
      const double terms = T <= w1 ? T * (T + 1) / 2 : w1 * (w1 + 1) / 2 + (T - w1) * w1;
      return 2.0 * double(s.B) * double(s.H) * terms * (2.0 * double(s.D));
    }
  }
  return 0;
}

/// Elements a call reads and writes once (min_bytes / sizeof(T)).
double min_elements(const Mechanism& m, const Shape& s) {
  const double bth = double(s.B) * double(s.T) * double(s.H);
  if (m.kind == Kind::softmax_window) return bth * 4.0 * double(s.D);
  // backward: q, k, v, d_out read, d_q, d_k, d_v written
  if (m.kind == Kind::latte_backward) return bth * (4.0 * double(s.L) + 3.0 * double(s.D));
  return bth * (2.0 * double(s.L) + 2.0 * double(s.D));
}

/// Elements of the tensors this program holds for the call.
double tensor_elements(const Mechanism& m, const Shape& s) {
  const double bth = double(s.B) * double(s.T) * double(s.H);
  // q, k, v, out; softmax adds its own keys [B,T,H,D] (its queries are v).
  return bth * (2.0 * double(s.L) + 2.0 * double(s.D)) +
         (m.kind == Kind::softmax_window ? bth * double(s.D) : 0.0) +
         (m.kind == Kind::latte_backward ? bth * (2.0 * double(s.L) + 2.0 * double(s.D)) : 0.0);
}

index_t l_column(const Mechanism& m, const Shape& s) {
  if (m.kind == Kind::cosformer) return 2 * s.L;
  if (m.kind == Kind::softmax_window) return window;
  return s.L;
}

struct Sweep {
  Options options;
  Machine machine;
  Clock::time_point start = Clock::now();
  std::vector<Row> rows;
  std::set<std::tuple<int, index_t, index_t, index_t, index_t>> softmax_done;  // bytes, B, H, D, T
  std::uint64_t tensor_seed = 0;

  /// The pairs of a shape this sweep runs for type T: wanted, defined (VAPOR: even D),
  /// not run before (softmax: L does not matter) and, when `limited` (random points),
  /// within the memory and time limits.
  template <class T>
  std::vector<const Mechanism*> pairs(const Shape& s, bool limited) const {
    std::vector<const Mechanism*> chosen;
    for (const Mechanism& m : mechanisms) {
      if (!options.wanted(m.name)) continue;
      if (m.kind == Kind::latte_vapor && s.D % 2 != 0) continue;
      if (m.kind == Kind::softmax_window &&
          softmax_done.contains({int(sizeof(T)), s.B, s.H, s.D, s.T}))
        continue;
      if (limited) {
        if (!m.random_points) continue;
        if (tensor_elements(m, s) * sizeof(T) > max_tensor_bytes) continue;
        const double call = flops_of(m, s) / (0.5 * machine.peak<T>() * 1e9);
        if (call > (options.smoke ? smoke_call_seconds : max_call_seconds)) continue;
      }
      chosen.push_back(&m);
    }
    return chosen;
  }

  /// Predicted seconds to run these pairs: filling the tensors, a warm-up call
  /// and the repeats, each call at half the type's FMA peak.
  template <class T>
  double predicted_cost(const Shape& s, const std::vector<const Mechanism*>& chosen) const {
    double cost = 0, elements = 0;
    for (const Mechanism* m : chosen) {
      const double call = flops_of(*m, s) / (0.5 * machine.peak<T>() * 1e9);
      cost += call + std::max(options.min_time, 2 * call);
      elements = std::max(elements, tensor_elements(*m, s));
    }
    return chosen.empty() ? 0.0 : cost + elements * 2e-9;
  }

  /// Runs the chosen pairs of a shape in type T, one row each.
  template <class T>
  void run(const Shape& s, const std::vector<const Mechanism*>& chosen) {
    if (chosen.empty()) return;
    const char* dtype = sizeof(T) == 4 ? "fp32" : "fp64";
    const index_t B = s.B, T_ = s.T, H = s.H, L = s.L, D = s.D;
    const std::uint64_t seed = options.seed * 1000003 + tensor_seed++;
    const auto is_softmax = [](const Mechanism* m) { return m->kind == Kind::softmax_window; };
    const bool softmax = std::any_of(chosen.begin(), chosen.end(), is_softmax);
    const bool latent = !std::all_of(chosen.begin(), chosen.end(), is_softmax);  // q, k [B,T,H,L]
    const std::array<index_t, 4> none{1, 1, 1, 1};
    auto q = random_tensor<T, 4>(seed * 4 + 0, latent ? std::array<index_t, 4>{B, T_, H, L} : none);
    auto k = random_tensor<T, 4>(seed * 4 + 1, latent ? std::array<index_t, 4>{B, T_, H, L} : none);
    auto v = random_tensor<T, 4>(seed * 4 + 2, {B, T_, H, D});
    latte::Tensor<T, 4> out({B, T_, H, D});
    const std::array<index_t, 4> values_shape{B, T_, H, D}, logits_shape{B, T_, H, L};
    auto softmax_keys = random_tensor<T, 4>(seed * 4 + 3, softmax ? values_shape : none);

    // One instance of each mechanism type per scalar type: the dims are runtime values.
    const latte::LatteAttention<latte::Causal> latte_causal({H, L, D});
    const latte::LatteAttention<latte::Bidirectional> latte_bidirectional({H, L, D});
    const latte::LinearAttention<latte::Causal, latte::EluPlusOne> linear({H, L, D});
    const latte::CosFormer<latte::Causal> cosformer({H, L, D});  // M = T
    const latte::SoftmaxAttention<latte::Causal, latte::SlidingWindow> softmax_window(
        {H, D, D}, {.left = window});
    using VaporCausal = latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR>;
    using VaporBidirectional =
        latte::LatteAttention<latte::Bidirectional, latte::RunningMax, latte::VAPOR>;
    std::unique_ptr<VaporCausal> vapor_causal;  // VAPOR needs an even D
    std::unique_ptr<VaporBidirectional> vapor_bidirectional;
    if (D % 2 == 0) {
      vapor_causal = std::make_unique<VaporCausal>(latte::LatteDims{H, L, D});
      vapor_bidirectional = std::make_unique<VaporBidirectional>(latte::LatteDims{H, L, D});
    }

    const bool backward = std::any_of(chosen.begin(), chosen.end(), [](const Mechanism* m) {
      return m->kind == Kind::latte_backward;
    });
    auto d_out = random_tensor<T, 4>(~(seed * 4 + 3), backward ? values_shape : none);
    latte::Tensor<T, 4> dq(backward ? logits_shape : none), dk(backward ? logits_shape : none),
        dv(backward ? values_shape : none);

    for (const Mechanism* m : chosen) {
      std::function<void()> call;
      switch (m->kind) {
        case Kind::latte:
          if (m->causal)
            call = [&] { latte_causal.forward(latte::exec::cpu, q, k, v, out.view()); };
          else
            call = [&] { latte_bidirectional.forward(latte::exec::cpu, q, k, v, out.view()); };
          break;
        case Kind::latte_vapor:
          if (m->causal)
            call = [&] { vapor_causal->forward(latte::exec::cpu, q, k, v, out.view()); };
          else
            call = [&] { vapor_bidirectional->forward(latte::exec::cpu, q, k, v, out.view()); };
          break;
        case Kind::linear_elu:
          call = [&] { linear.forward(latte::exec::cpu, q, k, v, out.view()); };
          break;
        case Kind::cosformer:
          call = [&] { cosformer.forward(latte::exec::cpu, q, k, v, out.view()); };
          break;
        case Kind::latte_backward:
          call = [&] {
            latte_causal.backward(latte::exec::cpu, q, k, v, d_out,
                                  latte::LatteGradients<T>{dq.view(), dk.view(), dv.view()});
          };
          break;
        case Kind::softmax_window:
          // queries: the values (any [B,T,H,D] tensor times the same); keys of their own
          call = [&] { softmax_window.forward(latte::exec::cpu, v, softmax_keys, v, out.view()); };
          softmax_done.insert({int(sizeof(T)), B, H, D, T_});
          break;
      }
      const double seconds = measure(call, options.min_time);
      const double flops = flops_of(*m, s);
      const double min_bytes = min_elements(*m, s) * sizeof(T);
      rows.push_back({m->name, m->direction, "latte-cpu", dtype, B, T_, H, l_column(*m, s), D,
                      seconds, flops, min_bytes});
      const double gflops = flops / seconds / 1e9;
      const double roof = std::min(machine.peak<T>(), flops / min_bytes * machine.bandwidth);
      std::fprintf(stderr,
                   "latte-sweep [%6.1f s] %-17s %-13s %s B%-2td T%-6td H%-3td L%-4td D%-4td "
                   "%10.6f s %7.1f GFLOP/s %5.1f %% of roofline\n",
                   since(start), m->name, m->direction, dtype, B, T_, H, l_column(*m, s), D,
                   seconds, gflops, 100 * gflops / roof);
    }
  }

  /// Both types of a shape; random points (`limited`) only within the limits and,
  /// unless it is a smoke run, only when the predicted cost fits in the budget left.
  /// Whether anything ran.
  bool run_shape(const Shape& s, bool limited) {
    const auto p32 = pairs<float>(s, limited);
    const auto p64 = pairs<double>(s, limited);
    if (p32.empty() && p64.empty()) return false;
    if (limited && !options.smoke) {
      const double left = options.budget_minutes * 60 - since(start);
      if (predicted_cost<float>(s, p32) + predicted_cost<double>(s, p64) > left) return false;
    }
    run<float>(s, p32);
    run<double>(s, p64);
    return true;
  }
};

/// The shapes every mechanism and type must have: (a), (c), (b) of the header,
/// in that order, each once. With `smoke`, (a) at T = 1K only.
std::vector<Shape> required_shapes(bool smoke) {
  std::vector<Shape> shapes;
  auto add = [&](const Shape& s) {
    if (std::find(shapes.begin(), shapes.end(), s) == shapes.end()) shapes.push_back(s);
  };
  constexpr index_t t8k = 8192;
  for (const index_t T : grid_T) {
    add({1, T, 8, 64, 64});
    if (smoke) return shapes;
  }
  for (const index_t L : grid_L)
    for (const index_t D : grid_D) add({1, t8k, 8, L, D});
  for (const index_t B : grid_B) add({B, t8k, 8, 64, 64});
  for (const index_t H : grid_H) add({1, t8k, H, 64, 64});
  return shapes;
}

/// Every grid point in an order drawn from `seed` (Fisher-Yates on mt19937_64, whose
/// output the standard fixes: the same order with any standard library).
std::vector<Shape> shuffled_grid(std::uint64_t seed) {
  std::vector<Shape> grid;
  for (const index_t B : grid_B)
    for (const index_t T : grid_T)
      for (const index_t H : grid_H)
        for (const index_t L : grid_L)
          for (const index_t D : grid_D) grid.push_back({B, T, H, L, D});
  std::mt19937_64 rng(seed);
  for (std::size_t i = grid.size(); i > 1; --i) std::swap(grid[i - 1], grid[rng() % i]);
  return grid;
}

[[noreturn]] void usage(const char* problem) {
  if (problem) std::fprintf(stderr, "latte-sweep: %s\n", problem);
  std::fprintf(stderr,
               "usage: latte-sweep [--budget-minutes M] [--seed S] [--min-time S] "
               "[--only NAME,...] [--smoke]\n");
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  Sweep sweep;
  Options& options = sweep.options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage((flag + " needs a value").c_str());
      return argv[++i];
    };
    try {
      if (flag == "--budget-minutes") options.budget_minutes = std::stod(value());
      else if (flag == "--seed") options.seed = std::stoull(value());
      else if (flag == "--min-time") {
        options.min_time = std::stod(value());
        options.min_time_given = true;
      } else if (flag == "--smoke") options.smoke = true;
      else if (flag == "--only") options.only.add_list(value());
      else usage(("unknown argument " + flag).c_str());
    } catch (const std::logic_error&) {  // stod / stoull: not a number
      usage(("bad value for " + flag).c_str());
    }
  }
  if (!(options.budget_minutes >= 0) || !(options.min_time >= 0))
    usage("--budget-minutes and --min-time must be >= 0");
  if (options.smoke && !options.min_time_given) options.min_time = 0.02;

  Machine& machine = sweep.machine;
  machine.threads = latte::cpu::thread_count();
  sample_machine(machine, options.smoke);
  std::fprintf(stderr,
               "latte-sweep: %d threads, FMA peak %.1f GFLOP/s fp32, %.1f fp64, memory %.1f GB/s\n",
               machine.threads, machine.peak32, machine.peak64, machine.bandwidth);

  for (const Shape& s : required_shapes(options.smoke)) sweep.run_shape(s, false);
  const std::size_t required_rows = sweep.rows.size();
  int random_points = 0;
  for (const Shape& s : shuffled_grid(options.seed)) {
    if (options.smoke ? random_points == 3 : since(sweep.start) >= options.budget_minutes * 60)
      break;
    if (sweep.run_shape(s, true)) ++random_points;
  }
  sample_machine(machine, options.smoke);
  std::fprintf(stderr,
               "latte-sweep: %zu rows (%zu required, %zu from %d random points) in %.1f s; "
               "FMA peak %.1f / %.1f GFLOP/s, memory %.1f GB/s\n",
               sweep.rows.size(), required_rows, sweep.rows.size() - required_rows, random_points,
               since(sweep.start), machine.peak32, machine.peak64, machine.bandwidth);

  std::printf("mechanism,direction,backend,dtype,B,T,H,L,D,seconds,tokens_per_s,gflops,min_bytes,"
              "roofline_gflops\n");
  auto machine_row = [](const char* name, const char* dtype, double value) {
    std::printf("%s,-,machine,%s,0,0,0,0,0,1.000000e+00,0.000000e+00,%.3f,0,0\n", name, dtype, value);
  };
  machine_row("threads", "-", machine.threads);
  machine_row("fma_peak", "fp32", machine.peak32);
  machine_row("fma_peak_fp64", "fp64", machine.peak64);
  machine_row("memory_bandwidth", "-", machine.bandwidth);
  for (const Row& r : sweep.rows) {
    const double peak = r.dtype == "fp32" ? machine.peak32 : machine.peak64;
    const double roofline = std::min(peak, r.flops / r.min_bytes * machine.bandwidth);
    std::printf("%s,%s,%s,%s,%td,%td,%td,%td,%td,%.6e,%.6e,%.3f,%.0f,%.3f\n", r.mechanism.c_str(),
                r.direction.c_str(), r.backend.c_str(), r.dtype.c_str(), r.B, r.T, r.H, r.L, r.D,
                r.seconds, double(r.B * r.T) / r.seconds, r.flops / r.seconds / 1e9, r.min_bytes,
                roofline);
  }
  return 0;
}
