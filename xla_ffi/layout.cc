#include "layout.h"

#include <string>

namespace jax_comm_gemm {

Status GatheredOffset(GatheredLayout layout, size_t gathered_bytes, size_t workspace_bytes,
                      size_t* offset) {
  const std::string sizes = "the gathered operand (" + std::to_string(gathered_bytes) +
                            " bytes) and a " + std::to_string(workspace_bytes) +
                            "-byte cuBLASMp workspace";
  switch (layout) {
    case GatheredLayout::kFront:
      if (gathered_bytes > workspace_bytes) {
        return Status::FailedPrecondition(
            "the 'front' layout does not hold here: " + sizes +
            ": the operand is larger than the workspace");
      }
      *offset = 0;
      return Status();
    case GatheredLayout::kTail:
      // Compared without subtracting, so that sizes near SIZE_MAX cannot wrap.
      if (gathered_bytes > workspace_bytes || workspace_bytes - gathered_bytes < kTailPadding) {
        return Status::FailedPrecondition(
            "the 'tail' layout does not hold here: " + sizes + ": the operand and the " +
            std::to_string(kTailPadding) + "-byte tail padding do not fit");
      }
      *offset = workspace_bytes - gathered_bytes - kTailPadding;
      return Status();
  }
  return Status::InvalidArgument("unknown gathered layout " +
                                 std::to_string(static_cast<int64_t>(layout)));
}

}  // namespace jax_comm_gemm
