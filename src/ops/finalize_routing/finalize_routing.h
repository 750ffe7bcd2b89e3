// Finalize routing (unpermute + weighted combine) forward and grad: parameters, validation and
// shape inference (no kernels). Spec: operators.md §3 (V2Grad), §4 (V2), §7.3; decisions.md
// D4-D8; docs/decisions.md L4-L6.
#ifndef MOEGRAD_OPS_FINALIZE_ROUTING_H_
#define MOEGRAD_OPS_FINALIZE_ROUTING_H_

#include <array>

#include "core/executor.h"
#include "core/slot_sort.h"
#include "moegrad/moegrad.h"

namespace moegrad {

struct FinalizeRoutingPlan : PlanBase {
  TensorView expanded_x, expanded_row_idx, x1, x2, bias, scales, expert_idx, out;
  bool has_x1 = false, has_x2 = false, has_bias = false, has_scales = false;
  int64_t drop_pad_mode = 0;
  int64_t R = 0, K = 0, H = 0;
  int64_t rows = 0;       // addressable expanded rows: dim0 (dropless) or E*C (drop-pad)
  int64_t num_bias = 0;   // E of bias
  bool row_layout = false;  // modes 2/3: flat = r*K + k; modes 0/1: flat = k*R + r
  Slot ws_idx, ws_eidx;     // int64 indices narrowed to int32
  Slot ws_slots;            // CPU scratch, one copy per thread: slot tables
  Slot ws_strict;               // CUDA strict index check (L46)
  bool strict_indices = false;  // MOEGRAD_STRICT_INDICES=1 when planned (CUDA)
  std::array<TensorView*, 1> output_views() { return {&out}; }
};

struct FinalizeRoutingGradPlan : PlanBase {
  TensorView grad_y, expanded_row_idx, expanded_x, scales, expert_idx, bias;
  TensorView grad_expanded_x, grad_scales;
  bool has_scales = false, has_bias = false;
  int64_t drop_pad_mode = 0;
  int64_t R = 0, K = 0, H = 0;
  int64_t rows = 0;  // rows of grad_expanded_x viewed as (rows, H)
  int64_t num_bias = 0;
  Shape grad_expanded_x_shape, grad_scales_shape;
  DType grad_scales_dtype = DType::kFloat32;
  Slot ws_idx, ws_eidx;                // int64 indices narrowed to int32
  Slot ws_covered;                     // rows of grad_expanded_x some index addresses
  Slot ws_g;                           // CPU scratch, one copy per thread: grad_y row in fp32
  int zero_threads = 1;                // threads of the zero-fill loop
  Slot ws_owner, ws_strict;            // CUDA: row owner map (L44), strict index check (L46)
  bool strict_indices = false;         // MOEGRAD_STRICT_INDICES=1 when planned (CUDA)
  std::array<TensorView*, 2> output_views() { return {&grad_expanded_x, &grad_scales}; }
};

struct FinalizeRoutingBiasGradPlan : PlanBase {
  TensorView grad_y, expert_idx, scales, grad_bias;
  bool has_scales = false;
  int64_t R = 0, K = 0, H = 0, E = 0;
  Slot ws_eidx;                    // int64 expert_idx narrowed to int32
  Slot ws_offsets, ws_fill;        // per-expert slot lists: E + 1 offsets, E fill cursors
  Slot ws_slots;                   // R*K slot numbers sorted by expert
  Slot ws_acc;                     // CPU scratch, one tile row per thread
  cuda::SlotSort cuda_sort;        // CUDA: the stable slot sort by expert
  std::array<TensorView*, 1> output_views() { return {&grad_bias}; }
};

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

// CPU kernels (finalize_routing_cpu.cc): workspace sizing (stage one) and run (stage two).
void finalize_routing_cpu_size(FinalizeRoutingPlan& plan, WorkspaceLayout& layout);
void finalize_routing_cpu(const FinalizeRoutingPlan& plan, const Workspace& ws, void* stream);
void finalize_routing_grad_cpu_size(FinalizeRoutingGradPlan& plan, WorkspaceLayout& layout);
void finalize_routing_grad_cpu(const FinalizeRoutingGradPlan& plan, const Workspace& ws,
                               void* stream);
void finalize_routing_bias_grad_cpu_size(FinalizeRoutingBiasGradPlan& plan,
                                         WorkspaceLayout& layout);
void finalize_routing_bias_grad_cpu(const FinalizeRoutingBiasGradPlan& plan, const Workspace& ws,
                                    void* stream);

#if defined(MOEGRAD_WITH_CUDA)
// CUDA kernels (finalize_routing_cuda.cu); `stream` is a cudaStream_t.
void finalize_routing_cuda_size(FinalizeRoutingPlan& plan, WorkspaceLayout& layout);
void finalize_routing_cuda(const FinalizeRoutingPlan& plan, const Workspace& ws, void* stream);
void finalize_routing_grad_cuda_size(FinalizeRoutingGradPlan& plan, WorkspaceLayout& layout);
void finalize_routing_grad_cuda(const FinalizeRoutingGradPlan& plan, const Workspace& ws,
                                void* stream);
void finalize_routing_bias_grad_cuda_size(FinalizeRoutingBiasGradPlan& plan,
                                          WorkspaceLayout& layout);
void finalize_routing_bias_grad_cuda(const FinalizeRoutingBiasGradPlan& plan,
                                     const Workspace& ws, void* stream);
#endif

}  // namespace moegrad

#endif  // MOEGRAD_OPS_FINALIZE_ROUTING_H_
