// extern "C" entry points of MoeFinalizeRoutingV2 and MoeFinalizeRoutingV2Grad (§3.2, §4.2).
#include "core/acl_api.h"
#include "core/check.h"

using namespace moegrad;

extern "C" {

aclnnStatus aclnnMoeFinalizeRoutingV2GetWorkspaceSize(
    const aclTensor* expandedX, const aclTensor* expandedRowIdx, const aclTensor* x1Optional,
    const aclTensor* x2Optional, const aclTensor* biasOptional, const aclTensor* scalesOptional,
    const aclTensor* expertIdxOptional, int64_t dropPadMode, const aclTensor* out,
    uint64_t* workspaceSize, aclOpExecutor** executor) {
  return stage_one("moe_finalize_routing", workspaceSize, executor, [&] {
    require_index32("moe_finalize_routing", view_of(expandedRowIdx), "expanded_row_idx");
    require_index32("moe_finalize_routing", view_of(expertIdxOptional), "expert_idx");
    return plan_moe_finalize_routing(view_of(expandedX), view_of(expandedRowIdx),
                                     view_of(x1Optional), view_of(x2Optional),
                                     view_of(biasOptional), view_of(scalesOptional),
                                     view_of(expertIdxOptional), FinalizeRoutingAttrs{dropPadMode},
                                     view_of(out));
  });
}

aclnnStatus aclnnMoeFinalizeRoutingV2(void* workspace, uint64_t workspaceSize,
                                      aclOpExecutor* executor, aclrtStream stream) {
  return stage_two("moe_finalize_routing", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnMoeFinalizeRoutingV2GradGetWorkspaceSize(
    const aclTensor* gradY, const aclTensor* expandedRowIdx, const aclTensor* expandedXOptional,
    const aclTensor* scalesOptional, const aclTensor* expertIdxOptional,
    const aclTensor* biasOptional, int64_t dropPadMode, int64_t activeNum, int64_t expertNum,
    int64_t expertCapacity, const aclTensor* gradExpandedXOut, const aclTensor* gradScalesOut,
    uint64_t* workspaceSize, aclOpExecutor** executor) {
  return stage_one("moe_finalize_routing_grad", workspaceSize, executor, [&] {
    require_index32("moe_finalize_routing_grad", view_of(expandedRowIdx), "expanded_row_idx");
    if (scalesOptional && biasOptional) {  // expert_idx is only read (and checked) with both
      require_index32("moe_finalize_routing_grad", view_of(expertIdxOptional), "expert_idx");
    }
    FinalizeRoutingGradAttrs a{dropPadMode, activeNum, expertNum, expertCapacity};
    return plan_moe_finalize_routing_grad(view_of(gradY), view_of(expandedRowIdx),
                                          view_of(expandedXOptional), view_of(scalesOptional),
                                          view_of(expertIdxOptional), view_of(biasOptional), a,
                                          view_of(gradExpandedXOut), view_of(gradScalesOut));
  });
}

aclnnStatus aclnnMoeFinalizeRoutingV2Grad(void* workspace, uint64_t workspaceSize,
                                          aclOpExecutor* executor, aclrtStream stream) {
  return stage_two("moe_finalize_routing_grad", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnMoeFinalizeRoutingBiasGradGetWorkspaceSize(
    const aclTensor* gradY, const aclTensor* expertIdx, const aclTensor* scalesOptional,
    int64_t expertNum, const aclTensor* gradBiasOut, uint64_t* workspaceSize,
    aclOpExecutor** executor) {
  return stage_one("moe_finalize_routing_bias_grad", workspaceSize, executor, [&] {
    require_index32("moe_finalize_routing_bias_grad", view_of(expertIdx), "expert_idx");
    return plan_moe_finalize_routing_bias_grad(view_of(gradY), view_of(expertIdx),
                                               view_of(scalesOptional),
                                               FinalizeRoutingBiasGradAttrs{expertNum},
                                               view_of(gradBiasOut));
  });
}

aclnnStatus aclnnMoeFinalizeRoutingBiasGrad(void* workspace, uint64_t workspaceSize,
                                            aclOpExecutor* executor, aclrtStream stream) {
  return stage_two("moe_finalize_routing_bias_grad", workspace, workspaceSize, executor, stream);
}

}  // extern "C"
