// GatheredOffset: where the gathered operand sits in cuBLASMp's workspace.
#include <cstddef>
#include <limits>

#include "check.h"
#include "constants.h"
#include "context.h"

using jax_comm_gemm::GatheredLayout;
using jax_comm_gemm::GatheredOffset;
using jax_comm_gemm::kTailPadding;
using jax_comm_gemm::LayoutByNumber;
using jax_comm_gemm::Status;

namespace {

constexpr size_t kMiB = size_t{1} << 20;

}  // namespace

TEST(FrontIsAtOffsetZero) {
  size_t offset = 123;
  CHECK(GatheredOffset(GatheredLayout::kFront, 64 * kMiB, 160 * kMiB, &offset).ok());
  CHECK_EQ(offset, size_t{0});
  offset = 123;
  CHECK(GatheredOffset(GatheredLayout::kFront, 64 * kMiB, 64 * kMiB, &offset).ok());
  CHECK_EQ(offset, size_t{0});
}

TEST(FrontTooSmallWorkspaceIsAnError) {
  size_t offset = 0;
  const Status s = GatheredOffset(GatheredLayout::kFront, 64 * kMiB + 1, 64 * kMiB, &offset);
  CHECK(s.code() == Status::Code::kFailedPrecondition);
  CHECK_CONTAINS(s.message(), "'front' layout does not hold");
  CHECK_CONTAINS(s.message(), "67108865 bytes");
  CHECK_CONTAINS(s.message(), "67108864-byte");
}

TEST(TailEndsSixteenBytesBeforeTheEnd) {
  CHECK_EQ(kTailPadding, size_t{16});
  size_t offset = 0;
  // The measured cuBLASMp 0.10 case: 96 MiB of cuBLASLt workspace before the operand.
  CHECK(GatheredOffset(GatheredLayout::kTail, 64 * kMiB, 160 * kMiB + 16, &offset).ok());
  CHECK_EQ(offset, 96 * kMiB);
}

TEST(TailExactFitIsAtOffsetZero) {
  size_t offset = 1;
  CHECK(GatheredOffset(GatheredLayout::kTail, 1000, 1016, &offset).ok());
  CHECK_EQ(offset, size_t{0});
}

TEST(TailWithoutRoomForThePaddingIsAnError) {
  size_t offset = 0;
  const Status s = GatheredOffset(GatheredLayout::kTail, 1000, 1015, &offset);
  CHECK(s.code() == Status::Code::kFailedPrecondition);
  CHECK_CONTAINS(s.message(), "'tail' layout does not hold");
  CHECK_CONTAINS(s.message(), "16-byte tail padding");
}

TEST(TailLargerThanWorkspaceDoesNotWrap) {
  size_t offset = 0;
  const size_t huge = std::numeric_limits<size_t>::max();
  CHECK(!GatheredOffset(GatheredLayout::kTail, huge, 1024, &offset).ok());
  CHECK(!GatheredOffset(GatheredLayout::kTail, huge - 8, huge, &offset).ok());
  CHECK(GatheredOffset(GatheredLayout::kTail, huge - 16, huge, &offset).ok());
  CHECK_EQ(offset, size_t{0});
}

TEST(UnknownLayoutIsAnError) {
  size_t offset = 0;
  const Status s = GatheredOffset(static_cast<GatheredLayout>(7), 1, 1024, &offset);
  CHECK(s.code() == Status::Code::kInvalidArgument);
  CHECK_CONTAINS(s.message(), "unknown gathered layout 7");
}

TEST(LayoutAttributeNumbers) {
  CHECK(LayoutByNumber(0) == GatheredLayout::kFront);
  CHECK(LayoutByNumber(1) == GatheredLayout::kTail);
  CHECK(!LayoutByNumber(2).has_value());
  CHECK(!LayoutByNumber(-1).has_value());
}
