// The vector loops of the host-side index checks (core/host.h), compiled once per SIMD target
// (Highway) and dispatched at run time: the library's portable objects are built for the
// baseline ISA, where the min/max pass over an int32 index tensor took 4 values per dozen SSE2
// instructions (about 4 us of a GPT-OSS gating backward call at T = 4096; L127).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/host_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <cstdint>

#include "core/host_simd.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// *mn, *mx = the minimum and maximum of p[0..n), n >= 1.
template <typename I>
void MinMaxT(const I* HWY_RESTRICT p, int64_t n, I* mn, I* mx) {
  const hn::ScalableTag<I> d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  I lo = p[0], hi = p[0];
  int64_t i = 0;
  if (n >= 4 * L) {
    auto vlo0 = hn::LoadU(d, p), vhi0 = vlo0;
    auto vlo1 = vlo0, vhi1 = vlo0;  // two chains: min/max latency is not the bound
    for (; i + 2 * L <= n; i += 2 * L) {
      const auto a = hn::LoadU(d, p + i), b = hn::LoadU(d, p + i + L);
      vlo0 = hn::Min(vlo0, a);
      vhi0 = hn::Max(vhi0, a);
      vlo1 = hn::Min(vlo1, b);
      vhi1 = hn::Max(vhi1, b);
    }
    lo = hn::GetLane(hn::MinOfLanes(d, hn::Min(vlo0, vlo1)));
    hi = hn::GetLane(hn::MaxOfLanes(d, hn::Max(vhi0, vhi1)));
  }
  for (; i < n; ++i) {
    lo = p[i] < lo ? p[i] : lo;
    hi = p[i] > hi ? p[i] : hi;
  }
  *mn = lo;
  *mx = hi;
}

void MinMaxI32(const int32_t* p, int64_t n, int32_t* mn, int32_t* mx) { MinMaxT(p, n, mn, mx); }
void MinMaxI64(const int64_t* p, int64_t n, int64_t* mn, int64_t* mx) { MinMaxT(p, n, mn, mx); }

}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moegrad {
HWY_EXPORT(MinMaxI32);
HWY_EXPORT(MinMaxI64);

void index_min_max(const int32_t* p, int64_t n, int32_t* mn, int32_t* mx) {
  HWY_DYNAMIC_DISPATCH(MinMaxI32)(p, n, mn, mx);
}
void index_min_max(const int64_t* p, int64_t n, int64_t* mn, int64_t* mx) {
  HWY_DYNAMIC_DISPATCH(MinMaxI64)(p, n, mn, mx);
}
}  // namespace moegrad
#endif  // HWY_ONCE
