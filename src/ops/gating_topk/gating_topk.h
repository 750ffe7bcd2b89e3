// Gating top-k forward, replay and backward: parameters, validation and shape inference (no
// kernels). Spec: operators.md §1 (backward), §2 (forward), §2.8 (replay); decisions.md D1-D3,
// D6, D12-D15, D22, D33, D34.
#ifndef MOEGRAD_OPS_GATING_TOPK_H_
#define MOEGRAD_OPS_GATING_TOPK_H_

#include <array>

#include "core/executor.h"
#include "moegrad/moegrad.h"

namespace moegrad {

// Whether the k selected scores are renormalised (§2.4 step 6): sigmoid and sqrt-softplus always,
// softmax with renorm = 1, and never with no_renorm (D33).
inline bool renormalises(int64_t norm_type, int64_t renorm, bool no_renorm) {
  return !no_renorm && (norm_type != 0 || renorm == 1);
}

struct GatingTopKPlan : PlanBase {
  TensorView x, bias, y, expert_idx, norm_out;
  bool has_bias = false;
  GatingTopKAttrs attrs;
  int64_t M = 0, N = 0;
  bool grouped = false;  // group-limited selection is in effect
  // CPU scratch, one copy per thread.
  Slot ws_rows, ws_keys, ws_gkeys, ws_order, ws_kept, ws_bias;
  std::array<TensorView*, 3> output_views() { return {&y, &expert_idx, &norm_out}; }
};

struct GatingTopKBackwardPlan : PlanBase {
  TensorView x_norm, grad_y, expert_idx, grad_x;
  GatingTopKBackwardAttrs attrs;
  int64_t M = 0, N = 0, K = 0;
  Slot ws_idx;  // int64 expert_idx narrowed to int32
  Slot ws_strict;               // CUDA strict index check (L46)
  bool strict_indices = false;  // MOEGRAD_STRICT_INDICES=1 when planned (CUDA)
  std::array<TensorView*, 1> output_views() { return {&grad_x}; }
};

struct GatingReplayPlan : PlanBase {
  TensorView x, expert_idx, y, norm_out;
  GatingReplayAttrs attrs;
  int64_t M = 0, N = 0, K = 0;
  Slot ws_rows;                 // CPU: two padded fp32 rows per thread
  Slot ws_idx;                  // int64 expert_idx narrowed to int32
  Slot ws_strict;               // CUDA strict index check (L46)
  bool strict_indices = false;  // MOEGRAD_STRICT_INDICES=1 when planned (CUDA)
  std::array<TensorView*, 2> output_views() { return {&y, &norm_out}; }
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
GatingReplayPlan validate_gating_replay(const TensorView* x, const TensorView* expert_idx,
                                        const TensorView* bias, const GatingReplayAttrs& attrs,
                                        const TensorView* y, const TensorView* norm_out,
                                        bool with_outputs);

// CPU kernels (gating_topk_cpu.cc): workspace sizing (stage one) and run (stage two).
void gating_top_k_cpu_size(GatingTopKPlan& plan, WorkspaceLayout& layout);
void gating_top_k_cpu(const GatingTopKPlan& plan, const Workspace& ws, void* stream);
void gating_top_k_backward_cpu_size(GatingTopKBackwardPlan& plan, WorkspaceLayout& layout);
void gating_top_k_backward_cpu(const GatingTopKBackwardPlan& plan, const Workspace& ws,
                               void* stream);
void gating_replay_cpu_size(GatingReplayPlan& plan, WorkspaceLayout& layout);
void gating_replay_cpu(const GatingReplayPlan& plan, const Workspace& ws, void* stream);

#if defined(MOEGRAD_WITH_CUDA)
// CUDA kernels (gating_topk_cuda.cu); `stream` is a cudaStream_t.
void gating_top_k_cuda_size(GatingTopKPlan& plan, WorkspaceLayout& layout);
void gating_top_k_cuda(const GatingTopKPlan& plan, const Workspace& ws, void* stream);
void gating_top_k_backward_cuda_size(GatingTopKBackwardPlan& plan, WorkspaceLayout& layout);
void gating_top_k_backward_cuda(const GatingTopKBackwardPlan& plan, const Workspace& ws,
                                void* stream);
void gating_replay_cuda_size(GatingReplayPlan& plan, WorkspaceLayout& layout);
void gating_replay_cuda(const GatingReplayPlan& plan, const Workspace& ws, void* stream);
#endif

}  // namespace moegrad

#endif  // MOEGRAD_OPS_GATING_TOPK_H_
