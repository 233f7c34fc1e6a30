#pragma once
// Sequence parallelism over MPI: one causal sequence cut into contiguous
// slices, one per rank of a communicator, whose ranks pass each other states,
// never keys and values (docs/distributed.md).
//
//   auto state = latte::distributed::forward(latte::exec::cpu, comm, attention,
//                                            q_slice, k_slice, v_slice, out_slice);
//
// Forward, for a mechanism whose causal state has an associative merge
// (SequenceParallel<Attention> below: causal Latte, the linear family, Latte
// Macchiato, LAVO, windowed softmax; convolutional compression builds its
// state level by level in conv_compressed_parallel.hpp):
//   1. every rank agrees the call's shapes with the others (agreement.hpp);
//   2. every rank but the last absorbs its slice into a state (its summary:
//      Attention::absorb, no outputs); LAVO's summary needs the keys and
//      values before the slice, so a scan of those (its halo) comes first;
//   3. an exclusive scan of the summaries with the state's merge
//      (State::append_state; state_scan.hpp) gives each rank the state of
//      everything before its slice (Macchiato's and LAVO's with their window
//      rings: the halo travels in the state);
//   4. each rank runs the forward of its slice from that state.
// The state each rank returns is the one after its slice: the last rank's is
// the decode state of the whole sequence.
//
// Backward (Latte and the linear family; the gradients of a loss of the whole
// sequence's outputs): the gradient of the state a slice starts from is affine
// in the gradient of the state it ends with, d_initial(r) = g(r) + D(r)
// d_final(r), with g(r) the part through the slice's own outputs and D(r) the
// state's carry-over (1 for the linear family, exp(m_in - m_out) per latent
// for Latte). Each rank finds g(r) by a backward from its incoming state with
// no final gradient; a reverse exclusive scan sums the g of the ranks after
// each rank (Latte: against the smaller reference, factors <= 1); then Latte
// adds the final state's share in closed form
// (LatteAttention::final_state_backward) and the linear family runs its
// backward again with the summed final gradient. Parameter gradients (VAPOR's
// angles, the LeaP modules' weights) are summed over the ranks and added on
// every rank.
#include <mpi.h>

#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>

#include "latte/core/crc32c.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/tensor.hpp"
#include "latte/distributed/agreement.hpp"
#include "latte/distributed/state_scan.hpp"
#include "latte/mechanisms/latte_attention.hpp"
#include "latte/mechanisms/latte_macchiato.hpp"
#include "latte/mechanisms/lavo.hpp"
#include "latte/mechanisms/linear_attention.hpp"
#include "latte/mechanisms/softmax_attention.hpp"
#include "latte/policies/execution.hpp"

namespace latte::distributed {

namespace detail {

/// Queries / keys [B, T, H, features] and values [B, T, H, Dv] of one rank's
/// slice (Latte's and the linear family's inputs).
template <Real T>
void check_queries_keys_values(const std::tuple<TensorView<const T, 4>, TensorView<const T, 4>,
                                                TensorView<const T, 4>>& inputs,
                               const std::array<index_t, 3>& dims, const char* queries,
                               const char* keys, const char* layout) {
  const auto& [q, k, v] = inputs;
  latte::check_view(q, queries);
  const index_t B = q.extent(0), Tn = q.extent(1);
  latte::detail::check_positive(B, "batch");
  latte::detail::check_shape(q, queries, {B, Tn, dims[0], dims[1]}, layout);
  latte::detail::check_shape(k, keys, {B, Tn, dims[0], dims[1]}, layout);
  latte::detail::check_shape(v, "values", {B, Tn, dims[0], dims[2]}, "[B, T, H, Dv]");
}

/// What the traits of mechanisms whose inputs are queries (or query logits),
/// keys (key logits) and values share: the inputs' tuple, their check, and an
/// absorb of keys and values. `Parallel` names them (queries, keys, layout)
/// and gives dims().
template <class Parallel>
struct QueriesKeysValues {
  template <Real T>
  using Inputs = std::tuple<TensorView<const T, 4>, TensorView<const T, 4>, TensorView<const T, 4>>;
  template <class Attention, Real T>
  static void check_inputs(const Attention& attention, const Inputs<T>& inputs) {
    check_queries_keys_values(inputs, Parallel::dims(attention), Parallel::queries,
                              Parallel::keys, Parallel::layout);
  }
  /// The state after the slice, without its outputs.
  template <class E, class Attention, Real T, class State>
  static void absorb(E e, const Attention& attention, const Inputs<T>& inputs, State& state) {
    attention.absorb(e, std::get<1>(inputs), std::get<2>(inputs), state);
  }
};

}  // namespace detail

/// What sequence parallelism needs of a mechanism beyond its forward, absorb
/// and chunked backward: the names and sizes of its inputs, a description of
/// its parameters (so that ranks holding different attentions are refused),
/// and how two of its states' gradients add. Specialised for the causal
/// mechanisms: LatteAttention, LinearAttention, LatteMacchiato, Lavo,
/// SoftmaxAttention with a SlidingWindow (here) and ConvCompressedAttention
/// (distributed/conv_compressed_parallel.hpp, with its own forward).
template <class Attention>
struct SequenceParallel;

template <Stabilizer Stab, Positional Pos, Summation Sum>
struct SequenceParallel<LatteAttention<Causal, Stab, Pos, Sum>>
    : detail::QueriesKeysValues<SequenceParallel<LatteAttention<Causal, Stab, Pos, Sum>>> {
  using Attention = LatteAttention<Causal, Stab, Pos, Sum>;
  static constexpr bool backward_across_ranks = true;
  static constexpr const char* queries = "query_logits";
  static constexpr const char* keys = "key_logits";
  static constexpr const char* layout = "[B, T, H, L]";

  /// {H, features of a query / key row, Dv}.
  [[nodiscard]] static std::array<index_t, 3> dims(const Attention& attention) noexcept {
    return {attention.dims().heads, attention.dims().latents, attention.dims().value_dim};
  }
  /// VAPOR's angles: ranks must rotate alike.
  static void describe(latte::detail::ByteSink& sink, const Attention& attention) {
    const auto angles = attention.angles();
    sink.put_raw(angles.data(), static_cast<std::size_t>(angles.size()) * sizeof(double));
  }
  /// into <- into + from, two gradients of the stored normaliser and memory
  /// taken against the running maxima in their running_max fields (docs/backward.md):
  /// the sum is taken against the smaller of the two, so that every factor
  /// exp(m_sum - m) is at most 1 (a latent whose reference is -inf on one side
  /// and finite on the other takes nothing from the finite side's terms: they
  /// belong to tokens after an empty prefix, whose stored sums are zero).
  template <Real T>
  static void add_gradient(LatteState<T>& into, const LatteState<T>& from) {
    const index_t L = into.latents(), Dv = into.value_dim();
    const index_t heads = into.batch() * into.heads();
    T* m_into = into.field(0);
    const T* m_from = from.field(0);
    for (index_t i = 0; i < heads * L; ++i) {
      const T m = std::min(m_into[i], m_from[i]);
      auto factor = [&](T reference) { return reference == m ? T(1) : std::exp(m - reference); };
      const T scale_into = factor(m_into[i]), scale_from = factor(m_from[i]);
      T& normaliser = into.field(1)[i];
      normaliser = normaliser * scale_into + from.field(1)[i] * scale_from;
      T* memory = into.field(2) + i * Dv;
      const T* memory_from = from.field(2) + i * Dv;
      for (index_t d = 0; d < Dv; ++d)
        memory[d] = memory[d] * scale_into + memory_from[d] * scale_from;
      m_into[i] = m;
    }
  }
  /// The state-gradient argument of Attention::backward.
  template <Real T>
  using StateGradients = LatteStateGradients<T>;
  /// Checks the buffers backward writes: the inputs' gradients and VAPOR's
  /// angles' [H, Dv/2] (or empty).
  template <Real T, class Inputs>
  static void check_gradients(const Attention& attention, const LatteGradients<T>& gradients,
                              index_t batch, index_t length, const Inputs&) {
    const auto [H, L, Dv] = dims(attention);
    latte::detail::check_shape(gradients.d_query_logits, "gradients.d_query_logits",
                               {batch, length, H, L}, layout);
    latte::detail::check_shape(gradients.d_key_logits, "gradients.d_key_logits",
                               {batch, length, H, L}, layout);
    latte::detail::check_shape(gradients.d_values, "gradients.d_values", {batch, length, H, Dv},
                               "[B, T, H, Dv]");
    if (gradients.d_angles.empty()) return;
    const auto angles = attention.angles();
    latte::detail::require(angles.size() > 0, "gradients.d_angles",
                           "expected empty: this attention has no VAPOR angles");
    latte::detail::check_shape(gradients.d_angles, "gradients.d_angles",
                               {angles.extent(0), angles.extent(1)}, "[H, Dv/2]");
  }
  /// Parameter gradients this rank's slice adds, summed over the ranks and
  /// added into `gradients` on every rank: the call's own `local` buffers.
  template <Real T>
  struct ParameterGradients {
    Tensor<T, 2> d_angles;
    bool wanted;
    ParameterGradients(const Attention&, const LatteGradients<T>& gradients)
        : d_angles({gradients.d_angles.extent(0), gradients.d_angles.extent(1)}),
          wanted(!gradients.d_angles.empty()) {}
    void attach(LatteGradients<T>& local) {
      local.d_angles = wanted ? d_angles.view() : TensorView<T, 2>{};
    }
    void detach(LatteGradients<T>& local) const { local.d_angles = {}; }
    void sum_into(MPI_Comm comm, const LatteGradients<T>& gradients) {
      if (!wanted) return;
      std::vector<T> total(static_cast<std::size_t>(d_angles.size()));
      MPI_Allreduce(d_angles.data(), total.data(), static_cast<int>(total.size()),
                    detail::mpi_type<T>(), MPI_SUM, comm);
      const index_t pairs = d_angles.view().extent(1);
      for (index_t h = 0; h < d_angles.view().extent(0); ++h)
        for (index_t i = 0; i < pairs; ++i)
          gradients.d_angles(h, i) += total[static_cast<std::size_t>(h * pairs + i)];
    }
  };
};

template <FeatureMap Map, Reweight Rw, Positional Pos, Summation Sum>
struct SequenceParallel<LinearAttention<Causal, Map, Rw, Pos, Sum>>
    : detail::QueriesKeysValues<SequenceParallel<LinearAttention<Causal, Map, Rw, Pos, Sum>>> {
  using Attention = LinearAttention<Causal, Map, Rw, Pos, Sum>;
  using Base = detail::QueriesKeysValues<SequenceParallel<Attention>>;
  using Base::absorb;
  using Base::check_inputs;
  static constexpr bool backward_across_ranks = true;
  /// LeaPformer's inputs with precomputed proportions P_q, P_k [B, T, H].
  template <Real T>
  using InputsWithProportions = std::tuple<TensorView<const T, 4>, TensorView<const T, 4>,
                                           TensorView<const T, 4>, SequenceProportions<T>>;
  template <Real T>
    requires(Attention::learned_proportions)
  static void check_inputs(const Attention& attention, const InputsWithProportions<T>& inputs) {
    const auto& [q, k, v, proportions] = inputs;
    check_inputs(attention, std::tuple{q, k, v});
    attention.validate_proportions(proportions, q.extent(0), q.extent(1));
  }
  template <class E, Real T, class State>
    requires(Attention::learned_proportions)
  static void absorb(E e, const Attention& attention, const InputsWithProportions<T>& inputs,
                     State& state) {
    attention.absorb(e, std::get<1>(inputs), std::get<2>(inputs), std::get<3>(inputs), state);
  }
  static constexpr const char* queries = "queries";
  static constexpr const char* keys = "keys";
  static constexpr const char* layout = "[B, T, H, Dk]";

  [[nodiscard]] static std::array<index_t, 3> dims(const Attention& attention) noexcept {
    return {attention.dims().heads, attention.dims().key_dim, attention.dims().value_dim};
  }
  /// The feature dimension, the normaliser, cosFormer's M, the RoPE
  /// denominator and the LeaP modules' weights: ranks must compute alike.
  static void describe(latte::detail::ByteSink& sink, const Attention& attention) {
    const auto& options = attention.options();
    sink.put(attention.feature_dim());
    sink.put(static_cast<int>(options.normaliser.kind));
    sink.put(options.normaliser.value);
    sink.put(static_cast<int>(options.rope_denominator));
    if constexpr (Attention::position_proportions)
      sink.put(options.reweight.length.value_or(index_t{-1}));
    if constexpr (Attention::learned_proportions) {
      sink.put(options.reweight.leap_factor);
      for (const auto* module : {&options.reweight.query_module, &options.reweight.key_module}) {
        if (!module->has_value()) continue;
        sink.put_raw((*module)->w1.data(), static_cast<std::size_t>((*module)->w1.size()) * sizeof(double));
        sink.put_raw((*module)->b1.data(), static_cast<std::size_t>((*module)->b1.size()) * sizeof(double));
        sink.put_raw((*module)->w2.data(), static_cast<std::size_t>((*module)->w2.size()) * sizeof(double));
        sink.put((*module)->b2);
      }
    }
  }
  template <Real T>
  static void add_gradient(LinearState<T>& into, const LinearState<T>& from) {
    for (std::size_t f = 0; f < 2; ++f)  // memory, normaliser (the gradient has no low parts)
      for (std::size_t i = 0; i < into.field_size(f); ++i) into.field(f)[i] += from.field(f)[i];
  }
  template <Real T>
  using StateGradients = LinearStateGradients<T>;
  template <Real T, class Inputs>
  static void check_gradients(const Attention& attention, const LinearGradients<T>& gradients,
                              index_t batch, index_t length, const Inputs&) {
    const auto [H, Dk, Dv] = dims(attention);
    latte::detail::check_shape(gradients.d_queries, "gradients.d_queries", {batch, length, H, Dk},
                               layout);
    latte::detail::check_shape(gradients.d_keys, "gradients.d_keys", {batch, length, H, Dk},
                               layout);
    latte::detail::check_shape(gradients.d_values, "gradients.d_values", {batch, length, H, Dv},
                               "[B, T, H, Dv]");
    for (const auto& [module, name] :
         {std::pair{gradients.d_query_module, "gradients.d_query_module"},
          std::pair{gradients.d_key_module, "gradients.d_key_module"}}) {
      if (module == nullptr) continue;
      if constexpr (Attention::learned_proportions) {
        const auto& own = attention.options().reweight.query_module;
        latte::detail::require(own.has_value(), name,
                               "expected nullptr: this attention has no LeaP modules");
        latte::detail::require(module->w1.view().extents() == own->w1.view().extents() &&
                                   module->w2.size() == own->w2.size(),
                               name, "expected a module shaped as the attention's (zeros_like)");
      } else {
        latte::detail::require(false, name, "expected nullptr: this attention has no LeaP modules");
      }
    }
    constexpr bool given = std::tuple_size_v<Inputs> == 4;  // with proportions
    for (const auto& [d_proportions, name] :
         {std::pair{gradients.d_query_proportions, "gradients.d_query_proportions"},
          std::pair{gradients.d_key_proportions, "gradients.d_key_proportions"}}) {
      if (d_proportions.empty()) continue;
      latte::detail::require(given, name, "expected empty: this call takes no proportions");
      latte::detail::check_shape(d_proportions, name, {batch, length, H}, "[B, T, H]");
    }
  }
  /// The LeaP modules' weight gradients this rank's slice adds, summed over
  /// the ranks (MPI_Allreduce, in double as the backward accumulates them) and
  /// added into the caller's modules on every rank. Given proportions'
  /// gradients are the slice's own (accumulated by the backward pass that
  /// has the final state's gradient only, so they are counted once).
  template <Real T>
  struct ParameterGradients {
    std::optional<LeaPModule> query, key;
    TensorView<T, 3> d_query_proportions, d_key_proportions;
    ParameterGradients(const Attention&, const LinearGradients<T>& gradients)
        : d_query_proportions(gradients.d_query_proportions),
          d_key_proportions(gradients.d_key_proportions) {
      if (gradients.d_query_module) query = gradients.d_query_module->zeros_like();
      if (gradients.d_key_module) key = gradients.d_key_module->zeros_like();
    }
    void attach(LinearGradients<T>& local) {
      local.d_query_module = query ? &*query : nullptr;
      local.d_key_module = key ? &*key : nullptr;
      local.d_query_proportions = d_query_proportions;
      local.d_key_proportions = d_key_proportions;
    }
    void detach(LinearGradients<T>& local) const {
      local.d_query_module = nullptr;
      local.d_key_module = nullptr;
      local.d_query_proportions = {};
      local.d_key_proportions = {};
    }
    void sum_into(MPI_Comm comm, const LinearGradients<T>& gradients) {
      auto sum = [&](LeaPModule& local, LeaPModule& into) {
        std::vector<double> flat;
        auto gather = [&](const auto& tensor) {
          flat.insert(flat.end(), tensor.data(), tensor.data() + tensor.size());
        };
        gather(local.w1), gather(local.b1), gather(local.w2);
        flat.push_back(local.b2);
        MPI_Allreduce(MPI_IN_PLACE, flat.data(), static_cast<int>(flat.size()), MPI_DOUBLE,
                      MPI_SUM, comm);
        const double* from = flat.data();
        auto add = [&](auto& tensor) {
          for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] += *from++;
        };
        add(into.w1), add(into.b1), add(into.w2);
        into.b2 += *from;
      };
      if (query) sum(*query, *gradients.d_query_module);
      if (key) sum(*key, *gradients.d_key_module);
    }
  };
};

/// Latte Macchiato (forward only): the latent carry merges as Latte's, and
/// the state's window ring carries each slice's last w + 1 tokens to the next
/// (the halo the window part of the slice's first tokens reads).
template <Stabilizer Stab, Positional LatentPos, Positional WindowPos>
struct SequenceParallel<LatteMacchiato<Causal, Stab, LatentPos, WindowPos>> {
  using Attention = LatteMacchiato<Causal, Stab, LatentPos, WindowPos>;
  [[nodiscard]] static std::array<index_t, 3> dims(const Attention& attention) noexcept {
    return {attention.dims().heads, attention.dims().latents, attention.dims().value_dim};
  }
  /// The window's sizes, scale and VAPOR scope, and both angle sets.
  static void describe(latte::detail::ByteSink& sink, const Attention& attention) {
    sink.put(attention.dims().key_dim);
    sink.put(attention.dims().window);
    sink.put(attention.scale());
    sink.put(static_cast<int>(attention.vapor_scope()));
    for (const auto angles : {attention.latent_angles(), attention.window_angles()})
      sink.put_raw(angles.data(), static_cast<std::size_t>(angles.size()) * sizeof(double));
  }
  /// The forward's inputs: query logits [.., L + 1], key logits [.., L],
  /// window queries and keys [.., Dk], values [.., Dv].
  template <Real T>
  using Inputs = std::tuple<TensorView<const T, 4>, TensorView<const T, 4>, TensorView<const T, 4>,
                            TensorView<const T, 4>, TensorView<const T, 4>>;
  template <Real T>
  static void check_inputs(const Attention& attention, const Inputs<T>& inputs) {
    const auto& [q, k, wq, wk, v] = inputs;
    latte::check_view(q, "query_logits");
    const index_t B = q.extent(0), Tn = q.extent(1), H = attention.dims().heads;
    const index_t L = attention.dims().latents, Dk = attention.dims().key_dim;
    latte::detail::check_positive(B, "batch");
    latte::detail::check_shape(q, "query_logits", {B, Tn, H, L + 1}, "[B, T, H, L+1]");
    latte::detail::check_shape(k, "key_logits", {B, Tn, H, L}, "[B, T, H, L]");
    latte::detail::check_shape(wq, "window_queries", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    latte::detail::check_shape(wk, "window_keys", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    latte::detail::check_shape(v, "values", {B, Tn, H, attention.dims().value_dim}, "[B, T, H, Dv]");
  }
  template <class E, Real T>
  static void absorb(E e, const Attention& attention, const Inputs<T>& inputs,
                     MacchiatoState<T>& state) {
    attention.absorb(e, std::get<1>(inputs), std::get<3>(inputs), std::get<4>(inputs), state);
  }
};

/// LAVO (forward only): its memory sums the tokens' locally attended outputs,
/// and a slice's first tokens attend to the w tokens before it, so the halo
/// comes first: a scan of rings (LavoState::absorb_window, merged by
/// append_state) gives each rank the keys and values before its slice; its
/// summary then starts from that ring; a second scan merges the summaries
/// (complete windows' sums, the open window's partial sums, the ring).
template <>
struct SequenceParallel<Lavo<Causal>> : detail::QueriesKeysValues<SequenceParallel<Lavo<Causal>>> {
  using Attention = Lavo<Causal>;
  static constexpr bool halo_first = true;
  static constexpr const char* queries = "queries";
  static constexpr const char* keys = "keys";
  static constexpr const char* layout = "[B, T, H, d]";
  [[nodiscard]] static std::array<index_t, 3> dims(const Attention& attention) noexcept {
    return {attention.dims().heads, attention.dims().dim, attention.dims().dim};
  }
  /// The bases, the window, the relative bias, the scale and the empty-memory rule.
  static void describe(latte::detail::ByteSink& sink, const Attention& attention) {
    sink.put(attention.dims().bases);
    sink.put(attention.dims().window);
    sink.put(attention.scale());
    sink.put(static_cast<int>(attention.empty_memory()));
    sink.put_raw(attention.bases().data(),
                 static_cast<std::size_t>(attention.bases().size()) * sizeof(double));
    sink.put_raw(attention.relative_bias().data(),
                 static_cast<std::size_t>(attention.relative_bias().size()) * sizeof(double));
  }
  /// The halo this slice passes on: its last w keys and values.
  template <class E, Real T>
  static void absorb_halo(E, const Attention&, const Inputs<T>& inputs, LavoState<T>& state) {
    state.absorb_window(std::get<1>(inputs), std::get<2>(inputs));
  }
  /// LAVO's absorb takes the queries too (its memory sums local outputs).
  template <class E, Real T>
  static void absorb(E e, const Attention& attention, const Inputs<T>& inputs,
                     LavoState<T>& state) {
    std::apply([&](const auto&... views) { attention.absorb(e, views..., state); }, inputs);
  }
};

/// Causal softmax with a sliding window (forward only): its state is the KV
/// cache's ring of the last window.left + 1 keys and values, so the halo is
/// the whole state; KVCache::append_state lays the later ring over the
/// earlier. (Without a window the cache would hold every key and value
/// before the slice: ring attention's traffic, not a state's.)
template <>
struct SequenceParallel<SoftmaxAttention<Causal, SlidingWindow>>
    : detail::QueriesKeysValues<SequenceParallel<SoftmaxAttention<Causal, SlidingWindow>>> {
  using Attention = SoftmaxAttention<Causal, SlidingWindow>;
  static constexpr const char* queries = "queries";
  static constexpr const char* keys = "keys";
  static constexpr const char* layout = "[B, T, H, Dk]";
  [[nodiscard]] static std::array<index_t, 3> dims(const Attention& attention) noexcept {
    return {attention.dims().heads, attention.dims().key_dim, attention.dims().value_dim};
  }
  /// The window and the scale.
  static void describe(latte::detail::ByteSink& sink, const Attention& attention) {
    sink.put(attention.window().left);
    sink.put(attention.scale());
  }
  /// A cache at `first` (make_state's second argument is a capacity, not a position).
  template <Real T>
  [[nodiscard]] static KVCache<T> make_state(const Attention& attention, index_t batch,
                                             std::int64_t first) {
    KVCache<T> state = attention.template make_state<T>(batch);
    state.advance(first);
    return state;
  }
};

namespace detail {

/// A fresh state of `attention` for `batch` sequences at position `first`.
template <Real T, class Attention>
[[nodiscard]] auto state_at(const Attention& attention, index_t batch, std::int64_t first) {
  using Parallel = SequenceParallel<Attention>;
  if constexpr (requires { Parallel::template make_state<T>(attention, batch, first); })
    return Parallel::template make_state<T>(attention, batch, first);
  else
    return attention.template make_state<T>(batch, first);
}

/// Whether distributed::backward takes a mechanism (it says how its states'
/// gradients add).
template <class Attention>
concept BackwardAcrossRanks = SequenceParallel<Attention>::backward_across_ranks;

/// Whether a mechanism's summaries need the halo of the slices before theirs.
template <class Parallel>
concept HaloFirst = Parallel::halo_first;

/// crc32c of the attention's kind (type and dtype), sizes and parameters.
template <class Attention, Real T>
[[nodiscard]] CallDescription describe_call(Call call, const Attention& attention, index_t batch,
                                            index_t length) {
  using Parallel = SequenceParallel<Attention>;
  latte::detail::ByteSink sink;
  const std::string kind = attention.template kind<T>();
  sink.put_string(kind);
  const auto dims = Parallel::dims(attention);
  for (index_t d : dims) sink.put(d);
  Parallel::describe(sink, attention);
  CallDescription description;
  description.call = call;
  description.batch = batch;
  description.length = length;
  description.heads = dims[0];
  description.features = dims[1];
  description.value_dim = dims[2];
  description.element_bytes = sizeof(T);
  description.fingerprint = latte::crc32c(std::span<const std::byte>(sink.bytes));
  description.attention = kind;
  return description;
}

/// The state before this rank's slice: the forward's steps 2 and 3 (every
/// rank but the last absorbs its slice; an exclusive scan of the summaries).
template <class Attention, class E, Real T, class Inputs>
[[nodiscard]] typename Attention::template State<T> incoming_state(
    E e, MPI_Comm comm, const SliceLayout& layout, const Attention& attention, index_t batch,
    const Inputs& inputs) {
  using State = typename Attention::template State<T>;
  using Parallel = SequenceParallel<Attention>;
  auto scan = [&](State own) {
    std::optional<State> before = exclusive_scan(
        comm, layout, false, std::move(own),
        [&](int, int last) {
          return state_at<T>(attention, batch, layout.first_of(last + 1));
        },
        [](State& earlier, const State& later) { earlier.append_state(later); });
    return before ? std::move(*before) : state_at<T>(attention, batch, 0);
  };
  State summary = state_at<T>(attention, batch, layout.first());
  if constexpr (HaloFirst<Parallel>) {  // the summary starts from the slices' halo before it
    Parallel::absorb_halo(e, attention, inputs, summary);
    summary = scan(std::move(summary));
  }
  if (layout.rank < layout.ranks - 1) Parallel::absorb(e, attention, inputs, summary);
  return scan(std::move(summary));
}

/// Agrees the call and the states, as forward and backward begin.
template <class Attention, Real T, class Check>
[[nodiscard]] SliceLayout agree_call(MPI_Comm comm, Call call, const Attention& attention,
                                     const TensorView<const T, 4>& first_input, Check&& check) {
  const index_t B = first_input.extent(0), Tn = first_input.extent(1);
  const SliceLayout layout =
      agree(comm, describe_call<Attention, T>(call, attention, B, Tn), check);
  // States: made, and checked for room, alike on every rank before the scan.
  agree_without_error(comm, layout.rank, [&] {
    auto probe = state_at<T>(attention, B, layout.first());
    require_sendable(probe);
    attention.validate_state(probe, B, Tn);
  });
  return layout;
}

}  // namespace detail

/// The causal forward of one sequence cut across the ranks of `comm`: this
/// rank holds tokens [first, first + T) of it (its slice, in rank order; the
/// ranks' T may differ and may be 0), as queries / keys [B, T, H, *] and
/// values [B, T, H, Dv], and gets their outputs in `out` [B, T, H, Dv]. Returns
/// the state after this rank's slice (on the last rank, the decode state of
/// the whole sequence). Collective over `comm`: every rank calls it with the
/// same attention and batch; a rank whose inputs are wrong, or ranks that
/// disagree, make every rank throw the same latte::Error before data moves.
/// `inputs` are the forward's, in its order: Latte Macchiato's five views;
/// LeaPformer's queries, keys, values and its SequenceProportions.
template <class Attention, exec::Policy E, Real T, class... Inputs>
  requires((std::is_same_v<Inputs, TensorView<const T, 4>> ||
            std::is_same_v<Inputs, SequenceProportions<T>>) && ...)
[[nodiscard]] typename Attention::template State<T> forward(
    E e, MPI_Comm comm, const Attention& attention,
    const std::tuple<TensorView<const T, 4>, Inputs...>& inputs, TensorView<T, 4> out) {
  using Parallel = SequenceParallel<Attention>;
  const TensorView<const T, 4>& first_input = std::get<0>(inputs);
  const SliceLayout layout =
      detail::agree_call(comm, detail::Call::forward, attention, first_input, [&] {
        Parallel::check_inputs(attention, inputs);
        latte::detail::check_shape(out, "out",
                                   {first_input.extent(0), first_input.extent(1),
                                    Parallel::dims(attention)[0], Parallel::dims(attention)[2]},
                                   "[B, T, H, Dv]");
      });
  auto state = detail::incoming_state<Attention, E, T>(e, comm, layout, attention,
                                                       first_input.extent(0), inputs);
  std::apply([&](const auto&... views) { attention.forward(e, views..., out, state); }, inputs);
  return state;
}

/// The same, for a mechanism whose inputs are queries (or query logits), keys
/// (key logits) and values: causal Latte and the linear family.
template <class Attention, exec::Policy E, Real T>
[[nodiscard]] typename Attention::template State<T> forward(
    E e, MPI_Comm comm, const Attention& attention,
    std::type_identity_t<TensorView<const T, 4>> queries,
    std::type_identity_t<TensorView<const T, 4>> keys,
    std::type_identity_t<TensorView<const T, 4>> values, TensorView<T, 4> out) {
  return forward(e, comm, attention, std::tuple{queries, keys, values}, out);
}

namespace detail {

/// distributed::backward over the forward's inputs as a tuple (queries, keys,
/// values, and LeaPformer's proportions where given).
template <class Attention, class E, Real T, class Inputs, class Gradients>
void backward(E e, MPI_Comm comm, const Attention& attention, const Inputs& inputs,
              const TensorView<const T, 4>& d_out, const Gradients& gradients) {
  using Parallel = SequenceParallel<Attention>;
  using State = typename Attention::template State<T>;
  const TensorView<const T, 4>& queries = std::get<0>(inputs);
  const TensorView<const T, 4>& keys = std::get<1>(inputs);
  const TensorView<const T, 4>& values = std::get<2>(inputs);
  const index_t B = queries.extent(0);
  const SliceLayout layout = agree_call(comm, Call::backward, attention, queries, [&] {
    Parallel::check_inputs(attention, inputs);
    const auto dims = Parallel::dims(attention);
    latte::detail::check_shape(d_out, "d_out", {B, queries.extent(1), dims[0], dims[2]},
                               "[B, T, H, Dv]");
    Parallel::check_gradients(attention, gradients, B, queries.extent(1), inputs);
  });
  const State initial = incoming_state<Attention, E, T>(e, comm, layout, attention, B, inputs);
  auto run_backward = [&](const Gradients& into,
                          const typename Parallel::template StateGradients<T>& states) {
    std::apply([&](const auto&... views) { attention.backward(e, views..., d_out, into, states); },
               inputs);
  };

  // g(r): the gradient of this slice's initial state through its own outputs.
  // The first rank's is not needed (nothing before it); the last rank's final
  // state has no gradient (nothing after it). A mechanism with
  // final_state_backward computes its inputs' gradients in this same backward
  // and adds the final state's share after the scan; the others run their
  // backward again with the final state's gradient.
  constexpr bool adds_final_share = requires(const State& d) {
    attention.final_state_backward(e, keys, values, d, gradients);
  };
  typename Parallel::template ParameterGradients<T> parameters(attention, gradients);
  auto local_gradients = gradients;
  if constexpr (adds_final_share) parameters.attach(local_gradients);
  else parameters.detach(local_gradients);
  State through_outputs = state_at<T>(attention, B, layout.first());
  if (layout.rank > 0 || adds_final_share) {
    typename Parallel::template StateGradients<T> states;
    states.initial = &initial;
    if (layout.rank > 0) states.d_initial = &through_outputs;
    run_backward(local_gradients, states);
  }
  // d_final(r) = sum over later ranks r' of g(r') carried back to r's end.
  std::optional<State> after = exclusive_scan(
      comm, layout, true, std::move(through_outputs),
      [&](int, int) { return state_at<T>(attention, B, 0); },
      [](State& earlier, const State& later) { Parallel::add_gradient(earlier, later); });
  if constexpr (adds_final_share) {
    if (after) {
      after->advance(layout.first() + layout.length() - after->position());  // at the slice's end
      attention.final_state_backward(e, keys, values, *after, local_gradients);
    }
  } else {
    typename Parallel::template StateGradients<T> states;
    states.initial = &initial;
    if (after) states.d_final = &*after;
    parameters.attach(local_gradients);
    run_backward(local_gradients, states);
  }
  parameters.sum_into(comm, gradients);
}

}  // namespace detail

/// The gradients of a loss of the whole sequence's outputs, whose gradient
/// with respect to this rank's outputs is `d_out` [B, T, H, Dv]: writes this
/// rank's inputs' gradients (as Attention::backward), and adds the parameters'
/// gradients (VAPOR's angles, the LeaP modules' weights), summed over every
/// rank, on every rank.
/// Collective over `comm`, with the slices of forward.
template <class Attention, exec::Policy E, class Gradients,
          Real T = typename decltype(Gradients::d_values)::element_type>
  requires detail::BackwardAcrossRanks<Attention> &&
           std::is_same_v<Gradients, typename Attention::template Gradients<T>>
void backward(E e, MPI_Comm comm, const Attention& attention,
              std::type_identity_t<TensorView<const T, 4>> queries,
              std::type_identity_t<TensorView<const T, 4>> keys,
              std::type_identity_t<TensorView<const T, 4>> values,
              std::type_identity_t<TensorView<const T, 4>> d_out, const Gradients& gradients) {
  detail::backward<Attention, E, T>(e, comm, attention, std::tuple{queries, keys, values}, d_out,
                                    gradients);
}

/// As above, for LeaPformer with precomputed proportions P_q, P_k [B, T, H]
/// (this rank's tokens): their gradients accumulate into
/// gradients.d_query_proportions / d_key_proportions (this rank's tokens)
/// where those are not empty.
template <class Attention, exec::Policy E, Real T>
  requires detail::BackwardAcrossRanks<Attention> && Attention::learned_proportions
void backward(E e, MPI_Comm comm, const Attention& attention,
              std::type_identity_t<TensorView<const T, 4>> queries,
              std::type_identity_t<TensorView<const T, 4>> keys,
              std::type_identity_t<TensorView<const T, 4>> values,
              std::type_identity_t<SequenceProportions<T>> proportions,
              std::type_identity_t<TensorView<const T, 4>> d_out,
              const LinearGradients<T>& gradients) {
  detail::backward<Attention, E, T>(e, comm, attention,
                                    std::tuple{queries, keys, values, proportions}, d_out,
                                    gradients);
}

}  // namespace latte::distributed
