// GatheredOffset: where the gathered operand sits in cuBLASMp's workspace.
#include <cstddef>
#include <limits>

#include "check.h"
#include "constants.h"
#include "context.h"

using jax_comm_gemm::GatheredLayout;
using jax_comm_gemm::GatheredOffset;
using jax_comm_gemm::TailPadding;
using jax_comm_gemm::LayoutByNumber;
using jax_comm_gemm::Status;

namespace {

constexpr size_t kMiB = size_t{1} << 20;

}  // namespace

TEST(FrontIsAtOffsetZero) {
  size_t offset = 123;
  CHECK(GatheredOffset(GatheredLayout::kFront, 64 * kMiB, 160 * kMiB, 8, &offset).ok());
  CHECK_EQ(offset, size_t{0});
  offset = 123;
  CHECK(GatheredOffset(GatheredLayout::kFront, 64 * kMiB, 64 * kMiB, 8, &offset).ok());
  CHECK_EQ(offset, size_t{0});
}

TEST(FrontTooSmallWorkspaceIsAnError) {
  size_t offset = 0;
  const Status s = GatheredOffset(GatheredLayout::kFront, 64 * kMiB + 1, 64 * kMiB, 2, &offset);
  CHECK(s.code() == Status::Code::kFailedPrecondition);
  CHECK_CONTAINS(s.message(), "'front' layout does not hold");
  CHECK_CONTAINS(s.message(), "67108865 bytes");
  CHECK_CONTAINS(s.message(), "67108864-byte");
}

TEST(TailPaddingPerGroupSize) {
  // Measured with cuBLASMp 0.10 (benchmarks/results/2026-12-07_h100/layout_probe/).
  CHECK_EQ(TailPadding(2), size_t{16});
  CHECK_EQ(TailPadding(4), size_t{16});
  CHECK_EQ(TailPadding(8), size_t{32});
  // Not measured: an int32 per rank rounded up to 16 bytes (the self-test decides).
  CHECK_EQ(TailPadding(1), size_t{16});
  CHECK_EQ(TailPadding(6), size_t{32});
  CHECK_EQ(TailPadding(16), size_t{64});
  CHECK_EQ(TailPadding(0), size_t{16});
}

TEST(TailEndsItsPaddingBeforeTheEnd) {
  size_t offset = 0;
  // The measured cuBLASMp 0.10 cases: 96 MiB of cuBLASLt workspace before a 4 MiB
  // operand, the workspace 100 MiB + 16 bytes at 2 and 4 ranks, + 32 at 8.
  CHECK(GatheredOffset(GatheredLayout::kTail, 4 * kMiB, 100 * kMiB + 16, 2, &offset).ok());
  CHECK_EQ(offset, 96 * kMiB);
  CHECK(GatheredOffset(GatheredLayout::kTail, 4 * kMiB, 100 * kMiB + 16, 4, &offset).ok());
  CHECK_EQ(offset, 96 * kMiB);
  CHECK(GatheredOffset(GatheredLayout::kTail, 4 * kMiB, 100 * kMiB + 32, 8, &offset).ok());
  CHECK_EQ(offset, 96 * kMiB);
}

TEST(TailExactFitIsAtOffsetZero) {
  size_t offset = 1;
  CHECK(GatheredOffset(GatheredLayout::kTail, 1000, 1016, 2, &offset).ok());
  CHECK_EQ(offset, size_t{0});
  offset = 1;
  CHECK(GatheredOffset(GatheredLayout::kTail, 1000, 1032, 8, &offset).ok());
  CHECK_EQ(offset, size_t{0});
}

TEST(TailWithoutRoomForThePaddingIsAnError) {
  size_t offset = 0;
  Status s = GatheredOffset(GatheredLayout::kTail, 1000, 1015, 2, &offset);
  CHECK(s.code() == Status::Code::kFailedPrecondition);
  CHECK_CONTAINS(s.message(), "'tail' layout does not hold");
  CHECK_CONTAINS(s.message(), "16-byte tail padding of 2 ranks");
  s = GatheredOffset(GatheredLayout::kTail, 1000, 1016, 8, &offset);
  CHECK(s.code() == Status::Code::kFailedPrecondition);
  CHECK_CONTAINS(s.message(), "32-byte tail padding of 8 ranks");
}

TEST(TailLargerThanWorkspaceDoesNotWrap) {
  size_t offset = 0;
  const size_t huge = std::numeric_limits<size_t>::max();
  CHECK(!GatheredOffset(GatheredLayout::kTail, huge, 1024, 2, &offset).ok());
  CHECK(!GatheredOffset(GatheredLayout::kTail, huge - 8, huge, 2, &offset).ok());
  CHECK(GatheredOffset(GatheredLayout::kTail, huge - 16, huge, 2, &offset).ok());
  CHECK_EQ(offset, size_t{0});
  CHECK(!GatheredOffset(GatheredLayout::kTail, huge - 16, huge, 8, &offset).ok());
}

TEST(UnknownLayoutIsAnError) {
  size_t offset = 0;
  const Status s = GatheredOffset(static_cast<GatheredLayout>(7), 1, 1024, 2, &offset);
  CHECK(s.code() == Status::Code::kInvalidArgument);
  CHECK_CONTAINS(s.message(), "unknown gathered layout 7");
}

TEST(LayoutAttributeNumbers) {
  CHECK(LayoutByNumber(0) == GatheredLayout::kFront);
  CHECK(LayoutByNumber(1) == GatheredLayout::kTail);
  CHECK(!LayoutByNumber(2).has_value());
  CHECK(!LayoutByNumber(-1).has_value());
}
