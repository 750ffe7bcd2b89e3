// The plan of the CUDA backend's stable slot sort (core/cuda_sort.cuh), plain C++ so that the
// operators' plans can hold it.
#ifndef MOEGRAD_CORE_SLOT_SORT_H_
#define MOEGRAD_CORE_SLOT_SORT_H_

#include <cstdint>

#include "core/workspace.h"

namespace moegrad {
namespace cuda {

struct SlotSort {
  // Set by the caller before slot_sort_size.
  int64_t n = 0;              // slots
  int64_t lo = 0, limit = 0;  // ids in [lo, limit) get key id - lo, every other id `sentinel`
  uint32_t sentinel = 0;      // > every key of an id in [lo, limit): sorted last, in slot order
  int64_t bins = 0;           // starts[b] = first sorted position of key b, b < bins
  uint32_t in_limit = 0;      // starts[bins] = the number of keys below in_limit
  // Set by slot_sort_size.
  int end_bit = 1;
  uint64_t temp_bytes = 0;
  Slot keys_in, keys_out, vals_in, vals_out, starts, temp;
};

}  // namespace cuda
}  // namespace moegrad

#endif  // MOEGRAD_CORE_SLOT_SORT_H_
