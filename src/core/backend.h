// Backends and the per-operator kernel table. Stage one picks the backend from the tensors'
// device (select_backend) and sizes that backend's workspace; stage two runs its kernel.
#ifndef MOEGRAD_CORE_BACKEND_H_
#define MOEGRAD_CORE_BACKEND_H_

#include <initializer_list>

#include "core/check.h"
#include "core/workspace.h"
#include "moegrad/moegrad.h"

namespace moegrad {

enum class Backend : int32_t { kCPU = 0, kCUDA = 1 };

const char* backend_name(Backend b);
// "cpu", "cuda:1", or "device type 13" for a device moegrad does not know.
std::string device_str(Device d, int32_t id);

// A tensor argument of a call; view == nullptr for an absent optional.
struct NamedView {
  const char* name;
  const TensorView* view;
};

// The call's device is the first tensor's. Every other present tensor must have the same device
// type and id (161002 naming the tensor that differs), and this build must serve the device
// (161002, e.g. a CUDA tensor when moegrad was built without CUDA). The first n_inputs tensors
// are inputs, the rest outputs: an output whose memory overlaps another tensor's is 161002
// naming it (L232; kernels read inputs while they write, and the CUDA ones assume no alias),
// except that the output named in_place_out may be exactly the view of the input named
// in_place_in on the CPU, where that operator computes in place.
Backend select_backend(const Validator& v, std::initializer_list<NamedView> tensors,
                       size_t n_inputs, const char* in_place_out = nullptr,
                       const char* in_place_in = nullptr);

// One backend's entry in an operator's kernel table.
//   size: stage one; reserves the backend's scratch in the layout and may fix plan fields the
//         kernel depends on (e.g. the CPU thread count). May be null (no scratch).
//   run:  stage two; takes scratch only from the workspace. `stream` is a cudaStream_t for CUDA.
template <typename Plan>
struct KernelEntry {
  void (*size)(Plan&, WorkspaceLayout&) = nullptr;
  void (*run)(const Plan&, const Workspace&, void* stream) = nullptr;
};

// An operator's kernels, one entry per backend; a null run means "not in this build".
template <typename Plan>
struct KernelTable {
  KernelEntry<Plan> cpu;
  KernelEntry<Plan> cuda;
  const KernelEntry<Plan>& operator[](Backend b) const { return b == Backend::kCUDA ? cuda : cpu; }
};

// The CUDA entry of a kernel table: the given functions in a CUDA build, empty otherwise, so the
// CUDA functions need only exist when MOEGRAD_WITH_CUDA is defined.
#if defined(MOEGRAD_WITH_CUDA)
#define MOEGRAD_CUDA_ENTRY(size_fn, run_fn) {size_fn, run_fn}
#else
#define MOEGRAD_CUDA_ENTRY(size_fn, run_fn) {}
#endif

}  // namespace moegrad

#endif  // MOEGRAD_CORE_BACKEND_H_
