// Consumer of an installed moegrad: the gating backward worked example (operators.md §1.9)
// through the C++ API (plan_moe_gating_top_k_backward + run_now), the finalize-routing grad
// worked example (§3.9) through the C API, and an invalid call through each, checking the
// documented status codes. Exits non-zero on any mismatch.
#include <moegrad/aclnn.h>
#include <moegrad/moegrad.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

int failures = 0;

void check_near(const char* what, int i, double got, double want, double tol) {
  if (!(std::fabs(got - want) <= tol)) {
    std::printf("MISMATCH %s[%d]: got %.7f, expected %.7f\n", what, i, got, want);
    ++failures;
  }
}

void check(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what);
    ++failures;
  }
}

void cpp_api_gating_backward() {
  std::vector<float> xn = {0.5f, 0.7f, 0.3f, 0.8f, 0.2f, 0.6f, 0.9f, 0.4f,
                           0.6f, 0.4f, 0.8f, 0.1f, 0.7f, 0.5f, 0.3f, 0.9f,
                           0.2f, 0.9f, 0.5f, 0.6f, 0.8f, 0.3f, 0.7f, 0.4f,
                           0.8f, 0.3f, 0.6f, 0.5f, 0.4f, 0.7f, 0.2f, 0.9f};
  std::vector<float> gy = {1.0f, 0.5f, 0.8f, 0.3f, 0.6f, 0.9f, 0.4f, 0.7f};
  std::vector<int32_t> idx = {3, 6, 2, 7, 1, 4, 0, 7};
  std::vector<float> gx(32, -1.0f);
  using moegrad::DType;
  using moegrad::TensorView;
  TensorView t_xn = TensorView::contiguous(xn.data(), DType::kFloat32, {4, 8});
  TensorView t_gy = TensorView::contiguous(gy.data(), DType::kFloat32, {4, 2});
  TensorView t_idx = TensorView::contiguous(idx.data(), DType::kInt32, {4, 2});
  TensorView t_gx = TensorView::contiguous(gx.data(), DType::kFloat32, {4, 8});
  moegrad::GatingTopKBackwardAttrs attrs;
  attrs.norm_type = 1;
  attrs.routed_scaling_factor = 2.5;
  attrs.eps = 1e-20;
  try {
    moegrad::ExecutorPtr ex =
        moegrad::plan_moe_gating_top_k_backward(&t_xn, &t_gy, &t_idx, attrs, &t_gx);
    moegrad::run_now(*ex);
  } catch (const moegrad::Error& e) {
    std::printf("C++ API error %d: %s\n", e.code(), e.what());
    ++failures;
    return;
  }
  std::vector<double> want(32, 0.0);
  want[3] = 0.062284;
  want[6] = -0.031142;
  want[8 + 2] = 0.062284;
  want[8 + 7] = -0.031142;
  want[16 + 1] = -0.018685;
  want[16 + 4] = 0.037370;
  want[24 + 0] = -0.037370;
  want[24 + 7] = 0.018685;
  for (int i = 0; i < 32; ++i) check_near("C++ gating backward grad_x", i, gx[i], want[i], 1e-6);

  // An invalid call throws moegrad::Error with the documented code (norm_type 3: 161002).
  attrs.norm_type = 3;
  int code = 0;
  try {
    moegrad::plan_moe_gating_top_k_backward(&t_xn, &t_gy, &t_idx, attrs, &t_gx);
  } catch (const moegrad::Error& e) {
    code = e.code();
  }
  check(code == moegrad::kErrParamInvalid, "C++ API: norm_type 3 must throw 161002");
}

void c_api_finalize_grad() {
  std::vector<float> gy = {0.3816f, 0.3939f, 0.8474f, 0.1652f};
  std::vector<int32_t> idx = {1, 3, 0, 2};
  std::vector<float> ex = {0.6049f, 0.3315f, 0.4954f, 0.3284f, 0.7060f, 0.4359f, 0.6514f, 0.9476f};
  std::vector<float> scales = {0.4708f, 0.0656f, 0.9652f, 0.9512f};
  std::vector<int32_t> eid = {0, 1, 0, 1};
  std::vector<float> bias = {0.6452f, 0.1981f, 0.4159f, 0.9575f};
  std::vector<float> gex(8, -1.0f), gs(4, -1.0f);
  const int64_t d22[2] = {2, 2}, d4[1] = {4}, d42[2] = {4, 2};
  aclTensor* t_gy = aclCreateTensor(d22, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, d22, 2, gy.data());
  aclTensor* t_idx = aclCreateTensor(d4, 1, ACL_INT32, nullptr, 0, ACL_FORMAT_ND, d4, 1, idx.data());
  aclTensor* t_ex = aclCreateTensor(d42, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, d42, 2, ex.data());
  aclTensor* t_sc = aclCreateTensor(d22, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, d22, 2, scales.data());
  aclTensor* t_eid = aclCreateTensor(d22, 2, ACL_INT32, nullptr, 0, ACL_FORMAT_ND, d22, 2, eid.data());
  aclTensor* t_b = aclCreateTensor(d22, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, d22, 2, bias.data());
  aclTensor* t_gex = aclCreateTensor(d42, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, d42, 2, gex.data());
  aclTensor* t_gs = aclCreateTensor(d22, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, d22, 2, gs.data());

  uint64_t ws = 0;
  aclOpExecutor* executor = nullptr;
  aclnnStatus st = aclnnMoeFinalizeRoutingV2GradGetWorkspaceSize(
      t_gy, t_idx, t_ex, t_sc, t_eid, t_b, 0, 0, 0, 0, t_gex, t_gs, &ws, &executor);
  check(st == ACLNN_SUCCESS, "C API: aclnnMoeFinalizeRoutingV2GradGetWorkspaceSize");
  if (st == ACLNN_SUCCESS) {
    std::vector<unsigned char> workspace(ws);
    st = aclnnMoeFinalizeRoutingV2Grad(ws ? workspace.data() : nullptr, ws, executor, nullptr);
    check(st == ACLNN_SUCCESS, "C API: aclnnMoeFinalizeRoutingV2Grad");
    const double want_gex[8] = {0.817910, 0.159451, 0.179657, 0.185448,
                                0.806047, 0.157138, 0.025033, 0.025840};
    const double want_gs[4] = {0.642641, 1.157701, 1.146825, 1.180888};
    for (int i = 0; i < 8; ++i) check_near("C finalize grad grad_expanded_x", i, gex[i], want_gex[i], 2e-6);
    for (int i = 0; i < 4; ++i) check_near("C finalize grad grad_scales", i, gs[i], want_gs[i], 2e-6);
  } else {
    std::printf("error: %s\n", aclGetRecentErrMsg());
  }

  // Invalid: drop_pad_mode 2 -> 561103, no executor, outputs untouched.
  std::vector<float> before = gex;
  aclOpExecutor* bad = nullptr;
  st = aclnnMoeFinalizeRoutingV2GradGetWorkspaceSize(t_gy, t_idx, t_ex, t_sc, t_eid, t_b, 2, 0, 0,
                                                      0, t_gex, t_gs, &ws, &bad);
  check(st == ACLNN_ERR_INNER_NULLPTR, "C API: drop_pad_mode 2 must return 561103");
  check(bad == nullptr, "C API: a failing call must not create an executor");
  check(before == gex, "C API: a failing call must not write outputs");

  for (aclTensor* t : {t_gy, t_idx, t_ex, t_sc, t_eid, t_b, t_gex, t_gs}) aclDestroyTensor(t);
}

}  // namespace

int main() {
  std::printf("moegrad %s\n", moegradVersion());
  cpp_api_gating_backward();
  c_api_finalize_grad();
  if (failures) {
    std::printf("%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("consumer OK\n");
  return 0;
}
