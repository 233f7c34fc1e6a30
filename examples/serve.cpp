// serve — a toy inference-server loop over causal Latte (docs/serving.md).
//
// Requests arrive with random prompt lengths (log-uniform in --min-prompt ..
// --max-prompt) and ask for a random number of new tokens. Each iteration of the
// loop admits waiting requests into free slots of a latte::StatePool and prefills
// all of them in one packed call (latte::forward_packed over cu_seqlens). Then one
// pool.step advances every live request by one token, each at its own position.
// Requests that have their tokens retire and free their slots. The model around
// the attention is left out: the "next token"'s query / key / value projections
// are random here, as are the prompts'. With --bf16 1 the prompts arrive in
// bfloat16, as a server keeps its activations, and are prefilled through
// latte::HalfPrecision (fp32 sums and states; docs/serving.md).
//
// Usage: serve [--requests N] [--slots S] [--min-prompt P] [--max-prompt P]
//              [--max-new T] [--seed S] [--bf16 0|1]
//        (defaults: 64 requests, 16 slots, prompts 64..2048, up to 256 new tokens)
#include <latte/attention.hpp>

#include "example_support.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using example::random_tensor;
using latte::index_t;
using Attention = latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR>;

constexpr index_t H = 8, L = 64, D = 64;  // heads, latents, value features

struct Request {
  index_t prompt = 0, wanted = 0, generated = 0;
  latte::PoolSlot slot;
};

struct Options {
  int requests = 64, slots = 16;
  index_t min_prompt = 64, max_prompt = 2048, max_new = 256;
  unsigned seed = 1;
  bool bf16 = false;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "serve: %s needs a value\n", flag.c_str());
      std::exit(2);
    }
    const long value = std::strtol(argv[++i], nullptr, 10);
    if (flag == "--requests") o.requests = int(value);
    else if (flag == "--slots") o.slots = int(value);
    else if (flag == "--min-prompt") o.min_prompt = value;
    else if (flag == "--max-prompt") o.max_prompt = value;
    else if (flag == "--max-new") o.max_new = value;
    else if (flag == "--seed") o.seed = unsigned(value);
    else if (flag == "--bf16") o.bf16 = value != 0;
    else {
      std::fprintf(stderr, "serve: unknown flag %s\n", flag.c_str());
      std::exit(2);
    }
  }
  if (o.requests < 1 || o.slots < 1 || o.min_prompt < 1 || o.max_prompt < o.min_prompt || o.max_new < 1) {
    std::fprintf(stderr, "serve: need requests, slots, min-prompt, max-new >= 1 and max-prompt >= min-prompt\n");
    std::exit(2);
  }
  return o;
}

latte::Tensor<latte::bfloat16, 4> to_bf16(const latte::Tensor<float, 4>& x) {
  latte::Tensor<latte::bfloat16, 4> y(x.extents());
  for (index_t i = 0; i < x.size(); ++i) y.data()[i] = latte::bfloat16(x.data()[i]);
  return y;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::mt19937 rng(o.seed);
  const Attention attention({.heads = H, .latents = L, .value_dim = D});
  latte::StatePool<Attention, float> pool(attention, o.slots);

  // The requests, in arrival order.
  std::uniform_real_distribution<double> log_prompt(std::log(double(o.min_prompt)), std::log(double(o.max_prompt)));
  std::uniform_int_distribution<index_t> new_tokens(1, o.max_new);
  std::vector<Request> waiting;
  for (int i = 0; i < o.requests; ++i)
    waiting.push_back({static_cast<index_t>(std::llround(std::exp(log_prompt(rng)))), new_tokens(rng), 0, {}});
  std::reverse(waiting.begin(), waiting.end());  // pop_back() takes the oldest

  std::vector<Request> live;
  index_t prompt_tokens = 0, decoded_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  int steps = 0, prefills = 0, retired = 0;
  while (!waiting.empty() || !live.empty()) {
    // Admit what fits and prefill the new requests together.
    std::vector<latte::PoolSlot> admitted;
    std::vector<index_t> cu_seqlens{0};
    while (!waiting.empty() && pool.live() < pool.capacity()) {
      Request r = waiting.back();
      waiting.pop_back();
      r.slot = pool.acquire();
      admitted.push_back(r.slot);
      cu_seqlens.push_back(cu_seqlens.back() + r.prompt);
      live.push_back(r);
    }
    if (!admitted.empty()) {
      const index_t total = cu_seqlens.back();
      auto q = random_tensor<4>(rng, {1, total, H, L}), k = random_tensor<4>(rng, {1, total, H, L});
      auto v = random_tensor<4>(rng, {1, total, H, D});
      latte::Tensor<float, 4> out({1, total, H, D});
      if (o.bf16) {
        // The prompts in bf16; the admitted slots' fp32 states continue from them.
        const auto q16 = to_bf16(q), k16 = to_bf16(k), v16 = to_bf16(v);
        latte::Tensor<latte::bfloat16, 4> out16({1, total, H, D});
        std::vector<Attention::State<float>*> states;
        for (const latte::PoolSlot& slot : admitted) states.push_back(&pool.state(slot));
        const auto start = Clock::now();
        latte::forward_packed(latte::HalfPrecision(attention), latte::exec::cpu, cu_seqlens,
                              std::make_tuple(q16.cview(), k16.cview(), v16.cview()), out16.view(), states);
        prefill_seconds += seconds_since(start);
      } else {
        const auto start = Clock::now();
        pool.forward_packed(latte::exec::cpu, admitted, cu_seqlens, std::make_tuple(q.cview(), k.cview(), v.cview()),
                            out.view());
        prefill_seconds += seconds_since(start);
      }
      prompt_tokens += total;
      ++prefills;
    }
    // One decode step for every live request, each at its own position.
    const auto N = static_cast<index_t>(live.size());
    std::vector<latte::PoolSlot> slots;
    for (const Request& r : live) slots.push_back(r.slot);
    auto q = random_tensor<3>(rng, {N, H, L}), k = random_tensor<3>(rng, {N, H, L});
    auto v = random_tensor<3>(rng, {N, H, D});
    latte::Tensor<float, 3> out({N, H, D});
    const auto start = Clock::now();
    pool.step(latte::exec::cpu, slots, std::make_tuple(q.cview(), k.cview(), v.cview()), out.view());
    decode_seconds += seconds_since(start);
    decoded_tokens += N;
    ++steps;
    // Retire the requests that have all their tokens.
    for (std::size_t i = live.size(); i-- > 0;)
      if (++live[i].generated == live[i].wanted) {
        pool.release(live[i].slot);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        ++retired;
      }
  }
  std::printf("serve: %d requests through %d slots (causal Latte + VAPOR, H=%td L=%td D=%td, %s prompts, exec::cpu)\n",
              retired, o.slots, H, L, D, o.bf16 ? "bf16" : "fp32");
  std::printf("  prefill: %td prompt tokens in %d packed calls, %.3f s, %.0f tokens/s\n", prompt_tokens, prefills,
              prefill_seconds, double(prompt_tokens) / prefill_seconds);
  std::printf("  decode:  %td tokens in %d steps over the live requests, %.3f s, %.0f tokens/s\n", decoded_tokens,
              steps, decode_seconds, double(decoded_tokens) / decode_seconds);
  return retired == o.requests ? 0 : 1;
}
