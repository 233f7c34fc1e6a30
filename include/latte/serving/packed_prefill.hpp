#pragma once
// Packed variable-length prefill: N sequences of different lengths stored back to
// back along the time axis of [1, total_T, H, *] buffers, delimited by `cu_seqlens`
// (N + 1 offsets into the time axis, the convention of flash-attention's and
// flash-linear-attention's varlen entry points). Each sequence attends only to
// itself and, when states are given, continues from its own state and leaves it at
// the sequence's end, exactly as the mechanism's own forward(..., state) would.
// (Sequences are weighed by their length, or by the attention's prefill_cost where
// it has one: softmax's work grows with the square of the length.)
//
// Any causal mechanism: the call slices every input and the output at the offsets
// and runs the mechanism's forward on each slice. On exec::cpu the sequences are
// spread over the threads: a sequence longer than total_T / threads runs alone on
// all of them (the kernel splits its heads and time), the rest go whole to one
// thread each, longest first onto the least loaded thread (so one 64K prompt and
// fifty short ones keep both cores busy). Which thread runs a sequence depends on
// the lengths and the thread count only, so repeated calls give the same bits.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "latte/backends/cpu/parallel.hpp"
#include "latte/core/error.hpp"
#include "latte/core/half_float.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/execution.hpp"
#include "latte/policies/reweight.hpp"

namespace latte {

/// The N sequences of a packed batch: cu_seqlens[0] == 0, non-decreasing,
/// cu_seqlens[N] == total_T. Empty sequences are allowed (they are skipped).
class PackedSequences {
 public:
  PackedSequences(std::span<const index_t> cu_seqlens, index_t total_tokens) : offsets_(cu_seqlens) {
    detail::require(cu_seqlens.size() >= 2, "cu_seqlens",
                    detail::expected_given("size", "N + 1 >= 2 offsets", cu_seqlens.size()));
    detail::require(cu_seqlens.front() == 0, "cu_seqlens",
                    detail::expected_given("cu_seqlens[0]", 0, cu_seqlens.front()));
    for (std::size_t i = 1; i < cu_seqlens.size(); ++i)
      if (cu_seqlens[i] < cu_seqlens[i - 1])
        throw Error("cu_seqlens", detail::expected_given("cu_seqlens[" + std::to_string(i) + "]",
                                                         ">= cu_seqlens[" + std::to_string(i - 1) +
                                                             "] = " + std::to_string(cu_seqlens[i - 1]),
                                                         cu_seqlens[i]));
    detail::require(cu_seqlens.back() == total_tokens, "cu_seqlens",
                    detail::expected_given("cu_seqlens[N] (the packed time extent total_T)",
                                           total_tokens, cu_seqlens.back()));
  }
  [[nodiscard]] index_t count() const noexcept { return static_cast<index_t>(offsets_.size()) - 1; }
  [[nodiscard]] index_t begin(index_t i) const noexcept { return offsets_[static_cast<std::size_t>(i)]; }
  [[nodiscard]] index_t length(index_t i) const noexcept { return begin(i + 1) - begin(i); }
  [[nodiscard]] index_t total() const noexcept { return offsets_.back(); }

  /// Sequences each worker runs, in order: the first list holds the sequences
  /// that run alone on every worker, list w + 1 those worker w runs by itself.
  /// A sequence weighs cost(length): one whose cost is at least 1 / workers of
  /// the whole runs alone, the rest go longest first to the least loaded worker.
  template <class Cost>
  [[nodiscard]] std::vector<std::vector<index_t>> schedule(int workers, Cost&& cost) const {
    std::vector<std::vector<index_t>> plan(static_cast<std::size_t>(workers) + 1);
    std::vector<index_t> order(static_cast<std::size_t>(count()));
    std::iota(order.begin(), order.end(), index_t{0});
    if (workers <= 1) {
      plan[0] = order;
      return plan;
    }
    std::vector<double> costs(order.size());
    double whole = 0;
    for (index_t i : order) whole += costs[static_cast<std::size_t>(i)] = length(i) == 0 ? 0.0 : cost(length(i));
    const auto cost_of = [&](index_t i) { return costs[static_cast<std::size_t>(i)]; };
    std::stable_sort(order.begin(), order.end(), [&](index_t a, index_t b) { return cost_of(a) > cost_of(b); });
    std::vector<double> load(static_cast<std::size_t>(workers), 0.0);
    for (index_t i : order) {
      if (length(i) == 0) continue;
      if (cost_of(i) * workers >= whole) {
        plan[0].push_back(i);
        continue;
      }
      const auto least = std::min_element(load.begin(), load.end()) - load.begin();
      load[static_cast<std::size_t>(least)] += cost_of(i);
      plan[static_cast<std::size_t>(least) + 1].push_back(i);
    }
    return plan;
  }
  /// The same, each sequence weighing its length (a linear-time mechanism).
  [[nodiscard]] std::vector<std::vector<index_t>> schedule(int workers) const {
    return schedule(workers, [](index_t length) { return static_cast<double>(length); });
  }

 private:
  std::span<const index_t> offsets_;
};

namespace detail {

/// Tokens [begin, begin + length) of a [1, total_T, ...] view.
template <class T, std::size_t N>
TensorView<T, N> time_slice(const TensorView<T, N>& view, index_t begin, index_t length) {
  auto extents = view.extents();
  extents[1] = length;
  return TensorView<T, N>(view.data() + (length == 0 ? 0 : begin * view.stride(1)), extents, view.strides());
}

/// LeaPformer's given proportions: both [1, total_T, H] views sliced alike.
template <Real T>
SequenceProportions<T> time_slice(const SequenceProportions<T>& proportions, index_t begin, index_t length) {
  return {time_slice(proportions.queries, begin, length), time_slice(proportions.keys, begin, length)};
}

/// Every packed view has batch 1 and total_T tokens.
template <class T, std::size_t N>
void check_packed(const TensorView<T, N>& view, std::string_view argument, index_t total) {
  static_assert(N >= 2, "a packed view is [1, total_T, ...]");
  check_view(view, argument);
  require(view.extent(0) == 1, argument,
          expected_given("batch extent of a packed view [1, total_T, ...]", 1, view.extent(0)));
  require(view.extent(1) == total, argument,
          expected_given("time extent total_T (= the out's)", total, view.extent(1)));
}

template <Real T>
void check_packed(const SequenceProportions<T>& proportions, std::string_view argument, index_t total) {
  check_packed(proportions.queries, std::string(argument) + ".queries", total);
  check_packed(proportions.keys, std::string(argument) + ".keys", total);
}

/// Given proportions hold values the attention accepts, every token of every
/// sequence (a value checked only when its sequence runs would throw after
/// other sequences' states moved). Other inputs: nothing more to check.
template <class Attention, class Input>
void check_packed_values(const Attention&, const Input&, index_t) {}
template <class Attention, Real T>
void check_packed_values(const Attention& attention, const SequenceProportions<T>& proportions, index_t total) {
  if constexpr (requires { attention.validate_proportions(proportions, index_t{1}, total); })
    attention.validate_proportions(proportions, 1, total);
}

/// out shares no element with an input (each view of given proportions too).
template <class O, class I, std::size_t N>
void check_packed_no_overlap(const TensorView<O, 4>& out, const TensorView<I, N>& input, std::string_view name) {
  check_no_overlap(out, "out", input, name);
}
template <class O, Real T>
void check_packed_no_overlap(const TensorView<O, 4>& out, const SequenceProportions<T>& proportions,
                             std::string_view name) {
  check_no_overlap(out, "out", proportions.queries, std::string(name) + ".queries");
  check_no_overlap(out, "out", proportions.keys, std::string(name) + ".keys");
}

/// A prefill's work in `attention`'s own units: its prefill_cost(length) where it
/// has one (softmax: the keys attended), else the length (a linear-time scan).
template <class Attention>
double prefill_cost(const Attention& attention, index_t length) {
  if constexpr (requires { attention.prefill_cost(length); })
    return attention.prefill_cost(length);
  else
    return static_cast<double>(length);
}

}  // namespace detail

/// Runs `attention`'s causal forward on each sequence of a packed batch.
/// `inputs` are the views the mechanism's forward takes before `out`, in its
/// order (q, k, v; Macchiato's five; LeaPformer's given SequenceProportions,
/// two [1, total_T, H] views, after v), each [1, total_T, H, *]; `out`
/// [1, total_T, H, Dv]. With `states` (one per
/// sequence, batch 1, distinct), sequence i continues from *states[i] and leaves
/// it at its end; without, every sequence starts fresh at position 0. With
/// bf16 / fp16 activations, pass HalfPrecision(attention) (half_precision.hpp).
template <class Attention, exec::Policy E, Activation T, class... Inputs>
  requires(Attention::direction::is_causal)
void forward_packed(const Attention& attention, E e, std::span<const index_t> cu_seqlens,
                    const std::tuple<Inputs...>& inputs, TensorView<T, 4> out,
                    std::span<typename Attention::template State<T>* const> states) {
  static_assert(sizeof...(Inputs) >= 3, "inputs: the views forward takes before out (q, k, v, ...)");
  static_assert(!std::is_same_v<E, exec::cuda_t>, "packed prefill runs on exec::cpu and exec::reference");
  check_view(out, "out");
  detail::require(out.extent(0) == 1, "out",
                  detail::expected_given("batch extent of a packed view [1, total_T, H, Dv]", 1, out.extent(0)));
  const index_t total = out.extent(1);
  const PackedSequences sequences(cu_seqlens, total);
  const index_t N = sequences.count();
  {
    int position = 0;
    detail::check_distinct_elements(out, "out");
    std::apply([&](const auto&... view) {
      ((detail::check_packed(view, "inputs[" + std::to_string(position) + "]", total),
        detail::check_packed_no_overlap(out, view, "inputs[" + std::to_string(position) + "]"), ++position),
       ...);
    }, inputs);
    std::apply([&](const auto&... view) { (detail::check_packed_values(attention, view, total), ...); }, inputs);
  }
  if (!states.empty()) {
    detail::require(static_cast<index_t>(states.size()) == N, "states",
                    detail::expected_given("count (one per sequence, N = cu_seqlens.size() - 1)", N,
                                           states.size()));
    std::vector<const void*> seen;
    for (std::size_t i = 0; i < states.size(); ++i) {
      detail::require(states[i] != nullptr, "states",
                      "states[" + std::to_string(i) + "] is null: expected a state per sequence");
      try {  // its kind, sizes, batch 1 and room for the sequence's tokens
        attention.validate_state(*states[i], 1, sequences.length(static_cast<index_t>(i)));
      } catch (const Error& error) {
        throw detail::renamed(error, "states[" + std::to_string(i) + "]");
      }
      seen.push_back(states[i]);
    }
    std::sort(seen.begin(), seen.end());
    detail::require(std::adjacent_find(seen.begin(), seen.end()) == seen.end(), "states",
                    "the same state is given for two sequences: expected one distinct state per sequence");
  }
  const auto run = [&](index_t i, index_t begin, index_t length) {
    auto slices = std::apply([&](const auto&... view) {
      return std::make_tuple(detail::time_slice(view, begin, length)...);
    }, inputs);
    const TensorView<T, 4> out_i = detail::time_slice(out, begin, length);
    std::apply([&](const auto&... slice) {
      if (states.empty())
        attention.forward(e, slice..., out_i);
      else
        attention.forward(e, slice..., out_i, *states[static_cast<std::size_t>(i)]);
    }, slices);
  };
  // Every sequence's views through the mechanism's own checks, on its first zero
  // tokens: with the states checked above, a bad call throws before any state moves.
  for (index_t i = 0; i < N; ++i) run(i, sequences.begin(i), 0);
  if constexpr (std::is_same_v<E, exec::cpu_t>) {
    const int workers = cpu::thread_count();
    const std::vector<std::vector<index_t>> plan =
        sequences.schedule(workers, [&](index_t length) { return detail::prefill_cost(attention, length); });
    for (index_t i : plan[0]) run(i, sequences.begin(i), sequences.length(i));
    if (workers > 1) {
      // (memory exhaustion only: every argument was checked above; parallel_for rethrows)
      cpu::parallel_for(workers, workers, [&](index_t w, int) {
        for (index_t i : plan[static_cast<std::size_t>(w) + 1]) run(i, sequences.begin(i), sequences.length(i));
      });
    }
  } else {
    for (index_t i = 0; i < N; ++i) run(i, sequences.begin(i), sequences.length(i));
  }
}

/// The same, each sequence starting fresh (no states).
template <class Attention, exec::Policy E, Activation T, class... Inputs>
  requires(Attention::direction::is_causal)
void forward_packed(const Attention& attention, E e, std::span<const index_t> cu_seqlens,
                    const std::tuple<Inputs...>& inputs, TensorView<T, 4> out) {
  forward_packed(attention, e, cu_seqlens, inputs, out,
                 std::span<typename Attention::template State<T>* const>{});
}

}  // namespace latte
