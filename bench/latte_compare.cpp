// latte-compare: every mechanism and the exact softmax baseline, side by side,
// in one run on this machine (exec::cpu, fp32, B=1, H=8, L=64, D=64).
//
//   latte-compare [--t 256,1024,...] [--csv] [--time-cap S] [--min-time S] [--rounds N]
//                 [--only NAME,...]
//
// With --csv it prints the header
//   mechanism,direction,backend,B,T,H,L,D,seconds,tokens_per_s,gflops,extra_bytes
// and one row per run (an `fma_peak` row first: this machine's measured FMA
// throughput in the gflops column, the best of 16 samples taken before and
// after the runs, so kernels can be stated as a fraction of it). Without
// --csv it prints a table of times and ratios against the
// softmax baseline measured in the same run. Peers (PyTorch SDPA, the paper's
// JAX scan) append rows to the same CSV from bench/peers/.
//
// Each run's time is the best of its repeats (at least two, until --min-time
// is spent). With --rounds N the whole sweep over the lengths runs N times and
// each row keeps its best round: on a shared machine a neighbour's burst can
// cover every repeat of one run, and rounds minutes apart rarely all meet one.
//
// --only NAME,...: run only the rows whose mechanism starts with one of the
// NAMEs (`--only macchiato,lavo,conv` for those mechanisms' forward, backward
// and forward + backward rows; a NAME ending in `$` is that row only: `latte$`);
// the fma_peak row is always measured.
//
// FLOP formulas (multiply-add = 2):
//   latte causal / bidirectional:  4 * B*T*H*L*D
//   softmax causal:                2 * B*H*T*(T+1)/2 * (Dk+Dv)
//   softmax sliding window (w):    2 * B*H*sum_t min(t+1, w+1) * (Dk+Dv)
//   decode step (per token):       latte 4*B*H*L*D; softmax 2*B*H*context*(Dk+Dv)
//                                  (Latte's step is timed in batches of 1000 steps,
//                                  the contexts taking turns after all lengths ran)
//   linear (elu+1 causal and bidirectional, cosFormer causal): B*T*H*(4*E*D + 3*E), E = expanded features
//                                  (Dk for elu+1, 2*Dk for cosFormer; the L column)
//   bf16 rows (latte_bf16, and latte_bf16_products for the bidirectional
//                                  forward with latte::bf16_products, against
//                                  latte_fp32 on the same values): latte's
//                                  formula; T >= 16K up to 64K only
//   sums rows (latte_compensated against latte_plain, the forward; the same
//                                  for the backward, latte_backward_*, and for
//                                  1000 decode steps, latte_step_*; linear
//                                  elu+1 likewise, linear_*): the mechanisms'
//                                  formulas (the backward 2x); T >= 16K up to 64K
//   latte_unaligned, linear_elu_unaligned: causal Latte and elu+1 with q, k, v
//                                  and out 16 bytes past a cache line (NumPy's and
//                                  malloc's large arrays); their mechanisms' formulas
//   macchiato (L latents, window 128 with RoPE), LAVO (r = 64 bases in the L
//   column, window 64), conv-compression (levels 2, group M = 64 in the L
//   column): the models of bench/flop_models.hpp.
// Runs whose cost grows faster than T (softmax; conv-compression's cross part,
// O(T^2 / M^2)) are skipped past --time-cap, predicted from their previous length.
// extra_bytes: the peak heap memory allocated during the measured call
// (counted by this program's operator new, plain and over-aligned), i.e. the
// kernel's workspace.
#include <latte/attention.hpp>

#include "conv_compressed_weights.hpp"
#include "flop_models.hpp"
#include "fma_peak.hpp"
#include "name_filter.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <unistd.h>

#if defined(_OPENMP)
#include <omp.h>
#endif

// ---- heap accounting (the workspace a call allocates) ----------------------
namespace {
std::atomic<long long> heap_now{0}, heap_peak{0};
void note_alloc(std::size_t bytes) {
  const long long now = heap_now.fetch_add(static_cast<long long>(bytes)) + static_cast<long long>(bytes);
  long long peak = heap_peak.load();
  while (now > peak && !heap_peak.compare_exchange_weak(peak, now)) {
  }
}
}  // namespace

void* operator new(std::size_t bytes) {
  void* p = std::malloc(bytes + 16);
  if (!p) throw std::bad_alloc();
  *static_cast<std::size_t*>(p) = bytes;
  note_alloc(bytes);
  return static_cast<char*>(p) + 16;
}
void operator delete(void* p) noexcept {
  if (!p) return;
  char* base = static_cast<char*>(p) - 16;
  heap_now.fetch_sub(static_cast<long long>(*reinterpret_cast<std::size_t*>(base)));
  std::free(base);
}
void operator delete(void* p, std::size_t) noexcept { operator delete(p); }
void* operator new[](std::size_t bytes) { return operator new(bytes); }
void operator delete[](void* p) noexcept { operator delete(p); }
void operator delete[](void* p, std::size_t) noexcept { operator delete(p); }
// The over-aligned forms too: latte::HugePageAllocator (Tensor, AlignedVector,
// hence the kernels' workspaces) allocates through them. The size sits in the
// `alignment` bytes before the block.
void* operator new(std::size_t bytes, std::align_val_t alignment) {
  const auto align = std::max<std::size_t>(static_cast<std::size_t>(alignment), 16);
  const std::size_t total = (bytes + 2 * align - 1) / align * align;  // header + block, a multiple
  void* p = std::aligned_alloc(align, total);
  if (!p) throw std::bad_alloc();
  *static_cast<std::size_t*>(p) = bytes;
  note_alloc(bytes);
  return static_cast<char*>(p) + align;
}
void operator delete(void* p, std::align_val_t alignment) noexcept {
  if (!p) return;
  const auto align = std::max<std::size_t>(static_cast<std::size_t>(alignment), 16);
  char* base = static_cast<char*>(p) - align;
  heap_now.fetch_sub(static_cast<long long>(*reinterpret_cast<std::size_t*>(base)));
  std::free(base);
}
void operator delete(void* p, std::size_t, std::align_val_t alignment) noexcept {
  operator delete(p, alignment);
}
void* operator new[](std::size_t bytes, std::align_val_t alignment) {
  return operator new(bytes, alignment);
}
void operator delete[](void* p, std::align_val_t alignment) noexcept { operator delete(p, alignment); }
void operator delete[](void* p, std::size_t, std::align_val_t alignment) noexcept {
  operator delete(p, alignment);
}

namespace {

using latte::index_t;
using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<index_t> lengths{256, 1024, 4096, 16384, 65536, 262144, 1048576};
  bool csv = false;
  double time_cap = 20.0;  // skip a quadratic run predicted to take longer
  double min_time = 0.3;   // repeat a run until this much time was spent (min of repeats)
  int rounds = 1;          // sweeps over the lengths; each row keeps its best
  latte::bench::NameFilter only;  // mechanism prefixes to run; empty: every row

  [[nodiscard]] bool wanted(const std::string& mechanism) const { return only.wanted(mechanism); }
};

struct Row {
  std::string mechanism, direction;
  index_t B, T, H, L, D;
  double seconds, flops;
  long long extra_bytes;
};

/// Wall time of one call of f() and the peak heap it allocated.
std::pair<double, long long> timed_call(const std::function<void()>& f) {
  const long long before = heap_now.load();
  heap_peak.store(before);
  const auto start = Clock::now();
  f();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return {seconds, heap_peak.load() - before};
}

/// Best-of-repeats wall time of f() and the peak heap it allocated.
std::pair<double, long long> measure(const std::function<void()>& f, double min_time,
                                     int max_runs = 1000) {
  double best = 1e300, spent = 0;
  long long extra = 0;
  for (int run = 0; run < max_runs && (run < 2 || spent < min_time); ++run) {
    const auto [seconds, bytes] = timed_call(f);
    extra = std::max(extra, bytes);
    best = std::min(best, seconds);
    spent += seconds;
    if (seconds > 2.0) break;  // long runs: one timed repeat is enough
  }
  return {best, extra};
}

template <std::size_t N>
latte::Tensor<float, N> random_tensor(std::mt19937& rng, const std::array<index_t, N>& extents) {
  latte::Tensor<float, N> x(extents);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (index_t i = 0; i < x.size(); ++i) x.data()[i] = normal(rng);
  return x;
}

/// Whether `bytes` more of tensors fit beside the heap latte-compare holds,
/// within 3/4 of this machine's memory (workspaces and the system need the
/// rest); a block of rows that does not fit is skipped, saying so on stderr
/// (at 1M tokens a Macchiato backward's nine extra [1, 1M, 8, 64] tensors
/// would not fit in 24 GiB beside the inputs: the OOM killer ended the run).
bool memory_allows(const char* rows, index_t T, double bytes) {
  const double physical = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
  const double held = double(heap_now.load());
  if (physical <= 0 || held + bytes <= 0.75 * physical) return true;
  std::fprintf(stderr, "  %s rows T=%td skipped (%.1f GB of tensors beside %.1f GB held; memory %.1f GB)\n", rows,
               T, bytes / 1e9, held / 1e9, physical / 1e9);
  return false;
}

/// Skips a run whose time grows like T^2 once its previous length predicts more
/// than the time cap.
struct QuadraticCap {
  double previous_seconds = 0;
  index_t previous_t = 0;

  /// Seconds a run at T should take: the last length's time scaled by
  /// (T / last)^2, or before any length ran, its `flops` at the FMA peak (a
  /// lower bound: `--t 1M` alone would otherwise start an hours-long run).
  double predicted(index_t T, double flops, double peak_gflops) const {
    if (previous_t == 0) return flops / (peak_gflops * 1e9);
    const double ratio = double(T) / double(previous_t);
    return previous_seconds * ratio * ratio;
  }
  void record(index_t T, double seconds) {
    previous_t = T;
    previous_seconds = seconds;
  }
};

std::vector<index_t> parse_lengths(const std::string& text) {
  std::vector<index_t> lengths;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    index_t value = std::stol(item);
    const char unit = item.empty() ? ' ' : item.back();
    if (unit == 'K' || unit == 'k') value *= 1024;
    if (unit == 'M' || unit == 'm') value *= 1024 * 1024;
    if (value < 1) throw std::invalid_argument("--t: lengths must be >= 1");
    lengths.push_back(value);
  }
  return lengths;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "latte-compare: %s needs a value\n", flag.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (flag == "--csv") options.csv = true;
    else if (flag == "--t") options.lengths = parse_lengths(value());
    else if (flag == "--time-cap") options.time_cap = std::stod(value());
    else if (flag == "--min-time") options.min_time = std::stod(value());
    else if (flag == "--rounds") options.rounds = std::stoi(value());
    else if (flag == "--only") options.only.add_list(value());
    else {
      std::fprintf(stderr,
                   "usage: latte-compare [--t 256,1K,64K,...] [--csv] [--time-cap S] "
                   "[--min-time S] [--rounds N] [--only NAME,...]\n");
      return 2;
    }
  }
  if (options.rounds < 1) {
    std::fprintf(stderr, "latte-compare: --rounds must be >= 1\n");
    return 2;
  }
  constexpr index_t B = 1, H = 8, L = 64, D = 64, window = 128;
  std::vector<Row> rows;
  // The peak is sampled before the runs and again after them (below); the
  // fma_peak row holds the best of all samples.
  double peak = latte::bench::fma_peak_gflops<float>(8);
  rows.push_back({"fma_peak", "-", 0, 0, 0, 0, 0, 1.0, peak * 1e9, 0});

  const latte::LatteAttention<latte::Causal> latte_causal({H, L, D});
  const latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR> latte_vapor({H, L, D});
  const latte::LatteAttention<latte::Bidirectional> latte_bidirectional({H, L, D});
  const latte::SoftmaxAttention<latte::Causal> softmax_causal({H, D, D});
  const latte::LinearAttention<latte::Causal, latte::EluPlusOne> linear_causal({H, L, D});
  const latte::LinearAttention<latte::Bidirectional, latte::EluPlusOne> linear_bidirectional({H, L, D});
  const latte::CosFormer<latte::Causal> cosformer_causal({H, L, D});  // M = T
  const latte::SoftmaxAttention<latte::Causal, latte::SlidingWindow> softmax_window(
      {H, D, D}, {.left = window});
  using MacchiatoRope = latte::LatteMacchiato<latte::Causal, latte::RunningMax,
                                              latte::NoPositional, latte::RoPE>;
  const MacchiatoRope macchiato(
      {.heads = H, .latents = L, .key_dim = D, .value_dim = D, .window = window});
  constexpr index_t lavo_window = 64, conv_levels = 2, conv_group = 64;
  const latte::Lavo<latte::Causal> lavo_causal(
      {.heads = H, .dim = D, .bases = L, .window = lavo_window}, {.basis_seed = 1});
  const latte::Lavo<latte::Bidirectional> lavo_bidirectional(
      {.heads = H, .dim = D, .bases = L, .window = lavo_window}, {.basis_seed = 1});
  const latte::ConvCompressedDims conv_dims{.heads = H, .key_dim = D, .value_dim = D,
                                            .group_size = conv_group, .levels = conv_levels};
  const latte::ConvCompressedAttention<latte::Causal> conv_causal(
      conv_dims, latte::bench::random_conv_compressed_params(conv_dims));
  std::mt19937 rng(7);
  using LatteState = decltype(latte_causal.make_state<float>(B));
  std::vector<std::pair<index_t, LatteState>> decode_states;
  // A run's row, or in a later round the faster of it and the row it repeats.
  auto record = [&](const Row& row) {
    for (Row& r : rows)
      if (r.mechanism == row.mechanism && r.direction == row.direction && r.B == row.B && r.T == row.T) {
        r.seconds = std::min(r.seconds, row.seconds);
        r.extra_bytes = std::max(r.extra_bytes, row.extra_bytes);
        return;
      }
    rows.push_back(row);
  };

  for (int round = 0; round < options.rounds; ++round) {
    QuadraticCap softmax_cap, conv_cap, conv_backward_cap, conv_forward_backward_cap;
    for (const index_t T : options.lengths) {
      auto q = random_tensor<4>(rng, {B, T, H, L});
      auto k = random_tensor<4>(rng, {B, T, H, L});
      auto v = random_tensor<4>(rng, {B, T, H, D});
      latte::Tensor<float, 4> out({B, T, H, D});
      const double latte_flops = 4.0 * B * T * H * L * D;
      // One timed run, its row's L column `latents`; `calls`: how many calls
      // f() makes, the row reports the time of one.
      auto timed = [&](const char* name, const char* direction, index_t latents, double flops,
                       const std::function<void()>& f, int calls, int max_runs) {
        if (!options.wanted(name)) return 0.0;
        auto [seconds, extra] = measure(f, options.min_time, max_runs);
        seconds /= calls;
        record({name, direction, B, T, H, latents, D, seconds, flops, extra});
        if (!options.csv)
          std::fprintf(stderr, "  %-22s T=%-8td %10.4f s\n", name, T, seconds);
        return seconds;
      };
      auto run = [&](const char* name, const char* direction, double flops,
                     const std::function<void()>& f, int calls = 1, int max_runs = 1000) {
        return timed(name, direction, L, flops, f, calls, max_runs);
      };
      run("latte", "causal", latte_flops,
          [&] { latte_causal.forward(latte::exec::cpu, q, k, v, out.view()); });
      run("latte_vapor", "causal", latte_flops,
          [&] { latte_vapor.forward(latte::exec::cpu, q, k, v, out.view()); });
      run("latte", "bidirectional", latte_flops,
          [&] { latte_bidirectional.forward(latte::exec::cpu, q, k, v, out.view()); });
      // Backward (docs/backward.md): counted as 2x the forward's FLOPs, no credit
      // for its recompute; forward + backward as 3x.
      const double tensor_bytes = double(B) * T * H * std::max(L + 1, D) * sizeof(float);  // one [B, T, H, *]
      if (memory_allows("latte_backward", T, 4 * tensor_bytes)) {
        auto d_out = random_tensor<4>(rng, {B, T, H, D});
        latte::Tensor<float, 4> dq({B, T, H, L}), dk({B, T, H, L}), dv({B, T, H, D});
        const latte::LatteGradients<float> gradients{dq.view(), dk.view(), dv.view()};
        run("latte_backward", "causal", 2 * latte_flops, [&] {
          latte_causal.backward(latte::exec::cpu, q, k, v, d_out, gradients);
        });
        run("latte_forward_backward", "causal", 3 * latte_flops, [&] {
          latte_causal.forward(latte::exec::cpu, q, k, v, out.view());
          latte_causal.backward(latte::exec::cpu, q, k, v, d_out, gradients);
        });
        run("latte_vapor_backward", "causal", 2 * latte_flops, [&] {
          latte_vapor.backward(latte::exec::cpu, q, k, v, d_out, gradients);
        });
        run("latte_backward", "bidirectional", 2 * latte_flops, [&] {
          latte_bidirectional.backward(latte::exec::cpu, q, k, v, d_out, gradients);
        });
      }
      double window_terms = 0;
      for (index_t t = 0; t < T; ++t) window_terms += static_cast<double>(std::min(t + 1, window + 1));
      run("softmax_window128", "causal", 2.0 * B * H * window_terms * (D + D),
          [&] { softmax_window.forward(latte::exec::cpu, q, k, v, out.view()); });
      // The linear-attention family (q, k as [B, T, H, Dk] with Dk = L): E = L, and 2L for cosFormer.
      auto linear_run = [&](const char* name, index_t E, const std::function<void()>& f) {
        timed(name, "causal", E, double(B) * T * H * (4.0 * E * D + 3.0 * E), f, 1, 1000);
      };
      linear_run("linear_elu", L, [&] { linear_causal.forward(latte::exec::cpu, q, k, v, out.view()); });
      timed("linear_elu", "bidirectional", L, double(B) * T * H * (4.0 * L * D + 3.0 * L),
            [&] { linear_bidirectional.forward(latte::exec::cpu, q, k, v, out.view()); }, 1, 1000);
      // The same two with q, k, v and out starting 16 bytes past a cache line, as NumPy's and
      // malloc's (std::vector's) large arrays do: every row straddles one line more.
      if (options.wanted("latte_unaligned") || options.wanted("linear_elu_unaligned")) {
        const index_t qk = B * T * H * L, vo = B * T * H * D, shift = 16 / sizeof(float);
        latte::Tensor<float, 1> shifted({2 * qk + 2 * vo + 4 * 16});
        float* base = shifted.data();
        auto place = [&](const float* from, index_t n, index_t& at) {
          float* row = base + at + shift;
          std::copy(from, from + n, row);
          at += (n + shift + 15) / 16 * 16;  // the next array on a line again, then shifted
          return row;
        };
        index_t at = 0;
        const latte::TensorView<const float, 4> q16(place(q.data(), qk, at), {B, T, H, L});
        const latte::TensorView<const float, 4> k16(place(k.data(), qk, at), {B, T, H, L});
        const latte::TensorView<const float, 4> v16(place(v.data(), vo, at), {B, T, H, D});
        const latte::TensorView<float, 4> out16(place(out.data(), vo, at), {B, T, H, D});
        run("latte_unaligned", "causal", latte_flops,
            [&] { latte_causal.forward(latte::exec::cpu, q16, k16, v16, out16); });
        linear_run("linear_elu_unaligned", L,
                   [&] { linear_causal.forward(latte::exec::cpu, q16, k16, v16, out16); });
      }
      if (memory_allows("linear_elu_backward", T, 4 * tensor_bytes)) {
        // backward: 2x the forward's FLOPs, forward + backward 3x (as Latte's rows)
        const double linear_flops = double(B) * T * H * (4.0 * L * D + 3.0 * L);
        auto d_out = random_tensor<4>(rng, {B, T, H, D});
        latte::Tensor<float, 4> dq({B, T, H, L}), dk({B, T, H, L}), dv({B, T, H, D});
        const latte::LinearGradients<float> gradients{dq.view(), dk.view(), dv.view()};
        timed("linear_elu_backward", "causal", L, 2 * linear_flops, [&] {
          linear_causal.backward(latte::exec::cpu, q, k, v, d_out, gradients);
        }, 1, 1000);
        timed("linear_elu_forward_backward", "causal", L, 3 * linear_flops, [&] {
          linear_causal.forward(latte::exec::cpu, q, k, v, out.view());
          linear_causal.backward(latte::exec::cpu, q, k, v, d_out, gradients);
        }, 1, 1000);
        timed("linear_elu_backward", "bidirectional", L, 2 * linear_flops, [&] {
          linear_bidirectional.backward(latte::exec::cpu, q, k, v, d_out, gradients);
        }, 1, 1000);
      }
      linear_run("cosformer", 2 * L,
                 [&] { cosformer_causal.forward(latte::exec::cpu, q, k, v, out.view()); });
      // Macchiato: q carries L + 1 columns (column 0 scores the window state), the
      // window part its own RoPE-rotated queries / keys wq, wk.
      if (memory_allows("macchiato", T, 3 * tensor_bytes)) {
        auto q_states = random_tensor<4>(rng, {B, T, H, L + 1});
        auto wq = random_tensor<4>(rng, {B, T, H, D}), wk = random_tensor<4>(rng, {B, T, H, D});
        const double macchiato_flops =
            double(B) * T * H * latte::bench::macchiato_token_flops(L, D, D, window);
        run("macchiato", "causal", macchiato_flops, [&] {
          macchiato.forward(latte::exec::cpu, q_states, k, wq, wk, v, out.view());
        });
        // Backward: 2x the forward's FLOPs, forward + backward 3x (as Latte's rows).
        if (memory_allows("macchiato_backward", T, 6 * tensor_bytes)) {
          auto d_out = random_tensor<4>(rng, {B, T, H, D});
          latte::Tensor<float, 4> dq({B, T, H, L + 1}), dk({B, T, H, L}), dwq({B, T, H, D}),
              dwk({B, T, H, D}), dv({B, T, H, D});
          const latte::MacchiatoGradients<float> gradients{dq.view(), dk.view(), dwq.view(),
                                                           dwk.view(), dv.view()};
          run("macchiato_backward", "causal", 2 * macchiato_flops, [&] {
            macchiato.backward(latte::exec::cpu, q_states, k, wq, wk, v, d_out, gradients);
          });
          run("macchiato_forward_backward", "causal", 3 * macchiato_flops, [&] {
            macchiato.forward(latte::exec::cpu, q_states, k, wq, wk, v, out.view());
            macchiato.backward(latte::exec::cpu, q_states, k, wq, wk, v, d_out, gradients);
          });
        }
      }
      run("lavo", "causal",
          double(B) * H * latte::bench::lavo_forward_flops(T, D, L, lavo_window, true),
          [&] { lavo_causal.forward(latte::exec::cpu, q, k, v, out.view()); });
      run("lavo", "bidirectional",
          double(B) * H * latte::bench::lavo_forward_flops(T, D, L, lavo_window, false),
          [&] { lavo_bidirectional.forward(latte::exec::cpu, q, k, v, out.view()); });
      if (memory_allows("lavo_backward", T, 4 * tensor_bytes)) {
        // backward: 2x the forward's FLOPs, forward + backward 3x (as Latte's rows)
        const double lavo_flops =
            double(B) * H * latte::bench::lavo_forward_flops(T, D, L, lavo_window, true);
        auto d_out = random_tensor<4>(rng, {B, T, H, D});
        latte::Tensor<float, 4> dq({B, T, H, D}), dk({B, T, H, D}), dv({B, T, H, D});
        latte::Tensor<float, 2> d_bias({H, 2 * lavo_window - 1});
        const latte::LavoGradients<float> gradients{dq.view(), dk.view(), dv.view(), d_bias.view()};
        run("lavo_backward", "causal", 2 * lavo_flops, [&] {
          lavo_causal.backward(latte::exec::cpu, q, k, v, d_out, gradients);
        });
        run("lavo_forward_backward", "causal", 3 * lavo_flops, [&] {
          lavo_causal.forward(latte::exec::cpu, q, k, v, out.view());
          lavo_causal.backward(latte::exec::cpu, q, k, v, d_out, gradients);
        });
      }
      // Runs that grow like T^2: skipped when the last length predicts a run past the cap.
      auto capped = [&](QuadraticCap& cap, const char* name, double flops,
                        const std::function<void()>& f) {
        if (!options.wanted(name)) return;
        const double predicted = cap.predicted(T, flops, peak);
        if (predicted <= options.time_cap) {
          cap.record(T, run(name, "causal", flops, f));
        } else if (!options.csv) {
          std::fprintf(stderr, "  %s causal T=%td skipped (predicted %.0f s > cap %.0f s)\n", name, T,
                       predicted, options.time_cap);
        }
      };
      capped(conv_cap, "conv_compressed",
             double(B) * H *
                 latte::bench::conv_compressed_forward_flops(T, conv_levels, conv_group, D, D, true),
             [&] { conv_causal.forward(latte::exec::cpu, q, k, v, out.view()); });
      if (memory_allows("conv_compressed_backward", T, 4 * tensor_bytes)) {
        // backward: 2x the forward's FLOPs, forward + backward 3x (as Latte's rows)
        const double conv_flops =
            double(B) * H *
            latte::bench::conv_compressed_forward_flops(T, conv_levels, conv_group, D, D, true);
        auto d_out = random_tensor<4>(rng, {B, T, H, D});
        latte::Tensor<float, 4> dq({B, T, H, L}), dk({B, T, H, L}), dv({B, T, H, D});
        // The weights' gradients too (accumulated: zeroed once, the sums only grow).
        auto d_params = latte::ConvCompressedParams::zeros(conv_dims);
        const latte::ConvCompressedGradients<float> gradients{dq.view(), dk.view(), dv.view(),
                                                              &d_params};
        capped(conv_backward_cap, "conv_compressed_backward", 2 * conv_flops, [&] {
          conv_causal.backward(latte::exec::cpu, q, k, v, d_out, gradients);
        });
        capped(conv_forward_backward_cap, "conv_compressed_forward_backward", 3 * conv_flops, [&] {
          conv_causal.forward(latte::exec::cpu, q, k, v, out.view());
          conv_causal.backward(latte::exec::cpu, q, k, v, d_out, gradients);
        });
      }
      capped(softmax_cap, "softmax", 2.0 * B * H * (double(T) * (T + 1) / 2) * (D + D),
             [&] { softmax_causal.forward(latte::exec::cpu, q, k, v, out.view()); });
      // Decode: the state after a context of T tokens, stepped once all the
      // lengths have run (below).
      if (round == 0 && options.wanted("latte_decode_step")) {
        auto state = latte_causal.make_state<float>(B);
        latte_causal.forward(latte::exec::cpu, q, k, v, out.view(), state);
        decode_states.emplace_back(T, std::move(state));
      }
      if (options.wanted("softmax_decode_step") &&
          static_cast<double>(T) * H * 2 * D * sizeof(float) < 4e9) {
        auto cache = softmax_causal.make_state<float>(B, T + 64);
        // Fill the cache with T tokens directly through steps would be O(T^2); write them instead.
        for (index_t b = 0; b < B; ++b)
          for (index_t h = 0; h < H; ++h) {
            auto slots = cache.slots(b, h);
            for (index_t t = 0; t < T; ++t) {
              std::copy(k.view().row(b, t, h), k.view().row(b, t, h) + D, slots.keys + t * D);
              std::copy(v.view().row(b, t, h), v.view().row(b, t, h) + D, slots.values + t * D);
            }
          }
        cache.advance(T);
        auto q1 = random_tensor<3>(rng, {B, H, D}), k1 = random_tensor<3>(rng, {B, H, D});
        auto v1 = random_tensor<3>(rng, {B, H, D});
        latte::Tensor<float, 3> o1({B, H, D});
        // At most 60 timed steps: they must stay inside the cache's spare capacity.
        run("softmax_decode_step", "causal", 2.0 * B * H * double(T) * (D + D), [&] {
          softmax_causal.step(latte::exec::cpu, cache, q1, k1, v1, o1.view());
        }, 1, 60);
      }
    }
  }

  // The Latte decode step after each context. One step takes about 2 us:
  // timing single calls measures the clock and the machine's interruptions as
  // much as the step, so each timed call runs a batch of 1000 steps. The
  // contexts take turns, batch by batch, and each keeps its best batch: the
  // claim is that the step costs the same at every context, and timing the
  // contexts one after another would compare quiet moments of this shared
  // machine with busy ones instead.
  {
    auto q1 = random_tensor<3>(rng, {B, H, L}), k1 = random_tensor<3>(rng, {B, H, L});
    auto v1 = random_tensor<3>(rng, {B, H, D});
    latte::Tensor<float, 3> o1({B, H, D});
    constexpr int steps_per_call = 1000;
    const auto contexts = decode_states.size();
    std::vector<double> best(contexts, 1e300);
    std::vector<long long> extra(contexts, 0);
    double spent = 0;
    for (int round = 0; round < 1000 && (round < 3 || spent < options.min_time * contexts);
         ++round)
      for (std::size_t i = 0; i < contexts; ++i) {
        const auto [seconds, bytes] = timed_call([&] {
          for (int s = 0; s < steps_per_call; ++s)
            latte_causal.step(latte::exec::cpu, decode_states[i].second, q1, k1, v1, o1.view());
        });
        extra[i] = std::max(extra[i], bytes);
        best[i] = std::min(best[i], seconds / steps_per_call);
        spent += seconds;
      }
    for (std::size_t i = 0; i < contexts; ++i)
      rows.push_back({"latte_decode_step", "causal", B, decode_states[i].first, H, L, D, best[i],
                      4.0 * B * H * L * D, extra[i]});
  }

  // Serving (docs/serving.md). Decode throughput: N live sequences stepped together
  // through a StatePool, one token each per call (B = N, T = 1, tokens/s = N /
  // seconds), contexts drawn log-uniformly from 256..16K; causal Latte against the
  // softmax KV-cache step. A step's cost does not depend on what the states hold,
  // only on where they are: Latte's states are advanced to their context (the
  // carry's size is O(L * Dv) at any position), the KV caches are written in full
  // to their context (a real cache's memory traffic) and advanced. Packed prefill:
  // fifty prompts log-uniform in 64..4K plus one 64K prompt through
  // forward_packed, against one forward over a sequence of the same total length.
  if (options.wanted("serving")) {
    std::mt19937 serving_rng(11);
    std::uniform_real_distribution<double> log_context(std::log(256.0), std::log(16384.0));
    constexpr int max_steps = 16;  // timed calls per pool: each advances every slot by one
    for (const index_t live : {index_t{1}, index_t{8}, index_t{64}, index_t{256}}) {
      std::vector<index_t> contexts;
      double context_sum = 0;
      for (index_t i = 0; i < live; ++i) {
        contexts.push_back(static_cast<index_t>(std::llround(std::exp(log_context(serving_rng)))));
        context_sum += double(contexts.back());
      }
      auto q1 = random_tensor<3>(rng, {live, H, L}), k1 = random_tensor<3>(rng, {live, H, L});
      auto v1 = random_tensor<3>(rng, {live, H, D});
      latte::Tensor<float, 3> o1({live, H, D});
      const auto inputs = std::make_tuple(q1.cview(), k1.cview(), v1.cview());
      {
        latte::StatePool<latte::LatteAttention<latte::Causal>, float> pool(latte_causal, live);
        std::vector<latte::PoolSlot> slots;
        for (index_t i = 0; i < live; ++i) {
          slots.push_back(pool.acquire());
          pool.state(slots.back()).advance(contexts[static_cast<std::size_t>(i)]);
        }
        const auto [seconds, extra] = measure([&] { pool.step(latte::exec::cpu, slots, inputs, o1.view()); },
                                              options.min_time, max_steps);
        record({"latte_pool_step", "causal", live, 1, H, L, D, seconds, 4.0 * live * H * L * D, extra});
        if (!options.csv) std::fprintf(stderr, "  %-22s N=%-8td %10.6f s\n", "latte_pool_step", live, seconds);
      }
      {
        // A StatePool sizes every slot alike, and KV caches of 16K tokens for 256
        // slots would hold 4x the tokens these contexts have: each cache is made at
        // its own capacity instead and the caches stepped side by side, as the pool steps.
        std::vector<latte::KVCache<float>> caches;
        caches.reserve(static_cast<std::size_t>(live));
        for (index_t i = 0; i < live; ++i) {
          const index_t context = contexts[static_cast<std::size_t>(i)];
          caches.push_back(softmax_causal.make_state<float>(1, context + max_steps));
          for (index_t h = 0; h < H; ++h) {
            auto slots = caches.back().slots(0, h);
            std::fill(slots.keys, slots.keys + context * D, 0.01f * float(h + 1));
            std::fill(slots.values, slots.values + context * D, 0.02f);
          }
          caches.back().advance(context);
        }
        const auto [seconds, extra] = measure([&] {
          latte::cpu::parallel_for(live, latte::cpu::thread_count(), [&](index_t n, int) {
            const auto row = [n](const auto& view) { return latte::detail::batch_row(view, n); };
            softmax_causal.step(latte::exec::cpu, caches[static_cast<std::size_t>(n)], row(q1.cview()),
                                row(k1.cview()), row(v1.cview()), row(o1.view()));
          });
        }, options.min_time, max_steps);
        record({"softmax_pool_step", "causal", live, 1, H, D, D, seconds, 2.0 * H * context_sum * (D + D), extra});
        if (!options.csv) std::fprintf(stderr, "  %-22s N=%-8td %10.6f s\n", "softmax_pool_step", live, seconds);
      }
    }
    {
      std::uniform_real_distribution<double> log_prompt(std::log(64.0), std::log(4096.0));
      std::vector<index_t> cu_seqlens{0, 65536};
      for (int i = 0; i < 50; ++i)
        cu_seqlens.push_back(cu_seqlens.back() + static_cast<index_t>(std::llround(std::exp(log_prompt(serving_rng)))));
      const index_t total = cu_seqlens.back();
      auto q = random_tensor<4>(rng, {1, total, H, L}), k = random_tensor<4>(rng, {1, total, H, L});
      auto v = random_tensor<4>(rng, {1, total, H, D});
      latte::Tensor<float, 4> out({1, total, H, D});
      const double flops = 4.0 * total * H * L * D;
      for (int repeat = 0; repeat < 2; ++repeat) {  // interleaved, each row keeps its best
        const auto [one, one_extra] = measure([&] { latte_causal.forward(latte::exec::cpu, q, k, v, out.view()); },
                                              options.min_time);
        record({"latte_one_sequence", "causal", 1, total, H, L, D, one, flops, one_extra});
        const auto [packed, packed_extra] = measure([&] {
          latte::forward_packed(latte_causal, latte::exec::cpu, cu_seqlens,
                                std::make_tuple(q.cview(), k.cview(), v.cview()), out.view());
        }, options.min_time);
        record({"latte_forward_packed", "causal", 1, total, H, L, D, packed, flops, packed_extra});
      }
      if (!options.csv) std::fprintf(stderr, "  packed prefill: 51 prompts, %td tokens\n", total);
    }
  }

  // bf16 activations (serving/half_precision.hpp): causal and bidirectional Latte
  // reading bf16 inputs and writing a bf16 output (fp32 sums and state), against
  // the fp32 forward on the same values, interleaved; T >= 16K up to 64K.
  if (options.wanted("bf16")) {
    for (const index_t T : options.lengths) {
      if (T < 16384 || T > 65536) continue;
      auto q = random_tensor<4>(rng, {B, T, H, L}), k = random_tensor<4>(rng, {B, T, H, L});
      auto v = random_tensor<4>(rng, {B, T, H, D});
      latte::Tensor<float, 4> out({B, T, H, D});
      auto to_bf16 = [](const latte::Tensor<float, 4>& x) {
        latte::Tensor<latte::bfloat16, 4> y(x.extents());
        for (index_t i = 0; i < x.size(); ++i) y.data()[i] = latte::bfloat16(x.data()[i]);
        return y;
      };
      const auto q16 = to_bf16(q), k16 = to_bf16(k), v16 = to_bf16(v);
      latte::Tensor<latte::bfloat16, 4> out16({B, T, H, D});
      const double flops = 4.0 * B * T * H * L * D;
      for (int repeat = 0; repeat < 2; ++repeat) {
        auto both = [&](const auto& attention, const char* direction) {
          const auto [fp32, fp32_extra] = measure([&] { attention.forward(latte::exec::cpu, q, k, v, out.view()); },
                                                  options.min_time);
          record({"latte_fp32", direction, B, T, H, L, D, fp32, flops, fp32_extra});
          const auto [bf16, bf16_extra] = measure([&] {
            attention.forward(latte::exec::cpu, q16.cview(), k16.cview(), v16.cview(), out16.view());
          }, options.min_time);
          record({"latte_bf16", direction, B, T, H, L, D, bf16, flops, bf16_extra});
          if constexpr (!std::decay_t<decltype(attention)>::direction::is_causal) {
            const auto [products, products_extra] = measure([&] {
              attention.forward(latte::exec::cpu, latte::bf16_products, q16.cview(), k16.cview(), v16.cview(),
                                out16.view());
            }, options.min_time);
            record({"latte_bf16_products", direction, B, T, H, L, D, products, flops, products_extra});
          }
        };
        both(latte_causal, "causal");
        both(latte_bidirectional, "bidirectional");
      }
      if (!options.csv) std::fprintf(stderr, "  bf16 forward T=%td\n", T);
    }
  }

  // Summation (policies/summation.hpp): causal Latte's forward and decode step
  // with compensated sums (the default) against PlainSums on the same inputs,
  // interleaved; T >= 16K up to 64K. A step row's T is the 1000 steps timed.
  if (options.wanted("sums")) {
    const latte::LatteAttention<latte::Causal, latte::RunningMax, latte::NoPositional,
                                latte::PlainSums>
        plain({H, L, D});
    const latte::LinearAttention<latte::Causal, latte::EluPlusOne, latte::NoReweight,
                                 latte::NoPositional, latte::PlainSums>
        linear_plain({H, L, D});
    for (const index_t T : options.lengths) {
      if (T < 16384 || T > 65536) continue;
      auto q = random_tensor<4>(rng, {B, T, H, L}), k = random_tensor<4>(rng, {B, T, H, L});
      auto v = random_tensor<4>(rng, {B, T, H, D});
      latte::Tensor<float, 4> out({B, T, H, D}), d_q({B, T, H, L}), d_k({B, T, H, L}),
          d_v({B, T, H, D});
      const double flops = 4.0 * B * T * H * L * D;
      for (int repeat = 0; repeat < 2; ++repeat) {
        auto forward = [&](const auto& attention, const char* name, double flop_count) {
          const auto [seconds, extra] = measure(
              [&] { attention.forward(latte::exec::cpu, q, k, v, out.view()); }, options.min_time);
          record({name, "causal", B, T, H, L, D, seconds, flop_count, extra});
        };
        const double linear_flops = flops + 3.0 * B * T * H * L;
        forward(latte_causal, "latte_compensated", flops);
        forward(plain, "latte_plain", flops);
        forward(linear_causal, "linear_compensated", linear_flops);
        forward(linear_plain, "linear_plain", linear_flops);
        // The backward (2x the forward's FLOPs, as the backward rows above).
        auto backward = [&](const auto& attention, const char* name, double flop_count) {
          const auto [seconds, extra] = measure([&] {
            using Gradients =
                typename std::decay_t<decltype(attention)>::template Gradients<float>;
            attention.backward(latte::exec::cpu, q, k, v, out, Gradients{d_q.view(), d_k.view(), d_v.view()});
          }, options.min_time);
          record({name, "causal", B, T, H, L, D, seconds, 2 * flop_count, extra});
        };
        backward(latte_causal, "latte_backward_compensated", flops);
        backward(plain, "latte_backward_plain", flops);
        backward(linear_causal, "linear_backward_compensated", linear_flops);
        backward(linear_plain, "linear_backward_plain", linear_flops);
      }
      if (!options.csv) std::fprintf(stderr, "  summation forward T=%td\n", T);
    }
    auto q1 = random_tensor<3>(rng, {B, H, L}), k1 = random_tensor<3>(rng, {B, H, L});
    auto v1 = random_tensor<3>(rng, {B, H, D});
    latte::Tensor<float, 3> out1({B, H, D});
    constexpr index_t steps = 1000;
    auto compensated_state = latte_causal.make_state<float>(B);
    auto plain_state = plain.make_state<float>(B);
    auto linear_state = linear_causal.make_state<float>(B);
    auto linear_plain_state = linear_plain.make_state<float>(B);
    for (int repeat = 0; repeat < 2; ++repeat) {
      auto decode = [&](const auto& attention, auto& state, const char* name) {
        const auto [seconds, extra] = measure([&] {
          for (index_t s = 0; s < steps; ++s)
            attention.step(latte::exec::cpu, state, q1, k1, v1, out1.view());
        }, options.min_time);
        record({name, "causal", B, steps, H, L, D, seconds, 4.0 * steps * B * H * L * D, extra});
      };
      decode(latte_causal, compensated_state, "latte_step_compensated");
      decode(plain, plain_state, "latte_step_plain");
      decode(linear_causal, linear_state, "linear_step_compensated");
      decode(linear_plain, linear_plain_state, "linear_step_plain");
    }
  }

  peak = std::max(peak, latte::bench::fma_peak_gflops<float>(8));
  rows.front().flops = peak * 1e9;

  if (options.csv) {
    std::printf("mechanism,direction,backend,B,T,H,L,D,seconds,tokens_per_s,gflops,extra_bytes\n");
    for (const Row& r : rows)
      std::printf("%s,%s,%s,%td,%td,%td,%td,%td,%.6e,%.6e,%.3f,%lld\n", r.mechanism.c_str(),
                  r.direction.c_str(), r.mechanism == "fma_peak" ? "machine" : "latte-cpu", r.B,
                  r.T, r.H, r.L, r.D, r.seconds,
                  r.seconds > 0 ? double(r.B * r.T) / r.seconds : 0.0, r.flops / r.seconds / 1e9,
                  r.extra_bytes);
    return 0;
  }
  std::printf("latte-compare: exec::cpu, fp32, B=%td H=%td L=%td D=%td; FMA peak %.1f GFLOP/s\n\n",
              B, H, L, D, peak);
  std::printf("%-22s %-14s %9s %12s %10s %9s %12s %14s\n", "mechanism", "direction", "T",
              "seconds", "GFLOP/s", "of peak", "extra bytes", "vs softmax");
  for (const Row& r : rows) {
    if (r.mechanism == "fma_peak") continue;
    double baseline = 0;
    for (const Row& s : rows)
      if (s.mechanism == (r.mechanism.find("decode") != std::string::npos ? "softmax_decode_step"
                                                                          : "softmax") &&
          s.T == r.T)
        baseline = s.seconds;
    // Serving rows: the pool step against the KV-cache step of as many sequences,
    // packed prefill against one sequence of the same total length.
    for (const Row& s : rows)
      if ((r.mechanism == "latte_pool_step" && s.mechanism == "softmax_pool_step" && s.B == r.B) ||
          (r.mechanism == "latte_forward_packed" && s.mechanism == "latte_one_sequence" && s.T == r.T) ||
          ((r.mechanism == "latte_bf16" || r.mechanism == "latte_bf16_products") &&
           s.mechanism == "latte_fp32" && s.T == r.T && s.direction == r.direction) ||
          (r.mechanism == "latte_compensated" && s.mechanism == "latte_plain" && s.T == r.T) ||
          (r.mechanism == "latte_step_compensated" && s.mechanism == "latte_step_plain") ||
          (r.mechanism == "linear_compensated" && s.mechanism == "linear_plain" && s.T == r.T) ||
          (r.mechanism == "linear_step_compensated" && s.mechanism == "linear_step_plain"))
        baseline = s.seconds;
    char versus[32] = "-";
    if (baseline > 0) std::snprintf(versus, sizeof versus, "%.1fx faster", baseline / r.seconds);
    const double gflops = r.flops / r.seconds / 1e9;
    std::printf("%-22s %-14s %9td %12.5f %10.1f %8.0f%% %12lld %14s\n", r.mechanism.c_str(),
                r.direction.c_str(), r.T, r.seconds, gflops, peak > 0 ? 100 * gflops / peak : 0.0,
                r.extra_bytes, versus);
  }
  index_t crossover = 0;
  for (const Row& r : rows)
    if (r.mechanism == "latte" && r.direction == "causal")
      for (const Row& s : rows)
        if (s.mechanism == "softmax" && s.T == r.T && r.seconds < s.seconds && crossover == 0)
          crossover = r.T;
  if (crossover)
    std::printf("\ncausal Latte first beats causal softmax at T = %td (of the lengths run)\n",
                crossover);
  return 0;
}
