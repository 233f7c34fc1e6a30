// distributed_prefill — one causal sequence prefilled across MPI ranks, then
// decoded on the last rank (latte/distributed.hpp, docs/distributed.md).
//
// Each rank holds a contiguous slice of the sequence (here: random latent
// logits and values; in a model, the previous layer's output for its tokens).
// latte::distributed::forward computes every rank's outputs as one forward
// over the whole sequence would, while the ranks pass each other only states
// of O(H * L * Dv) values, never keys and values; the last rank ends with the
// decode state of the whole sequence and decodes from it.
//
// With --backward 1 it also times latte::distributed::backward of the same
// slices (the gradients of a loss of the whole sequence's outputs, as in
// training across ranks).
//
// Usage: mpirun -n 2 distributed_prefill [--tokens N] [--repeats R] [--backward 0|1]
//        (defaults: 1048576 tokens, 1 timed prefill, no backward; run as root,
//        Open MPI also wants --allow-run-as-root)
#include <latte/distributed.hpp>

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

namespace {

using latte::index_t;
using Attention = latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR>;
constexpr index_t B = 1, H = 2, L = 16, Dv = 32;  // batch, heads, latents, value features

/// A [B, T, H, D] tensor of N(0, 1) values, drawn with a fast generator.
latte::Tensor<float, 4> random_tensor(std::minstd_rand& rng, index_t tokens, index_t features) {
  latte::Tensor<float, 4> tensor({B, tokens, H, features});
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = normal(rng);
  return tensor;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  std::int64_t tokens = std::int64_t{1} << 20;
  int repeats = 1;
  bool backward = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--tokens") tokens = std::max<std::int64_t>(1, std::atoll(argv[i + 1]));
    if (flag == "--repeats") repeats = std::max(1, std::atoi(argv[i + 1]));
    if (flag == "--backward") backward = std::atoi(argv[i + 1]) != 0;
  }

  // This rank's slice: tokens [first, first + length).
  const std::int64_t first = tokens * rank / ranks, length = tokens * (rank + 1) / ranks - first;
  std::minstd_rand rng(static_cast<unsigned>(1234 + rank));
  const auto query_logits = random_tensor(rng, length, L);
  const auto key_logits = random_tensor(rng, length, L);
  const auto values = random_tensor(rng, length, Dv);
  latte::Tensor<float, 4> out({B, length, H, Dv});
  const Attention attention({.heads = H, .latents = L, .value_dim = Dv});

  // The prefill across ranks, timed from a common start (the fastest of `repeats`).
  double fastest = 1e30;
  auto state = attention.make_state<float>(B);
  for (int repeat = 0; repeat < repeats; ++repeat) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    state = latte::distributed::forward(latte::exec::cpu, MPI_COMM_WORLD, attention,
                                        query_logits.view(), key_logits.view(), values.view(),
                                        out.view());
    MPI_Barrier(MPI_COMM_WORLD);
    fastest = std::min(fastest, MPI_Wtime() - start);
  }
  // The backward across ranks, timed the same way (the fastest of `repeats`).
  double fastest_backward = 0;
  if (backward) {
    const auto d_out = random_tensor(rng, length, Dv);
    latte::Tensor<float, 4> d_query({B, length, H, L}), d_key({B, length, H, L}),
        d_values({B, length, H, Dv});
    fastest_backward = 1e30;
    for (int repeat = 0; repeat < repeats; ++repeat) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double start = MPI_Wtime();
      latte::distributed::backward(latte::exec::cpu, MPI_COMM_WORLD, attention, query_logits.view(),
                                   key_logits.view(), values.view(), d_out.view(),
                                   latte::LatteGradients<float>{d_query.view(), d_key.view(),
                                                                d_values.view()});
      MPI_Barrier(MPI_COMM_WORLD);
      fastest_backward = std::min(fastest_backward, MPI_Wtime() - start);
    }
  }
  std::printf("rank %d of %d: tokens [%lld, %lld) prefilled\n", rank, ranks,
              static_cast<long long>(first), static_cast<long long>(first + length));
  std::fflush(stdout);
  MPI_Barrier(MPI_COMM_WORLD);

  if (rank == ranks - 1) {
    // What moved between ranks: one state per scan round, against ring
    // attention's keys and values of every other rank.
    const double state_kib = static_cast<double>(state.bytes()) / 1024.0;
    const double ring_mib = static_cast<double>(ranks - 1) * static_cast<double>(length) * H *
                            (L + Dv) * sizeof(float) / (1024.0 * 1024.0);
    std::printf("prefill of %lld tokens across %d ranks: %.3f s; a state is %.1f KiB "
                "(ring attention would pass %.1f MiB of keys and values per rank)\n",
                static_cast<long long>(tokens), ranks, fastest, state_kib, ring_mib);
    if (backward)
      std::printf("backward of %lld tokens across %d ranks: %.3f s\n",
                  static_cast<long long>(tokens), ranks, fastest_backward);
    // Decode on from the whole sequence's state, in constant time per token.
    latte::Tensor<float, 3> q({B, H, L}), k({B, H, L}), v({B, H, Dv}), o({B, H, Dv});
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int step = 0; step < 4; ++step) {
      for (auto* x : {&q, &k, &v})
        for (index_t i = 0; i < x->size(); ++i) x->data()[i] = normal(rng);
      attention.step(latte::exec::cpu, state, q.view(), k.view(), v.view(), o.view());
      std::printf("decoded token %lld: out[0, 0, 0:3] = %+.4f %+.4f %+.4f\n",
                  static_cast<long long>(state.position() - 1), o(0, 0, 0), o(0, 0, 1),
                  o(0, 0, 2));
    }
  }
  MPI_Finalize();
  return 0;
}
