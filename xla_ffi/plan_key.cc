// PlanKey's wire form and the messages of a plan that the ranks do not agree on (plan_key.h).
#include "plan_key.h"

#include <string>
#include <utility>

#include <library_types.h>

#include "constants.h"

namespace jax_comm_gemm {
namespace {

// "JCGPKEY" and a format version: a rank running another build (or garbage)
// is reported as such rather than as a shape mismatch.
constexpr uint64_t kFormatWord = 0x4A4347504B455904ull;

// The fields in wire order; the flags are the 0/1 ones.
enum Field : size_t {
  kOp, kXType, kWType, kYType, kTransposeW, kAlgorithm, kXRows, kXCols, kWRows, kWCols,
  kFastAccum,
};
const char* const kFieldNames[kPlanKeyFields] = {
    "operation", "x dtype", "w dtype", "result dtype", "transpose_w", "algorithm",
    "x rows",    "x cols",  "w rows",  "w cols",       "fast accumulation",
};

bool IsFlag(size_t field) {
  return field == kTransposeW || field == kFastAccum;
}

std::array<int64_t, kPlanKeyFields> Fields(const PlanKey& k) {
  return {static_cast<int64_t>(k.op), k.x_type, k.w_type, k.y_type, k.transpose_w ? 1 : 0,
          k.algorithm, k.x_rows, k.x_cols, k.w_rows, k.w_cols, k.fast_accum ? 1 : 0};
}

std::string DtypeName(int64_t dtype) {
  switch (dtype) {
    case CUDA_R_16BF: return "bfloat16";
    case CUDA_R_16F: return "float16";
    case CUDA_R_32F: return "float32";
    case CUDA_R_8F_E4M3: return "float8_e4m3fn";
    case CUDA_R_8F_E5M2: return "float8_e5m2";
    default: return "cudaDataType " + std::to_string(dtype);
  }
}

std::string FormatField(size_t field, int64_t value) {
  if (IsFlag(field)) return value ? "true" : "false";
  switch (field) {
    case kOp:
      return value == static_cast<int64_t>(CommOp::kAllGather) ? kAllGatherMatmulTarget
                                                               : kMatmulReduceScatterTarget;
    case kXType:
    case kWType:
    case kYType: return DtypeName(value);
    case kAlgorithm: {
      const char* name = AlgorithmNameOf(value);
      return name != nullptr ? name : "algorithm " + std::to_string(value);
    }
    default: return std::to_string(value);
  }
}

void PutWord(uint64_t v, unsigned char* out) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<unsigned char>(v >> (8 * i));
}

uint64_t GetWord(const unsigned char* in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(in[i]) << (8 * i);
  return v;
}

// "rank 3", "ranks 0-2, 5": short even for large groups.
std::string RankList(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i > 0) out += ", ";
    out += std::to_string(ranks[i]);
    if (j > i) out += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

// "x rows: rank 0 has 512, rank 1 has 256", values in order of first appearance.
std::string DescribeField(size_t field, const std::vector<PlanKey>& keys) {
  std::vector<std::pair<int64_t, std::vector<int>>> groups;
  for (int r = 0; r < static_cast<int>(keys.size()); ++r) {
    const int64_t v = Fields(keys[r])[field];
    auto it = groups.begin();
    while (it != groups.end() && it->first != v) ++it;
    if (it == groups.end()) {
      groups.push_back({v, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  std::string out = std::string(kFieldNames[field]) + ": ";
  for (size_t g = 0; g < groups.size(); ++g) {
    if (g > 0) out += ", ";
    out += RankList(groups[g].second) + (groups[g].second.size() == 1 ? " has " : " have ") +
           FormatField(field, groups[g].first);
  }
  return out;
}

}  // namespace

PlanKeyBytes SerializePlanKey(const PlanKey& key) {
  PlanKeyBytes out{};
  PutWord(kFormatWord, out.data());
  const auto fields = Fields(key);
  for (size_t i = 0; i < kPlanKeyFields; ++i) {
    PutWord(static_cast<uint64_t>(fields[i]), out.data() + 8 * (i + 1));
  }
  return out;
}

Status ParsePlanKey(const unsigned char* bytes, int rank, PlanKey* out) {
  std::array<int64_t, kPlanKeyFields> f{};
  for (size_t i = 0; i < kPlanKeyFields; ++i) {
    f[i] = static_cast<int64_t>(GetWord(bytes + 8 * (i + 1)));
  }
  bool flags_ok = true;
  for (size_t i = 0; i < kPlanKeyFields; ++i) {
    flags_ok = flags_ok && (!IsFlag(i) || f[i] == 0 || f[i] == 1);
  }
  const bool known_op = f[kOp] == static_cast<int64_t>(CommOp::kAllGather) ||
                        f[kOp] == static_cast<int64_t>(CommOp::kReduceScatter);
  if (GetWord(bytes) != kFormatWord || !known_op || !flags_ok) {
    return Status::FailedPrecondition(
        "plan agreement: rank " + std::to_string(rank) +
        " sent something that is not a jax_comm_gemm plan key (do all processes run the "
        "same jax_comm_gemm build?)");
  }
  out->op = static_cast<CommOp>(f[kOp]);
  out->x_type = f[kXType], out->w_type = f[kWType], out->y_type = f[kYType];
  out->transpose_w = f[kTransposeW] != 0;
  out->algorithm = f[kAlgorithm];
  out->x_rows = f[kXRows], out->x_cols = f[kXCols], out->w_rows = f[kWRows];
  out->w_cols = f[kWCols];
  out->fast_accum = f[kFastAccum] != 0;
  return Status();
}

Status CheckPlanAgreement(const std::vector<PlanKey>& keys) {
  std::string differences;
  for (size_t field = 0; field < kPlanKeyFields; ++field) {
    bool same = true;
    for (const PlanKey& k : keys) same = same && Fields(k)[field] == Fields(keys[0])[field];
    if (same) continue;
    differences += (differences.empty() ? "" : "; ") + DescribeField(field, keys);
  }
  if (differences.empty()) return Status();
  return Status::FailedPrecondition(
      "plan mismatch in the group: " + differences +
      " \u2014 every rank must make the same comm-GEMM calls with the same shapes");
}

Status CheckAlgorithm(CommOp op, int64_t algorithm) {
  if (AlgorithmNameOf(algorithm) != nullptr) return Status();
  std::string allowed;
  for (const AlgorithmName& a : kAlgorithms) {
    allowed += (allowed.empty() ? "" : ", ") + std::string(a.name);
  }
  const char* target =
      op == CommOp::kReduceScatter ? kMatmulReduceScatterTarget : kAllGatherMatmulTarget;
  return Status::InvalidArgument("unknown algorithm " + std::to_string(algorithm) + ": " +
                                 target + " takes " + allowed);
}

Status CheckGatheredPlanKeys(const unsigned char* gathered, int nranks) {
  std::vector<PlanKey> keys(static_cast<size_t>(nranks));
  for (int r = 0; r < nranks; ++r) {
    JCG_RETURN_IF_ERROR(ParsePlanKey(gathered + kPlanKeyBytes * r, r, &keys[r]));
  }
  return CheckPlanAgreement(keys);
}

}  // namespace jax_comm_gemm
