// Hostile input through the C API (docs/decisions.md L50-L53): overflowing sizes and counts,
// errors that must name the argument that is actually wrong, attributes outside their range,
// and dtype messages that name the dtype seen once.
#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>

#include <moegrad/moegrad.h>

#include "test_util.h"

using namespace mgt;

namespace {

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();

// Stage one of a call that must fail: the status, the argument named first in the message
// ("<op>: <arg>: ..."), and no executor.
void expect_fails(aclnnStatus st, aclOpExecutor* ex, aclnnStatus code, const std::string& arg) {
  const std::string msg = aclGetRecentErrMsg();
  EXPECT_EQ(st, code) << msg;
  const size_t colon = msg.find(": ");
  ASSERT_NE(colon, std::string::npos) << msg;
  const size_t colon2 = msg.find(": ", colon + 2);
  ASSERT_NE(colon2, std::string::npos) << msg;
  EXPECT_EQ(msg.substr(colon + 2, colon2 - colon - 2), arg) << "blamed the wrong argument: " << msg;
  EXPECT_EQ(ex, nullptr);
}

// ---- the wrong argument is named (L50) ----

TEST(Blame, GatingBackwardNamesXNormWhenItsTokenCountIsTheOddOneOut) {
  Tensor x_norm({5, 8}, ACL_FLOAT), grad_y({4, 2}, ACL_FLOAT), idx({4, 2}, ACL_INT32),
      out({4, 8}, ACL_FLOAT);
  uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  aclnnStatus st = aclnnMoeGatingTopKBackwardGetWorkspaceSize(
      x_norm.handle(), grad_y.handle(), idx.handle(), 0, 1, 1.0, 1e-20, out.handle(), &ws, &ex);
  expect_fails(st, ex, ACLNN_ERR_PARAM_INVALID, "x_norm");
  EXPECT_TRUE(has_word(aclGetRecentErrMsg(), "5")) << aclGetRecentErrMsg();
}

TEST(Blame, GatingBackwardNamesExpertIdxOrGradYForTheirOwnDims) {
  Tensor x_norm({4, 8}, ACL_FLOAT), grad_y({4, 2}, ACL_FLOAT), idx({3, 2}, ACL_INT32),
      out({4, 8}, ACL_FLOAT);
  uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  aclnnStatus st = aclnnMoeGatingTopKBackwardGetWorkspaceSize(
      x_norm.handle(), grad_y.handle(), idx.handle(), 0, 1, 1.0, 1e-20, out.handle(), &ws, &ex);
  expect_fails(st, ex, ACLNN_ERR_PARAM_INVALID, "expert_idx");
  Tensor gy2({3, 2}, ACL_FLOAT), idx2({4, 2}, ACL_INT32);
  st = aclnnMoeGatingTopKBackwardGetWorkspaceSize(x_norm.handle(), gy2.handle(), idx2.handle(), 0,
                                                  1, 1.0, 1e-20, out.handle(), &ws, &ex);
  expect_fails(st, ex, ACLNN_ERR_PARAM_INVALID, "grad_y");
}

struct Finalize {
  int64_t R = 3, K = 2, H = 4, E = 3;
  Tensor ex{{6, 4}, ACL_FLOAT}, idx, x1{{3, 4}, ACL_FLOAT}, scales{{3, 2}, ACL_FLOAT},
      eidx{{3, 2}, ACL_INT32}, bias{{3, 4}, ACL_FLOAT}, out{{3, 4}, ACL_FLOAT};
  Finalize() : idx(Tensor::from_i32({6}, {0, 1, 2, 3, 4, 5})) {}
  aclnnStatus call(aclOpExecutor** e) {
    uint64_t ws = 0;
    return aclnnMoeFinalizeRoutingV2GetWorkspaceSize(ex.handle(), idx.handle(), x1.handle(),
                                                     nullptr, bias.handle(), scales.handle(),
                                                     eidx.handle(), 0, out.handle(), &ws, e);
  }
};

TEST(Blame, FinalizeForwardNamesOutWhenOnlyOutHasAnotherTokenCount) {
  Finalize f;
  f.out = Tensor({2, 4}, ACL_FLOAT);
  aclOpExecutor* ex = nullptr;
  expect_fails(f.call(&ex), ex, ACLNN_ERR_INNER_NULLPTR, "out");
}

TEST(Blame, FinalizeForwardNamesScalesWhenTheOthersAgree) {
  Finalize f;
  f.scales = Tensor({2, 2}, ACL_FLOAT);
  aclOpExecutor* ex = nullptr;
  expect_fails(f.call(&ex), ex, ACLNN_ERR_INNER_NULLPTR, "scales");
}

TEST(Blame, FinalizeForwardNamesX1ForAWrongHiddenSize) {
  Finalize f;
  f.x1 = Tensor({3, 5}, ACL_FLOAT);
  aclOpExecutor* ex = nullptr;
  expect_fails(f.call(&ex), ex, ACLNN_ERR_INNER_NULLPTR, "x1");
}

TEST(Blame, FinalizeForwardWithoutScalesNamesTheIndexNotAnAbsentExpertIdx) {
  // Only the index and out: R = 3 from out, an empty index gives K = 0.
  Finalize f;
  f.idx = Tensor({0}, ACL_INT32);
  f.x1 = Tensor();
  f.scales = Tensor();
  f.eidx = Tensor();
  f.bias = Tensor();
  aclOpExecutor* ex = nullptr;
  expect_fails(f.call(&ex), ex, ACLNN_ERR_INNER_NULLPTR, "expanded_row_idx");
}

struct FinalizeGrad {
  Tensor gy{{3, 4}, ACL_FLOAT}, idx, ex{{6, 4}, ACL_FLOAT}, scales{{3, 2}, ACL_FLOAT},
      eidx{{3, 2}, ACL_INT32}, bias{{3, 4}, ACL_FLOAT}, gex{{6, 4}, ACL_FLOAT},
      gs{{3, 2}, ACL_FLOAT};
  int64_t mode = 0, active = 0, E = 0, C = 0;
  FinalizeGrad() : idx(Tensor::from_i32({6}, {0, 1, 2, 3, 4, 5})) {}
  aclnnStatus call(aclOpExecutor** e) {
    uint64_t ws = 0;
    return aclnnMoeFinalizeRoutingV2GradGetWorkspaceSize(
        gy.handle(), idx.handle(), ex.handle(), scales.handle(), eidx.handle(), bias.handle(),
        mode, active, E, C, gex.handle(), gs.handle(), &ws, e);
  }
};

TEST(Blame, FinalizeGradNamesGradYWhenScalesAndExpertIdxAgree) {
  FinalizeGrad f;
  f.gy = Tensor({2, 4}, ACL_FLOAT);
  aclOpExecutor* ex = nullptr;
  expect_fails(f.call(&ex), ex, ACLNN_ERR_INNER_NULLPTR, "grad_y");
}

TEST(Blame, FinalizeGradNamesGradYForAWrongHiddenSize) {
  FinalizeGrad f;
  f.gy = Tensor({3, 5}, ACL_FLOAT);
  aclOpExecutor* ex = nullptr;
  expect_fails(f.call(&ex), ex, ACLNN_ERR_INNER_NULLPTR, "grad_y");
}

TEST(Blame, FinalizeGradNamesExpertIdxForAWrongTopK) {
  FinalizeGrad f;
  f.eidx = Tensor({3, 3}, ACL_INT32);
  aclOpExecutor* ex = nullptr;
  expect_fails(f.call(&ex), ex, ACLNN_ERR_INNER_NULLPTR, "expert_idx");
}

TEST(Blame, SwigluGradNamesXWhenGradYAndYOriginAgree) {
  Tensor gy({4, 3}, ACL_FLOAT), x({5, 6}, ACL_FLOAT), w({4}, ACL_FLOAT), yo({4, 3}, ACL_FLOAT),
      gx({5, 6}, ACL_FLOAT), gw({4}, ACL_FLOAT);
  uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  aclnnStatus st = aclnnSwigluGroupQuantGradGetWorkspaceSize(
      gy.handle(), x.handle(), w.handle(), yo.handle(), nullptr, -1.0, gx.handle(), gw.handle(),
      &ws, &ex);
  expect_fails(st, ex, ACLNN_ERR_INNER_TILING_ERROR, "x");
  // x's last dim is 2H: a grad_y whose H disagrees with x and y_origin is named.
  Tensor gy2({4, 2}, ACL_FLOAT), x2({4, 6}, ACL_FLOAT), gx2({4, 6}, ACL_FLOAT);
  st = aclnnSwigluGroupQuantGradGetWorkspaceSize(gy2.handle(), x2.handle(), w.handle(),
                                                 yo.handle(), nullptr, -1.0, gx2.handle(),
                                                 gw.handle(), &ws, &ex);
  expect_fails(st, ex, ACLNN_ERR_INNER_TILING_ERROR, "grad_y");
}

// ---- attributes outside their range (L51) ----

TEST(Attributes, FinalizeGradIgnoresANegativeActiveNum) {
  // §3.4: only 0 < active_num < R*K truncates; any other value is ignored.
  for (int64_t a : {int64_t{-1}, -(int64_t{1} << 40)}) {
    FinalizeGrad f;
    f.active = a;
    aclOpExecutor* ex = nullptr;
    EXPECT_EQ(f.call(&ex), ACLNN_SUCCESS) << a;
    EXPECT_NE(ex, nullptr);
    aclDestroyAclOpExecutor(ex);
  }
}

TEST(Attributes, FinalizeGradHugeCapacityIsAnErrorNotAnOverflow) {
  FinalizeGrad f;
  f.mode = 1;
  f.E = int64_t{1} << 40;
  f.C = int64_t{1} << 40;  // E * C = 2^80 does not fit in int64
  f.idx = Tensor::from_i32({6}, {0, 1, 2, 3, 4, -1});
  f.ex = Tensor({1, 6, 4}, ACL_FLOAT);
  f.gex = Tensor({1, 6, 4}, ACL_FLOAT);
  f.bias = Tensor();
  aclOpExecutor* ex = nullptr;
  expect_fails(f.call(&ex), ex, ACLNN_ERR_INNER_NULLPTR, "expert_capacity");
  f.E = kI64Max;
  f.C = kI64Max;
  expect_fails(f.call(&ex), ex, ACLNN_ERR_INNER_NULLPTR, "expert_capacity");
}

// ---- overflowing sizes and counts (L52) ----

TEST(Overflow, CreateTensorRefusesAByteSizeThatDoesNotFitInInt64) {
  const int64_t dims[2] = {int64_t{1} << 40, int64_t{1} << 40};
  aclTensor* t = aclCreateTensor(dims, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, dims, 2, nullptr);
  EXPECT_EQ(t, nullptr);
  EXPECT_TRUE(has_word(aclGetRecentErrMsg(), "viewDims")) << aclGetRecentErrMsg();
  const int64_t dims1[1] = {kI64Max / 2};  // fits as a count, not as float32 bytes
  t = aclCreateTensor(dims1, 1, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, dims1, 1, nullptr);
  EXPECT_EQ(t, nullptr);
  const int64_t one = 1;
  t = aclCreateTensor(&one, 1, ACL_FLOAT, nullptr, kI64Max / 2, ACL_FORMAT_ND, &one, 1, nullptr);
  EXPECT_EQ(t, nullptr);
  EXPECT_TRUE(has_word(aclGetRecentErrMsg(), "offset")) << aclGetRecentErrMsg();
}

TEST(Overflow, ZeroSizedTensorsWithHugeDimsAreEmptyNotOverflowing) {
  // [2^40, 2^40, 0, 2]: no element, but the product of the first two dims overflows int64.
  Tensor x({int64_t{1} << 40, int64_t{1} << 40, 0, 2}, ACL_FLOAT);
  Tensor y({int64_t{1} << 40, int64_t{1} << 40, 0, 1}, ACL_FLOAT);
  uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(aclnnSwigluGroupGetWorkspaceSize(x.handle(), nullptr, nullptr, -1.0, y.handle(), &ws,
                                             &ex),
            ACLNN_SUCCESS)
      << aclGetRecentErrMsg();
  EXPECT_EQ(aclnnSwigluGroup(nullptr, 0, ex, nullptr), ACLNN_SUCCESS) << aclGetRecentErrMsg();
}

// SwiGLU forward rows kept for a group_index: the sum is exact, then clamped to [0, T].
int64_t rows_kept(const std::vector<int64_t>& counts, int64_t T = 6) {
  const int64_t H = 3;
  std::vector<double> xs(static_cast<size_t>(T * 2 * H), 1.0);
  Tensor x = Tensor::from({T, 2 * H}, ACL_FLOAT, xs);
  Tensor gi = Tensor::from_i64({static_cast<int64_t>(counts.size())}, counts);
  Tensor y({T, H}, ACL_FLOAT);
  y.poison();
  uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  EXPECT_EQ(aclnnSwigluGroupGetWorkspaceSize(x.handle(), nullptr, gi.handle(), -1.0, y.handle(),
                                             &ws, &ex),
            ACLNN_SUCCESS)
      << aclGetRecentErrMsg();
  EXPECT_EQ(aclnnSwigluGroup(nullptr, 0, ex, nullptr), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  int64_t kept = 0;
  for (int64_t t = 0; t < T; ++t) {
    const bool zero = y.get(t * H) == 0.0;
    if (!zero) kept = t + 1;
    for (int64_t h = 0; h < H; ++h) {
      EXPECT_EQ(y.get(t * H + h) == 0.0, zero) << "row " << t << " partly written";
    }
  }
  return kept;
}

TEST(Overflow, GroupIndexSumsAreExactAndNeverWrap) {
  EXPECT_EQ(rows_kept({2, 1}), 3);
  EXPECT_EQ(rows_kept({kI64Max, kI64Max}), 6);        // would wrap to -2 in int64
  EXPECT_EQ(rows_kept({kI64Max, 1}), 6);              // would wrap to INT64_MIN
  EXPECT_EQ(rows_kept({kI64Min, 5}), 0);              // negative total: nothing kept
  EXPECT_EQ(rows_kept({kI64Min, kI64Min, 4}), 0);     // would wrap to 4
  EXPECT_EQ(rows_kept({kI64Max, kI64Max, kI64Min, kI64Min, 4}), 2);  // exact: -2 + 4
  EXPECT_EQ(rows_kept({int64_t{1} << 62, int64_t{1} << 62, -(int64_t{1} << 62),
                       -(int64_t{1} << 62), 3}),
            3);
}

// ---- found by fuzzing: optional tensors with a null data pointer (L55) ----

TEST(Fuzzed, OptionalTensorsWithNullDataAreRejectedNotRead) {
  // group_index of SwiGLU, bias of the gating forward, expert_idx of finalize routing: each
  // non-empty with a null data pointer was read by the host checks before the fix.
  Tensor x({4, 6}, ACL_FLOAT), y({4, 3}, ACL_FLOAT);
  Tensor gi = Tensor::null_data({2}, ACL_INT64);
  uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  expect_fails(aclnnSwigluGroupGetWorkspaceSize(x.handle(), nullptr, gi.handle(), -1.0,
                                                y.handle(), &ws, &ex),
               ex, ACLNN_ERR_PARAM_NULLPTR, "group_index");
  Tensor gx({4, 8}, ACL_FLOAT), bias = Tensor::null_data({8}, ACL_FLOAT), gy({4, 2}, ACL_FLOAT),
      gidx({4, 2}, ACL_INT32), gn({4, 8}, ACL_FLOAT);
  expect_fails(aclnnMoeGatingTopKGetWorkspaceSize(gx.handle(), bias.handle(), 2, 1, 1, 0, 0, 1,
                                                  false, 1.0, 1e-20, gy.handle(), gidx.handle(),
                                                  gn.handle(), &ws, &ex),
               ex, ACLNN_ERR_PARAM_NULLPTR, "bias");
  Finalize f;
  f.eidx = Tensor::null_data({3, 2}, ACL_INT32);
  expect_fails(f.call(&ex), ex, ACLNN_ERR_PARAM_NULLPTR, "expert_idx");
  // Empty tensors may have a null data pointer.
  Tensor gi0 = Tensor({0}, ACL_INT64);
  ASSERT_EQ(aclnnSwigluGroupGetWorkspaceSize(x.handle(), nullptr, gi0.handle(), -1.0, y.handle(),
                                             &ws, &ex),
            ACLNN_SUCCESS)
      << aclGetRecentErrMsg();
  EXPECT_EQ(aclDestroyAclOpExecutor(ex), ACLNN_SUCCESS);
}

// ---- found by fuzzing: sizes from attributes in the routing extensions (L52) ----

TEST(Fuzzed, InitRoutingGradWithoutTokensAcceptsAnyTopK) {
  Tensor gex({0, 4}, ACL_FLOAT), idx({0}, ACL_INT32), gx({0, 4}, ACL_FLOAT);
  uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(aclnnMoeInitRoutingV2GradGetWorkspaceSize(gex.handle(), idx.handle(), kI64Max, 0, 0,
                                                      gx.handle(), &ws, &ex),
            ACLNN_SUCCESS)
      << aclGetRecentErrMsg();
  EXPECT_EQ(aclnnMoeInitRoutingV2Grad(nullptr, 0, ex, nullptr), ACLNN_SUCCESS)
      << aclGetRecentErrMsg();
}

TEST(Fuzzed, InitRoutingHugeExpertNumIsAnErrorNotAnOverflowedWorkspace) {
  Tensor x({2, 4}, ACL_FLOAT), eidx = Tensor::from_i32({2, 1}, {0, 1}), ex({2, 4}, ACL_FLOAT),
      idx({2}, ACL_INT32);
  uint64_t ws = 0;
  aclOpExecutor* e = nullptr;
  expect_fails(aclnnMoeInitRoutingV2GetWorkspaceSize(x.handle(), eidx.handle(), 0, 0, kI64Max, 0,
                                                     0, false, ex.handle(), idx.handle(), nullptr,
                                                     nullptr, &ws, &e),
               e, ACLNN_ERR_INNER_NULLPTR, "expert_num");
}

TEST(Fuzzed, InitRoutingV3ExpertNumBoundsTheWholeCountingWorkspace) {
  // Found by fuzz_init_routing_v3: the histogram alone stayed below the bound, the histogram
  // plus the starts array did not (a workspace of ~3e18 bytes was planned).
  Tensor x({2, 4}, ACL_FLOAT), eidx = Tensor::from_i32({2, 1}, {0, 1}), ex({2, 4}, ACL_FLOAT),
      idx({2}, ACL_INT32);
  uint64_t ws = 0;
  aclOpExecutor* e = nullptr;
  const int64_t E = int64_t{1} << 58;  // 4 * (E + 1) bytes per array: just above 2^60 each
  expect_fails(aclnnMoeInitRoutingV3GetWorkspaceSize(x.handle(), eidx.handle(), nullptr, nullptr,
                                                     0, 0, E, 0, 1, false, -1, nullptr, 0,
                                                     ex.handle(), idx.handle(), nullptr, nullptr,
                                                     &ws, &e),
               e, ACLNN_ERR_INNER_NULLPTR, "expert_num");
  // A large but plannable E still plans.
  ASSERT_EQ(aclnnMoeInitRoutingV3GetWorkspaceSize(x.handle(), eidx.handle(), nullptr, nullptr, 0,
                                                  0, 1 << 20, 0, 1, false, -1, nullptr, 0,
                                                  ex.handle(), idx.handle(), nullptr, nullptr,
                                                  &ws, &e),
            ACLNN_SUCCESS);
  EXPECT_LT(ws, uint64_t{1} << 30);
  aclDestroyAclOpExecutor(e);
}

TEST(Fuzzed, FinalizeBiasGradNamesTheOddTensorAndBoundsExpertNum) {
  Tensor gy({3, 4}, ACL_FLOAT), eidx = Tensor::from_i32({3, 2}, {0, 1, 2, 0, 1, 2}),
      scales({2, 2}, ACL_FLOAT), gb({3, 4}, ACL_FLOAT);
  uint64_t ws = 0;
  aclOpExecutor* e = nullptr;
  expect_fails(aclnnMoeFinalizeRoutingBiasGradGetWorkspaceSize(gy.handle(), eidx.handle(),
                                                               scales.handle(), 3, gb.handle(),
                                                               &ws, &e),
               e, ACLNN_ERR_INNER_NULLPTR, "scales");
  Tensor gy2({2, 4}, ACL_FLOAT), scales3({3, 2}, ACL_FLOAT);
  expect_fails(aclnnMoeFinalizeRoutingBiasGradGetWorkspaceSize(gy2.handle(), eidx.handle(),
                                                               scales3.handle(), 3, gb.handle(),
                                                               &ws, &e),
               e, ACLNN_ERR_INNER_NULLPTR, "grad_y");
  expect_fails(aclnnMoeFinalizeRoutingBiasGradGetWorkspaceSize(gy.handle(), eidx.handle(),
                                                               scales3.handle(), kI64Max,
                                                               gb.handle(), &ws, &e),
               e, ACLNN_ERR_INNER_NULLPTR, "expert_num");
}

// ---- dtype messages (L53) ----

TEST(DtypeMessages, NameTheDtypeSeenAndTheAcceptedOnesOnce) {
  Tensor x_norm({4, 8}, ACL_FLOAT), grad_y({4, 2}, ACL_FLOAT), idx({4, 2}, ACL_INT64),
      out({4, 8}, ACL_FLOAT);
  uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  aclnnStatus st = aclnnMoeGatingTopKBackwardGetWorkspaceSize(
      x_norm.handle(), grad_y.handle(), idx.handle(), 0, 1, 1.0, 1e-20, out.handle(), &ws, &ex);
  expect_fails(st, ex, ACLNN_ERR_PARAM_INVALID, "expert_idx");
  std::string msg = aclGetRecentErrMsg();
  EXPECT_NE(msg.find("must be int32; got int64"), std::string::npos) << msg;
  // A dtype no operator takes is still named.
  Tensor gy_double({4, 2}, ACL_DOUBLE), idx32({4, 2}, ACL_INT32);
  st = aclnnMoeGatingTopKBackwardGetWorkspaceSize(x_norm.handle(), gy_double.handle(),
                                                  idx32.handle(), 0, 1, 1.0, 1e-20, out.handle(),
                                                  &ws, &ex);
  expect_fails(st, ex, ACLNN_ERR_PARAM_INVALID, "grad_y");
  msg = aclGetRecentErrMsg();
  EXPECT_TRUE(has_word(msg, "float64")) << msg;
  for (const char* name : {"float32", "float16", "bfloat16"}) {
    const size_t first = msg.find(name);
    EXPECT_NE(first, std::string::npos) << msg;
    EXPECT_EQ(msg.find(std::string(name) + ",", first + 1), std::string::npos) << msg;
  }
  Tensor gy_i8({4, 2}, ACL_INT8);
  st = aclnnMoeGatingTopKBackwardGetWorkspaceSize(x_norm.handle(), gy_i8.handle(), idx32.handle(),
                                                  0, 1, 1.0, 1e-20, out.handle(), &ws, &ex);
  EXPECT_TRUE(has_word(aclGetRecentErrMsg(), "int8")) << aclGetRecentErrMsg();
}

}  // namespace

// ---- the C++ API takes TensorViews as given (L232) ----
namespace {

// The Error a C++ call throws (code and message), or {0, ""}.
template <typename F>
std::pair<int32_t, std::string> cpp_error(F&& f) {
  try {
    f();
  } catch (const moegrad::Error& e) {
    return {e.code(), e.what()};
  }
  return {0, ""};
}

}  // namespace

// A rank outside [0, 16] or a negative dim is refused (161002, naming the view) before any rule
// reads the shape: a rank of 2^24 read far past shape[] and crashed; negative dims planned
// negative output shapes.
TEST(CppApi, ViewsWithABadRankOrNegativeDimsAreRefusedByName) {
  std::vector<float> xb(8 * 16, 0.5f), yb(8 * 8), wb(8, 1.0f);
  for (int32_t nd : {17, 1 << 24, -1}) {
    for (bool on_weight : {false, true}) {
      auto x = moegrad::TensorView::contiguous(xb.data(), moegrad::DType::kFloat32, {8, 16});
      auto w = moegrad::TensorView::contiguous(wb.data(), moegrad::DType::kFloat32, {8});
      auto y = moegrad::TensorView::contiguous(yb.data(), moegrad::DType::kFloat32, {8, 8});
      (on_weight ? w : x).ndim = nd;
      auto [code, msg] = cpp_error([&] { moegrad::prepare_swiglu_group(&x, &w, nullptr, {}); });
      EXPECT_EQ(code, ACLNN_ERR_PARAM_INVALID) << nd << ": " << msg;
      const std::string arg = on_weight ? "weight" : "x";
      EXPECT_EQ(msg.rfind("swiglu_group: " + arg + ": rank must be in [0, 16]", 0), 0u) << msg;
      std::tie(code, msg) = cpp_error([&] { moegrad::plan_swiglu_group(&x, &w, nullptr, {}, &y); });
      EXPECT_EQ(code, ACLNN_ERR_PARAM_INVALID) << msg;
    }
  }
  std::vector<int32_t> eb(16);
  auto x = moegrad::TensorView::contiguous(xb.data(), moegrad::DType::kFloat32, {8, 16});
  auto e = moegrad::TensorView::contiguous(eb.data(), moegrad::DType::kInt32, {8, 2});
  x.shape[0] = e.shape[0] = -1000000;
  moegrad::InitRoutingAttrs at;
  at.expert_num = 4;
  auto [code, msg] = cpp_error([&] { moegrad::prepare_moe_init_routing(&x, &e, at); });
  EXPECT_EQ(code, ACLNN_ERR_PARAM_INVALID) << msg;
  EXPECT_EQ(msg.rfind("moe_init_routing: x: dims must be >= 0; got -1000000", 0), 0u) << msg;
}

// A bind-and-run call refused at its third output binds none: the next plain run writes the
// planned outputs, not the refused call's first one.
TEST(CppApi, ARefusedBindLeavesThePlanAsItWas) {
  std::vector<float> xb(8 * 16), y1(8 * 4, -7.f), y2(8 * 4, -7.f), nb(8 * 16), bad(8 * 17);
  std::vector<int32_t> eb(8 * 4);
  for (size_t i = 0; i < xb.size(); ++i) xb[i] = static_cast<float>((i * 37) % 23) - 11.f;
  using moegrad::DType;
  auto x = moegrad::TensorView::contiguous(xb.data(), DType::kFloat32, {8, 16});
  auto y = moegrad::TensorView::contiguous(y1.data(), DType::kFloat32, {8, 4});
  auto yo = moegrad::TensorView::contiguous(y2.data(), DType::kFloat32, {8, 4});
  auto ei = moegrad::TensorView::contiguous(eb.data(), DType::kInt32, {8, 4});
  auto no = moegrad::TensorView::contiguous(nb.data(), DType::kFloat32, {8, 16});
  auto nbad = moegrad::TensorView::contiguous(bad.data(), DType::kFloat32, {8, 17});
  moegrad::GatingTopKAttrs at;
  at.k = 4;
  auto ex = moegrad::plan_moe_gating_top_k(&x, nullptr, at, &y, &ei, &no);
  std::vector<unsigned char> ws(ex->workspace_size() + 1);
  const moegrad::TensorView* outs[] = {&yo, &ei, &nbad};
  auto [code, msg] = cpp_error([&] { ex->run(outs, 3, ws.data(), ws.size(), nullptr); });
  EXPECT_EQ(code, ACLNN_ERR_INNER_TILING_ERROR) << msg;
  EXPECT_TRUE(has_word(msg, "norm_out")) << msg;
  std::tie(code, msg) = cpp_error([&] { ex->run(nullptr, 3, ws.data(), ws.size(), nullptr); });
  EXPECT_EQ(code, ACLNN_ERR_PARAM_NULLPTR) << msg;
  moegrad::run_now(*ex);
  for (float v : y2) EXPECT_EQ(v, -7.f) << "the refused call's output was bound";
  bool written = false;
  for (float v : y1) written |= v != -7.f;
  EXPECT_TRUE(written) << "the planned output was not written";
}

// Null tensors are reported before dtypes (§0.3): a missing padded_offsets with a float64 x.
TEST(CppApi, ANullRequiredOutputIsReportedBeforeADtype) {
  std::vector<double> xb(3 * 2);
  std::vector<int32_t> eb = {0, 1, 2, 3, 0, 1}, ib(6);
  std::vector<float> exb(64);
  using moegrad::DType;
  auto x = moegrad::TensorView::contiguous(xb.data(), static_cast<DType>(11) /* float64 */, {3, 2});
  auto e = moegrad::TensorView::contiguous(eb.data(), DType::kInt32, {3, 2});
  auto ex = moegrad::TensorView::contiguous(exb.data(), DType::kFloat32, {22, 2});
  auto idx = moegrad::TensorView::contiguous(ib.data(), DType::kInt32, {6});
  moegrad::InitRoutingAttrs at;
  at.expert_num = 4;
  at.align_block = 4;
  auto [code, msg] = cpp_error([&] {
    moegrad::plan_moe_init_routing(&x, &e, at, &ex, &idx, nullptr, nullptr);
  });
  EXPECT_EQ(code, ACLNN_ERR_PARAM_NULLPTR) << msg;
  EXPECT_EQ(msg.rfind("moe_init_routing: padded_offsets:", 0), 0u) << msg;
}

// An output whose memory overlaps an input or another output is refused (161002 naming the
// output, nothing written); the one in-place form, swiglu grad's grad_x exactly over x on the
// CPU (L228), computes what a separate grad_x gets.
TEST(CppApi, OverlappingOutputsAreRefusedExceptTheDocumentedInPlace) {
  using moegrad::DType;
  std::vector<float> buf(8 * 16 + 8 * 8);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>((i * 29) % 17) / 8.f - 1.f;
  const std::vector<float> before = buf;
  auto x = moegrad::TensorView::contiguous(buf.data(), DType::kFloat32, {8, 16});
  // y over the second half of x's rows: overlaps x
  auto y = moegrad::TensorView::contiguous(buf.data() + 4 * 16, DType::kFloat32, {8, 8});
  auto [code, msg] = cpp_error([&] { moegrad::plan_swiglu_group(&x, nullptr, nullptr, {}, &y); });
  EXPECT_EQ(code, ACLNN_ERR_PARAM_INVALID) << msg;
  EXPECT_EQ(msg.rfind("swiglu_group: y: output memory must not overlap x's", 0), 0u) << msg;
  // just past x: accepted
  auto y_ok = moegrad::TensorView::contiguous(buf.data() + 8 * 16, DType::kFloat32, {8, 8});
  moegrad::run_now(*moegrad::plan_swiglu_group(&x, nullptr, nullptr, {}, &y_ok));

  // swiglu grad: grad_x exactly over x equals a separate grad_x; shifted by one row, refused
  std::vector<float> xs(before.begin(), before.begin() + 8 * 16), gy(8 * 8), sep(8 * 16);
  for (size_t i = 0; i < gy.size(); ++i) gy[i] = static_cast<float>((i * 13) % 7) / 4.f - 0.8f;
  auto vx = moegrad::TensorView::contiguous(xs.data(), DType::kFloat32, {8, 16});
  auto vgy = moegrad::TensorView::contiguous(gy.data(), DType::kFloat32, {8, 8});
  auto vsep = moegrad::TensorView::contiguous(sep.data(), DType::kFloat32, {8, 16});
  moegrad::run_now(*moegrad::plan_swiglu_group_quant_grad(&vgy, &vx, nullptr, nullptr, nullptr,
                                                          {}, &vsep, nullptr));
  std::vector<float> xs2(xs.size() + 16);
  std::copy(xs.begin(), xs.end(), xs2.begin());
  auto vshift = moegrad::TensorView::contiguous(xs2.data() + 16, DType::kFloat32, {8, 16});
  auto vx2 = moegrad::TensorView::contiguous(xs2.data(), DType::kFloat32, {8, 16});
  std::tie(code, msg) = cpp_error([&] {
    moegrad::plan_swiglu_group_quant_grad(&vgy, &vx2, nullptr, nullptr, nullptr, {}, &vshift,
                                          nullptr);
  });
  EXPECT_EQ(code, ACLNN_ERR_PARAM_INVALID) << msg;
  EXPECT_EQ(msg.rfind("swiglu_group_quant_backward: grad_x: output memory must not overlap x's", 0), 0u) << msg;
  moegrad::run_now(*moegrad::plan_swiglu_group_quant_grad(&vgy, &vx, nullptr, nullptr, nullptr,
                                                          {}, &vx, nullptr));
  EXPECT_EQ(0, std::memcmp(xs.data(), sep.data(), sep.size() * sizeof(float)));

  // two outputs sharing memory: the later one is named
  std::vector<float> lg(8 * 16, 0.25f), shared(8 * 16);
  std::vector<int32_t> ids(8 * 4);
  auto vl = moegrad::TensorView::contiguous(lg.data(), DType::kFloat32, {8, 16});
  auto vy = moegrad::TensorView::contiguous(shared.data(), DType::kFloat32, {8, 4});
  auto vi = moegrad::TensorView::contiguous(ids.data(), DType::kInt32, {8, 4});
  auto vn = moegrad::TensorView::contiguous(shared.data(), DType::kFloat32, {8, 16});
  moegrad::GatingTopKAttrs at;
  at.k = 4;
  std::tie(code, msg) = cpp_error([&] { moegrad::plan_moe_gating_top_k(&vl, nullptr, at, &vy, &vi, &vn); });
  EXPECT_EQ(code, ACLNN_ERR_PARAM_INVALID) << msg;
  EXPECT_EQ(msg.rfind("moe_gating_top_k: norm_out: output memory must not overlap y's", 0), 0u) << msg;
}
