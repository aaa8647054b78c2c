// How the pipelined GEMM+ReduceScatter splits x's rows into blocks: which
// destination rank owns each block's sums, where the block sits in x and in
// the owner's y, and the order every rank enqueues them in (ncclReduce is
// collective, so the order must be the same everywhere). Pure, unit-tested on
// the CPU (tests/cpp/test_chunks.cc); pipelined.cc enqueues what it says.
#ifndef JAX_COMM_GEMM_CHUNKS_H_
#define JAX_COMM_GEMM_CHUNKS_H_

#include <cstdint>
#include <vector>

namespace jax_comm_gemm {

// Rows per chunk are at least this many where a rank's rows allow, and a
// rank's rows make at most kMaxChunks chunks: smaller GEMMs lose efficiency,
// and each chunk costs an NCCL launch.
inline constexpr int64_t kMinChunkRows = 1024;
inline constexpr int kMaxChunks = 4;

// How many chunks a destination rank's `rows` rows make (1, 2 or 4; always
// a divisor of `rows`).
int ChunksFor(int64_t rows);

struct RowBlock {
  int dest;       // the rank that owns the sums of these rows
  int64_t x_row;  // first row in x [n, k/P] (and in the partial sums [n, m])
  int64_t y_row;  // first row in the owner's y [n/P, m]
};

// The blocks of `rows` = n rows over `nranks` ranks, `chunks` per rank, each
// n / (nranks * chunks) rows, in enqueue order: chunk 0 of every destination,
// then chunk 1, ..., so the last reduce is one block's.
std::vector<RowBlock> ReduceScatterBlocks(int64_t rows, int nranks, int chunks);

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_CHUNKS_H_
