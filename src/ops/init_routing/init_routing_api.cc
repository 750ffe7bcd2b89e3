// extern "C" entry points of MoeInitRoutingV2, MoeInitRoutingV3 and MoeInitRoutingV2Grad
// (docs/operators.md §8.2, §8.8, §8.9). The vendor's attribute encodings are mapped onto the one
// C++ plan here.
#include "core/acl_api.h"
#include "core/acl_int_array.h"
#include "core/check.h"

using namespace moegrad;

namespace {

void check_count_output(const Validator& v, const aclTensor* t, const char* arg, DType want) {
  if (t == nullptr) v.fail(kErrNullptr, arg, "required by its flag; got null");
  if (t->view.dtype != want) {
    v.fail(kErrParamInvalid, arg, cat("dtype must be ", dtype_name(want), "; got ",
                                      dtype_name(t->view.dtype)));
  }
}

}  // namespace

extern "C" {

aclnnStatus aclnnMoeInitRoutingV2GetWorkspaceSize(
    const aclTensor* x, const aclTensor* expertIdx, int64_t activeNum, int64_t expertCapacity,
    int64_t expertNum, int64_t dropPadMode, int64_t expertTokensCountOrCumsumFlag,
    bool expertTokensBeforeCapacityFlag, const aclTensor* expandedXOut,
    const aclTensor* expandedRowIdxOut, const aclTensor* expertTokensCountOrCumsumOut,
    const aclTensor* expertTokensBeforeCapacityOut, uint64_t* workspaceSize,
    aclOpExecutor** executor) {
  return stage_one("moe_init_routing", workspaceSize, executor, [&] {
    Validator v("moe_init_routing", kErrInnerNullptr);
    v.present(view_of(x), "x");
    v.present(view_of(expertIdx), "expert_idx");
    v.present(view_of(expandedXOut), "expanded_x");
    v.present(view_of(expandedRowIdxOut), "expanded_row_idx");
    require_index32("moe_init_routing", view_of(expertIdx), "expert_idx");
    v.check_shape(activeNum >= 0, "active_num", "must be >= 0; got ", activeNum);
    v.check_shape(expertCapacity >= 0, "expert_capacity",
                  "must be >= 0; got ", expertCapacity);
    v.check_shape(expertNum >= 0, "expert_num", "must be >= 0; got ", expertNum);
    v.check_shape(expertTokensCountOrCumsumFlag >= 0 && expertTokensCountOrCumsumFlag <= 2,
                  "expert_tokens_count_or_cumsum_flag",
                  "must be 0 (none), 1 (cumsum) or 2 (count); got ",
                  expertTokensCountOrCumsumFlag);
    InitRoutingAttrs a;
    a.expert_num = expertNum;
    a.drop_pad_mode = dropPadMode;
    const aclTensor* tokens = nullptr;
    if (dropPadMode == 0) {
      a.active_num = activeNum;
      if (expertTokensCountOrCumsumFlag > 0) {
        a.expert_tokens_num_flag = true;
        a.expert_tokens_num_type = expertTokensCountOrCumsumFlag == 1 ? 0 : 1;
        tokens = expertTokensCountOrCumsumOut;
        check_count_output(v, tokens, "expert_tokens_count_or_cumsum", DType::kInt32);
      }
    } else if (dropPadMode == 1) {
      a.expert_capacity = expertCapacity;
      if (expertTokensBeforeCapacityFlag) {
        a.expert_tokens_num_flag = true;
        a.expert_tokens_num_type = 1;
        tokens = expertTokensBeforeCapacityOut;
        check_count_output(v, tokens, "expert_tokens_before_capacity", DType::kInt32);
      }
    }
    return plan_moe_init_routing(view_of(x), view_of(expertIdx), a, view_of(expandedXOut),
                                 view_of(expandedRowIdxOut), view_of(tokens));
  });
}

aclnnStatus aclnnMoeInitRoutingV2(void* workspace, uint64_t workspaceSize,
                                  aclOpExecutor* executor, aclrtStream stream) {
  return stage_two("moe_init_routing", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnMoeInitRoutingV3GetWorkspaceSize(
    const aclTensor* x, const aclTensor* expertIdx, const aclTensor* scaleOptional,
    const aclTensor* offsetOptional, int64_t activeNum, int64_t expertCapacity, int64_t expertNum,
    int64_t dropPadMode, int64_t expertTokensNumType, bool expertTokensNumFlag, int64_t quantMode,
    const aclIntArray* activeExpertRangeOptional, int64_t rowIdxType,
    const aclTensor* expandedXOut, const aclTensor* expandedRowIdxOut,
    const aclTensor* expertTokensCountOrCumsumOut, const aclTensor* /*expandedScaleOut*/,
    uint64_t* workspaceSize, aclOpExecutor** executor) {
  return stage_one("moe_init_routing", workspaceSize, executor, [&] {
    Validator v("moe_init_routing", kErrInnerNullptr);
    v.present(view_of(x), "x");
    v.present(view_of(expertIdx), "expert_idx");
    v.present(view_of(expandedXOut), "expanded_x");
    v.present(view_of(expandedRowIdxOut), "expanded_row_idx");
    require_index32("moe_init_routing", view_of(expertIdx), "expert_idx");
    // No quantisation in this release (D25).
    v.check(quantMode == -1, kErrParamInvalid, "quant_mode",
            "only -1 (no quantisation) is supported; got ", quantMode);
    v.check(scaleOptional == nullptr, kErrParamInvalid, "scale",
            "is not supported (no quantisation, no scale permutation); got a tensor");
    v.check(offsetOptional == nullptr, kErrParamInvalid, "offset",
            "is not supported (no quantisation); got a tensor");
    v.check_shape(expertNum >= 1, "expert_num", "must be >= 1; got ", expertNum);
    InitRoutingAttrs a;
    a.active_num = activeNum;
    a.expert_capacity = expertCapacity;
    a.expert_num = expertNum;
    a.drop_pad_mode = dropPadMode;
    a.expert_tokens_num_type = expertTokensNumType;
    a.expert_tokens_num_flag = expertTokensNumFlag;
    a.row_idx_type = rowIdxType;
    if (activeExpertRangeOptional != nullptr && !activeExpertRangeOptional->values.empty()) {
      const auto& r = activeExpertRangeOptional->values;
      if (r.size() != 2) {
        // The list as given (L154), not only its length.
        std::string got;
        for (size_t i = 0; i < r.size(); ++i) got += cat(i ? ", " : "", r[i]);
        v.fail_shape("active_expert_range", cat("must hold 2 values [start, end]; got [", got,
                                                "] (", r.size(), " values)"));
      }
      a.has_range = true;
      a.expert_start = r[0];
      a.expert_end = r[1];
    }
    if (expertTokensNumFlag) {
      check_count_output(v, expertTokensCountOrCumsumOut, "expert_tokens_count_or_cumsum",
                         DType::kInt64);
    }
    return plan_moe_init_routing(view_of(x), view_of(expertIdx), a, view_of(expandedXOut),
                                 view_of(expandedRowIdxOut),
                                 expertTokensNumFlag ? view_of(expertTokensCountOrCumsumOut)
                                                     : nullptr);
  });
}

aclnnStatus aclnnMoeInitRoutingV3(void* workspace, uint64_t workspaceSize,
                                  aclOpExecutor* executor, aclrtStream stream) {
  return stage_two("moe_init_routing", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnMoeInitRoutingV2GradGetWorkspaceSize(
    const aclTensor* gradExpandedX, const aclTensor* expandedRowIdx, int64_t topK,
    int64_t dropPadMode, int64_t activeNum, const aclTensor* out, uint64_t* workspaceSize,
    aclOpExecutor** executor) {
  return stage_one("moe_init_routing_grad", workspaceSize, executor, [&] {
    require_index32("moe_init_routing_grad", view_of(expandedRowIdx), "expanded_row_idx");
    InitRoutingGradAttrs a{topK, dropPadMode, activeNum};
    return plan_moe_init_routing_grad(view_of(gradExpandedX), view_of(expandedRowIdx), a,
                                      view_of(out));
  });
}

aclnnStatus aclnnMoeInitRoutingV2Grad(void* workspace, uint64_t workspaceSize,
                                      aclOpExecutor* executor, aclrtStream stream) {
  return stage_two("moe_init_routing_grad", workspace, workspaceSize, executor, stream);
}

}  // extern "C"
