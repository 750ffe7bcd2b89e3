// moegrad C++ API: fused Mixture-of-Experts training operators, forward and backward.
//
// Every operator has two stages, like aclnn (docs/operators.md §0.2):
//   plan_<op>(...)   validates every argument, infers shapes and returns an Executor;
//   Executor::run()  only computes. Nothing is written to any output when planning fails.
// Tensors are non-owning views (TensorView); optional tensors are passed as nullptr.
// Errors are thrown as moegrad::Error carrying a status code (docs/decisions.md D18):
//   161001 a required tensor is null, 161002 dtype/format/value invalid,
//   561002 gating-forward / SwiGLU shape or attribute error, 561103 finalize-routing shape/value.
// The C API (aclnn.h) and the Python module are thin layers over these functions.
#ifndef MOEGRAD_MOEGRAD_H_
#define MOEGRAD_MOEGRAD_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(_WIN32)
#define MOEGRAD_API __declspec(dllexport)
#else
#define MOEGRAD_API __attribute__((visibility("default")))
#endif

namespace moegrad {

// Status codes (docs/operators.md §0.3, decisions.md D18).
enum Status : int32_t {
  kSuccess = 0,
  kErrNullptr = 161001,       // ACLNN_ERR_PARAM_NULLPTR
  kErrParamInvalid = 161002,  // ACLNN_ERR_PARAM_INVALID
  kErrTiling = 561002,        // ACLNN_ERR_INNER_TILING_ERROR
  kErrInnerNullptr = 561103,  // ACLNN_ERR_INNER_NULLPTR (finalize routing shape/value errors)
};

// The one exception type of the library: a status code and a message that names the operator,
// the argument, the rule and the value seen.
class MOEGRAD_API Error : public std::runtime_error {
 public:
  Error(int32_t code, const std::string& message);
  int32_t code() const noexcept { return code_; }

 private:
  int32_t code_;
};

// Element types; the values equal aclDataType's.
enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kInt32 = 3,
  kInt64 = 9,
  kBFloat16 = 27,
  kUInt8 = 4,           // raw bytes: storage of FP8 / e8m0 outputs where a framework lacks them
  kHiFloat8 = 34,       // named in errors only (no operator takes it)
  kFloat8E5M2 = 35,
  kFloat8E4M3FN = 36,
  kFloat8E8M0 = 37,     // MX scales: an unsigned power-of-two exponent, bias 127
  kOther = -2,  // any type no operator accepts (reported by name in errors)
};

enum class Device : int32_t { kCPU = 1, kCUDA = 2 };

// Views hold up to 16 dims so that rank rules (e.g. SwiGLU's 1..8) report a named shape error.
constexpr int kMaxDims = 16;

// A non-owning strided view. Strides are in elements. The C API requires contiguous views
// (D19); the Python front makes inputs contiguous before calling.
struct MOEGRAD_API TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int32_t ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
  Device device = Device::kCPU;
  int32_t device_id = 0;
  // The aclFormat a C API caller gave (ND = 2; the C++ and Python fronts leave it). Stage one
  // refuses, with 161002, any format it does not read as ND (docs/operators.md §0.5).
  int32_t format = 2;

  int64_t numel() const;
  bool is_contiguous() const;
  // A contiguous view of `shape` (rank <= kMaxDims) over `data`.
  static TensorView contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                               Device device = Device::kCPU, int32_t device_id = 0);
};

using Shape = std::vector<int64_t>;

// An output a plan will write: its shape and dtype as inferred in stage one.
struct OutputSpec {
  Shape shape;
  DType dtype = DType::kFloat32;
  bool optional = false;  // may be bound to nullptr: the output is then not computed
};

// A planned operator call (stage two). Stage one has validated everything and chosen the
// backend (from the tensors' device); running it only computes. CUDA kernels run on `stream`.
class MOEGRAD_API Executor {
 public:
  virtual ~Executor();
  // Scratch bytes run() must be handed (host memory for CPU plans, device memory for CUDA).
  virtual uint64_t workspace_size() const = 0;
  // The outputs in the operator's order, as planned.
  virtual const std::vector<OutputSpec>& outputs() const = 0;
  virtual Device device() const = 0;
  virtual int32_t device_id() const = 0;
  // Runs a plan made with its outputs (plan_*). Throws Error(161002) if workspace_size() > 0
  // and `workspace` is null or smaller than workspace_size().
  virtual void run(void* workspace, uint64_t workspace_bytes, void* stream) = 0;
  // Binds outputs[0..n) (n == outputs().size()) and runs: the plan_* form for plans made
  // without outputs (prepare_*). Each output is checked in O(1) against outputs(): present
  // (unless optional), dtype, shape, contiguous, same device. One run at a time per executor:
  // a run (either form) started while another thread runs the same executor throws
  // Error(161002) naming the executor; destroying it during a run is the owner's error.
  virtual void run(const TensorView* const* outputs, size_t n, void* workspace,
                   uint64_t workspace_bytes, void* stream) = 0;
};

using ExecutorPtr = std::unique_ptr<Executor>;

// ---- Gating top-k (§2; decisions D2, D12, D13; docs/decisions.md L1-L3) ----
struct GatingTopKAttrs {
  int64_t k = 1;                  // experts per token, 1 <= k <= N
  int64_t k_group = 1;            // groups kept, 1 <= k_group <= group_count
  int64_t group_count = 1;        // groups, divides N
  int64_t group_select_mode = 0;  // 0: group max, 1: sum of the group's top two
  int64_t renorm = 0;             // softmax only: 1 renormalises the k weights
  int64_t norm_type = 0;          // 0 softmax, 1 sigmoid, 2 sqrt(softplus)
  bool out_flag = false;          // write norm_out (else it is zero-filled, L1)
  double routed_scaling_factor = 1.0;
  double eps = 1e-20;
  bool no_renorm = false;  // true: never renormalise the k weights, any norm type (D33)
};
// x [M,N] fp32/fp16/bf16; bias [N] x.dtype (selection only) or null;
// y [M,k] x.dtype; expert_idx [M,k] int32; norm_out [M,N] fp32. Shape errors: 561002.
MOEGRAD_API ExecutorPtr plan_moe_gating_top_k(const TensorView* x, const TensorView* bias,
                                              const GatingTopKAttrs& attrs, const TensorView* y,
                                              const TensorView* expert_idx,
                                              const TensorView* norm_out);
// Shapes of (y, expert_idx, norm_out) after validating inputs and attributes.
MOEGRAD_API std::vector<Shape> infer_moe_gating_top_k(const TensorView* x, const TensorView* bias,
                                                      const GatingTopKAttrs& attrs);

// ---- Gating top-k backward (§1; D1, D2, D3, D15, D22; L20) ----
struct GatingTopKBackwardAttrs {
  int64_t renorm = 0;     // softmax only: 0 or 1 as in the forward; ignored for norm_type 1/2
  int64_t norm_type = 1;  // 0 softmax, 1 sigmoid (default), 2 sqrt(softplus)
  double routed_scaling_factor = 1.0;
  double eps = 1e-20;
  bool no_renorm = false;  // true: the forward did not renormalise, any norm type (D33)
};
// x_norm [M,N] fp32 (2 <= N <= 2048), the forward's norm_out: softmax, sigmoid or
// sqrt(softplus) of the logits per norm_type; grad_y [M,K] fp32/fp16/bf16; expert_idx [M,K]
// int32 or int64 in [0,N); grad_x [M,N] grad_y.dtype. Every error but null is 161002 (D3).
MOEGRAD_API ExecutorPtr plan_moe_gating_top_k_backward(const TensorView* x_norm,
                                                       const TensorView* grad_y,
                                                       const TensorView* expert_idx,
                                                       const GatingTopKBackwardAttrs& attrs,
                                                       const TensorView* grad_x);
MOEGRAD_API std::vector<Shape> infer_moe_gating_top_k_backward(
    const TensorView* x_norm, const TensorView* grad_y, const TensorView* expert_idx,
    const GatingTopKBackwardAttrs& attrs);

// ---- Gating replay (moegrad extension, D33, D34; docs/operators.md §2.8) ----
// The gating forward with the selection replaced by given expert ids: the weights are computed
// from the current scores at those ids with the forward's normalisation, renormalisation, eps
// and scaling; the selection bias plays no part. Its gradient is moe_gating_top_k_backward.
struct GatingReplayAttrs {
  int64_t renorm = 0;      // softmax only: 1 renormalises the K weights (as the forward)
  int64_t norm_type = 0;   // 0 softmax, 1 sigmoid, 2 sqrt(softplus)
  double routed_scaling_factor = 1.0;
  double eps = 1e-20;
  bool no_renorm = false;  // true: never renormalise, any norm type (D33)
};
// x [M,N] fp32/fp16/bf16 (1 <= N <= 2048); bias [N] x.dtype or null (checked, unused);
// expert_idx [M,K] int32 (int64 in the C++ API), 1 <= K <= N; host ids in [0, N), no id twice in
// a row (161002 naming row and value); y [M,K] x.dtype; norm_out [M,N] fp32, always written.
// Dtype errors 161002, shape/attribute errors 561002.
MOEGRAD_API ExecutorPtr plan_moe_gating_replay(const TensorView* x, const TensorView* expert_idx,
                                               const TensorView* bias,
                                               const GatingReplayAttrs& attrs, const TensorView* y,
                                               const TensorView* norm_out);
// Shapes of (y, norm_out).
MOEGRAD_API std::vector<Shape> infer_moe_gating_replay(const TensorView* x,
                                                       const TensorView* expert_idx,
                                                       const TensorView* bias,
                                                       const GatingReplayAttrs& attrs);

// ---- Finalize routing V2 forward (§4; D6, D7, D8; L4, L5) ----
struct FinalizeRoutingAttrs {
  int64_t drop_pad_mode = 0;  // 0/2 dropless, 1/3 drop-pad; 0/1 column layout, 2/3 row layout
  // D36, dropless modes: expanded_x is init routing's aligned layout (align_block > 1) and may
  // have more than R*K rows; index values then lie in [-1, rows).
  bool padded = false;
};
// expanded_x (R*K,H) or (E,C,H); expanded_row_idx (R*K) int32; x1, x2 (R,H); bias (E,H);
// scales (R,K); expert_idx (R,K) int32; out (R,H) expanded_x.dtype. Shape/value errors: 561103.
// Index tensors may also be int64 in the C++ API (values must fit in int32).
MOEGRAD_API ExecutorPtr plan_moe_finalize_routing(
    const TensorView* expanded_x, const TensorView* expanded_row_idx, const TensorView* x1,
    const TensorView* x2, const TensorView* bias, const TensorView* scales,
    const TensorView* expert_idx, const FinalizeRoutingAttrs& attrs, const TensorView* out);
// Output shape (R,H); R = rows of scales / expert_idx / x1 if given, else numel(idx) / k.
MOEGRAD_API std::vector<Shape> infer_moe_finalize_routing(
    const TensorView* expanded_x, const TensorView* expanded_row_idx, const TensorView* x1,
    const TensorView* x2, const TensorView* bias, const TensorView* scales,
    const TensorView* expert_idx, const FinalizeRoutingAttrs& attrs, int64_t k);

// ---- Finalize routing V2 grad (§3; D4, D5, D6, D7; L6) ----
struct FinalizeRoutingGradAttrs {
  int64_t drop_pad_mode = 0;  // 0 dropless, 1 drop-pad (row layout r*K + k)
  int64_t active_num = 0;     // mode 0: 0 < active_num < R*K truncates the expanded rows
  int64_t expert_num = 0;     // mode 1: E > 0
  int64_t expert_capacity = 0;  // mode 1: C > 0
  // D36, mode 0: > 0 when grad_expanded_x is init routing's aligned layout of this many rows
  // (active_num is then 0); index values lie in [-1, padded_rows). Unaddressed rows are zero.
  int64_t padded_rows = 0;
};
// grad_y (R,H); expanded_row_idx (R*K) int32; expanded_x (rows,H) or (E,C,H) (required with
// scales); scales (R,K); expert_idx (R,K) int32 (required with bias); bias (E,H);
// grad_expanded_x like expanded_x; grad_scales (R,K) scales.dtype or (R,1) grad_y.dtype.
MOEGRAD_API ExecutorPtr plan_moe_finalize_routing_grad(
    const TensorView* grad_y, const TensorView* expanded_row_idx, const TensorView* expanded_x,
    const TensorView* scales, const TensorView* expert_idx, const TensorView* bias,
    const FinalizeRoutingGradAttrs& attrs, const TensorView* grad_expanded_x,
    const TensorView* grad_scales);
MOEGRAD_API std::vector<Shape> infer_moe_finalize_routing_grad(
    const TensorView* grad_y, const TensorView* expanded_row_idx, const TensorView* expanded_x,
    const TensorView* scales, const TensorView* expert_idx, const TensorView* bias,
    const FinalizeRoutingGradAttrs& attrs);

// ---- Finalize routing bias gradient (moegrad extension, D23; L22) ----
// grad_bias[e, :] = sum over slots (r, k) with expert_idx[r, k] = e of scales[r, k] * grad_y[r, :]
// (scale 1 without scales), dropped slots included (they carry the bias term, D7). fp32 sums in
// slot order r*K + k, narrowed once; deterministic for any thread count (no atomics).
struct FinalizeRoutingBiasGradAttrs {
  int64_t expert_num = 0;  // E >= 1 (rows of bias)
};
// grad_y (R,H) fp32/fp16/bf16; expert_idx (R,K) int32 in [0,E) (required); scales (R,K)
// fp32/fp16/bf16 or null; grad_bias (E,H) grad_y.dtype. Shape/value errors: 561103.
MOEGRAD_API ExecutorPtr plan_moe_finalize_routing_bias_grad(
    const TensorView* grad_y, const TensorView* expert_idx, const TensorView* scales,
    const FinalizeRoutingBiasGradAttrs& attrs, const TensorView* grad_bias);
MOEGRAD_API std::vector<Shape> infer_moe_finalize_routing_bias_grad(
    const TensorView* grad_y, const TensorView* expert_idx, const TensorView* scales,
    const FinalizeRoutingBiasGradAttrs& attrs);

// ---- SwiGLU forward with weight / clamp / group_index (§5.5, §6.4; D9, D11; L8, L9) ----
struct SwigluAttrs {
  double clamp_limit = -1.0;  // -1 (off) or > 0
};
// x [...,2H] fp32/fp16/bf16; weight fp32 with numel T (product of leading dims) or null;
// group_index [G] int64 or null; y [...,H] x.dtype. Shape/attribute errors: 561002.
MOEGRAD_API ExecutorPtr plan_swiglu_group(const TensorView* x, const TensorView* weight,
                                          const TensorView* group_index,
                                          const SwigluAttrs& attrs, const TensorView* y);
MOEGRAD_API std::vector<Shape> infer_swiglu_group(const TensorView* x, const TensorView* weight,
                                                  const TensorView* group_index,
                                                  const SwigluAttrs& attrs);

// ---- SwiGLU backward = SwigluGroupQuantGrad (§5; D9, D10, D11; L7, L8) ----
// grad_y [...,H]; x [...,2H]; weight fp32 numel T (needs y_origin); y_origin like grad_y (the
// UNWEIGHTED activation, D10); group_index [G] int64; grad_x like x; grad_weight like weight
// (fp32) or null to skip it.
MOEGRAD_API ExecutorPtr plan_swiglu_group_quant_grad(const TensorView* grad_y, const TensorView* x,
                                                     const TensorView* weight,
                                                     const TensorView* y_origin,
                                                     const TensorView* group_index,
                                                     const SwigluAttrs& attrs,
                                                     const TensorView* grad_x,
                                                     const TensorView* grad_weight);
MOEGRAD_API std::vector<Shape> infer_swiglu_group_quant_grad(
    const TensorView* grad_y, const TensorView* x, const TensorView* weight,
    const TensorView* y_origin, const TensorView* group_index, const SwigluAttrs& attrs);

// ---- SwiGLU quantised forward = SwigluGroupQuant (§6; D10, D11, D24; L24-L28) ----
struct SwigluQuantAttrs {
  int64_t dst_type = 36;      // aclDataType of y: 36 FLOAT8_E4M3FN, 35 FLOAT8_E5M2
  int64_t quant_mode = 0;     // 0 FP8 blocks of 128 (fp32 scales), 1 MX blocks of 32 (e8m0)
  int64_t block_size = 0;     // 0, or the mode's block size (128 / 32)
  bool round_scale = false;   // mode 0: scales rounded up to powers of two; mode 1: must be true
  double clamp_limit = -1.0;  // -1 (off) or > 0, as for swiglu_group
  double dst_type_max = 15.0;  // HiFloat8 modes only: ignored by modes 0/1
  bool output_origin = false;  // also write y_origin (the WEIGHTED pre-quantisation output)
  // dst_type is in the Python front's codes (torch_npu 291/292/290/296/297, torch ScalarType
  // 23/24; other values read as aclDataType): translated by the validator, whose messages show
  // the code as given (L153).
  bool python_dst_codes = false;
};
// x [...,2H] fp32/fp16/bf16, rank 2..8; weight fp32 numel T or null; group_index [G] int64 or
// null; scale: must be null (HiFloat8 only). Outputs: y [...,H] in dst_type (or uint8 storage);
// y_scale [..., ceil(H/128)] fp32 (mode 0) or [..., ceil(ceil(H/32)/2), 2] e8m0 (or uint8)
// (mode 1); y_origin [...,H] x.dtype, required with output_origin, else ignored (may be null).
// Errors: 161001 null, 161002 dtypes and unsupported modes / dst types, 561002 shapes, clamp.
MOEGRAD_API ExecutorPtr plan_swiglu_group_quant(const TensorView* x, const TensorView* weight,
                                                const TensorView* group_index,
                                                const TensorView* scale,
                                                const SwigluQuantAttrs& attrs, const TensorView* y,
                                                const TensorView* y_scale,
                                                const TensorView* y_origin);
// Stage one without outputs (they are bound when the executor runs): y, y_scale, y_origin.
MOEGRAD_API ExecutorPtr prepare_swiglu_group_quant(const TensorView* x, const TensorView* weight,
                                                   const TensorView* group_index,
                                                   const TensorView* scale,
                                                   const SwigluQuantAttrs& attrs);
// Shapes of (y, y_scale, y_origin); y_origin is [0] without output_origin.
MOEGRAD_API std::vector<Shape> infer_swiglu_group_quant(const TensorView* x,
                                                        const TensorView* weight,
                                                        const TensorView* group_index,
                                                        const TensorView* scale,
                                                        const SwigluQuantAttrs& attrs);

// ---- ClippedSwiglu (V1/V2) and ClippedSwigluGrad: the GPT-OSS SwiGLU (docs/operators.md §9) ----
struct ClippedSwigluAttrs {
  int64_t dim = -1;          // the split axis, in [-rank, rank - 1]; x.shape[dim] even
  double alpha = 1.702;      // sigmoid slope (clamp_mode 0), finite
  double limit = 7.0;        // clamp limit, > 0 and finite
  double bias = 1.0;         // offset added to the linear half (clamp_mode 0), finite
  bool interleaved = true;   // gate = even elements, linear = odd; else two contiguous halves
  int64_t clamp_mode = 0;    // 0: clamp the inputs; 1: clamp silu(gate) (alpha, bias default)
};
// x fp32/fp16/bf16, rank 1..8; group_index [G] int64 or null (rows of the folded [pre, 2h]
// view past sum(group_index) are +0); y = x's shape with shape[dim] halved, x.dtype.
// Errors: 161001 null; 161002 dtypes, layout, rank, dim, clamp_mode, mode-1 alpha/bias;
// 561002 shapes, limit/alpha/bias out of range.
MOEGRAD_API ExecutorPtr plan_clipped_swiglu(const TensorView* x, const TensorView* group_index,
                                            const ClippedSwigluAttrs& attrs, const TensorView* y);
MOEGRAD_API ExecutorPtr prepare_clipped_swiglu(const TensorView* x,
                                               const TensorView* group_index,
                                               const ClippedSwigluAttrs& attrs);
MOEGRAD_API std::vector<Shape> infer_clipped_swiglu(const TensorView* x,
                                                    const TensorView* group_index,
                                                    const ClippedSwigluAttrs& attrs);
// grad_y y's shape, x.dtype; grad_x x's shape, x.dtype. Both clamp modes (inclusive masks).
MOEGRAD_API ExecutorPtr plan_clipped_swiglu_grad(const TensorView* grad_y, const TensorView* x,
                                                 const TensorView* group_index,
                                                 const ClippedSwigluAttrs& attrs,
                                                 const TensorView* grad_x);
MOEGRAD_API ExecutorPtr prepare_clipped_swiglu_grad(const TensorView* grad_y,
                                                    const TensorView* x,
                                                    const TensorView* group_index,
                                                    const ClippedSwigluAttrs& attrs);
MOEGRAD_API std::vector<Shape> infer_clipped_swiglu_grad(const TensorView* grad_y,
                                                         const TensorView* x,
                                                         const TensorView* group_index,
                                                         const ClippedSwigluAttrs& attrs);

// ---- Init routing V2/V3 = token permutation (spec §8; D25-D31; docs/decisions.md L30-L39) ----
struct InitRoutingAttrs {
  int64_t active_num = 0;       // mode 0: 0 (or -1) dropless; A > 0 keeps the first min(A, R*K)
  int64_t expert_capacity = 0;  // mode 1: C >= 1 (no C <= R rule, D30)
  int64_t expert_num = 0;       // E >= 0; 0 = unknown (dropless, no counts, no window)
  int64_t drop_pad_mode = 0;    // 0 dropless/active, 1 drop-pad [E, C, H]
  int64_t expert_tokens_num_type = 1;  // 0 cumsum, 1 count, 2 key-value ([E, 2])
  bool expert_tokens_num_flag = false;  // write expert_tokens
  bool has_range = false;       // active expert window [expert_start, expert_end)
  int64_t expert_start = 0;
  int64_t expert_end = 0;
  int64_t row_idx_type = 0;     // 0 src->dst (slot -> expanded row, -1 = none), 1 dst->src
  // D36: m > 1 starts each expert's block of expanded_x at a multiple of m (mode 0, A = 0,
  // row_idx_type 0, expert_num > 0): expanded_x has R*K + bins*(m-1) rows, padding rows are
  // zero, the index points into that layout, the counts stay the real ones, and the fourth
  // output padded_offsets [bins + 1] int64 holds each block's first row (the last: the end).
  // 0 or 1: off (padded_offsets is [0] and may be null). bins = end - start of the window.
  int64_t align_block = 0;
};
// x [R,H] fp32/fp16/bf16; expert_idx [R,K] int32 or int64; expanded_x [rows,H] (mode 0: rows = R*K, or
// min(A, R*K) when A > 0) or [E,C,H] (mode 1), x.dtype; expanded_row_idx [R*K] int32;
// expert_tokens int32 or int64, [end-start] (types 0/1, end-start = E without a window) or [E,2]
// (type 2), required iff expert_tokens_num_flag. Shape/attribute/value errors: 561103.
MOEGRAD_API ExecutorPtr plan_moe_init_routing(const TensorView* x, const TensorView* expert_idx,
                                              const InitRoutingAttrs& attrs,
                                              const TensorView* expanded_x,
                                              const TensorView* expanded_row_idx,
                                              const TensorView* expert_tokens,
                                              const TensorView* padded_offsets = nullptr);
// Stage one without outputs: Executor::outputs() lists (expanded_x, expanded_row_idx,
// expert_tokens [0] and optional without the flag, int64; padded_offsets [bins + 1] int64, or
// [0] and optional without align_block); bind them in Executor::run.
MOEGRAD_API ExecutorPtr prepare_moe_init_routing(const TensorView* x,
                                                 const TensorView* expert_idx,
                                                 const InitRoutingAttrs& attrs);
// Shapes of (expanded_x, expanded_row_idx, expert_tokens, padded_offsets); expert_tokens is [0]
// without the flag, padded_offsets [0] without align_block.
MOEGRAD_API std::vector<Shape> infer_moe_init_routing(const TensorView* x,
                                                      const TensorView* expert_idx,
                                                      const InitRoutingAttrs& attrs);

// ---- Init routing V2 grad (spec §8.9; D29) ----
struct InitRoutingGradAttrs {
  int64_t top_k = 1;          // K >= 1, divides numel(expanded_row_idx)
  int64_t drop_pad_mode = 0;  // 0: grad_expanded_x [rows,H]; 1: [E,C,H]
  int64_t active_num = 0;     // mode 0: A > 0 => grad_expanded_x has min(A, R*K) rows
  int64_t padded_rows = 0;    // mode 0, D36: > 0 => the aligned layout of this many rows
};
// grad_expanded_x fp32/fp16/bf16; expanded_row_idx [R*K] int32/int64 (src->dst, -1 = none);
// grad_x [R,H] grad_expanded_x.dtype: per token the fp32 sum, in k order, of its valid rows.
MOEGRAD_API ExecutorPtr plan_moe_init_routing_grad(const TensorView* grad_expanded_x,
                                                   const TensorView* expanded_row_idx,
                                                   const InitRoutingGradAttrs& attrs,
                                                   const TensorView* grad_x);
MOEGRAD_API ExecutorPtr prepare_moe_init_routing_grad(const TensorView* grad_expanded_x,
                                                      const TensorView* expanded_row_idx,
                                                      const InitRoutingGradAttrs& attrs);
MOEGRAD_API std::vector<Shape> infer_moe_init_routing_grad(const TensorView* grad_expanded_x,
                                                           const TensorView* expanded_row_idx,
                                                           const InitRoutingGradAttrs& attrs);

// ---- Threads (CPU) ----
// n <= 0 restores the default (OpenMP's). Results never depend on the thread count (D16).
MOEGRAD_API void set_num_threads(int n);
MOEGRAD_API int get_num_threads();

// Runs a planned executor with a workspace it allocates itself (CPU convenience).
MOEGRAD_API void run_now(Executor& executor);

// ---- Plans without outputs (stage one for callers that allocate outputs afterwards) ----
// Same validation as plan_<op> minus the outputs; the executor's outputs() lists what to
// allocate, and run(outputs, n, workspace, bytes, stream) binds them. Index tensors may be
// int32 or int64 here and in plan_<op> (int64 values must fit in int32; errors name the
// position and value). The C API takes int32 only.
MOEGRAD_API ExecutorPtr prepare_moe_gating_top_k(const TensorView* x, const TensorView* bias,
                                                 const GatingTopKAttrs& attrs);
MOEGRAD_API ExecutorPtr prepare_moe_gating_top_k_backward(const TensorView* x_norm,
                                                          const TensorView* grad_y,
                                                          const TensorView* expert_idx,
                                                          const GatingTopKBackwardAttrs& attrs);
MOEGRAD_API ExecutorPtr prepare_moe_gating_replay(const TensorView* x,
                                                  const TensorView* expert_idx,
                                                  const TensorView* bias,
                                                  const GatingReplayAttrs& attrs);
// k: the top-k hint used when R cannot be read from another tensor (L4).
MOEGRAD_API ExecutorPtr prepare_moe_finalize_routing(
    const TensorView* expanded_x, const TensorView* expanded_row_idx, const TensorView* x1,
    const TensorView* x2, const TensorView* bias, const TensorView* scales,
    const TensorView* expert_idx, const FinalizeRoutingAttrs& attrs, int64_t k);
MOEGRAD_API ExecutorPtr prepare_moe_finalize_routing_grad(
    const TensorView* grad_y, const TensorView* expanded_row_idx, const TensorView* expanded_x,
    const TensorView* scales, const TensorView* expert_idx, const TensorView* bias,
    const FinalizeRoutingGradAttrs& attrs);
MOEGRAD_API ExecutorPtr prepare_swiglu_group(const TensorView* x, const TensorView* weight,
                                             const TensorView* group_index,
                                             const SwigluAttrs& attrs);
MOEGRAD_API ExecutorPtr prepare_moe_finalize_routing_bias_grad(
    const TensorView* grad_y, const TensorView* expert_idx, const TensorView* scales,
    const FinalizeRoutingBiasGradAttrs& attrs);
// grad_weight (output 1) is optional: bound to nullptr it is not computed.
MOEGRAD_API ExecutorPtr prepare_swiglu_group_quant_grad(const TensorView* grad_y,
                                                        const TensorView* x,
                                                        const TensorView* weight,
                                                        const TensorView* y_origin,
                                                        const TensorView* group_index,
                                                        const SwigluAttrs& attrs);

// Number of argument validations run so far in this process (all threads). For tests that
// check each call validates once.
MOEGRAD_API uint64_t validation_count();

}  // namespace moegrad

#endif  // MOEGRAD_MOEGRAD_H_
