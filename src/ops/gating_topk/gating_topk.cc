// Validation, shape inference and planning of the gating top-k operators (§1.6, §2.5).
#include "ops/gating_topk/gating_topk.h"

#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/backend.h"
#include "core/executor.h"
#include "core/host.h"

namespace moegrad {

namespace {
constexpr int64_t kMaxExperts = 2048;

int64_t round_up32(int64_t v) { return (v + 31) / 32 * 32; }

// norm_type, renorm, routed_scaling_factor and eps as the gating forward checks them (§2.5).
template <typename Attrs>
void check_norm_attrs(const Validator& v, const Attrs& a) {
  v.check_shape(a.norm_type >= 0 && a.norm_type <= 2, "norm_type",
                "must be 0 (softmax), 1 (sigmoid) or 2 (sqrt-softplus); got ", a.norm_type);
  v.check_shape(a.renorm == 0 || a.renorm == 1, "renorm", "must be 0 or 1; got ", a.renorm);
  v.check_shape(std::isfinite(a.routed_scaling_factor), "routed_scaling_factor",
                "must be finite; got ", a.routed_scaling_factor);
  v.check_shape(std::isfinite(a.eps), "eps", "must be finite; got ", a.eps);
}

// Host replay ids (D34): no id twice within a row (the range is checked before), 161002 naming
// the row and the value.
template <typename I>
void check_rows_distinct(const Validator& v, const I* idx, int64_t M, int64_t K, int64_t N) {
  std::vector<int64_t> seen(static_cast<size_t>(N), -1);  // the last row that used each id
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = static_cast<int64_t>(idx[r * K + k]);
      v.check(seen[e] != r, kErrParamInvalid, "expert_idx",
              "each expert id at most once per row; got ", e, " twice in row ", r);
      seen[e] = r;
    }
  }
}
}  // namespace

GatingTopKPlan validate_gating_top_k(const TensorView* x, const TensorView* bias,
                                     const GatingTopKAttrs& a, const TensorView* y,
                                     const TensorView* expert_idx, const TensorView* norm_out,
                                     bool with_outputs) {
  Validator v("moe_gating_top_k", kErrTiling);
  GatingTopKPlan p;
  p.op = v.op();
  p.shape_code = v.shape_code();
  v.present(x, "x");
  if (with_outputs) {
    v.present(y, "y");
    v.present(expert_idx, "expert_idx");
    v.present(norm_out, "norm_out");
  }
  // Dtypes and layouts: 161002 (§2.5).
  v.dtype_in(*x, "x", kFloatTypes);
  if (bias) v.same_dtype(*bias, "bias", x->dtype, "x's dtype");
  if (with_outputs) {
    v.same_dtype(*y, "y", x->dtype, "x's dtype");
    v.same_dtype(*expert_idx, "expert_idx", DType::kInt32, "int32");
    v.same_dtype(*norm_out, "norm_out", DType::kFloat32, "float32");
  }
  p.backend = select_backend(v, {{"x", x}, {"bias", bias}, {"y", y}, {"expert_idx", expert_idx},
                                 {"norm_out", norm_out}}, 2);
  v.contiguous(*x, "x");
  if (bias) v.contiguous(*bias, "bias");
  if (with_outputs) {
    v.contiguous(*y, "y");
    v.contiguous(*expert_idx, "expert_idx");
    v.contiguous(*norm_out, "norm_out");
  }
  // Shapes and attributes: 561002 (§2.5, D2, D13).
  v.rank(*x, "x", 2);
  const int64_t M = x->shape[0], N = x->shape[1];
  v.check_shape(N >= 1 && N <= kMaxExperts, "x",
                "expert count N (dim 1) must satisfy 1 <= N <= 2048; got ", N);
  if (bias) {
    v.rank(*bias, "bias", 1);
    v.dim(*bias, "bias", 0, N, "the expert count N of x");
  }
  v.check_shape(a.group_count >= 1, "group_count", "must be >= 1; got ", a.group_count);
  v.check_shape(N % a.group_count == 0, "group_count",
                "must divide the expert count N (", N, "); got ", a.group_count);
  const int64_t group_size = N / a.group_count;
  v.check_shape(a.k_group >= 1 && a.k_group <= a.group_count, "k_group",
                "must satisfy 1 <= k_group <= group_count (", a.group_count, "); got ",
                a.k_group);
  v.check_shape(a.group_select_mode == 0 || a.group_select_mode == 1, "group_select_mode",
                "must be 0 (group max) or 1 (sum of top two); got ", a.group_select_mode);
  v.check_shape(a.group_select_mode == 0 || group_size >= 2, "group_select_mode",
                "group_select_mode 1 needs groups of at least 2 experts (N / group_count = ",
                group_size, "); got 1");
  v.check_shape(a.k >= 1 && a.k <= N, "k", "must satisfy 1 <= k <= N (", N, "); got ", a.k);
  v.check_shape(a.k <= a.k_group * group_size, "k",
                "must be <= k_group * N / group_count (", a.k_group * group_size, "); got ",
                a.k);
  const bool grouped = a.group_count > 1 && a.k_group < a.group_count;
  if (a.group_count != 1 && a.group_count != N && a.k_group != a.group_count) {
    v.check_shape(a.group_count * round_up32(group_size) <= kMaxExperts, "group_count",
                  "group_count * roundup32(N / group_count) must be <= 2048; got ",
                  a.group_count * round_up32(group_size));
  }
  check_norm_attrs(v, a);
  if (with_outputs) {
    v.shape(*y, "y", {M, a.k});
    v.shape(*expert_idx, "expert_idx", {M, a.k});
    v.shape(*norm_out, "norm_out", {M, N});
  }
  p.x = *x;
  if (bias) p.bias = *bias;
  p.has_bias = bias != nullptr;
  if (with_outputs) {
    p.y = *y;
    p.expert_idx = *expert_idx;
    p.norm_out = *norm_out;
  }
  p.attrs = a;
  p.M = M;
  p.N = N;
  p.grouped = grouped;
  p.place(*x, with_outputs);
  p.add_output("y", {M, a.k}, x->dtype);
  p.add_output("expert_idx", {M, a.k}, DType::kInt32);
  p.add_output("norm_out", {M, N}, DType::kFloat32);
  return p;
}

GatingTopKBackwardPlan validate_gating_top_k_backward(const TensorView* x_norm,
                                                      const TensorView* grad_y,
                                                      const TensorView* expert_idx,
                                                      const GatingTopKBackwardAttrs& a,
                                                      const TensorView* grad_x,
                                                      bool with_outputs) {
  // Every violation but a null tensor is 161002 (D3).
  Validator v("moe_gating_top_k_backward", kErrParamInvalid);
  GatingTopKBackwardPlan p;
  p.op = v.op();
  p.shape_code = v.shape_code();
  v.present(x_norm, "x_norm");
  v.present(grad_y, "grad_y");
  v.present(expert_idx, "expert_idx");
  if (with_outputs) v.present(grad_x, "grad_x");
  v.same_dtype(*x_norm, "x_norm", DType::kFloat32, "float32");
  v.dtype_in(*grad_y, "grad_y", kFloatTypes);
  v.index_dtype(*expert_idx, "expert_idx");
  if (with_outputs) v.same_dtype(*grad_x, "grad_x", grad_y->dtype, "grad_y's dtype");
  p.backend = select_backend(v, {{"x_norm", x_norm}, {"grad_y", grad_y},
                                 {"expert_idx", expert_idx}, {"grad_x", grad_x}}, 3);
  v.contiguous(*x_norm, "x_norm");
  v.contiguous(*grad_y, "grad_y");
  v.contiguous(*expert_idx, "expert_idx");
  if (with_outputs) v.contiguous(*grad_x, "grad_x");
  v.rank(*x_norm, "x_norm", 2);
  v.rank(*grad_y, "grad_y", 2);
  v.rank(*expert_idx, "expert_idx", 2);
  const int64_t N = x_norm->shape[1];
  v.check_shape(N >= 2 && N <= kMaxExperts, "x_norm",
                "expert count N (dim 1) must satisfy 2 <= N <= 2048; got ", N);
  // The odd one out is blamed: x_norm with a wrong M is named as x_norm (L50).
  const int64_t M = v.agree("token count M", {dim_claim(*x_norm, "x_norm", 0),
                                              dim_claim(*grad_y, "grad_y", 0),
                                              dim_claim(*expert_idx, "expert_idx", 0)});
  const int64_t K = grad_y->shape[1];
  v.check_shape(K >= 1 && K <= N, "grad_y",
                "top-k K (dim 1) must satisfy 1 <= K <= N (", N, "); got ", K);
  v.agree("top-k K", {dim_claim(*grad_y, "grad_y", 1), dim_claim(*expert_idx, "expert_idx", 1)});
  // D22: every norm type of the forward; renorm only matters (and is checked) for softmax, the
  // sigmoid and sqrt-softplus paths always renormalise and ignore it (L20).
  v.check_shape(a.norm_type >= 0 && a.norm_type <= 2, "norm_type",
                "must be 0 (softmax), 1 (sigmoid) or 2 (sqrt-softplus); got ", a.norm_type);
  if (a.norm_type == 0) {
    v.check_shape(a.renorm == 0 || a.renorm == 1, "renorm",
                  "must be 0 or 1 with norm_type 0 (softmax); got ", a.renorm);
  }
  v.check_shape(std::isfinite(a.routed_scaling_factor), "routed_scaling_factor",
                "must be finite; got ", a.routed_scaling_factor);
  v.check_shape(std::isfinite(a.eps), "eps", "must be finite; got ", a.eps);
  if (with_outputs) {
    v.rank(*grad_x, "grad_x", 2);
    v.shape(*grad_x, "grad_x", {M, N});
  }
  // D6: host index values lie in [0, N); repeats within a row are summed (D1).
  check_index_range(v, kErrParamInvalid, *expert_idx, "expert_idx", 0, N);
  p.x_norm = *x_norm;
  p.grad_y = *grad_y;
  p.expert_idx = *expert_idx;
  if (with_outputs) p.grad_x = *grad_x;
  p.attrs = a;
  p.M = M;
  p.N = N;
  p.K = K;
  p.place(*x_norm, with_outputs);
  p.add_output("grad_x", {M, N}, grad_y->dtype);
  return p;
}

GatingReplayPlan validate_gating_replay(const TensorView* x, const TensorView* expert_idx,
                                        const TensorView* bias, const GatingReplayAttrs& a,
                                        const TensorView* y, const TensorView* norm_out,
                                        bool with_outputs) {
  Validator v("moe_gating_replay", kErrTiling);
  GatingReplayPlan p;
  p.op = v.op();
  p.shape_code = v.shape_code();
  v.present(x, "x");
  v.present(expert_idx, "expert_idx");
  if (with_outputs) {
    v.present(y, "y");
    v.present(norm_out, "norm_out");
  }
  // Dtypes and layouts: 161002, as the forward (§2.5).
  v.dtype_in(*x, "x", kFloatTypes);
  v.index_dtype(*expert_idx, "expert_idx");
  if (bias) v.same_dtype(*bias, "bias", x->dtype, "x's dtype");
  if (with_outputs) {
    v.same_dtype(*y, "y", x->dtype, "x's dtype");
    v.same_dtype(*norm_out, "norm_out", DType::kFloat32, "float32");
  }
  p.backend = select_backend(v, {{"x", x}, {"expert_idx", expert_idx}, {"bias", bias},
                                 {"y", y}, {"norm_out", norm_out}}, 3);
  v.contiguous(*x, "x");
  v.contiguous(*expert_idx, "expert_idx");
  if (bias) v.contiguous(*bias, "bias");
  if (with_outputs) {
    v.contiguous(*y, "y");
    v.contiguous(*norm_out, "norm_out");
  }
  // Shapes and attributes: 561002.
  v.rank(*x, "x", 2);
  const int64_t N = x->shape[1];
  v.check_shape(N >= 1 && N <= kMaxExperts, "x",
                "expert count N (dim 1) must satisfy 1 <= N <= 2048; got ", N);
  v.rank(*expert_idx, "expert_idx", 2);
  const int64_t M = v.agree("token count M", {dim_claim(*x, "x", 0),
                                              dim_claim(*expert_idx, "expert_idx", 0)});
  const int64_t K = expert_idx->shape[1];
  v.check_shape(K >= 1 && K <= N, "expert_idx",
                "top-k K (dim 1) must satisfy 1 <= K <= N (", N, "); got ", K);
  if (bias) {
    v.rank(*bias, "bias", 1);
    v.dim(*bias, "bias", 0, N, "the expert count N of x");
  }
  check_norm_attrs(v, a);
  if (with_outputs) {
    v.shape(*y, "y", {M, K});
    v.shape(*norm_out, "norm_out", {M, N});
  }
  // D34 / D6: host ids lie in [0, N) and differ within a row (161002); device ids are skipped
  // by the kernel when out of range.
  check_index_range(v, kErrParamInvalid, *expert_idx, "expert_idx", 0, N);
  if (expert_idx->device == Device::kCPU) {
    if (expert_idx->dtype == DType::kInt64) {
      check_rows_distinct(v, static_cast<const int64_t*>(expert_idx->data), M, K, N);
    } else {
      check_rows_distinct(v, static_cast<const int32_t*>(expert_idx->data), M, K, N);
    }
  }
  p.x = *x;
  p.expert_idx = *expert_idx;
  if (with_outputs) {
    p.y = *y;
    p.norm_out = *norm_out;
  }
  p.attrs = a;
  p.M = M;
  p.N = N;
  p.K = K;
  p.place(*x, with_outputs);
  p.add_output("y", {M, K}, x->dtype);
  p.add_output("norm_out", {M, N}, DType::kFloat32);
  return p;
}

namespace {
const KernelTable<GatingTopKPlan> kForward = {
    {gating_top_k_cpu_size, gating_top_k_cpu},
    MOEGRAD_CUDA_ENTRY(gating_top_k_cuda_size, gating_top_k_cuda)};
const KernelTable<GatingTopKBackwardPlan> kBackward = {
    {gating_top_k_backward_cpu_size, gating_top_k_backward_cpu},
    MOEGRAD_CUDA_ENTRY(gating_top_k_backward_cuda_size, gating_top_k_backward_cuda)};
const KernelTable<GatingReplayPlan> kReplay = {
    {gating_replay_cpu_size, gating_replay_cpu},
    MOEGRAD_CUDA_ENTRY(gating_replay_cuda_size, gating_replay_cuda)};
}  // namespace

ExecutorPtr plan_moe_gating_top_k(const TensorView* x, const TensorView* bias,
                                  const GatingTopKAttrs& attrs, const TensorView* y,
                                  const TensorView* expert_idx, const TensorView* norm_out) {
  return make_executor(validate_gating_top_k(x, bias, attrs, y, expert_idx, norm_out, true),
                       kForward);
}

ExecutorPtr prepare_moe_gating_top_k(const TensorView* x, const TensorView* bias,
                                     const GatingTopKAttrs& attrs) {
  return make_executor(
      validate_gating_top_k(x, bias, attrs, nullptr, nullptr, nullptr, false), kForward);
}

std::vector<Shape> infer_moe_gating_top_k(const TensorView* x, const TensorView* bias,
                                          const GatingTopKAttrs& attrs) {
  GatingTopKPlan p = validate_gating_top_k(x, bias, attrs, nullptr, nullptr, nullptr, false);
  return {{p.M, attrs.k}, {p.M, attrs.k}, {p.M, p.N}};
}

ExecutorPtr plan_moe_gating_top_k_backward(const TensorView* x_norm, const TensorView* grad_y,
                                           const TensorView* expert_idx,
                                           const GatingTopKBackwardAttrs& attrs,
                                           const TensorView* grad_x) {
  return make_executor(
      validate_gating_top_k_backward(x_norm, grad_y, expert_idx, attrs, grad_x, true), kBackward);
}

ExecutorPtr prepare_moe_gating_top_k_backward(const TensorView* x_norm, const TensorView* grad_y,
                                              const TensorView* expert_idx,
                                              const GatingTopKBackwardAttrs& attrs) {
  return make_executor(
      validate_gating_top_k_backward(x_norm, grad_y, expert_idx, attrs, nullptr, false),
      kBackward);
}

std::vector<Shape> infer_moe_gating_top_k_backward(const TensorView* x_norm,
                                                   const TensorView* grad_y,
                                                   const TensorView* expert_idx,
                                                   const GatingTopKBackwardAttrs& attrs) {
  GatingTopKBackwardPlan p =
      validate_gating_top_k_backward(x_norm, grad_y, expert_idx, attrs, nullptr, false);
  return {{p.M, p.N}};
}

ExecutorPtr plan_moe_gating_replay(const TensorView* x, const TensorView* expert_idx,
                                   const TensorView* bias, const GatingReplayAttrs& attrs,
                                   const TensorView* y, const TensorView* norm_out) {
  return make_executor(validate_gating_replay(x, expert_idx, bias, attrs, y, norm_out, true),
                       kReplay);
}

ExecutorPtr prepare_moe_gating_replay(const TensorView* x, const TensorView* expert_idx,
                                      const TensorView* bias, const GatingReplayAttrs& attrs) {
  return make_executor(
      validate_gating_replay(x, expert_idx, bias, attrs, nullptr, nullptr, false), kReplay);
}

std::vector<Shape> infer_moe_gating_replay(const TensorView* x, const TensorView* expert_idx,
                                           const TensorView* bias,
                                           const GatingReplayAttrs& attrs) {
  GatingReplayPlan p = validate_gating_replay(x, expert_idx, bias, attrs, nullptr, nullptr, false);
  return {{p.M, p.K}, {p.M, p.N}};
}

}  // namespace moegrad
