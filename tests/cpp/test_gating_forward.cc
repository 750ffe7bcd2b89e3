// aclnnMoeGatingTopK through the C API: the validation rules of operators.md §2.5 with
// decisions D2, D13, D18, D19 and docs/decisions.md L3 (dtypes/layout 161002, shapes and
// attributes 561002), and values against the float64 reference (§2.4, D13, L1, stable ties).
#include "hwy_targets.h"
#include "reference.h"
#include "test_util.h"

using namespace mgt;

namespace {

struct GatingFwdCase : OpCase {
  Tensor x, bias, y, expert_idx, norm_out;
  ref::GatingFwdAttrs a;
  int64_t M, N;

  GatingFwdCase(int64_t m = 3, int64_t n = 8, int64_t k = 2, aclDataType dt = ACL_FLOAT,
                bool with_bias = false)
      : M(m), N(n) {
    a.k = k;
    Rng rng(11);
    x = Tensor::from({M, N}, dt, rng.uniform_vec(M * N, -2.0, 2.0));
    if (with_bias) bias = Tensor::from({N}, dt, rng.uniform_vec(N, -0.5, 0.5));
    alloc_outputs();
  }
  void alloc_outputs() {
    y = Tensor({M, a.k}, x.dtype());
    expert_idx = Tensor({M, a.k}, ACL_INT32);
    norm_out = Tensor({M, N}, ACL_FLOAT);
  }
  aclnnStatus stage1(uint64_t* ws, aclOpExecutor** ex) override {
    if (a.no_renorm) {  // D33: the Ex entry point
      return aclnnMoeGatingTopKExGetWorkspaceSize(
          x.handle(), bias.handle(), a.k, a.k_group, a.group_count, a.group_select_mode, a.renorm,
          a.norm_type, a.out_flag, a.rsf, a.eps, true, y.handle(), expert_idx.handle(),
          norm_out.handle(), ws, ex);
    }
    return aclnnMoeGatingTopKGetWorkspaceSize(x.handle(), bias.handle(), a.k, a.k_group,
                                              a.group_count, a.group_select_mode, a.renorm,
                                              a.norm_type, a.out_flag, a.rsf, a.eps, y.handle(),
                                              expert_idx.handle(), norm_out.handle(), ws, ex);
  }
  aclnnStatus stage2(void* ws, uint64_t size, aclOpExecutor* ex) override {
    if (a.no_renorm) return aclnnMoeGatingTopKEx(ws, size, ex, nullptr);
    return aclnnMoeGatingTopK(ws, size, ex, nullptr);
  }
  std::vector<Tensor*> outputs() override { return {&y, &expert_idx, &norm_out}; }

  ref::GatingFwd reference() const {
    ref::GatingFwdAttrs ra = a;
    ra.rsf = static_cast<float>(a.rsf);
    ra.eps = static_cast<float>(a.eps);
    std::vector<double> b = bias.is_null() ? std::vector<double>() : bias.values();
    return ref::gating_forward(x.values(), bias.is_null() ? nullptr : &b, M, N, ra);
  }
  void check_against_reference(const std::string& what) {
    ref::GatingFwd r = reference();
    for (int64_t i = 0; i < M * a.k; ++i) {
      EXPECT_EQ(expert_idx.i32(i), r.idx[i]) << what << ": expert_idx flat " << i << "; " << seed_trace();
    }
    expect_close(y, r.y, what + " y", {}, static_cast<double>(a.k + (a.norm_type == 0 ? N : 0)));
    if (a.out_flag) {
      expect_close(norm_out, r.norm_out, what + " norm_out", {}, static_cast<double>(N));
    } else {
      for (int64_t i = 0; i < M * N; ++i) {
        ASSERT_EQ(norm_out.get(i), 0.0) << what << ": norm_out must be zero-filled without out_flag (L1)";
      }
    }
  }
};

using R = Rule<GatingFwdCase>;
constexpr aclnnStatus kNull = ACLNN_ERR_PARAM_NULLPTR;
constexpr aclnnStatus kInv = ACLNN_ERR_PARAM_INVALID;
constexpr aclnnStatus kTiling = ACLNN_ERR_INNER_TILING_ERROR;

void with_n(GatingFwdCase& c, int64_t n) {
  c.N = n;
  c.x = Tensor::from({c.M, n}, c.x.dtype(), std::vector<double>(c.M * n, 0.25));
  c.alloc_outputs();
}
void with_groups(GatingFwdCase& c, int64_t k, int64_t k_group, int64_t group_count, int64_t mode) {
  c.a.k = k;
  c.a.k_group = k_group;
  c.a.group_count = group_count;
  c.a.group_select_mode = mode;
  c.alloc_outputs();
}

const std::vector<R> kRules = {
    // null pointers: 161001
    {"NullX", [](GatingFwdCase& c) { c.x = Tensor(); }, kNull, "x"},
    {"NullY", [](GatingFwdCase& c) { c.y = Tensor(); }, kNull, "y|yOut"},
    {"NullExpertIdx", [](GatingFwdCase& c) { c.expert_idx = Tensor(); }, kNull, "expert_idx|expertIdxOut"},
    {"NullNormOut", [](GatingFwdCase& c) { c.norm_out = Tensor(); }, kNull, "norm_out|outOut"},
    {"NullDataX", [](GatingFwdCase& c) { c.x = Tensor::null_data({3, 8}, ACL_FLOAT); }, kNull, "x"},
    {"NullWorkspaceSize", [](GatingFwdCase& c) { c.null_workspace_size = true; }, kNull, "workspaceSize"},
    {"NullExecutor", [](GatingFwdCase& c) { c.null_executor = true; }, kNull, "executor"},
    // dtypes: 161002
    {"XInt32", [](GatingFwdCase& c) { c.x = Tensor({3, 8}, ACL_INT32); c.y = Tensor({3, 2}, ACL_INT32); }, kInv, "x"},
    {"XDouble", [](GatingFwdCase& c) { c.x = Tensor({3, 8}, ACL_DOUBLE); c.y = Tensor({3, 2}, ACL_DOUBLE); }, kInv, "x"},
    {"BiasDtypeNotX", [](GatingFwdCase& c) { c.bias = Tensor({8}, ACL_FLOAT16); }, kInv, "bias"},
    {"YDtypeNotX", [](GatingFwdCase& c) { c.y = Tensor({3, 2}, ACL_BF16); }, kInv, "y|yOut"},
    {"ExpertIdxInt64", [](GatingFwdCase& c) { c.expert_idx = Tensor({3, 2}, ACL_INT64); }, kInv, "expert_idx|expertIdxOut"},
    {"NormOutFp16", [](GatingFwdCase& c) { c.norm_out = Tensor({3, 8}, ACL_FLOAT16); }, kInv, "norm_out|outOut"},
    {"NormOutBf16ForBf16X", [](GatingFwdCase& c) {
       c.x = Tensor({3, 8}, ACL_BF16); c.y = Tensor({3, 2}, ACL_BF16); c.norm_out = Tensor({3, 8}, ACL_BF16);
     }, kInv, "norm_out|outOut"},
    // shapes: 561002
    {"XRank1", [](GatingFwdCase& c) { c.x = Tensor({8}, ACL_FLOAT); }, kTiling, "x"},
    {"XRank3", [](GatingFwdCase& c) { c.x = Tensor({3, 8, 1}, ACL_FLOAT); }, kTiling, "x"},
    {"N2049", [](GatingFwdCase& c) { with_n(c, 2049); }, kTiling, "x", {"2049"}},
    {"NEquals0", [](GatingFwdCase& c) { with_n(c, 0); }, kTiling, "x|N|k"},
    {"BiasRank2", [](GatingFwdCase& c) { c.bias = Tensor({1, 8}, ACL_FLOAT); }, kTiling, "bias"},
    {"BiasLengthNotN", [](GatingFwdCase& c) { c.bias = Tensor({7}, ACL_FLOAT); }, kTiling, "bias", {"7"}},
    {"KZero", [](GatingFwdCase& c) { with_groups(c, 0, 1, 1, 0); }, kTiling, "k"},
    {"KNegative", [](GatingFwdCase& c) { c.a.k = -1; }, kTiling, "k"},
    {"KGreaterThanN", [](GatingFwdCase& c) { with_groups(c, 9, 1, 1, 0); }, kTiling, "k", {"9"}},
    {"KGreaterThanKeptExperts", [](GatingFwdCase& c) { with_groups(c, 3, 1, 4, 0); }, kTiling, "k", {"3"}},
    {"KGroupZero", [](GatingFwdCase& c) { with_groups(c, 2, 0, 2, 0); }, kTiling, "k_group|kGroup"},
    {"KGroupAboveGroupCount", [](GatingFwdCase& c) { with_groups(c, 2, 3, 2, 0); }, kTiling, "k_group|kGroup"},
    {"GroupCountZero", [](GatingFwdCase& c) { with_groups(c, 2, 1, 0, 0); }, kTiling, "group_count|groupCount"},
    {"GroupCountNegative", [](GatingFwdCase& c) { with_groups(c, 2, 1, -2, 0); }, kTiling, "group_count|groupCount"},
    {"GroupCountNotDividingN", [](GatingFwdCase& c) { with_groups(c, 2, 1, 3, 0); }, kTiling, "group_count|groupCount", {"3"}},
    {"GroupSizeOneWithSelectMode1", [](GatingFwdCase& c) { with_groups(c, 2, 4, 8, 1); }, kTiling, "group_select_mode|groupSelectMode|group_count|groupCount"},
    {"GroupedPaddedSizeAbove2048", [](GatingFwdCase& c) { with_n(c, 2046); with_groups(c, 1, 1, 3, 0); }, kTiling, "group_count|groupCount"},
    {"GroupSelectMode2", [](GatingFwdCase& c) { c.a.group_select_mode = 2; }, kTiling, "group_select_mode|groupSelectMode"},
    {"GroupSelectModeMinus1", [](GatingFwdCase& c) { c.a.group_select_mode = -1; }, kTiling, "group_select_mode|groupSelectMode"},
    {"NormType3", [](GatingFwdCase& c) { c.a.norm_type = 3; }, kTiling, "norm_type|normType", {"3"}},
    {"NormTypeMinus1", [](GatingFwdCase& c) { c.a.norm_type = -1; }, kTiling, "norm_type|normType"},
    {"Renorm2", [](GatingFwdCase& c) { c.a.renorm = 2; }, kTiling, "renorm", {"2"}},
    {"RenormMinus1", [](GatingFwdCase& c) { c.a.renorm = -1; }, kTiling, "renorm"},
    {"RsfNaN", [](GatingFwdCase& c) { c.a.rsf = std::nan(""); }, kTiling, "routed_scaling_factor|routedScalingFactor"},
    {"RsfMinusInf", [](GatingFwdCase& c) { c.a.rsf = -INFINITY; }, kTiling, "routed_scaling_factor|routedScalingFactor"},
    {"EpsNaN", [](GatingFwdCase& c) { c.a.eps = std::nan(""); }, kTiling, "eps"},
    {"EpsInf", [](GatingFwdCase& c) { c.a.eps = INFINITY; }, kTiling, "eps"},
    {"YShapeNotMk", [](GatingFwdCase& c) { c.y = Tensor({3, 3}, ACL_FLOAT); }, kTiling, "y|yOut"},
    {"YRank1", [](GatingFwdCase& c) { c.y = Tensor({6}, ACL_FLOAT); }, kTiling, "y|yOut"},
    {"ExpertIdxShapeNotMk", [](GatingFwdCase& c) { c.expert_idx = Tensor({4, 2}, ACL_INT32); }, kTiling, "expert_idx|expertIdxOut"},
    {"ExpertIdxRank3", [](GatingFwdCase& c) { c.expert_idx = Tensor({3, 2, 1}, ACL_INT32); }, kTiling, "expert_idx|expertIdxOut"},
    {"NormOutShapeNotMN", [](GatingFwdCase& c) { c.norm_out = Tensor({3, 7}, ACL_FLOAT); }, kTiling, "norm_out|outOut"},
    {"NormOutRank1", [](GatingFwdCase& c) { c.norm_out = Tensor({24}, ACL_FLOAT); }, kTiling, "norm_out|outOut"},
    // layouts: 161002 (D19)
    {"XStrided", [](GatingFwdCase& c) { c.x = Tensor::strided({3, 8}, ACL_FLOAT); }, kInv, "x"},
    {"XFormatNZ", [](GatingFwdCase& c) { c.x = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 8}, ACL_FLOAT); }, kInv, "x"},
    {"BiasStrided", [](GatingFwdCase& c) { c.bias = Tensor::strided({8}, ACL_FLOAT); }, kInv, "bias"},
    {"BiasFormatNZ", [](GatingFwdCase& c) { c.bias = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {8}, ACL_FLOAT); }, kInv, "bias"},
    {"YStrided", [](GatingFwdCase& c) { c.y = Tensor::strided({3, 2}, ACL_FLOAT); }, kInv, "y|yOut"},
    {"YFormatNZ", [](GatingFwdCase& c) { c.y = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 2}, ACL_FLOAT); }, kInv, "y|yOut"},
    {"ExpertIdxStrided", [](GatingFwdCase& c) { c.expert_idx = Tensor::strided({3, 2}, ACL_INT32); }, kInv, "expert_idx|expertIdxOut"},
    {"ExpertIdxFormatNZ", [](GatingFwdCase& c) { c.expert_idx = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 2}, ACL_INT32); }, kInv, "expert_idx|expertIdxOut"},
    {"NormOutStrided", [](GatingFwdCase& c) { c.norm_out = Tensor::strided({3, 8}, ACL_FLOAT); }, kInv, "norm_out|outOut"},
    {"NormOutFormatNZ", [](GatingFwdCase& c) { c.norm_out = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 8}, ACL_FLOAT); }, kInv, "norm_out|outOut"},
};

class GatingForwardRules : public testing::TestWithParam<R> {};

TEST_P(GatingForwardRules, Rejected) {
  GatingFwdCase c;
  GetParam().mutate(c);
  expect_rejected(c, GetParam().code, GetParam().arg, GetParam().words);
}

INSTANTIATE_TEST_SUITE_P(MoeGatingTopK, GatingForwardRules, testing::ValuesIn(kRules),
                         rule_name<GatingFwdCase>);

TEST(MoeGatingTopK, BaselineOfRuleTableIsValid) {
  GatingFwdCase c;
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference("baseline");
  GatingFwdCase b(3, 8, 2, ACL_FLOAT, true);
  ASSERT_TRUE(run_ok(b));
  b.check_against_reference("baseline with bias");
}

// The boundary values of the rules are accepted.
TEST(MoeGatingTopK, BoundaryValuesAccepted) {
  {  // k == N, N == 1 (D2: the forward allows N = 1)
    GatingFwdCase c(2, 1, 1);
    ASSERT_TRUE(run_ok(c));
    c.check_against_reference("N=1");
  }
  {  // k == k_group * group size
    GatingFwdCase c;
    with_groups(c, 4, 2, 4, 0);
    ASSERT_TRUE(run_ok(c));
  }
  {  // the padded-size rule only applies in the grouped case: k_group == group_count passes
    GatingFwdCase c;
    with_n(c, 2046);
    with_groups(c, 1, 3, 3, 0);
    ASSERT_TRUE(run_ok(c));
  }
  {  // N == 2048, group_count == N
    GatingFwdCase c;
    with_n(c, 2048);
    with_groups(c, 2, 2, 2048, 0);
    ASSERT_TRUE(run_ok(c));
  }
  {  // negative eps / scaling factor are allowed (§2.5)
    GatingFwdCase c;
    c.a.norm_type = 1;
    c.a.eps = -0.857;
    c.a.rsf = -1.5;
    ASSERT_TRUE(run_ok(c));
    c.check_against_reference("negative eps/rsf");
  }
}

// Tie-free inputs: logits on a 1/8 grid (exact in bf16) from a permutation; bias on a 1/64 grid;
// redrawn until every two distinct ranking values differ by more than 2e-5 relative (fp32 error
// is ~1e-7); values that round to the same fp16/bf16 number are exact ties, resolved alike.
struct FwdConfig {
  const char* name;
  int64_t M, N, k, k_group, group_count, group_select_mode, renorm, norm_type;
  bool out_flag, bias;
  double rsf, eps;
  bool no_renorm;  // D33
};

class GatingForwardValues
    : public testing::TestWithParam<std::tuple<aclDataType, FwdConfig>> {};

TEST_P(GatingForwardValues, MatchesFloat64Reference) {
  SCOPED_TRACE(seed_trace());
  const auto [dt, f] = GetParam();
  GatingFwdCase c(f.M, f.N, f.k, dt, f.bias);
  c.a = {f.k, f.k_group, f.group_count, f.group_select_mode, f.renorm, f.norm_type, f.out_flag,
         f.rsf, f.eps, f.no_renorm};
  c.alloc_outputs();
  Rng rng(static_cast<uint32_t>(f.N * 7 + f.k * 3 + f.norm_type));
  for (int attempt = 0; attempt < 200; ++attempt) {
    std::vector<double> x;
    for (int64_t i = 0; i < f.M; ++i) {
      std::vector<int32_t> p = rng.permutation(static_cast<int32_t>(f.N));
      for (int32_t v : p) x.push_back((v - f.N / 2) * 0.125 * (f.N > 64 ? 64.0 / f.N : 1.0));
    }
    c.x.set(x);
    if (f.bias) {
      std::vector<double> b(f.N);
      for (auto& v : b) v = static_cast<double>(rng.integer(-16, 16)) / 64.0;
      c.bias.set(b);
    }
    if (c.reference().min_gap > 2e-5) break;
  }
  ASSERT_GT(c.reference().min_gap, 2e-5) << "could not draw near-tie-free inputs";
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference(f.name);
}

INSTANTIATE_TEST_SUITE_P(
    MoeGatingTopK, GatingForwardValues,
    testing::Combine(
        testing::Values(ACL_FLOAT, ACL_FLOAT16, ACL_BF16),
        testing::Values(
            FwdConfig{"softmax", 5, 16, 4, 1, 1, 0, 0, 0, false, false, 1.0, 1e-20},
            FwdConfig{"softmax_renorm_outflag", 4, 16, 3, 1, 1, 0, 1, 0, true, false, 2.5, 1e-20},
            FwdConfig{"sigmoid_bias", 6, 32, 8, 1, 1, 0, 0, 1, true, true, 1.0, 1e-20},
            FwdConfig{"sqrt_softplus", 3, 12, 12, 1, 1, 0, 0, 2, true, false, 0.5, 1e-10},
            FwdConfig{"grouped_max", 4, 32, 4, 2, 8, 0, 0, 1, false, true, 1.0, 1e-20},
            FwdConfig{"grouped_top2", 4, 32, 6, 3, 4, 1, 0, 1, true, true, 2.0, 1e-20},
            FwdConfig{"grouped_softmax", 3, 24, 2, 1, 3, 1, 1, 0, false, false, 1.0, 1e-20},
            FwdConfig{"k1_n2", 7, 2, 1, 1, 1, 0, 0, 1, true, false, 1.0, 1e-20},
            FwdConfig{"n2048", 2, 2048, 8, 1, 1, 0, 0, 1, false, false, 1.0, 1e-20},
            // D33: no renormalisation for every norm type (the softmax renorm 1 is overridden)
            FwdConfig{"sigmoid_no_renorm", 6, 32, 8, 1, 1, 0, 0, 1, true, true, 2.5, 1e-20, true},
            FwdConfig{"sigmoid_k1_no_renorm", 5, 8, 1, 1, 1, 0, 0, 1, false, false, 1.0, 1e-20, true},
            FwdConfig{"sqrt_softplus_no_renorm", 3, 12, 5, 1, 1, 0, 0, 2, true, false, 0.5, 1e-10, true},
            FwdConfig{"softmax_renorm1_no_renorm", 4, 16, 3, 1, 1, 0, 1, 0, true, false, 1.5, 1e-20, true},
            FwdConfig{"grouped_sigmoid_no_renorm", 4, 32, 4, 2, 8, 0, 0, 1, false, true, 1.0, 1e-20, true})),
    [](const testing::TestParamInfo<std::tuple<aclDataType, FwdConfig>>& info) {
      return std::string(dt_name(std::get<0>(info.param))) + "_" + std::get<1>(info.param).name;
    });

// Equal scores: the lower expert index wins (D13, L2), also for groups.
TEST(MoeGatingTopK, TiesGoToLowerIndex) {
  GatingFwdCase c(2, 8, 3);
  c.x.set(std::vector<double>(16, 0.5));
  ASSERT_TRUE(run_ok(c));
  for (int64_t i = 0; i < 2; ++i) {
    for (int64_t p = 0; p < 3; ++p) EXPECT_EQ(c.expert_idx.i32(i * 3 + p), p);
  }
  // Groups of 2 with equal group scores: groups 0 and 1 are kept, then experts 0, 1, 2.
  GatingFwdCase g(1, 8, 3);
  with_groups(g, 3, 2, 4, 0);
  g.a.norm_type = 1;
  g.x.set(std::vector<double>(8, -1.0));
  ASSERT_TRUE(run_ok(g));
  for (int64_t p = 0; p < 3; ++p) EXPECT_EQ(g.expert_idx.i32(p), p);
  // Row 0: experts 5 and 2 tie above the rest -> 2 before 5.
  GatingFwdCase t(1, 8, 2);
  t.x.set({0.0, 0.1, 1.0, 0.2, 0.3, 1.0, 0.4, 0.5});
  ASSERT_TRUE(run_ok(t));
  EXPECT_EQ(t.expert_idx.i32(0), 2);
  EXPECT_EQ(t.expert_idx.i32(1), 5);
}

// The selection on every SIMD target the CPU supports (k <= 8 by vector maxima, larger k by
// insertion; docs/decisions.md L143), on rows built from five logit values (-0 next to +0), so
// most scores tie exactly and the lower index must win, with and without groups and bias.
TEST(MoeGatingTopK, SelectionWithExactTiesOnEveryTarget) {
  struct Sel { int64_t n, k, group_count, k_group, mode; bool bias; };
  const Sel cases[] = {{13, 8, 1, 1, 0, false}, {37, 3, 1, 1, 0, true}, {37, 9, 1, 1, 0, false},
                       {300, 8, 1, 1, 0, false}, {256, 8, 8, 4, 1, true}, {256, 9, 8, 4, 1, false},
                       {48, 5, 4, 2, 0, true}, {40, 2, 8, 1, 1, false}};
  const double values[] = {-1.0, -0.0, 0.0, 0.5, 2.0};
  moegrad_test::for_each_target([&](int64_t) {
    for (const Sel& s : cases) {
      GatingFwdCase c(12, s.n, s.k, ACL_FLOAT, s.bias);
      if (s.group_count > 1) with_groups(c, s.k, s.k_group, s.group_count, s.mode);
      c.a.norm_type = 1;
      c.a.out_flag = true;
      Rng rng(s.n * 31 + s.k);
      std::vector<double> x(static_cast<size_t>(12 * s.n));
      for (double& v : x) v = values[static_cast<size_t>(rng.uniform(0.0, 5.0)) % 5];
      c.x.set(x);
      if (s.bias) {
        std::vector<double> b(static_cast<size_t>(s.n));
        for (double& v : b) v = rng.uniform(0.0, 1.0) < 0.5 ? 0.0 : 0.25;
        c.bias.set(b);
      }
      ASSERT_TRUE(run_ok(c));
      c.check_against_reference("N=" + std::to_string(s.n) + " k=" + std::to_string(s.k) +
                                " groups=" + std::to_string(s.group_count));
    }
  });
}

// The bias only affects the selection: y holds the unbiased scores (§2.4 steps 2, 5).
TEST(MoeGatingTopK, BiasOnlySelects) {
  GatingFwdCase c(1, 4, 1, ACL_FLOAT, true);
  c.a.norm_type = 1;
  c.x.set({2.0, 0.0, 0.0, 0.0});
  c.bias.set({0.0, 0.0, 5.0, 0.0});
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(c.expert_idx.i32(0), 2);
  // sigmoid(0) / (sigmoid(0) + eps) = 1 with renormalisation over one expert.
  EXPECT_NEAR(c.y.get(0), 1.0, 1e-6);
  c.check_against_reference("bias");
}

// L2: NaN ranks above every number (as torch.topk); its weight propagates NaN.
TEST(MoeGatingTopK, NaNRanksFirst) {
  GatingFwdCase c(1, 6, 2);
  c.a.norm_type = 1;
  c.x.set({0.1, 0.9, std::nan(""), 0.5, 2.0, -1.0});
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(c.expert_idx.i32(0), 2);
  EXPECT_EQ(c.expert_idx.i32(1), 4);
  EXPECT_TRUE(std::isnan(c.y.get(0)));
}

TEST(MoeGatingTopK, ZeroTokens) {
  GatingFwdCase c(0, 8, 2);
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(c.y.numel(), 0);
}

// D16: bitwise identical with 1 and 2 threads.
TEST(MoeGatingTopK, DeterministicAcrossThreads) {
  for (int64_t norm_type : {0, 1, 2}) {
    GatingFwdCase one(1024, 64, 6, ACL_FLOAT16, true), two(1024, 64, 6, ACL_FLOAT16, true);
    for (GatingFwdCase* c : {&one, &two}) {
      c->a = {6, 4, 8, 1, 1, norm_type, true, 1.5, 1e-20};
      c->alloc_outputs();
    }
    expect_deterministic_across_threads(one, two);
  }
}

TEST(MoeGatingTopK, WorkspaceSizeIdempotent) {
  GatingFwdCase c;
  expect_workspace_idempotent(c);
}

}  // namespace
