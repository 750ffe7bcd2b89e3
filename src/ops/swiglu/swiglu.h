// SwiGLU with per-token weight, clamp and MoE group_index: forward and backward
// (SwigluGroupQuantGrad). Parameters, validation and shape inference (no kernels).
// Spec: operators.md §5 (backward), §6.4 (forward without quantisation); decisions.md D9-D11,
// D17; docs/decisions.md L7-L9.
#ifndef MOEGRAD_OPS_SWIGLU_H_
#define MOEGRAD_OPS_SWIGLU_H_

#include <array>

#include "core/executor.h"
#include "moegrad/moegrad.h"

namespace moegrad {

struct SwigluPlan : PlanBase {
  TensorView x, weight, group_index, y;
  bool has_weight = false, has_group_index = false;
  float clamp = -1.0f;
  int64_t T = 0, H = 0;
  Shape y_shape;
  Slot ws_active;  // CUDA: the group_index row count, computed on the device (L45)
  std::array<TensorView*, 1> output_views() { return {&y}; }
};

struct SwigluGradPlan : PlanBase {
  TensorView grad_y, x, weight, y_origin, group_index, grad_x, grad_weight;
  bool has_weight = false, has_group_index = false;
  float clamp = -1.0f;
  int64_t T = 0, H = 0;
  Shape grad_x_shape, grad_weight_shape;
  Slot ws_active;  // CUDA: the group_index row count, computed on the device (L45)
  std::array<TensorView*, 2> output_views() { return {&grad_x, &grad_weight}; }
  // grad_weight is computed when a weight is given and the output is bound (L7).
  bool wants_grad_weight() const { return has_weight && grad_weight.ndim > 0; }
};

struct SwigluQuantPlan : PlanBase {
  TensorView x, weight, group_index, y, y_scale, y_origin;
  bool has_weight = false, has_group_index = false, write_origin = false;
  bool e5m2 = false;         // y format: e5m2, else e4m3fn
  int64_t quant_mode = 0;    // 0 FP8 block, 1 MX
  int64_t block = 128;       // elements per scale along H
  bool round_scale = false;
  float clamp = -1.0f;
  int64_t T = 0, H = 0;
  int64_t blocks = 0;        // scales per row: ceil(H / block)
  int64_t scale_stride = 0;  // scale elements per row: blocks (mode 0), 2*ceil(blocks/2) (mode 1)
  Shape y_shape, y_scale_shape, y_origin_shape;
  Slot ws_active;  // CUDA: the group_index row count, computed on the device
  std::array<TensorView*, 3> output_views() { return {&y, &y_scale, &y_origin}; }
};

SwigluQuantPlan validate_swiglu_quant(const TensorView* x, const TensorView* weight,
                                      const TensorView* group_index, const TensorView* scale,
                                      const SwigluQuantAttrs& attrs, const TensorView* y,
                                      const TensorView* y_scale, const TensorView* y_origin,
                                      bool with_outputs);

SwigluPlan validate_swiglu(const TensorView* x, const TensorView* weight,
                           const TensorView* group_index, const SwigluAttrs& attrs,
                           const TensorView* y, bool with_outputs);
SwigluGradPlan validate_swiglu_grad(const TensorView* grad_y, const TensorView* x,
                                    const TensorView* weight, const TensorView* y_origin,
                                    const TensorView* group_index, const SwigluAttrs& attrs,
                                    const TensorView* grad_x, const TensorView* grad_weight,
                                    bool with_outputs);


// Rows that are processed: min(max(sum(group_index), 0), T) (L8), or T without group_index.
int64_t swiglu_active_rows(const TensorView* group_index, bool has_group_index, int64_t T);

// CPU kernels (swiglu_cpu.cc): workspace sizing (stage one) and run (stage two).
void swiglu_cpu_size(SwigluPlan& plan, WorkspaceLayout& layout);
void swiglu_cpu(const SwigluPlan& plan, const Workspace& ws, void* stream);
void swiglu_grad_cpu_size(SwigluGradPlan& plan, WorkspaceLayout& layout);
void swiglu_grad_cpu(const SwigluGradPlan& plan, const Workspace& ws, void* stream);
// The quantised forward (swiglu_quant_cpu.cc).
void swiglu_quant_cpu_size(SwigluQuantPlan& plan, WorkspaceLayout& layout);
void swiglu_quant_cpu(const SwigluQuantPlan& plan, const Workspace& ws, void* stream);

#if defined(MOEGRAD_WITH_CUDA)
// CUDA kernels (swiglu_cuda.cu); `stream` is a cudaStream_t.
void swiglu_cuda_size(SwigluPlan& plan, WorkspaceLayout& layout);
void swiglu_cuda(const SwigluPlan& plan, const Workspace& ws, void* stream);
void swiglu_grad_cuda_size(SwigluGradPlan& plan, WorkspaceLayout& layout);
void swiglu_grad_cuda(const SwigluGradPlan& plan, const Workspace& ws, void* stream);
void swiglu_quant_cuda_size(SwigluQuantPlan& plan, WorkspaceLayout& layout);
void swiglu_quant_cuda(const SwigluQuantPlan& plan, const Workspace& ws, void* stream);
#endif

}  // namespace moegrad

#endif  // MOEGRAD_OPS_SWIGLU_H_
