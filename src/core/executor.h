// The generic executor: a validated plan plus the kernel of the backend stage one chose.
#ifndef MOEGRAD_CORE_EXECUTOR_H_
#define MOEGRAD_CORE_EXECUTOR_H_

#include <array>
#include <atomic>
#include <tuple>
#include <utility>
#include <vector>

#include "core/backend.h"
#include "core/check.h"
#include "core/workspace.h"
#include "moegrad/moegrad.h"

namespace moegrad {

// Fields every operator's plan carries. A plan struct derives from it and adds its tensors,
// attributes and workspace slots, plus
//   std::array<TensorView*, N> output_views();   // its output members, in output order
struct PlanBase {
  const char* op = "";
  int32_t shape_code = kErrParamInvalid;  // the status of the op's shape errors
  Backend backend = Backend::kCPU;
  Device device = Device::kCPU;
  int32_t device_id = 0;
  uint64_t workspace_bytes = 0;
  int threads = 1;      // CPU: threads of the row loop, fixed in stage one (scratch is per thread)
  bool bound = false;   // outputs given (plan_*) or bound later (prepare_* + run with outputs)
  std::vector<OutputSpec> outputs;     // what the op writes, in output order
  std::vector<const char*> out_names;  // their argument names

  // The plan runs on `on`'s device (select_backend has checked that every tensor agrees).
  void place(const TensorView& on, bool outputs_given) {
    device = on.device;
    device_id = on.device_id;
    bound = outputs_given;
  }
  void add_output(const char* name, Shape shape, DType dtype, bool optional = false) {
    outputs.push_back(OutputSpec{std::move(shape), dtype, optional});
    out_names.push_back(name);
  }
};

// Stage two's checks: the workspace against the planned size; a bound output against its spec
// (present unless optional, dtype, contiguity, device, shape; O(1) each).
void check_workspace(const char* op, uint64_t need, const void* workspace, uint64_t bytes);
void bind_output(const PlanBase& plan, size_t i, const TensorView* given, TensorView& slot);

template <typename Plan>
class PlanExecutor final : public Executor {
 public:
  PlanExecutor(Plan plan, const KernelEntry<Plan>& kernel)
      : plan_(std::move(plan)), run_(kernel.run) {}
  uint64_t workspace_size() const override { return plan_.workspace_bytes; }
  const std::vector<OutputSpec>& outputs() const override { return plan_.outputs; }
  Device device() const override { return plan_.device; }
  int32_t device_id() const override { return plan_.device_id; }

  void run(void* workspace, uint64_t bytes, void* stream) override {
    const InUse guard(this);
    if (!plan_.bound) {
      throw Error(kErrNullptr, cat(plan_.op, ": outputs: planned without outputs, so run needs "
                                             "them; got none"));
    }
    launch(workspace, bytes, stream);
  }

  void run(const TensorView* const* outs, size_t n, void* workspace, uint64_t bytes,
           void* stream) override {
    const InUse guard(this);
    auto views = plan_.output_views();
    if (n != views.size()) {
      throw Error(kErrParamInvalid,
                  cat(plan_.op, ": outputs: must be ", views.size(), " tensors; got ", n));
    }
    if (n > 0 && outs == nullptr) {
      throw Error(kErrNullptr, cat(plan_.op, ": outputs: must not be null; got null"));
    }
    check_workspace(plan_.op, plan_.workspace_bytes, workspace, bytes);
    // All outputs are checked before any is bound: a refused call leaves the plan as it was.
    std::array<TensorView, std::tuple_size_v<decltype(views)>> bound;  // no allocation per call
    for (size_t i = 0; i < n; ++i) bind_output(plan_, i, outs[i], bound[i]);
    for (size_t i = 0; i < n; ++i) *views[i] = bound[i];
    plan_.bound = true;
    run_(plan_, Workspace(workspace), stream);
  }

 private:
  // One run at a time: a second thread running (or rebinding) the same executor while a run is
  // in progress gets 161002 instead of a data race on the bound outputs (docs/decisions.md L84).
  // Destroying an executor another thread is running stays the owner's error (unique_ptr).
  struct InUse {
    PlanExecutor* self;
    explicit InUse(PlanExecutor* s) : self(s) {
      if (self->in_use_.exchange(true, std::memory_order_acquire)) {
        throw Error(kErrParamInvalid, cat(self->plan_.op, ": executor: must not be in use by "
                                                          "another thread; got an executor "
                                                          "whose run is in progress"));
      }
    }
    ~InUse() { self->in_use_.store(false, std::memory_order_release); }
    InUse(const InUse&) = delete;
    InUse& operator=(const InUse&) = delete;
  };

  void launch(void* workspace, uint64_t bytes, void* stream) {
    check_workspace(plan_.op, plan_.workspace_bytes, workspace, bytes);
    run_(plan_, Workspace(workspace), stream);
  }

  Plan plan_;
  void (*run_)(const Plan&, const Workspace&, void*);
  std::atomic<bool> in_use_{false};
};

// Throws 161002 when this build has no kernel of `b` for the op.
void require_kernel(const char* op, Backend b, bool available);

// Stage one's tail: looks up the chosen backend's kernel, sizes its workspace, wraps the plan.
template <typename Plan>
ExecutorPtr make_executor(Plan plan, const KernelTable<Plan>& table) {
  const KernelEntry<Plan>& k = table[plan.backend];
  require_kernel(plan.op, plan.backend, k.run != nullptr);
  WorkspaceLayout layout;
  if (k.size) k.size(plan, layout);
  plan.workspace_bytes = layout.bytes();
  return ExecutorPtr(new PlanExecutor<Plan>(std::move(plan), k));
}

}  // namespace moegrad

#endif  // MOEGRAD_CORE_EXECUTOR_H_
