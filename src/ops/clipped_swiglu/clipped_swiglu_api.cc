// extern "C" entry points of ClippedSwiglu (V1: clamp mode 0), ClippedSwigluV2 (clampMode) and
// ClippedSwigluGrad (clamp mode 0), with the vendor's argument orders (docs/operators.md §9),
// and the moegrad extension ClippedSwigluGradV2 (clampMode, docs/decisions.md L163).
#include "core/acl_api.h"

using namespace moegrad;

namespace {
ClippedSwigluAttrs attrs_of(int64_t dim, double alpha, double limit, double bias,
                            bool interleaved, int64_t clamp_mode) {
  ClippedSwigluAttrs a;
  a.dim = dim;
  a.alpha = alpha;
  a.limit = limit;
  a.bias = bias;
  a.interleaved = interleaved;
  a.clamp_mode = clamp_mode;
  return a;
}
}  // namespace

extern "C" {

aclnnStatus aclnnClippedSwigluGetWorkspaceSize(const aclTensor* x,
                                               const aclTensor* groupIndexOptional, int64_t dim,
                                               double alpha, double limit, double bias,
                                               bool interleaved, const aclTensor* out,
                                               uint64_t* workspaceSize, aclOpExecutor** executor) {
  return stage_one("clipped_swiglu", workspaceSize, executor, [&] {
    return plan_clipped_swiglu(view_of(x), view_of(groupIndexOptional),
                               attrs_of(dim, alpha, limit, bias, interleaved, 0), view_of(out));
  });
}

aclnnStatus aclnnClippedSwiglu(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                               aclrtStream stream) {
  return stage_two("clipped_swiglu", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnClippedSwigluV2GetWorkspaceSize(const aclTensor* x,
                                                 const aclTensor* groupIndexOptional, int64_t dim,
                                                 double alpha, double limit, double bias,
                                                 bool interleaved, int64_t clampMode,
                                                 const aclTensor* out, uint64_t* workspaceSize,
                                                 aclOpExecutor** executor) {
  return stage_one("clipped_swiglu", workspaceSize, executor, [&] {
    return plan_clipped_swiglu(view_of(x), view_of(groupIndexOptional),
                               attrs_of(dim, alpha, limit, bias, interleaved, clampMode),
                               view_of(out));
  });
}

aclnnStatus aclnnClippedSwigluV2(void* workspace, uint64_t workspaceSize,
                                 aclOpExecutor* executor, aclrtStream stream) {
  return stage_two("clipped_swiglu", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnClippedSwigluGradGetWorkspaceSize(
    const aclTensor* gradY, const aclTensor* x, const aclTensor* groupIndexOptional, int64_t dim,
    double alpha, double limit, double bias, bool interleaved, const aclTensor* gradXOut,
    uint64_t* workspaceSize, aclOpExecutor** executor) {
  return stage_one("clipped_swiglu_grad", workspaceSize, executor, [&] {
    return plan_clipped_swiglu_grad(view_of(gradY), view_of(x), view_of(groupIndexOptional),
                                    attrs_of(dim, alpha, limit, bias, interleaved, 0),
                                    view_of(gradXOut));
  });
}

aclnnStatus aclnnClippedSwigluGrad(void* workspace, uint64_t workspaceSize,
                                   aclOpExecutor* executor, aclrtStream stream) {
  return stage_two("clipped_swiglu_grad", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnClippedSwigluGradV2GetWorkspaceSize(
    const aclTensor* gradY, const aclTensor* x, const aclTensor* groupIndexOptional, int64_t dim,
    double alpha, double limit, double bias, bool interleaved, int64_t clampMode,
    const aclTensor* gradXOut, uint64_t* workspaceSize, aclOpExecutor** executor) {
  return stage_one("clipped_swiglu_grad", workspaceSize, executor, [&] {
    return plan_clipped_swiglu_grad(view_of(gradY), view_of(x), view_of(groupIndexOptional),
                                    attrs_of(dim, alpha, limit, bias, interleaved, clampMode),
                                    view_of(gradXOut));
  });
}

aclnnStatus aclnnClippedSwigluGradV2(void* workspace, uint64_t workspaceSize,
                                     aclOpExecutor* executor, aclrtStream stream) {
  return stage_two("clipped_swiglu_grad", workspace, workspaceSize, executor, stream);
}

}  // extern "C"
