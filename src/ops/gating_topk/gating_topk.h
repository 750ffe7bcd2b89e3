// Gating top-k forward and backward: parameters, validation and shape inference (no kernels).
// Spec: operators.md §1 (backward), §2 (forward); decisions.md D1-D3, D6, D12-D15.
#ifndef MOEGRAD_OPS_GATING_TOPK_H_
#define MOEGRAD_OPS_GATING_TOPK_H_

#include "moegrad/moegrad.h"

namespace moegrad {

struct GatingTopKPlan {
  const char* op = "moe_gating_top_k";
  uint64_t workspace_bytes = 0;
  TensorView x, bias, y, expert_idx, norm_out;
  bool has_bias = false;
  GatingTopKAttrs attrs;
  int64_t M = 0, N = 0;
  bool grouped = false;  // group-limited selection is in effect
};

struct GatingTopKBackwardPlan {
  const char* op = "moe_gating_top_k_backward";
  uint64_t workspace_bytes = 0;
  TensorView x_norm, grad_y, expert_idx, grad_x;
  GatingTopKBackwardAttrs attrs;
  int64_t M = 0, N = 0, K = 0;
  bool strict_indices = false;  // MOEGRAD_STRICT_INDICES=1 at planning time (CUDA, L46)
};

// With with_outputs = false only inputs and attributes are checked (shape inference).
GatingTopKPlan validate_gating_top_k(const TensorView* x, const TensorView* bias,
                                     const GatingTopKAttrs& attrs, const TensorView* y,
                                     const TensorView* expert_idx, const TensorView* norm_out,
                                     bool with_outputs);
GatingTopKBackwardPlan validate_gating_top_k_backward(const TensorView* x_norm,
                                                      const TensorView* grad_y,
                                                      const TensorView* expert_idx,
                                                      const GatingTopKBackwardAttrs& attrs,
                                                      const TensorView* grad_x, bool with_outputs);

void run_plan(const GatingTopKPlan& plan, void* workspace, void* stream);
void run_plan(const GatingTopKBackwardPlan& plan, void* workspace, void* stream);

// CPU kernels (gating_topk_cpu.cc).
void gating_top_k_cpu(const GatingTopKPlan& plan);
void gating_top_k_backward_cpu(const GatingTopKBackwardPlan& plan);

#ifdef MOEGRAD_WITH_CUDA
// CUDA launchers (gating_topk_cuda.cu): stage two on `stream` (a cudaStream_t) with the
// workspace sized by the *_workspace function; no host synchronisation, no allocation.
uint64_t gating_top_k_cuda_workspace(const GatingTopKPlan& plan);
void gating_top_k_cuda(const GatingTopKPlan& plan, void* workspace, void* stream);
uint64_t gating_top_k_backward_cuda_workspace(const GatingTopKBackwardPlan& plan);
void gating_top_k_backward_cuda(const GatingTopKBackwardPlan& plan, void* workspace,
                                void* stream);
#endif

}  // namespace moegrad

#endif  // MOEGRAD_OPS_GATING_TOPK_H_
