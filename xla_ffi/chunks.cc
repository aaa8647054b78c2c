#include "chunks.h"

#include <cstddef>

namespace jax_comm_gemm {

int ChunksFor(int64_t rows) {
  int chunks = kMaxChunks;
  while (chunks > 1 && (rows % chunks != 0 || rows / chunks < kMinChunkRows)) chunks /= 2;
  return chunks;
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
