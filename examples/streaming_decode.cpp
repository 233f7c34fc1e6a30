// streaming_decode — decode one token at a time while the context grows.
//
// Causal Latte keeps a fixed-size state per head (running maximum, normaliser
// and an L x Dv latent memory: O(L * Dv)), so the time and memory per decoded
// token stay flat however long the stream gets. Exact softmax attention keeps
// a KV cache that grows by one key and one value per token, and each token
// attends to all of it: time and memory grow linearly with the context.
//
// The Latte stream really is one stream: every token from 0 to --max-context is
// stepped, and at each checkpoint (1K, 4K, 16K, ... tokens) the median time of
// the last --window steps is printed (a median, so that other programs taking
// the CPU for a moment do not show up as a slow token). Stepping a softmax KV cache token by
// token to 64K costs O(context^2) (minutes on the reference backend), so at
// each checkpoint a cache is filled with that many random keys and values, as
// a prefill would have left it, and --softmax-steps decode steps are timed.
//
// Usage: streaming_decode [--max-context N] [--window W] [--softmax-steps S]
//                         [--backend cpu|reference]
//        (defaults: 65536, 256, 8, cpu: xsimd + OpenMP; reference: the scalar loops)
#include <latte/attention.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using latte::index_t;

constexpr index_t B = 1, H = 8, L = 64, D = 64;  // batch, heads, latents, features (Dk = Dv)

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

template <std::size_t N>
latte::Tensor<float, N> random_tensor(std::mt19937& rng, const std::array<index_t, N>& extents) {
  latte::Tensor<float, N> tensor(extents);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = normal(rng);
  return tensor;
}

template <std::size_t N>
bool all_finite(const latte::Tensor<float, N>& tensor) {
  return std::all_of(tensor.data(), tensor.data() + tensor.size(),
                     [](float x) { return std::isfinite(x); });
}

// The inputs of one decoded token: query, key and value rows [B, H, *].
struct TokenInputs {
  latte::Tensor<float, 3> query, key, value;
};

// A pool of random tokens to cycle through, so that drawing random numbers
// stays out of the timed loops.
std::vector<TokenInputs> token_pool(std::mt19937& rng, index_t query_key_dim, index_t count) {
  std::vector<TokenInputs> pool;
  for (index_t i = 0; i < count; ++i)
    pool.push_back({random_tensor<3>(rng, {B, H, query_key_dim}),
                    random_tensor<3>(rng, {B, H, query_key_dim}), random_tensor<3>(rng, {B, H, D})});
  return pool;
}

// 1K, 4K, 16K, ... up to max_context, and max_context itself.
std::vector<index_t> checkpoints(index_t max_context) {
  std::vector<index_t> marks;
  for (index_t mark = 1024; mark < max_context; mark *= 4) marks.push_back(mark);
  marks.push_back(max_context);
  return marks;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t middle = values.size() / 2;
  return values.size() % 2 ? values[middle] : (values[middle - 1] + values[middle]) / 2;
}

std::string human_bytes(std::size_t bytes) {
  char text[32];
  if (bytes >= (std::size_t{1} << 30)) std::snprintf(text, sizeof text, "%.1f GiB", double(bytes) / (1 << 30));
  else if (bytes >= (std::size_t{1} << 20)) std::snprintf(text, sizeof text, "%.1f MiB", double(bytes) / (1 << 20));
  else std::snprintf(text, sizeof text, "%.1f KiB", double(bytes) / (1 << 10));
  return text;
}

// Streams on the given execution backend; false if an output was not finite.
template <class Exec>
bool stream(Exec exec, index_t max_context, index_t window, index_t softmax_steps) {
  std::printf("latte %s streaming decode: B=%td H=%td L=%td Dv=Dk=%td, fp32, %s backend\n",
              LATTE_VERSION_STRING, B, H, L, D, Exec::name);
  std::printf("Latte: one stream stepped token by token to %td tokens (time: median of the last %td "
              "steps before each mark)\nsoftmax: a KV cache holding the context, median of %td steps\n\n",
              max_context, window, softmax_steps);
  std::printf("%10s | %16s %12s | %18s %12s\n", "context", "Latte us/token", "Latte state",
              "softmax us/token", "KV cache");

  std::mt19937 rng(42);
  constexpr index_t kPool = 64;
  const auto latte_tokens = token_pool(rng, L, kPool);
  const auto softmax_tokens = token_pool(rng, D, kPool);
  latte::Tensor<float, 3> out({B, H, D});
  bool finite = true;

  latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR> latte_attn(
      {.heads = H, .latents = L, .value_dim = D});
  latte::SoftmaxAttention<latte::Causal> softmax_attn({.heads = H, .key_dim = D, .value_dim = D});
  auto state = latte_attn.make_state<float>(B);

  index_t position = 0;  // tokens absorbed by the Latte stream so far
  for (const index_t mark : checkpoints(max_context)) {
    // ---- Latte: step on to `mark`, timing the last `window` steps --------------
    auto step_latte = [&] {
      const TokenInputs& token = latte_tokens[static_cast<std::size_t>(position % kPool)];
      latte_attn.step(exec, state, token.query, token.key, token.value,
                      out.view());
      ++position;
    };
    while (position < mark - window) step_latte();
    std::vector<double> step_seconds;
    while (position < mark) {
      const auto start = Clock::now();
      step_latte();
      step_seconds.push_back(seconds_since(start));
    }
    const double latte_us = median(step_seconds) * 1e6;
    finite = finite && all_finite(out);

    // ---- Softmax: a KV cache holding `mark` tokens, then decode steps ----------
    // What a prefill leaves in the cache are the keys and values of the prompt:
    // write random ones straight into the cache's slots (O(context)) and move
    // its position to `mark`; a stepped fill would cost O(mark^2).
    auto cache = softmax_attn.make_state<float>(B, mark + softmax_steps);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (index_t b = 0; b < B; ++b)
      for (index_t h = 0; h < H; ++h) {
        const auto slots = cache.slots(b, h);
        for (index_t i = 0; i < mark * D; ++i) {
          slots.keys[i] = normal(rng);
          slots.values[i] = normal(rng);
        }
      }
    cache.advance(mark);
    step_seconds.clear();
    for (index_t s = 0; s < softmax_steps; ++s) {
      const TokenInputs& token = softmax_tokens[static_cast<std::size_t>(s % kPool)];
      const auto start = Clock::now();
      softmax_attn.step(exec, cache, token.query, token.key, token.value,
                        out.view());
      step_seconds.push_back(seconds_since(start));
    }
    const double softmax_us = median(step_seconds) * 1e6;
    finite = finite && all_finite(out);

    std::printf("%10td | %16.1f %12s | %18.1f %12s\n", mark, latte_us,
                human_bytes(state.bytes()).c_str(), softmax_us, human_bytes(cache.bytes()).c_str());
    std::fflush(stdout);
  }

  std::printf("\nLatte's time and state per token stay flat as the context grows; the softmax "
              "KV cache and its time per token grow with it.\n");
  std::printf("sanity check: all outputs finite: %s\n", finite ? "yes" : "NO");
  return finite;
}

}  // namespace

int main(int argc, char** argv) {
  index_t max_context = 65536, window = 256, softmax_steps = 8;
  std::string backend = "cpu";
  bool usage_error = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) usage_error = true;
    else if (flag == "--max-context") max_context = std::atol(argv[i + 1]);
    else if (flag == "--window") window = std::atol(argv[i + 1]);
    else if (flag == "--softmax-steps") softmax_steps = std::atol(argv[i + 1]);
    else if (flag == "--backend") backend = argv[i + 1];
    else usage_error = true;
  }
  if (usage_error || max_context < 1 || window < 1 || window > max_context || softmax_steps < 1 ||
      (backend != "cpu" && backend != "reference")) {
    std::fprintf(stderr,
                 "usage: streaming_decode [--max-context N] [--window W] [--softmax-steps S]\n"
                 "                        [--backend cpu|reference]   (N >= W >= 1, S >= 1)\n");
    return 2;
  }

  const bool finite = backend == "cpu"
                          ? stream(latte::exec::cpu, max_context, window, softmax_steps)
                          : stream(latte::exec::reference, max_context, window, softmax_steps);
  return finite ? 0 : 1;
}
