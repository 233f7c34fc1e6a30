#pragma once
// Bytes handed to MPI by this rank, per MPI function, counted through the MPI
// profiling interface (mpi_bytes.cpp wraps each function the library and the
// tests call and forwards it to its PMPI_ twin), so that the library's own
// collectives are counted, not only what a test sends itself.
//
// What counts as sent: point-to-point, the message (count x type size, to a
// real rank); MPI_Allgather and MPI_Allreduce, this rank's contribution;
// MPI_Bcast, the message at the root.
#include <cstdint>
#include <map>
#include <string>

namespace latte_test {

struct MpiBytes {
  std::map<std::string, std::int64_t> sent;   ///< bytes, by function
  std::map<std::string, std::int64_t> calls;  ///< calls, by function
  [[nodiscard]] std::int64_t total() const {
    std::int64_t sum = 0;
    for (const auto& [name, bytes] : sent) sum += bytes;
    return sum;
  }
};

/// This rank's counts since the last reset.
MpiBytes& mpi_bytes();
inline void reset_mpi_bytes() { mpi_bytes() = {}; }

}  // namespace latte_test
