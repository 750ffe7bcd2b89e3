// aclnnMoeFinalizeRoutingV2Grad through the C API: the validation rules of operators.md §3.6
// with decisions D4, D5, D6, D18, D19 and docs/decisions.md L6 (dtypes/layout 161002, shapes,
// attributes and index values 561103), and values against the float64 reference (§3.5, worked
// example §3.9, D5, D7, activeNum truncation, drop-pad zero fill).
#include "reference.h"
#include "test_util.h"

using namespace mgt;

namespace {

struct FinalizeGradCase : OpCase {
  Tensor grad_y, expanded_row_idx, expanded_x, scales, expert_idx, bias, grad_expanded_x,
      grad_scales;
  int64_t drop_pad_mode = 0, active_num = 0, expert_num = 0, expert_capacity = 0;
  int64_t R, K, H, E;

  // A valid dropless call with every optional input present (row layout r*K + k).
  FinalizeGradCase(int64_t r = 3, int64_t k = 2, int64_t h = 4, int64_t e = 3,
                   aclDataType dt = ACL_FLOAT, aclDataType sdt = ACL_FLOAT, uint32_t salt = 9)
      : R(r), K(k), H(h), E(e) {
    Rng rng(salt);
    std::vector<double> gy(R * H);
    for (auto& v : gy) v = rng.signed_uniform(0.05, 2.0);
    grad_y = Tensor::from({R, H}, dt, gy);
    expanded_row_idx = Tensor::from_i32({R * K}, rng.permutation(static_cast<int32_t>(R * K)));
    expanded_x = Tensor::from({R * K, H}, dt, rng.uniform_vec(R * K * H, -2, 2));
    scales = Tensor::from({R, K}, sdt, rng.uniform_vec(R * K, 0.05, 1.5));
    std::vector<int32_t> eid(R * K);
    for (auto& v : eid) v = static_cast<int32_t>(rng.integer(0, E - 1));
    expert_idx = Tensor::from_i32({R, K}, eid);
    bias = Tensor::from({E, H}, dt, rng.uniform_vec(E * H, -0.5, 0.5));
    grad_expanded_x = Tensor({R * K, H}, dt);
    grad_scales = Tensor({R, K}, sdt);
  }
  // Switch to drop-pad mode 1 with E2 experts x C capacity; idx has R*K entries.
  void to_drop_pad(int64_t e2, int64_t cap, const std::vector<int32_t>& idx, uint32_t salt = 2) {
    Rng rng(salt);
    drop_pad_mode = 1;
    expert_num = e2;
    expert_capacity = cap;
    expanded_x = Tensor::from({e2, cap, H}, grad_y.dtype(), rng.uniform_vec(e2 * cap * H, -2, 2));
    grad_expanded_x = Tensor({e2, cap, H}, grad_y.dtype());
    expanded_row_idx = Tensor::from_i32({static_cast<int64_t>(idx.size())}, idx);
    if (!bias.is_null()) bias = Tensor::from({e2, H}, grad_y.dtype(), rng.uniform_vec(e2 * H, -0.5, 0.5));
    if (!expert_idx.is_null()) {
      std::vector<int32_t> eid(R * K);
      for (auto& v : eid) v = static_cast<int32_t>(rng.integer(0, e2 - 1));
      expert_idx = Tensor::from_i32({R, K}, eid);
    }
  }
  void drop_scales() {
    scales = Tensor();
    grad_scales = Tensor({R, 1}, grad_y.dtype());
  }
  aclnnStatus stage1(uint64_t* ws, aclOpExecutor** ex) override {
    return aclnnMoeFinalizeRoutingV2GradGetWorkspaceSize(
        grad_y.handle(), expanded_row_idx.handle(), expanded_x.handle(), scales.handle(),
        expert_idx.handle(), bias.handle(), drop_pad_mode, active_num, expert_num,
        expert_capacity, grad_expanded_x.handle(), grad_scales.handle(), ws, ex);
  }
  aclnnStatus stage2(void* ws, uint64_t size, aclOpExecutor* ex) override {
    return aclnnMoeFinalizeRoutingV2Grad(ws, size, ex, nullptr);
  }
  std::vector<Tensor*> outputs() override { return {&grad_expanded_x, &grad_scales}; }

  void check_against_reference(const std::string& what) {
    const bool has_scales = !scales.is_null();
    const bool has_bias = has_scales && !bias.is_null();
    const int64_t k = has_scales ? K : 1;
    std::vector<int32_t> idx(expanded_row_idx.numel()), eid;
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = expanded_row_idx.i32(i);
    if (has_bias) {
      eid.resize(expert_idx.numel());
      for (size_t i = 0; i < eid.size(); ++i) eid[i] = expert_idx.i32(i);
    }
    std::vector<double> ex = has_scales ? expanded_x.values() : std::vector<double>(),
                        s = has_scales ? scales.values() : std::vector<double>(),
                        b = has_bias ? bias.values() : std::vector<double>();
    const int64_t rows = grad_expanded_x.numel() / H;
    ref::FinalizeGrad r = ref::finalize_grad(grad_y.values(), idx, has_scales ? &ex : nullptr,
                                             has_scales ? &s : nullptr, has_bias ? &eid : nullptr,
                                             has_bias ? &b : nullptr, R, k, H, rows);
    expect_close(grad_expanded_x, r.grad_ex, what + " grad_expanded_x");
    if (has_scales) {
      expect_close(grad_scales, r.grad_scales, what + " grad_scales", r.scales_scale,
                   static_cast<double>(H));
    } else {
      for (int64_t i = 0; i < grad_scales.numel(); ++i) {
        EXPECT_EQ(grad_scales.get(i), 0.0) << what << ": grad_scales must be zeros (D5)";
      }
    }
  }
};

using R_ = Rule<FinalizeGradCase>;
constexpr aclnnStatus kNull = ACLNN_ERR_PARAM_NULLPTR;
constexpr aclnnStatus kInv = ACLNN_ERR_PARAM_INVALID;
constexpr aclnnStatus kShape = ACLNN_ERR_INNER_NULLPTR;

const std::vector<int32_t> kDropIdx = {7, -1, 0, 3, 5, 1};  // R*K = 6 slots over E*C = 2*4

const std::vector<R_> kRules = {
    // null pointers: 161001
    {"NullGradY", [](FinalizeGradCase& c) { c.grad_y = Tensor(); }, kNull, "grad_y|gradY"},
    {"NullExpandedRowIdx", [](FinalizeGradCase& c) { c.expanded_row_idx = Tensor(); }, kNull, "expanded_row_idx|expandedRowIdx"},
    {"NullGradExpandedX", [](FinalizeGradCase& c) { c.grad_expanded_x = Tensor(); }, kNull, "grad_expanded_x|gradExpandedXOut"},
    {"NullGradScales", [](FinalizeGradCase& c) { c.grad_scales = Tensor(); }, kNull, "grad_scales|gradScalesOut"},
    {"NullDataGradY", [](FinalizeGradCase& c) { c.grad_y = Tensor::null_data({3, 4}, ACL_FLOAT); }, kNull, "grad_y|gradY"},
    {"NullWorkspaceSize", [](FinalizeGradCase& c) { c.null_workspace_size = true; }, kNull, "workspaceSize"},
    {"NullExecutor", [](FinalizeGradCase& c) { c.null_executor = true; }, kNull, "executor"},
    // dtypes: 161002
    {"GradYInt32", [](FinalizeGradCase& c) { c.grad_y = Tensor({3, 4}, ACL_INT32); }, kInv, "grad_y|gradY"},
    {"GradYDouble", [](FinalizeGradCase& c) { c.grad_y = Tensor({3, 4}, ACL_DOUBLE); }, kInv, "grad_y|gradY"},
    {"ExpandedRowIdxInt64", [](FinalizeGradCase& c) { c.expanded_row_idx = Tensor({6}, ACL_INT64); }, kInv, "expanded_row_idx|expandedRowIdx"},
    {"ExpandedXDtypeNotGradY", [](FinalizeGradCase& c) { c.expanded_x = Tensor({6, 4}, ACL_FLOAT16); }, kInv, "expanded_x|expandedX"},
    {"ScalesInt32", [](FinalizeGradCase& c) { c.scales = Tensor({3, 2}, ACL_INT32); c.grad_scales = Tensor({3, 2}, ACL_INT32); }, kInv, "scales"},
    {"ExpertIdxInt64", [](FinalizeGradCase& c) { c.expert_idx = Tensor({3, 2}, ACL_INT64); }, kInv, "expert_idx|expertIdx"},
    {"BiasDtypeNotGradY", [](FinalizeGradCase& c) { c.bias = Tensor({3, 4}, ACL_BF16); }, kInv, "bias"},
    {"GradExpandedXDtypeNotGradY", [](FinalizeGradCase& c) { c.grad_expanded_x = Tensor({6, 4}, ACL_FLOAT16); }, kInv, "grad_expanded_x|gradExpandedXOut"},
    {"GradScalesDtypeNotScales", [](FinalizeGradCase& c) { c.grad_scales = Tensor({3, 2}, ACL_BF16); }, kInv, "grad_scales|gradScalesOut"},
    {"GradScalesDtypeNotGradYWithoutScales", [](FinalizeGradCase& c) {
       c.drop_scales(); c.grad_scales = Tensor({3, 1}, ACL_FLOAT16);
       c.expanded_row_idx = Tensor::from_i32({3}, {2, 0, 1}); c.grad_expanded_x = Tensor({3, 4}, ACL_FLOAT);
     }, kInv, "grad_scales|gradScalesOut"},
    // attributes: 561103
    {"DropPadMode2", [](FinalizeGradCase& c) { c.drop_pad_mode = 2; }, kShape, "drop_pad_mode|dropPadMode", {"2"}},
    {"DropPadMode3", [](FinalizeGradCase& c) { c.drop_pad_mode = 3; }, kShape, "drop_pad_mode|dropPadMode", {"3"}},
    {"DropPadModeMinus1", [](FinalizeGradCase& c) { c.drop_pad_mode = -1; }, kShape, "drop_pad_mode|dropPadMode"},
    {"Mode1ExpertNumZero", [](FinalizeGradCase& c) { c.to_drop_pad(2, 4, kDropIdx); c.expert_num = 0; }, kShape, "expert_num|expertNum"},
    {"Mode1ExpertNumNegative", [](FinalizeGradCase& c) { c.to_drop_pad(2, 4, kDropIdx); c.expert_num = -2; }, kShape, "expert_num|expertNum"},
    {"Mode1ExpertCapacityZero", [](FinalizeGradCase& c) { c.to_drop_pad(2, 4, kDropIdx); c.expert_capacity = 0; }, kShape, "expert_capacity|expertCapacity"},
    {"Mode1ExpertCapacityNegative", [](FinalizeGradCase& c) { c.to_drop_pad(2, 4, kDropIdx); c.expert_capacity = -1; }, kShape, "expert_capacity|expertCapacity"},
    // shapes: 561103
    {"GradYRank1", [](FinalizeGradCase& c) { c.grad_y = Tensor({12}, ACL_FLOAT); }, kShape, "grad_y|gradY"},
    {"GradYRank3", [](FinalizeGradCase& c) { c.grad_y = Tensor({3, 4, 1}, ACL_FLOAT); }, kShape, "grad_y|gradY"},
    {"HiddenZero", [](FinalizeGradCase& c) {
       c.grad_y = Tensor({3, 0}, ACL_FLOAT); c.expanded_x = Tensor({6, 0}, ACL_FLOAT); c.bias = Tensor({3, 0}, ACL_FLOAT);
       c.grad_expanded_x = Tensor({6, 0}, ACL_FLOAT);
     }, kShape, "grad_y|gradY|H"},
    {"KZero", [](FinalizeGradCase& c) {
       c.scales = Tensor({3, 0}, ACL_FLOAT); c.grad_scales = Tensor({3, 0}, ACL_FLOAT);
       c.expanded_row_idx = Tensor({0}, ACL_INT32); c.expanded_x = Tensor({0, 4}, ACL_FLOAT);
       c.grad_expanded_x = Tensor({0, 4}, ACL_FLOAT); c.bias = Tensor(); c.expert_idx = Tensor();
     }, kShape, "scales|K"},
    {"ExpandedRowIdxRank2", [](FinalizeGradCase& c) { c.expanded_row_idx = Tensor::from_i32({3, 2}, {0, 1, 2, 3, 4, 5}); }, kShape, "expanded_row_idx|expandedRowIdx"},
    {"ScalesWithoutExpandedX", [](FinalizeGradCase& c) { c.expanded_x = Tensor(); }, kShape, "expanded_x|expandedX"},
    {"ExpandedXRank3InMode0", [](FinalizeGradCase& c) { c.expanded_x = Tensor({2, 3, 4}, ACL_FLOAT); }, kShape, "expanded_x|expandedX"},
    {"ExpandedXRank2InMode1", [](FinalizeGradCase& c) { c.to_drop_pad(2, 4, kDropIdx); c.expanded_x = Tensor({8, 4}, ACL_FLOAT); }, kShape, "expanded_x|expandedX"},
    {"ScalesRank1", [](FinalizeGradCase& c) { c.scales = Tensor({6}, ACL_FLOAT); }, kShape, "scales"},
    {"ScalesRank3", [](FinalizeGradCase& c) { c.scales = Tensor({3, 2, 1}, ACL_FLOAT); }, kShape, "scales"},
    {"ScalesDim0NotR", [](FinalizeGradCase& c) { c.scales = Tensor({2, 3}, ACL_FLOAT); }, kShape, "scales"},
    {"ExpandedRowIdxLengthNotRK", [](FinalizeGradCase& c) { c.expanded_row_idx = Tensor::from_i32({5}, {0, 1, 2, 3, 4}); }, kShape, "expanded_row_idx|expandedRowIdx", {"5"}},
    {"ExpandedXDim0NotRK", [](FinalizeGradCase& c) { c.expanded_x = Tensor({5, 4}, ACL_FLOAT); }, kShape, "expanded_x|expandedX", {"5"}},
    {"ExpandedXDim0NotActiveNum", [](FinalizeGradCase& c) { c.active_num = 4; c.grad_expanded_x = Tensor({4, 4}, ACL_FLOAT); }, kShape, "expanded_x|expandedX"},
    {"Mode1ExpandedXNotEC", [](FinalizeGradCase& c) { c.to_drop_pad(2, 4, kDropIdx); c.expanded_x = Tensor({3, 4, 4}, ACL_FLOAT); }, kShape, "expanded_x|expandedX"},
    {"ExpandedXLastDimNotH", [](FinalizeGradCase& c) { c.expanded_x = Tensor({6, 5}, ACL_FLOAT); }, kShape, "expanded_x|expandedX"},
    {"Mode1ExpandedXLastDimNotH", [](FinalizeGradCase& c) { c.to_drop_pad(2, 4, kDropIdx); c.expanded_x = Tensor({2, 4, 3}, ACL_FLOAT); }, kShape, "expanded_x|expandedX"},
    {"BiasWithoutExpertIdx", [](FinalizeGradCase& c) { c.expert_idx = Tensor(); }, kShape, "expert_idx|expertIdx"},
    {"ExpertIdxRank1", [](FinalizeGradCase& c) { c.expert_idx = Tensor::from_i32({6}, {0, 1, 2, 0, 1, 2}); }, kShape, "expert_idx|expertIdx"},
    {"BiasRank1", [](FinalizeGradCase& c) { c.bias = Tensor({12}, ACL_FLOAT); }, kShape, "bias"},
    {"BiasRank3", [](FinalizeGradCase& c) { c.bias = Tensor({3, 4, 1}, ACL_FLOAT); }, kShape, "bias"},
    {"ExpertIdxDim0NotR", [](FinalizeGradCase& c) { c.expert_idx = Tensor::from_i32({2, 3}, {0, 1, 2, 0, 1, 2}); }, kShape, "expert_idx|expertIdx"},
    {"ExpertIdxNumelNotRK", [](FinalizeGradCase& c) { c.expert_idx = Tensor::from_i32({3, 3}, std::vector<int32_t>(9, 0)); }, kShape, "expert_idx|expertIdx"},
    {"BiasDim0Zero", [](FinalizeGradCase& c) { c.bias = Tensor({0, 4}, ACL_FLOAT); }, kShape, "bias|expert_idx"},
    {"Mode1BiasDim0NotExpertNum", [](FinalizeGradCase& c) { c.to_drop_pad(2, 4, kDropIdx); c.bias = Tensor({3, 4}, ACL_FLOAT); }, kShape, "bias|expert_num"},
    {"BiasDim1NotH", [](FinalizeGradCase& c) { c.bias = Tensor({3, 5}, ACL_FLOAT); }, kShape, "bias"},
    {"NoScalesIdxLengthNotR", [](FinalizeGradCase& c) { c.drop_scales(); }, kShape, "expanded_row_idx|expandedRowIdx", {"6"}},
    {"GradExpandedXRank1", [](FinalizeGradCase& c) { c.grad_expanded_x = Tensor({24}, ACL_FLOAT); }, kShape, "grad_expanded_x|gradExpandedXOut"},
    {"GradExpandedXRank3InMode0", [](FinalizeGradCase& c) { c.grad_expanded_x = Tensor({2, 3, 4}, ACL_FLOAT); }, kShape, "grad_expanded_x|gradExpandedXOut"},
    {"GradExpandedXDim0NotRK", [](FinalizeGradCase& c) { c.grad_expanded_x = Tensor({5, 4}, ACL_FLOAT); }, kShape, "grad_expanded_x|gradExpandedXOut"},
    {"GradExpandedXDim1NotH", [](FinalizeGradCase& c) { c.grad_expanded_x = Tensor({6, 3}, ACL_FLOAT); }, kShape, "grad_expanded_x|gradExpandedXOut"},
    {"Mode1GradExpandedXRank2", [](FinalizeGradCase& c) { c.to_drop_pad(2, 4, kDropIdx); c.grad_expanded_x = Tensor({8, 4}, ACL_FLOAT); }, kShape, "grad_expanded_x|gradExpandedXOut"},
    {"Mode1GradExpandedXNotEC", [](FinalizeGradCase& c) { c.to_drop_pad(2, 4, kDropIdx); c.grad_expanded_x = Tensor({2, 3, 4}, ACL_FLOAT); }, kShape, "grad_expanded_x|gradExpandedXOut"},
    {"GradScalesNotRK", [](FinalizeGradCase& c) { c.grad_scales = Tensor({3, 1}, ACL_FLOAT); }, kShape, "grad_scales|gradScalesOut"},
    {"GradScalesRank1", [](FinalizeGradCase& c) { c.grad_scales = Tensor({6}, ACL_FLOAT); }, kShape, "grad_scales|gradScalesOut"},
    {"NoScalesGradScalesNotR1", [](FinalizeGradCase& c) {
       c.drop_scales(); c.grad_scales = Tensor({3, 2}, ACL_FLOAT);
       c.expanded_row_idx = Tensor::from_i32({3}, {2, 0, 1}); c.grad_expanded_x = Tensor({3, 4}, ACL_FLOAT);
     }, kShape, "grad_scales|gradScalesOut"},
    // host index values: 561103 naming the position and value (D6)
    {"RowIdxEqualsRKMode0", [](FinalizeGradCase& c) { c.expanded_row_idx.set_i32(2, 6); }, kShape, "expanded_row_idx|expandedRowIdx", {"6", "2"}},
    {"RowIdxMinus2Mode0", [](FinalizeGradCase& c) { c.expanded_row_idx.set_i32(5, -2); }, kShape, "expanded_row_idx|expandedRowIdx", {"-2", "5"}},
    {"RowIdxDuplicateMode0", [](FinalizeGradCase& c) { c.expanded_row_idx = Tensor::from_i32({6}, {3, 1, 2, 3, 4, 0}); }, kShape, "expanded_row_idx|expandedRowIdx", {"3"}},
    {"RowIdxBelowMinus1Mode1", [](FinalizeGradCase& c) { c.to_drop_pad(2, 4, {7, -1, 0, -2, 5, 1}); }, kShape, "expanded_row_idx|expandedRowIdx", {"-2", "3"}},
    {"RowIdxEqualsECMode1", [](FinalizeGradCase& c) { c.to_drop_pad(2, 4, {7, -1, 8, 3, 5, 1}); }, kShape, "expanded_row_idx|expandedRowIdx", {"8", "2"}},
    {"RowIdxDuplicateMode1", [](FinalizeGradCase& c) { c.to_drop_pad(2, 4, {7, -1, 0, 3, 5, 0}); }, kShape, "expanded_row_idx|expandedRowIdx", {"5"}},
    {"ExpertIdxEqualsE", [](FinalizeGradCase& c) { c.expert_idx.set_i32(4, 3); }, kShape, "expert_idx|expertIdx", {"3", "4"}},
    {"ExpertIdxNegative", [](FinalizeGradCase& c) { c.expert_idx.set_i32(0, -1); }, kShape, "expert_idx|expertIdx", {"-1", "0"}},
    // layouts: 161002 (D19)
    {"GradYStrided", [](FinalizeGradCase& c) { c.grad_y = Tensor::strided({3, 4}, ACL_FLOAT); }, kInv, "grad_y|gradY"},
    {"GradYFormatNZ", [](FinalizeGradCase& c) { c.grad_y = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 4}, ACL_FLOAT); }, kInv, "grad_y|gradY"},
    {"ExpandedRowIdxStrided", [](FinalizeGradCase& c) { c.expanded_row_idx = Tensor::strided({6}, ACL_INT32); }, kInv, "expanded_row_idx|expandedRowIdx"},
    {"ExpandedRowIdxFormatNZ", [](FinalizeGradCase& c) { c.expanded_row_idx = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {6}, ACL_INT32); }, kInv, "expanded_row_idx|expandedRowIdx"},
    {"ExpandedXStrided", [](FinalizeGradCase& c) { c.expanded_x = Tensor::strided({6, 4}, ACL_FLOAT); }, kInv, "expanded_x|expandedX"},
    {"ExpandedXFormatNZ", [](FinalizeGradCase& c) { c.expanded_x = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {6, 4}, ACL_FLOAT); }, kInv, "expanded_x|expandedX"},
    {"ScalesStrided", [](FinalizeGradCase& c) { c.scales = Tensor::strided({3, 2}, ACL_FLOAT); }, kInv, "scales"},
    {"ScalesFormatNZ", [](FinalizeGradCase& c) { c.scales = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 2}, ACL_FLOAT); }, kInv, "scales"},
    {"ExpertIdxStrided", [](FinalizeGradCase& c) { c.expert_idx = Tensor::strided({3, 2}, ACL_INT32); }, kInv, "expert_idx|expertIdx"},
    {"ExpertIdxFormatNZ", [](FinalizeGradCase& c) { c.expert_idx = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 2}, ACL_INT32); }, kInv, "expert_idx|expertIdx"},
    {"BiasStrided", [](FinalizeGradCase& c) { c.bias = Tensor::strided({3, 4}, ACL_FLOAT); }, kInv, "bias"},
    {"BiasFormatNZ", [](FinalizeGradCase& c) { c.bias = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 4}, ACL_FLOAT); }, kInv, "bias"},
    {"GradExpandedXStrided", [](FinalizeGradCase& c) { c.grad_expanded_x = Tensor::strided({6, 4}, ACL_FLOAT); }, kInv, "grad_expanded_x|gradExpandedXOut"},
    {"GradExpandedXFormatNZ", [](FinalizeGradCase& c) { c.grad_expanded_x = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {6, 4}, ACL_FLOAT); }, kInv, "grad_expanded_x|gradExpandedXOut"},
    {"GradScalesStrided", [](FinalizeGradCase& c) { c.grad_scales = Tensor::strided({3, 2}, ACL_FLOAT); }, kInv, "grad_scales|gradScalesOut"},
    {"GradScalesFormatNZ", [](FinalizeGradCase& c) { c.grad_scales = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 2}, ACL_FLOAT); }, kInv, "grad_scales|gradScalesOut"},
};

class FinalizeGradRules : public testing::TestWithParam<R_> {};

TEST_P(FinalizeGradRules, Rejected) {
  FinalizeGradCase c;
  GetParam().mutate(c);
  expect_rejected(c, GetParam().code, GetParam().arg, GetParam().words);
}

INSTANTIATE_TEST_SUITE_P(MoeFinalizeRoutingV2Grad, FinalizeGradRules, testing::ValuesIn(kRules),
                         rule_name<FinalizeGradCase>);

TEST(MoeFinalizeRoutingV2Grad, BaselineOfRuleTableIsValid) {
  SCOPED_TRACE(seed_trace());
  FinalizeGradCase c;
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference("baseline");
  FinalizeGradCase d;
  d.to_drop_pad(2, 4, kDropIdx);
  ASSERT_TRUE(run_ok(d));
  d.check_against_reference("baseline drop-pad");
}

const std::vector<double> kEx39GradY = {0.3816, 0.3939, 0.8474, 0.1652};
const std::vector<double> kEx39ExpandedX = {0.6049, 0.3315, 0.4954, 0.3284,
                                            0.7060, 0.4359, 0.6514, 0.9476};
const std::vector<double> kEx39Scales = {0.4708, 0.0656, 0.9652, 0.9512};
const std::vector<double> kEx39Bias = {0.6452, 0.1981, 0.4159, 0.9575};

FinalizeGradCase example_3_9() {
  FinalizeGradCase c(2, 2, 2, 2);
  c.grad_y.set(kEx39GradY);
  c.expanded_row_idx = Tensor::from_i32({4}, {1, 3, 0, 2});
  c.expanded_x.set(kEx39ExpandedX);
  c.scales.set(kEx39Scales);
  c.expert_idx = Tensor::from_i32({2, 2}, {0, 1, 0, 1});
  c.bias.set(kEx39Bias);
  return c;
}

TEST(MoeFinalizeRoutingV2Grad, WorkedExample_3_9_WithBias) {
  FinalizeGradCase c = example_3_9();
  ASSERT_TRUE(run_ok(c));
  expect_listed(c.grad_expanded_x,
                {0.817910, 0.159451, 0.179657, 0.185448, 0.806047, 0.157138, 0.025033, 0.025840},
                6, "§3.9 gradExpandedX");
  expect_listed(c.grad_scales, {0.642641, 1.157701, 1.146825, 1.180888}, 6, "§3.9 gradScales");
  c.check_against_reference("§3.9");
}

TEST(MoeFinalizeRoutingV2Grad, WorkedExample_3_9_WithoutBias) {
  FinalizeGradCase c = example_3_9();
  c.bias = Tensor();
  c.expert_idx = Tensor();
  ASSERT_TRUE(run_ok(c));
  expect_listed(c.grad_expanded_x,
                {0.817910, 0.159451, 0.179657, 0.185448, 0.806047, 0.157138, 0.025033, 0.025840},
                6, "§3.9 gradExpandedX (no bias)");
  expect_listed(c.grad_scales, {0.318401, 0.621834, 0.567356, 0.670275}, 6,
                "§3.9 gradScales (no bias)");
  c.check_against_reference("§3.9 no bias");
}

struct GradConfig {
  const char* name;
  int64_t mode, R, K, H, E, active_num;
  bool scales, bias;
  aclDataType sdt_override;
};

class FinalizeGradValues : public testing::TestWithParam<std::tuple<aclDataType, GradConfig>> {};

TEST_P(FinalizeGradValues, MatchesFloat64Reference) {
  SCOPED_TRACE(seed_trace());
  const auto [dt, f] = GetParam();
  const aclDataType sdt = f.sdt_override == ACL_DT_UNDEFINED ? dt : f.sdt_override;
  FinalizeGradCase c(f.R, f.K, f.H, f.E, dt, sdt, static_cast<uint32_t>(f.H * 3 + f.mode));
  Rng rng(static_cast<uint32_t>(f.R + 100 * f.mode));
  if (f.mode == 1) {
    const int64_t cap = f.R;
    std::vector<int32_t> perm = rng.permutation(static_cast<int32_t>(f.E * cap));
    std::vector<int32_t> idx(perm.begin(), perm.begin() + f.R * f.K);
    for (size_t i = 1; i < idx.size(); i += 4) idx[i] = -1;  // dropped slots (D7)
    c.to_drop_pad(f.E, cap, idx, static_cast<uint32_t>(f.H));
  }
  c.active_num = f.active_num;  // <= 0 or >= R*K: ignored (§3.4)
  if (f.active_num > 0) {
    const int64_t rows = f.active_num < f.R * f.K ? f.active_num : f.R * f.K;
    c.expanded_x = Tensor::from({rows, f.H}, dt, rng.uniform_vec(rows * f.H, -2, 2));
    c.grad_expanded_x = Tensor({rows, f.H}, dt);
  }
  if (!f.bias) {
    c.bias = Tensor();
    c.expert_idx = Tensor();
  }
  if (!f.scales) {
    c.drop_scales();
    c.K = 1;
    c.expanded_x = Tensor();
  }
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference(f.name);
}

INSTANTIATE_TEST_SUITE_P(
    MoeFinalizeRoutingV2Grad, FinalizeGradValues,
    testing::Combine(
        testing::Values(ACL_FLOAT, ACL_FLOAT16, ACL_BF16),
        testing::Values(
            GradConfig{"mode0_bias", 0, 5, 3, 16, 4, 0, true, true, ACL_DT_UNDEFINED},
            GradConfig{"mode0_no_bias", 0, 4, 2, 9, 3, 0, true, false, ACL_DT_UNDEFINED},
            GradConfig{"mode0_scales_fp32", 0, 4, 2, 8, 3, 0, true, true, ACL_FLOAT},
            GradConfig{"mode0_active_num", 0, 5, 2, 8, 3, 6, true, true, ACL_DT_UNDEFINED},
            GradConfig{"mode0_active_num_ignored", 0, 3, 2, 8, 3, 50, true, true, ACL_DT_UNDEFINED},
            GradConfig{"mode0_negative_active_num_ignored", 0, 3, 2, 8, 3, -7, true, true, ACL_DT_UNDEFINED},
            GradConfig{"mode0_no_scales", 0, 6, 1, 8, 3, 0, false, false, ACL_DT_UNDEFINED},
            GradConfig{"mode1_bias", 1, 4, 2, 8, 3, 0, true, true, ACL_DT_UNDEFINED},
            GradConfig{"mode1_no_bias", 1, 5, 3, 6, 4, 0, true, false, ACL_DT_UNDEFINED},
            GradConfig{"odd_hidden_257", 0, 3, 2, 257, 3, 0, true, true, ACL_DT_UNDEFINED})),
    [](const testing::TestParamInfo<std::tuple<aclDataType, GradConfig>>& info) {
      return std::string(dt_name(std::get<0>(info.param))) + "_" + std::get<1>(info.param).name;
    });

// Without scales, expanded_x, bias and expert_idx are not used and not checked (§3.6, L6).
TEST(MoeFinalizeRoutingV2Grad, WithoutScalesUnusedInputsIgnored) {
  SCOPED_TRACE(seed_trace());
  FinalizeGradCase c(3, 1, 4, 3);
  c.drop_scales();
  c.expanded_x = Tensor({7, 9}, ACL_FLOAT16);   // wrong shape and dtype: not read
  c.bias = Tensor({2, 5}, ACL_BF16);            // wrong shape and dtype: ignored
  c.expert_idx = Tensor({1}, ACL_INT64);        // ignored
  ASSERT_TRUE(run_ok(c));
  c.expanded_x = Tensor();
  c.bias = Tensor();
  c.expert_idx = Tensor();
  c.check_against_reference("no scales");
}

// Drop-pad mode: capacity rows that no index addresses are zero (§3.7), a dropped slot gets the
// bias-only grad_scales (D7). Hand case.
TEST(MoeFinalizeRoutingV2Grad, DropPadZeroFillAndBiasOnlyScales) {
  FinalizeGradCase c(1, 2, 2, 2);
  c.to_drop_pad(2, 2, {2, -1});
  c.grad_y.set({1.0, -2.0});
  c.scales.set({0.5, 4.0});
  c.expanded_x.set({9, 9, 9, 9, 3.0, 1.0, 9, 9});
  c.bias.set({0.25, 0.5, 1.0, 2.0});
  c.expert_idx = Tensor::from_i32({1, 2}, {0, 1});
  ASSERT_TRUE(run_ok(c));
  const std::vector<double> gex = {0, 0, 0, 0, 0.5, -1.0, 0, 0};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(c.grad_expanded_x.get(i), gex[i]) << i;
  // slot 0: ([3, 1] + [0.25, 0.5]) . [1, -2] = 3.25 - 3 = 0.25; slot 1 (dropped): [1, 2] . [1, -2] = -3
  EXPECT_EQ(c.grad_scales.get(0), 0.25);
  EXPECT_EQ(c.grad_scales.get(1), -3.0);
}

// D4: zero tokens; in drop-pad mode grad_expanded_x is (E, C, H) and all zeros.
TEST(MoeFinalizeRoutingV2Grad, ZeroTokens) {
  FinalizeGradCase c(0, 2, 4, 3);
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(c.grad_expanded_x.numel(), 0);
  FinalizeGradCase d(0, 2, 4, 3);
  d.to_drop_pad(3, 2, {});
  ASSERT_TRUE(run_ok(d));
  ASSERT_EQ(d.grad_expanded_x.numel(), 3 * 2 * 4);
  for (int64_t i = 0; i < d.grad_expanded_x.numel(); ++i) EXPECT_EQ(d.grad_expanded_x.get(i), 0.0);
  FinalizeGradCase n(0, 1, 4, 3);
  n.drop_scales();
  ASSERT_TRUE(run_ok(n));
}

// D16: bitwise identical with 1 and 2 threads.
TEST(MoeFinalizeRoutingV2Grad, DeterministicAcrossThreads) {
  FinalizeGradCase one(512, 4, 64, 8, ACL_FLOAT16, ACL_FLOAT16, 43),
      two(512, 4, 64, 8, ACL_FLOAT16, ACL_FLOAT16, 43);
  expect_deterministic_across_threads(one, two);
  FinalizeGradCase d1(256, 2, 96, 4, ACL_FLOAT, ACL_FLOAT, 44), d2(256, 2, 96, 4, ACL_FLOAT, ACL_FLOAT, 44);
  Rng rng(45);
  std::vector<int32_t> perm = rng.permutation(4 * 256);
  std::vector<int32_t> idx(perm.begin(), perm.begin() + 512);
  for (size_t i = 0; i < idx.size(); i += 5) idx[i] = -1;
  d1.to_drop_pad(4, 256, idx, 46);
  d2.to_drop_pad(4, 256, idx, 46);
  expect_deterministic_across_threads(d1, d2);
}

TEST(MoeFinalizeRoutingV2Grad, WorkspaceSizeIdempotent) {
  FinalizeGradCase c;
  expect_workspace_idempotent(c);
}

}  // namespace

// Two tensors disagree on R: expanded_row_idx's R * K rows and the grad_scales output witness
// which one is wrong (grad_y here), rather than the earlier one being taken as right.
TEST(FinalizeGradBlame, TheOddTokenCountIsNamed) {
  FinalizeGradCase c;
  c.bias = Tensor();
  c.expert_idx = Tensor();
  c.grad_y = Tensor({4, 4}, ACL_FLOAT);
  expect_blamed(c, ACLNN_ERR_INNER_NULLPTR, "moe_finalize_routing_grad", "grad_y");
  c.grad_y = Tensor({3, 4}, ACL_FLOAT);
  c.scales = Tensor({4, 2}, ACL_FLOAT);
  expect_blamed(c, ACLNN_ERR_INNER_NULLPTR, "moe_finalize_routing_grad", "scales");
}
