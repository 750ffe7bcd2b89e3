// Validation, shape inference and planning of finalize routing (§3.6, §4.6, D6).
#include "ops/finalize_routing/finalize_routing.h"

#include "core/check.h"
#include "core/backend.h"
#include "core/executor.h"
#include "core/host.h"

namespace moegrad {

namespace {
// Checks a present optional tensor's layout.
void optional_layout(const Validator& v, const TensorView* t, const char* arg) {
  if (t) v.contiguous(*t, arg);
}
// D6, D29 on host tensors: indices lie in [-1, limit) (limit = R*K dropless, E*C drop-pad; -1
// = no row, also in dropless modes, as an active expert window produces); each valid value
// appears at most once.
void check_expanded_row_idx(const Validator& v, const TensorView& idx, int64_t limit) {
  check_index_range(v, kErrInnerNullptr, idx, "expanded_row_idx", -1, limit);
  check_index_unique(v, kErrInnerNullptr, idx, "expanded_row_idx", limit);
}

}  // namespace

FinalizeRoutingPlan validate_finalize_routing(const TensorView* ex, const TensorView* idx,
                                              const TensorView* x1, const TensorView* x2,
                                              const TensorView* bias, const TensorView* scales,
                                              const TensorView* eidx,
                                              const FinalizeRoutingAttrs& a,
                                              const TensorView* out, bool with_outputs,
                                              int64_t k_hint) {
  Validator v("moe_finalize_routing", kErrInnerNullptr);
  FinalizeRoutingPlan p;
  p.op = v.op();
  p.shape_code = v.shape_code();
  v.present(ex, "expanded_x");
  v.present(idx, "expanded_row_idx");
  if (with_outputs) v.present(out, "out");
  // Dtypes and layouts: 161002.
  v.dtype_in(*ex, "expanded_x", kFloatTypes);
  v.index_dtype(*idx, "expanded_row_idx");
  if (x1) v.same_dtype(*x1, "x1", ex->dtype, "expanded_x's dtype");
  if (x2) v.same_dtype(*x2, "x2", ex->dtype, "expanded_x's dtype");
  if (bias) v.same_dtype(*bias, "bias", ex->dtype, "expanded_x's dtype");
  if (scales) v.dtype_in(*scales, "scales", kFloatTypes);
  if (eidx) v.index_dtype(*eidx, "expert_idx");
  if (with_outputs) v.same_dtype(*out, "out", ex->dtype, "expanded_x's dtype");
  p.backend = select_backend(v, {{"expanded_x", ex}, {"expanded_row_idx", idx}, {"x1", x1},
                                 {"x2", x2}, {"bias", bias}, {"scales", scales},
                                 {"expert_idx", eidx}, {"out", out}}, 7);
  v.contiguous(*ex, "expanded_x");
  v.contiguous(*idx, "expanded_row_idx");
  optional_layout(v, x1, "x1");
  optional_layout(v, x2, "x2");
  optional_layout(v, bias, "bias");
  optional_layout(v, scales, "scales");
  optional_layout(v, eidx, "expert_idx");
  if (with_outputs) v.contiguous(*out, "out");

  // Shapes and attributes: 561103.
  const int64_t mode = a.drop_pad_mode;
  v.check_shape(mode >= 0 && mode <= 3, "drop_pad_mode",
                "must be 0, 1 (column layout) or 2, 3 (row layout); got ", mode);
  const bool drop_pad = mode == 1 || mode == 3;
  v.rank(*ex, "expanded_x", drop_pad ? 3 : 2);
  const int64_t H = ex->shape[ex->ndim - 1];
  v.check_shape(H >= 1, "expanded_x", "hidden size H (last dim) must be >= 1; got ", H);
  v.rank(*idx, "expanded_row_idx", 1);
  v.check_shape(!x2 || x1, "x2", "x2 requires x1; got x2 without x1");
  v.check_shape(!bias || eidx, "expert_idx", "expert_idx is required when bias is given; got null");
  for (auto [t, name] : {std::pair{x1, "x1"}, {x2, "x2"}, {bias, "bias"}, {scales, "scales"},
                         {eidx, "expert_idx"}}) {
    if (t) v.rank(*t, name, 2);
  }
  if (with_outputs) v.rank(*out, "out", 2);

  // Token count R, top-k K and hidden size H (L4). Where several tensors carry one of them they
  // must agree, and the odd one out is named (L50). k (Python only) must be >= 1 and, unless left
  // at its default of 1, agree with the tensors (L51).
  const int64_t n_idx = idx->shape[0];
  if (!with_outputs) v.check_shape(k_hint >= 1, "k", "must be >= 1; got ", k_hint);
  const bool k_given = !with_outputs && k_hint != 1;
  std::vector<Claim> r_claims;
  for (auto [t, name] : {std::pair{scales, "scales"}, {eidx, "expert_idx"}, {x1, "x1"}, {x2, "x2"}}) {
    if (t) r_claims.push_back(dim_claim(*t, name, 0));
  }
  if (with_outputs) r_claims.push_back(dim_claim(*out, "out", 0));
  // expanded_row_idx's R * K rows witness R (K from the first tensor that carries it), so a
  // mismatch between two tensors does not fall on the earlier one by default.
  const int64_t k_seen = scales ? scales->shape[1] : eidx ? eidx->shape[1] : k_given ? k_hint : 0;
  if (auto w = witness_claim(*idx, "expanded_row_idx", 0, k_seen); w && !r_claims.empty()) {
    r_claims.push_back(*w);
  }
  int64_t R;
  if (!r_claims.empty()) {
    R = v.agree("token count R", r_claims);
  } else {
    v.check_shape(n_idx % k_hint == 0, "k",
                  "must divide the length of expanded_row_idx (", n_idx, "); got ", k_hint);
    R = n_idx / k_hint;
  }
  int64_t K;
  std::vector<Claim> k_claims;
  if (scales) k_claims.push_back(dim_claim(*scales, "scales", 1));
  if (eidx) k_claims.push_back(dim_claim(*eidx, "expert_idx", 1));
  if (!k_claims.empty()) {
    K = v.agree("top-k K", k_claims);
  } else if (R > 0) {
    v.check_shape(n_idx % R == 0, "expanded_row_idx",
                  "length must be a multiple of the token count R (", R, "); got ", n_idx);
    K = n_idx / R;
  } else {
    K = k_hint >= 1 ? k_hint : 1;
  }
  const char* k_arg = scales ? "scales" : eidx ? "expert_idx" : "expanded_row_idx";
  v.check_shape(K >= 1, k_arg, "top-k K must be >= 1; got ", K);
  if (k_given) {
    v.check_shape(k_hint == K, "k",
                  "must equal the top-k K the tensors give (", K, ", from ", k_arg,
                  "); got ", k_hint);
  }
  std::vector<Claim> h_claims{dim_claim(*ex, "expanded_x", -1)};
  for (auto [t, name] : {std::pair{x1, "x1"}, {x2, "x2"}, {bias, "bias"}}) {
    if (t) h_claims.push_back(dim_claim(*t, name, 1));
  }
  if (with_outputs) h_claims.push_back(dim_claim(*out, "out", 1));
  v.agree("hidden size H", h_claims);
  const int64_t RK = mul_sat(R, K);
  v.check_shape(n_idx == RK, "expanded_row_idx",
                "length must equal R * K (", R, " * ", K, "); got ", n_idx);
  if (bias) v.check_shape(bias->shape[0] >= 1, "bias", "dim 0 (E) must be >= 1; got ", bias->shape[0]);
  if (bias && drop_pad) v.dim(*bias, "bias", 0, ex->shape[0], "expanded_x's expert count E");
  v.check_shape(!a.padded || !drop_pad, "padded",
                "must be false in drop-pad modes (1, 3); got true with drop_pad_mode ", mode);
  if (!drop_pad && !a.padded) {
    // Fewer rows than R*K is an active_num-truncated expanded_x (L5); more is a caller bug
    // unless the layout is padded (D36).
    v.check_shape(ex->shape[0] <= RK, "expanded_x",
                  "dim 0 must be <= R * K (", RK, ") in dropless modes; got ", ex->shape[0]);
  }
  if (with_outputs) v.shape(*out, "out", {R, H});

  const int64_t rows = drop_pad ? mul_sat(ex->shape[0], ex->shape[1]) : ex->shape[0];
  check_expanded_row_idx(v, *idx, drop_pad || a.padded ? rows : RK);
  if (bias) check_index_range(v, kErrInnerNullptr, *eidx, "expert_idx", 0, bias->shape[0]);

  p.expanded_x = *ex;
  p.expanded_row_idx = *idx;
  if (x1) p.x1 = *x1;
  if (x2) p.x2 = *x2;
  if (bias) p.bias = *bias;
  if (scales) p.scales = *scales;
  if (eidx) p.expert_idx = *eidx;
  if (with_outputs) p.out = *out;
  p.has_x1 = x1 != nullptr;
  p.has_x2 = x2 != nullptr;
  p.has_bias = bias != nullptr;
  p.has_scales = scales != nullptr;
  p.drop_pad_mode = mode;
  p.R = R;
  p.K = K;
  p.H = H;
  p.rows = rows;
  p.num_bias = bias ? bias->shape[0] : 0;
  p.row_layout = mode >= 2;
  p.place(*ex, with_outputs);
  p.add_output("out", {R, H}, ex->dtype);
  return p;
}

FinalizeRoutingGradPlan validate_finalize_routing_grad(
    const TensorView* gy, const TensorView* idx, const TensorView* ex, const TensorView* scales,
    const TensorView* eidx, const TensorView* bias, const FinalizeRoutingGradAttrs& a,
    const TensorView* gex, const TensorView* gs, bool with_outputs) {
  Validator v("moe_finalize_routing_grad", kErrInnerNullptr);
  FinalizeRoutingGradPlan p;
  p.op = v.op();
  p.shape_code = v.shape_code();
  v.present(gy, "grad_y");
  v.present(idx, "expanded_row_idx");
  if (with_outputs) {
    v.present(gex, "grad_expanded_x");
    v.present(gs, "grad_scales");
  }
  // Only what is used is checked: without scales, expanded_x, bias and expert_idx are ignored
  // (§3.6, L6); without bias, expert_idx is ignored.
  const TensorView* ex_used = scales ? ex : nullptr;
  const TensorView* bias_used = scales ? bias : nullptr;
  const TensorView* eidx_used = bias_used ? eidx : nullptr;
  v.dtype_in(*gy, "grad_y", kFloatTypes);
  v.index_dtype(*idx, "expanded_row_idx");
  if (ex_used) v.same_dtype(*ex_used, "expanded_x", gy->dtype, "grad_y's dtype");
  if (scales) v.dtype_in(*scales, "scales", kFloatTypes);
  if (eidx_used) v.index_dtype(*eidx_used, "expert_idx");
  if (bias_used) v.same_dtype(*bias_used, "bias", gy->dtype, "grad_y's dtype");
  const DType gs_dtype = scales ? scales->dtype : gy->dtype;
  if (with_outputs) {
    v.same_dtype(*gex, "grad_expanded_x", gy->dtype, "grad_y's dtype");
    v.same_dtype(*gs, "grad_scales", gs_dtype, scales ? "scales' dtype" : "grad_y's dtype");
  }
  p.backend = select_backend(v, {{"grad_y", gy}, {"expanded_row_idx", idx},
                                 {"expanded_x", ex_used}, {"scales", scales},
                                 {"expert_idx", eidx_used}, {"bias", bias_used},
                                 {"grad_expanded_x", gex}, {"grad_scales", gs}}, 6);
  v.contiguous(*gy, "grad_y");
  v.contiguous(*idx, "expanded_row_idx");
  optional_layout(v, ex_used, "expanded_x");
  optional_layout(v, scales, "scales");
  optional_layout(v, eidx_used, "expert_idx");
  optional_layout(v, bias_used, "bias");
  if (with_outputs) {
    v.contiguous(*gex, "grad_expanded_x");
    v.contiguous(*gs, "grad_scales");
  }

  const int64_t mode = a.drop_pad_mode;
  v.check_shape(mode == 0 || mode == 1, "drop_pad_mode",
                "must be 0 (dropless) or 1 (drop-pad); got ", mode);
  if (mode == 1) {
    v.check_shape(a.expert_num > 0, "expert_num",
                  "must be > 0 in drop-pad mode; got ", a.expert_num);
    v.check_shape(a.expert_capacity > 0, "expert_capacity",
                  "must be > 0 in drop-pad mode; got ", a.expert_capacity);
  }
  // active_num <= 0 or >= R*K: no truncation (§3.4: any other value is ignored, as the vendor's)
  v.rank(*gy, "grad_y", 2);
  v.rank(*idx, "expanded_row_idx", 1);
  if (scales) {
    v.check_shape(ex != nullptr, "expanded_x", "expanded_x is required when scales are given; got null");
    v.rank(*scales, "scales", 2);
    v.rank(*ex_used, "expanded_x", mode == 0 ? 2 : 3);
  }
  if (bias_used) {
    v.check_shape(eidx != nullptr, "expert_idx", "expert_idx is required when bias is given; got null");
    v.rank(*eidx_used, "expert_idx", 2);
    v.rank(*bias_used, "bias", 2);
  }
  // Token count R, hidden size H and top-k K: the odd one out is named (L50).
  std::vector<Claim> r_claims{dim_claim(*gy, "grad_y", 0)};
  if (scales) r_claims.push_back(dim_claim(*scales, "scales", 0));
  if (eidx_used) r_claims.push_back(dim_claim(*eidx_used, "expert_idx", 0));
  // Witnesses (their own rules name them later): expanded_row_idx's R * K rows and grad_scales.
  if (auto w = witness_claim(*idx, "expanded_row_idx", 0, scales ? scales->shape[1] : 1)) {
    r_claims.push_back(*w);
  }
  if (with_outputs && gs->ndim >= 1) {
    if (auto w = witness_claim(*gs, "grad_scales", 0, 1)) r_claims.push_back(*w);
  }
  const int64_t R = v.agree("token count R", r_claims);
  std::vector<Claim> h_claims{dim_claim(*gy, "grad_y", 1)};
  if (ex_used) h_claims.push_back(dim_claim(*ex_used, "expanded_x", -1));
  if (bias_used) h_claims.push_back(dim_claim(*bias_used, "bias", 1));
  if (with_outputs && gex->ndim >= 1) h_claims.push_back(dim_claim(*gex, "grad_expanded_x", -1));
  const int64_t H = v.agree("hidden size H", h_claims);
  v.check_shape(H >= 1, "grad_y", "hidden size H (dim 1) must be >= 1; got ", H);
  const int64_t n_idx = idx->shape[0];
  int64_t K = 1;
  if (scales) {
    std::vector<Claim> k_claims{dim_claim(*scales, "scales", 1)};
    if (eidx_used) k_claims.push_back(dim_claim(*eidx_used, "expert_idx", 1));
    K = v.agree("top-k K", k_claims);
    v.check_shape(K >= 1, "scales", "top-k K (dim 1) must be >= 1; got ", K);
    v.check_shape(n_idx == mul_sat(R, K), "expanded_row_idx",
                  "length must equal R * K (", R, " * ", K, "); got ", n_idx);
  } else {
    v.check_shape(n_idx == R, "expanded_row_idx",
                  "length must equal R (", R, ") when scales are absent (K = 1); got ", n_idx);
  }
  const int64_t RK = mul_sat(R, K);
  int64_t rows;
  Shape gex_shape;
  v.check_shape(a.padded_rows >= 0, "padded_rows", "must be >= 0; got ", a.padded_rows);
  const bool padded = a.padded_rows > 0;
  if (padded) {
    v.check_shape(mode == 0 && a.active_num <= 0, "padded_rows",
                  "must be 0 unless drop_pad_mode = 0 and active_num <= 0; got ", a.padded_rows);
  }
  if (padded) {  // D36: the aligned layout of init routing
    rows = a.padded_rows;
    gex_shape = {rows, H};
  } else if (mode == 0) {
    rows = (a.active_num > 0 && a.active_num < RK) ? a.active_num : RK;
    gex_shape = {rows, H};
  } else {
    rows = mul_sat(a.expert_num, a.expert_capacity);
    v.check_shape(mul_sat(rows, H) < std::numeric_limits<int64_t>::max(), "expert_capacity",
                  "expert_num * expert_capacity * H must fit in int64; got ", a.expert_num,
                  " * ", a.expert_capacity, " * ", H);
    gex_shape = {a.expert_num, a.expert_capacity, H};
  }
  if (ex_used) {
    if (mode == 0) {
      v.dim(*ex_used, "expanded_x", 0, rows,
            padded ? "padded_rows" : "the expanded row count (R * K or active_num)");
    } else {
      v.check_shape(mul_sat(ex_used->shape[0], ex_used->shape[1]) == rows, "expanded_x",
                    "dims 0 and 1 must multiply to expert_num * expert_capacity (", rows,
                    "); got ", shape_str(*ex_used));
    }
  }
  if (bias_used) {
    v.check_shape(bias_used->shape[0] >= 1, "bias",
                  "dim 0 (E) must be >= 1; got ", bias_used->shape[0]);
    if (mode == 1) v.dim(*bias_used, "bias", 0, a.expert_num, "expert_num");
  }
  const Shape gs_shape = {R, K};
  if (with_outputs) {
    if (mode == 0) {
      v.shape(*gex, "grad_expanded_x", gex_shape);
    } else {
      v.rank(*gex, "grad_expanded_x", 3);
      v.check_shape(mul_sat(gex->shape[0], gex->shape[1]) == rows && gex->shape[2] == H,
                    "grad_expanded_x",
                    "shape must be [expert_num, expert_capacity, H] = [", a.expert_num, ", ",
                    a.expert_capacity, ", ", H, "]; got ", shape_str(*gex));
    }
    v.shape(*gs, "grad_scales", gs_shape);
  }
  check_expanded_row_idx(v, *idx, mode == 1 || padded ? rows : RK);
  if (bias_used) check_index_range(v, kErrInnerNullptr, *eidx_used, "expert_idx", 0, bias_used->shape[0]);

  p.grad_y = *gy;
  p.expanded_row_idx = *idx;
  if (ex_used) p.expanded_x = *ex_used;
  if (scales) p.scales = *scales;
  if (eidx_used) p.expert_idx = *eidx_used;
  if (bias_used) p.bias = *bias_used;
  if (with_outputs) {
    p.grad_expanded_x = *gex;
    p.grad_scales = *gs;
  }
  p.has_scales = scales != nullptr;
  p.has_bias = bias_used != nullptr;
  p.drop_pad_mode = mode;
  p.R = R;
  p.K = K;
  p.H = H;
  p.rows = rows;
  p.num_bias = bias_used ? bias_used->shape[0] : 0;
  p.grad_expanded_x_shape = gex_shape;
  p.grad_scales_shape = gs_shape;
  p.grad_scales_dtype = gs_dtype;
  p.place(*gy, with_outputs);
  p.add_output("grad_expanded_x", gex_shape, gy->dtype);
  p.add_output("grad_scales", gs_shape, gs_dtype);
  return p;
}

namespace {
// A bound on the bias grad's workspace (two int64 per expert plus the slots), saturating (L52):
// E is an attribute, so a huge one must be refused before the kernel sizes its workspace.
uint64_t bias_grad_workspace(int64_t E, int64_t slots) {
  return static_cast<uint64_t>(
      add_sat(mul_sat(add_sat(E, 1), 16), mul_sat(add_sat(mul_sat(slots, 8), 63) / 64, 64)));
}
}  // namespace

FinalizeRoutingBiasGradPlan validate_finalize_routing_bias_grad(
    const TensorView* gy, const TensorView* eidx, const TensorView* scales,
    const FinalizeRoutingBiasGradAttrs& a, const TensorView* gb, bool with_outputs) {
  Validator v("moe_finalize_routing_bias_grad", kErrInnerNullptr);
  FinalizeRoutingBiasGradPlan p;
  p.op = v.op();
  p.shape_code = v.shape_code();
  v.present(gy, "grad_y");
  v.present(eidx, "expert_idx");
  if (with_outputs) v.present(gb, "grad_bias");
  v.dtype_in(*gy, "grad_y", kFloatTypes);
  v.index_dtype(*eidx, "expert_idx");
  if (scales) v.dtype_in(*scales, "scales", kFloatTypes);
  if (with_outputs) v.same_dtype(*gb, "grad_bias", gy->dtype, "grad_y's dtype");
  p.backend = select_backend(v, {{"grad_y", gy}, {"expert_idx", eidx}, {"scales", scales},
                                 {"grad_bias", gb}}, 3);
  v.contiguous(*gy, "grad_y");
  v.contiguous(*eidx, "expert_idx");
  optional_layout(v, scales, "scales");
  if (with_outputs) v.contiguous(*gb, "grad_bias");
  v.rank(*gy, "grad_y", 2);
  const int64_t H = gy->shape[1];
  v.check_shape(H >= 1, "grad_y", "hidden size H (dim 1) must be >= 1; got ", H);
  v.rank(*eidx, "expert_idx", 2);
  if (scales) v.rank(*scales, "scales", 2);
  // The odd one out is named (L50).
  std::vector<Claim> r_claims{dim_claim(*gy, "grad_y", 0), dim_claim(*eidx, "expert_idx", 0)};
  if (scales) r_claims.push_back(dim_claim(*scales, "scales", 0));
  const int64_t R = v.agree("token count R", r_claims);
  const int64_t K = eidx->shape[1];
  v.check_shape(K >= 1, "expert_idx", "top-k K (dim 1) must be >= 1; got ", K);
  if (scales) v.shape(*scales, "scales", {R, K});
  v.check_shape(a.expert_num >= 1, "expert_num", "must be >= 1; got ", a.expert_num);
  const int64_t E = a.expert_num;
  v.check_shape(mul_sat(E, H) < (int64_t{1} << 61) &&
                    bias_grad_workspace(E, mul_sat(R, K)) < (uint64_t{1} << 61),
                "expert_num",
                "expert_num * H (the grad_bias size) must stay below 2^61; got ", E, " * ", H);
  if (with_outputs) v.shape(*gb, "grad_bias", {E, H});
  check_index_range(v, kErrInnerNullptr, *eidx, "expert_idx", 0, E);
  p.grad_y = *gy;
  p.expert_idx = *eidx;
  if (scales) p.scales = *scales;
  if (with_outputs) p.grad_bias = *gb;
  p.has_scales = scales != nullptr;
  p.R = R;
  p.K = K;
  p.H = H;
  p.E = E;
  p.place(*gy, with_outputs);
  p.add_output("grad_bias", {E, H}, gy->dtype);
  return p;
}

namespace {
const KernelTable<FinalizeRoutingPlan> kForward = {
    {finalize_routing_cpu_size, finalize_routing_cpu},
    MOEGRAD_CUDA_ENTRY(finalize_routing_cuda_size, finalize_routing_cuda)};
const KernelTable<FinalizeRoutingGradPlan> kGrad = {
    {finalize_routing_grad_cpu_size, finalize_routing_grad_cpu},
    MOEGRAD_CUDA_ENTRY(finalize_routing_grad_cuda_size, finalize_routing_grad_cuda)};
const KernelTable<FinalizeRoutingBiasGradPlan> kBiasGrad = {
    {finalize_routing_bias_grad_cpu_size, finalize_routing_bias_grad_cpu},
    MOEGRAD_CUDA_ENTRY(finalize_routing_bias_grad_cuda_size, finalize_routing_bias_grad_cuda)};
}  // namespace

ExecutorPtr plan_moe_finalize_routing_bias_grad(const TensorView* grad_y,
                                                const TensorView* expert_idx,
                                                const TensorView* scales,
                                                const FinalizeRoutingBiasGradAttrs& attrs,
                                                const TensorView* grad_bias) {
  return make_executor(
      validate_finalize_routing_bias_grad(grad_y, expert_idx, scales, attrs, grad_bias, true),
      kBiasGrad);
}

ExecutorPtr prepare_moe_finalize_routing_bias_grad(const TensorView* grad_y,
                                                   const TensorView* expert_idx,
                                                   const TensorView* scales,
                                                   const FinalizeRoutingBiasGradAttrs& attrs) {
  return make_executor(
      validate_finalize_routing_bias_grad(grad_y, expert_idx, scales, attrs, nullptr, false),
      kBiasGrad);
}

std::vector<Shape> infer_moe_finalize_routing_bias_grad(const TensorView* grad_y,
                                                        const TensorView* expert_idx,
                                                        const TensorView* scales,
                                                        const FinalizeRoutingBiasGradAttrs& attrs) {
  FinalizeRoutingBiasGradPlan p =
      validate_finalize_routing_bias_grad(grad_y, expert_idx, scales, attrs, nullptr, false);
  return {{p.E, p.H}};
}

ExecutorPtr plan_moe_finalize_routing(const TensorView* expanded_x,
                                      const TensorView* expanded_row_idx, const TensorView* x1,
                                      const TensorView* x2, const TensorView* bias,
                                      const TensorView* scales, const TensorView* expert_idx,
                                      const FinalizeRoutingAttrs& attrs, const TensorView* out) {
  return make_executor(validate_finalize_routing(expanded_x, expanded_row_idx, x1, x2, bias,
                                                 scales, expert_idx, attrs, out, true, 0),
                       kForward);
}

ExecutorPtr prepare_moe_finalize_routing(const TensorView* expanded_x,
                                         const TensorView* expanded_row_idx, const TensorView* x1,
                                         const TensorView* x2, const TensorView* bias,
                                         const TensorView* scales, const TensorView* expert_idx,
                                         const FinalizeRoutingAttrs& attrs, int64_t k) {
  return make_executor(validate_finalize_routing(expanded_x, expanded_row_idx, x1, x2, bias,
                                                 scales, expert_idx, attrs, nullptr, false, k),
                       kForward);
}

std::vector<Shape> infer_moe_finalize_routing(const TensorView* expanded_x,
                                              const TensorView* expanded_row_idx,
                                              const TensorView* x1, const TensorView* x2,
                                              const TensorView* bias, const TensorView* scales,
                                              const TensorView* expert_idx,
                                              const FinalizeRoutingAttrs& attrs, int64_t k) {
  FinalizeRoutingPlan p = validate_finalize_routing(expanded_x, expanded_row_idx, x1, x2, bias,
                                                    scales, expert_idx, attrs, nullptr, false, k);
  return {{p.R, p.H}};
}

ExecutorPtr plan_moe_finalize_routing_grad(const TensorView* grad_y,
                                           const TensorView* expanded_row_idx,
                                           const TensorView* expanded_x, const TensorView* scales,
                                           const TensorView* expert_idx, const TensorView* bias,
                                           const FinalizeRoutingGradAttrs& attrs,
                                           const TensorView* grad_expanded_x,
                                           const TensorView* grad_scales) {
  return make_executor(validate_finalize_routing_grad(grad_y, expanded_row_idx, expanded_x,
                                                      scales, expert_idx, bias, attrs,
                                                      grad_expanded_x, grad_scales, true),
                       kGrad);
}

ExecutorPtr prepare_moe_finalize_routing_grad(const TensorView* grad_y,
                                              const TensorView* expanded_row_idx,
                                              const TensorView* expanded_x,
                                              const TensorView* scales,
                                              const TensorView* expert_idx,
                                              const TensorView* bias,
                                              const FinalizeRoutingGradAttrs& attrs) {
  return make_executor(validate_finalize_routing_grad(grad_y, expanded_row_idx, expanded_x,
                                                      scales, expert_idx, bias, attrs, nullptr,
                                                      nullptr, false),
                       kGrad);
}

std::vector<Shape> infer_moe_finalize_routing_grad(const TensorView* grad_y,
                                                   const TensorView* expanded_row_idx,
                                                   const TensorView* expanded_x,
                                                   const TensorView* scales,
                                                   const TensorView* expert_idx,
                                                   const TensorView* bias,
                                                   const FinalizeRoutingGradAttrs& attrs) {
  FinalizeRoutingGradPlan p = validate_finalize_routing_grad(
      grad_y, expanded_row_idx, expanded_x, scales, expert_idx, bias, attrs, nullptr, nullptr,
      false);
  return {p.grad_expanded_x_shape, p.grad_scales_shape};
}

}  // namespace moegrad
