// Per-target SIMD helpers (Google Highway). Included once per instruction-set target from the
// operators' *_cpu.cc files through hwy/foreach_target.h; the kernels are chosen at run time
// with HWY_DYNAMIC_DISPATCH. All math is fp32 (D12).
#if defined(MOEGRAD_CORE_SIMD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOEGRAD_CORE_SIMD_INL_H_
#undef MOEGRAD_CORE_SIMD_INL_H_
#else
#define MOEGRAD_CORE_SIMD_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// Elements processed per chunk of a row: a few streams of 8 KB stay in L1.
constexpr size_t kChunk = 2048;

// Chunk buffers are padded to whole vectors so the SIMD loops need no tail code; the padding
// lanes compute on stale values and are never stored.
inline size_t padded(size_t n) {
  const size_t lanes = hn::Lanes(DF());
  return (n + lanes - 1) / lanes * lanes;
}

// Widening / narrowing of one chunk. Plain loops: the compiler vectorises them for the current
// target (F16C conversions, integer bf16 rounding).
template <typename T>
HWY_INLINE void load_chunk(const T* HWY_RESTRICT src, float* HWY_RESTRICT dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
}
template <typename T>
HWY_INLINE void store_chunk(const float* HWY_RESTRICT src, T* HWY_RESTRICT dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = from_f32<T>(src[i]);
}

// Stable logistic function: exp of a non-positive argument only, so no overflow; exact 0/1 at
// the extremes; NaN propagates.
HWY_INLINE VF Sigmoid(DF d, VF x) {
  const VF one = hn::Set(d, 1.0f);
  const VF e = hn::Exp(d, hn::Neg(hn::Abs(x)));
  const VF num = hn::IfThenElse(hn::Ge(x, hn::Zero(d)), one, e);
  return hn::IfThenElse(hn::IsNaN(x), x, hn::Div(num, hn::Add(one, e)));
}

// exp(x), NaN-propagating (Highway's Exp maps NaN to 0).
HWY_INLINE VF ExpNaN(DF d, VF x) { return hn::IfThenElse(hn::IsNaN(x), x, hn::Exp(d, x)); }

// sqrt(log(1 + exp(x))) without overflow.
HWY_INLINE VF SqrtSoftplus(DF d, VF x) {
  const VF sp = hn::Add(hn::Max(x, hn::Zero(d)), hn::Log1p(d, hn::Exp(d, hn::Neg(hn::Abs(x)))));
  return hn::IfThenElse(hn::IsNaN(x), x, hn::Sqrt(sp));
}

// Sum of a(i) * b(i) over n terms in a fixed blocked order (8 partial sums, then a fixed tree),
// so the bits do not depend on threads or on the SIMD target. Defined per target so the
// accessor lambdas inline and the 8 partial sums vectorise.
template <typename LoadA, typename LoadB>
HWY_INLINE float Dot8(int64_t n, LoadA&& a, LoadB&& b) {
  constexpr int kLanes = 8;
  float acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a(i + l) * b(i + l);
  }
  for (int l = 0; i < n; ++i, ++l) acc[l] += a(i) * b(i);
  const float s01 = acc[0] + acc[1], s23 = acc[2] + acc[3];
  const float s45 = acc[4] + acc[5], s67 = acc[6] + acc[7];
  return (s01 + s23) + (s45 + s67);
}

// out[i] = f(in[i]) over a padded chunk.
template <class F>
HWY_INLINE void map_chunk(const float* HWY_RESTRICT in, float* HWY_RESTRICT out, size_t n, F f) {
  const DF d;
  const size_t np = padded(n);
  for (size_t i = 0; i < np; i += hn::Lanes(d)) hn::Store(f(d, hn::Load(d, in + i)), d, out + i);
}

}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#endif  // MOEGRAD_CORE_SIMD_INL_H_
