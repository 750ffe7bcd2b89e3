// aclnnMoeGatingTopKBackward through the C API: every validation rule of operators.md §1.6 with
// decisions D2, D3, D6, D19 and docs/decisions.md L3 (every error but a null pointer is
// 161002), and values against the float64 reference (§1.5, worked example §1.9, D1, D4).
#include "reference.h"
#include "test_util.h"

using namespace mgt;

namespace {

struct GatingBwdCase : OpCase {
  Tensor x_norm, grad_y, expert_idx, out;
  int64_t renorm = 0, norm_type = 1;
  double rsf = 1.0, eps = 1e-20;
  bool no_renorm = false;  // D33: through the Ex entry point
  int64_t M, N, K;

  // A valid call: x_norm in (0.05, 0.95), random signed grad_y, distinct experts per row.
  explicit GatingBwdCase(int64_t m = 3, int64_t n = 6, int64_t k = 2, aclDataType dt = ACL_FLOAT,
                         uint32_t salt = 1)
      : M(m), N(n), K(k) {
    Rng rng(salt);
    x_norm = Tensor::from({M, N}, ACL_FLOAT, rng.uniform_vec(M * N, 0.05, 0.95));
    std::vector<double> gy(M * K);
    for (auto& v : gy) v = rng.signed_uniform(0.1, 2.0);
    grad_y = Tensor::from({M, K}, dt, gy);
    std::vector<int32_t> idx;
    for (int64_t i = 0; i < M; ++i) {
      std::vector<int32_t> p = rng.permutation(static_cast<int32_t>(N));
      idx.insert(idx.end(), p.begin(), p.begin() + K);
    }
    expert_idx = Tensor::from_i32({M, K}, idx);
    out = Tensor({M, N}, dt);
  }
  aclnnStatus stage1(uint64_t* ws, aclOpExecutor** ex) override {
    if (no_renorm) {
      return aclnnMoeGatingTopKBackwardExGetWorkspaceSize(
          x_norm.handle(), grad_y.handle(), expert_idx.handle(), renorm, norm_type, rsf, eps, true,
          out.handle(), ws, ex);
    }
    return aclnnMoeGatingTopKBackwardGetWorkspaceSize(x_norm.handle(), grad_y.handle(),
                                                      expert_idx.handle(), renorm, norm_type, rsf,
                                                      eps, out.handle(), ws, ex);
  }
  aclnnStatus stage2(void* ws, uint64_t size, aclOpExecutor* ex) override {
    if (no_renorm) return aclnnMoeGatingTopKBackwardEx(ws, size, ex, nullptr);
    return aclnnMoeGatingTopKBackward(ws, size, ex, nullptr);
  }
  std::vector<Tensor*> outputs() override { return {&out}; }

  void check_against_reference(const std::string& what) {
    std::vector<int32_t> idx(M * K);
    for (int64_t i = 0; i < M * K; ++i) idx[i] = expert_idx.i32(i);
    ref::GatingBwd r = ref::gating_backward_any(x_norm.values(), grad_y.values(), idx, M, N, K,
                                                static_cast<float>(rsf), static_cast<float>(eps),
                                                norm_type, renorm, no_renorm);
    expect_close(out, r.grad_x, what, r.scale, static_cast<double>(K));
    // Unselected experts get exactly 0 (§1.7); softmax spreads over every column.
    for (int64_t i = 0; i < M && norm_type != 0; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        bool selected = false;
        for (int64_t p = 0; p < K; ++p) selected |= idx[i * K + p] == j;
        if (!selected) {
          EXPECT_EQ(out.get(i * N + j), 0.0) << what << " unselected (" << i << "," << j << ")";
        }
      }
    }
  }
};

using R = Rule<GatingBwdCase>;
constexpr aclnnStatus kNull = ACLNN_ERR_PARAM_NULLPTR;
constexpr aclnnStatus kInv = ACLNN_ERR_PARAM_INVALID;

// Reshapes the case to N experts keeping M, K.
void with_n(GatingBwdCase& c, int64_t n) {
  c.N = n;
  c.x_norm = Tensor::from({c.M, n}, ACL_FLOAT, std::vector<double>(c.M * n, 0.5));
  c.out = Tensor({c.M, n}, c.grad_y.dtype());
}

const std::vector<R> kRules = {
    // null pointers: 161001
    {"NullXNorm", [](GatingBwdCase& c) { c.x_norm = Tensor(); }, kNull, "x_norm|xNorm"},
    {"NullGradY", [](GatingBwdCase& c) { c.grad_y = Tensor(); }, kNull, "grad_y|gradY"},
    {"NullExpertIdx", [](GatingBwdCase& c) { c.expert_idx = Tensor(); }, kNull, "expert_idx|expertIdx"},
    {"NullOut", [](GatingBwdCase& c) { c.out = Tensor(); }, kNull, "grad_x|out"},
    {"NullDataXNorm", [](GatingBwdCase& c) { c.x_norm = Tensor::null_data({3, 6}, ACL_FLOAT); }, kNull, "x_norm|xNorm"},
    {"NullWorkspaceSize", [](GatingBwdCase& c) { c.null_workspace_size = true; }, kNull, "workspaceSize"},
    {"NullExecutor", [](GatingBwdCase& c) { c.null_executor = true; }, kNull, "executor"},
    // dtypes: 161002
    {"XNormFp16", [](GatingBwdCase& c) { c.x_norm = Tensor({3, 6}, ACL_FLOAT16); }, kInv, "x_norm|xNorm"},
    {"XNormBf16", [](GatingBwdCase& c) { c.x_norm = Tensor({3, 6}, ACL_BF16); }, kInv, "x_norm|xNorm"},
    {"XNormDouble", [](GatingBwdCase& c) { c.x_norm = Tensor({3, 6}, ACL_DOUBLE); }, kInv, "x_norm|xNorm"},
    {"GradYInt32", [](GatingBwdCase& c) { c.grad_y = Tensor({3, 2}, ACL_INT32); c.out = Tensor({3, 6}, ACL_INT32); }, kInv, "grad_y|gradY"},
    {"GradYDouble", [](GatingBwdCase& c) { c.grad_y = Tensor({3, 2}, ACL_DOUBLE); c.out = Tensor({3, 6}, ACL_DOUBLE); }, kInv, "grad_y|gradY"},
    {"ExpertIdxInt64", [](GatingBwdCase& c) { c.expert_idx = Tensor({3, 2}, ACL_INT64); }, kInv, "expert_idx|expertIdx"},
    {"ExpertIdxFloat", [](GatingBwdCase& c) { c.expert_idx = Tensor({3, 2}, ACL_FLOAT); }, kInv, "expert_idx|expertIdx"},
    {"OutFp16ForFp32GradY", [](GatingBwdCase& c) { c.out = Tensor({3, 6}, ACL_FLOAT16); }, kInv, "grad_x|out"},
    {"OutFp32ForBf16GradY", [](GatingBwdCase& c) { c.grad_y = Tensor({3, 2}, ACL_BF16); }, kInv, "grad_x|out"},
    // ranks and shapes: 161002 (D3)
    {"XNormRank1", [](GatingBwdCase& c) { c.x_norm = Tensor({6}, ACL_FLOAT); }, kInv, "x_norm|xNorm"},
    {"XNormRank3", [](GatingBwdCase& c) { c.x_norm = Tensor({3, 6, 1}, ACL_FLOAT); }, kInv, "x_norm|xNorm"},
    {"NEquals1", [](GatingBwdCase& c) {
       with_n(c, 1);
       c.grad_y = Tensor::from({3, 1}, ACL_FLOAT, {0.5, -0.25, 1.0});
       c.expert_idx = Tensor::from_i32({3, 1}, {0, 0, 0});
     }, kInv, "x_norm|xNorm"},
    {"NEquals0", [](GatingBwdCase& c) { with_n(c, 0); }, kInv, "x_norm|xNorm"},
    {"N2049", [](GatingBwdCase& c) { with_n(c, 2049); }, kInv, "x_norm|xNorm", {"2049"}},
    {"GradYRank1", [](GatingBwdCase& c) { c.grad_y = Tensor({6}, ACL_FLOAT); }, kInv, "grad_y|gradY"},
    {"GradYRank3", [](GatingBwdCase& c) { c.grad_y = Tensor({3, 2, 1}, ACL_FLOAT); }, kInv, "grad_y|gradY"},
    {"GradYDim0NotM", [](GatingBwdCase& c) { c.grad_y = Tensor({4, 2}, ACL_FLOAT); }, kInv, "grad_y|gradY"},
    {"KEquals0", [](GatingBwdCase& c) { c.grad_y = Tensor({3, 0}, ACL_FLOAT); c.expert_idx = Tensor({3, 0}, ACL_INT32); }, kInv, "grad_y|gradY"},
    {"KGreaterThanN", [](GatingBwdCase& c) {
       c.grad_y = Tensor::from({3, 7}, ACL_FLOAT, std::vector<double>(21, 0.5));
       c.expert_idx = Tensor::from_i32({3, 7}, std::vector<int32_t>(21, 1));
     }, kInv, "grad_y|gradY", {"7"}},
    {"ExpertIdxRank1", [](GatingBwdCase& c) { c.expert_idx = Tensor({6}, ACL_INT32); }, kInv, "expert_idx|expertIdx"},
    {"ExpertIdxRank3", [](GatingBwdCase& c) { c.expert_idx = Tensor({3, 2, 1}, ACL_INT32); }, kInv, "expert_idx|expertIdx"},
    {"ExpertIdxDim0NotM", [](GatingBwdCase& c) { c.expert_idx = Tensor({2, 2}, ACL_INT32); }, kInv, "expert_idx|expertIdx"},
    {"ExpertIdxDim1NotK", [](GatingBwdCase& c) { c.expert_idx = Tensor({3, 3}, ACL_INT32); }, kInv, "expert_idx|expertIdx"},
    {"OutRank1", [](GatingBwdCase& c) { c.out = Tensor({18}, ACL_FLOAT); }, kInv, "grad_x|out"},
    {"OutRank3", [](GatingBwdCase& c) { c.out = Tensor({3, 6, 1}, ACL_FLOAT); }, kInv, "grad_x|out"},
    {"OutDim1NotN", [](GatingBwdCase& c) { c.out = Tensor({3, 7}, ACL_FLOAT); }, kInv, "grad_x|out"},
    {"OutDim0NotM", [](GatingBwdCase& c) { c.out = Tensor({4, 6}, ACL_FLOAT); }, kInv, "grad_x|out"},
    // attributes: 161002 (D3, L3)
    {"NormType3", [](GatingBwdCase& c) { c.norm_type = 3; }, kInv, "norm_type|normType", {"3"}},
    {"SoftmaxRenorm2", [](GatingBwdCase& c) { c.norm_type = 0; c.renorm = 2; }, kInv, "renorm", {"2"}},
    {"SoftmaxRenormMinus1", [](GatingBwdCase& c) { c.norm_type = 0; c.renorm = -1; }, kInv, "renorm", {"-1"}},
    {"NormTypeMinus1", [](GatingBwdCase& c) { c.norm_type = -1; }, kInv, "norm_type|normType"},
    {"RsfNaN", [](GatingBwdCase& c) { c.rsf = std::nan(""); }, kInv, "routed_scaling_factor|routedScalingFactor"},
    {"RsfInf", [](GatingBwdCase& c) { c.rsf = INFINITY; }, kInv, "routed_scaling_factor|routedScalingFactor"},
    {"EpsNaN", [](GatingBwdCase& c) { c.eps = std::nan(""); }, kInv, "eps"},
    {"EpsMinusInf", [](GatingBwdCase& c) { c.eps = -INFINITY; }, kInv, "eps"},
    // layouts: 161002 (D19)
    {"XNormStrided", [](GatingBwdCase& c) { c.x_norm = Tensor::strided({3, 6}, ACL_FLOAT); }, kInv, "x_norm|xNorm"},
    {"XNormFormatNZ", [](GatingBwdCase& c) { c.x_norm = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 6}, ACL_FLOAT); }, kInv, "x_norm|xNorm"},
    {"GradYStrided", [](GatingBwdCase& c) { c.grad_y = Tensor::strided({3, 2}, ACL_FLOAT); }, kInv, "grad_y|gradY"},
    {"GradYFormatNZ", [](GatingBwdCase& c) { c.grad_y = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 2}, ACL_FLOAT); }, kInv, "grad_y|gradY"},
    {"ExpertIdxStrided", [](GatingBwdCase& c) { c.expert_idx = Tensor::strided({3, 2}, ACL_INT32); }, kInv, "expert_idx|expertIdx"},
    {"ExpertIdxFormatNZ", [](GatingBwdCase& c) { c.expert_idx = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 2}, ACL_INT32); }, kInv, "expert_idx|expertIdx"},
    {"OutStrided", [](GatingBwdCase& c) { c.out = Tensor::strided({3, 6}, ACL_FLOAT); }, kInv, "grad_x|out"},
    {"OutFormatNZ", [](GatingBwdCase& c) { c.out = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 6}, ACL_FLOAT); }, kInv, "grad_x|out"},
    {"XNormTransposed", [](GatingBwdCase& c) { c.x_norm = Tensor::transposed(3, 6, ACL_FLOAT); }, kInv, "x_norm|xNorm"},
    {"OutTransposed", [](GatingBwdCase& c) { c.out = Tensor::transposed(3, 6, ACL_FLOAT); }, kInv, "grad_x|out"},
    // host index values: 161002 naming the position and value (D6)
    {"ExpertIdxEqualsN", [](GatingBwdCase& c) { c.expert_idx.set_i32(3, 6); }, kInv, "expert_idx|expertIdx", {"6", "3"}},
    {"ExpertIdxNegative", [](GatingBwdCase& c) { c.expert_idx.set_i32(4, -1); }, kInv, "expert_idx|expertIdx", {"-1", "4"}},
    {"ExpertIdxHuge", [](GatingBwdCase& c) { c.expert_idx.set_i32(0, 1000000); }, kInv, "expert_idx|expertIdx", {"1000000", "0"}},
};

class GatingBackwardRules : public testing::TestWithParam<R> {};

TEST_P(GatingBackwardRules, Rejected) {
  GatingBwdCase c;
  GetParam().mutate(c);
  expect_rejected(c, GetParam().code, GetParam().arg, GetParam().words);
}

INSTANTIATE_TEST_SUITE_P(MoeGatingTopKBackward, GatingBackwardRules, testing::ValuesIn(kRules),
                         rule_name<GatingBwdCase>);

// The valid baseline of the rule table succeeds: each rejection comes from its one mutation.
TEST(MoeGatingTopKBackward, BaselineOfRuleTableIsValid) {
  GatingBwdCase c;
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference("baseline");
}

TEST(MoeGatingTopKBackward, WorkedExample_1_9) {
  GatingBwdCase c(4, 8, 2);
  c.x_norm.set({0.5, 0.7, 0.3, 0.8, 0.2, 0.6, 0.9, 0.4, 0.6, 0.4, 0.8, 0.1, 0.7, 0.5, 0.3, 0.9,
                0.2, 0.9, 0.5, 0.6, 0.8, 0.3, 0.7, 0.4, 0.8, 0.3, 0.6, 0.5, 0.4, 0.7, 0.2, 0.9});
  c.grad_y.set({1.0, 0.5, 0.8, 0.3, 0.6, 0.9, 0.4, 0.7});
  c.expert_idx = Tensor::from_i32({4, 2}, {3, 6, 2, 7, 1, 4, 0, 7});
  c.rsf = 2.5;
  c.eps = 1e-20;
  ASSERT_TRUE(run_ok(c));
  std::vector<double> listed(32, 0.0);
  listed[0 * 8 + 3] = 0.062284;
  listed[0 * 8 + 6] = -0.031142;
  listed[1 * 8 + 2] = 0.062284;
  listed[1 * 8 + 7] = -0.031142;
  listed[2 * 8 + 1] = -0.018685;
  listed[2 * 8 + 4] = 0.037370;
  listed[3 * 8 + 0] = -0.037370;
  listed[3 * 8 + 7] = 0.018685;
  expect_listed(c.out, listed, 6, "§1.9 gradX");
  c.check_against_reference("§1.9 gradX");
}

// D22: softmax (renorm 0 and 1) and sqrt-softplus, for every dtype and edge sizes. x_norm is a
// real forward output: a softmax row (sums to 1) or sqrt(softplus) of random logits.
struct NormCase {
  int64_t norm_type, renorm;
  bool no_renorm;  // D33
};

class GatingBackwardNormTypes
    : public testing::TestWithParam<std::tuple<aclDataType, NormCase, int>> {};

TEST_P(GatingBackwardNormTypes, MatchesFloat64Reference) {
  SCOPED_TRACE(seed_trace());
  const auto [dt, nc, shape] = GetParam();
  const int64_t shapes[][3] = {{5, 8, 2}, {4, 2, 1}, {3, 2, 2}, {3, 7, 7}, {2, 2048, 8}, {9, 257, 5}};
  const int64_t M = shapes[shape][0], N = shapes[shape][1], K = shapes[shape][2];
  GatingBwdCase c(M, N, K, dt, static_cast<uint32_t>(N * 37 + K + nc.norm_type));
  c.norm_type = nc.norm_type;
  c.renorm = nc.renorm;
  c.no_renorm = nc.no_renorm;
  c.rsf = shape % 2 ? 2.5 : -1.5;
  Rng rng(static_cast<uint32_t>(M * 131 + N));
  std::vector<double> xn(M * N);
  for (int64_t i = 0; i < M; ++i) {
    double sum = 0.0;
    for (int64_t j = 0; j < N; ++j) {
      const double x = rng.signed_uniform(0.0, 4.0);
      xn[i * N + j] = nc.norm_type == 0   ? std::exp(x)
                      : nc.norm_type == 1 ? 1.0 / (1.0 + std::exp(-x))
                                          : std::sqrt(std::log1p(std::exp(x)));
      sum += xn[i * N + j];
    }
    if (nc.norm_type == 0) {
      for (int64_t j = 0; j < N; ++j) xn[i * N + j] /= sum;
    }
  }
  c.x_norm = Tensor::from({M, N}, ACL_FLOAT, xn);
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference("gradX");
}

INSTANTIATE_TEST_SUITE_P(
    MoeGatingTopKBackward, GatingBackwardNormTypes,
    testing::Combine(testing::Values(ACL_FLOAT, ACL_FLOAT16, ACL_BF16),
                     testing::Values(NormCase{0, 0}, NormCase{0, 1}, NormCase{2, 0}, NormCase{2, 1},
                                     NormCase{0, 1, true}, NormCase{1, 0, true},
                                     NormCase{2, 0, true}),
                     testing::Range(0, 6)),
    [](const testing::TestParamInfo<std::tuple<aclDataType, NormCase, int>>& info) {
      const auto& n = std::get<1>(info.param);
      return std::string(dt_name(std::get<0>(info.param))) + "_norm" + std::to_string(n.norm_type) +
             "_renorm" + std::to_string(n.renorm) + (n.no_renorm ? "_norenorm" : "") + "_shape" +
             std::to_string(std::get<2>(info.param));
    });

// sqrt-softplus at n = 0 (x = -inf) gives exactly 0, and tiny n follows the n / 2 limit.
TEST(MoeGatingTopKBackward, SqrtSoftplusSmallScores) {
  GatingBwdCase c(1, 4, 2);
  c.norm_type = 2;
  c.x_norm.set({0.0, 1e-6, 0.5, 3.0});
  c.expert_idx = Tensor::from_i32({1, 2}, {0, 1});
  c.grad_y.set({0.7, -1.3});
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(c.out.get(0), 0.0);
  c.check_against_reference("small n");
}

// Duplicate ids are summed for every norm type (D1).
TEST(MoeGatingTopKBackward, DuplicateIdsAreSummedEveryNormType) {
  for (int64_t nt : {0, 2}) {
    for (int64_t rn : {0, 1}) {
      GatingBwdCase c(3, 5, 3);
      c.norm_type = nt;
      c.renorm = rn;
      c.expert_idx = Tensor::from_i32({3, 3}, {2, 2, 4, 0, 1, 0, 3, 3, 3});
      c.rsf = 1.7;
      ASSERT_TRUE(run_ok(c));
      c.check_against_reference("duplicates norm_type " + std::to_string(nt));
    }
  }
}

struct BwdShape {
  int64_t M, N, K;
  double rsf, eps;
};

class GatingBackwardValues
    : public testing::TestWithParam<std::tuple<aclDataType, BwdShape>> {};

TEST_P(GatingBackwardValues, MatchesFloat64Reference) {
  SCOPED_TRACE(seed_trace());
  const auto [dt, s] = GetParam();
  GatingBwdCase c(s.M, s.N, s.K, dt, static_cast<uint32_t>(s.N * 31 + s.K));
  c.rsf = s.rsf;
  c.eps = s.eps;
  c.renorm = 0;
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference("gradX");
}

INSTANTIATE_TEST_SUITE_P(
    MoeGatingTopKBackward, GatingBackwardValues,
    testing::Combine(testing::Values(ACL_FLOAT, ACL_FLOAT16, ACL_BF16),
                     testing::Values(BwdShape{5, 8, 2, 1.0, 1e-20}, BwdShape{4, 2, 1, 2.5, 1e-20},
                                     BwdShape{3, 2, 2, 0.1, 1e-10}, BwdShape{3, 7, 7, -1.5, 1e-20},
                                     BwdShape{2, 2048, 8, 1.0, 1e-20},
                                     BwdShape{9, 257, 5, 2.5, 1e-10})),
    [](const testing::TestParamInfo<std::tuple<aclDataType, BwdShape>>& info) {
      const auto& s = std::get<1>(info.param);
      return std::string(dt_name(std::get<0>(info.param))) + "_M" + std::to_string(s.M) + "_N" +
             std::to_string(s.N) + "_K" + std::to_string(s.K);
    });

// D1: a repeated expert id within a row sums its contributions.
TEST(MoeGatingTopKBackward, DuplicateIdsAreSummed) {
  SCOPED_TRACE(seed_trace());
  GatingBwdCase c(3, 5, 3);
  c.expert_idx = Tensor::from_i32({3, 3}, {2, 2, 4, 0, 1, 0, 3, 3, 3});
  c.rsf = 1.7;
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference("gradX with duplicate ids");
}

// renorm is ignored by sigmoid and sqrt-softplus (§1.4, L20): any value gives the same bits.
TEST(MoeGatingTopKBackward, RenormIsIgnored) {
  for (int64_t nt : {1, 2}) {
    GatingBwdCase a(4, 9, 3, ACL_FLOAT, 7), b(4, 9, 3, ACL_FLOAT, 7);
    a.norm_type = b.norm_type = nt;
    a.renorm = 0;
    b.renorm = 5;
    ASSERT_TRUE(run_ok(a));
    ASSERT_TRUE(run_ok(b));
    expect_bitwise_equal(a.out, b.out, "renorm 0 vs 5");
  }
}

// A selected expert with x_norm exactly 0 or 1 gets exactly 0 (§1.7).
TEST(MoeGatingTopKBackward, SaturatedScoresGiveZero) {
  GatingBwdCase c(2, 4, 2);
  c.x_norm.set({1.0, 0.3, 0.6, 0.2, 0.0, 0.4, 0.5, 0.7});
  c.expert_idx = Tensor::from_i32({2, 2}, {0, 2, 0, 3});
  c.grad_y.set({0.7, -1.3, 0.9, 0.4});
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(c.out.get(0), 0.0);
  EXPECT_EQ(c.out.get(4), 0.0);
  c.check_against_reference("saturated");
}

// D4: zero tokens succeed with an empty output.
TEST(MoeGatingTopKBackward, ZeroTokens) {
  GatingBwdCase c(0, 8, 2);
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(c.out.numel(), 0);
}

// D16: bitwise identical with 1 and 2 threads (enough rows that 2 threads split the work).
TEST(MoeGatingTopKBackward, DeterministicAcrossThreads) {
  GatingBwdCase one(1024, 64, 6, ACL_BF16, 77), two(1024, 64, 6, ACL_BF16, 77);
  one.rsf = two.rsf = 2.5;
  expect_deterministic_across_threads(one, two);
  GatingBwdCase f1(600, 128, 8, ACL_FLOAT, 78), f2(600, 128, 8, ACL_FLOAT, 78);
  expect_deterministic_across_threads(f1, f2);
}

TEST(MoeGatingTopKBackward, WorkspaceSizeIdempotent) {
  GatingBwdCase c;
  expect_workspace_idempotent(c);
}

}  // namespace
