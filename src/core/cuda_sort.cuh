// The stable slot sort of the CUDA routing kernels (init routing, the finalize bias grad): the
// R*K slots ordered by a 32-bit key made from their expert id, by CUB's DeviceRadixSort (stable
// and deterministic: the unique stable order, whatever the GPU), then each bin's first sorted
// position by binary search. Stage one sizes every buffer, CUB's scratch included; stage two
// launches on the caller's stream and never synchronises. Included only by .cu files.
#ifndef MOEGRAD_CORE_CUDA_SORT_CUH_
#define MOEGRAD_CORE_CUDA_SORT_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "core/slot_sort.h"
#include "core/workspace.h"
#include "moegrad/moegrad.h"

namespace moegrad {
namespace cuda {

struct SortedSlots {
  const uint32_t* keys;  // [n] ascending
  const int32_t* slots;  // [n] the slot of each sorted position
  const int32_t* starts; // [bins + 1]
};

// Stage one: reserves the buffers in `layout` (asks CUB for its scratch size on `device`).
void slot_sort_size(const char* op, int device, SlotSort& s, WorkspaceLayout& layout);
// Stage two: keys from the int32/int64 ids, the sort, the starts; all on `stream`.
SortedSlots slot_sort_run(const char* op, const SlotSort& s, const TensorView& ids,
                          const Workspace& ws, cudaStream_t stream);

}  // namespace cuda
}  // namespace moegrad

#endif  // MOEGRAD_CORE_CUDA_SORT_CUH_
