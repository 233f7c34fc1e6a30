#pragma once
// latte's distributed part (needs MPI: link latte::mpi): sequence-parallel
// forward of every causal mechanism, and backward of causal Latte and the
// linear family, across the ranks of an MPI communicator, passing states, not
// keys and values (docs/distributed.md). Not included by latte/attention.hpp.
#include "latte/attention.hpp"
#include "latte/distributed/agreement.hpp"
#include "latte/distributed/conv_compressed_parallel.hpp"
#include "latte/distributed/sequence_parallel.hpp"
#include "latte/distributed/state_scan.hpp"
