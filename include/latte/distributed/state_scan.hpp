#pragma once
// An exclusive scan of states over the ranks of a communicator: rank r gets
// the combination of the states of ranks 0 .. r-1 (or, reversed, of ranks
// r+1 .. P-1), under an associative combine such as LatteState::append_state.
//
// Recursive doubling (Hillis and Steele): in round d = 1, 2, 4, ... each rank
// sends what it has accumulated so far to rank r + d and receives rank r - d's,
// so ceil(log2 P) rounds, one state sent per rank and round at most (none by
// a rank with no successor d ranks on). MPI_Exscan would run the same scan,
// but its user-defined operations see raw buffers without the state's sizes,
// and MPI leaves its algorithm to the implementation; with point-to-point
// rounds the bytes each rank sends are those docs/distributed.md derives.
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "latte/core/error.hpp"
#include "latte/distributed/agreement.hpp"

namespace latte::distributed::detail {

/// Elements of all a state's fields (what one message of the scan carries).
template <class State>
[[nodiscard]] std::size_t state_elements(const State& state) noexcept {
  std::size_t count = 0;
  for (std::size_t f = 0; f < state.field_count(); ++f) count += state.field_size(f);
  return count;
}

/// Throws latte::Error("state") unless one state fits one MPI message (an int
/// count of elements). Every rank's states have the same sizes, so every rank
/// decides alike.
template <class State>
void require_sendable(const State& state) {
  require(state_elements(state) <= static_cast<std::size_t>(INT_MAX), "state",
          expected_given("elements in one state, for one MPI message", "<= INT_MAX",
                         state_elements(state)));
}

template <class State, class T = std::remove_pointer_t<decltype(std::declval<State&>().field(0))>>
void pack_state(const State& state, std::vector<T>& buffer) {
  buffer.resize(state_elements(state));
  T* to = buffer.data();
  for (std::size_t f = 0; f < state.field_count(); ++f)
    to = std::copy_n(state.field(f), state.field_size(f), to);
}

template <class State, class T>
void unpack_state(const std::vector<T>& buffer, State& state) {
  const T* from = buffer.data();
  for (std::size_t f = 0; f < state.field_count(); ++f) {
    std::copy_n(from, state.field_size(f), state.field(f));
    from += state.field_size(f);
  }
}

/// The exclusive scan of `own` (this rank's state) over `comm`: the combination
/// of the states of the ranks before this one in scan order (rank order, or
/// its reverse), nullopt for the first. combine(earlier, later) makes
/// `earlier` the combination of the two (earlier in scan order);
/// make(lowest, highest) returns a state to receive the accumulation of the
/// ranks lowest ..= highest (rank order, a contiguous run) into.
/// Collective over `comm`.
template <class State, class Make, class Combine>
[[nodiscard]] std::optional<State> exclusive_scan(MPI_Comm comm, const SliceLayout& layout,
                                                  bool reverse, State own, Make&& make,
                                                  Combine&& combine) {
  using T = std::remove_pointer_t<decltype(own.field(0))>;
  const int P = layout.ranks;
  const int position = reverse ? P - 1 - layout.rank : layout.rank;  // in scan order
  auto rank_at = [&](int p) { return reverse ? P - 1 - p : p; };
  std::optional<State> prefix;
  State accumulated = std::move(own);  // scan positions (position - 2d, position]
  std::vector<T> outgoing, incoming(state_elements(accumulated));
  constexpr int tag = 0x1a77e;
  for (int d = 1; d < P; d *= 2) {
    const bool sends = position + d < P, receives = position - d >= 0;
    if (sends) pack_state(accumulated, outgoing);
    const int to = sends ? rank_at(position + d) : MPI_PROC_NULL;
    const int from = receives ? rank_at(position - d) : MPI_PROC_NULL;
    MPI_Sendrecv(outgoing.data(), sends ? static_cast<int>(outgoing.size()) : 0, mpi_type<T>(),
                 to, tag, incoming.data(), receives ? static_cast<int>(incoming.size()) : 0,
                 mpi_type<T>(), from, tag, comm, MPI_STATUS_IGNORE);
    if (!receives) continue;
    // The partner's accumulation covers the scan positions just before ours.
    const int covered = rank_at(std::max(0, position - 2 * d + 1));  // partner's first
    State received = make(std::min(from, covered), std::max(from, covered));
    unpack_state(incoming, received);
    if (position + 2 * d < P) {  // our accumulation is sent again next round
      State earlier = received;
      combine(earlier, accumulated);
      accumulated = std::move(earlier);
    }
    if (prefix) combine(received, *prefix);
    prefix = std::move(received);
  }
  return prefix;
}

}  // namespace latte::distributed::detail
