// Glue between the extern "C" entry points and the C++ API: tensor handles, the executor
// registry and the guard that turns exceptions into status codes. Nothing throws across it.
#ifndef MOEGRAD_CORE_ACL_API_H_
#define MOEGRAD_CORE_ACL_API_H_

#include <utility>

#include "moegrad/aclnn.h"
#include "moegrad/moegrad.h"

struct aclTensor {
  moegrad::TensorView view;
};

namespace moegrad {

inline const TensorView* view_of(const aclTensor* t) { return t ? &t->view : nullptr; }

void set_last_error(const char* message);

// Registers an executor made by `op` (a string literal); stage two only accepts registered
// ones, from the same op.
aclOpExecutor* publish_executor(const char* op, ExecutorPtr executor);


// Runs f; returns 0, or the status of the exception it threw (message kept for
// aclGetRecentErrMsg).
template <typename F>
aclnnStatus api_guard(F&& f) noexcept {
  try {
    set_last_error("");
    std::forward<F>(f)();
    return ACLNN_SUCCESS;
  } catch (const Error& e) {
    set_last_error(e.what());
    return e.code();
  } catch (const std::exception& e) {
    set_last_error(e.what());
    return ACLNN_ERR_INNER;
  } catch (...) {
    set_last_error("unknown internal error");
    return ACLNN_ERR_INNER;
  }
}

// Stage one's common tail: checks the out-parameters, then plans and publishes the executor.
template <typename PlanFn>
aclnnStatus stage_one(const char* op, uint64_t* workspace_size, aclOpExecutor** executor,
                      PlanFn&& plan) noexcept {
  return api_guard([&] {
    if (workspace_size == nullptr) {
      throw Error(kErrNullptr, std::string(op) + ": workspaceSize: must not be null; got null");
    }
    if (executor == nullptr) {
      throw Error(kErrNullptr, std::string(op) + ": executor: must not be null; got null");
    }
    ExecutorPtr e = plan();
    *workspace_size = e->workspace_size();
    *executor = publish_executor(op, std::move(e));
  });
}

// Stage two: runs (and, unless repeatable, frees) a registered executor.
aclnnStatus stage_two(const char* op, void* workspace, uint64_t workspace_size,
                      aclOpExecutor* executor, void* stream) noexcept;

}  // namespace moegrad

#endif  // MOEGRAD_CORE_ACL_API_H_
