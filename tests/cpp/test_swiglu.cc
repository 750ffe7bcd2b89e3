// aclnnSwigluGroupQuantGrad (operators.md §5.6, decisions D4, D9, D11, D18, D19; docs L7, L8)
// and the aclnnSwigluGroup forward (docs/decisions.md L9) through the C API: dtypes/layout
// 161002, shapes and attributes 561002, and values against the float64 reference (§5.5).
#include "reference.h"
#include "test_util.h"

using namespace mgt;

namespace {

constexpr aclnnStatus kNull = ACLNN_ERR_PARAM_NULLPTR;
constexpr aclnnStatus kInv = ACLNN_ERR_PARAM_INVALID;
constexpr aclnnStatus kTiling = ACLNN_ERR_INNER_TILING_ERROR;

// ---------------------------------------------------------------------------------------------
// SwigluGroupQuantGrad
// ---------------------------------------------------------------------------------------------
struct SwigluGradCase : OpCase {
  Tensor grad_y, x, weight, y_origin, group_index, grad_x, grad_weight;
  double clamp_limit = -1.0;
  std::vector<int64_t> lead;  // leading dims of x (T = product)
  int64_t H;

  // A valid call: x [3, 8], grad_y [3, 4], weight [3], y_origin [3, 4], group_index [2].
  SwigluGradCase(std::vector<int64_t> lead_dims = {3}, int64_t h = 4, aclDataType dt = ACL_FLOAT,
                 uint32_t salt = 21)
      : lead(std::move(lead_dims)), H(h) {
    Rng rng(salt);
    const int64_t T = numel_of(lead);
    std::vector<int64_t> xs = lead, gs = lead;
    xs.push_back(2 * H);
    gs.push_back(H);
    x = Tensor::from(xs, dt, rng.uniform_vec(T * 2 * H, -4, 4));
    std::vector<double> gy(T * H);
    for (auto& v : gy) v = rng.signed_uniform(0.05, 2.0);
    grad_y = Tensor::from(gs, dt, gy);
    weight = Tensor::from(lead, ACL_FLOAT, rng.uniform_vec(T, 0.1, 1.5));
    y_origin = Tensor::from(gs, dt, rng.uniform_vec(T * H, -2, 2));
    group_index = Tensor::from_i64({2}, {1, T});  // sum > T: clipped to T (§5.7)
    grad_x = Tensor(xs, dt);
    grad_weight = Tensor(lead, ACL_FLOAT);
  }
  int64_t T() const { return numel_of(lead); }
  aclnnStatus stage1(uint64_t* ws, aclOpExecutor** ex) override {
    return aclnnSwigluGroupQuantGradGetWorkspaceSize(
        grad_y.handle(), x.handle(), weight.handle(), y_origin.handle(), group_index.handle(),
        clamp_limit, grad_x.handle(), grad_weight.handle(), ws, ex);
  }
  aclnnStatus stage2(void* ws, uint64_t size, aclOpExecutor* ex) override {
    return aclnnSwigluGroupQuantGrad(ws, size, ex, nullptr);
  }
  std::vector<Tensor*> outputs() override { return {&grad_x, &grad_weight}; }

  void check_against_reference(const std::string& what) {
    std::vector<double> w = weight.is_null() ? std::vector<double>() : weight.values();
    std::vector<double> yo = y_origin.is_null() ? std::vector<double>() : y_origin.values();
    std::vector<int64_t> gi;
    for (int64_t i = 0; !group_index.is_null() && i < group_index.numel(); ++i) {
      gi.push_back(static_cast<int64_t>(group_index.get(i)));
    }
    ref::SwigluGrad r = ref::swiglu_grad(grad_y.values(), x.values(), weight.is_null() ? nullptr : &w,
                                         yo.empty() ? nullptr : &yo,
                                         group_index.is_null() ? nullptr : &gi,
                                         static_cast<float>(clamp_limit), T(), H);
    expect_close(grad_x, r.grad_x, what + " grad_x", r.grad_x_scale, 2.0);
    if (!weight.is_null() && !grad_weight.is_null()) {
      expect_close(grad_weight, r.grad_weight, what + " grad_weight", r.grad_weight_scale,
                   static_cast<double>(H));
    }
  }
};

using RG = Rule<SwigluGradCase>;

const std::vector<RG> kGradRules = {
    // null pointers: 161001
    {"NullGradY", [](SwigluGradCase& c) { c.grad_y = Tensor(); }, kNull, "grad_y|gradY"},
    {"NullX", [](SwigluGradCase& c) { c.x = Tensor(); }, kNull, "x"},
    {"NullGradX", [](SwigluGradCase& c) { c.grad_x = Tensor(); }, kNull, "grad_x|gradXOut"},
    {"NullDataX", [](SwigluGradCase& c) { c.x = Tensor::null_data({3, 8}, ACL_FLOAT); }, kNull, "x"},
    {"NullWorkspaceSize", [](SwigluGradCase& c) { c.null_workspace_size = true; }, kNull, "workspaceSize"},
    {"NullExecutor", [](SwigluGradCase& c) { c.null_executor = true; }, kNull, "executor"},
    // dtypes: 161002
    {"GradYInt32", [](SwigluGradCase& c) { c.grad_y = Tensor({3, 4}, ACL_INT32); }, kInv, "grad_y|gradY"},
    {"XInt32", [](SwigluGradCase& c) { c.x = Tensor({3, 8}, ACL_INT32); }, kInv, "x"},
    {"XDouble", [](SwigluGradCase& c) { c.x = Tensor({3, 8}, ACL_DOUBLE); }, kInv, "x"},
    {"GradYDtypeNotX", [](SwigluGradCase& c) { c.grad_y = Tensor({3, 4}, ACL_FLOAT16); }, kInv, "grad_y|gradY"},
    {"WeightFp16", [](SwigluGradCase& c) { c.weight = Tensor({3}, ACL_FLOAT16); }, kInv, "weight"},
    {"YOriginDtypeNotX", [](SwigluGradCase& c) { c.y_origin = Tensor({3, 4}, ACL_BF16); }, kInv, "y_origin|yOrigin"},
    {"GroupIndexInt32", [](SwigluGradCase& c) { c.group_index = Tensor({2}, ACL_INT32); }, kInv, "group_index|groupIndex"},
    {"GradXDtypeNotX", [](SwigluGradCase& c) { c.grad_x = Tensor({3, 8}, ACL_FLOAT16); }, kInv, "grad_x|gradXOut"},
    {"GradWeightFp16", [](SwigluGradCase& c) { c.grad_weight = Tensor({3}, ACL_FLOAT16); }, kInv, "grad_weight|gradWeightOut"},
    // clamp_limit: -1 or > 0 (D11): 561002
    {"ClampZero", [](SwigluGradCase& c) { c.clamp_limit = 0.0; }, kTiling, "clamp_limit|clampLimit"},
    {"ClampMinusHalf", [](SwigluGradCase& c) { c.clamp_limit = -0.5; }, kTiling, "clamp_limit|clampLimit"},
    // The value as given, not at the stream's 6 digits ("-1", L154).
    {"ClampNearMinus1", [](SwigluGradCase& c) { c.clamp_limit = -0.9999999; }, kTiling, "clamp_limit|clampLimit", {"got -0.9999999"}},
    {"ClampMinus2", [](SwigluGradCase& c) { c.clamp_limit = -2.0; }, kTiling, "clamp_limit|clampLimit"},
    {"ClampNaN", [](SwigluGradCase& c) { c.clamp_limit = std::nan(""); }, kTiling, "clamp_limit|clampLimit"},
    {"ClampMinusInf", [](SwigluGradCase& c) { c.clamp_limit = -INFINITY; }, kTiling, "clamp_limit|clampLimit"},
    // shapes: 561002
    {"XRank0", [](SwigluGradCase& c) { c.x = Tensor({}, ACL_FLOAT); c.grad_y = Tensor({}, ACL_FLOAT); c.weight = Tensor(); c.y_origin = Tensor(); }, kTiling, "x|grad_y"},
    {"GradYRankNotX", [](SwigluGradCase& c) { c.grad_y = Tensor({1, 3, 4}, ACL_FLOAT); }, kTiling, "grad_y|gradY"},
    {"LeadingDimsDiffer", [](SwigluGradCase& c) { c.grad_y = Tensor({2, 4}, ACL_FLOAT); }, kTiling, "grad_y|gradY"},
    {"LeadingDimsDiffer3D", [](SwigluGradCase& c) {
       c.x = Tensor({2, 3, 8}, ACL_FLOAT); c.grad_x = Tensor({2, 3, 8}, ACL_FLOAT);
       c.grad_y = Tensor({3, 2, 4}, ACL_FLOAT); c.weight = Tensor(); c.y_origin = Tensor(); c.grad_weight = Tensor();
     }, kTiling, "grad_y|gradY"},
    {"XLastDimOdd", [](SwigluGradCase& c) { c.x = Tensor({3, 7}, ACL_FLOAT); c.grad_x = Tensor({3, 7}, ACL_FLOAT); c.grad_y = Tensor({3, 3}, ACL_FLOAT); c.y_origin = Tensor({3, 3}, ACL_FLOAT); }, kTiling, "x", {"7"}},
    {"HiddenZero", [](SwigluGradCase& c) {
       c.x = Tensor({3, 0}, ACL_FLOAT); c.grad_x = Tensor({3, 0}, ACL_FLOAT); c.grad_y = Tensor({3, 0}, ACL_FLOAT);
       c.y_origin = Tensor({3, 0}, ACL_FLOAT);
     }, kTiling, "x"},
    {"GradYLastDimNotHalf", [](SwigluGradCase& c) { c.grad_y = Tensor({3, 5}, ACL_FLOAT); }, kTiling, "grad_y|gradY", {"5"}},
    {"WeightNumelNotT", [](SwigluGradCase& c) { c.weight = Tensor({4}, ACL_FLOAT); }, kTiling, "weight", {"4"}},
    {"WeightNumelNotT2D", [](SwigluGradCase& c) { c.weight = Tensor({3, 2}, ACL_FLOAT); }, kTiling, "weight"},
    {"YOriginShapeNotGradY", [](SwigluGradCase& c) { c.y_origin = Tensor({3, 5}, ACL_FLOAT); }, kTiling, "y_origin|yOrigin"},
    {"YOriginRankNotGradY", [](SwigluGradCase& c) { c.y_origin = Tensor({12}, ACL_FLOAT); }, kTiling, "y_origin|yOrigin"},
    {"WeightWithoutYOrigin", [](SwigluGradCase& c) { c.y_origin = Tensor(); }, kTiling, "y_origin|yOrigin"},
    {"GroupIndexRank2", [](SwigluGradCase& c) { c.group_index = Tensor::from_i64({1, 2}, {1, 2}); }, kTiling, "group_index|groupIndex"},
    {"GroupIndexRank0", [](SwigluGradCase& c) { c.group_index = Tensor::from_i64({}, {3}); }, kTiling, "group_index|groupIndex"},
    {"GradXShapeNotX", [](SwigluGradCase& c) { c.grad_x = Tensor({3, 6}, ACL_FLOAT); }, kTiling, "grad_x|gradXOut"},
    {"GradXRankNotX", [](SwigluGradCase& c) { c.grad_x = Tensor({3, 8, 1}, ACL_FLOAT); }, kTiling, "grad_x|gradXOut"},
    {"GradWeightShapeNotWeight", [](SwigluGradCase& c) { c.grad_weight = Tensor({4}, ACL_FLOAT); }, kTiling, "grad_weight|gradWeightOut"},
    {"GradWeightRankNotWeight", [](SwigluGradCase& c) { c.grad_weight = Tensor({3, 1}, ACL_FLOAT); }, kTiling, "grad_weight|gradWeightOut"},
    // layouts: 161002 (D19)
    {"GradYStrided", [](SwigluGradCase& c) { c.grad_y = Tensor::strided({3, 4}, ACL_FLOAT); }, kInv, "grad_y|gradY"},
    {"GradYFormatNZ", [](SwigluGradCase& c) { c.grad_y = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 4}, ACL_FLOAT); }, kInv, "grad_y|gradY"},
    {"XStrided", [](SwigluGradCase& c) { c.x = Tensor::strided({3, 8}, ACL_FLOAT); }, kInv, "x"},
    {"XFormatNZ", [](SwigluGradCase& c) { c.x = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 8}, ACL_FLOAT); }, kInv, "x"},
    {"WeightStrided", [](SwigluGradCase& c) { c.weight = Tensor::strided({3}, ACL_FLOAT); }, kInv, "weight"},
    {"WeightFormatNZ", [](SwigluGradCase& c) { c.weight = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3}, ACL_FLOAT); }, kInv, "weight"},
    {"YOriginStrided", [](SwigluGradCase& c) { c.y_origin = Tensor::strided({3, 4}, ACL_FLOAT); }, kInv, "y_origin|yOrigin"},
    {"YOriginFormatNZ", [](SwigluGradCase& c) { c.y_origin = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 4}, ACL_FLOAT); }, kInv, "y_origin|yOrigin"},
    {"GroupIndexStrided", [](SwigluGradCase& c) { c.group_index = Tensor::strided({2}, ACL_INT64); }, kInv, "group_index|groupIndex"},
    {"GroupIndexFormatNZ", [](SwigluGradCase& c) { c.group_index = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {2}, ACL_INT64); }, kInv, "group_index|groupIndex"},
    {"GradXStrided", [](SwigluGradCase& c) { c.grad_x = Tensor::strided({3, 8}, ACL_FLOAT); }, kInv, "grad_x|gradXOut"},
    {"GradXFormatNZ", [](SwigluGradCase& c) { c.grad_x = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 8}, ACL_FLOAT); }, kInv, "grad_x|gradXOut"},
    {"GradWeightStrided", [](SwigluGradCase& c) { c.grad_weight = Tensor::strided({3}, ACL_FLOAT); }, kInv, "grad_weight|gradWeightOut"},
    {"GradWeightFormatNZ", [](SwigluGradCase& c) { c.grad_weight = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3}, ACL_FLOAT); }, kInv, "grad_weight|gradWeightOut"},
};

class SwigluGradRules : public testing::TestWithParam<RG> {};

TEST_P(SwigluGradRules, Rejected) {
  SwigluGradCase c;
  GetParam().mutate(c);
  expect_rejected(c, GetParam().code, GetParam().arg, GetParam().words);
}

INSTANTIATE_TEST_SUITE_P(SwigluGroupQuantGrad, SwigluGradRules, testing::ValuesIn(kGradRules),
                         rule_name<SwigluGradCase>);

TEST(SwigluGroupQuantGrad, BaselineOfRuleTableIsValid) {
  SCOPED_TRACE(seed_trace());
  SwigluGradCase c;
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference("baseline");
}

// Accepted boundary values and optional combinations (D9, D11, L7).
TEST(SwigluGroupQuantGrad, AcceptedVariants) {
  SCOPED_TRACE(seed_trace());
  {  // weight [T, 1] and [1, T] (any shape with T elements, D9)
    SwigluGradCase c;
    c.weight = Tensor::from({3, 1}, ACL_FLOAT, {0.5, 1.5, -0.25});
    c.grad_weight = Tensor({3, 1}, ACL_FLOAT);
    ASSERT_TRUE(run_ok(c));
    c.check_against_reference("weight [T,1]");
    c.weight = Tensor::from({1, 3}, ACL_FLOAT, {0.5, 1.5, -0.25});
    c.grad_weight = Tensor({1, 3}, ACL_FLOAT);
    ASSERT_TRUE(run_ok(c));
    c.check_against_reference("weight [1,T]");
  }
  {  // grad_weight output null with a weight: not computed (L7), grad_x unchanged
    SwigluGradCase a, b;
    b.grad_weight = Tensor();
    ASSERT_TRUE(run_ok(a));
    ASSERT_TRUE(run_ok(b));
    expect_bitwise_equal(a.grad_x, b.grad_x, "grad_x with and without grad_weight");
  }
  {  // no weight, no y_origin, no group_index
    SwigluGradCase c;
    c.weight = Tensor();
    c.y_origin = Tensor();
    c.group_index = Tensor();
    c.grad_weight = Tensor();
    ASSERT_TRUE(run_ok(c));
    c.check_against_reference("bare");
  }
  {  // a tiny positive clamp and +inf are > 0
    SwigluGradCase c;
    c.clamp_limit = 1e-3;
    ASSERT_TRUE(run_ok(c));
    c.check_against_reference("clamp 1e-3");
    c.clamp_limit = INFINITY;
    ASSERT_TRUE(run_ok(c));
    c.check_against_reference("clamp +inf");
  }
}

struct SwConfig {
  const char* name;
  std::vector<int64_t> lead;
  int64_t H;
  double clamp;
  bool weight;
  std::vector<int64_t> group_index;  // empty and !use_gi: none
  bool use_gi;
};

class SwigluGradValues : public testing::TestWithParam<std::tuple<aclDataType, SwConfig>> {};

TEST_P(SwigluGradValues, MatchesFloat64Reference) {
  SCOPED_TRACE(seed_trace());
  const auto [dt, f] = GetParam();
  SwigluGradCase c(f.lead, f.H, dt, static_cast<uint32_t>(f.H + 7 * f.lead.size()));
  c.clamp_limit = f.clamp;
  if (!f.weight) {
    c.weight = Tensor();
    c.y_origin = Tensor();
    c.grad_weight = Tensor();
  }
  if (f.use_gi) {
    c.group_index = Tensor::from_i64({static_cast<int64_t>(f.group_index.size())}, f.group_index);
  } else {
    c.group_index = Tensor();
  }
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference(f.name);
}

INSTANTIATE_TEST_SUITE_P(
    SwigluGroupQuantGrad, SwigluGradValues,
    testing::Combine(
        testing::Values(ACL_FLOAT, ACL_FLOAT16, ACL_BF16),
        testing::Values(
            SwConfig{"plain", {5}, 16, -1.0, false, {}, false},
            SwConfig{"weight", {6}, 8, -1.0, true, {}, false},
            SwConfig{"clamp", {4}, 32, 1.5, true, {}, false},
            SwConfig{"group_truncates", {7}, 8, -1.0, true, {2, 0, 3}, true},
            SwConfig{"group_clips", {4}, 8, 2.0, true, {3, 9}, true},
            SwConfig{"group_empty", {3}, 8, -1.0, true, {}, true},
            SwConfig{"rank3", {2, 3}, 12, 0.7, true, {4}, true},
            SwConfig{"odd_hidden_257", {2}, 257, -1.0, true, {}, false},
            SwConfig{"one_token", {1}, 1, -1.0, true, {}, false})),
    [](const testing::TestParamInfo<std::tuple<aclDataType, SwConfig>>& info) {
      return std::string(dt_name(std::get<0>(info.param))) + "_" + std::get<1>(info.param).name;
    });

// At exactly the clamp limit the gradient is masked (strict inequalities, D11): hand values.
TEST(SwigluGroupQuantGrad, ClampBoundaryMasked) {
  SwigluGradCase c({1}, 4);
  c.weight = Tensor();
  c.y_origin = Tensor();
  c.group_index = Tensor();
  c.grad_weight = Tensor();
  c.clamp_limit = 1.0;
  // x0 = [1, 0.5, 2, -3], x1 = [0.5, 1, -1, 2]
  c.x.set({1.0, 0.5, 2.0, -3.0, 0.5, 1.0, -1.0, 2.0});
  c.grad_y.set({1.0, 1.0, 1.0, 1.0});
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(c.grad_x.get(0), 0.0);  // x0 == c
  EXPECT_NE(c.grad_x.get(1), 0.0);  // x0 < c
  EXPECT_EQ(c.grad_x.get(2), 0.0);  // x0 > c
  EXPECT_NE(c.grad_x.get(3), 0.0);  // x0 < c
  EXPECT_NE(c.grad_x.get(4), 0.0);  // |x1| < c
  EXPECT_EQ(c.grad_x.get(5), 0.0);  // x1 == c
  EXPECT_EQ(c.grad_x.get(6), 0.0);  // x1 == -c
  EXPECT_EQ(c.grad_x.get(7), 0.0);  // x1 > c
  c.check_against_reference("clamp boundary");
}

// L8: trunc = clamp(sum(group_index), 0, T), summed in int64; negative entries are not rejected.
TEST(SwigluGroupQuantGrad, L8NegativeGroupCounts) {
  SCOPED_TRACE(seed_trace());
  {  // total negative: no row is processed
    SwigluGradCase c({4}, 8);
    c.group_index = Tensor::from_i64({2}, {1, -3});
    ASSERT_TRUE(run_ok(c));
    c.check_against_reference("sum -2");
  }
  {  // a prefix above T followed by a negative count: trunc = 6 - 4 = 2 of T = 4
    SwigluGradCase c({4}, 8);
    c.group_index = Tensor::from_i64({2}, {6, -4});
    ASSERT_TRUE(run_ok(c));
    c.check_against_reference("sum 2 with a prefix above T");
  }
}

// D4: zero tokens.
TEST(SwigluGroupQuantGrad, ZeroTokens) {
  SwigluGradCase c({0}, 8);
  c.group_index = Tensor();
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(c.grad_x.numel(), 0);
  SwigluGradCase d({0, 5}, 4);
  ASSERT_TRUE(run_ok(d));
}

// ---------------------------------------------------------------------------------------------
// SwigluGroup forward (L9)
// ---------------------------------------------------------------------------------------------
struct SwigluFwdCase : OpCase {
  Tensor x, weight, group_index, y;
  double clamp_limit = -1.0;
  std::vector<int64_t> lead;
  int64_t H;

  SwigluFwdCase(std::vector<int64_t> lead_dims = {3}, int64_t h = 4, aclDataType dt = ACL_FLOAT,
                uint32_t salt = 33)
      : lead(std::move(lead_dims)), H(h) {
    Rng rng(salt);
    const int64_t T = numel_of(lead);
    std::vector<int64_t> xs = lead, ys = lead;
    xs.push_back(2 * H);
    ys.push_back(H);
    x = Tensor::from(xs, dt, rng.uniform_vec(T * 2 * H, -4, 4));
    weight = Tensor::from(lead, ACL_FLOAT, rng.uniform_vec(T, 0.1, 1.5));
    group_index = Tensor::from_i64({2}, {1, T});
    y = Tensor(ys, dt);
  }
  aclnnStatus stage1(uint64_t* ws, aclOpExecutor** ex) override {
    return aclnnSwigluGroupGetWorkspaceSize(x.handle(), weight.handle(), group_index.handle(),
                                            clamp_limit, y.handle(), ws, ex);
  }
  aclnnStatus stage2(void* ws, uint64_t size, aclOpExecutor* ex) override {
    return aclnnSwigluGroup(ws, size, ex, nullptr);
  }
  std::vector<Tensor*> outputs() override { return {&y}; }

  void check_against_reference(const std::string& what) {
    std::vector<double> w = weight.is_null() ? std::vector<double>() : weight.values();
    std::vector<int64_t> gi;
    for (int64_t i = 0; !group_index.is_null() && i < group_index.numel(); ++i) {
      gi.push_back(static_cast<int64_t>(group_index.get(i)));
    }
    std::vector<double> r = ref::swiglu_forward(x.values(), weight.is_null() ? nullptr : &w,
                                                group_index.is_null() ? nullptr : &gi,
                                                static_cast<float>(clamp_limit), numel_of(lead), H);
    expect_close(y, r, what + " y");
  }
};

using RF = Rule<SwigluFwdCase>;

const std::vector<RF> kFwdRules = {
    {"NullX", [](SwigluFwdCase& c) { c.x = Tensor(); }, kNull, "x"},
    {"NullY", [](SwigluFwdCase& c) { c.y = Tensor(); }, kNull, "y|yOut"},
    {"NullWorkspaceSize", [](SwigluFwdCase& c) { c.null_workspace_size = true; }, kNull, "workspaceSize"},
    {"NullExecutor", [](SwigluFwdCase& c) { c.null_executor = true; }, kNull, "executor"},
    {"XInt32", [](SwigluFwdCase& c) { c.x = Tensor({3, 8}, ACL_INT32); }, kInv, "x"},
    {"WeightFp16", [](SwigluFwdCase& c) { c.weight = Tensor({3}, ACL_FLOAT16); }, kInv, "weight"},
    {"GroupIndexInt32", [](SwigluFwdCase& c) { c.group_index = Tensor({2}, ACL_INT32); }, kInv, "group_index|groupIndex"},
    {"YDtypeNotX", [](SwigluFwdCase& c) { c.y = Tensor({3, 4}, ACL_BF16); }, kInv, "y|yOut"},
    {"ClampZero", [](SwigluFwdCase& c) { c.clamp_limit = 0.0; }, kTiling, "clamp_limit|clampLimit"},
    {"ClampMinus2", [](SwigluFwdCase& c) { c.clamp_limit = -2.0; }, kTiling, "clamp_limit|clampLimit"},
    {"ClampNaN", [](SwigluFwdCase& c) { c.clamp_limit = std::nan(""); }, kTiling, "clamp_limit|clampLimit"},
    {"XRank0", [](SwigluFwdCase& c) { c.x = Tensor({}, ACL_FLOAT); c.weight = Tensor(); }, kTiling, "x"},
    {"XLastDimOdd", [](SwigluFwdCase& c) { c.x = Tensor({3, 7}, ACL_FLOAT); c.y = Tensor({3, 3}, ACL_FLOAT); }, kTiling, "x", {"7"}},
    {"HiddenZero", [](SwigluFwdCase& c) { c.x = Tensor({3, 0}, ACL_FLOAT); c.y = Tensor({3, 0}, ACL_FLOAT); }, kTiling, "x"},
    {"WeightNumelNotT", [](SwigluFwdCase& c) { c.weight = Tensor({2}, ACL_FLOAT); }, kTiling, "weight"},
    {"GroupIndexRank2", [](SwigluFwdCase& c) { c.group_index = Tensor::from_i64({2, 1}, {1, 2}); }, kTiling, "group_index|groupIndex"},
    {"YShapeNotHalfX", [](SwigluFwdCase& c) { c.y = Tensor({3, 8}, ACL_FLOAT); }, kTiling, "y|yOut"},
    {"YRankNotX", [](SwigluFwdCase& c) { c.y = Tensor({12}, ACL_FLOAT); }, kTiling, "y|yOut"},
    {"XStrided", [](SwigluFwdCase& c) { c.x = Tensor::strided({3, 8}, ACL_FLOAT); }, kInv, "x"},
    {"XFormatNZ", [](SwigluFwdCase& c) { c.x = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 8}, ACL_FLOAT); }, kInv, "x"},
    {"WeightStrided", [](SwigluFwdCase& c) { c.weight = Tensor::strided({3}, ACL_FLOAT); }, kInv, "weight"},
    {"WeightFormatNZ", [](SwigluFwdCase& c) { c.weight = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3}, ACL_FLOAT); }, kInv, "weight"},
    {"GroupIndexStrided", [](SwigluFwdCase& c) { c.group_index = Tensor::strided({2}, ACL_INT64); }, kInv, "group_index|groupIndex"},
    {"GroupIndexFormatNZ", [](SwigluFwdCase& c) { c.group_index = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {2}, ACL_INT64); }, kInv, "group_index|groupIndex"},
    {"YStrided", [](SwigluFwdCase& c) { c.y = Tensor::strided({3, 4}, ACL_FLOAT); }, kInv, "y|yOut"},
    {"YFormatNZ", [](SwigluFwdCase& c) { c.y = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 4}, ACL_FLOAT); }, kInv, "y|yOut"},
};

class SwigluForwardRules : public testing::TestWithParam<RF> {};

TEST_P(SwigluForwardRules, Rejected) {
  SwigluFwdCase c;
  GetParam().mutate(c);
  expect_rejected(c, GetParam().code, GetParam().arg, GetParam().words);
}

INSTANTIATE_TEST_SUITE_P(SwigluGroup, SwigluForwardRules, testing::ValuesIn(kFwdRules),
                         rule_name<SwigluFwdCase>);

class SwigluForwardValues : public testing::TestWithParam<std::tuple<aclDataType, SwConfig>> {};

TEST_P(SwigluForwardValues, MatchesFloat64Reference) {
  SCOPED_TRACE(seed_trace());
  const auto [dt, f] = GetParam();
  SwigluFwdCase c(f.lead, f.H, dt, static_cast<uint32_t>(f.H * 5 + 1));
  c.clamp_limit = f.clamp;
  if (!f.weight) c.weight = Tensor();
  if (f.use_gi) {
    c.group_index = Tensor::from_i64({static_cast<int64_t>(f.group_index.size())}, f.group_index);
  } else {
    c.group_index = Tensor();
  }
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference(f.name);
}

INSTANTIATE_TEST_SUITE_P(
    SwigluGroup, SwigluForwardValues,
    testing::Combine(testing::Values(ACL_FLOAT, ACL_FLOAT16, ACL_BF16),
                     testing::Values(SwConfig{"plain", {5}, 16, -1.0, false, {}, false},
                                     SwConfig{"weight_clamp", {4}, 32, 1.5, true, {}, false},
                                     SwConfig{"group_truncates", {7}, 8, -1.0, true, {2, 3}, true},
                                     SwConfig{"rank3", {2, 3}, 257, 0.7, true, {9}, true})),
    [](const testing::TestParamInfo<std::tuple<aclDataType, SwConfig>>& info) {
      return std::string(dt_name(std::get<0>(info.param))) + "_" + std::get<1>(info.param).name;
    });

TEST(SwigluGroup, ZeroTokens) {
  SwigluFwdCase c({0}, 8);
  c.group_index = Tensor();
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(c.y.numel(), 0);
}

// D16: bitwise identical with 1 and 2 threads.
TEST(SwigluGroupQuantGrad, DeterministicAcrossThreads) {
  SwigluGradCase one({512}, 64, ACL_BF16, 51), two({512}, 64, ACL_BF16, 51);
  one.clamp_limit = two.clamp_limit = 2.5;
  one.group_index = Tensor::from_i64({2}, {200, 250});
  two.group_index = Tensor::from_i64({2}, {200, 250});
  expect_deterministic_across_threads(one, two);
}

TEST(SwigluGroup, DeterministicAcrossThreads) {
  SwigluFwdCase one({512}, 64, ACL_FLOAT, 52), two({512}, 64, ACL_FLOAT, 52);
  expect_deterministic_across_threads(one, two);
}

TEST(SwigluGroupQuantGrad, WorkspaceSizeIdempotent) {
  SwigluGradCase c;
  expect_workspace_idempotent(c);
}

TEST(SwigluGroup, WorkspaceSizeIdempotent) {
  SwigluFwdCase c;
  expect_workspace_idempotent(c);
}

}  // namespace
