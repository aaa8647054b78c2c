// The timed pick's choice from its samples (timed_pick.h).
#include "timed_pick.h"

#include <algorithm>

namespace jax_comm_gemm {

int FastestByMedian(const std::vector<std::vector<float>>& samples) {
  int fastest = -1;
  float best = 0;
  for (int i = 0; i < static_cast<int>(samples.size()); ++i) {
    if (samples[i].empty()) continue;
    std::vector<float> v = samples[i];
    const size_t mid = v.size() / 2;
    std::nth_element(v.begin(), v.begin() + mid, v.end());
    float median = v[mid];
    if (v.size() % 2 == 0) {  // the mean of the two middle samples
      median = 0.5f * (median + *std::max_element(v.begin(), v.begin() + mid));
    }
    // cuBLASLt's own choice is the prior: another must beat it by the margin.
    if (i == 0) median *= 1.0f - kTimedMargin;
    if (fastest < 0 || median < best) fastest = i, best = median;
  }
  return fastest;
}

}  // namespace jax_comm_gemm
