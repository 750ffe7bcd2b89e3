// Finalize routing (unpermute + weighted combine) forward and grad: parameters, validation and
// shape inference (no kernels). Spec: operators.md §3 (V2Grad), §4 (V2), §7.3; decisions.md
// D4-D8; docs/decisions.md L4-L6.
#ifndef MOEGRAD_OPS_FINALIZE_ROUTING_H_
#define MOEGRAD_OPS_FINALIZE_ROUTING_H_

#include "moegrad/moegrad.h"

namespace moegrad {

struct FinalizeRoutingPlan {
  const char* op = "moe_finalize_routing";
  uint64_t workspace_bytes = 0;
  TensorView expanded_x, expanded_row_idx, x1, x2, bias, scales, expert_idx, out;
  bool has_x1 = false, has_x2 = false, has_bias = false, has_scales = false;
  int64_t drop_pad_mode = 0;
  int64_t R = 0, K = 0, H = 0;
  int64_t rows = 0;       // addressable expanded rows: dim0 (dropless) or E*C (drop-pad)
  int64_t num_bias = 0;   // E of bias
  bool row_layout = false;  // modes 2/3: flat = r*K + k; modes 0/1: flat = k*R + r
  bool strict_indices = false;  // MOEGRAD_STRICT_INDICES=1 at planning time (CUDA, L46)
};

struct FinalizeRoutingGradPlan {
  const char* op = "moe_finalize_routing_grad";
  uint64_t workspace_bytes = 0;
  TensorView grad_y, expanded_row_idx, expanded_x, scales, expert_idx, bias;
  TensorView grad_expanded_x, grad_scales;
  bool has_scales = false, has_bias = false;
  int64_t drop_pad_mode = 0;
  int64_t R = 0, K = 0, H = 0;
  int64_t rows = 0;  // rows of grad_expanded_x viewed as (rows, H)
  int64_t num_bias = 0;
  Shape grad_expanded_x_shape, grad_scales_shape;
  DType grad_scales_dtype = DType::kFloat32;
  bool strict_indices = false;
};

struct FinalizeRoutingBiasGradPlan {
  const char* op = "moe_finalize_routing_bias_grad";
  uint64_t workspace_bytes = 0;  // per-expert slot lists (see bias_grad_workspace)
  TensorView grad_y, expert_idx, scales, grad_bias;
  bool has_scales = false;
  int64_t R = 0, K = 0, H = 0, E = 0;
};

// Workspace of the bias gradient: E + 1 int64 offsets, then R*K int32 slot numbers.
uint64_t bias_grad_workspace(int64_t E, int64_t slots);

// k is the Python front's top-k hint, used only without outputs and only when R cannot be read
// from another tensor (L4).
FinalizeRoutingPlan validate_finalize_routing(const TensorView* expanded_x,
                                              const TensorView* expanded_row_idx,
                                              const TensorView* x1, const TensorView* x2,
                                              const TensorView* bias, const TensorView* scales,
                                              const TensorView* expert_idx,
                                              const FinalizeRoutingAttrs& attrs,
                                              const TensorView* out, bool with_outputs,
                                              int64_t k);
FinalizeRoutingBiasGradPlan validate_finalize_routing_bias_grad(
    const TensorView* grad_y, const TensorView* expert_idx, const TensorView* scales,
    const FinalizeRoutingBiasGradAttrs& attrs, const TensorView* grad_bias, bool with_outputs);
FinalizeRoutingGradPlan validate_finalize_routing_grad(
    const TensorView* grad_y, const TensorView* expanded_row_idx, const TensorView* expanded_x,
    const TensorView* scales, const TensorView* expert_idx, const TensorView* bias,
    const FinalizeRoutingGradAttrs& attrs, const TensorView* grad_expanded_x,
    const TensorView* grad_scales, bool with_outputs);

void run_plan(const FinalizeRoutingPlan& plan, void* workspace, void* stream);
void run_plan(const FinalizeRoutingGradPlan& plan, void* workspace, void* stream);
void run_plan(const FinalizeRoutingBiasGradPlan& plan, void* workspace, void* stream);

void finalize_routing_cpu(const FinalizeRoutingPlan& plan);
void finalize_routing_grad_cpu(const FinalizeRoutingGradPlan& plan);
void finalize_routing_bias_grad_cpu(const FinalizeRoutingBiasGradPlan& plan, void* workspace);

#ifdef MOEGRAD_WITH_CUDA
// CUDA launchers (finalize_routing_cuda.cu): stage two on `stream` (a cudaStream_t) with the
// workspace sized by the *_workspace function; no host synchronisation, no allocation.
uint64_t finalize_routing_cuda_workspace(const FinalizeRoutingPlan& plan);
void finalize_routing_cuda(const FinalizeRoutingPlan& plan, void* workspace, void* stream);
uint64_t finalize_routing_grad_cuda_workspace(const FinalizeRoutingGradPlan& plan);
void finalize_routing_grad_cuda(const FinalizeRoutingGradPlan& plan, void* workspace,
                                void* stream);
#endif

}  // namespace moegrad

#endif  // MOEGRAD_OPS_FINALIZE_ROUTING_H_
