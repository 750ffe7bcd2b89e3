// Validation, shape inference and planning of init routing and its grad (docs/operators.md
// §8.6, §8.8, §8.9; docs/decisions.md D25-D31, L30-L39).
#include "ops/init_routing/init_routing.h"

#include <algorithm>
#include <limits>

#include "core/backend.h"
#include "core/check.h"
#include "core/executor.h"
#include "core/host.h"

namespace moegrad {

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// Largest id of a host int32/int64 tensor (-1 when empty); device tensors report -1.
int64_t host_max(const TensorView& t) {
  if (t.device != Device::kCPU) return -1;
  int64_t m = -1;
  const int64_t n = t.numel();
  if (t.dtype == DType::kInt64) {
    const int64_t* p = static_cast<const int64_t*>(t.data);
    for (int64_t i = 0; i < n; ++i) m = std::max<int64_t>(m, p[i]);
  } else {
    const int32_t* p = static_cast<const int32_t*>(t.data);
    for (int64_t i = 0; i < n; ++i) m = std::max<int64_t>(m, p[i]);
  }
  return m;
}

}  // namespace

InitRoutingPlan validate_init_routing(const TensorView* x, const TensorView* eidx,
                                      const InitRoutingAttrs& a, const TensorView* ex,
                                      const TensorView* idx, const TensorView* tokens,
                                      const TensorView* offsets, bool with_outputs) {
  Validator v("moe_init_routing", kErrInnerNullptr);
  InitRoutingPlan p;
  v.present(x, "x");
  v.present(eidx, "expert_idx");
  if (with_outputs) {
    v.present(ex, "expanded_x");
    v.present(idx, "expanded_row_idx");
    if (a.expert_tokens_num_flag) v.present(tokens, "expert_tokens_count_or_cumsum");
  }
  const bool aligned = a.align_block > 1;
  if (with_outputs && aligned) v.present(offsets, "padded_offsets");  // null tensors first
  // Dtypes, device and layouts: 161002.
  v.dtype_in(*x, "x", kFloatTypes);
  v.index_dtype(*eidx, "expert_idx");
  const TensorView* tok = a.expert_tokens_num_flag ? tokens : nullptr;
  const TensorView* off = aligned && with_outputs ? offsets : nullptr;
  if (with_outputs) {
    v.same_dtype(*ex, "expanded_x", x->dtype, "x's dtype");
    v.same_dtype(*idx, "expanded_row_idx", DType::kInt32, "int32");
    if (tok) v.dtype_in(*tok, "expert_tokens_count_or_cumsum", {DType::kInt64, DType::kInt32});
    if (off) v.same_dtype(*off, "padded_offsets", DType::kInt64, "int64");
  }
  p.backend = select_backend(v, {{"x", x}, {"expert_idx", eidx},
                                 {"expanded_x", with_outputs ? ex : nullptr},
                                 {"expanded_row_idx", with_outputs ? idx : nullptr},
                                 {"expert_tokens_count_or_cumsum", tok},
                                 {"padded_offsets", off}}, 2);
  v.contiguous(*x, "x");
  v.contiguous(*eidx, "expert_idx");
  if (with_outputs) {
    v.contiguous(*ex, "expanded_x");
    v.contiguous(*idx, "expanded_row_idx");
    if (tok) v.contiguous(*tok, "expert_tokens_count_or_cumsum");
    if (off) v.contiguous(*off, "padded_offsets");
  }

  // Attributes: 561103.
  const int64_t mode = a.drop_pad_mode;
  v.check_shape(mode == 0 || mode == 1, "drop_pad_mode",
                "must be 0 (dropless/active) or 1 (drop-pad); got ", mode);
  v.check_shape(a.expert_num >= 0, "expert_num", "must be >= 0; got ", a.expert_num);
  const int64_t E = a.expert_num;
  // unused in drop/pad mode, but checked there too: a negative count other than V3's -1 is a bug
  v.check_shape(a.active_num >= -1, "active_num",
                "must be >= 0 (or -1, the same as 0); got ", a.active_num);
  if (mode == 0) {
    // unused without drop/pad, but a negative capacity other than V3's default -1 is a bug
    v.check_shape(a.expert_capacity >= -1, "expert_capacity",
                  "must be >= 0 (or -1, the same as 0); got ", a.expert_capacity);
  } else {
    v.check_shape(E > 0, "expert_num", "must be > 0 in drop-pad mode; got ", E);
    v.check_shape(a.expert_capacity >= 1, "expert_capacity",
                  "must be >= 1 in drop-pad mode; got ", a.expert_capacity);
    v.check_shape(a.row_idx_type == 0, "row_idx_type",
                  "must be 0 (src->dst) in drop-pad mode; got ", a.row_idx_type);
  }
  v.check_shape(a.row_idx_type == 0 || a.row_idx_type == 1, "row_idx_type",
                "must be 0 (src->dst, gather) or 1 (dst->src, scatter); got ",
                a.row_idx_type);
  // D36: aligned blocks need the dropless layout with every row, the src->dst index and a known
  // expert count (the row count of expanded_x depends on it).
  v.check_shape(a.align_block >= 0 && a.align_block <= 4096, "align_block",
                "must satisfy 0 <= align_block <= 4096 (0 and 1: off); got ", a.align_block);
  if (aligned) {
    v.check_shape(mode == 0, "drop_pad_mode",
                  "must be 0 (dropless) with align_block > 1; got ", mode);
    v.check_shape(a.active_num <= 0, "active_num",
                  "must be 0 with align_block > 1 (every row is kept); got ", a.active_num);
    v.check_shape(a.row_idx_type == 0, "row_idx_type",
                  "must be 0 (src->dst) with align_block > 1; got ", a.row_idx_type);
    v.check_shape(E > 0, "expert_num", "must be > 0 with align_block > 1; got ", E);
  }
  if (a.expert_tokens_num_flag) {
    v.check_shape(a.expert_tokens_num_type >= 0 && a.expert_tokens_num_type <= 2,
                  "expert_tokens_num_type",
                  "must be 0 (cumsum), 1 (count) or 2 (key-value); got ",
                  a.expert_tokens_num_type);
    v.check_shape(E > 0, "expert_num",
                  "must be > 0 when expert token counts are requested; got ", E);
  }
  int64_t lo = 0, hi = E;
  if (a.has_range) {
    lo = a.expert_start;
    hi = a.expert_end;
    v.check_shape(E > 0, "expert_num",
                  "must be > 0 with an active_expert_range; got ", E);
    v.check_shape(0 <= lo && lo < hi && hi <= E, "active_expert_range",
                  "[start, end] must satisfy 0 <= start < end <= expert_num (", E, "); got [",
                  lo, ", ", hi, "]");
    if (mode == 1) {
      v.check_shape(lo == 0 && hi == E, "active_expert_range",
                    "must be [0, ", E, "] (all experts) in drop-pad mode; got [", lo, ", ",
                    hi, "]");
    }
  }

  // Shapes: 561103.
  v.rank(*x, "x", 2);
  v.rank(*eidx, "expert_idx", 2);
  const int64_t H = x->shape[1];
  const int64_t K = eidx->shape[1];
  // The odd one out is named (L50); expanded_row_idx's R * K rows witness R.
  std::vector<Claim> r_claims{dim_claim(*x, "x", 0), dim_claim(*eidx, "expert_idx", 0)};
  if (with_outputs && idx->ndim == 1) {
    if (auto w = witness_claim(*idx, "expanded_row_idx", 0, K)) r_claims.push_back(*w);
  }
  const int64_t R = v.agree("token count R", r_claims);
  v.check_shape(H >= 1, "x", "hidden size H (dim 1) must be >= 1; got ", H);
  v.check_shape(K >= 1, "expert_idx", "top-k K (dim 1) must be >= 1; got ", K);
  const int64_t N = mul_sat(R, K);
  v.check_shape(N <= kInt32Max, "expert_idx",
                "R * K must fit the int32 index (<= ", kInt32Max, "); got ", N);
  int64_t rows;
  Shape ex_shape;
  if (mode == 0) {
    const int64_t A = a.active_num > 0 ? a.active_num : 0;
    rows = A > 0 ? std::min(A, N) : N;
    // D36: at most align - 1 padding rows per block.
    if (aligned) rows = add_sat(N, mul_sat(hi - lo, a.align_block - 1));
    v.check_shape(rows <= kInt32Max, "align_block",
                  "R * K + (experts) * (align_block - 1) must fit the int32 index; got ", rows);
    ex_shape = {rows, H};
  } else {
    v.check_shape(mul_sat(E, a.expert_capacity) <= kInt32Max, "expert_capacity",
                  "expert_num * expert_capacity must fit the int32 index; got ", E, " * ",
                  a.expert_capacity);
    rows = E * a.expert_capacity;
    ex_shape = {E, a.expert_capacity, H};
  }
  const int64_t token_type = a.expert_tokens_num_type;
  Shape tok_shape = {0};
  if (a.expert_tokens_num_flag) {
    tok_shape = token_type == 2 ? Shape{E, 2} : Shape{hi - lo};
  }
  const Shape off_shape = {aligned ? hi - lo + 1 : 0};
  if (with_outputs) {
    v.shape(*ex, "expanded_x", ex_shape);
    v.shape(*idx, "expanded_row_idx", {N});
    if (tok) v.shape(*tok, "expert_tokens_count_or_cumsum", tok_shape);
    if (off) v.shape(*off, "padded_offsets", off_shape);
  }

  // Expert id values (D28): with a window, ids outside it are excluded, not errors; without one
  // they must lie in [0, E) when E is known, else be >= 0.
  bool window_all = false;
  if (a.has_range && eidx->dtype == DType::kInt64) {
    // Ids outside the window are excluded, but int64 ids must still fit the int32 kernels.
    check_index_range(v, kErrInnerNullptr, *eidx, "expert_idx",
                      std::numeric_limits<int32_t>::min(), kInt32Max + 1);
  }
  if (!a.has_range) {
    if (E > 0) {
      check_index_range(v, kErrInnerNullptr, *eidx, "expert_idx", 0, E);
    } else {
      check_index_range(v, kErrInnerNullptr, *eidx, "expert_idx", 0, kInt32Max + 1);
      window_all = true;
      lo = 0;
      hi = host_max(*eidx) + 1;
    }
  }

  p.op = "moe_init_routing";
  p.shape_code = kErrInnerNullptr;
  p.x = *x;
  p.expert_idx = *eidx;
  if (with_outputs) {
    p.expanded_x = *ex;
    p.expanded_row_idx = *idx;
    if (tok) p.expert_tokens = *tok;
    if (off) p.padded_offsets = *off;
  }
  p.has_tokens = a.expert_tokens_num_flag;
  p.align = aligned ? a.align_block : 1;
  p.place(*x, with_outputs);
  p.add_output("expanded_x", ex_shape, x->dtype);
  p.add_output("expanded_row_idx", {N}, DType::kInt32);
  p.add_output("expert_tokens_count_or_cumsum", tok_shape,
               tok ? tok->dtype : DType::kInt64, !a.expert_tokens_num_flag);
  p.add_output("padded_offsets", off_shape, DType::kInt64, !aligned);
  p.R = R;
  p.K = K;
  p.H = H;
  p.mode = mode;
  p.rows = rows;
  p.capacity = mode == 1 ? a.expert_capacity : 0;
  p.expert_num = E;
  p.lo = lo;
  p.hi = hi;
  p.window_all = window_all;
  p.token_type = token_type;
  p.row_idx_type = a.row_idx_type;
  const int64_t bins = std::max<int64_t>(hi - lo, 0);
  // Ids much sparser than the slots (only possible without E) sort by comparison (L33).
  p.comparison_sort = window_all && bins > 2 * N + 65536;
  const int64_t counted_bins = p.comparison_sort ? 0 : bins;
  int64_t chunks = std::clamp<int64_t>(N / 16384, 1, 64);
  if (counted_bins > 0) {
    chunks = std::min<int64_t>(chunks, std::max<int64_t>(1, 4 * N / counted_bins));
  }
  p.chunks = chunks;
  // expert_num is an attribute, not bounded by any tensor when no count output is asked for:
  // the counting workspace (4 bytes per expert for the starts and for each chunk's histogram)
  // must be refused before it, or the whole workspace with it, overflows (L52).
  const int64_t count_bytes = mul_sat(mul_sat(add_sat(counted_bins, 1), 4), chunks + 1);
  v.check_shape(count_bytes < (int64_t{1} << 60), "expert_num",
                "the per-expert counting workspace (4 bytes per expert and sort chunk, plus "
                "the starts) must stay below 2^60 bytes; got expert_num ", E);
  return p;
}

InitRoutingGradPlan validate_init_routing_grad(const TensorView* gex, const TensorView* idx,
                                               const InitRoutingGradAttrs& a,
                                               const TensorView* gx, bool with_outputs) {
  Validator v("moe_init_routing_grad", kErrInnerNullptr);
  InitRoutingGradPlan p;
  v.present(gex, "grad_expanded_x");
  v.present(idx, "expanded_row_idx");
  if (with_outputs) v.present(gx, "grad_x");
  v.dtype_in(*gex, "grad_expanded_x", kFloatTypes);
  v.index_dtype(*idx, "expanded_row_idx");
  if (with_outputs) v.same_dtype(*gx, "grad_x", gex->dtype, "grad_expanded_x's dtype");
  p.backend = select_backend(v, {{"grad_expanded_x", gex}, {"expanded_row_idx", idx},
                                 {"grad_x", with_outputs ? gx : nullptr}}, 2);
  v.contiguous(*gex, "grad_expanded_x");
  v.contiguous(*idx, "expanded_row_idx");
  if (with_outputs) v.contiguous(*gx, "grad_x");

  const int64_t mode = a.drop_pad_mode;
  v.check_shape(mode == 0 || mode == 1, "drop_pad_mode",
                "must be 0 (dropless/active) or 1 (drop-pad); got ", mode);
  v.check_shape(a.top_k >= 1, "top_k", "must be >= 1; got ", a.top_k);
  v.check_shape(a.active_num >= 0, "active_num", "must be >= 0; got ", a.active_num);
  v.rank(*idx, "expanded_row_idx", 1);
  const int64_t N = idx->shape[0], K = a.top_k;
  v.check_shape(N % K == 0, "expanded_row_idx",
                "length must be a multiple of top_k (", K, "); got ", N);
  const int64_t R = N / K;
  v.check_shape(a.padded_rows >= 0, "padded_rows", "must be >= 0; got ", a.padded_rows);
  const bool padded = a.padded_rows > 0;
  if (padded) {
    v.check_shape(mode == 0 && a.active_num == 0, "padded_rows",
                  "must be 0 unless drop_pad_mode = 0 and active_num = 0; got ", a.padded_rows);
  }
  if (mode == 0) {
    v.rank(*gex, "grad_expanded_x", 2);
    if (padded) {
      v.dim(*gex, "grad_expanded_x", 0, a.padded_rows, "padded_rows");
    } else {
      const int64_t want = a.active_num > 0 ? std::min(a.active_num, N) : N;
      v.dim(*gex, "grad_expanded_x", 0, want,
            a.active_num > 0 ? "min(active_num, R * K)"
                             : "R * K (the length of expanded_row_idx)");
    }
  } else {
    v.rank(*gex, "grad_expanded_x", 3);
  }
  const int64_t H = gex->shape[gex->ndim - 1];
  v.check_shape(H >= 1, "grad_expanded_x", "hidden size H (last dim) must be >= 1; got ", H);
  const int64_t rows = mode == 0 ? gex->shape[0] : mul_sat(gex->shape[0], gex->shape[1]);
  v.check_shape(rows <= kInt32Max, "grad_expanded_x",
                "row count must fit the int32 index; got ", rows);
  if (with_outputs) v.shape(*gx, "grad_x", {R, H});
  // D29: values in [-1, limit), each valid value at most once; the kernel skips -1 and d >= rows.
  const int64_t limit = mode == 0 && !padded ? N : rows;
  check_index_range(v, kErrInnerNullptr, *idx, "expanded_row_idx", -1, limit);
  check_index_unique(v, kErrInnerNullptr, *idx, "expanded_row_idx", limit);

  p.op = "moe_init_routing_grad";
  p.shape_code = kErrInnerNullptr;
  p.grad_expanded_x = *gex;
  p.expanded_row_idx = *idx;
  if (with_outputs) p.grad_x = *gx;
  p.place(*gex, with_outputs);
  p.add_output("grad_x", {R, H}, gex->dtype);
  p.R = R;
  p.K = K;
  p.H = H;
  p.rows = rows;
  return p;
}

namespace {
const KernelTable<InitRoutingPlan> kForward = {
    {init_routing_cpu_size, init_routing_cpu},
    MOEGRAD_CUDA_ENTRY(init_routing_cuda_size, init_routing_cuda)};
const KernelTable<InitRoutingGradPlan> kGrad = {
    {init_routing_grad_cpu_size, init_routing_grad_cpu},
    MOEGRAD_CUDA_ENTRY(init_routing_grad_cuda_size, init_routing_grad_cuda)};
}  // namespace

ExecutorPtr plan_moe_init_routing(const TensorView* x, const TensorView* expert_idx,
                                  const InitRoutingAttrs& attrs, const TensorView* expanded_x,
                                  const TensorView* expanded_row_idx,
                                  const TensorView* expert_tokens,
                                  const TensorView* padded_offsets) {
  return make_executor(validate_init_routing(x, expert_idx, attrs, expanded_x, expanded_row_idx,
                                             expert_tokens, padded_offsets, true),
                       kForward);
}

ExecutorPtr prepare_moe_init_routing(const TensorView* x, const TensorView* expert_idx,
                                     const InitRoutingAttrs& attrs) {
  return make_executor(
      validate_init_routing(x, expert_idx, attrs, nullptr, nullptr, nullptr, nullptr, false),
      kForward);
}

std::vector<Shape> infer_moe_init_routing(const TensorView* x, const TensorView* expert_idx,
                                          const InitRoutingAttrs& attrs) {
  InitRoutingPlan p =
      validate_init_routing(x, expert_idx, attrs, nullptr, nullptr, nullptr, nullptr, false);
  return {p.outputs[0].shape, p.outputs[1].shape, p.outputs[2].shape, p.outputs[3].shape};
}

ExecutorPtr plan_moe_init_routing_grad(const TensorView* grad_expanded_x,
                                       const TensorView* expanded_row_idx,
                                       const InitRoutingGradAttrs& attrs,
                                       const TensorView* grad_x) {
  return make_executor(
      validate_init_routing_grad(grad_expanded_x, expanded_row_idx, attrs, grad_x, true), kGrad);
}

ExecutorPtr prepare_moe_init_routing_grad(const TensorView* grad_expanded_x,
                                          const TensorView* expanded_row_idx,
                                          const InitRoutingGradAttrs& attrs) {
  return make_executor(
      validate_init_routing_grad(grad_expanded_x, expanded_row_idx, attrs, nullptr, false),
      kGrad);
}

std::vector<Shape> infer_moe_init_routing_grad(const TensorView* grad_expanded_x,
                                               const TensorView* expanded_row_idx,
                                               const InitRoutingGradAttrs& attrs) {
  InitRoutingGradPlan p =
      validate_init_routing_grad(grad_expanded_x, expanded_row_idx, attrs, nullptr, false);
  return {p.outputs[0].shape};
}

}  // namespace moegrad
