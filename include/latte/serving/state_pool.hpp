#pragma once
// A pool of per-sequence decode states for continuous batching: a fixed number
// of slots, each one batch-1 state of a causal mechanism, handed out by acquire()
// and returned by release(). One step() advances any set of live slots by one
// token each, every slot at its own position, with no allocation. One
// forward_packed() prefills chosen slots from a packed buffer
// (serving/packed_prefill.hpp). One slot is saved and restored in the state
// format of docs/state-format.md (checksum included).
//
// Every call checks all of its arguments (slot handles, shapes, each state's room)
// before any state moves, and a refused call changes nothing in the pool. A slot
// handle names its pool and its acquisition, so a handle of another pool, a
// released one, or one kept past release and re-acquisition is refused by name.
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "latte/backends/cpu/half_conversion.hpp"
#include "latte/backends/cpu/parallel.hpp"
#include "latte/core/half_float.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/error.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/execution.hpp"
#include "latte/serving/packed_prefill.hpp"

namespace latte {

/// One slot of a StatePool, as acquire() hands it out.
struct PoolSlot {
  index_t index = -1;            ///< the slot's place in its pool
  std::uint64_t pool = 0;        ///< the issuing pool's id (0: no pool)
  std::uint64_t generation = 0;  ///< which acquisition of the slot this handle names
  friend bool operator==(const PoolSlot&, const PoolSlot&) = default;
};

namespace detail {
inline std::uint64_t next_pool_id() noexcept {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

/// Row n of a [N, ...] view as a [1, ...] view.
template <class T, std::size_t N>
TensorView<T, N> batch_row(const TensorView<T, N>& view, index_t n) {
  auto extents = view.extents();
  extents[0] = 1;
  return TensorView<T, N>(view.data() + n * view.stride(0), extents, view.strides());
}
}  // namespace detail

/// `slots` batch-1 states of `Attention` in dtype T. Not thread-safe: one
/// caller at a time (each call spreads its own work over the CPU threads).
template <class Attention, Real T>
  requires(Attention::direction::is_causal)
class StatePool {
 public:
  using State = typename Attention::template State<T>;

  /// Every slot starts as attention.make_state<T>(1, state_args...) (a KV
  /// cache's capacity, a conv-compression context capacity, a first position).
  template <class... StateArgs>
  StatePool(const Attention& attention, index_t slots, StateArgs... state_args)
      : attention_(attention), id_(detail::next_pool_id()) {
    detail::check_positive(slots, "slots");
    states_.reserve(static_cast<std::size_t>(slots));
    for (index_t i = 0; i < slots; ++i)
      states_.push_back(attention_.template make_state<T>(1, state_args...));
    fresh_ = states_.front().save();
    live_.assign(static_cast<std::size_t>(slots), 0);
    generation_.assign(static_cast<std::size_t>(slots), 0);
    marks_.assign(static_cast<std::size_t>(slots), 0);
    pointers_.reserve(static_cast<std::size_t>(slots));
    free_.reserve(static_cast<std::size_t>(slots));
    for (index_t i = slots; i-- > 0;) free_.push_back(i);  // slot 0 handed out first
  }

  // A copy would share the pool's id and so accept the original's handles.
  StatePool(const StatePool&) = delete;
  StatePool& operator=(const StatePool&) = delete;
  StatePool(StatePool&&) = default;
  StatePool& operator=(StatePool&&) = default;

  [[nodiscard]] const Attention& attention() const noexcept { return attention_; }
  [[nodiscard]] index_t capacity() const noexcept { return static_cast<index_t>(states_.size()); }
  [[nodiscard]] index_t live() const noexcept { return capacity() - static_cast<index_t>(free_.size()); }

  /// A free slot, its state fresh (as the constructor made it).
  [[nodiscard]] PoolSlot acquire() {
    detail::require(!free_.empty(), "pool",
                    detail::expected_given("a free slot: slots in use", "< " + std::to_string(capacity()),
                                           live()));
    const index_t i = free_.back();
    states_[static_cast<std::size_t>(i)].restore(fresh_);
    free_.pop_back();
    live_[static_cast<std::size_t>(i)] = 1;
    return {i, id_, ++generation_[static_cast<std::size_t>(i)]};
  }

  /// Returns a live slot to the pool; its handle (and every copy) is dead from now on.
  void release(PoolSlot slot) {
    check_slot(slot, "slot");
    live_[static_cast<std::size_t>(slot.index)] = 0;
    free_.push_back(slot.index);
  }

  /// The state of a live slot (for the mechanism's own calls on it).
  [[nodiscard]] State& state(PoolSlot slot) {
    check_slot(slot, "slot");
    return states_[static_cast<std::size_t>(slot.index)];
  }
  [[nodiscard]] const State& state(PoolSlot slot) const {
    check_slot(slot, "slot");
    return states_[static_cast<std::size_t>(slot.index)];
  }

  /// The slot's state in the saved-state format (docs/state-format.md).
  [[nodiscard]] std::vector<std::byte> save(PoolSlot slot) const { return state(slot).save(); }

  /// Replaces a live slot's state with saved bytes of a batch-1 state of this
  /// mechanism and dtype; refused bytes (another kind, other sizes, a bad
  /// checksum) leave it as it was.
  void restore(PoolSlot slot, std::span<const std::byte> bytes) {
    State& target = state(slot);
    try {
      target.restore(bytes);
    } catch (const Error& error) {
      throw detail::renamed(error, "bytes");
    }
  }

  /// Advances each slot of `slots` by one token: row n of every input
  /// ([N, H, *], the views the mechanism's step takes, in its order) and of
  /// `out` [N, H, Dv] belongs to slots[n], each at its own position. Allocates
  /// nothing; the slots run side by side on the CPU threads.
  ///
  /// A float pool also steps bf16 / fp16 activations (inputs and out all of one
  /// 16-bit type): each slot's rows are widened into per-thread fp32 rows, the
  /// mechanism's fp32 step runs on them, and its output row is rounded once. The
  /// rows are allocated by the first call of a size and reused after.
  template <exec::Policy E, class... Inputs, class O>
  void step(E e, std::span<const PoolSlot> slots, const std::tuple<Inputs...>& inputs,
            TensorView<O, 3> out) {
    static_assert(!std::is_same_v<E, exec::cuda_t>, "the pool's states live in host memory");
    static_assert(sizeof...(Inputs) <= 8, "inputs: at most 8 views");
    static_assert(std::is_same_v<O, T> || (HalfFloat<O> && std::is_same_v<T, float>),
                  "out: the pool's dtype, or bfloat16 / float16 for a float pool");
    const index_t N = check_slots(slots);
    check_view(out, "out");
    if (out.extent(0) != N)  // (the message only on failure: step allocates nothing)
      throw Error("out", detail::expected_given("rows (one per slot, N = slots.size())", N, out.extent(0)));
    detail::check_distinct_elements(out, "out");
    {
      int position = 0;
      std::apply([&](const auto&... view) {
        ((check_rows(view, position, N), detail::check_no_overlap(out, "out", view, input_name(position)),
          ++position),
         ...);
      }, inputs);
    }
    for (index_t n = 0; n < N; ++n) check_room(slots, n, 1);
    if (N == 0) return;
    constexpr std::size_t K = sizeof...(Inputs);
    const int workers = std::is_same_v<E, exec::cpu_t> ? cpu::thread_count() : 1;
    if constexpr (HalfFloat<O>) {  // per-thread fp32 rows: grown here, never in the loop
      if (half_rows_.size() < static_cast<std::size_t>(workers) * (K + 1))
        half_rows_.resize(static_cast<std::size_t>(workers) * (K + 1));
      std::array<std::size_t, K + 1> need{};
      std::size_t j = 0;
      std::apply([&](const auto&... view) { ((need[j++] = row_elements(view)), ...); }, inputs);
      need[K] = row_elements(out);
      for (int w = 0; w < workers; ++w)
        for (std::size_t i = 0; i <= K; ++i) {
          AlignedVector<float>& row = half_rows_[static_cast<std::size_t>(w) * (K + 1) + i];
          if (row.size() < need[i]) row.resize(need[i]);
        }
    }
    const auto run = [&](index_t n, int worker) {
      State& state = states_[static_cast<std::size_t>(slots[static_cast<std::size_t>(n)].index)];
      if constexpr (HalfFloat<O>) {
        step_half_row(e, state, inputs, out, n, half_rows_.data() + static_cast<std::size_t>(worker) * (K + 1),
                      std::make_index_sequence<K>{});
      } else {
        std::apply([&](const auto&... view) {
          attention_.step(e, state, detail::batch_row(view, n)..., detail::batch_row(out, n));
        }, inputs);
      }
    };
    run(0, 0);  // the mechanism's own shape checks, before any other slot moves
    if constexpr (std::is_same_v<E, exec::cpu_t>) {
      // (none expected to throw: every argument was checked above; parallel_for rethrows)
      cpu::parallel_for(N - 1, workers, [&](index_t n, int worker) { run(n + 1, worker); });
    } else {
      for (index_t n = 1; n < N; ++n) run(n, 0);
    }
  }

  /// Packed variable-length prefill (latte::forward_packed) into live slots:
  /// sequence i of `cu_seqlens` continues from slots[i]'s state.
  template <exec::Policy E, class... Inputs>
  void forward_packed(E e, std::span<const PoolSlot> slots, std::span<const index_t> cu_seqlens,
                      const std::tuple<Inputs...>& inputs, TensorView<T, 4> out) {
    check_slots(slots);
    pointers_.clear();
    for (const PoolSlot& slot : slots) pointers_.push_back(&states_[static_cast<std::size_t>(slot.index)]);
    latte::forward_packed(attention_, e, cu_seqlens, inputs, out, std::span<State* const>(pointers_));
  }

 private:
  template <class V>
  static std::size_t row_elements(const V& view) {
    return static_cast<std::size_t>(view.extent(1)) * static_cast<std::size_t>(view.extent(2));
  }

  /// One slot's step on 16-bit rows: row n of each input widened into `rows`
  /// (exact), the fp32 step, its output row rounded into out's row n.
  template <class E, class Inputs, class O, std::size_t... I>
  void step_half_row(E e, State& state, const Inputs& inputs, const TensorView<O, 3>& out, index_t n,
                     AlignedVector<float>* rows, std::index_sequence<I...>) const {
    constexpr std::size_t K = sizeof...(I);
    const auto widened = [&](const auto& view, AlignedVector<float>& row) {
      using H = std::remove_const_t<typename std::remove_cvref_t<decltype(view)>::element_type>;
      static_assert(std::is_same_v<H, O>, "inputs: every view of out's 16-bit type");
      const auto one = detail::batch_row(view, n);
      cpu::widen(TensorView<const H, 3>(one), row.data());
      return TensorView<const float, 3>(row.data(), one.extents());
    };
    const TensorView<O, 3> out_row = detail::batch_row(out, n);
    attention_.step(e, state, widened(std::get<I>(inputs), rows[I])...,
                    TensorView<float, 3>(rows[K].data(), out_row.extents()));
    cpu::narrow(rows[K].data(), out_row);
  }

  /// "inputs[j]" without building a string (step allocates nothing).
  static std::string_view input_name(int position) {
    static constexpr std::string_view names[] = {"inputs[0]", "inputs[1]", "inputs[2]", "inputs[3]",
                                                 "inputs[4]", "inputs[5]", "inputs[6]", "inputs[7]"};
    return names[position];
  }

  void check_slot(const PoolSlot& slot, std::string_view argument) const {
    if (slot.pool != id_)
      throw Error(argument, slot.pool == 0 ? std::string("a slot no pool handed out (default-constructed)")
                                           : std::string("a slot of another pool"));
    if (slot.index < 0 || slot.index >= capacity())
      throw Error(argument, detail::expected_given("index", "in [0, " + std::to_string(capacity()) + ")",
                                                   slot.index));
    const auto i = static_cast<std::size_t>(slot.index);
    if (!live_[i] || slot.generation != generation_[i])
      throw Error(argument, "slot " + std::to_string(slot.index) +
                                " was released: expected a slot acquired and not yet released");
  }

  /// Every handle live and no slot twice; returns N. Allocation-free.
  index_t check_slots(std::span<const PoolSlot> slots) {
    for (std::size_t n = 0; n < slots.size(); ++n) check_slot(slots[n], "slots");
    bool repeated = false;
    for (const PoolSlot& slot : slots) {
      auto& mark = marks_[static_cast<std::size_t>(slot.index)];
      repeated = repeated || mark;
      mark = 1;
    }
    for (const PoolSlot& slot : slots) marks_[static_cast<std::size_t>(slot.index)] = 0;
    detail::require(!repeated, "slots", "a slot appears twice: expected distinct slots");
    return static_cast<index_t>(slots.size());
  }

  template <class V>
  static void check_rows(const V& view, int position, index_t N) {
    check_view(view, input_name(position));
    if (view.extent(0) == N) return;
    throw Error(input_name(position),
                detail::expected_given("rows (one per slot, N = slots.size())", N, view.extent(0)));
  }

  void check_room(std::span<const PoolSlot> slots, index_t n, index_t tokens) const {
    const auto& state = states_[static_cast<std::size_t>(slots[static_cast<std::size_t>(n)].index)];
    try {
      attention_.validate_state(state, 1, tokens);
    } catch (const Error& error) {
      throw detail::renamed(error, "slots");
    }
  }

  Attention attention_;
  std::uint64_t id_;
  std::vector<State> states_;
  std::vector<std::byte> fresh_;
  std::vector<char> live_;
  std::vector<std::uint64_t> generation_;
  std::vector<char> marks_;
  std::vector<index_t> free_;
  std::vector<State*> pointers_;
  std::vector<AlignedVector<float>> half_rows_;  // 16-bit steps: (inputs + out) rows per thread
};

}  // namespace latte
