// The PMPI wrappers behind mpi_bytes.hpp: each MPI function latte's
// distributed part and its tests call, counted, then forwarded to PMPI_.
#include "mpi_bytes.hpp"

#include <mpi.h>

namespace latte_test {

MpiBytes& mpi_bytes() {
  static MpiBytes counts;
  return counts;
}

namespace {
void count(const char* name, int elements, MPI_Datatype type) {
  int size = 0;
  PMPI_Type_size(type, &size);
  mpi_bytes().sent[name] += static_cast<std::int64_t>(elements) * size;
  mpi_bytes().calls[name] += 1;
}
}  // namespace

}  // namespace latte_test

extern "C" {

int MPI_Send(const void* buffer, int count, MPI_Datatype type, int destination, int tag,
             MPI_Comm comm) {
  if (destination != MPI_PROC_NULL) latte_test::count("MPI_Send", count, type);
  return PMPI_Send(buffer, count, type, destination, tag, comm);
}

int MPI_Sendrecv(const void* send, int send_count, MPI_Datatype send_type, int destination,
                 int send_tag, void* receive, int receive_count, MPI_Datatype receive_type,
                 int source, int receive_tag, MPI_Comm comm, MPI_Status* status) {
  latte_test::count("MPI_Sendrecv", destination != MPI_PROC_NULL ? send_count : 0, send_type);
  return PMPI_Sendrecv(send, send_count, send_type, destination, send_tag, receive,
                       receive_count, receive_type, source, receive_tag, comm, status);
}

int MPI_Bcast(void* buffer, int count, MPI_Datatype type, int root, MPI_Comm comm) {
  int rank = 0;
  PMPI_Comm_rank(comm, &rank);
  latte_test::count("MPI_Bcast", rank == root ? count : 0, type);
  return PMPI_Bcast(buffer, count, type, root, comm);
}

int MPI_Allgather(const void* send, int send_count, MPI_Datatype send_type, void* receive,
                  int receive_count, MPI_Datatype receive_type, MPI_Comm comm) {
  latte_test::count("MPI_Allgather", send_count, send_type);
  return PMPI_Allgather(send, send_count, send_type, receive, receive_count, receive_type, comm);
}

int MPI_Allreduce(const void* send, void* receive, int count, MPI_Datatype type, MPI_Op op,
                  MPI_Comm comm) {
  latte_test::count("MPI_Allreduce", count, type);
  return PMPI_Allreduce(send, receive, count, type, op, comm);
}

int MPI_Alltoallv(const void* send, const int* send_counts, const int* send_offsets,
                  MPI_Datatype send_type, void* receive, const int* receive_counts,
                  const int* receive_offsets, MPI_Datatype receive_type, MPI_Comm comm) {
  int ranks = 0, elements = 0;
  PMPI_Comm_size(comm, &ranks);
  for (int r = 0; r < ranks; ++r) elements += send_counts[r];
  latte_test::count("MPI_Alltoallv", elements, send_type);
  return PMPI_Alltoallv(send, send_counts, send_offsets, send_type, receive, receive_counts,
                        receive_offsets, receive_type, comm);
}

}  // extern "C"
