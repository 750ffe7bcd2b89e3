// Memory-bandwidth probes of the benchmark's streaming roof (docs/performance.md, "Streaming
// roof"): read-only, write-only and copy traffic over large fp32 buffers, on the library's own
// thread count (set_num_threads) and with the same non-temporal stores as the kernels.
// Internal: reached from Python through moegrad._C (_stream_read, _stream_write, _stream_copy,
// _dependent_adds).
#ifndef MOEGRAD_CORE_STREAM_PROBE_H_
#define MOEGRAD_CORE_STREAM_PROBE_H_

#include <cstdint>

namespace moegrad {

// Sum of p[0..n) (each thread sums its contiguous part; returned so no load can be dropped).
double stream_read(const float* p, int64_t n);
// p[0..n) = value; whole 64-byte lines with non-temporal stores where the target has them.
void stream_write(float* p, int64_t n, float value);
// dst[0..n) = src[0..n), non-temporal stores as stream_write.
void stream_copy(const float* src, float* dst, int64_t n);
// 8 n dependent integer additions on the calling thread: one per cycle on any out-of-order
// x86-64 or Arm core, so n / seconds * 8 is the core's clock (the compute roof's cycles).
uint64_t dependent_adds(int64_t n);

}  // namespace moegrad

#endif  // MOEGRAD_CORE_STREAM_PROBE_H_
