// What the host-side planning code (plain C++) needs to know about the CUDA backend. The kernel
// launchers themselves are declared in each family's header (src/ops/<family>/<family>.h).
#ifndef MOEGRAD_CORE_CUDA_BACKEND_H_
#define MOEGRAD_CORE_CUDA_BACKEND_H_

namespace moegrad {

// True when the environment sets MOEGRAD_STRICT_INDICES=1: CUDA launches then check device
// index tensors on the device before computing and report the first bad position, at the
// price of one host synchronisation per call (docs/decisions.md L46). Read at planning time.
bool strict_indices();

}  // namespace moegrad

#endif  // MOEGRAD_CORE_CUDA_BACKEND_H_
