// aclnnMoeFinalizeRoutingBiasGrad (moegrad extension, decisions D23, docs/decisions.md L22): the
// gradient of finalize routing's bias, a per-expert sum of scale * grad_y over the slots that use
// the expert (dropped slots included), against a float64 loop; validation rules (dtypes/layout
// 161002, shapes/values 561103), determinism across threads, skewed expert loads.
#include "reference.h"
#include "test_util.h"

using namespace mgt;

namespace {

struct BiasGradCase : OpCase {
  Tensor grad_y, expert_idx, scales, grad_bias;
  int64_t R, K, H, E;

  BiasGradCase(int64_t r = 5, int64_t k = 2, int64_t h = 6, int64_t e = 3,
               aclDataType dt = ACL_FLOAT, aclDataType sdt = ACL_FLOAT, uint32_t salt = 3)
      : R(r), K(k), H(h), E(e) {
    Rng rng(salt);
    std::vector<double> gy(R * H);
    for (auto& v : gy) v = rng.signed_uniform(0.05, 2.0);
    grad_y = Tensor::from({R, H}, dt, gy);
    std::vector<int32_t> eid(R * K);
    for (auto& v : eid) v = static_cast<int32_t>(rng.integer(0, E - 1));
    expert_idx = Tensor::from_i32({R, K}, eid);
    scales = Tensor::from({R, K}, sdt, rng.uniform_vec(R * K, -1.5, 1.5));
    grad_bias = Tensor({E, H}, dt);
  }
  aclnnStatus stage1(uint64_t* ws, aclOpExecutor** ex) override {
    return aclnnMoeFinalizeRoutingBiasGradGetWorkspaceSize(grad_y.handle(), expert_idx.handle(),
                                                           scales.handle(), E, grad_bias.handle(),
                                                           ws, ex);
  }
  aclnnStatus stage2(void* ws, uint64_t size, aclOpExecutor* ex) override {
    return aclnnMoeFinalizeRoutingBiasGrad(ws, size, ex, nullptr);
  }
  std::vector<Tensor*> outputs() override { return {&grad_bias}; }

  void check_against_reference(const std::string& what) {
    std::vector<double> ref(E * H, 0.0), mag(E * H, 0.0);
    int64_t max_count = 1;
    std::vector<int64_t> count(E, 0);
    for (int64_t i = 0; i < R * K; ++i) {
      const int32_t e = expert_idx.i32(i);
      const double s = scales.is_null() ? 1.0 : scales.get(i);
      max_count = std::max(max_count, ++count[e]);
      for (int64_t j = 0; j < H; ++j) {
        ref[e * H + j] += s * grad_y.get((i / K) * H + j);
        mag[e * H + j] += std::fabs(s * grad_y.get((i / K) * H + j));
      }
    }
    expect_close(grad_bias, ref, what, mag, static_cast<double>(max_count));
  }
};

using R_ = Rule<BiasGradCase>;
constexpr aclnnStatus kNull = ACLNN_ERR_PARAM_NULLPTR;
constexpr aclnnStatus kInv = ACLNN_ERR_PARAM_INVALID;
constexpr aclnnStatus kShape = ACLNN_ERR_INNER_NULLPTR;

const std::vector<R_> kRules = {
    {"NullGradY", [](BiasGradCase& c) { c.grad_y = Tensor(); }, kNull, "grad_y|gradY"},
    {"NullExpertIdx", [](BiasGradCase& c) { c.expert_idx = Tensor(); }, kNull, "expert_idx|expertIdx"},
    {"NullGradBias", [](BiasGradCase& c) { c.grad_bias = Tensor(); }, kNull, "grad_bias|gradBiasOut"},
    {"NullWorkspaceSize", [](BiasGradCase& c) { c.null_workspace_size = true; }, kNull, "workspaceSize"},
    {"NullExecutor", [](BiasGradCase& c) { c.null_executor = true; }, kNull, "executor"},
    {"GradYDouble", [](BiasGradCase& c) { c.grad_y = Tensor({5, 6}, ACL_DOUBLE); }, kInv, "grad_y|gradY"},
    {"ExpertIdxInt64", [](BiasGradCase& c) { c.expert_idx = Tensor({5, 2}, ACL_INT64); }, kInv, "expert_idx|expertIdx"},
    {"ScalesInt32", [](BiasGradCase& c) { c.scales = Tensor({5, 2}, ACL_INT32); }, kInv, "scales"},
    {"GradBiasFp16", [](BiasGradCase& c) { c.grad_bias = Tensor({3, 6}, ACL_FLOAT16); }, kInv, "grad_bias|gradBiasOut"},
    {"GradYStrided", [](BiasGradCase& c) { c.grad_y = Tensor::strided({5, 6}, ACL_FLOAT); }, kInv, "grad_y|gradY"},
    {"GradYFormatNZ", [](BiasGradCase& c) { c.grad_y = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {5, 6}, ACL_FLOAT); }, kInv, "grad_y|gradY"},
    {"GradYRank3", [](BiasGradCase& c) { c.grad_y = Tensor({5, 6, 1}, ACL_FLOAT); }, kShape, "grad_y|gradY"},
    {"ExpertIdxRows", [](BiasGradCase& c) { c.expert_idx = Tensor({4, 2}, ACL_INT32); }, kShape, "expert_idx|expertIdx"},
    {"ExpertIdxK0", [](BiasGradCase& c) { c.expert_idx = Tensor({5, 0}, ACL_INT32); c.scales = Tensor(); }, kShape, "expert_idx|expertIdx"},
    {"ScalesShape", [](BiasGradCase& c) { c.scales = Tensor({5, 3}, ACL_FLOAT); }, kShape, "scales"},
    {"ExpertNum0", [](BiasGradCase& c) { c.E = 0; c.grad_bias = Tensor({0, 6}, ACL_FLOAT); }, kShape, "expert_num|expertNum"},
    {"GradBiasRows", [](BiasGradCase& c) { c.grad_bias = Tensor({4, 6}, ACL_FLOAT); }, kShape, "grad_bias|gradBiasOut"},
    {"GradBiasCols", [](BiasGradCase& c) { c.grad_bias = Tensor({3, 5}, ACL_FLOAT); }, kShape, "grad_bias|gradBiasOut"},
    {"ExpertIdxEqualsE", [](BiasGradCase& c) { c.expert_idx.set_i32(7, 3); }, kShape, "expert_idx|expertIdx", {"3", "7"}},
    {"ExpertIdxNegative", [](BiasGradCase& c) { c.expert_idx.set_i32(2, -1); }, kShape, "expert_idx|expertIdx", {"-1", "2"}},
};

class BiasGradRules : public testing::TestWithParam<R_> {};

TEST_P(BiasGradRules, Rejected) {
  BiasGradCase c;
  GetParam().mutate(c);
  expect_rejected(c, GetParam().code, GetParam().arg, GetParam().words);
}

INSTANTIATE_TEST_SUITE_P(MoeFinalizeRoutingBiasGrad, BiasGradRules, testing::ValuesIn(kRules),
                         rule_name<BiasGradCase>);

TEST(MoeFinalizeRoutingBiasGrad, BaselineOfRuleTableIsValid) {
  BiasGradCase c;
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference("baseline");
}

struct BiasShape {
  int64_t R, K, H, E;
};

class BiasGradValues
    : public testing::TestWithParam<std::tuple<aclDataType, aclDataType, BiasShape, bool>> {};

TEST_P(BiasGradValues, MatchesFloat64Reference) {
  SCOPED_TRACE(seed_trace());
  const auto [dt, sdt, s, with_scales] = GetParam();
  BiasGradCase c(s.R, s.K, s.H, s.E, dt, sdt, static_cast<uint32_t>(s.R * 7 + s.H));
  if (!with_scales) c.scales = Tensor();
  ASSERT_TRUE(run_ok(c));
  c.check_against_reference("grad_bias");
}

INSTANTIATE_TEST_SUITE_P(
    MoeFinalizeRoutingBiasGrad, BiasGradValues,
    testing::Combine(testing::Values(ACL_FLOAT, ACL_FLOAT16, ACL_BF16),
                     testing::Values(ACL_FLOAT, ACL_BF16),
                     testing::Values(BiasShape{5, 2, 6, 3}, BiasShape{1, 1, 1, 1},
                                     BiasShape{7, 4, 4099, 2}, BiasShape{33, 3, 17, 64},
                                     BiasShape{0, 2, 8, 4}),
                     testing::Bool()),
    [](const testing::TestParamInfo<BiasGradValues::ParamType>& info) {
      const auto& s = std::get<2>(info.param);
      return std::string(dt_name(std::get<0>(info.param))) + "_s" +
             dt_name(std::get<1>(info.param)) + "_R" + std::to_string(s.R) + "_H" +
             std::to_string(s.H) + "_E" + std::to_string(s.E) +
             (std::get<3>(info.param) ? "_scales" : "_noscales");
    });

// Experts no slot uses get exactly zero; all slots on one expert (a skewed load) still sum in
// slot order.
TEST(MoeFinalizeRoutingBiasGrad, UnusedExpertsZeroAndSkewedLoad) {
  BiasGradCase c(40, 2, 9, 5);
  for (int64_t i = 0; i < 80; ++i) c.expert_idx.set_i32(i, i % 7 == 0 ? 4 : 1);
  ASSERT_TRUE(run_ok(c));
  for (int64_t e : {0, 2, 3}) {
    for (int64_t j = 0; j < 9; ++j) EXPECT_EQ(c.grad_bias.get(e * 9 + j), 0.0) << e << "," << j;
  }
  c.check_against_reference("skewed");
}

// D16: 1 vs 2 threads give the same bits (enough tiles that two threads split them).
TEST(MoeFinalizeRoutingBiasGrad, DeterministicAcrossThreads) {
  BiasGradCase one(512, 4, 300, 8, ACL_BF16, ACL_FLOAT, 5), two(512, 4, 300, 8, ACL_BF16, ACL_FLOAT, 5);
  expect_deterministic_across_threads(one, two);
  BiasGradCase a(300, 2, 5000, 2, ACL_FLOAT, ACL_FLOAT, 6), b(300, 2, 5000, 2, ACL_FLOAT, ACL_FLOAT, 6);
  expect_deterministic_across_threads(a, b);
}

TEST(MoeFinalizeRoutingBiasGrad, WorkspaceSizeIdempotentAndChecked) {
  BiasGradCase c;
  expect_workspace_idempotent(c);
  uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(c.stage1(&ws, &ex), ACLNN_SUCCESS);
  EXPECT_GT(ws, 0u);
  EXPECT_EQ(c.stage2(nullptr, 0, ex), ACLNN_ERR_PARAM_INVALID);  // too small a workspace
}

}  // namespace
