// ChunksFor and ReduceScatterBlocks: the pipelined_ce GEMM+ReduceScatter's row
// blocks cover x once, each block's sums land in its owner's rows, the order
// is the same for every rank (it depends on the shape alone), and four chunks
// are made only where a block's GEMM outlasts the host's enqueue of a chunk.
#include <cstdint>
#include <vector>

#include "check.h"
#include "pipelined.h"

using jax_comm_gemm::ChunksFor;
using jax_comm_gemm::kMaxChunks;
using jax_comm_gemm::kMinChunkRows;
using jax_comm_gemm::kMinFourChunkBlockFlop;
using jax_comm_gemm::ReduceScatterBlocks;
using jax_comm_gemm::RowBlock;

TEST(ChunksDivideTheRowsAndKeepBlocksLarge) {
  // The benchmark's GEMM+ReduceScatters at TP 2 (a rank's rows, k and m per GPU).
  CHECK_EQ(ChunksFor(4096, 14336, 8192), kMaxChunks);  // 8192x28672x8192: 2.4e11 a block
  CHECK_EQ(ChunksFor(8192, 4096, 8192), 4);            // 16384x8192x8192
  CHECK_EQ(ChunksFor(4096, 3584, 8192), 4);            // 8192x7168x8192: 6.0e10 a block
  CHECK_EQ(ChunksFor(4096, 2048, 4096), 2);            // 8192x4096x4096: 1.7e10 with 4
  CHECK_EQ(ChunksFor(2048, 2048, 4096), 2);            // 4096^3
  CHECK_EQ(ChunksFor(1024, 4096, 8192), 2);            // 2048x8192x8192: 512 rows a chunk
  // The GPU check rs_pipelined_chunks's shapes (tests/gpu/checks.py).
  CHECK_EQ(ChunksFor(4096, 2048, 10240), 4);  // 8192x4096x10240: 4.3e10 a block
  CHECK_EQ(ChunksFor(3072, 256, 384), 2);
  CHECK_EQ(ChunksFor(1024, 128, 640), 2);
  // Rows that do not divide, or make blocks under kMinChunkRows.
  CHECK_EQ(ChunksFor(4098, 1 << 16, 1 << 16), 2);  // not a multiple of 4
  CHECK_EQ(ChunksFor(1000, 1 << 16, 1 << 16), 2);  // 250 rows a chunk of 4
  CHECK_EQ(ChunksFor(510, 8192, 8192), 1);          // 255 rows a chunk of 2
  CHECK_EQ(ChunksFor(512, 8192, 8192), 2);
  for (int64_t rows : {1, 7, 1000, 1026, 2050, 4100, 8192, 65536}) {
    for (int64_t km : {int64_t{64}, int64_t{4096}, int64_t{1} << 15}) {
      const int c = ChunksFor(rows, km, km);
      CHECK(c >= 1 && c <= kMaxChunks);
      CHECK_EQ(rows % c, int64_t{0});
      CHECK(c == 1 || rows / c >= kMinChunkRows);
      CHECK(c < kMaxChunks || 2.0 * (rows / c) * km * km >= kMinFourChunkBlockFlop);
    }
  }
}

TEST(BlocksCoverEveryRowOnceAndLandInTheOwnersRows) {
  for (int nranks : {1, 2, 4, 8}) {
    for (int chunks : {1, 2, 4}) {
      const int64_t per_block = 3, rows = per_block * chunks * nranks;
      const std::vector<RowBlock> blocks = ReduceScatterBlocks(rows, nranks, chunks);
      CHECK_EQ(blocks.size(), static_cast<size_t>(nranks * chunks));
      std::vector<int> covered(static_cast<size_t>(rows), 0);
      for (const RowBlock& b : blocks) {
        CHECK(b.dest >= 0 && b.dest < nranks);
        // The block's rows are the owner's: its y rows are its x rows less
        // the owner's first row.
        CHECK_EQ(b.x_row - b.dest * (rows / nranks), b.y_row);
        CHECK(b.y_row >= 0 && b.y_row + per_block <= rows / nranks);
        for (int64_t r = b.x_row; r < b.x_row + per_block; ++r) ++covered[static_cast<size_t>(r)];
      }
      for (int c : covered) CHECK_EQ(c, 1);
    }
  }
}

TEST(EveryDestinationsFirstChunkComesFirst) {
  const std::vector<RowBlock> blocks = ReduceScatterBlocks(16, 2, 2);
  CHECK_EQ(blocks.size(), size_t{4});
  const int64_t want[4][3] = {{0, 0, 0}, {1, 8, 0}, {0, 4, 4}, {1, 12, 4}};
  for (size_t i = 0; i < 4; ++i) {
    CHECK_EQ(blocks[i].dest, static_cast<int>(want[i][0]));
    CHECK_EQ(blocks[i].x_row, want[i][1]);
    CHECK_EQ(blocks[i].y_row, want[i][2]);
  }
}
