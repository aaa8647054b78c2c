// FastestByMedian: a timed pick takes the candidate with the smallest median,
// keeps cuBLASLt's first choice unless another beats it by the margin, skips
// candidates that did not run, and is not swayed by one outlying sample.
#include <vector>

#include "check.h"
#include "timed_pick.h"

using jax_comm_gemm::FastestByMedian;
using jax_comm_gemm::kTimedMargin;

TEST(TakesTheSmallestMedian) {
  CHECK_EQ(FastestByMedian({{1.0f, 1.0f, 1.0f}, {0.9f, 0.9f, 0.9f}, {0.95f, 0.95f, 0.95f}}), 1);
  CHECK_EQ(FastestByMedian({{1.0f, 1.0f, 1.0f}, {1.2f, 1.2f, 1.2f}, {0.8f, 0.8f, 0.8f}}), 2);
}

TEST(AnOutlyingSampleDoesNotDecide) {
  // Candidate 1 has one fast sample (a clock swing) but the slower median.
  CHECK_EQ(FastestByMedian({{1.0f, 1.0f, 1.0f, 1.0f, 1.0f}, {0.5f, 1.1f, 1.1f, 1.1f, 1.1f}}), 0);
  // Candidate 0 has one slow sample but the faster median.
  CHECK_EQ(FastestByMedian({{3.0f, 0.9f, 0.9f, 0.9f, 0.9f}, {1.0f, 1.0f, 1.0f, 1.0f, 1.0f}}), 0);
}

TEST(TheFirstCandidateStaysWithinTheMargin) {
  const float just_inside = 1.0f - 0.5f * kTimedMargin;
  const float just_outside = 1.0f - 2.0f * kTimedMargin;
  CHECK_EQ(FastestByMedian({{1.0f, 1.0f, 1.0f}, {just_inside, just_inside, just_inside}}), 0);
  CHECK_EQ(FastestByMedian({{1.0f, 1.0f, 1.0f}, {just_outside, just_outside, just_outside}}), 1);
  // The margin favours the first candidate only, not every earlier one.
  CHECK_EQ(FastestByMedian({{2.0f}, {1.0f}, {1.0f - 0.5f * kTimedMargin}}), 2);
}

TEST(CandidatesThatDidNotRunAreLeftOut) {
  CHECK_EQ(FastestByMedian({{}, {2.0f, 2.0f}, {}, {3.0f, 3.0f}}), 1);
  CHECK_EQ(FastestByMedian({{}, {}}), -1);
  CHECK_EQ(FastestByMedian({}), -1);
}
