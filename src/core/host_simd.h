// SIMD loops of the host-side index checks (core/host.h), dispatched to the best target the CPU
// has (core/host_simd.cc).
#ifndef MOEGRAD_CORE_HOST_SIMD_H_
#define MOEGRAD_CORE_HOST_SIMD_H_

#include <cstdint>

namespace moegrad {

// *mn, *mx = the minimum and maximum of p[0..n); n >= 1.
void index_min_max(const int32_t* p, int64_t n, int32_t* mn, int32_t* mx);
void index_min_max(const int64_t* p, int64_t n, int64_t* mn, int64_t* mx);

}  // namespace moegrad

#endif  // MOEGRAD_CORE_HOST_SIMD_H_
