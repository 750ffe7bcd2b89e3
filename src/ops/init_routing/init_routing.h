// Init routing (token permutation) forward and grad: parameters, validation, shape inference and
// workspace plan (no kernels). docs/operators.md §8; docs/decisions.md D25-D31, L30-L39.
#ifndef MOEGRAD_OPS_INIT_ROUTING_H_
#define MOEGRAD_OPS_INIT_ROUTING_H_

#include "moegrad/moegrad.h"

namespace moegrad {

struct InitRoutingPlan {
  const char* op = "moe_init_routing";
  uint64_t workspace_bytes = 0;
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
  int64_t chunks = 1;        // slot chunks of the parallel counting sort (fixed at plan time)
  bool comparison_sort = false;  // ids too sparse for a counting sort (window_all only)
  // Workspace layout (bytes from the start): sorted slots [N] int32, expert starts [bins + 1]
  // int32, then chunk histograms [chunks, bins + 1] int32 (the last column counts the slots
  // outside the window).
  uint64_t starts_offset = 0, hist_offset = 0;
};

struct InitRoutingGradPlan {
  const char* op = "moe_init_routing_grad";
  uint64_t workspace_bytes = 0;
  TensorView grad_expanded_x, expanded_row_idx, grad_x;
  int64_t R = 0, K = 0, H = 0;
  int64_t rows = 0;  // valid expanded rows: d in [0, rows) is read, anything else skipped
};

InitRoutingPlan validate_init_routing(const TensorView* x, const TensorView* expert_idx,
                                      const InitRoutingAttrs& attrs, const TensorView* expanded_x,
                                      const TensorView* expanded_row_idx,
                                      const TensorView* expert_tokens, bool with_outputs);
InitRoutingGradPlan validate_init_routing_grad(const TensorView* grad_expanded_x,
                                               const TensorView* expanded_row_idx,
                                               const InitRoutingGradAttrs& attrs,
                                               const TensorView* grad_x, bool with_outputs);

void run_plan(const InitRoutingPlan& plan, void* workspace, void* stream);
void run_plan(const InitRoutingGradPlan& plan, void* workspace, void* stream);

void init_routing_cpu(const InitRoutingPlan& plan, void* workspace);
void init_routing_grad_cpu(const InitRoutingGradPlan& plan);

}  // namespace moegrad

#endif  // MOEGRAD_OPS_INIT_ROUTING_H_
