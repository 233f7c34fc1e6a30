#pragma once
// Shapes agreed before any data moves: every rank of a sequence-parallel call
// contributes a fixed-size description of its call (which call, batch, its
// slice's length, the attention's sizes and a checksum of its kind and
// parameters) and checks its own inputs; one MPI_Allgather shares both. Where
// a rank's inputs are wrong or the ranks disagree, every rank throws the same
// latte::Error (the same argument and message, naming the rank), so that no
// rank is left waiting in a collective the others never reach
// (docs/distributed.md, "Failure").
#include <mpi.h>

#include <cstdint>
#include <exception>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "latte/core/error.hpp"
#include "latte/core/types.hpp"

namespace latte::distributed {

/// Where every rank's slice sits in the whole sequence, as all ranks agreed.
struct SliceLayout {
  int rank = 0;
  int ranks = 1;
  std::vector<std::int64_t> lengths;  ///< tokens of each rank's slice, in rank order

  /// Position of rank r's first token (lengths[0] + ... + lengths[r - 1]).
  [[nodiscard]] std::int64_t first_of(int r) const noexcept {
    std::int64_t first = 0;
    for (int i = 0; i < r; ++i) first += lengths[static_cast<std::size_t>(i)];
    return first;
  }
  [[nodiscard]] std::int64_t first() const noexcept { return first_of(rank); }
  [[nodiscard]] std::int64_t length() const noexcept {
    return lengths[static_cast<std::size_t>(rank)];
  }
  [[nodiscard]] std::int64_t total() const noexcept { return first_of(ranks); }
};

namespace detail {

using latte::detail::expected_given;
using latte::detail::require;

/// MPI's name for T.
template <Real T>
[[nodiscard]] MPI_Datatype mpi_type() noexcept {
  if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else return MPI_DOUBLE;
}

/// Which sequence-parallel call a rank is in (ranks must all be in the same one).
enum class Call : std::int64_t { forward = 1, backward = 2 };

/// What a rank contributes to the agreement.
struct CallDescription {
  Call call = Call::forward;
  std::int64_t batch = 0;
  std::int64_t length = 0;  ///< this rank's tokens
  std::int64_t heads = 0, features = 0, value_dim = 0;
  std::int64_t element_bytes = 0;
  std::int64_t fingerprint = 0;  ///< crc32c of the attention's kind and parameters
  std::string attention;         ///< the attention's kind, for messages
};

inline constexpr int description_values = 10;
inline constexpr std::int64_t protocol_version = 1;

/// The error every rank throws: a rank's own, or a disagreement.
struct SharedError {
  std::string argument, message;
};

/// Rank `origin`'s error, sent to every rank (its length, then its text).
inline SharedError broadcast_error(MPI_Comm comm, int origin, int rank,
                                   const std::optional<SharedError>& mine) {
  std::string text;
  if (rank == origin && mine) text = mine->argument + '\0' + mine->message;
  std::int64_t size = static_cast<std::int64_t>(text.size());
  MPI_Bcast(&size, 1, MPI_INT64_T, origin, comm);
  text.resize(static_cast<std::size_t>(size));
  MPI_Bcast(text.data(), static_cast<int>(size), MPI_CHAR, origin, comm);
  const std::size_t split = text.find('\0');
  return {text.substr(0, split), "rank " + std::to_string(origin) + ": " +
                                     (split == std::string::npos ? "" : text.substr(split + 1))};
}

/// Runs `check` (this rank's own validation, which may throw latte::Error);
/// then every rank learns whether any rank failed and, if one did, all throw
/// the lowest failing rank's error. Collective over `comm`.
template <class Check>
void agree_without_error(MPI_Comm comm, int rank, Check&& check) {
  std::optional<SharedError> mine;
  try {
    check();
  } catch (const Error& error) {
    std::string message = error.what();
    const std::string prefix = "latte: argument '" + error.argument() + "': ";
    if (message.rfind(prefix, 0) == 0) message = message.substr(prefix.size());
    mine = SharedError{error.argument(), message};
  }
  int failing = mine ? rank : std::numeric_limits<int>::max(), first = 0;
  MPI_Allreduce(&failing, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == std::numeric_limits<int>::max()) return;
  const SharedError shared = broadcast_error(comm, first, rank, mine);
  throw Error(shared.argument, shared.message);
}

/// The agreement: checks this rank's inputs (`check`), shares every rank's
/// description, and throws the same latte::Error on every rank when one
/// rank's inputs are wrong or two ranks describe different calls. Collective.
template <class Check>
[[nodiscard]] SliceLayout agree(MPI_Comm comm, CallDescription mine, Check&& check) {
  require(comm != MPI_COMM_NULL, "comm", "expected a communicator, given MPI_COMM_NULL");
  SliceLayout layout;
  MPI_Comm_rank(comm, &layout.rank);
  MPI_Comm_size(comm, &layout.ranks);
  agree_without_error(comm, layout.rank, check);
  const std::int64_t values[description_values] = {
      protocol_version, static_cast<std::int64_t>(mine.call), mine.batch, mine.length,
      mine.heads, mine.features, mine.value_dim, mine.element_bytes, mine.fingerprint, 0};
  std::vector<std::int64_t> all(static_cast<std::size_t>(layout.ranks) * description_values);
  MPI_Allgather(values, description_values, MPI_INT64_T, all.data(), description_values,
                MPI_INT64_T, comm);
  auto of = [&](int r, int field) {
    return all[static_cast<std::size_t>(r) * description_values + static_cast<std::size_t>(field)];
  };
  // Every rank reads the same table, so every rank throws the same error.
  auto call_name = [](std::int64_t call) {
    return call == static_cast<std::int64_t>(Call::forward)    ? std::string("forward")
           : call == static_cast<std::int64_t>(Call::backward) ? std::string("backward")
                                                               : std::string("another call");
  };
  auto describe = [&](int r) {
    return "H " + std::to_string(of(r, 4)) + ", features " + std::to_string(of(r, 5)) +
           ", Dv " + std::to_string(of(r, 6)) + ", " + std::to_string(of(r, 7)) +
           "-byte elements, kind and parameters crc32c " + std::to_string(of(r, 8));
  };
  std::int64_t total = 0;
  for (int r = 0; r < layout.ranks; ++r) {
    const std::string who = "rank " + std::to_string(r);
    require(of(r, 0) == protocol_version, "comm",
            who + " runs another latte (agreement protocol " + std::to_string(of(r, 0)) +
                ", rank 0's " + std::to_string(of(0, 0)) + ")");
    require(of(r, 1) == of(0, 1), "comm",
            who + " called distributed::" + call_name(of(r, 1)) + ", rank 0 distributed::" +
                call_name(of(0, 1)) + ": every rank must make the same call");
    require(of(r, 2) == of(0, 2), "batch",
            expected_given("the same batch B on every rank (rank 0's)", of(0, 2),
                           who + "'s " + std::to_string(of(r, 2))));
    bool same_attention = true;
    for (int field = 4; field <= 8; ++field) same_attention = same_attention && of(r, field) == of(0, field);
    require(same_attention, "attention",
            "expected the same attention on every rank: rank 0 has " + describe(0) + "; " + who +
                " has " + describe(r) + " (this rank's kind: " + mine.attention + ")");
    require(of(r, 3) <= std::numeric_limits<std::int64_t>::max() - total, "length",
            "the slices' lengths add up past int64 at " + who);
    total += of(r, 3);
    layout.lengths.push_back(of(r, 3));
  }
  return layout;
}

}  // namespace detail
}  // namespace latte::distributed
