// Init routing (token permutation) forward and grad: parameters, validation, shape inference and
// workspace plan (no kernels). docs/operators.md §8; docs/decisions.md D25-D31, L30-L39.
#ifndef MOEGRAD_OPS_INIT_ROUTING_H_
#define MOEGRAD_OPS_INIT_ROUTING_H_

#include <array>

#include "core/executor.h"
#include "core/slot_sort.h"
#include "moegrad/moegrad.h"

namespace moegrad {

struct InitRoutingPlan : PlanBase {
  TensorView x, expert_idx, expanded_x, expanded_row_idx, expert_tokens;
  bool has_tokens = false;
  int64_t R = 0, K = 0, H = 0;
  int64_t mode = 0;          // 0 dropless/active, 1 drop-pad
  int64_t rows = 0;          // rows of expanded_x viewed as (rows, H)
  int64_t capacity = 0;      // C (mode 1)
  int64_t expert_num = 0;    // E (0 = unknown)
  int64_t lo = 0, hi = 0;    // window of expert ids that are materialised (bins = hi - lo)
  bool window_all = false;   // no window and E unknown: every id >= 0 is in (hi from the data)
  int64_t token_type = 1;    // 0 cumsum, 1 count, 2 key-value
  int64_t row_idx_type = 0;
  int64_t chunks = 1;        // slot chunks of the parallel counting sort (fixed in stage one)
  bool comparison_sort = false;  // ids too sparse for a counting sort (window_all only)
  int sort_threads = 1;      // threads of the per-chunk loops (plan.threads: the row copies)
  // Workspace: int64 expert ids narrowed to int32; sorted slots [N] int32 (dst -> src); expert
  // starts [bins + 1] int32; chunk histograms [chunks, bins + 1] int32 (the last column counts
  // the slots outside the window).
  Slot ws_eidx, ws_sorted, ws_starts, ws_hist;
  // Large x (docs/decisions.md L113): the rows are copied in token order, each x row read once
  // and written to its slots' destinations; ws_dest [N] int32 holds each slot's destination
  // row (-1: none).
  bool source_order = false;
  Slot ws_dest;
  cuda::SlotSort cuda_sort;  // CUDA: the stable slot sort by expert id
  std::array<TensorView*, 3> output_views() {
    return {&expanded_x, &expanded_row_idx, &expert_tokens};
  }
};

struct InitRoutingGradPlan : PlanBase {
  TensorView grad_expanded_x, expanded_row_idx, grad_x;
  int64_t R = 0, K = 0, H = 0;
  int64_t rows = 0;  // valid expanded rows: d in [0, rows) is read, anything else skipped
  Slot ws_idx;       // int64 indices narrowed to int32
  std::array<TensorView*, 1> output_views() { return {&grad_x}; }
};

InitRoutingPlan validate_init_routing(const TensorView* x, const TensorView* expert_idx,
                                      const InitRoutingAttrs& attrs, const TensorView* expanded_x,
                                      const TensorView* expanded_row_idx,
                                      const TensorView* expert_tokens, bool with_outputs);
InitRoutingGradPlan validate_init_routing_grad(const TensorView* grad_expanded_x,
                                               const TensorView* expanded_row_idx,
                                               const InitRoutingGradAttrs& attrs,
                                               const TensorView* grad_x, bool with_outputs);

// CPU kernels (init_routing_cpu.cc): workspace sizing (stage one) and run (stage two).
void init_routing_cpu_size(InitRoutingPlan& plan, WorkspaceLayout& layout);
void init_routing_cpu(const InitRoutingPlan& plan, const Workspace& ws, void* stream);
void init_routing_grad_cpu_size(InitRoutingGradPlan& plan, WorkspaceLayout& layout);
void init_routing_grad_cpu(const InitRoutingGradPlan& plan, const Workspace& ws, void* stream);

#if defined(MOEGRAD_WITH_CUDA)
// CUDA kernels (init_routing_cuda.cu); `stream` is a cudaStream_t.
void init_routing_cuda_size(InitRoutingPlan& plan, WorkspaceLayout& layout);
void init_routing_cuda(const InitRoutingPlan& plan, const Workspace& ws, void* stream);
void init_routing_grad_cuda_size(InitRoutingGradPlan& plan, WorkspaceLayout& layout);
void init_routing_grad_cuda(const InitRoutingGradPlan& plan, const Workspace& ws, void* stream);
#endif

}  // namespace moegrad

#endif  // MOEGRAD_OPS_INIT_ROUTING_H_
