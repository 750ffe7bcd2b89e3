// Row-parallel loops. Each row is computed by one thread in a fixed order, so results are
// bitwise identical for any thread count (D16).
#ifndef MOEGRAD_CORE_PARALLEL_H_
#define MOEGRAD_CORE_PARALLEL_H_

#include <algorithm>
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace moegrad {

int effective_threads();

// Calls f(begin, end) on disjoint chunks covering [0, n); chunks hold at least `grain` rows.
template <typename F>
void parallel_for(int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
  int64_t max_chunks = std::max<int64_t>(1, n / std::max<int64_t>(1, grain));
  int threads = static_cast<int>(std::min<int64_t>(effective_threads(), max_chunks));
  if (threads <= 1) {
    f(int64_t{0}, n);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
  {
    int tid = omp_get_thread_num();
    int nt = omp_get_num_threads();
    int64_t begin = n * tid / nt;
    int64_t end = n * (tid + 1) / nt;
    if (begin < end) f(begin, end);
  }
#else
  f(int64_t{0}, n);
#endif
}

}  // namespace moegrad

#endif  // MOEGRAD_CORE_PARALLEL_H_
