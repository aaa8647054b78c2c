// How the pipelined_ce GEMM+ReduceScatter splits x's rows into blocks: which
// destination rank owns each block's sums, where the block sits in x and in
// the owner's y, and the order every rank enqueues them in (each chunk's
// exchange is collective, so the order must be the same everywhere). Pure,
// unit-tested on the CPU (tests/cpp/test_chunks.cc); pipelined.cc enqueues
// what it says.
#ifndef JAX_COMM_GEMM_CHUNKS_H_
#define JAX_COMM_GEMM_CHUNKS_H_

#include <cstdint>
#include <vector>

namespace jax_comm_gemm {

// A rank's rows make at most kMaxChunks chunks, each of at least
// kMinChunkRows rows (smaller GEMMs lose efficiency).
inline constexpr int64_t kMinChunkRows = 256;
inline constexpr int kMaxChunks = 4;
// Four chunks only where one block's GEMM does at least this much work: its
// GPU time must outlast the host's enqueueing of a chunk (an NCCL call and the
// cuBLASLt launches), or the calls are host-bound (measured:
// docs/design.md#gemmreducescatter, docs/performance.md).
inline constexpr double kMinFourChunkBlockFlop = 4e10;

// How many chunks a destination rank's `rows` rows make (1, 2 or 4; always
// a divisor of `rows`), each block's GEMM being rows/chunks x k x m.
int ChunksFor(int64_t rows, int64_t k, int64_t m);

struct RowBlock {
  int dest;       // the rank that owns the sums of these rows
  int64_t x_row;  // first row in x [n, k/P]
  int64_t y_row;  // first row in the owner's y [n/P, m]
};

// The blocks of `rows` = n rows over `nranks` ranks, `chunks` per rank, each
// n / (nranks * chunks) rows, in enqueue order: chunk 0 of every destination,
// then chunk 1, ..., so the P blocks of one chunk are contiguous (one
// exchange per chunk) and the last exchange is one chunk's.
std::vector<RowBlock> ReduceScatterBlocks(int64_t rows, int nranks, int chunks);

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_CHUNKS_H_
