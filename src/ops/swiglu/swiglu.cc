// Validation, shape inference and planning of the SwiGLU operators (§5.6, D9, D11).
#include "ops/swiglu/swiglu.h"
#include "ops/swiglu/swiglu_formula.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "core/backend.h"
#include "core/executor.h"
#include "core/host.h"

namespace moegrad {

namespace {

constexpr int kMaxRank = 8;  // §5.3: ranks 1..8 (2..8 documented, 1 accepted by the host check)

// clamp_limit is -1.0 (off) or > 0 (D11); compared in fp32 as the device does.
float check_clamp(const Validator& v, double clamp_limit) {
  const float c = static_cast<float>(clamp_limit);
  v.check_shape(c == -1.0f || c > 0.0f, "clamp_limit",
                "must be -1.0 (off) or > 0 as float32; got ", clamp_limit);
  return c;
}

// Leading-dim product T of a [..., D] tensor.
int64_t leading(const TensorView& t) {
  int64_t n = 1;
  for (int i = 0; i + 1 < t.ndim; ++i) {
    if (t.shape[i] == 0) return 0;
  }
  for (int i = 0; i + 1 < t.ndim; ++i) n = mul_sat(n, t.shape[i]);
  return n;
}

void check_weight(const Validator& v, const TensorView& w, int64_t T) {
  v.same_dtype(w, "weight", DType::kFloat32, "float32");
  v.rank_in(w, "weight", 1, kMaxRank);
  v.check_shape(w.numel() == T, "weight",
                "element count must equal the token count T (product of x's leading dims, ",
                T, "); got ", w.numel(), " in ", shape_str(w));
}

void check_group_index(const Validator& v, const TensorView& g) {
  v.same_dtype(g, "group_index", DType::kInt64, "int64");
  v.rank(g, "group_index", 1);
}

Shape half_last(const TensorView& x) {
  Shape s(x.shape, x.shape + x.ndim);
  s.back() /= 2;
  return s;
}

}  // namespace

int64_t swiglu_active_rows(const TensorView* group_index, bool has_group_index, int64_t T) {
  if (!has_group_index) return T;
  // Host tensors are summed here; the CUDA path sums on the device. The sum is exact (128-bit:
  // no int64 element count can overflow it), then clamped to [0, T], so garbage or huge counts
  // can neither overflow nor wrap around to a small or negative total (L8, L52).
  const int64_t* g = static_cast<const int64_t*>(group_index->data);
  swiglu_formula::Sum128 sum = 0;
  for (int64_t i = 0; i < group_index->numel(); ++i) sum += g[i];
  return swiglu_formula::rows_of_sum(sum, T);
}

SwigluPlan validate_swiglu(const TensorView* x, const TensorView* weight,
                           const TensorView* group_index, const SwigluAttrs& a,
                           const TensorView* y, bool with_outputs) {
  Validator v("swiglu_group", kErrTiling);
  SwigluPlan p;
  p.op = v.op();
  p.shape_code = v.shape_code();
  v.present(x, "x");
  if (with_outputs) v.present(y, "y");
  v.dtype_in(*x, "x", kFloatTypes);
  if (weight) v.same_dtype(*weight, "weight", DType::kFloat32, "float32");
  if (group_index) v.same_dtype(*group_index, "group_index", DType::kInt64, "int64");
  if (with_outputs) v.same_dtype(*y, "y", x->dtype, "x's dtype");
  p.backend = select_backend(
      v, {{"x", x}, {"weight", weight}, {"group_index", group_index}, {"y", y}}, 3);
  v.contiguous(*x, "x");
  if (weight) v.contiguous(*weight, "weight");
  if (group_index) v.contiguous(*group_index, "group_index");
  if (with_outputs) v.contiguous(*y, "y");
  p.clamp = check_clamp(v, a.clamp_limit);
  v.rank_in(*x, "x", 1, kMaxRank);
  const int64_t D = x->shape[x->ndim - 1];
  v.check_shape(D >= 2 && D % 2 == 0, "x", "last dim must be even and >= 2 (2H); got ", D);
  const int64_t T = leading(*x);
  if (weight) check_weight(v, *weight, T);
  if (group_index) check_group_index(v, *group_index);
  p.y_shape = half_last(*x);
  if (with_outputs) v.shape(*y, "y", p.y_shape);
  p.x = *x;
  if (weight) p.weight = *weight;
  if (group_index) p.group_index = *group_index;
  if (with_outputs) p.y = *y;
  p.has_weight = weight != nullptr;
  p.has_group_index = group_index != nullptr;
  p.T = T;
  p.H = D / 2;
  p.place(*x, with_outputs);
  p.add_output("y", p.y_shape, x->dtype);
  return p;
}

SwigluGradPlan validate_swiglu_grad(const TensorView* gy, const TensorView* x,
                                    const TensorView* weight, const TensorView* y_origin,
                                    const TensorView* group_index, const SwigluAttrs& a,
                                    const TensorView* gx, const TensorView* gw,
                                    bool with_outputs) {
  Validator v("swiglu_group_quant_backward", kErrTiling);
  SwigluGradPlan p;
  p.op = v.op();
  p.shape_code = v.shape_code();
  v.present(gy, "grad_y");
  v.present(x, "x");
  if (with_outputs) v.present(gx, "grad_x");
  // y_origin is checked whenever given but only read together with weight (§5.5, §5.6).
  const TensorView* yo = y_origin;
  v.dtype_in(*gy, "grad_y", kFloatTypes);
  v.dtype_in(*x, "x", kFloatTypes);
  v.same_dtype(*gy, "grad_y", x->dtype, "x's dtype");
  if (weight) v.same_dtype(*weight, "weight", DType::kFloat32, "float32");
  if (y_origin) v.same_dtype(*y_origin, "y_origin", x->dtype, "x's dtype");
  if (group_index) v.same_dtype(*group_index, "group_index", DType::kInt64, "int64");
  if (with_outputs) {
    v.same_dtype(*gx, "grad_x", x->dtype, "x's dtype");
    if (gw) v.same_dtype(*gw, "grad_weight", DType::kFloat32, "float32");
  }
  p.backend = select_backend(v, {{"x", x}, {"grad_y", gy}, {"weight", weight},
                                 {"y_origin", yo}, {"group_index", group_index},
                                 {"grad_x", gx}, {"grad_weight", gw}}, 5, "grad_x", "x");
  v.contiguous(*gy, "grad_y");
  v.contiguous(*x, "x");
  if (weight) v.contiguous(*weight, "weight");
  if (yo) v.contiguous(*yo, "y_origin");
  if (group_index) v.contiguous(*group_index, "group_index");
  if (with_outputs) {
    v.contiguous(*gx, "grad_x");
    if (gw) v.contiguous(*gw, "grad_weight");
  }
  p.clamp = check_clamp(v, a.clamp_limit);
  v.rank_in(*x, "x", 1, kMaxRank);
  v.rank_in(*gy, "grad_y", 1, kMaxRank);
  if (y_origin) v.rank_in(*y_origin, "y_origin", 1, kMaxRank);
  const int64_t D = x->shape[x->ndim - 1];
  v.check_shape(D >= 2 && D % 2 == 0, "x", "last dim must be even and >= 2 (2H); got ", D);
  // Rank, leading dims and H: where grad_y, x and y_origin disagree, the odd one out is named
  // (L50); x's last dim counts as 2H.
  std::vector<Claim> rank_claims{rank_claim(*gy, "grad_y"), rank_claim(*x, "x")};
  if (y_origin) rank_claims.push_back(rank_claim(*y_origin, "y_origin"));
  const int64_t rank = v.agree("rank", rank_claims);
  for (int i = 0; i + 1 < rank; ++i) {
    std::vector<Claim> c{dim_claim(*gy, "grad_y", i), dim_claim(*x, "x", i)};
    if (y_origin) c.push_back(dim_claim(*y_origin, "y_origin", i));
    v.agree("leading dim", c);
  }
  std::vector<Claim> h_claims{dim_claim(*gy, "grad_y", -1),
                              half_dim_claim(*x, "x", -1)};
  if (y_origin) h_claims.push_back(dim_claim(*y_origin, "y_origin", -1));
  v.agree("hidden size H", h_claims);
  const int64_t T = leading(*x);
  if (weight) {
    check_weight(v, *weight, T);
    v.check_shape(y_origin != nullptr, "y_origin",
                  "y_origin is required when weight is given; got null");
  }
  if (y_origin) v.shape(*y_origin, "y_origin", Shape(gy->shape, gy->shape + gy->ndim));
  if (group_index) check_group_index(v, *group_index);
  p.grad_x_shape = Shape(x->shape, x->shape + x->ndim);
  p.grad_weight_shape = weight ? Shape(weight->shape, weight->shape + weight->ndim) : Shape{0};
  if (with_outputs) {
    v.shape(*gx, "grad_x", p.grad_x_shape);
    if (weight && gw) v.shape(*gw, "grad_weight", p.grad_weight_shape);
  }
  p.grad_y = *gy;
  p.x = *x;
  if (weight) p.weight = *weight;
  if (yo) p.y_origin = *yo;
  if (group_index) p.group_index = *group_index;
  if (with_outputs) {
    p.grad_x = *gx;
    if (gw && weight) p.grad_weight = *gw;
  }
  p.has_weight = weight != nullptr;
  p.has_group_index = group_index != nullptr;
  p.T = T;
  p.H = D / 2;
  p.place(*x, with_outputs);
  p.add_output("grad_x", p.grad_x_shape, x->dtype);
  p.add_output("grad_weight", p.grad_weight_shape, DType::kFloat32, true);
  return p;
}

namespace {
const KernelTable<SwigluPlan> kForward = {{swiglu_cpu_size, swiglu_cpu},
                                          MOEGRAD_CUDA_ENTRY(swiglu_cuda_size, swiglu_cuda)};
const KernelTable<SwigluGradPlan> kGrad = {
    {swiglu_grad_cpu_size, swiglu_grad_cpu},
    MOEGRAD_CUDA_ENTRY(swiglu_grad_cuda_size, swiglu_grad_cuda)};
}  // namespace

namespace {
const char* quant_dst_name(int64_t code) {
  switch (code) {
    case 34: return "HiFloat8";
    case 35: return "float8_e5m2";
    case 36: return "float8_e4m3fn";
    case 40: return "float4_e2m1";
    case 41: return "float4_e1m2";
    default: return "an unknown type";
  }
}

// dst_type of the Python front (docs/operators.md §6.2) -> aclDataType: the vendor's torch_npu
// codes and torch's ScalarType codes of the FP8 types; any other value is an aclDataType code.
int64_t acl_dst_type(int64_t code) {
  switch (code) {
    case 291: case 23: return 35;
    case 292: case 24: return 36;
    case 290: return 34;
    case 296: return 40;
    case 297: return 41;
    default: return code;
  }
}
}  // namespace

SwigluQuantPlan validate_swiglu_quant(const TensorView* x, const TensorView* weight,
                                      const TensorView* group_index, const TensorView* scale,
                                      const SwigluQuantAttrs& a, const TensorView* y,
                                      const TensorView* y_scale, const TensorView* y_origin,
                                      bool with_outputs) {
  Validator v("swiglu_group_quant", kErrTiling);
  SwigluQuantPlan p;
  p.op = v.op();
  p.shape_code = v.shape_code();
  v.present(x, "x");
  if (with_outputs) {
    v.present(y, "y");
    v.present(y_scale, "y_scale");
    if (a.output_origin) v.present(y_origin, "y_origin");
  }
  // Modes and target types (161002, D24): FP8 blocks (0) and MX (1) only.
  if (a.quant_mode == 2 || a.quant_mode == 3) {
    v.fail(kErrParamInvalid, "quant_mode",
           cat("HiFloat8 quantisation (quant_mode 2 static, 3 dynamic) is not supported; got ",
               a.quant_mode));
  }
  v.check(a.quant_mode == 0 || a.quant_mode == 1, kErrParamInvalid, "quant_mode",
          "must be 0 (FP8 blocks of 128) or 1 (MX blocks of 32); got ", a.quant_mode);
  // Messages name the code as the caller gave it, in the caller's vocabulary (L153).
  const int64_t dst = a.python_dst_codes ? acl_dst_type(a.dst_type) : a.dst_type;
  const char* fp8_codes = a.python_dst_codes
                              ? "float8_e4m3fn 292 / 24 or float8_e5m2 291 / 23"
                              : "float8_e4m3fn 36 or float8_e5m2 35";
  if (dst == 34 || dst == 40 || dst == 41) {
    v.fail(kErrParamInvalid, "dst_type",
           cat(quant_dst_name(dst), " output is not supported (", fp8_codes, " only); got ",
               a.dst_type));
  }
  v.check(dst == 35 || dst == 36, kErrParamInvalid, "dst_type", "must be ", fp8_codes, "; got ",
          a.dst_type);
  const int64_t block = a.quant_mode == 0 ? 128 : 32;
  v.check(a.block_size == 0 || a.block_size == block, kErrParamInvalid, "block_size",
          "must be 0 or ", block, " for quant_mode ", a.quant_mode, "; got ", a.block_size);
  v.check(a.quant_mode == 0 || a.round_scale, kErrParamInvalid, "round_scale",
          "quant_mode 1 (MX) needs power-of-two scales, round_scale = true; got false");
  v.check(scale == nullptr, kErrParamInvalid, "scale",
          "only the HiFloat8 static mode (quant_mode 2, not supported) takes a scale; got a "
          "tensor with quant_mode ", a.quant_mode);
  // Dtypes and layouts (161002).
  v.dtype_in(*x, "x", kFloatTypes);
  if (weight) v.same_dtype(*weight, "weight", DType::kFloat32, "float32");
  if (group_index) v.same_dtype(*group_index, "group_index", DType::kInt64, "int64");
  const DType y_dt = dst == 35 ? DType::kFloat8E5M2 : DType::kFloat8E4M3FN;
  const DType s_dt = a.quant_mode == 0 ? DType::kFloat32 : DType::kFloat8E8M0;
  if (with_outputs) {
    // uint8 is accepted as the storage of the 8-bit outputs (L25).
    v.dtype_in(*y, "y", {y_dt, DType::kUInt8});
    if (a.quant_mode == 0) {
      v.same_dtype(*y_scale, "y_scale", s_dt, "float32");
    } else {
      v.dtype_in(*y_scale, "y_scale", {s_dt, DType::kUInt8});
    }
    if (a.output_origin) v.same_dtype(*y_origin, "y_origin", x->dtype, "x's dtype");
  }
  const TensorView* yo_used = a.output_origin ? y_origin : nullptr;
  p.backend = select_backend(v, {{"x", x},
                                 {"weight", weight},
                                 {"group_index", group_index},
                                 {"y", y},
                                 {"y_scale", y_scale},
                                 {"y_origin", yo_used}}, 3);
  v.contiguous(*x, "x");
  if (weight) v.contiguous(*weight, "weight");
  if (group_index) v.contiguous(*group_index, "group_index");
  if (with_outputs) {
    v.contiguous(*y, "y");
    v.contiguous(*y_scale, "y_scale");
    if (yo_used) v.contiguous(*yo_used, "y_origin");
  }
  // Shapes and attributes (561002).
  p.clamp = check_clamp(v, a.clamp_limit);
  v.rank_in(*x, "x", 2, kMaxRank);
  const int64_t D = x->shape[x->ndim - 1];
  v.check_shape(D >= 2 && D % 2 == 0, "x", "last dim must be even and >= 2 (2H); got ", D);
  const int64_t T = leading(*x);
  const int64_t H = D / 2;
  if (weight) check_weight(v, *weight, T);
  if (group_index) check_group_index(v, *group_index);
  const int64_t blocks = (H + block - 1) / block;
  p.y_shape = half_last(*x);
  p.y_scale_shape = Shape(x->shape, x->shape + x->ndim - 1);
  if (a.quant_mode == 0) {
    p.y_scale_shape.push_back(blocks);
    p.scale_stride = blocks;
  } else {
    p.y_scale_shape.push_back((blocks + 1) / 2);
    p.y_scale_shape.push_back(2);
    p.scale_stride = 2 * ((blocks + 1) / 2);
  }
  p.y_origin_shape = a.output_origin ? p.y_shape : Shape{0};
  if (with_outputs) {
    v.shape(*y, "y", p.y_shape);
    v.shape(*y_scale, "y_scale", p.y_scale_shape);
    if (a.output_origin) v.shape(*y_origin, "y_origin", p.y_shape);
  }
  p.x = *x;
  if (weight) p.weight = *weight;
  if (group_index) p.group_index = *group_index;
  if (with_outputs) {
    p.y = *y;
    p.y_scale = *y_scale;
    if (a.output_origin) p.y_origin = *y_origin;
  }
  p.has_weight = weight != nullptr;
  p.has_group_index = group_index != nullptr;
  p.write_origin = a.output_origin;
  p.e5m2 = dst == 35;
  p.quant_mode = a.quant_mode;
  p.block = block;
  p.round_scale = a.round_scale || a.quant_mode == 1;
  p.T = T;
  p.H = H;
  p.blocks = blocks;
  p.place(*x, with_outputs);
  p.add_output("y", p.y_shape, y_dt);
  p.add_output("y_scale", p.y_scale_shape, s_dt);
  p.add_output("y_origin", p.y_origin_shape, x->dtype, !a.output_origin);
  return p;
}

namespace {
const KernelTable<SwigluQuantPlan> kQuant = {
    {swiglu_quant_cpu_size, swiglu_quant_cpu},
    MOEGRAD_CUDA_ENTRY(swiglu_quant_cuda_size, swiglu_quant_cuda)};
}  // namespace

ExecutorPtr plan_swiglu_group_quant(const TensorView* x, const TensorView* weight,
                                    const TensorView* group_index, const TensorView* scale,
                                    const SwigluQuantAttrs& attrs, const TensorView* y,
                                    const TensorView* y_scale, const TensorView* y_origin) {
  return make_executor(validate_swiglu_quant(x, weight, group_index, scale, attrs, y, y_scale,
                                             y_origin, true),
                       kQuant);
}

ExecutorPtr prepare_swiglu_group_quant(const TensorView* x, const TensorView* weight,
                                       const TensorView* group_index, const TensorView* scale,
                                       const SwigluQuantAttrs& attrs) {
  return make_executor(validate_swiglu_quant(x, weight, group_index, scale, attrs, nullptr,
                                             nullptr, nullptr, false),
                       kQuant);
}

std::vector<Shape> infer_swiglu_group_quant(const TensorView* x, const TensorView* weight,
                                            const TensorView* group_index,
                                            const TensorView* scale,
                                            const SwigluQuantAttrs& attrs) {
  SwigluQuantPlan p = validate_swiglu_quant(x, weight, group_index, scale, attrs, nullptr,
                                            nullptr, nullptr, false);
  return {p.y_shape, p.y_scale_shape, p.y_origin_shape};
}

ExecutorPtr plan_swiglu_group(const TensorView* x, const TensorView* weight,
                              const TensorView* group_index, const SwigluAttrs& attrs,
                              const TensorView* y) {
  return make_executor(validate_swiglu(x, weight, group_index, attrs, y, true), kForward);
}

ExecutorPtr prepare_swiglu_group(const TensorView* x, const TensorView* weight,
                                 const TensorView* group_index, const SwigluAttrs& attrs) {
  return make_executor(validate_swiglu(x, weight, group_index, attrs, nullptr, false), kForward);
}

std::vector<Shape> infer_swiglu_group(const TensorView* x, const TensorView* weight,
                                      const TensorView* group_index, const SwigluAttrs& attrs) {
  return {validate_swiglu(x, weight, group_index, attrs, nullptr, false).y_shape};
}

ExecutorPtr plan_swiglu_group_quant_grad(const TensorView* grad_y, const TensorView* x,
                                         const TensorView* weight, const TensorView* y_origin,
                                         const TensorView* group_index, const SwigluAttrs& attrs,
                                         const TensorView* grad_x,
                                         const TensorView* grad_weight) {
  return make_executor(validate_swiglu_grad(grad_y, x, weight, y_origin, group_index, attrs,
                                            grad_x, grad_weight, true),
                       kGrad);
}

ExecutorPtr prepare_swiglu_group_quant_grad(const TensorView* grad_y, const TensorView* x,
                                            const TensorView* weight, const TensorView* y_origin,
                                            const TensorView* group_index,
                                            const SwigluAttrs& attrs) {
  return make_executor(validate_swiglu_grad(grad_y, x, weight, y_origin, group_index, attrs,
                                            nullptr, nullptr, false),
                       kGrad);
}

std::vector<Shape> infer_swiglu_group_quant_grad(const TensorView* grad_y, const TensorView* x,
                                                 const TensorView* weight,
                                                 const TensorView* y_origin,
                                                 const TensorView* group_index,
                                                 const SwigluAttrs& attrs) {
  SwigluGradPlan p = validate_swiglu_grad(grad_y, x, weight, y_origin, group_index, attrs,
                                          nullptr, nullptr, false);
  return {p.grad_x_shape, p.grad_weight_shape};
}

}  // namespace moegrad
