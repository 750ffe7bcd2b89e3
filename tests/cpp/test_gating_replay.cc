// aclnnMoeGatingReplay through the C API (docs/operators.md §2.8, decisions D33, D34): the
// validation rules (dtypes/layout 161002, shapes and attributes 561002, host ids 161002 naming
// row and value), values against the float64 reference, and replaying the forward's own ids
// gives the forward's weights bit for bit.
#include "reference.h"
#include "test_util.h"

using namespace mgt;

namespace {

struct ReplayCase : OpCase {
  Tensor x, expert_idx, bias, y, norm_out;
  int64_t renorm = 0, norm_type = 0;
  double rsf = 1.0, eps = 1e-20;
  bool no_renorm = false;
  int64_t M, N, K;

  ReplayCase(int64_t m = 3, int64_t n = 8, int64_t k = 2, aclDataType dt = ACL_FLOAT,
             uint32_t salt = 5)
      : M(m), N(n), K(k) {
    Rng rng(salt);
    x = Tensor::from({M, N}, dt, rng.uniform_vec(M * N, -3.0, 3.0));
    std::vector<int32_t> idx;
    for (int64_t i = 0; i < M; ++i) {
      std::vector<int32_t> p = rng.permutation(static_cast<int32_t>(N));
      idx.insert(idx.end(), p.begin(), p.begin() + K);
    }
    expert_idx = Tensor::from_i32({M, K}, idx);
    alloc_outputs();
  }
  void alloc_outputs() {
    y = Tensor({M, K}, x.dtype());
    norm_out = Tensor({M, N}, ACL_FLOAT);
  }
  aclnnStatus stage1(uint64_t* ws, aclOpExecutor** ex) override {
    return aclnnMoeGatingReplayGetWorkspaceSize(x.handle(), expert_idx.handle(), bias.handle(),
                                                renorm, norm_type, rsf, eps, no_renorm,
                                                y.handle(), norm_out.handle(), ws, ex);
  }
  aclnnStatus stage2(void* ws, uint64_t size, aclOpExecutor* ex) override {
    return aclnnMoeGatingReplay(ws, size, ex, nullptr);
  }
  std::vector<Tensor*> outputs() override { return {&y, &norm_out}; }

  void check_against_reference(const std::string& what) {
    std::vector<int32_t> idx(M * K);
    for (int64_t i = 0; i < M * K; ++i) idx[i] = expert_idx.i32(i);
    ref::GatingReplay r = ref::gating_replay(x.values(), idx, M, N, K, norm_type, renorm,
                                             no_renorm, static_cast<float>(rsf),
                                             static_cast<float>(eps));
    expect_close(y, r.y, what + " y", {}, static_cast<double>(K + (norm_type == 0 ? N : 0)));
    expect_close(norm_out, r.norm_out, what + " norm_out", {}, static_cast<double>(N));
  }
};

using R = Rule<ReplayCase>;
constexpr aclnnStatus kNull = ACLNN_ERR_PARAM_NULLPTR;
constexpr aclnnStatus kInv = ACLNN_ERR_PARAM_INVALID;
constexpr aclnnStatus kTiling = ACLNN_ERR_INNER_TILING_ERROR;

void with_ids(ReplayCase& c, std::vector<int64_t> shape, const std::vector<int32_t>& v) {
  c.expert_idx = Tensor::from_i32(std::move(shape), v);
}

const std::vector<R> kRules = {
    {"NullX", [](ReplayCase& c) { c.x = Tensor(); }, kNull, "x"},
    {"NullExpertIdx", [](ReplayCase& c) { c.expert_idx = Tensor(); }, kNull, "expert_idx|expertIdx"},
    {"NullY", [](ReplayCase& c) { c.y = Tensor(); }, kNull, "y|yOut"},
    {"NullNormOut", [](ReplayCase& c) { c.norm_out = Tensor(); }, kNull, "norm_out|normOut"},
    {"XInt32", [](ReplayCase& c) { c.x = Tensor({3, 8}, ACL_INT32); c.y = Tensor({3, 2}, ACL_INT32); }, kInv, "x"},
    {"ExpertIdxInt64", [](ReplayCase& c) { c.expert_idx = Tensor({3, 2}, ACL_INT64); }, kInv, "expert_idx|expertIdx"},
    {"ExpertIdxFloat", [](ReplayCase& c) { c.expert_idx = Tensor({3, 2}, ACL_FLOAT); }, kInv, "expert_idx|expertIdx"},
    {"BiasDtypeNotX", [](ReplayCase& c) { c.bias = Tensor({8}, ACL_FLOAT16); }, kInv, "bias"},
    {"YDtypeNotX", [](ReplayCase& c) { c.y = Tensor({3, 2}, ACL_BF16); }, kInv, "y|yOut"},
    {"NormOutFp16", [](ReplayCase& c) { c.norm_out = Tensor({3, 8}, ACL_FLOAT16); }, kInv, "norm_out|normOut"},
    {"XStrided", [](ReplayCase& c) { c.x = Tensor::strided({3, 8}, ACL_FLOAT); }, kInv, "x"},
    {"XFormatNZ", [](ReplayCase& c) { c.x = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 8}, ACL_FLOAT); }, kInv, "x"},
    {"ExpertIdxStrided", [](ReplayCase& c) { c.expert_idx = Tensor::strided({3, 2}, ACL_INT32); }, kInv, "expert_idx|expertIdx"},
    {"ExpertIdxFormatNZ", [](ReplayCase& c) { c.expert_idx = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {3, 2}, ACL_INT32); }, kInv, "expert_idx|expertIdx"},
    {"XRank1", [](ReplayCase& c) { c.x = Tensor({8}, ACL_FLOAT); }, kTiling, "x"},
    {"N2049", [](ReplayCase& c) { c.x = Tensor({3, 2049}, ACL_FLOAT); c.norm_out = Tensor({3, 2049}, ACL_FLOAT); }, kTiling, "x", {"2049"}},
    {"ExpertIdxRank1", [](ReplayCase& c) { c.expert_idx = Tensor::from_i32({6}, {0, 1, 2, 3, 4, 5}); }, kTiling, "expert_idx|expertIdx"},
    {"ExpertIdxRowsNotM", [](ReplayCase& c) { with_ids(c, {4, 2}, {0, 1, 2, 3, 4, 5, 6, 7}); }, kTiling, "expert_idx|expertIdx", {"4"}},
    {"KAboveN", [](ReplayCase& c) {
       c.x = Tensor({3, 2}, ACL_FLOAT); c.norm_out = Tensor({3, 2}, ACL_FLOAT);
       with_ids(c, {3, 3}, {0, 1, 0, 0, 1, 0, 0, 1, 0}); c.y = Tensor({3, 3}, ACL_FLOAT);
     }, kTiling, "expert_idx|expertIdx", {"3"}},
    {"KZero", [](ReplayCase& c) { c.expert_idx = Tensor({3, 0}, ACL_INT32); c.y = Tensor({3, 0}, ACL_FLOAT); }, kTiling, "expert_idx|expertIdx"},
    {"BiasLengthNotN", [](ReplayCase& c) { c.bias = Tensor({7}, ACL_FLOAT); }, kTiling, "bias", {"7"}},
    {"NormType3", [](ReplayCase& c) { c.norm_type = 3; }, kTiling, "norm_type|normType", {"3"}},
    {"Renorm2", [](ReplayCase& c) { c.renorm = 2; }, kTiling, "renorm", {"2"}},
    {"RsfNaN", [](ReplayCase& c) { c.rsf = std::nan(""); }, kTiling, "routed_scaling_factor|routedScalingFactor"},
    {"EpsInf", [](ReplayCase& c) { c.eps = INFINITY; }, kTiling, "eps"},
    {"YShapeNotMK", [](ReplayCase& c) { c.y = Tensor({3, 3}, ACL_FLOAT); }, kTiling, "y|yOut"},
    {"NormOutShapeNotMN", [](ReplayCase& c) { c.norm_out = Tensor({3, 7}, ACL_FLOAT); }, kTiling, "norm_out|normOut"},
    // host ids (D34): range and repeats within a row, 161002 naming the value (and row)
    {"IdEqualsN", [](ReplayCase& c) { with_ids(c, {3, 2}, {0, 1, 2, 8, 4, 5}); }, kInv, "expert_idx|expertIdx", {"8"}},
    {"IdNegative", [](ReplayCase& c) { with_ids(c, {3, 2}, {0, 1, -1, 3, 4, 5}); }, kInv, "expert_idx|expertIdx", {"-1"}},
    {"IdTwiceInRow", [](ReplayCase& c) { with_ids(c, {3, 2}, {0, 1, 2, 3, 6, 6}); }, kInv, "expert_idx|expertIdx", {"6", "row 2"}},
};

class GatingReplayRules : public testing::TestWithParam<R> {};

TEST_P(GatingReplayRules, Rejected) {
  ReplayCase c;
  GetParam().mutate(c);
  expect_rejected(c, GetParam().code, GetParam().arg, GetParam().words);
}

INSTANTIATE_TEST_SUITE_P(MoeGatingReplay, GatingReplayRules, testing::ValuesIn(kRules),
                         rule_name<ReplayCase>);

TEST(MoeGatingReplay, BaselineOfRuleTableIsValid) {
  ReplayCase c;
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference("baseline");
  // The same id in two different rows is fine.
  with_ids(c, {3, 2}, {0, 1, 0, 1, 1, 0});
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference("ids shared across rows");
}

struct ReplayConfig {
  const char* name;
  int64_t M, N, K, norm_type, renorm;
  bool no_renorm, bias;
  double rsf, eps;
};

class GatingReplayValues
    : public testing::TestWithParam<std::tuple<aclDataType, ReplayConfig>> {};

TEST_P(GatingReplayValues, MatchesFloat64Reference) {
  SCOPED_TRACE(seed_trace());
  const auto [dt, f] = GetParam();
  ReplayCase c(f.M, f.N, f.K, dt, static_cast<uint32_t>(f.N * 13 + f.K));
  c.norm_type = f.norm_type;
  c.renorm = f.renorm;
  c.no_renorm = f.no_renorm;
  c.rsf = f.rsf;
  c.eps = f.eps;
  if (f.bias) c.bias = Tensor::from({f.N}, dt, std::vector<double>(f.N, 100.0));
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference(f.name);
}

INSTANTIATE_TEST_SUITE_P(
    MoeGatingReplay, GatingReplayValues,
    testing::Combine(
        testing::Values(ACL_FLOAT, ACL_FLOAT16, ACL_BF16),
        testing::Values(
            ReplayConfig{"softmax", 5, 16, 4, 0, 0, false, false, 1.0, 1e-20},
            ReplayConfig{"softmax_renorm", 4, 16, 3, 0, 1, false, true, 2.5, 1e-20},
            ReplayConfig{"softmax_renorm_off", 4, 16, 3, 0, 1, true, false, 2.5, 1e-20},
            ReplayConfig{"sigmoid", 6, 32, 8, 1, 0, false, true, 1.0, 1e-20},
            ReplayConfig{"sigmoid_no_renorm", 6, 32, 8, 1, 0, true, false, -1.5, 1e-20},
            ReplayConfig{"sigmoid_k1_no_renorm", 7, 5, 1, 1, 0, true, false, 1.0, 1e-20},
            ReplayConfig{"sqrt_softplus", 3, 12, 12, 2, 0, false, false, 0.5, 1e-10},
            ReplayConfig{"sqrt_softplus_no_renorm", 3, 12, 5, 2, 0, true, false, 0.5, 1e-10},
            ReplayConfig{"n2_k2", 9, 2, 2, 1, 0, false, false, 1.0, 1e-20},
            ReplayConfig{"n1_k1", 4, 1, 1, 0, 0, false, false, 1.0, 1e-20},
            ReplayConfig{"zero_rows", 0, 8, 2, 1, 0, false, false, 1.0, 1e-20},
            ReplayConfig{"n2048", 2, 2048, 8, 0, 1, false, false, 1.0, 1e-20},
            ReplayConfig{"n257_odd", 33, 257, 7, 1, 0, false, false, 2.0, 1e-20})),
    [](const testing::TestParamInfo<std::tuple<aclDataType, ReplayConfig>>& info) {
      return std::string(dt_name(std::get<0>(info.param))) + "_" + std::get<1>(info.param).name;
    });

// The forward's own ids replayed give the forward's weights and scores bit for bit, for every
// norm type with and without renormalisation (selection bias included: it only ranks).
TEST(MoeGatingReplay, ReplayOfForwardIdsIsBitwiseEqual) {
  for (int64_t norm_type : {0, 1, 2}) {
    for (bool no_renorm : {false, true}) {
      for (aclDataType dt : {ACL_FLOAT, ACL_BF16}) {
        const int64_t M = 37, N = 24, K = 6;
        Rng rng(static_cast<uint32_t>(norm_type * 7 + no_renorm));
        Tensor x = Tensor::from({M, N}, dt, rng.uniform_vec(M * N, -4.0, 4.0));
        Tensor bias = Tensor::from({N}, dt, rng.uniform_vec(N, -0.3, 0.3));
        Tensor fy({M, K}, dt), fidx({M, K}, ACL_INT32), fnorm({M, N}, ACL_FLOAT);
        uint64_t ws = 0;
        aclOpExecutor* ex = nullptr;
        ASSERT_EQ(aclnnMoeGatingTopKExGetWorkspaceSize(x.handle(), bias.handle(), K, 1, 1, 0, 1,
                                                       norm_type, true, 1.75, 1e-20, no_renorm,
                                                       fy.handle(), fidx.handle(), fnorm.handle(),
                                                       &ws, &ex),
                  ACLNN_SUCCESS)
            << aclGetRecentErrMsg();
        std::vector<char> mem(ws + 1);
        ASSERT_EQ(aclnnMoeGatingTopKEx(mem.data(), ws, ex, nullptr), ACLNN_SUCCESS);
        ReplayCase c(M, N, K, dt);
        c.x = std::move(x);
        c.bias = std::move(bias);
        c.expert_idx = std::move(fidx);
        c.norm_type = norm_type;
        c.renorm = 1;
        c.no_renorm = no_renorm;
        c.rsf = 1.75;
        c.alloc_outputs();
        ASSERT_TRUE(run_ok(c));
        for (int64_t i = 0; i < M * K; ++i) {
          ASSERT_EQ(c.y.get(i), fy.get(i)) << "norm_type " << norm_type << " slot " << i;
        }
        for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(c.norm_out.get(i), fnorm.get(i));
      }
    }
  }
}

// D16: bitwise identical with 1 and 2 threads.
TEST(MoeGatingReplay, DeterministicAcrossThreads) {
  ReplayCase one(1024, 64, 6, ACL_FLOAT16), two(1024, 64, 6, ACL_FLOAT16);
  moegradSetNumThreads(1);
  ASSERT_TRUE(run_ok(one));
  moegradSetNumThreads(2);
  ASSERT_TRUE(run_ok(two));
  moegradSetNumThreads(0);
  for (int64_t i = 0; i < one.y.numel(); ++i) ASSERT_EQ(one.y.get(i), two.y.get(i));
  for (int64_t i = 0; i < one.norm_out.numel(); ++i) {
    ASSERT_EQ(one.norm_out.get(i), two.norm_out.get(i));
  }
}

}  // namespace
