// The generic executor: a validated plan plus the kernel that runs it.
#ifndef MOEGRAD_CORE_EXECUTOR_H_
#define MOEGRAD_CORE_EXECUTOR_H_

#include <utility>

#include "core/check.h"
#include "moegrad/moegrad.h"

namespace moegrad {

// Checks the workspace handed to stage two against the planned size.
void check_workspace(const char* op, uint64_t need, const void* workspace, uint64_t bytes);

// Plan must provide: const char* op; uint64_t workspace_bytes; and a free function
// run_plan(const Plan&, void* workspace, void* stream) found by argument-dependent lookup.
template <typename Plan>
class PlanExecutor final : public Executor {
 public:
  explicit PlanExecutor(Plan plan) : plan_(std::move(plan)) {}
  uint64_t workspace_size() const override { return plan_.workspace_bytes; }
  void run(void* workspace, uint64_t bytes, void* stream) override {
    check_workspace(plan_.op, plan_.workspace_bytes, workspace, bytes);
    run_plan(plan_, workspace, stream);
  }

 private:
  Plan plan_;
};

template <typename Plan>
ExecutorPtr make_executor(Plan plan) {
  return ExecutorPtr(new PlanExecutor<Plan>(std::move(plan)));
}

}  // namespace moegrad

#endif  // MOEGRAD_CORE_EXECUTOR_H_
