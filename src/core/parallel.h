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

// Elements per chunk of a CPU row loop (a few streams stay in L1), and the most fp32 lanes of
// any SIMD target: chunk buffers are padded to whole vectors (padded_max bounds every target).
constexpr int64_t kRowChunk = 2048;
constexpr int64_t kMaxFloatLanes = 64;
inline int64_t padded_max(int64_t n) {
  return (n + kMaxFloatLanes - 1) / kMaxFloatLanes * kMaxFloatLanes;
}

// Whether a kernel output of `bytes` goes out with non-temporal stores: only when it is too big
// to stay in the last-level cache for the op that reads it next anyway (8 MiB and up; L72, L87);
// smaller outputs are stored normally and stay cached. One threshold for every CPU kernel.
constexpr int64_t kStreamOutputMinBytes = int64_t{8} << 20;
inline bool stream_output(int64_t bytes) { return bytes >= kStreamOutputMinBytes; }

// Stage one: the threads a loop over n rows with chunks of >= `grain` rows will use (0 for no
// rows). Stored in the plan and handed to parallel_rows, so per-thread scratch can be sized.
inline int plan_threads(int64_t n, int64_t grain) {
  if (n <= 0) return 0;
  const int64_t max_chunks = std::max<int64_t>(1, n / std::max<int64_t>(1, grain));
  return static_cast<int>(std::min<int64_t>(effective_threads(), max_chunks));
}

// Calls f(tid, begin, end) on disjoint chunks covering [0, n), tid < threads (from
// plan_threads). The split does not change results: each row is computed by one thread.
template <typename F>
void parallel_rows(int64_t n, int threads, F&& f) {
  if (n <= 0) return;
  if (threads <= 1) {
    f(0, int64_t{0}, n);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    const int nt = omp_get_num_threads();
    const int64_t begin = n * tid / nt;
    const int64_t end = n * (tid + 1) / nt;
    if (begin < end) f(tid, begin, end);
  }
#else
  f(0, int64_t{0}, n);
#endif
}

}  // namespace moegrad

#endif  // MOEGRAD_CORE_PARALLEL_H_
