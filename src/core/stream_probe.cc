// Memory-bandwidth probes of the benchmark's streaming roof (core/stream_probe.h), one copy per
// SIMD target (Highway), dispatched at run time like the kernels they bound.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/stream_probe.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <cstdint>
#include <vector>

#include "core/parallel.h"
#include "core/stream_probe.h"
#include "hwy/cache_control.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Elements before the first 64-byte-aligned one of p[0..n) (the part stored normally).
inline int64_t Head(const float* p, int64_t n) {
  const int64_t mis = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % 64) / 4;
  const int64_t head = mis == 0 ? 0 : 16 - mis;
  return head < n ? head : n;
}

// Four independent accumulators: the add latency does not bound the loop.
double ReadPart(const float* HWY_RESTRICT p, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  auto a0 = hn::Zero(d), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 4 * L <= n; i += 4 * L) {
    a0 = hn::Add(a0, hn::LoadU(d, p + i));
    a1 = hn::Add(a1, hn::LoadU(d, p + i + L));
    a2 = hn::Add(a2, hn::LoadU(d, p + i + 2 * L));
    a3 = hn::Add(a3, hn::LoadU(d, p + i + 3 * L));
  }
  double s = hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(a0, a1), hn::Add(a2, a3))));
  for (; i < n; ++i) s += p[i];
  return s;
}

// dst[0..n) = src ? src[0..n) : value; aligned whole vectors streamed.
void WritePart(const float* HWY_RESTRICT src, float* HWY_RESTRICT dst, int64_t n, float value) {
  const hn::ScalableTag<float> d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const auto v = hn::Set(d, value);
  int64_t i = 0;
  for (const int64_t head = Head(dst, n); i < head; ++i) dst[i] = src ? src[i] : value;
  if (reinterpret_cast<uintptr_t>(dst + i) % (L * sizeof(float)) == 0) {
    if (src) {
      for (; i + 2 * L <= n; i += 2 * L) {
        hn::Stream(hn::LoadU(d, src + i), d, dst + i);
        hn::Stream(hn::LoadU(d, src + i + L), d, dst + i + L);
      }
    } else {
      for (; i + 2 * L <= n; i += 2 * L) {
        hn::Stream(v, d, dst + i);
        hn::Stream(v, d, dst + i + L);
      }
    }
  }
  for (; i < n; ++i) dst[i] = src ? src[i] : value;
  hwy::FlushStream();
}

}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moegrad {
HWY_EXPORT(ReadPart);
HWY_EXPORT(WritePart);

namespace {
// Each thread's part starts on a 64-byte line of the destination (whole lines streamed).
template <typename F>
void ForParts(int64_t n, F&& f) {
  const int threads = plan_threads(n / 16, 1);
  parallel_rows(n / 16, threads, [&](int, int64_t b, int64_t e) {
    f(16 * b, e * 16 == n / 16 * 16 ? n : 16 * e);
  });
  if (n < 16) f(0, n);
}
}  // namespace

double stream_read(const float* p, int64_t n) {
  std::vector<double> part(static_cast<size_t>(effective_threads()) + 1, 0.0);
  const int threads = plan_threads(n / 16, 1);
  parallel_rows(n / 16, threads, [&](int tid, int64_t b, int64_t e) {
    const int64_t end = e * 16 == n / 16 * 16 ? n : 16 * e;
    part[static_cast<size_t>(tid)] = HWY_DYNAMIC_DISPATCH(ReadPart)(p + 16 * b, end - 16 * b);
  });
  if (n < 16) part[0] = HWY_DYNAMIC_DISPATCH(ReadPart)(p, n);
  double s = 0.0;
  for (double v : part) s += v;
  return s;
}

void stream_write(float* p, int64_t n, float value) {
  ForParts(n, [&](int64_t b, int64_t e) {
    HWY_DYNAMIC_DISPATCH(WritePart)(nullptr, p + b, e - b, value);
  });
}

void stream_copy(const float* src, float* dst, int64_t n) {
  ForParts(n, [&](int64_t b, int64_t e) {
    HWY_DYNAMIC_DISPATCH(WritePart)(src + b, dst + b, e - b, 0.0f);
  });
}

uint64_t dependent_adds(int64_t n) {
  uint64_t x = static_cast<uint64_t>(n);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t v = static_cast<uint64_t>(i);
    // The empty asm keeps each addition as one instruction on the chain (no folding).
#if defined(__GNUC__)
#define MOEGRAD_ADD x += v; __asm__ volatile("" : "+r"(x))
#else
#define MOEGRAD_ADD x += v
#endif
    MOEGRAD_ADD; MOEGRAD_ADD; MOEGRAD_ADD; MOEGRAD_ADD;
    MOEGRAD_ADD; MOEGRAD_ADD; MOEGRAD_ADD; MOEGRAD_ADD;
#undef MOEGRAD_ADD
  }
  return x;
}

}  // namespace moegrad
#endif  // HWY_ONCE
