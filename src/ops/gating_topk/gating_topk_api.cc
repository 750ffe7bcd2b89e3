// extern "C" entry points of MoeGatingTopK and MoeGatingTopKBackward (§1.2, §2.2), their Ex
// forms with noRenorm (D33) and MoeGatingReplay (§2.8, D34).
#include "core/acl_api.h"
#include "core/check.h"

using namespace moegrad;

extern "C" {

aclnnStatus aclnnMoeGatingTopKGetWorkspaceSize(
    const aclTensor* x, const aclTensor* biasOptional, int64_t k, int64_t kGroup,
    int64_t groupCount, int64_t groupSelectMode, int64_t renorm, int64_t normType, bool outFlag,
    double routedScalingFactor, double eps, const aclTensor* yOut, const aclTensor* expertIdxOut,
    const aclTensor* outOut, uint64_t* workspaceSize, aclOpExecutor** executor) {
  return stage_one("moe_gating_top_k", workspaceSize, executor, [&] {
    GatingTopKAttrs a{k, kGroup, groupCount, groupSelectMode, renorm, normType, outFlag,
                      routedScalingFactor, eps};
    return plan_moe_gating_top_k(view_of(x), view_of(biasOptional), a, view_of(yOut),
                                 view_of(expertIdxOut), view_of(outOut));
  });
}

aclnnStatus aclnnMoeGatingTopKExGetWorkspaceSize(
    const aclTensor* x, const aclTensor* biasOptional, int64_t k, int64_t kGroup,
    int64_t groupCount, int64_t groupSelectMode, int64_t renorm, int64_t normType, bool outFlag,
    double routedScalingFactor, double eps, bool noRenorm, const aclTensor* yOut,
    const aclTensor* expertIdxOut, const aclTensor* outOut, uint64_t* workspaceSize,
    aclOpExecutor** executor) {
  return stage_one("moe_gating_top_k", workspaceSize, executor, [&] {
    GatingTopKAttrs a{k, kGroup, groupCount, groupSelectMode, renorm, normType, outFlag,
                      routedScalingFactor, eps, noRenorm};
    return plan_moe_gating_top_k(view_of(x), view_of(biasOptional), a, view_of(yOut),
                                 view_of(expertIdxOut), view_of(outOut));
  });
}

aclnnStatus aclnnMoeGatingTopKEx(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                 aclrtStream stream) {
  return stage_two("moe_gating_top_k", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnMoeGatingTopK(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                               aclrtStream stream) {
  return stage_two("moe_gating_top_k", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnMoeGatingTopKBackwardGetWorkspaceSize(
    const aclTensor* xNorm, const aclTensor* gradY, const aclTensor* expertIdx, int64_t renorm,
    int64_t normType, double routedScalingFactor, double eps, const aclTensor* out,
    uint64_t* workspaceSize, aclOpExecutor** executor) {
  return stage_one("moe_gating_top_k_backward", workspaceSize, executor, [&] {
    require_index32("moe_gating_top_k_backward", view_of(expertIdx), "expert_idx");
    GatingTopKBackwardAttrs a{renorm, normType, routedScalingFactor, eps};
    return plan_moe_gating_top_k_backward(view_of(xNorm), view_of(gradY), view_of(expertIdx), a,
                                          view_of(out));
  });
}

aclnnStatus aclnnMoeGatingTopKBackward(void* workspace, uint64_t workspaceSize,
                                       aclOpExecutor* executor, aclrtStream stream) {
  return stage_two("moe_gating_top_k_backward", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnMoeGatingTopKBackwardExGetWorkspaceSize(
    const aclTensor* xNorm, const aclTensor* gradY, const aclTensor* expertIdx, int64_t renorm,
    int64_t normType, double routedScalingFactor, double eps, bool noRenorm, const aclTensor* out,
    uint64_t* workspaceSize, aclOpExecutor** executor) {
  return stage_one("moe_gating_top_k_backward", workspaceSize, executor, [&] {
    require_index32("moe_gating_top_k_backward", view_of(expertIdx), "expert_idx");
    GatingTopKBackwardAttrs a{renorm, normType, routedScalingFactor, eps, noRenorm};
    return plan_moe_gating_top_k_backward(view_of(xNorm), view_of(gradY), view_of(expertIdx), a,
                                          view_of(out));
  });
}

aclnnStatus aclnnMoeGatingTopKBackwardEx(void* workspace, uint64_t workspaceSize,
                                         aclOpExecutor* executor, aclrtStream stream) {
  return stage_two("moe_gating_top_k_backward", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnMoeGatingReplayGetWorkspaceSize(
    const aclTensor* x, const aclTensor* expertIdx, const aclTensor* biasOptional, int64_t renorm,
    int64_t normType, double routedScalingFactor, double eps, bool noRenorm, const aclTensor* yOut,
    const aclTensor* normOut, uint64_t* workspaceSize, aclOpExecutor** executor) {
  return stage_one("moe_gating_replay", workspaceSize, executor, [&] {
    require_index32("moe_gating_replay", view_of(expertIdx), "expert_idx");
    GatingReplayAttrs a{renorm, normType, routedScalingFactor, eps, noRenorm};
    return plan_moe_gating_replay(view_of(x), view_of(expertIdx), view_of(biasOptional), a,
                                  view_of(yOut), view_of(normOut));
  });
}

aclnnStatus aclnnMoeGatingReplay(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                 aclrtStream stream) {
  return stage_two("moe_gating_replay", workspace, workspaceSize, executor, stream);
}

}  // extern "C"
