// Host-side checks of index tensors (decisions.md D6). Device tensors are not read on the host;
// kernels skip invalid indices instead.
#ifndef MOEGRAD_CORE_INDEX_CHECK_H_
#define MOEGRAD_CORE_INDEX_CHECK_H_

#include <cstdint>

#include "core/check.h"

namespace moegrad {

// Every int32 value of a host tensor lies in [lo, hi); else `code`, naming the first bad
// position and value.
void check_index_range(const Validator& v, int32_t code, const TensorView& idx, const char* arg,
                       int64_t lo, int64_t hi);

// Every value of a host int32 tensor that is >= 0 appears at most once (values are already
// known to be < hi).
void check_index_unique(const Validator& v, int32_t code, const TensorView& idx, const char* arg,
                        int64_t hi);

// The CPU kernels only run on host views (161002 otherwise).
void require_cpu(const char* op, const TensorView& t);

}  // namespace moegrad

#endif  // MOEGRAD_CORE_INDEX_CHECK_H_
