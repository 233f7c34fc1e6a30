#pragma once
// Sequence parallelism for causal convolutional-compression attention
// (paper 003 §4, DESIGN §3.5) over MPI: the level pipeline.
//
//   auto state = latte::distributed::forward(latte::exec::cpu, comm, attention,
//                                            q_slice, k_slice, v_slice, out_slice);
//
// Its state is not a sum of independent slice summaries: a slice's window
// outputs y^(l) read the last tokens of the slices before it, and a group of M
// tokens (the convolution's input) can straddle slices. So the state before
// each rank's slice is built level by level (docs/distributed.md):
//   for l = 0 .. L-1, over the tokens of level l (the inputs, then c^(l)), which
//   a rank owns when their group ends inside its slice:
//     1. a scan of rings: each rank gets the last R = window_left + 1 keys and
//        values of level l before its first level-l token (the halo);
//     2. each rank computes y^(l) of its level-l tokens from that ring (level 0
//        on exec::cpu: the blocked windowed softmax, its first rows again from
//        the ring);
//     3. a scan of open groups' partial sums: each rank gets the convolution's
//        partial sum of the group its first level-l token falls in;
//     4. each rank completes the groups that end in its slice: c^(l+1), and
//        its projections (level l + 1's, or the cross read's at l + 1 = L);
//   then every rank sends its top-level tokens Wk_x c^(L), Wv_x c^(L) to the
//   ranks after it (MPI_Alltoallv): T / M^L tokens in all.
// The rings, partial sums and top-level tokens before the slice are exactly
// what the causal decode state holds (ConvCompressedState), so each rank
// assembles that state and runs its slice's forward from it. The last rank's
// returned state is the decode state of the whole sequence.
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "latte/backends/cpu/conv_compressed.hpp"
#include "latte/backends/reference/conv_compressed.hpp"
#include "latte/backends/reference/softmax.hpp"
#include "latte/core/crc32c.hpp"
#include "latte/distributed/agreement.hpp"
#include "latte/distributed/sequence_parallel.hpp"
#include "latte/distributed/state_scan.hpp"
#include "latte/mechanisms/conv_compressed_attention.hpp"

namespace latte::distributed {

template <>
struct SequenceParallel<ConvCompressedAttention<Causal>> {
  using Attention = ConvCompressedAttention<Causal>;
  [[nodiscard]] static std::array<index_t, 3> dims(const Attention& attention) noexcept {
    return {attention.dims().heads, attention.dims().key_dim, attention.dims().value_dim};
  }
  /// The hierarchy's sizes, the window, the scale and every weight.
  static void describe(latte::detail::ByteSink& sink, const Attention& attention) {
    const auto& dims = attention.dims();
    sink.put(dims.group_size);
    sink.put(dims.levels);
    sink.put(attention.window().left);
    sink.put(attention.scale());
    const auto& w = attention.weights<double>();
    for (const auto* part : {&w.conv_weight, &w.conv_bias, &w.level_query, &w.level_key,
                             &w.level_value, &w.cross_query, &w.cross_key, &w.cross_value})
      sink.put_raw(part->data(), part->size() * sizeof(double));
  }
};

namespace detail {

/// What one scan of the level pipeline carries about a run of level tokens
/// [first, end): a ring's R slots (keys, then values, per head) or the partial
/// convolution sum of the group open at `end` (per head). first and end are
/// set from the slice layout (exclusive_scan's make), never sent.
template <Real T>
struct LevelPiece {
  std::int64_t first = 0, end = 0;
  std::vector<T> data;
  [[nodiscard]] std::size_t field_count() const noexcept { return 1; }
  [[nodiscard]] std::size_t field_size(std::size_t) const noexcept { return data.size(); }
  [[nodiscard]] T* field(std::size_t) noexcept { return data.data(); }
  [[nodiscard]] const T* field(std::size_t) const noexcept { return data.data(); }
};

/// One rank's part of the level pipeline for a [B, T, H, *] slice starting at
/// input token `first`.
template <Real T>
class ConvCompressedPipeline {
 public:
  using Attention = ConvCompressedAttention<Causal>;

  ConvCompressedPipeline(MPI_Comm comm, const SliceLayout& layout, const Attention& attention,
                         index_t batch)
      : comm_(comm),
        layout_(layout),
        w_(attention.weights<T>()),
        heads_(batch * attention.dims().heads),
        H_(attention.dims().heads),
        Dk_(attention.dims().key_dim),
        Dv_(attention.dims().value_dim),
        M_(attention.dims().group_size),
        L_(attention.dims().levels),
        left_(attention.window().left),
        scale_(static_cast<T>(attention.scale())) {}

  /// The ring slot count R the state uses, and the pieces' sizes.
  void set_ring(index_t ring) noexcept { ring_ = ring; }

  /// Level-l token index where input token `position` falls: floor(position / M^l).
  [[nodiscard]] std::int64_t level_index(std::int64_t position, index_t level) const noexcept {
    return position / reference::tokens_per_compressed_token(M_, level);
  }

  /// Runs the pipeline over this rank's slice and fills `state` (fresh, of the
  /// agreed capacity) with what comes before the slice.
  template <class E>
  void state_before(E, const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                    const TensorView<const T, 4>& v, ConvCompressedState<T>& state) {
    const std::int64_t a = layout_.first(), b = a + layout_.length();
    const bool last = layout_.rank == layout_.ranks - 1;
    // Level l's owned tokens: queries, keys, values [heads][n][*] (level 0: the inputs).
    std::vector<T> level_q, level_k, level_v;
    for (index_t level = 0; level < L_; ++level) {
      const std::int64_t first = level_index(a, level), end = level_index(b, level);
      const index_t n = static_cast<index_t>(end - first);
      auto q_of = [&](index_t bh, index_t j) -> const T* {
        return level == 0 ? q.row(bh / H_, j, bh % H_) : level_q.data() + (bh * n + j) * Dk_;
      };
      auto k_of = [&](index_t bh, index_t j) -> const T* {
        return level == 0 ? k.row(bh / H_, j, bh % H_) : level_k.data() + (bh * n + j) * Dk_;
      };
      auto v_of = [&](index_t bh, index_t j) -> const T* {
        return level == 0 ? v.row(bh / H_, j, bh % H_) : level_v.data() + (bh * n + j) * Dv_;
      };
      // 1. The ring before this rank's level-l tokens.
      LevelPiece<T> ring = ring_piece(first, end);
      for (std::int64_t j = last ? end : std::max(first, end - ring_); j < end; ++j)
        for (index_t bh = 0; bh < heads_; ++bh)
          store_slot(ring, bh, j, k_of(bh, static_cast<index_t>(j - first)),
                     v_of(bh, static_cast<index_t>(j - first)));
      std::optional<LevelPiece<T>> ring_before = exclusive_scan(
          comm_, layout_, false, std::move(ring),
          [&](int lowest, int highest) {
            return ring_piece(level_index(layout_.first_of(lowest), level),
                              level_index(layout_.first_of(highest + 1), level));
          },
          [&](LevelPiece<T>& earlier, const LevelPiece<T>& later) { append_ring(earlier, later); });
      if (ring_before) copy_ring(*ring_before, level, state);

      // 2. y^(l) of the owned tokens (the last rank's are nobody's input).
      std::vector<T> y(last ? 0 : static_cast<std::size_t>(heads_ * n * Dv_));
      LevelPiece<T> working = ring_before ? *ring_before : ring_piece(first, first);
      if (!last && level == 0 && std::is_same_v<E, exec::cpu_t>) {  // the blocked window
        Tensor<T, 4> y0({heads_ / H_, n, H_, Dv_});
        cpu::window_outputs_after_ring(q, k, v, y0.view(), scale_, left_, ring_, first,
                                       [&](index_t b, index_t h) { return slots(working, b * H_ + h); });
        for (index_t bh = 0; bh < heads_; ++bh)
          for (index_t j = 0; j < n; ++j)
            std::copy_n(y0.view().row(bh / H_, j, bh % H_), Dv_, y.data() + (bh * n + j) * Dv_);
      } else if (!last) {
        for (index_t bh = 0; bh < heads_; ++bh)
          for (index_t j = 0; j < n; ++j) {
            const std::int64_t index = first + j;
            reference::softmax_decode_step(
                q_of(bh, j), k_of(bh, j), v_of(bh, j), y.data() + (bh * n + j) * Dv_,
                slots(working, bh), ring_, Dk_, Dv_, scale_, index,
                static_cast<index_t>(left_ >= index ? index + 1 : left_ + 1));
          }
      }

      // 3. The open group's partial sum before this rank's level-l tokens.
      LevelPiece<T> group = group_piece(first, end);
      if (!last)
        for (std::int64_t j = std::max(first, end / M_ * M_); j < end; ++j)
          for (index_t bh = 0; bh < heads_; ++bh)
            add_tap(level, bh, j, y.data() + (bh * n + (j - first)) * Dv_,
                    group.data.data() + bh * Dv_);
      std::optional<LevelPiece<T>> group_before = exclusive_scan(
          comm_, layout_, false, std::move(group),
          [&](int lowest, int highest) {
            return group_piece(level_index(layout_.first_of(lowest), level),
                               level_index(layout_.first_of(highest + 1), level));
          },
          [&](LevelPiece<T>& earlier, const LevelPiece<T>& later) { append_group(earlier, later); });
      if (group_before)
        for (index_t bh = 0; bh < heads_; ++bh)
          std::copy_n(group_before->data.data() + bh * Dv_, Dv_,
                      state.carry(bh / H_, bh % H_).group_sums + level * Dv_);

      // 4. The groups that end in this slice: c^(l+1) and its projections.
      const std::int64_t up_first = level_index(a, level + 1), up_end = level_index(b, level + 1);
      const index_t up = static_cast<index_t>(up_end - up_first);
      std::vector<T> next_q, next_k, next_v, c(static_cast<std::size_t>(Dv_)),
          sum(static_cast<std::size_t>(Dv_));
      const bool top = level + 1 == L_;
      if (!last) {
        next_q.resize(static_cast<std::size_t>(top ? 0 : heads_ * up * Dk_));
        next_k.resize(static_cast<std::size_t>(heads_ * up * Dk_));
        next_v.resize(static_cast<std::size_t>(heads_ * up * Dv_));
        for (index_t bh = 0; bh < heads_; ++bh)
          for (index_t g = 0; g < up; ++g) {
            const std::int64_t start = (up_first + g) * M_;
            if (start < first) std::copy_n(group_before->data.data() + bh * Dv_, Dv_, sum.data());
            else std::fill(sum.begin(), sum.end(), T(0));
            for (std::int64_t j = std::max(start, first); j < start + M_; ++j)
              add_tap(level, bh, j, y.data() + (bh * n + (j - first)) * Dv_, sum.data());
            const index_t h = bh % H_;
            reference::close_group(sum.data(), w_.bias(level + 1, h), c.data(), Dv_);
            T* key = next_k.data() + (bh * up + g) * Dk_;
            T* value = next_v.data() + (bh * up + g) * Dv_;
            if (top) {
              reference::matvec(w_.cross_key_projection(h), c.data(), key, Dk_, Dv_);
              reference::matvec(w_.cross_value_projection(h), c.data(), value, Dv_, Dv_);
            } else {
              reference::matvec(w_.query_projection(level + 1, h), c.data(),
                                next_q.data() + (bh * up + g) * Dk_, Dk_, Dv_);
              reference::matvec(w_.key_projection(level + 1, h), c.data(), key, Dk_, Dv_);
              reference::matvec(w_.value_projection(level + 1, h), c.data(), value, Dv_, Dv_);
            }
          }
      }
      level_q = std::move(next_q), level_k = std::move(next_k), level_v = std::move(next_v);
    }
    send_top_tokens(level_k, level_v, state);
    state.advance(a);
  }

 private:
  [[nodiscard]] LevelPiece<T> ring_piece(std::int64_t first, std::int64_t end) const {
    return {first, end, std::vector<T>(static_cast<std::size_t>(heads_ * ring_ * (Dk_ + Dv_)))};
  }
  [[nodiscard]] LevelPiece<T> group_piece(std::int64_t first, std::int64_t end) const {
    return {first, end, std::vector<T>(static_cast<std::size_t>(heads_ * Dv_))};
  }
  /// Where head bh's ring lies in a ring piece: every head's keys [R][Dk], then
  /// every head's values [R][Dv] (the state's layout of one level's ring).
  [[nodiscard]] index_t keys_at(index_t bh) const noexcept { return bh * ring_ * Dk_; }
  [[nodiscard]] index_t values_at(index_t bh) const noexcept {
    return heads_ * ring_ * Dk_ + bh * ring_ * Dv_;
  }
  [[nodiscard]] reference::KVSlots<T> slots(LevelPiece<T>& piece, index_t bh) const noexcept {
    return {piece.data.data() + keys_at(bh), piece.data.data() + values_at(bh)};
  }
  void store_slot(LevelPiece<T>& piece, index_t bh, std::int64_t index, const T* key,
                  const T* value) const {
    const auto slot = static_cast<index_t>(index % ring_);
    const reference::KVSlots<T> ring = slots(piece, bh);
    std::copy_n(key, Dk_, ring.keys + slot * Dk_);
    std::copy_n(value, Dv_, ring.values + slot * Dv_);
  }
  /// earlier <- the ring after earlier's tokens, then later's.
  void append_ring(LevelPiece<T>& earlier, const LevelPiece<T>& later) const {
    for (std::int64_t j = std::max(later.first, later.end - ring_); j < later.end; ++j) {
      const auto slot = static_cast<index_t>(j % ring_);
      for (index_t bh = 0; bh < heads_; ++bh)
        store_slot(earlier, bh, j, later.data.data() + keys_at(bh) + slot * Dk_,
                   later.data.data() + values_at(bh) + slot * Dv_);
    }
    earlier.end = later.end;
  }
  /// earlier <- the partial sum of the group open after later's tokens: later's
  /// alone if that group starts inside later, else the two added.
  void append_group(LevelPiece<T>& earlier, const LevelPiece<T>& later) const {
    if (later.end / M_ * M_ >= later.first) earlier.data = later.data;
    else
      for (std::size_t i = 0; i < earlier.data.size(); ++i) earlier.data[i] += later.data[i];
    earlier.end = later.end;
  }
  /// sum += W^(level+1)_{index mod M} y (a tap of the convolution into c^(level+1)).
  void add_tap(index_t level, index_t bh, std::int64_t index, const T* y, T* sum) const {
    const auto tap = static_cast<index_t>(index % M_);
    reference::conv_tap(w_.conv(level + 1, bh % H_) + tap * Dv_ * Dv_, y, sum, Dv_, false);
  }
  void copy_ring(LevelPiece<T>& ring, index_t level, ConvCompressedState<T>& state) const {
    for (index_t bh = 0; bh < heads_; ++bh) {
      const reference::ConvCompressedCarry<T> carry = state.carry(bh / H_, bh % H_);
      const reference::KVSlots<T> from = slots(ring, bh);
      std::copy_n(from.keys, ring_ * Dk_, carry.window_keys + level * ring_ * Dk_);
      std::copy_n(from.values, ring_ * Dv_, carry.window_values + level * ring_ * Dv_);
    }
  }
  /// Every rank's top-level tokens [heads][n][Dk] and [heads][n][Dv] to every
  /// later rank, into the state's compressed store at their indices.
  void send_top_tokens(const std::vector<T>& keys, const std::vector<T>& values,
                       ConvCompressedState<T>& state) const {
    const int P = layout_.ranks, rank = layout_.rank;
    auto top_of = [&](int r) {
      return std::pair{level_index(layout_.first_of(r), L_), level_index(layout_.first_of(r + 1), L_)};
    };
    const std::int64_t per_token = heads_ * (Dk_ + Dv_);
    std::vector<int> send_counts(static_cast<std::size_t>(P)), receive_counts(send_counts),
        send_offsets(send_counts), receive_offsets(send_counts);
    const auto [own_first, own_end] = top_of(rank);
    std::int64_t offset = 0;
    for (int r = 0; r < P; ++r) {
      const auto [first, end] = top_of(r);
      if (r > rank) send_counts[static_cast<std::size_t>(r)] = static_cast<int>((own_end - own_first) * per_token);
      if (r < rank) {
        receive_counts[static_cast<std::size_t>(r)] = static_cast<int>((end - first) * per_token);
        receive_offsets[static_cast<std::size_t>(r)] = static_cast<int>(offset);
        offset += (end - first) * per_token;
      }
    }
    std::vector<T> outgoing;
    if (rank < P - 1) {
      outgoing.reserve(keys.size() + values.size());
      outgoing.insert(outgoing.end(), keys.begin(), keys.end());
      outgoing.insert(outgoing.end(), values.begin(), values.end());
    }
    std::vector<T> incoming(static_cast<std::size_t>(offset));
    MPI_Alltoallv(outgoing.data(), send_counts.data(), send_offsets.data(), mpi_type<T>(),
                  incoming.data(), receive_counts.data(), receive_offsets.data(), mpi_type<T>(),
                  comm_);
    for (int r = 0; r < rank; ++r) {
      const auto [first, end] = top_of(r);
      const index_t n = static_cast<index_t>(end - first);
      const T* block = incoming.data() + receive_offsets[static_cast<std::size_t>(r)];
      for (index_t bh = 0; bh < heads_; ++bh) {
        const reference::ConvCompressedCarry<T> carry = state.carry(bh / H_, bh % H_);
        std::copy_n(block + bh * n * Dk_, n * Dk_, carry.compressed_keys + first * Dk_);
        std::copy_n(block + heads_ * n * Dk_ + bh * n * Dv_, n * Dv_,
                    carry.compressed_values + first * Dv_);
      }
    }
  }

  MPI_Comm comm_;
  const SliceLayout& layout_;
  const reference::ConvCompressedWeights<T>& w_;
  index_t heads_, H_, Dk_, Dv_, M_, L_, left_;
  T scale_;
  index_t ring_ = 1;
};

}  // namespace detail

/// The causal forward of one sequence cut across the ranks of `comm` (as the
/// forward above, for convolutional-compression attention): returns the state
/// after this rank's slice, able to hold `context_capacity` tokens (default:
/// the whole sequence; give more to decode on from the last rank's state).
/// Every rank passes the same capacity.
template <exec::Policy E, Real T>
[[nodiscard]] ConvCompressedState<T> forward(
    E e, MPI_Comm comm, const ConvCompressedAttention<Causal>& attention,
    std::type_identity_t<TensorView<const T, 4>> queries,
    std::type_identity_t<TensorView<const T, 4>> keys,
    std::type_identity_t<TensorView<const T, 4>> values, TensorView<T, 4> out,
    std::optional<index_t> context_capacity = std::nullopt) {
  using Attention = ConvCompressedAttention<Causal>;
  const index_t B = queries.extent(0), Tn = queries.extent(1);
  const auto& dims = attention.dims();
  detail::CallDescription description =
      detail::describe_call<Attention, T>(detail::Call::forward, attention, B, Tn);
  {  // the capacity is part of the call: ranks must agree on it
    latte::detail::ByteSink sink;
    sink.put(description.fingerprint);
    sink.put(context_capacity.value_or(index_t{-1}));
    description.fingerprint = latte::crc32c(std::span<const std::byte>(sink.bytes));
  }
  const SliceLayout layout = detail::agree(comm, description, [&] {
    latte::check_view(queries, "queries");
    latte::detail::check_positive(B, "batch");
    latte::detail::check_shape(queries, "queries", {B, Tn, dims.heads, dims.key_dim}, "[B, T, H, Dk]");
    latte::detail::check_shape(keys, "keys", {B, Tn, dims.heads, dims.key_dim}, "[B, T, H, Dk]");
    latte::detail::check_shape(values, "values", {B, Tn, dims.heads, dims.value_dim}, "[B, T, H, Dv]");
    latte::detail::check_shape(out, "out", {B, Tn, dims.heads, dims.value_dim}, "[B, T, H, Dv]");
    if (context_capacity)
      latte::detail::check_positive(*context_capacity, "context_capacity");
  });
  const std::int64_t total = layout.total();
  const index_t capacity = context_capacity.value_or(static_cast<index_t>(std::max<std::int64_t>(total, 1)));
  std::optional<ConvCompressedState<T>> state;
  detail::ConvCompressedPipeline<T> pipeline(comm, layout, attention, B);
  detail::agree_without_error(comm, layout.rank, [&] {
    latte::detail::require(capacity >= total, "context_capacity",
                           latte::detail::expected_given("tokens the state can hold",
                                                         ">= the sequence's " + std::to_string(total),
                                                         capacity));
    state = attention.template make_state<T>(B, capacity);
    pipeline.set_ring(state->shape().ring());
    // One scan message, and every top-level token the last rank receives, fit an int count.
    const std::int64_t heads = B * dims.heads, per_token = dims.key_dim + dims.value_dim;
    const std::int64_t ring_elements = heads * state->shape().ring() * per_token;
    const std::int64_t top_elements = pipeline.level_index(total, dims.levels) * heads * per_token;
    latte::detail::require(std::max(ring_elements, top_elements) <= INT_MAX, "context_capacity",
                           latte::detail::expected_given(
                               "elements in one MPI message (a ring, or the top-level tokens)",
                               "<= INT_MAX", std::max(ring_elements, top_elements)));
  });
  pipeline.state_before(e, queries, keys, values, *state);
  attention.forward(e, queries, keys, values, out, *state);
  return std::move(*state);
}

}  // namespace latte::distributed
