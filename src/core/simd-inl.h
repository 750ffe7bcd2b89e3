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
#include <type_traits>

#include "core/dtype.h"
#include "core/parallel.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// Elements processed per chunk of a row: a few streams of 8 KB stay in L1.
constexpr size_t kChunk = static_cast<size_t>(kRowChunk);

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

// Vector loads/stores of T widened to / narrowed from fp32 in registers, for the element types
// whose conversion is exact or correctly rounded on every target: float, and bf16 (integer
// round-to-nearest-even). fp16 goes through load_chunk/store_chunk (Highway's software fp16
// demotion on targets without F16C truncates).
template <typename T>
struct InRegister : std::false_type {};
template <>
struct InRegister<float> : std::true_type {};
template <>
struct InRegister<bf16_t> : std::true_type {};

HWY_INLINE VF LoadF(DF d, const float* HWY_RESTRICT p) { return hn::LoadU(d, p); }
HWY_INLINE VF LoadF(DF d, const bf16_t* HWY_RESTRICT p) {
  const hn::RebindToUnsigned<DF> du32;
  const hn::Rebind<uint16_t, DF> du16;
  const auto bits = hn::PromoteTo(du32, hn::LoadU(du16, reinterpret_cast<const uint16_t*>(p)));
  return hn::BitCast(d, hn::ShiftLeft<16>(bits));
}
HWY_INLINE void StoreF(DF d, VF v, float* HWY_RESTRICT p) { hn::StoreU(v, d, p); }
HWY_INLINE void StoreF(DF /*d*/, VF v, bf16_t* HWY_RESTRICT p) {
  const hn::RebindToUnsigned<DF> du32;
  const hn::RebindToSigned<DF> di32;
  const hn::Rebind<uint16_t, DF> du16;
  const auto u = hn::BitCast(du32, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(u), hn::Set(du32, 1u));
  auto r = hn::ShiftRight<16>(hn::Add(u, hn::Add(hn::Set(du32, 0x7fffu), lsb)));
  const auto quiet = hn::Or(hn::ShiftRight<16>(u), hn::Set(du32, 0x40u));
  r = hn::IfThenElse(hn::RebindMask(du32, hn::IsNaN(v)), quiet, r);
  hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di32, r)), du16, reinterpret_cast<uint16_t*>(p));
}

// Like store_chunk, for destinations that are not read again soon (kernel outputs): whole
// aligned vectors go out with non-temporal stores, which skip the read-for-ownership of each
// destination cache line (a third of the traffic of a write-only stream). `stage` holds
// kChunk elements of T (unused for float). Misaligned chunks fall back to store_chunk. Call
// hwy::FlushStream() before the data is handed to another thread.
template <typename T>
HWY_INLINE void stream_chunk(const float* HWY_RESTRICT src, T* HWY_RESTRICT dst, size_t n,
                             T* HWY_RESTRICT stage) {
  const hn::ScalableTag<uint8_t> du8;
  const size_t vbytes = hn::Lanes(du8);
  const size_t bytes = n * sizeof(T);
  if (reinterpret_cast<uintptr_t>(dst) % vbytes != 0 || bytes % vbytes != 0) {
    store_chunk(src, dst, n);
    return;
  }
  const uint8_t* from;
  if constexpr (std::is_same_v<T, float>) {
    from = reinterpret_cast<const uint8_t*>(src);
  } else {
    store_chunk(src, stage, n);
    from = reinterpret_cast<const uint8_t*>(stage);
  }
  uint8_t* to = reinterpret_cast<uint8_t*>(dst);
  for (size_t i = 0; i < bytes; i += vbytes) hn::Stream(hn::LoadU(du8, from + i), du8, to + i);
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

// d/dx sqrt(softplus(x)) written in n = sqrt(softplus(x)): (1 - exp(-n^2)) / (2n), since
// exp(-softplus(x)) = 1 - sigmoid(x). expm1 keeps it accurate for small n (the limit is n / 2;
// exactly 0 at n = 0); NaN propagates (D22).
HWY_INLINE VF SqrtSoftplusGrad(DF d, VF n) {
  const VF half = hn::Set(d, 0.5f);
  const VF n2 = hn::Mul(n, n);
  const VF num = hn::Neg(hn::Expm1(d, hn::Neg(n2)));
  const VF big = hn::Div(hn::Mul(num, half), n);
  const VF small = hn::Mul(n, half);  // (1 - exp(-n^2)) / (2n) = n/2 (1 - n^2/2 + ...)
  const VF r = hn::IfThenElse(hn::Lt(hn::Abs(n), hn::Set(d, 1e-4f)), small, big);
  return hn::IfThenElse(hn::IsNaN(n), n, r);
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
