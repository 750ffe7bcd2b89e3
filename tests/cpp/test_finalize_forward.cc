// aclnnMoeFinalizeRoutingV2 through the C API: the validation rules of operators.md §4.6 with
// decisions D4, D6, D18, D19 and docs/decisions.md L4 (dtypes/layout 161002, shapes and index
// values 561103), and values against the float64 reference (§4.5, worked example §4.7, D7, D8,
// L5).
#include "reference.h"
#include "test_util.h"

using namespace mgt;

namespace {

struct FinalizeFwdCase : OpCase {
  Tensor expanded_x, expanded_row_idx, x1, x2, bias, scales, expert_idx, out;
  int64_t drop_pad_mode = 0;
  int64_t R, K, H, E;

  // Valid dropless (mode 0) call with every optional input present.
  FinalizeFwdCase(int64_t r = 3, int64_t k = 2, int64_t h = 4, int64_t e = 3,
                  aclDataType dt = ACL_FLOAT, aclDataType sdt = ACL_FLOAT, uint32_t salt = 5)
      : R(r), K(k), H(h), E(e) {
    Rng rng(salt);
    expanded_x = Tensor::from({R * K, H}, dt, rng.uniform_vec(R * K * H, -2, 2));
    expanded_row_idx = Tensor::from_i32({R * K}, rng.permutation(static_cast<int32_t>(R * K)));
    x1 = Tensor::from({R, H}, dt, rng.uniform_vec(R * H, -1, 1));
    x2 = Tensor::from({R, H}, dt, rng.uniform_vec(R * H, -1, 1));
    bias = Tensor::from({E, H}, dt, rng.uniform_vec(E * H, -0.5, 0.5));
    scales = Tensor::from({R, K}, sdt, rng.uniform_vec(R * K, 0.05, 1.5));
    std::vector<int32_t> eid(R * K);
    for (auto& v : eid) v = static_cast<int32_t>(rng.integer(0, E - 1));
    expert_idx = Tensor::from_i32({R, K}, eid);
    out = Tensor({R, H}, dt);
  }
  aclnnStatus stage1(uint64_t* ws, aclOpExecutor** ex) override {
    return aclnnMoeFinalizeRoutingV2GetWorkspaceSize(
        expanded_x.handle(), expanded_row_idx.handle(), x1.handle(), x2.handle(), bias.handle(),
        scales.handle(), expert_idx.handle(), drop_pad_mode, out.handle(), ws, ex);
  }
  aclnnStatus stage2(void* ws, uint64_t size, aclOpExecutor* ex) override {
    return aclnnMoeFinalizeRoutingV2(ws, size, ex, nullptr);
  }
  std::vector<Tensor*> outputs() override { return {&out}; }

  void check_against_reference(const std::string& what) {
    auto vals = [](const Tensor& t) { return t.is_null() ? std::vector<double>() : t.values(); };
    std::vector<double> ex = expanded_x.values(), v1 = vals(x1), v2 = vals(x2), b = vals(bias),
                        s = vals(scales);
    std::vector<int32_t> idx(expanded_row_idx.numel()), eid(expert_idx.is_null() ? 0 : expert_idx.numel());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = expanded_row_idx.i32(i);
    for (size_t i = 0; i < eid.size(); ++i) eid[i] = expert_idx.i32(i);
    const int64_t rows = expanded_x.shape().size() == 3 ? expanded_x.shape()[0] * expanded_x.shape()[1]
                                                        : expanded_x.shape()[0];
    ref::FinalizeFwd r = ref::finalize_forward(
        ex, rows, idx, x1.is_null() ? nullptr : &v1, x2.is_null() ? nullptr : &v2,
        bias.is_null() ? nullptr : &b, scales.is_null() ? nullptr : &s,
        bias.is_null() ? nullptr : &eid, drop_pad_mode, R, K, H);
    expect_close(out, r.out, what, r.scale, static_cast<double>(K + 2));
  }
};

using R_ = Rule<FinalizeFwdCase>;
constexpr aclnnStatus kNull = ACLNN_ERR_PARAM_NULLPTR;
constexpr aclnnStatus kInv = ACLNN_ERR_PARAM_INVALID;
constexpr aclnnStatus kShape = ACLNN_ERR_INNER_NULLPTR;

// Drop-pad layout (E2 experts x C capacity) for mode 1 / 3.
void to_drop_pad(FinalizeFwdCase& c, int64_t mode, int64_t e2 = 2, int64_t cap = 4) {
  c.drop_pad_mode = mode;
  c.expanded_x = Tensor::from({e2, cap, c.H}, ACL_FLOAT, std::vector<double>(e2 * cap * c.H, 0.5));
  // R*K = 6 slots over 8 capacity rows, one dropped (-1).
  c.expanded_row_idx = Tensor::from_i32({6}, {7, -1, 0, 3, 5, 1});
  // bias has one row per expert of expanded_x (L5); expert ids in [0, e2).
  c.bias = Tensor::from({e2, c.H}, ACL_FLOAT, std::vector<double>(e2 * c.H, 0.125));
  std::vector<int32_t> eid(c.R * c.K);
  for (size_t i = 0; i < eid.size(); ++i) eid[i] = static_cast<int32_t>(i % e2);
  c.expert_idx = Tensor::from_i32({c.R, c.K}, eid);
}

const std::vector<R_> kRules = {
    // null pointers: 161001
    {"NullExpandedX", [](FinalizeFwdCase& c) { c.expanded_x = Tensor(); }, kNull, "expanded_x|expandedX"},
    {"NullExpandedRowIdx", [](FinalizeFwdCase& c) { c.expanded_row_idx = Tensor(); }, kNull, "expanded_row_idx|expandedRowIdx"},
    {"NullOut", [](FinalizeFwdCase& c) { c.out = Tensor(); }, kNull, "out"},
    {"NullDataExpandedX", [](FinalizeFwdCase& c) { c.expanded_x = Tensor::null_data({6, 4}, ACL_FLOAT); }, kNull, "expanded_x|expandedX"},
    {"NullWorkspaceSize", [](FinalizeFwdCase& c) { c.null_workspace_size = true; }, kNull, "workspaceSize"},
    {"NullExecutor", [](FinalizeFwdCase& c) { c.null_executor = true; }, kNull, "executor"},
    // dtypes: 161002
    {"ExpandedXInt32", [](FinalizeFwdCase& c) { c.expanded_x = Tensor({6, 4}, ACL_INT32); }, kInv, "expanded_x|expandedX"},
    {"ExpandedRowIdxInt64", [](FinalizeFwdCase& c) { c.expanded_row_idx = Tensor({6}, ACL_INT64); }, kInv, "expanded_row_idx|expandedRowIdx"},
    {"X1DtypeNotExpandedX", [](FinalizeFwdCase& c) { c.x1 = Tensor({3, 4}, ACL_FLOAT16); }, kInv, "x1"},
    {"X2DtypeNotExpandedX", [](FinalizeFwdCase& c) { c.x2 = Tensor({3, 4}, ACL_BF16); }, kInv, "x2"},
    {"BiasDtypeNotExpandedX", [](FinalizeFwdCase& c) { c.bias = Tensor({3, 4}, ACL_FLOAT16); }, kInv, "bias"},
    {"ScalesInt32", [](FinalizeFwdCase& c) { c.scales = Tensor({3, 2}, ACL_INT32); }, kInv, "scales"},
    {"ExpertIdxInt64", [](FinalizeFwdCase& c) { c.expert_idx = Tensor({3, 2}, ACL_INT64); }, kInv, "expert_idx|expertIdx"},
    {"OutDtypeNotExpandedX", [](FinalizeFwdCase& c) { c.out = Tensor({3, 4}, ACL_FLOAT16); }, kInv, "out"},
    // shapes and attributes: 561103
    {"DropPadMode4", [](FinalizeFwdCase& c) { c.drop_pad_mode = 4; }, kShape, "drop_pad_mode|dropPadMode", {"4"}},
    {"DropPadModeMinus1", [](FinalizeFwdCase& c) { c.drop_pad_mode = -1; }, kShape, "drop_pad_mode|dropPadMode"},
    {"ExpandedXRank3InMode0", [](FinalizeFwdCase& c) { c.expanded_x = Tensor({2, 3, 4}, ACL_FLOAT); }, kShape, "expanded_x|expandedX"},
    {"ExpandedXRank2InMode1", [](FinalizeFwdCase& c) { to_drop_pad(c, 1); c.expanded_x = Tensor({8, 4}, ACL_FLOAT); }, kShape, "expanded_x|expandedX"},
    {"ExpandedXRank2InMode3", [](FinalizeFwdCase& c) { to_drop_pad(c, 3); c.expanded_x = Tensor({8, 4}, ACL_FLOAT); }, kShape, "expanded_x|expandedX"},
    {"ExpandedXRank3InMode2", [](FinalizeFwdCase& c) { c.drop_pad_mode = 2; c.expanded_x = Tensor({2, 3, 4}, ACL_FLOAT); }, kShape, "expanded_x|expandedX"},
    {"HiddenZero", [](FinalizeFwdCase& c) {
       c.expanded_x = Tensor({6, 0}, ACL_FLOAT); c.x1 = Tensor({3, 0}, ACL_FLOAT); c.x2 = Tensor({3, 0}, ACL_FLOAT);
       c.bias = Tensor({3, 0}, ACL_FLOAT); c.out = Tensor({3, 0}, ACL_FLOAT);
     }, kShape, "expanded_x|expandedX|H"},
    {"ExpandedRowIdxRank2", [](FinalizeFwdCase& c) { c.expanded_row_idx = Tensor::from_i32({3, 2}, {0, 1, 2, 3, 4, 5}); }, kShape, "expanded_row_idx|expandedRowIdx"},
    {"X2WithoutX1", [](FinalizeFwdCase& c) { c.x1 = Tensor(); }, kShape, "x2|x1"},
    {"BiasWithoutExpertIdx", [](FinalizeFwdCase& c) { c.expert_idx = Tensor(); }, kShape, "expert_idx|expertIdx"},
    {"X1Rank1", [](FinalizeFwdCase& c) { c.x1 = Tensor({12}, ACL_FLOAT); }, kShape, "x1"},
    {"X2Rank3", [](FinalizeFwdCase& c) { c.x2 = Tensor({3, 4, 1}, ACL_FLOAT); }, kShape, "x2"},
    {"BiasRank1", [](FinalizeFwdCase& c) { c.bias = Tensor({12}, ACL_FLOAT); }, kShape, "bias"},
    {"ScalesRank1", [](FinalizeFwdCase& c) { c.scales = Tensor({6}, ACL_FLOAT); }, kShape, "scales"},
    {"ExpertIdxRank1", [](FinalizeFwdCase& c) { c.expert_idx = Tensor::from_i32({6}, {0, 0, 0, 0, 0, 0}); }, kShape, "expert_idx|expertIdx"},
    {"OutRank1", [](FinalizeFwdCase& c) { c.out = Tensor({12}, ACL_FLOAT); }, kShape, "out"},
    {"OutRank3", [](FinalizeFwdCase& c) { c.out = Tensor({3, 4, 1}, ACL_FLOAT); }, kShape, "out"},
    {"ScalesDim1NotExpertIdxDim1", [](FinalizeFwdCase& c) { c.expert_idx = Tensor::from_i32({3, 3}, std::vector<int32_t>(9, 0)); }, kShape, "expert_idx|expertIdx|scales"},
    {"X1Dim0NotR", [](FinalizeFwdCase& c) { c.x1 = Tensor({4, 4}, ACL_FLOAT); }, kShape, "x1"},
    {"X2Dim0NotR", [](FinalizeFwdCase& c) { c.x2 = Tensor({2, 4}, ACL_FLOAT); }, kShape, "x2"},
    {"ScalesDim0NotR", [](FinalizeFwdCase& c) { c.scales = Tensor({4, 2}, ACL_FLOAT); }, kShape, "scales"},
    {"ExpertIdxDim0NotR", [](FinalizeFwdCase& c) { c.expert_idx = Tensor::from_i32({4, 2}, std::vector<int32_t>(8, 0)); }, kShape, "expert_idx|expertIdx"},
    {"X1Dim1NotH", [](FinalizeFwdCase& c) { c.x1 = Tensor({3, 5}, ACL_FLOAT); }, kShape, "x1"},
    {"X2Dim1NotH", [](FinalizeFwdCase& c) { c.x2 = Tensor({3, 3}, ACL_FLOAT); }, kShape, "x2"},
    {"BiasDim1NotH", [](FinalizeFwdCase& c) { c.bias = Tensor({3, 5}, ACL_FLOAT); }, kShape, "bias"},
    // L5: drop-pad bias has E = expanded_x.dim0 rows; dropless expanded_x has at most R*K rows
    {"Mode1BiasDim0NotE", [](FinalizeFwdCase& c) { to_drop_pad(c, 1); c.bias = Tensor({3, 4}, ACL_FLOAT); }, kShape, "bias"},
    {"Mode3BiasDim0NotE", [](FinalizeFwdCase& c) { to_drop_pad(c, 3); c.bias = Tensor({1, 4}, ACL_FLOAT); }, kShape, "bias"},
    {"ExpandedXRowsAboveRK", [](FinalizeFwdCase& c) { c.expanded_x = Tensor({7, 4}, ACL_FLOAT); }, kShape, "expanded_x|expandedX", {"7"}},
    {"BiasDim0Zero", [](FinalizeFwdCase& c) { c.bias = Tensor({0, 4}, ACL_FLOAT); }, kShape, "bias|expert_idx"},
    {"ExpandedRowIdxLengthNotRK", [](FinalizeFwdCase& c) { c.expanded_row_idx = Tensor::from_i32({5}, {0, 1, 2, 3, 4}); }, kShape, "expanded_row_idx|expandedRowIdx", {"5"}},
    {"KZero", [](FinalizeFwdCase& c) {
       c.scales = Tensor({3, 0}, ACL_FLOAT); c.expert_idx = Tensor({3, 0}, ACL_INT32); c.bias = Tensor();
       c.expert_idx = Tensor(); c.expanded_row_idx = Tensor({0}, ACL_INT32);
     }, kShape, "scales|K"},
    {"OutDim1NotH", [](FinalizeFwdCase& c) { c.out = Tensor({3, 5}, ACL_FLOAT); }, kShape, "out"},
    {"OutDim0NotTokenCount", [](FinalizeFwdCase& c) { c.out = Tensor({4, 4}, ACL_FLOAT); }, kShape, "out|x1|scales|expert_idx|expanded_row_idx"},
    // L4: without scales and expert_idx, K = numel(expanded_row_idx) / R must divide exactly
    {"L4KNotExact", [](FinalizeFwdCase& c) {
       c.scales = Tensor(); c.bias = Tensor(); c.expert_idx = Tensor(); c.x1 = Tensor(); c.x2 = Tensor();
       c.expanded_x = Tensor({7, 4}, ACL_FLOAT);
       c.expanded_row_idx = Tensor::from_i32({7}, {0, 1, 2, 3, 4, 5, 6});
     }, kShape, "expanded_row_idx|expandedRowIdx", {"7"}},
    // host index values: 561103 naming the position and value (D6)
    {"RowIdxOutOfRangeMode0", [](FinalizeFwdCase& c) { c.expanded_row_idx.set_i32(2, 6); }, kShape, "expanded_row_idx|expandedRowIdx", {"6", "2"}},
    {"RowIdxMinus2Mode0", [](FinalizeFwdCase& c) { c.expanded_row_idx.set_i32(4, -2); }, kShape, "expanded_row_idx|expandedRowIdx", {"-2", "4"}},
    {"RowIdxDuplicateMode0", [](FinalizeFwdCase& c) {
       c.expanded_row_idx = Tensor::from_i32({6}, {0, 1, 2, 3, 4, 2});
     }, kShape, "expanded_row_idx|expandedRowIdx", {"5"}},
    {"RowIdxDuplicateMode2", [](FinalizeFwdCase& c) {
       c.drop_pad_mode = 2; c.expanded_row_idx = Tensor::from_i32({6}, {5, 1, 2, 3, 5, 0});
     }, kShape, "expanded_row_idx|expandedRowIdx", {"4"}},
    {"RowIdxBelowMinus1Mode1", [](FinalizeFwdCase& c) { to_drop_pad(c, 1); c.expanded_row_idx.set_i32(3, -2); }, kShape, "expanded_row_idx|expandedRowIdx", {"-2", "3"}},
    {"RowIdxEqualsECMode1", [](FinalizeFwdCase& c) { to_drop_pad(c, 1); c.expanded_row_idx.set_i32(0, 8); }, kShape, "expanded_row_idx|expandedRowIdx", {"8", "0"}},
    {"RowIdxDuplicateMode3", [](FinalizeFwdCase& c) {
       to_drop_pad(c, 3); c.expanded_row_idx = Tensor::from_i32({6}, {7, -1, 0, 3, 7, 1});
     }, kShape, "expanded_row_idx|expandedRowIdx", {"4"}},
    {"ExpertIdxEqualsE", [](FinalizeFwdCase& c) { c.expert_idx.set_i32(5, 3); }, kShape, "expert_idx|expertIdx", {"3", "5"}},
    {"ExpertIdxNegative", [](FinalizeFwdCase& c) { c.expert_idx.set_i32(1, -1); }, kShape, "expert_idx|expertIdx", {"-1", "1"}},
    // layouts: 161002 (D19)
    {"ExpandedXStrided", [](FinalizeFwdCase& c) { c.expanded_x = Tensor::strided({6, 4}, ACL_FLOAT); }, kInv, "expanded_x|expandedX"},
    {"ExpandedXFormatNZ", [](FinalizeFwdCase& c) { c.expanded_x = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {6, 4}, ACL_FLOAT); }, kInv, "expanded_x|expandedX"},
    {"ExpandedRowIdxStrided", [](FinalizeFwdCase& c) { c.expanded_row_idx = Tensor::strided({6}, ACL_INT32); }, kInv, "expanded_row_idx|expandedRowIdx"},
    {"ExpandedRowIdxFormatNZ", [](FinalizeFwdCase& c) { c.expanded_row_idx = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {6}, ACL_INT32); }, kInv, "expanded_row_idx|expandedRowIdx"},
    {"X1Strided", [](FinalizeFwdCase& c) { c.x1 = Tensor::strided({3, 4}, ACL_FLOAT); }, kInv, "x1"},
    {"X1FormatNZ", [](FinalizeFwdCase& c) { c.x1 = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 4}, ACL_FLOAT); }, kInv, "x1"},
    {"X2Strided", [](FinalizeFwdCase& c) { c.x2 = Tensor::strided({3, 4}, ACL_FLOAT); }, kInv, "x2"},
    {"X2FormatNZ", [](FinalizeFwdCase& c) { c.x2 = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 4}, ACL_FLOAT); }, kInv, "x2"},
    {"BiasStrided", [](FinalizeFwdCase& c) { c.bias = Tensor::strided({3, 4}, ACL_FLOAT); }, kInv, "bias"},
    {"BiasFormatNZ", [](FinalizeFwdCase& c) { c.bias = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 4}, ACL_FLOAT); }, kInv, "bias"},
    {"ScalesStrided", [](FinalizeFwdCase& c) { c.scales = Tensor::strided({3, 2}, ACL_FLOAT); }, kInv, "scales"},
    {"ScalesFormatNZ", [](FinalizeFwdCase& c) { c.scales = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 2}, ACL_FLOAT); }, kInv, "scales"},
    {"ExpertIdxStrided", [](FinalizeFwdCase& c) { c.expert_idx = Tensor::strided({3, 2}, ACL_INT32); }, kInv, "expert_idx|expertIdx"},
    {"ExpertIdxFormatNZ", [](FinalizeFwdCase& c) { c.expert_idx = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 2}, ACL_INT32); }, kInv, "expert_idx|expertIdx"},
    {"OutStrided", [](FinalizeFwdCase& c) { c.out = Tensor::strided({3, 4}, ACL_FLOAT); }, kInv, "out"},
    {"OutFormatNZ", [](FinalizeFwdCase& c) { c.out = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 4}, ACL_FLOAT); }, kInv, "out"},
};

class FinalizeForwardRules : public testing::TestWithParam<R_> {};

TEST_P(FinalizeForwardRules, Rejected) {
  FinalizeFwdCase c;
  GetParam().mutate(c);
  expect_rejected(c, GetParam().code, GetParam().arg, GetParam().words);
}

INSTANTIATE_TEST_SUITE_P(MoeFinalizeRoutingV2, FinalizeForwardRules, testing::ValuesIn(kRules),
                         rule_name<FinalizeFwdCase>);

TEST(MoeFinalizeRoutingV2, BaselineOfRuleTableIsValid) {
  SCOPED_TRACE(seed_trace());
  FinalizeFwdCase c;
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference("baseline");
  FinalizeFwdCase d;
  to_drop_pad(d, 1);
  ASSERT_TRUE(run_ok(d));
  d.check_against_reference("baseline drop-pad");
}

TEST(MoeFinalizeRoutingV2, WorkedExample_4_7) {
  FinalizeFwdCase c(3, 2, 4, 2);
  c.expanded_x.set({0.1, 1.1, 2.1, 3.1, 4.1, 5.1, 6.1, 7.1, 8.1, 9.1, 10.1, 11.1,
                    0.1, 1.1, 2.1, 3.1, 4.1, 5.1, 6.1, 7.1, 8.1, 9.1, 10.1, 11.1});
  const std::vector<double> x1 = {0.2, 1.2, 2.2, 3.2, 4.2, 5.2, 6.2, 7.2, 8.2, 9.2, 10.2, 11.2};
  c.x1.set(x1);
  c.x2.set(x1);
  c.bias.set({0.2, 0.4, 0.2, 0.4, 0.2, 0.4, 0.2, 0.4});
  c.scales.set({1.3, 1.6, 1.2, 1.8, 1.2, 2.3});
  c.expert_idx = Tensor::from_i32({3, 2}, {0, 1, 0, 1, 0, 1});
  c.expanded_row_idx = Tensor::from_i32({6}, {2, 1, 4, 3, 0, 5});
  ASSERT_TRUE(run_ok(c));
  expect_listed(c.out, {11.67, 17.15, 21.47, 26.95, 14.10, 19.70, 24.10, 29.70, 40.65, 46.85, 51.65, 57.85},
                2, "§4.7 out");
  c.check_against_reference("§4.7 out");
}

struct FwdConfig {
  const char* name;
  int64_t mode, R, K, H, E;
  bool x1, x2, bias, scales;
  aclDataType sdt_override;  // ACL_DT_UNDEFINED: scales dtype = expanded_x dtype
};

class FinalizeForwardValues : public testing::TestWithParam<std::tuple<aclDataType, FwdConfig>> {};

TEST_P(FinalizeForwardValues, MatchesFloat64Reference) {
  SCOPED_TRACE(seed_trace());
  const auto [dt, f] = GetParam();
  const aclDataType sdt = f.sdt_override == ACL_DT_UNDEFINED ? dt : f.sdt_override;
  FinalizeFwdCase c(f.R, f.K, f.H, f.E, dt, sdt, static_cast<uint32_t>(f.mode * 13 + f.H));
  c.drop_pad_mode = f.mode;
  Rng rng(static_cast<uint32_t>(f.R * 17 + f.mode));
  if (f.mode == 1 || f.mode == 3) {
    const int64_t cap = f.R;  // E experts x capacity R, some slots dropped
    c.expanded_x = Tensor::from({f.E, cap, f.H}, dt, rng.uniform_vec(f.E * cap * f.H, -2, 2));
    std::vector<int32_t> perm = rng.permutation(static_cast<int32_t>(f.E * cap));
    std::vector<int32_t> idx(perm.begin(), perm.begin() + f.R * f.K);
    for (size_t i = 0; i < idx.size(); i += 3) idx[i] = -1;  // dropped slots (D7)
    c.expanded_row_idx = Tensor::from_i32({f.R * f.K}, idx);
  }
  if (!f.x1) c.x1 = Tensor();
  if (!f.x2) c.x2 = Tensor();
  if (!f.bias) {
    c.bias = Tensor();
    c.expert_idx = Tensor();
  }
  if (!f.scales) c.scales = Tensor();
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference(f.name);
}

INSTANTIATE_TEST_SUITE_P(
    MoeFinalizeRoutingV2, FinalizeForwardValues,
    testing::Combine(
        testing::Values(ACL_FLOAT, ACL_FLOAT16, ACL_BF16),
        testing::Values(
            FwdConfig{"mode0_all", 0, 5, 3, 8, 4, true, true, true, true, ACL_DT_UNDEFINED},
            FwdConfig{"mode0_scales_fp32", 0, 4, 2, 6, 3, true, false, true, true, ACL_FLOAT},
            FwdConfig{"mode0_bare_K1", 0, 6, 1, 5, 2, false, false, false, false, ACL_DT_UNDEFINED},
            FwdConfig{"mode1_all", 1, 4, 2, 7, 3, true, true, true, true, ACL_DT_UNDEFINED},
            FwdConfig{"mode1_no_bias", 1, 5, 2, 4, 4, true, false, false, true, ACL_DT_UNDEFINED},
            FwdConfig{"mode2_all", 2, 5, 3, 8, 4, true, true, true, true, ACL_DT_UNDEFINED},
            FwdConfig{"mode3_all", 3, 4, 3, 9, 5, true, true, true, true, ACL_DT_UNDEFINED},
            FwdConfig{"odd_hidden_257", 0, 3, 2, 257, 3, true, true, true, true, ACL_DT_UNDEFINED})),
    [](const testing::TestParamInfo<std::tuple<aclDataType, FwdConfig>>& info) {
      return std::string(dt_name(std::get<0>(info.param))) + "_" + std::get<1>(info.param).name;
    });

// L4: without scales and expert_idx, K = numel(expanded_row_idx) / R (scales count as 1).
TEST(MoeFinalizeRoutingV2, L4KFromIndexLength) {
  SCOPED_TRACE(seed_trace());
  FinalizeFwdCase c(3, 2, 4, 3);
  c.scales = Tensor();
  c.bias = Tensor();
  c.expert_idx = Tensor();
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference("K inferred = 2");
}

// L5: in dropless modes an index >= rows of a truncated expanded_x is a skipped slot that keeps
// its scale * bias term.
TEST(MoeFinalizeRoutingV2, L5TruncatedExpandedX) {
  SCOPED_TRACE(seed_trace());
  FinalizeFwdCase c(3, 2, 4, 3);
  Rng rng(3);
  c.expanded_x = Tensor::from({4, 4}, ACL_FLOAT, rng.uniform_vec(16, -2, 2));  // rows 4 < R*K 6
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference("truncated expanded_x");
}

// D7: a dropped slot contributes scale * bias (checked on a hand case, not only the reference).
TEST(MoeFinalizeRoutingV2, DroppedSlotKeepsBias) {
  FinalizeFwdCase c(1, 2, 2, 2);
  c.drop_pad_mode = 1;
  c.expanded_x = Tensor::from({2, 1, 2}, ACL_FLOAT, {1.0, 2.0, 3.0, 4.0});
  c.expanded_row_idx = Tensor::from_i32({2}, {1, -1});
  c.x1 = Tensor();
  c.x2 = Tensor();
  c.bias = Tensor::from({2, 2}, ACL_FLOAT, {0.5, 0.25, 10.0, 20.0});
  c.expert_idx = Tensor::from_i32({1, 2}, {0, 1});
  c.scales = Tensor::from({1, 2}, ACL_FLOAT, {2.0, 0.5});
  ASSERT_TRUE(run_ok(c));
  // 2 * ([3, 4] + [0.5, 0.25]) + 0.5 * [10, 20]
  EXPECT_EQ(c.out.get(0), 12.0);
  EXPECT_EQ(c.out.get(1), 18.5);
}

// Repeated -1 entries are valid in drop-pad mode (only valid values must be unique).
TEST(MoeFinalizeRoutingV2, RepeatedDropsAccepted) {
  FinalizeFwdCase c;
  to_drop_pad(c, 1);
  c.expanded_row_idx = Tensor::from_i32({6}, {-1, -1, 0, 3, -1, 1});
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference("repeated -1");
}

// D4: zero tokens.
TEST(MoeFinalizeRoutingV2, ZeroTokens) {
  FinalizeFwdCase c(0, 2, 4, 3);
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(c.out.numel(), 0);
  FinalizeFwdCase d(0, 2, 4, 3);
  d.drop_pad_mode = 1;
  d.expanded_x = Tensor::from({3, 2, 4}, ACL_FLOAT, std::vector<double>(24, 1.0));
  ASSERT_TRUE(run_ok(d));
}

// D16: bitwise identical with 1 and 2 threads.
TEST(MoeFinalizeRoutingV2, DeterministicAcrossThreads) {
  FinalizeFwdCase one(512, 4, 64, 8, ACL_BF16, ACL_FLOAT, 41), two(512, 4, 64, 8, ACL_BF16, ACL_FLOAT, 41);
  expect_deterministic_across_threads(one, two);
}

TEST(MoeFinalizeRoutingV2, WorkspaceSizeIdempotent) {
  FinalizeFwdCase c;
  expect_workspace_idempotent(c);
}

}  // namespace

// Only scales and out carry R: expanded_row_idx's R * K rows witness which one is wrong.
TEST(FinalizeForwardBlame, TheOddTokenCountIsNamed) {
  for (const char* wrong : {"scales", "out"}) {
    FinalizeFwdCase c;
    c.x1 = Tensor();
    c.x2 = Tensor();
    c.bias = Tensor();
    c.expert_idx = Tensor();
    if (std::string(wrong) == "scales") c.scales = Tensor({2, 2}, ACL_FLOAT);
    else c.out = Tensor({2, 4}, ACL_FLOAT);
    expect_blamed(c, ACLNN_ERR_INNER_NULLPTR, "moe_finalize_routing", wrong);
  }
}
