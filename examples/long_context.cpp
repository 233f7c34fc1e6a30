// long_context — causal Latte over a million tokens in bounded memory.
//
// The sequence is fed in chunks to the forward that continues from a state
// (attn.forward(exec, q, k, v, out, state)): each chunk starts where the last
// one stopped, so the outputs are those of one forward over the whole
// sequence, while memory holds one chunk of inputs and outputs plus the
// O(H * L * Dv) state. Nothing grows with the sequence length: the peak
// resident memory (getrusage) printed along the way stays flat.
//
// A real model would compute each chunk's latent logits and values from the
// previous layer; here they are random, drawn with a fast generator so that
// drawing them costs little next to the attention itself.
//
// With --fp64-check 1 the same chunks also run through the same attention in
// fp64, and the worst normwise relative error of an fp32 output row against
// its fp64 twin is printed along the way: the states' sums are compensated
// (docs/numerics.md, "Long contexts"), so it stays near 1e-6 at any length
// instead of growing with the context.
//
// Usage: long_context [--tokens N] [--chunk C] [--backend cpu|reference] [--fp64-check 0|1]
//        (defaults: 1048576 tokens, chunks of 4096, cpu: xsimd + OpenMP, no fp64 check)
#include <latte/attention.hpp>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

using Clock = std::chrono::steady_clock;
using latte::index_t;

constexpr index_t B = 1, H = 8, L = 64, Dv = 64;  // batch, heads, latents, value features

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// Peak resident set size of this process so far, in MiB (Linux reports KiB).
double peak_resident_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

/// splitmix64: a small, fast generator of uniform numbers in [-2, 2).
class FastRandom {
 public:
  explicit FastRandom(std::uint64_t seed) : state_(seed) {}
  float next() noexcept {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<float>(z >> 40) * (4.0f / 16777216.0f) - 2.0f;  // 24 random bits
  }
  void fill(latte::TensorView<float, 4> view) noexcept {
    for (index_t b = 0; b < view.extent(0); ++b)
      for (index_t t = 0; t < view.extent(1); ++t)
        for (index_t h = 0; h < view.extent(2); ++h) {
          float* row = view.row(b, t, h);
          for (index_t d = 0; d < view.extent(3); ++d) row[d] = next();
        }
  }

 private:
  std::uint64_t state_;
};

/// The first `tokens` time steps of a [B, T, H, D] tensor.
latte::TensorView<float, 4> first_tokens(latte::Tensor<float, 4>& tensor, index_t tokens) {
  return latte::TensorView<float, 4>(tensor.data(),
                                     {tensor.extent(0), tokens, tensor.extent(2), tensor.extent(3)});
}

double gib(double bytes) { return bytes / double(1 << 30); }

/// The fp64 twin of a chunk: the same values in double.
void widen(latte::TensorView<const float, 4> from, latte::Tensor<double, 4>& to) {
  for (index_t i = 0; i < from.extent(0) * from.extent(1) * from.extent(2) * from.extent(3); ++i)
    to.data()[i] = from.data()[i];
}

/// The worst normwise relative error of an fp32 output row against its fp64 twin.
double worst_row_error(latte::TensorView<const float, 4> got, const latte::Tensor<double, 4>& want,
                       index_t n) {
  double worst = 0;
  for (index_t t = 0; t < n; ++t)
    for (index_t h = 0; h < H; ++h) {
      double diff = 0, norm = 0;
      for (index_t d = 0; d < Dv; ++d) {
        const double x = want(0, t, h, d), e = got(0, t, h, d) - x;
        diff += e * e;
        norm += x * x;
      }
      worst = std::max(worst, norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff));
    }
  return worst;
}

// Runs the chunked forward on the given execution backend; false if an output was not finite.
template <class Exec>
bool run(Exec exec, index_t tokens, index_t chunk, bool fp64_check) {
  std::printf("latte %s long context: causal Latte + VAPOR over %td tokens in chunks of %td\n"
              "B=%td H=%td L=%td Dv=%td, fp32, %s backend\n\n",
              LATTE_VERSION_STRING, tokens, chunk, B, H, L, Dv, Exec::name);
  const double at_start_mib = peak_resident_mib();

  latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR> attn(
      {.heads = H, .latents = L, .value_dim = Dv});
  auto state = attn.make_state<float>(B);

  // One chunk of inputs and outputs, reused for every chunk.
  latte::Tensor<float, 4> query_logits({B, chunk, H, L}), key_logits({B, chunk, H, L});
  latte::Tensor<float, 4> values({B, chunk, H, Dv}), out({B, chunk, H, Dv});
  FastRandom random(2024);
  // The fp64 twin (--fp64-check): its own state and chunk buffers.
  auto state64 = attn.make_state<double>(B);
  latte::Tensor<double, 4> q64({B, fp64_check ? chunk : 0, H, L}), k64({B, fp64_check ? chunk : 0, H, L});
  latte::Tensor<double, 4> v64({B, fp64_check ? chunk : 0, H, Dv}), out64({B, fp64_check ? chunk : 0, H, Dv});
  double worst_error = 0;

  bool finite = true;
  double attention_seconds = 0;
  index_t next_report = std::max<index_t>(tokens / 8, 1);
  std::printf("%12s %12s %14s %16s%s\n", "tokens", "seconds", "tokens/s", "peak RSS (MiB)",
              fp64_check ? "   worst fp32 row error vs fp64" : "");
  const auto start = Clock::now();
  for (index_t done = 0; done < tokens;) {
    const index_t n = std::min(chunk, tokens - done);
    const auto q = first_tokens(query_logits, n), k = first_tokens(key_logits, n);
    const auto v = first_tokens(values, n), o = first_tokens(out, n);
    random.fill(q);
    random.fill(k);
    random.fill(v);

    const auto chunk_start = Clock::now();
    // Continues at position `done` and leaves the state at done + n.
    attn.forward(exec, q, k, v, o, state);
    attention_seconds += seconds_since(chunk_start);
    finite = finite && std::all_of(o.data(), o.data() + n * H * Dv,
                                   [](float x) { return std::isfinite(x); });
    if (fp64_check) {
      widen(q, q64), widen(k, k64), widen(v, v64);
      auto rows = [n](latte::Tensor<double, 4>& x) {
        return latte::TensorView<double, 4>(x.data(), {B, n, H, x.extent(3)});
      };
      attn.forward(exec, rows(q64), rows(k64), rows(v64), rows(out64), state64);
      worst_error = std::max(worst_error, worst_row_error(o, out64, n));
    }
    done += n;

    if (done >= next_report || done == tokens) {
      const double elapsed = seconds_since(start);
      std::printf("%12td %12.2f %14.0f %16.1f", done, elapsed, double(done) / elapsed,
                  peak_resident_mib());
      if (fp64_check) std::printf("   %.2e", worst_error);
      std::printf("\n");
      std::fflush(stdout);
      while (next_report <= done) next_report += std::max<index_t>(tokens / 8, 1);
    }
  }
  const double total_seconds = seconds_since(start);

  const double chunk_buffers = double(chunk) * H * (2 * L + 2 * Dv) * sizeof(float);
  const double whole_sequence = double(tokens) * H * (2 * L + 2 * Dv) * sizeof(float);
  const double kv_cache = double(tokens) * H * (Dv + Dv) * sizeof(float);
  std::printf("\ntime: %.2f s in all, %.2f s in attention (%.1f us per token)\n", total_seconds,
              attention_seconds, attention_seconds * 1e6 / double(tokens));
  std::printf("peak resident memory: %.1f MiB (%.1f MiB before the first chunk)\n",
              peak_resident_mib(), at_start_mib);
  std::printf("  Latte state:                        %10.3f MiB, position %lld\n",
              double(state.bytes()) / (1 << 20), static_cast<long long>(state.position()));
  std::printf("  chunk buffers (q, k, v, out):       %10.3f MiB\n", chunk_buffers / (1 << 20));
  std::printf("  for comparison, not allocated:\n");
  std::printf("    whole-sequence q, k, v, out:      %10.3f GiB\n", gib(whole_sequence));
  std::printf("    softmax KV cache (Dk = Dv = %td):  %10.3f GiB\n", Dv, gib(kv_cache));
  std::printf("sanity check: all outputs finite: %s\n", finite ? "yes" : "NO");
  return finite;
}

}  // namespace

int main(int argc, char** argv) {
  index_t tokens = index_t{1} << 20, chunk = 4096;
  std::string backend = "cpu";
  bool usage_error = false, fp64_check = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) usage_error = true;
    else if (flag == "--tokens") tokens = std::atol(argv[i + 1]);
    else if (flag == "--chunk") chunk = std::atol(argv[i + 1]);
    else if (flag == "--backend") backend = argv[i + 1];
    else if (flag == "--fp64-check") fp64_check = std::string(argv[i + 1]) == "1";
    else usage_error = true;
  }
  if (usage_error || tokens < 1 || chunk < 1 || (backend != "cpu" && backend != "reference")) {
    std::fprintf(stderr,
                 "usage: long_context [--tokens N] [--chunk C] [--backend cpu|reference] "
                 "[--fp64-check 0|1]  (N, C >= 1)\n");
    return 2;
  }
  chunk = std::min(chunk, tokens);

  const bool finite = backend == "cpu" ? run(latte::exec::cpu, tokens, chunk, fp64_check)
                                       : run(latte::exec::reference, tokens, chunk, fp64_check);
  return finite ? 0 : 1;
}
