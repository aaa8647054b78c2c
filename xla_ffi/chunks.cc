#include "chunks.h"

#include <cstddef>

namespace jax_comm_gemm {

int ChunksFor(int64_t rows, int64_t k, int64_t m) {
  auto fits = [&](int chunks) { return rows % chunks == 0 && rows / chunks >= kMinChunkRows; };
  const double block_flop = 2.0 * static_cast<double>(rows / kMaxChunks) * k * m;
  if (fits(kMaxChunks) && block_flop >= kMinFourChunkBlockFlop) return kMaxChunks;
  return fits(2) ? 2 : 1;
}

std::vector<RowBlock> ReduceScatterBlocks(int64_t rows, int nranks, int chunks) {
  const int64_t per_rank = rows / nranks, per_block = per_rank / chunks;
  std::vector<RowBlock> blocks;
  blocks.reserve(static_cast<size_t>(nranks) * chunks);
  for (int j = 0; j < chunks; ++j) {
    for (int dest = 0; dest < nranks; ++dest) {
      blocks.push_back({dest, dest * per_rank + j * per_block, j * per_block});
    }
  }
  return blocks;
}

}  // namespace jax_comm_gemm
