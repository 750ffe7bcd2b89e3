// aclnnClippedSwiglu / V2 and aclnnClippedSwigluGrad (+ the GradV2 extension) through the C API
// (docs/operators.md §9, decisions D32, docs/decisions.md L160-L165): every validation rule with
// its code and untouched (poisoned) outputs, the §9.7 worked example, values of every dtype,
// layout, dim and clamp mode against the float64 reference, group_index, empty tensors, and the
// inclusive masks at exactly +-limit next to swiglu_group's strict ones.
#include "hwy_targets.h"
#include "reference.h"
#include "test_util.h"

using namespace mgt;

namespace {

constexpr aclnnStatus kNull = ACLNN_ERR_PARAM_NULLPTR;
constexpr aclnnStatus kInv = ACLNN_ERR_PARAM_INVALID;
constexpr aclnnStatus kTiling = ACLNN_ERR_INNER_TILING_ERROR;

std::vector<int64_t> half_at(std::vector<int64_t> s, int64_t dim) {
  const int64_t d = dim < 0 ? dim + static_cast<int64_t>(s.size()) : dim;
  s[static_cast<size_t>(d)] /= 2;
  return s;
}

std::vector<int64_t> group_values(const Tensor& g) {
  std::vector<int64_t> v;
  for (int64_t i = 0; !g.is_null() && i < g.numel(); ++i) v.push_back(static_cast<int64_t>(g.get(i)));
  return v;
}

// Common attributes and inputs of both directions.
struct ClippedBase : OpCase {
  Tensor x, group_index;
  std::vector<int64_t> shape;
  ref::Clipped attr;
  bool v2 = true;  // forward: V2 (clampMode) or V1; backward: GradV2 or Grad

  ClippedBase(std::vector<int64_t> s, aclDataType dt, uint32_t salt, double lo, double hi)
      : shape(std::move(s)) {
    Rng rng(salt);
    x = Tensor::from(shape, dt, rng.uniform_vec(static_cast<size_t>(numel_of(shape)), lo, hi));
  }
  std::vector<int64_t> y_shape() const { return half_at(shape, attr.dim); }
  const std::vector<int64_t>* gi(std::vector<int64_t>& store) const {
    if (group_index.is_null()) return nullptr;
    store = group_values(group_index);
    return &store;
  }
};

struct FwdCase : ClippedBase {
  Tensor y;
  FwdCase(std::vector<int64_t> s = {3, 8}, aclDataType dt = ACL_FLOAT, uint32_t salt = 91,
          int64_t dim = -1)
      : ClippedBase(std::move(s), dt, salt, -9, 9) {
    attr.dim = dim;
    group_index = Tensor::from_i64({2}, {1, 1});
    y = Tensor(y_shape(), dt);
  }
  aclnnStatus stage1(uint64_t* ws, aclOpExecutor** ex) override {
    if (!v2) {
      return aclnnClippedSwigluGetWorkspaceSize(x.handle(), group_index.handle(), attr.dim,
                                                attr.alpha, attr.limit, attr.bias,
                                                attr.interleaved, y.handle(), ws, ex);
    }
    return aclnnClippedSwigluV2GetWorkspaceSize(x.handle(), group_index.handle(), attr.dim,
                                                attr.alpha, attr.limit, attr.bias,
                                                attr.interleaved, attr.mode, y.handle(), ws, ex);
  }
  aclnnStatus stage2(void* ws, uint64_t size, aclOpExecutor* ex) override {
    return v2 ? aclnnClippedSwigluV2(ws, size, ex, nullptr) : aclnnClippedSwiglu(ws, size, ex, nullptr);
  }
  std::vector<Tensor*> outputs() override { return {&y}; }
  void check(const std::string& what) {
    std::vector<int64_t> g;
    const ref::ClippedOut r = ref::clipped_forward(x.values(), shape, gi(g), attr);
    expect_close(y, r.v, what + " y", r.scale);
  }
};

struct GradCase : ClippedBase {
  Tensor grad_y, grad_x;
  GradCase(std::vector<int64_t> s = {3, 8}, aclDataType dt = ACL_FLOAT, uint32_t salt = 92,
           int64_t dim = -1)
      : ClippedBase(std::move(s), dt, salt, -9, 9) {
    attr.dim = dim;
    Rng rng(salt + 1000);
    const std::vector<int64_t> ys = y_shape();
    std::vector<double> g(static_cast<size_t>(numel_of(ys)));
    for (auto& v : g) v = rng.signed_uniform(0.05, 2.0);  // random upstream gradient
    grad_y = Tensor::from(ys, dt, g);
    group_index = Tensor::from_i64({2}, {1, 1});
    grad_x = Tensor(shape, dt);
  }
  aclnnStatus stage1(uint64_t* ws, aclOpExecutor** ex) override {
    if (!v2) {
      return aclnnClippedSwigluGradGetWorkspaceSize(grad_y.handle(), x.handle(),
                                                    group_index.handle(), attr.dim, attr.alpha,
                                                    attr.limit, attr.bias, attr.interleaved,
                                                    grad_x.handle(), ws, ex);
    }
    return aclnnClippedSwigluGradV2GetWorkspaceSize(grad_y.handle(), x.handle(),
                                                    group_index.handle(), attr.dim, attr.alpha,
                                                    attr.limit, attr.bias, attr.interleaved,
                                                    attr.mode, grad_x.handle(), ws, ex);
  }
  aclnnStatus stage2(void* ws, uint64_t size, aclOpExecutor* ex) override {
    return v2 ? aclnnClippedSwigluGradV2(ws, size, ex, nullptr)
              : aclnnClippedSwigluGrad(ws, size, ex, nullptr);
  }
  std::vector<Tensor*> outputs() override { return {&grad_x}; }
  void check(const std::string& what) {
    std::vector<int64_t> g;
    const ref::ClippedOut r = ref::clipped_backward(grad_y.values(), x.values(), shape, gi(g), attr);
    expect_close(grad_x, r.v, what + " grad_x", r.scale, 2.0);
  }
};

// ---------------------------------------------------------------------------------------------
// Validation: one valid call mutated once; code, named argument, nothing written (poison).
// ---------------------------------------------------------------------------------------------
using RF = Rule<FwdCase>;
const std::vector<RF> kFwdRules = {
    {"NullX", [](FwdCase& c) { c.x = Tensor(); }, kNull, "x"},
    {"NullY", [](FwdCase& c) { c.y = Tensor(); }, kNull, "y|out"},
    {"NullDataX", [](FwdCase& c) { c.x = Tensor::null_data({3, 8}, ACL_FLOAT); }, kNull, "x"},
    {"NullWorkspaceSize", [](FwdCase& c) { c.null_workspace_size = true; }, kNull, "workspaceSize"},
    {"NullExecutor", [](FwdCase& c) { c.null_executor = true; }, kNull, "executor"},
    {"XInt32", [](FwdCase& c) { c.x = Tensor({3, 8}, ACL_INT32); }, kInv, "x"},
    {"XDouble", [](FwdCase& c) { c.x = Tensor({3, 8}, ACL_DOUBLE); }, kInv, "x"},
    {"YDtypeNotX", [](FwdCase& c) { c.y = Tensor({3, 4}, ACL_BF16); }, kInv, "y|out"},
    {"GroupIndexInt32", [](FwdCase& c) { c.group_index = Tensor({2}, ACL_INT32); }, kInv, "group_index|groupIndex"},
    {"XStrided", [](FwdCase& c) { c.x = Tensor::strided({3, 8}, ACL_FLOAT); }, kInv, "x"},
    {"XFormatNZ", [](FwdCase& c) { c.x = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 8}, ACL_FLOAT); }, kInv, "x"},
    {"YStrided", [](FwdCase& c) { c.y = Tensor::strided({3, 4}, ACL_FLOAT); }, kInv, "y|out"},
    {"YFormatNZ", [](FwdCase& c) { c.y = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 4}, ACL_FLOAT); }, kInv, "y|out"},
    {"GroupIndexStrided", [](FwdCase& c) { c.group_index = Tensor::strided({2}, ACL_INT64); }, kInv, "group_index|groupIndex"},
    {"GroupIndexFormatNZ", [](FwdCase& c) { c.group_index = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {2}, ACL_INT64); }, kInv, "group_index|groupIndex"},
    {"XRank0", [](FwdCase& c) { c.x = Tensor({}, ACL_FLOAT); }, kInv, "x", {"rank"}},
    {"XRank9", [](FwdCase& c) {
       c.x = Tensor({1, 1, 1, 1, 1, 1, 1, 1, 2}, ACL_FLOAT); c.y = Tensor({1, 1, 1, 1, 1, 1, 1, 1, 1}, ACL_FLOAT);
     }, kInv, "x", {"rank", "9"}},
    {"DimTooLarge", [](FwdCase& c) { c.attr.dim = 2; }, kInv, "dim", {"2"}},
    {"DimTooSmall", [](FwdCase& c) { c.attr.dim = -3; }, kInv, "dim", {"3"}},
    {"ClampModeTwo", [](FwdCase& c) { c.attr.mode = 2; }, kInv, "clamp_mode|clampMode", {"2"}},
    {"ClampModeNegative", [](FwdCase& c) { c.attr.mode = -1; }, kInv, "clamp_mode|clampMode"},
    {"Mode1AlphaNotDefault", [](FwdCase& c) { c.attr.mode = 1; c.attr.alpha = 1.0; }, kInv, "alpha"},
    {"Mode1BiasNotDefault", [](FwdCase& c) { c.attr.mode = 1; c.attr.bias = 0.0; }, kInv, "bias"},
    {"LimitZero", [](FwdCase& c) { c.attr.limit = 0.0; }, kTiling, "limit"},
    {"LimitNegative", [](FwdCase& c) { c.attr.limit = -7.0; }, kTiling, "limit"},
    {"LimitInf", [](FwdCase& c) { c.attr.limit = INFINITY; }, kTiling, "limit", {"inf"}},
    {"LimitNaN", [](FwdCase& c) { c.attr.limit = std::nan(""); }, kTiling, "limit"},
    {"AlphaInf", [](FwdCase& c) { c.attr.alpha = -INFINITY; }, kTiling, "alpha"},
    {"AlphaNaN", [](FwdCase& c) { c.attr.alpha = std::nan(""); }, kTiling, "alpha"},
    {"BiasInf", [](FwdCase& c) { c.attr.bias = INFINITY; }, kTiling, "bias"},
    {"SplitDimOdd", [](FwdCase& c) { c.x = Tensor({3, 7}, ACL_FLOAT); c.y = Tensor({3, 3}, ACL_FLOAT); }, kTiling, "x", {"7"}},
    {"SplitDimOddDim0", [](FwdCase& c) { c.attr.dim = 0; c.y = Tensor({1, 8}, ACL_FLOAT); }, kTiling, "x", {"3"}},
    {"YShapeNotHalved", [](FwdCase& c) { c.y = Tensor({3, 8}, ACL_FLOAT); }, kTiling, "y|out"},
    {"YShapeOtherDimHalved", [](FwdCase& c) { c.x = Tensor({4, 8}, ACL_FLOAT); c.y = Tensor({2, 8}, ACL_FLOAT); }, kTiling, "y|out"},
    {"YRankNotX", [](FwdCase& c) { c.y = Tensor({12}, ACL_FLOAT); }, kTiling, "y|out"},
    {"GroupIndexRank2", [](FwdCase& c) { c.group_index = Tensor::from_i64({1, 2}, {1, 1}); }, kTiling, "group_index|groupIndex"},
    {"GroupIndexRank0", [](FwdCase& c) { c.group_index = Tensor::from_i64({}, {1}); }, kTiling, "group_index|groupIndex"},
};

class ClippedForwardRules : public testing::TestWithParam<RF> {};
TEST_P(ClippedForwardRules, Rejected) {
  FwdCase c;
  GetParam().mutate(c);
  expect_rejected(c, GetParam().code, GetParam().arg, GetParam().words);
}
INSTANTIATE_TEST_SUITE_P(ClippedSwiglu, ClippedForwardRules, testing::ValuesIn(kFwdRules),
                         rule_name<FwdCase>);

using RG = Rule<GradCase>;
const std::vector<RG> kGradRules = {
    {"NullGradY", [](GradCase& c) { c.grad_y = Tensor(); }, kNull, "grad_y|gradY"},
    {"NullX", [](GradCase& c) { c.x = Tensor(); }, kNull, "x"},
    {"NullGradX", [](GradCase& c) { c.grad_x = Tensor(); }, kNull, "grad_x|gradXOut"},
    {"GradYDtypeNotX", [](GradCase& c) { c.grad_y = Tensor({3, 4}, ACL_FLOAT16); }, kInv, "grad_y|gradY"},
    {"XInt32", [](GradCase& c) { c.x = Tensor({3, 8}, ACL_INT32); c.grad_y = Tensor({3, 4}, ACL_INT32); }, kInv, "x"},
    {"GradXDtypeNotX", [](GradCase& c) { c.grad_x = Tensor({3, 8}, ACL_BF16); }, kInv, "grad_x|gradXOut"},
    {"GroupIndexInt32", [](GradCase& c) { c.group_index = Tensor({2}, ACL_INT32); }, kInv, "group_index|groupIndex"},
    {"GradYStrided", [](GradCase& c) { c.grad_y = Tensor::strided({3, 4}, ACL_FLOAT); }, kInv, "grad_y|gradY"},
    {"GradYFormatNZ", [](GradCase& c) { c.grad_y = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 4}, ACL_FLOAT); }, kInv, "grad_y|gradY"},
    {"GradXStrided", [](GradCase& c) { c.grad_x = Tensor::strided({3, 8}, ACL_FLOAT); }, kInv, "grad_x|gradXOut"},
    {"GradXFormatNZ", [](GradCase& c) { c.grad_x = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 8}, ACL_FLOAT); }, kInv, "grad_x|gradXOut"},
    {"DimOutOfRange", [](GradCase& c) { c.attr.dim = 5; }, kInv, "dim"},
    {"ClampModeThree", [](GradCase& c) { c.attr.mode = 3; }, kInv, "clamp_mode|clampMode"},
    {"Mode1AlphaNotDefault", [](GradCase& c) { c.attr.mode = 1; c.attr.alpha = 2.0; }, kInv, "alpha"},
    {"XRank9", [](GradCase& c) {
       c.x = Tensor({1, 1, 1, 1, 1, 1, 1, 1, 2}, ACL_FLOAT);
       c.grad_y = Tensor({1, 1, 1, 1, 1, 1, 1, 1, 1}, ACL_FLOAT);
       c.grad_x = Tensor({1, 1, 1, 1, 1, 1, 1, 1, 2}, ACL_FLOAT);
     }, kInv, "x", {"rank"}},
    {"LimitZero", [](GradCase& c) { c.attr.limit = 0.0; }, kTiling, "limit"},
    {"LimitNaN", [](GradCase& c) { c.attr.limit = std::nan(""); }, kTiling, "limit"},
    {"AlphaNaN", [](GradCase& c) { c.attr.alpha = std::nan(""); }, kTiling, "alpha"},
    {"BiasMinusInf", [](GradCase& c) { c.attr.bias = -INFINITY; }, kTiling, "bias"},
    {"SplitDimOdd", [](GradCase& c) {
       c.x = Tensor({3, 7}, ACL_FLOAT); c.grad_x = Tensor({3, 7}, ACL_FLOAT); c.grad_y = Tensor({3, 3}, ACL_FLOAT);
     }, kTiling, "x"},
    {"GradYShapeNotHalved", [](GradCase& c) { c.grad_y = Tensor({3, 5}, ACL_FLOAT); }, kTiling, "grad_y|gradY", {"5"}},
    {"GradYRankNotX", [](GradCase& c) { c.grad_y = Tensor({1, 3, 4}, ACL_FLOAT); }, kTiling, "grad_y|gradY"},
    {"GradYLeadingDiffers", [](GradCase& c) { c.grad_y = Tensor({2, 4}, ACL_FLOAT); }, kTiling, "grad_y|gradY"},
    {"GradXShapeNotX", [](GradCase& c) { c.grad_x = Tensor({3, 4}, ACL_FLOAT); }, kTiling, "grad_x|gradXOut"},
    {"GroupIndexRank2", [](GradCase& c) { c.group_index = Tensor::from_i64({2, 1}, {1, 1}); }, kTiling, "group_index|groupIndex"},
};

class ClippedGradRules : public testing::TestWithParam<RG> {};
TEST_P(ClippedGradRules, Rejected) {
  GradCase c;
  GetParam().mutate(c);
  expect_rejected(c, GetParam().code, GetParam().arg, GetParam().words);
}
INSTANTIATE_TEST_SUITE_P(ClippedSwigluGrad, ClippedGradRules, testing::ValuesIn(kGradRules),
                         rule_name<GradCase>);

TEST(ClippedSwiglu, BaselinesOfRuleTablesAreValid) {
  SCOPED_TRACE(seed_trace());
  FwdCase f;
  ASSERT_TRUE(run_ok(f));
  f.check("forward baseline");
  GradCase g;
  ASSERT_TRUE(run_ok(g));
  g.check("backward baseline");
  f.v2 = g.v2 = false;  // the vendor V1 forward and Grad (clamp mode 0)
  ASSERT_TRUE(run_ok(f));
  f.check("forward V1");
  ASSERT_TRUE(run_ok(g));
  g.check("backward V1");
}

// ---------------------------------------------------------------------------------------------
// docs/operators.md §9.7
// ---------------------------------------------------------------------------------------------
TEST(ClippedSwiglu, WorkedExample) {
  for (aclDataType dt : {ACL_FLOAT, ACL_BF16, ACL_FLOAT16}) {
    SCOPED_TRACE(dt_name(dt));
    FwdCase f({1, 4}, dt);
    f.v2 = false;
    f.group_index = Tensor();
    f.x.set({0.5, -1.0, 8.0, 2.0});
    ASSERT_TRUE(run_ok(f));
    expect_listed(f.y, {0.0, 20.999859}, 5, "y");
    EXPECT_EQ(f.y.get(0), 0.0);  // B' + bias = 0 exactly
    GradCase g({1, 4}, dt);
    g.v2 = false;
    g.group_index = Tensor();
    g.x.set({0.5, -1.0, 8.0, 2.0});
    g.grad_y.set({1.0, 1.0});
    ASSERT_TRUE(run_ok(g));
    expect_listed(g.grad_x, {0.0, 0.350388, 0.0, 6.999953}, 5, "grad_x");
    EXPECT_EQ(g.grad_x.get(0), 0.0);
    EXPECT_EQ(g.grad_x.get(2), 0.0);  // A = 8 > 7: masked
  }
}

// ---------------------------------------------------------------------------------------------
// Values against the float64 reference
// ---------------------------------------------------------------------------------------------
struct Config {
  const char* name;
  std::vector<int64_t> shape;
  int64_t dim;
  bool interleaved;
  int mode;
  std::vector<int64_t> group_index;
  bool use_gi;
  double alpha = 1.702, limit = 7.0, bias = 1.0;
};

void PrintTo(const Config& c, std::ostream* os) { *os << c.name; }

const std::vector<Config> kConfigs = {
    {"inter_last", {6, 64}, -1, true, 0, {}, false},
    {"split_last", {6, 64}, -1, false, 0, {}, false},
    {"inter_odd_h", {5, 2 * 257}, -1, true, 0, {}, false},
    {"split_odd_h", {5, 2 * 257}, -1, false, 0, {}, false},
    {"inter_h1", {4, 2}, -1, true, 0, {}, false},
    {"rank1", {2 * 37}, 0, true, 0, {}, false},
    {"dim0_inter", {6, 5, 3}, 0, true, 0, {}, false},
    {"dim0_split", {6, 5, 3}, 0, false, 0, {}, false},
    {"dim1_inter", {3, 4, 5}, 1, true, 0, {}, false},
    {"dim1_split", {3, 4, 5}, -2, false, 0, {}, false},
    {"mode1_inter", {4, 96}, -1, true, 1, {}, false},
    {"mode1_split_dim0", {4, 3, 10}, 0, false, 1, {}, false},
    {"attrs", {4, 48}, -1, true, 0, {}, false, -0.75, 2.5, -0.5},
    {"group_truncates", {7, 40}, -1, true, 0, {2, 0, 3}, true},
    {"group_negative_sum", {3, 16}, -1, false, 1, {1, -3}, true},
    {"group_above_rows", {3, 16}, -1, true, 0, {6, 9}, true},
    {"group_empty", {3, 16}, -1, true, 0, {}, true},
    {"group_dim1", {4, 6, 2}, 1, true, 0, {3}, true},
    {"long_row_blocks", {2 * 5000 + 2 * 37}, -1, true, 0, {}, false},
    {"long_row_split_blocks", {3, 2 * 4133}, -1, false, 1, {2}, true},
};

class ClippedValues : public testing::TestWithParam<std::tuple<aclDataType, Config>> {};

TEST_P(ClippedValues, ForwardAndBackwardMatchFloat64Reference) {
  SCOPED_TRACE(seed_trace());
  const auto [dt, cfg] = GetParam();
  const uint32_t salt = static_cast<uint32_t>(cfg.shape.size() * 31 + cfg.dim + 7 * cfg.mode);
  auto setup = [&](ClippedBase& c) {
    c.attr.interleaved = cfg.interleaved;
    c.attr.mode = cfg.mode;
    c.attr.alpha = cfg.alpha;
    c.attr.limit = cfg.limit;
    c.attr.bias = cfg.bias;
    c.group_index = cfg.use_gi ? Tensor::from_i64({static_cast<int64_t>(cfg.group_index.size())},
                                                  cfg.group_index)
                               : Tensor();
  };
  FwdCase f(cfg.shape, dt, salt, cfg.dim);
  setup(f);
  ASSERT_TRUE(run_ok(f));
  f.check(cfg.name);
  GradCase g(cfg.shape, dt, salt + 1, cfg.dim);
  setup(g);
  ASSERT_TRUE(run_ok(g));
  g.check(cfg.name);
}

INSTANTIATE_TEST_SUITE_P(
    ClippedSwiglu, ClippedValues,
    testing::Combine(testing::Values(ACL_FLOAT, ACL_FLOAT16, ACL_BF16), testing::ValuesIn(kConfigs)),
    [](const testing::TestParamInfo<std::tuple<aclDataType, Config>>& info) {
      return std::string(dt_name(std::get<0>(info.param))) + "_" + std::get<1>(info.param).name;
    });

// Rows past sum(group_index) are +0.0 (not -0.0, not poison) in y and grad_x.
TEST(ClippedSwiglu, RowsPastGroupTotalArePositiveZero) {
  FwdCase f({5, 8});
  f.group_index = Tensor::from_i64({1}, {2});
  ASSERT_TRUE(run_ok(f));
  GradCase g({5, 8});
  g.group_index = Tensor::from_i64({1}, {2});
  ASSERT_TRUE(run_ok(g));
  for (int64_t i = 2 * 4; i < 5 * 4; ++i) {
    EXPECT_EQ(f.y.get(i), 0.0);
    EXPECT_FALSE(std::signbit(f.y.get(i))) << i;
  }
  for (int64_t i = 2 * 8; i < 5 * 8; ++i) {
    EXPECT_EQ(g.grad_x.get(i), 0.0);
    EXPECT_FALSE(std::signbit(g.grad_x.get(i))) << i;
  }
}

// Empty tensors are valid (D4, D32): zero rows, a zero split dim, a zero dim after it.
TEST(ClippedSwiglu, EmptyTensors) {
  for (const auto& [shape, dim] : std::vector<std::pair<std::vector<int64_t>, int64_t>>{
           {{0, 8}, -1}, {{3, 0}, -1}, {{4, 0}, 0}, {{2, 4, 0}, 1}, {{0}, 0}}) {
    FwdCase f(shape, ACL_FLOAT, 5, dim);
    ASSERT_TRUE(run_ok(f));
    EXPECT_EQ(f.y.numel(), 0);
    GradCase g(shape, ACL_BF16, 6, dim);
    ASSERT_TRUE(run_ok(g));
    EXPECT_EQ(g.grad_x.numel(), 0);
  }
}

// At exactly +-limit the masks are inclusive here (§9.5, D32), strict in swiglu_group (D11).
TEST(ClippedSwiglu, MasksAtLimitInclusiveWhileSwigluGroupIsStrict) {
  const double L = 2.0;
  // Interleaved pairs (A, B): A = L, B = L, B = -L, and A just above / B just outside.
  const std::vector<double> xv = {L, 0.5, 0.5, L, 0.5, -L, 2.5, 0.5, 0.5, 2.5};
  GradCase g({1, 10});
  g.attr.limit = L;
  g.group_index = Tensor();
  g.x.set(xv);
  g.grad_y.set({1.0, 1.0, 1.0, 1.0, 1.0});
  ASSERT_TRUE(run_ok(g));
  EXPECT_NE(g.grad_x.get(0), 0.0);  // A == limit: kept
  EXPECT_NE(g.grad_x.get(3), 0.0);  // B == limit: kept
  EXPECT_NE(g.grad_x.get(5), 0.0);  // B == -limit: kept
  EXPECT_EQ(g.grad_x.get(6), 0.0);  // A > limit
  EXPECT_EQ(g.grad_x.get(9), 0.0);  // B > limit
  g.check("inclusive masks");

  // swiglu_group with clamp_limit L on the same gate/up values (split layout x0 | x1): strict.
  Tensor x = Tensor::from({1, 10}, ACL_FLOAT, {L, 0.5, 0.5, 2.5, 0.5, 0.5, L, -L, 0.5, 2.5});
  Tensor gy = Tensor::from({1, 5}, ACL_FLOAT, {1.0, 1.0, 1.0, 1.0, 1.0});
  Tensor gx({1, 10}, ACL_FLOAT);
  uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(aclnnSwigluGroupQuantGradGetWorkspaceSize(gy.handle(), x.handle(), nullptr, nullptr,
                                                      nullptr, L, gx.handle(), nullptr, &ws, &ex),
            ACLNN_SUCCESS)
      << aclGetRecentErrMsg();
  ASSERT_EQ(aclnnSwigluGroupQuantGrad(nullptr, 0, ex, nullptr), ACLNN_SUCCESS);
  EXPECT_EQ(gx.get(0), 0.0);  // gate == limit: masked (strict)
  EXPECT_EQ(gx.get(6), 0.0);  // up == limit: masked
  EXPECT_EQ(gx.get(7), 0.0);  // up == -limit: masked
  EXPECT_NE(gx.get(5), 0.0);  // |up| < limit: kept

  // clamp_mode 1: the gate mask is on A sigmoid(A) <= limit, inclusive as well.
  GradCase m({1, 4});
  m.attr.mode = 1;
  m.group_index = Tensor();
  m.x.set({30.0, 0.5, 1.0, 0.5});  // 30 sigmoid(30) = 30 > 7: masked; 1 sigmoid(1) < 7: kept
  m.grad_y.set({1.0, -1.5});
  ASSERT_TRUE(run_ok(m));
  EXPECT_EQ(m.grad_x.get(0), 0.0);
  EXPECT_NE(m.grad_x.get(2), 0.0);
  m.check("mode 1 masks");
}

// D16: bitwise the same with 1 and 2 threads (several units per row and rows past the total).
TEST(ClippedSwiglu, DeterministicAcrossThreads) {
  FwdCase one({64, 2 * 4500}, ACL_BF16, 71), two({64, 2 * 4500}, ACL_BF16, 71);
  one.group_index = Tensor::from_i64({1}, {50});
  two.group_index = Tensor::from_i64({1}, {50});
  expect_deterministic_across_threads(one, two);
  GradCase a({64, 2 * 300}, ACL_FLOAT, 72), b({64, 2 * 300}, ACL_FLOAT, 72);
  a.attr.mode = b.attr.mode = 1;
  expect_deterministic_across_threads(a, b);
}

// Outputs of 8 MiB and more go out with non-temporal stores: the same values.
TEST(ClippedSwiglu, LargeOutputsStreamed) {
  SCOPED_TRACE(seed_trace());
  for (aclDataType dt : {ACL_FLOAT, ACL_BF16}) {
    for (bool inter : {true, false}) {
      SCOPED_TRACE(std::string(dt_name(dt)) + (inter ? " interleaved" : " split"));
      FwdCase f({1024, 2 * 4096}, dt, 81);
      f.attr.interleaved = inter;
      f.group_index = Tensor::from_i64({1}, {1000});
      ASSERT_TRUE(run_ok(f));
      f.check("large forward");
      GradCase g({512, 2 * 4096}, dt, 82);
      g.attr.interleaved = inter;
      g.group_index = Tensor();
      ASSERT_TRUE(run_ok(g));
      g.check("large backward");
    }
  }
}

// Every SIMD target the CPU supports: SSE4 and AVX2 split, merge and narrow the halves with other
// instructions than AVX-512 (and SSE4 converts fp16 in scalar code); the large cases take the
// non-temporal stores (the whole-vector interleave of fp32 pairs).
TEST(ClippedSwiglu, EverySimdTarget) {
  SCOPED_TRACE(seed_trace());
  moegrad_test::for_each_target([&](int64_t) {
    for (aclDataType dt : {ACL_FLOAT, ACL_FLOAT16, ACL_BF16}) {
      for (bool inter : {true, false}) {
        for (int mode : {0, 1}) {
          SCOPED_TRACE(std::string(dt_name(dt)) + (inter ? " interleaved" : " split") +
                       " mode " + std::to_string(mode));
          FwdCase f({5, 2 * 203}, dt, 61);
          GradCase g({5, 2 * 203}, dt, 62);
          for (ClippedBase* c : {static_cast<ClippedBase*>(&f), static_cast<ClippedBase*>(&g)}) {
            c->attr.interleaved = inter;
            c->attr.mode = mode;
            c->group_index = Tensor::from_i64({1}, {4});
          }
          ASSERT_TRUE(run_ok(f));
          f.check("forward");
          ASSERT_TRUE(run_ok(g));
          g.check("backward");
        }
      }
    }
    FwdCase f({512, 2 * 4096}, ACL_FLOAT, 63);
    f.group_index = Tensor();
    ASSERT_TRUE(run_ok(f));
    f.check("large forward");
    GradCase g({256, 2 * 4096}, ACL_FLOAT, 64);
    g.group_index = Tensor();
    ASSERT_TRUE(run_ok(g));
    g.check("large backward");
  });
}

TEST(ClippedSwiglu, WorkspaceSizeIdempotent) {
  FwdCase f;
  expect_workspace_idempotent(f);
  GradCase g;
  expect_workspace_idempotent(g);
}

}  // namespace
