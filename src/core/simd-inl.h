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
#include <cstring>
#include <type_traits>

#include "core/dtype.h"
#include "core/parallel.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

// Once per translation unit (not per target): whether this CPU has AVX512-BF16.
#ifndef MOEGRAD_CORE_SIMD_ONCE_H_
#define MOEGRAD_CORE_SIMD_ONCE_H_
#include <atomic>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
namespace moegrad {
namespace simd_detail {
inline bool cpu_has_avx512bf16() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return ((a >> 5) & 1u) != 0;  // CPUID.(EAX=7,ECX=1):EAX[5] = AVX512_BF16
#else
  return false;
#endif
}
// Whether the AVX-512 targets narrow bf16 with VCVTNEPS2BF16. Set once at load from CPUID; the
// conversion tests clear it to run the portable path on the same target (both give the same
// bits).
inline std::atomic<bool> use_avx512bf16{cpu_has_avx512bf16()};
}  // namespace simd_detail
}  // namespace moegrad
#endif  // MOEGRAD_CORE_SIMD_ONCE_H_

// Per target: x86 AVX-512 (Highway's AVX3 family) and x86 with F16C (AVX2 and up).
#undef MOEGRAD_SIMD_AVX512
#undef MOEGRAD_SIMD_F16C
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
#define MOEGRAD_SIMD_AVX512 1
#else
#define MOEGRAD_SIMD_AVX512 0
#endif
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
#define MOEGRAD_SIMD_F16C 1
#else
#define MOEGRAD_SIMD_F16C 0
#endif
#if MOEGRAD_SIMD_AVX512
#include <immintrin.h>
#endif

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

// One family of vector loads and stores of T widened to / narrowed from fp32, for every
// element kernel (SwiGLU, gating, finalize and init routing):
//   LoadF / StoreF        Lanes(d) elements at any alignment;
//   LoadFN / StoreFN      the first n < Lanes(d) elements (row tails);
//   StreamF / StreamF2    non-temporal stores of one vector / of two vectors as one full-width
//                         store, at p with StreamAligned(p) / Stream2Aligned(p);
//   load_chunk / store_chunk / stream_chunk   whole chunk buffers.
// InRegister<T>: the conversion is exact or correctly rounded in registers on this target:
// float; bf16 (widened by a shift, narrowed with round-to-nearest-even); fp16 on x86 targets
// with F16C (AVX2 and up: VCVTPH2PS / VCVTPS2PH with an immediate round-to-nearest-even).
// Other types (fp16 elsewhere: Highway's software fp16 demotion truncates) go through the
// scalar conversions of core/convert.h, one vector at a time, with the same bits.
template <typename T>
struct InRegister : std::false_type {};
template <>
struct InRegister<float> : std::true_type {};
template <>
struct InRegister<bf16_t> : std::true_type {};
#if MOEGRAD_SIMD_F16C
template <>
struct InRegister<half_t> : std::true_type {};
#endif

using VU16 = hn::Vec<hn::Rebind<uint16_t, DF>>;

// fp32 -> bf16 bits. VCVTNEPS2BF16 (AVX512-BF16) rounds to nearest even and quiets NaN exactly
// like the portable path, but flushes denormal inputs to zero: vectors with a denormal lane
// (rare) take the portable path. Inline assembly, so the target needs no extra compiler flag;
// used where CPUID reports the instruction (docs/decisions.md L70).
HWY_INLINE VU16 Bf16Bits(DF d, VF v) {
  const hn::Rebind<uint16_t, DF> du16;
#if MOEGRAD_SIMD_AVX512
  if (simd_detail::use_avx512bf16.load(std::memory_order_relaxed)) {
    const __m512 raw = v.raw;
    if (_mm512_fpclass_ps_mask(raw, 0x20) == 0) {  // 0x20: denormal
      __m256i r;
      asm("vcvtneps2bf16 {%1, %0|%0, %1}" : "=v"(r) : "v"(raw));
      return VU16{r};
    }
  }
#endif
  const hn::RebindToUnsigned<DF> du32;
  const hn::RebindToSigned<DF> di32;
  const auto u = hn::BitCast(du32, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(u), hn::Set(du32, 1u));
  auto r = hn::ShiftRight<16>(hn::Add(u, hn::Add(hn::Set(du32, 0x7fffu), lsb)));
  const auto quiet = hn::Or(hn::ShiftRight<16>(u), hn::Set(du32, 0x40u));
  r = hn::IfThenElse(hn::RebindMask(du32, hn::IsNaN(v)), quiet, r);
  (void)d;
  return hn::DemoteTo(du16, hn::BitCast(di32, r));
}

// The register form of T (InRegister<T> only): the narrowed vector's tag D and lane type TN,
// Narrow (fp32 -> the bits of T) and Widen (Lanes(d) elements at p -> fp32).
template <typename T>
struct Reg;
template <>
struct Reg<float> {
  using D = DF;
  using TN = float;
  static HWY_INLINE VF Narrow(DF, VF v) { return v; }
  static HWY_INLINE VF Widen(DF d, const float* HWY_RESTRICT p) { return hn::LoadU(d, p); }
};
template <>
struct Reg<bf16_t> {
  using D = hn::Rebind<uint16_t, DF>;
  using TN = uint16_t;
  static HWY_INLINE VU16 Narrow(DF d, VF v) { return Bf16Bits(d, v); }
  static HWY_INLINE VF Widen(DF d, const bf16_t* HWY_RESTRICT p) {
    const hn::RebindToUnsigned<DF> du32;
    const auto bits = hn::PromoteTo(du32, hn::LoadU(D(), reinterpret_cast<const uint16_t*>(p)));
    return hn::BitCast(d, hn::ShiftLeft<16>(bits));
  }
};
#if MOEGRAD_SIMD_F16C
template <>
struct Reg<half_t> {
  using D = hn::Rebind<hwy::float16_t, DF>;
  using TN = hwy::float16_t;
  static HWY_INLINE hn::Vec<D> Narrow(DF, VF v) { return hn::DemoteTo(D(), v); }
  static HWY_INLINE VF Widen(DF d, const half_t* HWY_RESTRICT p) {
    return hn::PromoteTo(d, hn::LoadU(D(), reinterpret_cast<const hwy::float16_t*>(p)));
  }
};
#endif

// Lanes(d) elements of T at p (any alignment), widened to fp32.
template <typename T>
HWY_INLINE VF LoadF(DF d, const T* HWY_RESTRICT p) {
  if constexpr (InRegister<T>::value) {
    return Reg<T>::Widen(d, p);
  } else {
    HWY_ALIGN float buf[kMaxFloatLanes];
    for (size_t i = 0; i < hn::Lanes(d); ++i) buf[i] = to_f32(p[i]);
    return hn::Load(d, buf);
  }
}

// v narrowed to T, stored at p (any alignment).
template <typename T>
HWY_INLINE void StoreF(DF d, VF v, T* HWY_RESTRICT p) {
  if constexpr (InRegister<T>::value) {
    using R = Reg<T>;
    hn::StoreU(R::Narrow(d, v), typename R::D(), reinterpret_cast<typename R::TN*>(p));
  } else {
    HWY_ALIGN float buf[kMaxFloatLanes];
    hn::Store(v, d, buf);
    for (size_t i = 0; i < hn::Lanes(d); ++i) p[i] = from_f32<T>(buf[i]);
  }
}

// The first n < Lanes(d) elements of T at p, widened, the other lanes +0 (row tails).
template <typename T>
HWY_INLINE VF LoadFN(DF d, const T* HWY_RESTRICT p, size_t n) {
  HWY_ALIGN T buf[kMaxFloatLanes] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return LoadF(d, buf);
}

// The first n < Lanes(d) lanes of v narrowed to T, stored at p (the bits of StoreF).
template <typename T>
HWY_INLINE void StoreFN(DF d, VF v, T* HWY_RESTRICT p, size_t n) {
  HWY_ALIGN T buf[kMaxFloatLanes];
  StoreF(d, v, buf);
  std::memcpy(p, buf, n * sizeof(T));
}

// Non-temporal stores, for kernel outputs that are not read again soon (no read-for-ownership
// of the destination lines). They exist where the narrowed vector of T is a whole register
// (Highway's Stream writes a whole register on x86): fp32 everywhere, the 16-bit types on x86
// from AVX2 up (16 or 32 bytes). Elsewhere StreamAligned is false and StreamF is StoreF. p must
// be aligned to Lanes(d) * sizeof(T) (kStreamAlign<T>). Call hwy::FlushStream() before the data
// is handed to another thread.
template <typename T>
constexpr bool kStreams =
    InRegister<T>::value && (std::is_same_v<T, float> || MOEGRAD_SIMD_F16C != 0);
template <typename T>
constexpr size_t kStreamAlign = sizeof(T) * hn::MaxLanes(DF());
template <typename T>
HWY_INLINE bool StreamAligned(const T* p) {
  return kStreams<T> && reinterpret_cast<uintptr_t>(p) % kStreamAlign<T> == 0;
}
template <typename T>
HWY_INLINE void StreamF(DF d, VF v, T* HWY_RESTRICT p) {
  if constexpr (kStreams<T>) {
    using R = Reg<T>;
    hn::Stream(R::Narrow(d, v), typename R::D(), reinterpret_cast<typename R::TN*>(p));
  } else {
    StoreF(d, v, p);
  }
}

// Whether T's output pairs go through one VCVTNE2PS2BF16 (bf16 on AVX-512 where CPUID reports
// AVX512-BF16, Bf16x2 below); kernels read it once per call, not per vector.
template <typename T>
HWY_INLINE bool UseBf16x2() {
#if MOEGRAD_SIMD_AVX512
  if constexpr (std::is_same_v<T, bf16_t>) {
    return simd_detail::use_avx512bf16.load(std::memory_order_relaxed);
  }
#endif
  return false;
}

#if MOEGRAD_SIMD_AVX512
// v0 and v1 narrowed to bf16 by one VCVTNE2PS2BF16 into r (v0's lanes in the low half, v1's in
// the high half; AVX512-BF16: only where simd_detail::use_avx512bf16). False, with r unset,
// when a lane of either is denormal: the rule of Bf16Bits (the instruction flushes those).
HWY_INLINE bool Bf16x2(VF v0, VF v1, __m512i& r) {
  // 0x20: denormal; KORTESTW tests both masks at once (an OR of the masks in general registers
  // took four instructions per pair).
  if (!_kortestz_mask16_u8(_mm512_fpclass_ps_mask(v0.raw, 0x20),
                           _mm512_fpclass_ps_mask(v1.raw, 0x20))) {
    return false;
  }
  asm("vcvtne2ps2bf16 {%2, %1, %0|%0, %1, %2}" : "=v"(r) : "v"(v1.raw), "v"(v0.raw));
  return true;
}
#endif

// Whether rows at p can be written with StreamF2 for their pairs of whole vectors.
template <typename T>
HWY_INLINE bool Stream2Aligned(const T* p) {
  return StreamAligned(p) && reinterpret_cast<uintptr_t>(p) % (2 * kStreamAlign<T>) == 0;
}

// Two vectors narrowed to T, written with one full-width non-temporal store (whole cache lines
// for the 16-bit types on AVX-512); p must satisfy Stream2Aligned. fp32 (whose vectors are
// whole registers already) takes two StreamF.
template <typename T>
HWY_INLINE void StreamF2(DF d, VF v0, VF v1, T* HWY_RESTRICT p) {
#if HWY_TARGET == HWY_SCALAR
  constexpr bool kSplit = true;
#else
  constexpr bool kSplit = std::is_same_v<T, float> || !kStreams<T>;
#endif
  if constexpr (kSplit) {
    StreamF(d, v0, p);
    StreamF(d, v1, p + hn::Lanes(d));
  } else {
#if MOEGRAD_SIMD_AVX512
    if constexpr (std::is_same_v<T, bf16_t>) {
      // Both vectors in one VCVTNE2PS2BF16 when no lane of either is denormal.
      __m512i r;
      if (simd_detail::use_avx512bf16.load(std::memory_order_relaxed) && Bf16x2(v0, v1, r)) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(p), r);
        return;
      }
    }
#endif
#if HWY_TARGET != HWY_SCALAR
    using R = Reg<T>;
    const hn::RebindToUnsigned<typename R::D> dh;  // uint16 lanes, half a vector
    const hn::Twice<decltype(dh)> dw;
    const auto lo = hn::BitCast(dh, R::Narrow(d, v0));
    const auto hi = hn::BitCast(dh, R::Narrow(d, v1));
    hn::Stream(hn::Combine(dw, hi, lo), dw, reinterpret_cast<uint16_t*>(p));
#endif
  }
}

// U consecutive vectors v[0..U) at p: with stream2 (Stream2Aligned(p), U even) pairs of them
// in one full-width non-temporal store each, else with stream (StreamAligned(p)) one
// non-temporal store each, else plain stores. The same bits on every path.
template <size_t U, typename T>
HWY_INLINE void StoreBlock(DF d, const VF* v, T* HWY_RESTRICT p, bool stream, bool stream2) {
  const size_t L = hn::Lanes(d);
  if constexpr (U % 2 == 0) {
    if (stream2) {
      for (size_t u = 0; u < U; u += 2) StreamF2(d, v[u], v[u + 1], p + u * L);
      return;
    }
  }
  for (size_t u = 0; u < U; ++u) {
    if (stream) {
      StreamF(d, v[u], p + u * L);
    } else {
      StoreF(d, v[u], p + u * L);
    }
  }
}

// Widening / narrowing of one chunk: whole vectors in registers where InRegister<T>, the rest
// (and every element of the other types) with the scalar conversions of core/dtype.h.
template <typename T>
HWY_INLINE void load_chunk(const T* HWY_RESTRICT src, float* HWY_RESTRICT dst, size_t n) {
  size_t i = 0;
  if constexpr (InRegister<T>::value) {
    const DF d;
    const size_t N = hn::Lanes(d);
    for (; i + N <= n; i += N) hn::StoreU(LoadF(d, src + i), d, dst + i);
  }
  for (; i < n; ++i) dst[i] = to_f32(src[i]);
}
template <typename T>
HWY_INLINE void store_chunk(const float* HWY_RESTRICT src, T* HWY_RESTRICT dst, size_t n) {
  size_t i = 0;
  if constexpr (InRegister<T>::value) {
    const DF d;
    const size_t N = hn::Lanes(d);
    for (; i + N <= n; i += N) StoreF(d, hn::LoadU(d, src + i), dst + i);
  }
  for (; i < n; ++i) dst[i] = from_f32<T>(src[i]);
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

// exp(x) for x in [-104, 89] (the callers clamp; NaN passes the clamps on x86 and is blended
// back by the callers anyway): n = round(x / ln 2) by the 1.5 * 2^23 trick, r = x - n ln 2 in
// two FMA steps (Cody-Waite), e^r by a degree-6 polynomial in Horner form (fitted here for
// relative error on |r| <= ln2 / 2: 2e-9 before float rounding), times 2^n: VSCALEFPS on AVX-512 (one rounding,
// denormal results included), elsewhere two exact power-of-two multiplies (the second one rounds). Max error measured over
// the whole float range: docs/decisions.md L71.
// With kShort (the sigmoid of the 16-bit kernels, L96): a degree-5 polynomial (fitted the same
// way: 1.05e-7 before float rounding) and, on targets with FMA, r = x - n ln 2 in one FMA step
// (n ln 2 is not rounded; ln 2's own rounding adds n * 1.9e-9): two FMAs fewer.
template <bool kShort = false>
HWY_INLINE VF ExpClamped(DF d, VF x) {
  const VF magic = hn::Set(d, 12582912.0f);  // 1.5 * 2^23
  const VF k = hn::MulAdd(x, hn::Set(d, 1.44269504088896341f), magic);
  const VF n = hn::Sub(k, magic);
  VF p;
  if constexpr (kShort) {
#if HWY_NATIVE_FMA
    const VF r = hn::MulAdd(n, hn::Set(d, -0.693147182464599609375f), x);
#else  // without FMA the product would round before the subtraction: keep both steps
    VF r = hn::MulAdd(n, hn::Set(d, -0.693145751953125f), x);
    r = hn::MulAdd(n, hn::Set(d, -1.428606765330187045e-6f), r);
#endif
    VF u = hn::Set(d, 0.008312526158988476f);
    u = hn::MulAdd(u, r, hn::Set(d, 0.041890114545822144f));
    u = hn::MulAdd(u, r, hn::Set(d, 0.16667114198207855f));
    u = hn::MulAdd(u, r, hn::Set(d, 0.499992311000824f));
    u = hn::MulAdd(u, r, hn::Set(d, 1.0f));
    p = hn::MulAdd(u, r, hn::Set(d, 1.0f));
  } else {
    VF r = hn::MulAdd(n, hn::Set(d, -0.693145751953125f), x);
    r = hn::MulAdd(n, hn::Set(d, -1.428606765330187045e-6f), r);
    VF u = hn::Set(d, 0.0013843848137184978f);
    u = hn::MulAdd(u, r, hn::Set(d, 0.0083741694688797f));
    u = hn::MulAdd(u, r, hn::Set(d, 0.04166799783706665f));
    u = hn::MulAdd(u, r, hn::Set(d, 0.16666431725025177f));
    u = hn::MulAdd(u, r, hn::Set(d, 0.4999999403953552f));
    u = hn::MulAdd(u, r, hn::Set(d, 1.0f));
    p = hn::MulAdd(u, r, hn::Set(d, 1.0f));
  }
#if MOEGRAD_SIMD_AVX512
  return VF{_mm512_scalef_ps(p.raw, n.raw)};
#else
  const hn::RebindToSigned<DF> di;
  const auto ni = hn::Sub(hn::BitCast(di, k), hn::BitCast(di, magic));  // n as int32
  const auto h = hn::ShiftRight<1>(ni);
  const auto bias = hn::Set(di, 127);
  const VF s1 = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(h, bias)));
  const VF s2 = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(hn::Sub(ni, h), bias)));
  return hn::Mul(hn::Mul(p, s1), s2);
#endif
}

// exp(x), NaN-propagating: 0 below -104 (the true value rounds to 0 below about -103.97), inf
// above 89 (overflow from about 88.72).
HWY_INLINE VF ExpNaN(DF d, VF x) {
  const VF xc = hn::Min(hn::Set(d, 89.0f), hn::Max(hn::Set(d, -104.0f), x));
  return hn::IfThenElse(hn::IsNaN(x), x, ExpClamped(d, xc));
}

// Stable logistic function: exp of a non-positive argument only, so no overflow; exact 0/1 at
// the extremes; NaN propagates (the input's own bits). On AVX-512 the division is VRCP14PS and one Newton step (error
// well under an ulp of the quotient); elsewhere a division. kShort: the shorter exp (L96).
template <bool kShort = false>
HWY_INLINE VF SigmoidT(DF d, VF x) {
  const VF one = hn::Set(d, 1.0f);
  const VF t = hn::Max(hn::Set(d, -104.0f), hn::Neg(hn::Abs(x)));
  const VF e = ExpClamped<kShort>(d, t);
  const VF den = hn::Add(one, e);
  const VF num = hn::IfThenElse(hn::Ge(x, hn::Zero(d)), one, e);
#if MOEGRAD_SIMD_AVX512
  const VF y0 = hn::ApproximateReciprocal(den);
  const VF q0 = hn::Mul(num, y0);
  const VF q = hn::MulAdd(q0, hn::NegMulAdd(den, y0, one), q0);
#else
  const VF q = hn::Div(num, den);
#endif
  // NaN in, the same NaN out: the callers' products then give the same NaN bits whatever the
  // operand order the compiler picks (the streamed and plain-store loops must agree bitwise).
  return hn::IfThenElse(hn::IsNaN(x), x, q);
}
// The fp32 sigmoid (L71) and the one of the kernels with bf16/fp16 outputs (L96: an error of a
// few fp32 ulps more, far below their rounding).
HWY_INLINE VF Sigmoid(DF d, VF x) { return SigmoidT<false>(d, x); }
HWY_INLINE VF Sigmoid16(DF d, VF x) { return SigmoidT<true>(d, x); }

// p * sigmoid(x) for the SwiGLU forward with bf16/fp16 data, which calls it with p = x for
// silu(x) (docs/decisions.md L105). On AVX-512, 13 instructions: e = exp(-|x|) (|x| clamped at
// 104; x's NaN comes through p) from m = round(-|x| / ln 2) to a multiple of 1/32 (the
// 1.5 * 2^18 trick), r = -|x| - m ln 2 in one FMA (|r| <= ln 2 / 64), 2^(m - floor(m)) from a
// 32-entry table (VPERMT2PS on the low 5 bits of the rounded sum), e^r by 1 + c1 r + c2 r^2
// (fitted here for relative error on that range: 5.3e-8 before float rounding), times
// 2^floor(m) with VSCALEFPS (denormal results included); then p / (1 + e) for x >= 0 and
// p e / (1 + e) for x < 0 (sign bit, so -0 too), one correctly rounded division (VDIVPS: faster
// here than VRCP14PS with its Newton step, which is needed: the 2^-14 error of VRCP14PS alone
// takes results across the output rounding, outside the tolerances). Elsewhere
// p * Sigmoid16(x).
#if MOEGRAD_SIMD_AVX512
alignas(64) inline constexpr float kExp2Frac32[32] = {  // 2^(j / 32), rounded to fp32
    1.0f,        1.0218972f,  1.04427373f, 1.06714046f, 1.09050775f, 1.1143868f,  1.13878858f,
    1.1637249f,  1.18920708f, 1.21524739f, 1.24185777f, 1.26905096f, 1.29683959f, 1.32523668f,
    1.35425556f, 1.38390994f, 1.41421354f, 1.44518077f, 1.47682619f, 1.50916445f, 1.54221082f,
    1.5759809f,  1.61049032f, 1.64575553f, 1.68179286f, 1.71861935f, 1.75625217f, 1.79470909f,
    1.8340081f,  1.87416768f, 1.91520655f, 1.95714414f};
#endif
#if MOEGRAD_SIMD_AVX512
// exp(-min(|x|, 104)) by the table method above (9 instructions).
HWY_INLINE __m512 ExpNegAbs16(__m512 x) {
  // -min(|x|, 104) in one VRANGEPS (imm 0x0e: smaller magnitude, sign bit set). A quiet NaN x
  // gives -104; a signalling one its quiet NaN, the one p carries (every NaN of the chain then
  // has those bits, whatever the operand order).
  const __m512 t = _mm512_range_ps(x, _mm512_set1_ps(104.0f), 0x0e);
  const __m512 magic = _mm512_set1_ps(393216.0f);  // 1.5 * 2^18: sums have an ulp of 1/32
  const __m512 k = _mm512_fmadd_ps(t, _mm512_set1_ps(1.44269504088896341f), magic);
  const __m512 m = _mm512_sub_ps(k, magic);
  const __m512 r = _mm512_fmadd_ps(m, _mm512_set1_ps(-0.693147182464599609375f), t);
  const __m512 tab = _mm512_permutex2var_ps(_mm512_load_ps(kExp2Frac32), _mm512_castps_si512(k),
                                            _mm512_load_ps(kExp2Frac32 + 16));
  const __m512 u = _mm512_fmadd_ps(_mm512_set1_ps(0.4999999701976776f), r,
                                   _mm512_set1_ps(1.0000146627426147f));
  return _mm512_scalef_ps(_mm512_fmadd_ps(_mm512_mul_ps(tab, r), u, tab), m);
}
#endif

HWY_INLINE VF MulSigmoid16(DF d, VF x, VF p) {
#if MOEGRAD_SIMD_AVX512
  (void)d;
  const __m512 e = ExpNegAbs16(x.raw);
  const __mmask16 neg = _mm512_movepi32_mask(_mm512_castps_si512(x.raw));
  const __m512 num = _mm512_mask_mul_ps(p.raw, neg, p.raw, e);
  return VF{_mm512_div_ps(num, _mm512_add_ps(e, _mm512_set1_ps(1.0f)))};
#else
  return hn::Mul(p, Sigmoid16(d, x));
#endif
}

// sigmoid(x) for the 16-bit backward kernels (docs/decisions.md L217). On AVX-512, 12
// instructions: exp(-|x|) as in MulSigmoid16 (relative error 5.3e-8 before rounding, below the
// 1.05e-7 of L96's polynomial), then 1 / (1 + e) or e / (1 + e) by the sign bit, one correctly
// rounded division. A NaN x gives a finite value here: the callers' masks and products carry
// x's NaN (every caller multiplies by x or a value derived from it). Elsewhere Sigmoid16.
HWY_INLINE VF SigmoidGrad16(DF d, VF x) {
#if MOEGRAD_SIMD_AVX512
  (void)d;
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = ExpNegAbs16(x.raw);
  const __mmask16 neg = _mm512_movepi32_mask(_mm512_castps_si512(x.raw));
  const __m512 num = _mm512_mask_mov_ps(one, neg, e);
  return VF{_mm512_div_ps(num, _mm512_add_ps(e, one))};
#else
  return Sigmoid16(d, x);
#endif
}

// sqrt(log(1 + exp(x))) without overflow: exp of -|x| (clamped at -104, below which it is 0)
// with the exp of L71.
HWY_INLINE VF SqrtSoftplus(DF d, VF x) {
  const VF e = ExpClamped(d, hn::Max(hn::Set(d, -104.0f), hn::Neg(hn::Abs(x))));
  const VF sp = hn::Add(hn::Max(x, hn::Zero(d)), hn::Log1p(d, e));
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
