// extern "C" entry points of SwigluGroupQuantGrad (§5.2) and the SwigluGroup forward (L9).
#include "core/acl_api.h"

using namespace moegrad;

extern "C" {

aclnnStatus aclnnSwigluGroupQuantGradGetWorkspaceSize(
    const aclTensor* gradY, const aclTensor* x, const aclTensor* weightOptional,
    const aclTensor* yOriginOptional, const aclTensor* groupIndexOptional, double clampLimit,
    const aclTensor* gradXOut, const aclTensor* gradWeightOutOptional, uint64_t* workspaceSize,
    aclOpExecutor** executor) {
  return stage_one("swiglu_group_quant_backward", workspaceSize, executor, [&] {
    return plan_swiglu_group_quant_grad(view_of(gradY), view_of(x), view_of(weightOptional),
                                        view_of(yOriginOptional), view_of(groupIndexOptional),
                                        SwigluAttrs{clampLimit}, view_of(gradXOut),
                                        view_of(gradWeightOutOptional));
  });
}

aclnnStatus aclnnSwigluGroupQuantGrad(void* workspace, uint64_t workspaceSize,
                                      aclOpExecutor* executor, aclrtStream stream) {
  return stage_two("swiglu_group_quant_backward", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnSwigluGroupGetWorkspaceSize(const aclTensor* x, const aclTensor* weightOptional,
                                             const aclTensor* groupIndexOptional,
                                             double clampLimit, const aclTensor* yOut,
                                             uint64_t* workspaceSize, aclOpExecutor** executor) {
  return stage_one("swiglu_group", workspaceSize, executor, [&] {
    return plan_swiglu_group(view_of(x), view_of(weightOptional), view_of(groupIndexOptional),
                             SwigluAttrs{clampLimit}, view_of(yOut));
  });
}

aclnnStatus aclnnSwigluGroup(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                             aclrtStream stream) {
  return stage_two("swiglu_group", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnSwigluGroupQuantGetWorkspaceSize(
    const aclTensor* x, const aclTensor* weightOptional, const aclTensor* groupIndexOptional,
    const aclTensor* scaleOptional, int64_t dstType, int64_t quantMode, int64_t blockSize,
    bool roundScale, double clampLimit, double dstTypeMax, bool outputOrigin,
    const aclTensor* yOut, const aclTensor* yScaleOut, const aclTensor* yOriginOut,
    uint64_t* workspaceSize, aclOpExecutor** executor) {
  return stage_one("swiglu_group_quant", workspaceSize, executor, [&] {
    SwigluQuantAttrs a{dstType,    quantMode,  blockSize,   roundScale,
                       clampLimit, dstTypeMax, outputOrigin};
    return plan_swiglu_group_quant(view_of(x), view_of(weightOptional),
                                   view_of(groupIndexOptional), view_of(scaleOptional), a,
                                   view_of(yOut), view_of(yScaleOut), view_of(yOriginOut));
  });
}

aclnnStatus aclnnSwigluGroupQuant(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                  aclrtStream stream) {
  return stage_two("swiglu_group_quant", workspace, workspaceSize, executor, stream);
}

}  // extern "C"
