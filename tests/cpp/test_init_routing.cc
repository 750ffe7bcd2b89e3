// aclnnMoeInitRoutingV2 / V3 / V2Grad through the C API: every validation rule of
// docs/operators.md §8.6, §8.8, §8.9 with decisions D25-D31 (null 161001, dtype/layout and
// unsupported quantisation 161002, shapes, attributes and values 561103; nothing written, no
// executor), and values against the worked example of §8.12 and a float64 reference of the
// stable sort (std::stable_sort written here).
#include <algorithm>
#include <numeric>

#include "test_util.h"

using namespace mgt;

namespace {

constexpr aclnnStatus kNull = ACLNN_ERR_PARAM_NULLPTR;
constexpr aclnnStatus kInv = ACLNN_ERR_PARAM_INVALID;
constexpr aclnnStatus kShape = ACLNN_ERR_INNER_NULLPTR;

const std::vector<double> kX = {0.1, 0.2, 1.1, 1.2, 2.1, 2.2};
const std::vector<int32_t> kE = {3, 1, 1, 0, 3, 2};

struct V2Case : OpCase {
  Tensor x, expert_idx, expanded_x, expanded_row_idx, counts, before_cap;
  int64_t active_num = 0, capacity = 0, expert_num = 4, mode = 0, count_flag = 2;
  bool before_flag = false;

  V2Case(aclDataType dt = ACL_FLOAT) {
    x = Tensor::from({3, 2}, dt, kX);
    expert_idx = Tensor::from_i32({3, 2}, kE);
    expanded_x = Tensor({6, 2}, dt);
    expanded_row_idx = Tensor({6}, ACL_INT32);
    counts = Tensor({4}, ACL_INT32);
    before_cap = Tensor({4}, ACL_INT32);
  }
  void to_drop_pad(int64_t c) {
    mode = 1;
    capacity = c;
    before_flag = true;
    expanded_x = Tensor({4, c, 2}, x.dtype());
  }
  aclnnStatus stage1(uint64_t* ws, aclOpExecutor** ex) override {
    return aclnnMoeInitRoutingV2GetWorkspaceSize(
        x.handle(), expert_idx.handle(), active_num, capacity, expert_num, mode, count_flag,
        before_flag, expanded_x.handle(), expanded_row_idx.handle(), counts.handle(),
        before_cap.handle(), ws, ex);
  }
  aclnnStatus stage2(void* ws, uint64_t size, aclOpExecutor* ex) override {
    return aclnnMoeInitRoutingV2(ws, size, ex, nullptr);
  }
  std::vector<Tensor*> outputs() override {
    return {&expanded_x, &expanded_row_idx, &counts, &before_cap};
  }
};

struct V3Case : OpCase {
  Tensor x, expert_idx, scale, offset, expanded_x, expanded_row_idx, counts, expanded_scale;
  int64_t active_num = -1, capacity = -1, expert_num = 4, mode = 0, type = 1, quant = -1,
          row_idx_type = 0;
  bool flag = true;
  std::vector<int64_t> range = {0, 4};
  bool null_range = false;

  V3Case() {
    x = Tensor::from({3, 2}, ACL_FLOAT, kX);
    expert_idx = Tensor::from_i32({3, 2}, kE);
    expanded_x = Tensor({6, 2}, ACL_FLOAT);
    expanded_row_idx = Tensor({6}, ACL_INT32);
    counts = Tensor({4}, ACL_INT64);
  }
  aclnnStatus stage1(uint64_t* ws, aclOpExecutor** ex) override {
    aclIntArray* r = null_range ? nullptr : aclCreateIntArray(range.data(), range.size());
    const aclnnStatus st = aclnnMoeInitRoutingV3GetWorkspaceSize(
        x.handle(), expert_idx.handle(), scale.handle(), offset.handle(), active_num, capacity,
        expert_num, mode, type, flag, quant, r, row_idx_type, expanded_x.handle(),
        expanded_row_idx.handle(), counts.handle(), expanded_scale.handle(), ws, ex);
    if (r) aclDestroyIntArray(r);
    return st;
  }
  aclnnStatus stage2(void* ws, uint64_t size, aclOpExecutor* ex) override {
    return aclnnMoeInitRoutingV3(ws, size, ex, nullptr);
  }
  std::vector<Tensor*> outputs() override { return {&expanded_x, &expanded_row_idx, &counts}; }
};

struct GradCase : OpCase {
  Tensor grad, idx, out;
  int64_t top_k = 2, mode = 0, active_num = 0;
  GradCase(aclDataType dt = ACL_FLOAT) {
    std::vector<double> g(12);
    std::iota(g.begin(), g.end(), 1.0);
    grad = Tensor::from({6, 2}, dt, g);
    idx = Tensor::from_i32({6}, {4, 1, 2, 0, 5, 3});
    out = Tensor({3, 2}, dt);
  }
  aclnnStatus stage1(uint64_t* ws, aclOpExecutor** ex) override {
    return aclnnMoeInitRoutingV2GradGetWorkspaceSize(grad.handle(), idx.handle(), top_k, mode,
                                                     active_num, out.handle(), ws, ex);
  }
  aclnnStatus stage2(void* ws, uint64_t size, aclOpExecutor* ex) override {
    return aclnnMoeInitRoutingV2Grad(ws, size, ex, nullptr);
  }
  std::vector<Tensor*> outputs() override { return {&out}; }
};

std::vector<int32_t> ints(const Tensor& t) {
  std::vector<int32_t> v(t.numel());
  for (size_t i = 0; i < v.size(); ++i) v[i] = t.i32(i);
  return v;
}

// ------------------------------------------------------------------------------- V2 rules --
using RV2 = Rule<V2Case>;
const std::vector<RV2> kV2Rules = {
    {"NullX", [](V2Case& c) { c.x = Tensor(); }, kNull, "x"},
    {"NullExpertIdx", [](V2Case& c) { c.expert_idx = Tensor(); }, kNull, "expert_idx"},
    {"NullExpandedX", [](V2Case& c) { c.expanded_x = Tensor(); }, kNull, "expanded_x"},
    {"NullExpandedRowIdx", [](V2Case& c) { c.expanded_row_idx = Tensor(); }, kNull, "expanded_row_idx"},
    {"NullCountsWithFlag", [](V2Case& c) { c.counts = Tensor(); }, kNull, "expert_tokens_count_or_cumsum"},
    {"NullBeforeCapacityWithFlag", [](V2Case& c) { c.to_drop_pad(2); c.before_cap = Tensor(); }, kNull, "expert_tokens_before_capacity"},
    {"NullWorkspaceSize", [](V2Case& c) { c.null_workspace_size = true; }, kNull, "workspaceSize"},
    {"NullExecutor", [](V2Case& c) { c.null_executor = true; }, kNull, "executor"},
    {"XInt32", [](V2Case& c) { c.x = Tensor({3, 2}, ACL_INT32); }, kInv, "x"},
    {"XDouble", [](V2Case& c) { c.x = Tensor({3, 2}, ACL_DOUBLE); }, kInv, "x"},
    {"ExpertIdxInt64", [](V2Case& c) { c.expert_idx = Tensor({3, 2}, ACL_INT64); }, kInv, "expert_idx"},
    {"ExpandedXDtype", [](V2Case& c) { c.expanded_x = Tensor({6, 2}, ACL_FLOAT16); }, kInv, "expanded_x"},
    {"ExpandedRowIdxDtype", [](V2Case& c) { c.expanded_row_idx = Tensor({6}, ACL_INT64); }, kInv, "expanded_row_idx"},
    {"CountsInt64", [](V2Case& c) { c.counts = Tensor({4}, ACL_INT64); }, kInv, "expert_tokens_count_or_cumsum"},
    {"XStrided", [](V2Case& c) { c.x = Tensor::strided({3, 2}, ACL_FLOAT); }, kInv, "x"},
    {"XFormatNZ", [](V2Case& c) { c.x = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 2}, ACL_FLOAT); }, kInv, "x"},
    {"ActiveNumNegative", [](V2Case& c) { c.active_num = -1; }, kShape, "active_num"},
    {"ExpertNumNegative", [](V2Case& c) { c.expert_num = -1; c.count_flag = 0; }, kShape, "expert_num"},
    {"CapacityNegative", [](V2Case& c) { c.capacity = -1; }, kShape, "expert_capacity"},
    {"DropPadMode2", [](V2Case& c) { c.mode = 2; }, kShape, "drop_pad_mode", {"2"}},
    {"CountFlag3", [](V2Case& c) { c.count_flag = 3; }, kShape, "expert_tokens_count_or_cumsum_flag"},
    {"CountsWithoutExpertNum", [](V2Case& c) { c.expert_num = 0; }, kShape, "expert_num"},
    {"DropPadCapacityZero", [](V2Case& c) { c.to_drop_pad(2); c.capacity = 0; }, kShape, "expert_capacity"},
    {"DropPadExpertNumZero", [](V2Case& c) { c.to_drop_pad(2); c.expert_num = 0; }, kShape, "expert_num"},
    {"XRank1", [](V2Case& c) { c.x = Tensor({6}, ACL_FLOAT); }, kShape, "x"},
    {"ExpertIdxRank3", [](V2Case& c) { c.expert_idx = Tensor({3, 2, 1}, ACL_INT32); }, kShape, "expert_idx"},
    {"Dim0Differ", [](V2Case& c) { c.expert_idx = Tensor({2, 2}, ACL_INT32); }, kShape, "expert_idx"},
    {"HiddenZero", [](V2Case& c) { c.x = Tensor({3, 0}, ACL_FLOAT); c.expanded_x = Tensor({6, 0}, ACL_FLOAT); }, kShape, "x"},
    {"ExpandedXRows", [](V2Case& c) { c.expanded_x = Tensor({5, 2}, ACL_FLOAT); }, kShape, "expanded_x"},
    {"ExpandedXActiveRows", [](V2Case& c) { c.active_num = 4; }, kShape, "expanded_x"},
    {"ExpandedXDropPadShape", [](V2Case& c) { c.to_drop_pad(2); c.expanded_x = Tensor({4, 3, 2}, ACL_FLOAT); }, kShape, "expanded_x"},
    {"ExpandedRowIdxLength", [](V2Case& c) { c.expanded_row_idx = Tensor({5}, ACL_INT32); }, kShape, "expanded_row_idx"},
    {"CountsLength", [](V2Case& c) { c.counts = Tensor({3}, ACL_INT32); }, kShape, "expert_tokens_count_or_cumsum"},
    {"BeforeCapacityLength", [](V2Case& c) { c.to_drop_pad(2); c.before_cap = Tensor({5}, ACL_INT32); }, kShape, "expert_tokens_count_or_cumsum"},
    {"ExpertIdAtE", [](V2Case& c) { c.expert_idx = Tensor::from_i32({3, 2}, {3, 1, 1, 4, 3, 2}); }, kShape, "expert_idx", {"4", "3"}},
    {"ExpertIdNegative", [](V2Case& c) { c.count_flag = 0; c.expert_num = 0; c.expert_idx = Tensor::from_i32({3, 2}, {3, 1, -1, 0, 3, 2}); }, kShape, "expert_idx", {"-1"}},
};

class V2Rules : public testing::TestWithParam<RV2> {};
TEST_P(V2Rules, Rejected) {
  V2Case c;
  GetParam().mutate(c);
  expect_rejected(c, GetParam().code, GetParam().arg, GetParam().words);
}
INSTANTIATE_TEST_SUITE_P(MoeInitRoutingV2, V2Rules, testing::ValuesIn(kV2Rules), rule_name<V2Case>);

// ------------------------------------------------------------------------------- V3 rules --
using RV3 = Rule<V3Case>;
const std::vector<RV3> kV3Rules = {
    {"NullX", [](V3Case& c) { c.x = Tensor(); }, kNull, "x"},
    {"NullCountsWithFlag", [](V3Case& c) { c.counts = Tensor(); }, kNull, "expert_tokens_count_or_cumsum"},
    {"QuantMode0", [](V3Case& c) { c.quant = 0; }, kInv, "quant_mode"},
    {"Scale", [](V3Case& c) { c.scale = Tensor({3}, ACL_FLOAT); }, kInv, "scale"},
    {"Offset", [](V3Case& c) { c.offset = Tensor({1}, ACL_FLOAT); }, kInv, "offset"},
    {"CountsInt32", [](V3Case& c) { c.counts = Tensor({4}, ACL_INT32); }, kInv, "expert_tokens_count_or_cumsum"},
    {"ExpertNumZero", [](V3Case& c) { c.expert_num = 0; }, kShape, "expert_num"},
    {"ActiveNumMinus2", [](V3Case& c) { c.active_num = -2; }, kShape, "active_num"},
    {"CapacityMinus2", [](V3Case& c) { c.capacity = -2; }, kShape, "expert_capacity"},
    {"RangeLength3", [](V3Case& c) { c.range = {0, 2, 4}; }, kShape, "active_expert_range", {"got [0, 2, 4]"}},
    {"RangeEmptyWindow", [](V3Case& c) { c.range = {2, 2}; }, kShape, "active_expert_range"},
    {"RangePastE", [](V3Case& c) { c.range = {1, 5}; }, kShape, "active_expert_range", {"got [1, 5]"}},
    {"RangeNegative", [](V3Case& c) { c.range = {-1, 3}; }, kShape, "active_expert_range"},
    {"RowIdxType2", [](V3Case& c) { c.row_idx_type = 2; }, kShape, "row_idx_type"},
    {"TokenType3", [](V3Case& c) { c.type = 3; }, kShape, "expert_tokens_num_type"},
    {"DropPadRowIdxType1", [](V3Case& c) { c.mode = 1; c.capacity = 2; c.row_idx_type = 1; c.expanded_x = Tensor({4, 2, 2}, ACL_FLOAT); }, kShape, "row_idx_type"},
    {"DropPadPartialRange", [](V3Case& c) { c.mode = 1; c.capacity = 2; c.range = {1, 4}; c.expanded_x = Tensor({4, 2, 2}, ACL_FLOAT); c.counts = Tensor({3}, ACL_INT64); }, kShape, "active_expert_range"},
    {"CountsWindowLength", [](V3Case& c) { c.range = {1, 3}; }, kShape, "expert_tokens_count_or_cumsum"},
    {"KeyValueShape", [](V3Case& c) { c.type = 2; }, kShape, "expert_tokens_count_or_cumsum"},
};

class V3Rules : public testing::TestWithParam<RV3> {};
TEST_P(V3Rules, Rejected) {
  V3Case c;
  GetParam().mutate(c);
  expect_rejected(c, GetParam().code, GetParam().arg, GetParam().words);
}
INSTANTIATE_TEST_SUITE_P(MoeInitRoutingV3, V3Rules, testing::ValuesIn(kV3Rules), rule_name<V3Case>);

// ----------------------------------------------------------------------------- grad rules --
using RG = Rule<GradCase>;
const std::vector<RG> kGradRules = {
    {"NullGrad", [](GradCase& c) { c.grad = Tensor(); }, kNull, "grad_expanded_x"},
    {"NullIdx", [](GradCase& c) { c.idx = Tensor(); }, kNull, "expanded_row_idx"},
    {"NullOut", [](GradCase& c) { c.out = Tensor(); }, kNull, "grad_x"},
    {"GradInt32", [](GradCase& c) { c.grad = Tensor({6, 2}, ACL_INT32); }, kInv, "grad_expanded_x"},
    {"IdxInt64", [](GradCase& c) { c.idx = Tensor({6}, ACL_INT64); }, kInv, "expanded_row_idx"},
    {"OutDtype", [](GradCase& c) { c.out = Tensor({3, 2}, ACL_BF16); }, kInv, "grad_x"},
    {"GradStrided", [](GradCase& c) { c.grad = Tensor::strided({6, 2}, ACL_FLOAT); }, kInv, "grad_expanded_x"},
    {"GradFormatNZ", [](GradCase& c) { c.grad = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {6, 2}, ACL_FLOAT); }, kInv, "grad_expanded_x"},
    {"DropPadMode2", [](GradCase& c) { c.mode = 2; }, kShape, "drop_pad_mode"},
    {"TopKZero", [](GradCase& c) { c.top_k = 0; }, kShape, "top_k"},
    {"ActiveNegative", [](GradCase& c) { c.active_num = -1; }, kShape, "active_num"},
    {"LengthNotMultiple", [](GradCase& c) { c.top_k = 4; }, kShape, "expanded_row_idx"},
    {"IdxRank2", [](GradCase& c) { c.idx = Tensor({3, 2}, ACL_INT32); }, kShape, "expanded_row_idx"},
    {"GradRank3Mode0", [](GradCase& c) { c.grad = Tensor({6, 1, 2}, ACL_FLOAT); }, kShape, "grad_expanded_x"},
    {"GradRank2Mode1", [](GradCase& c) { c.mode = 1; }, kShape, "grad_expanded_x"},
    {"Dim0NotRK", [](GradCase& c) { c.grad = Tensor({5, 2}, ACL_FLOAT); }, kShape, "grad_expanded_x"},
    {"Dim0NotActive", [](GradCase& c) { c.active_num = 4; }, kShape, "grad_expanded_x"},
    {"HiddenZero", [](GradCase& c) { c.grad = Tensor({6, 0}, ACL_FLOAT); c.out = Tensor({3, 0}, ACL_FLOAT); }, kShape, "grad_expanded_x"},
    {"OutShape", [](GradCase& c) { c.out = Tensor({3, 3}, ACL_FLOAT); }, kShape, "grad_x"},
    {"OutRank3", [](GradCase& c) { c.out = Tensor({3, 2, 1}, ACL_FLOAT); }, kShape, "grad_x"},
    {"IdxPastEnd", [](GradCase& c) { c.idx = Tensor::from_i32({6}, {4, 1, 2, 0, 6, 3}); }, kShape, "expanded_row_idx", {"6"}},
    {"IdxBelowMinus1", [](GradCase& c) { c.idx = Tensor::from_i32({6}, {4, 1, -2, 0, 5, 3}); }, kShape, "expanded_row_idx", {"-2"}},
    {"IdxRepeated", [](GradCase& c) { c.idx = Tensor::from_i32({6}, {4, 1, 2, 1, 5, 3}); }, kShape, "expanded_row_idx"},
};

class GradRules : public testing::TestWithParam<RG> {};
TEST_P(GradRules, Rejected) {
  GradCase c;
  GetParam().mutate(c);
  expect_rejected(c, GetParam().code, GetParam().arg, GetParam().words);
}
INSTANTIATE_TEST_SUITE_P(MoeInitRoutingV2Grad, GradRules, testing::ValuesIn(kGradRules), rule_name<GradCase>);

// ---------------------------------------------------------------------------------- values --
TEST(MoeInitRoutingV2, WorkedExample_8_12_Dropless) {
  V2Case c;
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(ints(c.expanded_row_idx), (std::vector<int32_t>{4, 1, 2, 0, 5, 3}));
  const std::vector<int> src = {1, 0, 1, 2, 0, 2};
  for (int d = 0; d < 6; ++d) {
    EXPECT_EQ(c.expanded_x.get(2 * d), static_cast<float>(kX[2 * src[d]]));
    EXPECT_EQ(c.expanded_x.get(2 * d + 1), static_cast<float>(kX[2 * src[d] + 1]));
  }
  EXPECT_EQ(ints(c.counts), (std::vector<int32_t>{1, 2, 1, 2}));
  EXPECT_TRUE(c.before_cap.all_poison()) << "the drop-pad output is not written in mode 0";
  c.count_flag = 1;
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(ints(c.counts), (std::vector<int32_t>{1, 3, 4, 6}));
}

TEST(MoeInitRoutingV2, WorkedExample_8_12_Active) {
  V2Case c;
  c.active_num = 4;
  c.expanded_x = Tensor({4, 2}, ACL_FLOAT);
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(ints(c.expanded_row_idx), (std::vector<int32_t>{4, 1, 2, 0, 5, 3}));
  EXPECT_EQ(c.expanded_x.get(6), 2.1f);
}

TEST(MoeInitRoutingV2, WorkedExample_8_12_DropPad) {
  V2Case c;
  c.to_drop_pad(1);
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(ints(c.expanded_row_idx), (std::vector<int32_t>{3, 1, -1, 0, -1, 2}));
  EXPECT_EQ(ints(c.before_cap), (std::vector<int32_t>{1, 2, 1, 2}));
  EXPECT_TRUE(c.counts.all_poison()) << "the count output is not written in mode 1";
  V2Case d;
  d.to_drop_pad(2);
  ASSERT_TRUE(run_ok(d));
  EXPECT_EQ(ints(d.expanded_row_idx), (std::vector<int32_t>{6, 2, 3, 0, 7, 4}));
  // e0 (x1, 0): the padding row is +0.0.
  EXPECT_EQ(d.expanded_x.get(2), 0.0);
  EXPECT_FALSE(std::signbit(d.expanded_x.get(2)));
  EXPECT_EQ(d.expanded_x.get(0), 1.1f);
}

TEST(MoeInitRoutingV3, WorkedExample_8_12_Window) {
  V3Case c;
  c.range = {1, 3};
  c.counts = Tensor({2}, ACL_INT64);
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(ints(c.expanded_row_idx), (std::vector<int32_t>{-1, 0, 1, -1, -1, 2}));
  EXPECT_EQ(c.counts.get(0), 2);
  EXPECT_EQ(c.counts.get(1), 1);
  for (int j = 6; j < 12; ++j) EXPECT_EQ(c.expanded_x.get(j), 0.0) << "tail rows are zero (D27)";
  c.row_idx_type = 1;
  c.type = 0;
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(ints(c.expanded_row_idx), (std::vector<int32_t>{1, 2, 5, 0, 4, 3}));
  EXPECT_EQ(c.counts.get(1), 3);
  V3Case kv;
  kv.range = {1, 3};
  kv.type = 2;
  kv.counts = Tensor({4, 2}, ACL_INT64);
  ASSERT_TRUE(run_ok(kv));
  const std::vector<double> want = {1, 2, 2, 1, 0, 0, 0, 0};
  EXPECT_EQ(kv.counts.values(), want);
  V3Case full;
  full.null_range = true;
  ASSERT_TRUE(run_ok(full));
  EXPECT_EQ(ints(full.expanded_row_idx), (std::vector<int32_t>{4, 1, 2, 0, 5, 3}));
}

TEST(MoeInitRoutingV3, FlagOffLeavesCountsAlone) {
  V3Case c;
  c.flag = false;
  c.counts = Tensor();
  ASSERT_TRUE(run_ok(c));
}

TEST(MoeInitRoutingV2Grad, WorkedExample_8_12) {
  GradCase c;
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(c.out.values(), (std::vector<double>{12, 14, 6, 8, 18, 20}));
  GradCase a;
  a.active_num = 4;
  a.grad = Tensor::from({4, 2}, ACL_FLOAT, {1, 2, 3, 4, 5, 6, 7, 8});
  ASSERT_TRUE(run_ok(a));
  EXPECT_EQ(a.out.values(), (std::vector<double>{3, 4, 6, 8, 7, 8}));
  GradCase d;
  d.mode = 1;
  d.grad = Tensor::from({4, 1, 2}, ACL_FLOAT, {1, 2, 3, 4, 5, 6, 7, 8});
  d.idx = Tensor::from_i32({6}, {3, 1, -1, 0, -1, 2});
  ASSERT_TRUE(run_ok(d));
  EXPECT_EQ(d.out.values(), (std::vector<double>{10, 12, 1, 2, 5, 6}));
}

// Random inputs against a stable-sort reference, every dtype, odd sizes, several threads.
struct RandomParam {
  int64_t R, K, E, H, C;
  aclDataType dt;
};

class V2Random : public testing::TestWithParam<RandomParam> {};
TEST_P(V2Random, MatchesStableSortReference) {
  SCOPED_TRACE(seed_trace());
  const RandomParam p = GetParam();
  Rng rng(test_seed() ^ static_cast<uint32_t>(p.R * 131 + p.E));
  V2Case c(p.dt);
  c.x = Tensor::from({p.R, p.H}, p.dt, rng.uniform_vec(p.R * p.H, -3, 3));
  std::vector<int32_t> e(p.R * p.K);
  for (auto& v : e) v = static_cast<int32_t>(rng.integer(0, p.E - 1));
  c.expert_idx = Tensor::from_i32({p.R, p.K}, e);
  c.expert_num = p.E;
  c.counts = Tensor({p.E}, ACL_INT32);
  c.before_cap = Tensor({p.E}, ACL_INT32);
  if (p.C > 0) {
    c.to_drop_pad(p.C);
    c.expanded_x = Tensor({p.E, p.C, p.H}, p.dt);
  } else {
    c.expanded_x = Tensor({p.R * p.K, p.H}, p.dt);
  }
  c.expanded_row_idx = Tensor({p.R * p.K}, ACL_INT32);
  ASSERT_TRUE(run_ok(c));
  std::vector<int32_t> order(e.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return e[a] < e[b]; });
  std::vector<int32_t> want(e.size(), -1);
  std::vector<int64_t> fill(p.E, 0);
  for (size_t d = 0; d < order.size(); ++d) {
    const int32_t s = order[d], ex = e[s];
    if (p.C == 0) {
      want[s] = static_cast<int32_t>(d);
    } else if (fill[ex] < p.C) {
      want[s] = static_cast<int32_t>(ex * p.C + fill[ex]);
    }
    ++fill[ex];
  }
  ASSERT_EQ(ints(c.expanded_row_idx), want);
  const Tensor& cnt = p.C > 0 ? c.before_cap : c.counts;
  for (int64_t b = 0; b < p.E; ++b) EXPECT_EQ(cnt.get(b), fill[b]);
  // Every row is the source token's row (bit copy) or zero.
  const int64_t rows = c.expanded_x.numel() / p.H;
  std::vector<int64_t> src(rows, -1);
  for (size_t s = 0; s < want.size(); ++s) {
    if (want[s] >= 0) src[want[s]] = static_cast<int64_t>(s) / p.K;
  }
  for (int64_t d = 0; d < rows; ++d) {
    for (int64_t h = 0; h < p.H; ++h) {
      const double v = c.expanded_x.get(d * p.H + h);
      ASSERT_EQ(v, src[d] < 0 ? 0.0 : c.x.get(src[d] * p.H + h)) << "row " << d;
    }
  }
  // Backward of the same index: the per-token sum of its rows.
  GradCase g(p.dt);
  g.grad = Tensor::from(c.expanded_x.shape(), p.dt, rng.uniform_vec(rows * p.H, -2, 2));
  g.idx = Tensor::from_i32({p.R * p.K}, ints(c.expanded_row_idx));
  g.top_k = p.K;
  g.mode = p.C > 0 ? 1 : 0;
  g.out = Tensor({p.R, p.H}, p.dt);
  ASSERT_TRUE(run_ok(g));
  std::vector<double> ref(p.R * p.H, 0.0), mag(p.R * p.H, 0.0);
  for (int64_t r = 0; r < p.R; ++r) {
    for (int64_t k = 0; k < p.K; ++k) {
      const int32_t d = want[r * p.K + k];
      if (d < 0) continue;
      for (int64_t h = 0; h < p.H; ++h) {
        ref[r * p.H + h] += g.grad.get(d * p.H + h);
        mag[r * p.H + h] += std::abs(g.grad.get(d * p.H + h));
      }
    }
  }
  expect_close(g.out, ref, "grad_x", mag, static_cast<double>(p.K));
}

INSTANTIATE_TEST_SUITE_P(
    MoeInitRoutingV2, V2Random,
    testing::Values(RandomParam{37, 3, 8, 17, 0, ACL_FLOAT}, RandomParam{64, 6, 64, 33, 0, ACL_BF16},
                    RandomParam{50, 2, 5, 8, 9, ACL_FLOAT16}, RandomParam{40, 1, 2, 3, 0, ACL_FLOAT},
                    RandomParam{20000, 2, 16, 4, 0, ACL_FLOAT},
                    RandomParam{300, 4, 4, 1, 400, ACL_BF16},
                    RandomParam{0, 2, 4, 5, 0, ACL_FLOAT}, RandomParam{0, 2, 4, 5, 3, ACL_FLOAT}));

TEST(MoeInitRoutingV2, DeterministicAcrossThreads) {
  auto make = [] {
    auto c = std::make_unique<V2Case>(ACL_BF16);
    Rng rng(7);
    c->x = Tensor::from({9000, 5}, ACL_BF16, rng.uniform_vec(9000 * 5, -1, 1));
    std::vector<int32_t> e(9000 * 3);
    for (auto& v : e) v = static_cast<int32_t>(rng.integer(0, 31));
    c->expert_idx = Tensor::from_i32({9000, 3}, e);
    c->expert_num = 32;
    c->counts = Tensor({32}, ACL_INT32);
    c->expanded_x = Tensor({27000, 5}, ACL_BF16);
    c->expanded_row_idx = Tensor({27000}, ACL_INT32);
    return c;
  };
  auto one = make(), two = make();
  expect_deterministic_across_threads(*one, *two);
}

TEST(AclIntArray, CreateAndDestroy) {
  EXPECT_EQ(aclCreateIntArray(nullptr, 2), nullptr);
  EXPECT_NE(std::string(aclGetRecentErrMsg()).find("value"), std::string::npos);
  aclIntArray* a = aclCreateIntArray(nullptr, 0);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(aclDestroyIntArray(a), ACLNN_SUCCESS);
}

}  // namespace

// x and expert_idx disagree on R: expanded_row_idx's R * K rows witness which one is wrong
// (x is not taken as right by default).
TEST(InitRoutingBlame, TheOddTokenCountIsNamed) {
  V2Case c;
  c.x = Tensor({4, 2}, ACL_FLOAT);
  expect_blamed(c, ACLNN_ERR_INNER_NULLPTR, "moe_init_routing", "x");
  V2Case d;
  d.expert_idx = Tensor::from_i32({4, 2}, {0, 1, 2, 3, 0, 1, 2, 3});
  expect_blamed(d, ACLNN_ERR_INNER_NULLPTR, "moe_init_routing", "expert_idx");
}
