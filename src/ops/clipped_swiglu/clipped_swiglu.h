// ClippedSwiglu (V1/V2) and ClippedSwigluGrad, the GPT-OSS SwiGLU: parameters, validation and
// shape inference (no kernels). docs/operators.md §9; docs/decisions.md D32, L160-L167.
//
// Every dim reduces to one 2-D problem: x viewed as [pre, cut, after] around dim is folded to
// rows [pre, 2h] (2h = cut * after), y to [pre, h]; the gate A and linear half B are taken along
// the folded row (interleaved: even / odd elements; else the first / second h elements).
#ifndef MOEGRAD_OPS_CLIPPED_SWIGLU_H_
#define MOEGRAD_OPS_CLIPPED_SWIGLU_H_

#include <array>

#include "core/executor.h"
#include "moegrad/moegrad.h"

namespace moegrad {

// What the forward and the backward share: the folded sizes and the attributes in fp32.
struct ClippedSwigluShape {
  int64_t pre = 0;   // rows of the folded view
  int64_t h = 0;     // output elements per row (half of the folded row)
  float alpha = 1.702f, limit = 7.0f, bias = 1.0f;
  bool interleaved = true;
  int64_t clamp_mode = 0;
  bool has_group_index = false;
  TensorView group_index;
  Slot ws_active;  // CUDA: the group_index row count, computed on the device
};

struct ClippedSwigluPlan : PlanBase {
  TensorView x, y;
  ClippedSwigluShape s;
  Shape y_shape;
  std::array<TensorView*, 1> output_views() { return {&y}; }
};

struct ClippedSwigluGradPlan : PlanBase {
  TensorView grad_y, x, grad_x;
  ClippedSwigluShape s;
  Shape grad_x_shape;
  std::array<TensorView*, 1> output_views() { return {&grad_x}; }
};

ClippedSwigluPlan validate_clipped_swiglu(const TensorView* x, const TensorView* group_index,
                                          const ClippedSwigluAttrs& attrs, const TensorView* y,
                                          bool with_outputs);
ClippedSwigluGradPlan validate_clipped_swiglu_grad(const TensorView* grad_y, const TensorView* x,
                                                   const TensorView* group_index,
                                                   const ClippedSwigluAttrs& attrs,
                                                   const TensorView* grad_x, bool with_outputs);

// CPU kernels (clipped_swiglu_cpu.cc).
void clipped_swiglu_cpu_size(ClippedSwigluPlan& plan, WorkspaceLayout& layout);
void clipped_swiglu_cpu(const ClippedSwigluPlan& plan, const Workspace& ws, void* stream);
void clipped_swiglu_grad_cpu_size(ClippedSwigluGradPlan& plan, WorkspaceLayout& layout);
void clipped_swiglu_grad_cpu(const ClippedSwigluGradPlan& plan, const Workspace& ws,
                             void* stream);

#if defined(MOEGRAD_WITH_CUDA)
// CUDA kernels (clipped_swiglu_cuda.cu); `stream` is a cudaStream_t.
void clipped_swiglu_cuda_size(ClippedSwigluPlan& plan, WorkspaceLayout& layout);
void clipped_swiglu_cuda(const ClippedSwigluPlan& plan, const Workspace& ws, void* stream);
void clipped_swiglu_grad_cuda_size(ClippedSwigluGradPlan& plan, WorkspaceLayout& layout);
void clipped_swiglu_grad_cuda(const ClippedSwigluGradPlan& plan, const Workspace& ws,
                              void* stream);
#endif

}  // namespace moegrad

#endif  // MOEGRAD_OPS_CLIPPED_SWIGLU_H_
