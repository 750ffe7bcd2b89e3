// Workspace layout (stage one) and carve-out (stage two). Kernels take every scratch buffer from
// the workspace their caller hands them, so stage two allocates nothing on any backend.
#ifndef MOEGRAD_CORE_WORKSPACE_H_
#define MOEGRAD_CORE_WORKSPACE_H_

#include <cstdint>

namespace moegrad {

// A sub-buffer of the workspace: `copies` arrays (one per CPU thread, say) `stride` bytes apart.
struct Slot {
  uint64_t offset = 0;
  uint64_t stride = 0;
};

// Stage one: reserves aligned sub-buffers and reports the bytes stage two must be handed.
class WorkspaceLayout {
 public:
  // Alignment of every sub-buffer (whole SIMD vectors, no false sharing between thread copies).
  static constexpr uint64_t kAlign = 128;

  template <typename T>
  Slot add(int64_t count, int64_t copies = 1) {
    const uint64_t n = count > 0 ? static_cast<uint64_t>(count) * sizeof(T) : 0;
    const uint64_t stride = (n + kAlign - 1) / kAlign * kAlign;
    Slot s{total_, stride};
    total_ += stride * static_cast<uint64_t>(copies > 0 ? copies : 0);
    return s;
  }
  // The caller's base pointer need not be aligned: one kAlign of slack covers it.
  uint64_t bytes() const { return total_ == 0 ? 0 : total_ + kAlign; }

 private:
  uint64_t total_ = 0;
};

// Stage two: the caller's workspace (host or device memory), aligned once.
class Workspace {
 public:
  explicit Workspace(void* base)
      : base_((reinterpret_cast<uintptr_t>(base) + WorkspaceLayout::kAlign - 1) &
              ~static_cast<uintptr_t>(WorkspaceLayout::kAlign - 1)) {}
  template <typename T>
  T* get(Slot s, int64_t copy = 0) const {
    return reinterpret_cast<T*>(base_ + s.offset + s.stride * static_cast<uint64_t>(copy));
  }

 private:
  uintptr_t base_;
};

}  // namespace moegrad

#endif  // MOEGRAD_CORE_WORKSPACE_H_
