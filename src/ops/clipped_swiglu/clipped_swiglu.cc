// Validation, shape inference and planning of ClippedSwiglu and ClippedSwigluGrad
// (docs/operators.md §9.3, §9.6; docs/decisions.md D32, L160-L162).
#include "ops/clipped_swiglu/clipped_swiglu.h"

#include <cmath>

#include "core/backend.h"
#include "core/check.h"
#include "core/executor.h"

namespace moegrad {

namespace {

constexpr int kMaxRank = 8;
constexpr double kDefaultAlpha = 1.702;
constexpr double kDefaultBias = 1.0;

// The attributes (D32): clamp_mode 0/1 and the mode-1 defaults (161002), limit > 0 and finite,
// alpha and bias finite (561002).
void check_attrs(const Validator& v, const ClippedSwigluAttrs& a, ClippedSwigluShape& s) {
  v.check(a.clamp_mode == 0 || a.clamp_mode == 1, kErrParamInvalid, "clamp_mode",
          "must be 0 (clamp before the activation) or 1 (after); got ", a.clamp_mode);
  v.check_shape(std::isfinite(a.limit) && a.limit > 0.0, "limit", "must be > 0 and finite; got ",
                a.limit);
  v.check_shape(std::isfinite(a.alpha), "alpha", "must be finite; got ", a.alpha);
  v.check_shape(std::isfinite(a.bias), "bias", "must be finite; got ", a.bias);
  if (a.clamp_mode == 1) {
    // Mode 1 uses neither: a value other than the default would be silently ignored.
    v.check(a.alpha == kDefaultAlpha, kErrParamInvalid, "alpha",
            "takes no part in clamp_mode 1 and must keep its default 1.702; got ", a.alpha);
    v.check(a.bias == kDefaultBias, kErrParamInvalid, "bias",
            "takes no part in clamp_mode 1 and must keep its default 1.0; got ", a.bias);
  }
  s.alpha = static_cast<float>(a.alpha);
  s.limit = static_cast<float>(a.limit);
  s.bias = static_cast<float>(a.bias);
  s.interleaved = a.interleaved;
  s.clamp_mode = a.clamp_mode;
}

// Rank 1..8 and dim in range (161002), x.shape[dim] even (561002); the folded sizes and y's shape.
Shape fold(const Validator& v, const TensorView& x, int64_t dim, ClippedSwigluShape& s) {
  v.check(x.ndim >= 1 && x.ndim <= kMaxRank, kErrParamInvalid, "x",
          "rank must be in [1, 8]; got ", x.ndim, " in ", shape_str(x));
  v.check(dim >= -x.ndim && dim < x.ndim, kErrParamInvalid, "dim", "must be in [", -x.ndim, ", ",
          x.ndim - 1, "] for x of rank ", x.ndim, "; got ", dim);
  const int d = static_cast<int>(dim < 0 ? dim + x.ndim : dim);
  const int64_t cut = x.shape[d];
  v.check_shape(cut % 2 == 0, "x", "shape[dim] must be even; got ", cut, " at dim ", dim, " of ",
                shape_str(x));
  // Empty tensors are valid (D4) and compute nothing; otherwise the products fit (numel does).
  int64_t pre = 0, after = 0;
  if (x.numel() > 0) {
    pre = after = 1;
    for (int i = 0; i < d; ++i) pre *= x.shape[i];
    for (int i = d + 1; i < x.ndim; ++i) after *= x.shape[i];
  }
  s.pre = pre;
  s.h = cut / 2 * after;
  Shape y(x.shape, x.shape + x.ndim);
  y[d] = cut / 2;
  return y;
}

void check_group_index(const Validator& v, const TensorView* g, ClippedSwigluShape& s) {
  // As swiglu_group (D32): int64 (161002), 1-D (561002), contiguous.
  if (!g) return;
  v.rank(*g, "group_index", 1);
  s.has_group_index = true;
  s.group_index = *g;
}

}  // namespace

ClippedSwigluPlan validate_clipped_swiglu(const TensorView* x, const TensorView* group_index,
                                          const ClippedSwigluAttrs& a, const TensorView* y,
                                          bool with_outputs) {
  Validator v("clipped_swiglu", kErrTiling);
  ClippedSwigluPlan p;
  p.op = v.op();
  p.shape_code = v.shape_code();
  v.present(x, "x");
  if (with_outputs) v.present(y, "y");
  v.dtype_in(*x, "x", kFloatTypes);
  if (group_index) v.same_dtype(*group_index, "group_index", DType::kInt64, "int64");
  if (with_outputs) v.same_dtype(*y, "y", x->dtype, "x's dtype");
  p.backend = select_backend(v, {{"x", x}, {"group_index", group_index}, {"y", y}}, 2);
  v.contiguous(*x, "x");
  if (group_index) v.contiguous(*group_index, "group_index");
  if (with_outputs) v.contiguous(*y, "y");
  check_attrs(v, a, p.s);
  p.y_shape = fold(v, *x, a.dim, p.s);
  check_group_index(v, group_index, p.s);
  if (with_outputs) {
    v.shape(*y, "y", p.y_shape);
    p.y = *y;
  }
  p.x = *x;
  p.place(*x, with_outputs);
  p.add_output("y", p.y_shape, x->dtype);
  return p;
}

ClippedSwigluGradPlan validate_clipped_swiglu_grad(const TensorView* gy, const TensorView* x,
                                                   const TensorView* group_index,
                                                   const ClippedSwigluAttrs& a,
                                                   const TensorView* gx, bool with_outputs) {
  Validator v("clipped_swiglu_grad", kErrTiling);
  ClippedSwigluGradPlan p;
  p.op = v.op();
  p.shape_code = v.shape_code();
  v.present(gy, "grad_y");
  v.present(x, "x");
  if (with_outputs) v.present(gx, "grad_x");
  v.dtype_in(*x, "x", kFloatTypes);
  v.same_dtype(*gy, "grad_y", x->dtype, "x's dtype");
  if (group_index) v.same_dtype(*group_index, "group_index", DType::kInt64, "int64");
  if (with_outputs) v.same_dtype(*gx, "grad_x", x->dtype, "x's dtype");
  p.backend = select_backend(
      v, {{"x", x}, {"grad_y", gy}, {"group_index", group_index}, {"grad_x", gx}}, 3);
  v.contiguous(*gy, "grad_y");
  v.contiguous(*x, "x");
  if (group_index) v.contiguous(*group_index, "group_index");
  if (with_outputs) v.contiguous(*gx, "grad_x");
  check_attrs(v, a, p.s);
  const Shape y_shape = fold(v, *x, a.dim, p.s);
  v.shape(*gy, "grad_y", y_shape);
  check_group_index(v, group_index, p.s);
  p.grad_x_shape = Shape(x->shape, x->shape + x->ndim);
  if (with_outputs) {
    v.shape(*gx, "grad_x", p.grad_x_shape);
    p.grad_x = *gx;
  }
  p.grad_y = *gy;
  p.x = *x;
  p.place(*x, with_outputs);
  p.add_output("grad_x", p.grad_x_shape, x->dtype);
  return p;
}

namespace {
const KernelTable<ClippedSwigluPlan> kForward = {
    {clipped_swiglu_cpu_size, clipped_swiglu_cpu},
    MOEGRAD_CUDA_ENTRY(clipped_swiglu_cuda_size, clipped_swiglu_cuda)};
const KernelTable<ClippedSwigluGradPlan> kGrad = {
    {clipped_swiglu_grad_cpu_size, clipped_swiglu_grad_cpu},
    MOEGRAD_CUDA_ENTRY(clipped_swiglu_grad_cuda_size, clipped_swiglu_grad_cuda)};
}  // namespace

ExecutorPtr plan_clipped_swiglu(const TensorView* x, const TensorView* group_index,
                                const ClippedSwigluAttrs& attrs, const TensorView* y) {
  return make_executor(validate_clipped_swiglu(x, group_index, attrs, y, true), kForward);
}

ExecutorPtr prepare_clipped_swiglu(const TensorView* x, const TensorView* group_index,
                                   const ClippedSwigluAttrs& attrs) {
  return make_executor(validate_clipped_swiglu(x, group_index, attrs, nullptr, false), kForward);
}

std::vector<Shape> infer_clipped_swiglu(const TensorView* x, const TensorView* group_index,
                                        const ClippedSwigluAttrs& attrs) {
  return {validate_clipped_swiglu(x, group_index, attrs, nullptr, false).y_shape};
}

ExecutorPtr plan_clipped_swiglu_grad(const TensorView* grad_y, const TensorView* x,
                                     const TensorView* group_index,
                                     const ClippedSwigluAttrs& attrs, const TensorView* grad_x) {
  return make_executor(
      validate_clipped_swiglu_grad(grad_y, x, group_index, attrs, grad_x, true), kGrad);
}

ExecutorPtr prepare_clipped_swiglu_grad(const TensorView* grad_y, const TensorView* x,
                                        const TensorView* group_index,
                                        const ClippedSwigluAttrs& attrs) {
  return make_executor(
      validate_clipped_swiglu_grad(grad_y, x, group_index, attrs, nullptr, false), kGrad);
}

std::vector<Shape> infer_clipped_swiglu_grad(const TensorView* grad_y, const TensorView* x,
                                             const TensorView* group_index,
                                             const ClippedSwigluAttrs& attrs) {
  return {validate_clipped_swiglu_grad(grad_y, x, group_index, attrs, nullptr, false)
              .grad_x_shape};
}

}  // namespace moegrad
