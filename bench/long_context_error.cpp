// latte-long-context-error: how the error of fp32 causal states grows with the
// context (docs/numerics.md, "Long contexts"). For causal Latte (H1 L8 D8, the
// shape issue 30 measured) it compares each fp32 path with the same call in
// fp64, row by row (normwise relative error of an output row), and prints the
// worst row error up to each checkpoint 1K, 16K, 64K, 256K, 1M, ... as CSV:
//
//   path,summation,positional,spread,checkpoint,error
//
// Paths: `forward` (exec::cpu, whole sequence), `reference` (exec::reference),
// `decode` (step after step from an empty state; fp32 and fp64 states stepped
// side by side, inputs drawn as they go, so 10^7 steps need no memory).
// `backward-dq`, `backward-dk`, `backward-dv` (exec::cpu backward of causal
// Latte, and `linear-backward-*` of elu+1 linear attention, over the first
// `checkpoint` tokens, d_out N(0, 1)): a gradient row depends on the whole
// future, so each checkpoint is its own backward, and the error is the 90th
// percentile over the 1K-row blocks of their normwise errors (a few rows are
// ill-conditioned at any length: tests/test_long_context.cpp). `conv` (the
// exec::cpu forward of conv-compression attention, group 4, two levels: a
// query reads floor(t / 16) compressed tokens; its compensation has no
// policy, so no plain row).
// Summations: compensated (the default) and plain (PlainSums). Key logits
// N(0, spread^2), query logits and values N(0, 1).
//
// Usage: latte-long-context-error [--tokens N] [--steps S] [--spreads a,b,...]
//        (defaults: 1048576 tokens, 10000000 decode steps, spreads 1,3,10);
//        scripts/long-context.sh runs it and writes docs/long-context-results.csv.
#include <latte/attention.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using latte::index_t;
constexpr index_t H = 1, L = 8, D = 8;

/// The worst row error up to each checkpoint (powers of 4 from 1024).
struct Checkpoints {
  std::vector<index_t> at;
  std::vector<double> worst;
  explicit Checkpoints(index_t last) {
    for (index_t c = 1024; c < last; c *= 4) at.push_back(c);
    at.push_back(last);
    worst.assign(at.size(), 0.0);
  }
  void add(index_t t, double error) {  // row t (0-based)
    for (std::size_t i = 0; i < at.size(); ++i)
      if (t < at[i]) worst[i] = std::max(worst[i], error);
  }
  void print(const char* path, const char* summation, const char* positional, double spread) const {
    for (std::size_t i = 0; i < at.size(); ++i)
      std::printf("%s,%s,%s,%g,%td,%.3e\n", path, summation, positional, spread, at[i], worst[i]);
    std::fflush(stdout);
  }
};

double row_error(const float* got, const double* want) {
  double diff = 0, norm = 0;
  for (index_t d = 0; d < D; ++d) {
    diff += (got[d] - want[d]) * (got[d] - want[d]);
    norm += want[d] * want[d];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

template <class Pos, class Sum>
void forward_paths(index_t T, double spread, const char* positional) {
  std::mt19937_64 rng(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  latte::Tensor<float, 4> q({1, T, H, L}), k({1, T, H, L}), v({1, T, H, D}), out({1, T, H, D});
  latte::Tensor<double, 4> q64({1, T, H, L}), k64({1, T, H, L}), v64({1, T, H, D}),
      want({1, T, H, D});
  for (index_t i = 0; i < q.size(); ++i) {
    q64.data()[i] = q.data()[i] = static_cast<float>(normal(rng));
    k64.data()[i] = k.data()[i] = static_cast<float>(spread * normal(rng));
  }
  for (index_t i = 0; i < v.size(); ++i) v64.data()[i] = v.data()[i] = static_cast<float>(normal(rng));
  const latte::LatteAttention<latte::Causal, latte::RunningMax, Pos, Sum> attention({H, L, D});
  attention.forward(latte::exec::cpu, q64, k64, v64, want.view());
  auto report = [&](const char* path) {
    Checkpoints checkpoints(T);
    for (index_t t = 0; t < T; ++t) checkpoints.add(t, row_error(&out(0, t, 0, 0), &want(0, t, 0, 0)));
    checkpoints.print(path, Sum::name, positional, spread);
  };
  attention.forward(latte::exec::cpu, q, k, v, out.view());
  report("forward");
  attention.forward(latte::exec::reference, q, k, v, out.view());
  report("reference");
}

template <class Pos, class Sum>
void decode_path(index_t steps, double spread, const char* positional) {
  std::mt19937_64 rng(12);
  std::normal_distribution<double> normal(0.0, 1.0);
  const latte::LatteAttention<latte::Causal, latte::RunningMax, Pos, Sum> attention({H, L, D});
  auto state = attention.template make_state<float>(1);
  auto state64 = attention.template make_state<double>(1);
  latte::Tensor<float, 3> q({1, H, L}), k({1, H, L}), v({1, H, D}), out({1, H, D});
  latte::Tensor<double, 3> q64({1, H, L}), k64({1, H, L}), v64({1, H, D}), want({1, H, D});
  Checkpoints checkpoints(steps);
  for (index_t t = 0; t < steps; ++t) {
    for (index_t i = 0; i < L; ++i) {
      q64.data()[i] = q.data()[i] = static_cast<float>(normal(rng));
      k64.data()[i] = k.data()[i] = static_cast<float>(spread * normal(rng));
    }
    for (index_t i = 0; i < D; ++i) v64.data()[i] = v.data()[i] = static_cast<float>(normal(rng));
    attention.step(latte::exec::cpu, state, q, k, v, out.view());
    attention.step(latte::exec::cpu, state64, q64, k64, v64, want.view());
    checkpoints.add(t, row_error(out.data(), want.data()));
  }
  checkpoints.print("decode", Sum::name, positional, spread);
}

/// The 90th percentile of the normwise errors of the 1K-row blocks of got vs want.
double block_p90(const latte::Tensor<float, 4>& got, const latte::Tensor<double, 4>& want) {
  std::vector<double> blocks;
  const index_t T = want.extent(1), width = want.extent(2) * want.extent(3);
  for (index_t t0 = 0; t0 < T; t0 += 1024) {
    double diff = 0, norm = 0;
    for (index_t i = t0 * width; i < std::min(T, t0 + 1024) * width; ++i) {
      diff += (got.data()[i] - want.data()[i]) * (got.data()[i] - want.data()[i]);
      norm += want.data()[i] * want.data()[i];
    }
    blocks.push_back(norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff));
  }
  std::sort(blocks.begin(), blocks.end());
  return blocks[static_cast<std::size_t>(0.9 * static_cast<double>(blocks.size() - 1))];
}

/// `attention`'s exec::cpu backward in fp32 against fp64 at each checkpoint length.
template <class A>
void backward_path(const A& attention, const char* path, const char* summation, index_t T,
                   double spread, const char* positional) {
  std::mt19937_64 rng(13);
  std::normal_distribution<double> normal(0.0, 1.0);
  latte::Tensor<float, 4> q({1, T, H, L}), k({1, T, H, L}), v({1, T, H, D}), g({1, T, H, D});
  latte::Tensor<double, 4> q64({1, T, H, L}), k64({1, T, H, L}), v64({1, T, H, D}),
      g64({1, T, H, D});
  for (index_t i = 0; i < q.size(); ++i) {
    q64.data()[i] = q.data()[i] = static_cast<float>(normal(rng));
    k64.data()[i] = k.data()[i] = static_cast<float>(spread * normal(rng));
  }
  for (index_t i = 0; i < v.size(); ++i) {
    v64.data()[i] = v.data()[i] = static_cast<float>(normal(rng));
    g64.data()[i] = g.data()[i] = static_cast<float>(normal(rng));
  }
  auto first = [](const auto& x, index_t n) {
    using V = std::remove_pointer_t<decltype(x.data())>;
    return latte::TensorView<const V, 4>(x.data(), {1, n, H, x.extent(3)});
  };
  const Checkpoints checkpoints(T);
  for (const index_t n : checkpoints.at) {
    latte::Tensor<double, 4> dq64({1, n, H, L}), dk64({1, n, H, L}), dv64({1, n, H, D});
    latte::Tensor<float, 4> dq({1, n, H, L}), dk({1, n, H, L}), dv({1, n, H, D});
    attention.backward(latte::exec::cpu, first(q64, n), first(k64, n), first(v64, n), first(g64, n),
                       typename A::template Gradients<double>{dq64.view(), dk64.view(), dv64.view()});
    attention.backward(latte::exec::cpu, first(q, n), first(k, n), first(v, n), first(g, n),
                       typename A::template Gradients<float>{dq.view(), dk.view(), dv.view()});
    const std::pair<const char*, double> rows[] = {
        {"dq", block_p90(dq, dq64)}, {"dk", block_p90(dk, dk64)}, {"dv", block_p90(dv, dv64)}};
    for (const auto& [name, error] : rows)
      std::printf("%s-%s,%s,%s,%g,%td,%.3e\n", path, name, summation, positional, spread, n, error);
    std::fflush(stdout);
  }
}

/// Conv-compression's exec::cpu forward (group 4, two levels), fp32 against fp64.
void conv_path(index_t T) {
  const latte::ConvCompressedDims dims{.heads = H, .key_dim = L, .value_dim = D, .group_size = 4,
                                       .levels = 2};
  std::mt19937_64 rng(14);
  std::normal_distribution<double> normal(0.0, 1.0);
  latte::ConvCompressedParams params = latte::ConvCompressedParams::zeros(dims);
  auto fill = [&](auto& tensor, double stddev) {
    for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = stddev * normal(rng);
  };
  for (auto& w : params.conv_weight) fill(w, 1.0 / std::sqrt(4.0 * D));
  for (auto& b : params.conv_bias) fill(b, 0.5);
  for (auto* w : {&params.level_query, &params.level_key, &params.level_value})
    for (auto& m : *w) fill(m, 1.0 / std::sqrt(double(D)));
  fill(params.cross_query, 1.0 / std::sqrt(double(D)));
  fill(params.cross_key, 1.0 / std::sqrt(double(D)));
  fill(params.cross_value, 1.0 / std::sqrt(double(D)));
  const latte::ConvCompressedAttention<latte::Causal> conv(dims, params);
  latte::Tensor<float, 4> q({1, T, H, L}), k({1, T, H, L}), v({1, T, H, D}), out({1, T, H, D});
  latte::Tensor<double, 4> q64({1, T, H, L}), k64({1, T, H, L}), v64({1, T, H, D}),
      want({1, T, H, D});
  for (index_t i = 0; i < q.size(); ++i) {
    q64.data()[i] = q.data()[i] = static_cast<float>(normal(rng));
    k64.data()[i] = k.data()[i] = static_cast<float>(normal(rng));
  }
  for (index_t i = 0; i < v.size(); ++i) v64.data()[i] = v.data()[i] = static_cast<float>(normal(rng));
  conv.forward(latte::exec::cpu, q64, k64, v64, want.view());
  conv.forward(latte::exec::cpu, q, k, v, out.view());
  Checkpoints checkpoints(T);
  for (index_t t = 0; t < T; ++t) checkpoints.add(t, row_error(&out(0, t, 0, 0), &want(0, t, 0, 0)));
  checkpoints.print("conv", "compensated", "none", 1);
}

std::vector<double> parse_list(const std::string& text) {
  std::vector<double> values;
  std::stringstream stream(text);
  for (std::string item; std::getline(stream, item, ',');) values.push_back(std::stod(item));
  return values;
}

}  // namespace

int main(int argc, char** argv) {
  index_t tokens = index_t{1} << 20, steps = 10'000'000;
  std::vector<double> spreads{1, 3, 10};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--tokens") tokens = std::atol(value.c_str());
    else if (flag == "--steps") steps = std::atol(value.c_str());
    else if (flag == "--spreads") spreads = parse_list(value);
    else {
      std::fprintf(stderr, "usage: %s [--tokens N] [--steps S] [--spreads a,b,...]\n", argv[0]);
      return 2;
    }
  }
  std::printf("path,summation,positional,spread,checkpoint,error\n");
  for (const double spread : spreads) {
    forward_paths<latte::NoPositional, latte::CompensatedSums>(tokens, spread, "none");
    forward_paths<latte::NoPositional, latte::PlainSums>(tokens, spread, "none");
    forward_paths<latte::VAPOR, latte::CompensatedSums>(tokens, spread, "vapor");
    if (steps > 0) {
      decode_path<latte::NoPositional, latte::CompensatedSums>(steps, spread, "none");
      decode_path<latte::NoPositional, latte::PlainSums>(steps, spread, "none");
    }
    using latte::Causal, latte::RunningMax, latte::NoPositional;
    backward_path(latte::LatteAttention<Causal, RunningMax>({H, L, D}), "backward", "compensated",
                  tokens, spread, "none");
    backward_path(latte::LatteAttention<Causal, RunningMax, NoPositional, latte::PlainSums>({H, L, D}),
                  "backward", "plain", tokens, spread, "none");
  }
  const latte::LinearDims dims{H, L, D};
  backward_path(latte::LinearAttention<latte::Causal, latte::EluPlusOne>(dims), "linear-backward",
                "compensated", tokens, 1, "none");
  backward_path(latte::LinearAttention<latte::Causal, latte::EluPlusOne, latte::NoReweight,
                                       latte::NoPositional, latte::PlainSums>(dims),
                "linear-backward", "plain", tokens, 1, "none");
  conv_path(tokens);
  return 0;
}
