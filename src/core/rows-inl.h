// Per-target helpers of the gather/scatter row kernels (finalize routing, init routing grad,
// gating backward): whole-vector loads and stores of any element type widened to / narrowed
// from fp32 in registers, their non-temporal and partial (row tail) forms, and a dot product
// with a fixed summation order. Included after core/simd-inl.h, once per Highway target.
//
// Conversions: those of core/simd-inl.h (LoadF, Bf16Bits; fp16 with F16C, exact widening and
// round-to-nearest-even narrowing like the scalar conversions of core/convert.h, on x86 targets
// that have it); elsewhere fp16 goes through the scalar conversions one vector at a time.
#if defined(MOEGRAD_CORE_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOEGRAD_CORE_ROWS_INL_H_
#undef MOEGRAD_CORE_ROWS_INL_H_
#else
#define MOEGRAD_CORE_ROWS_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/dtype.h"
#include "core/parallel.h"
#include "core/simd-inl.h"
#include "hwy/cache_control.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {
namespace rows {
namespace hn = hwy::HWY_NAMESPACE;

#undef MOEGRAD_ROWS_F16C
#define MOEGRAD_ROWS_F16C MOEGRAD_SIMD_F16C  // fp16 in registers (core/simd-inl.h)

// Lanes(d) elements of T at p (any alignment), widened to fp32: LoadF of core/simd-inl.h where
// the conversion is in registers on this target, else the scalar conversions.
template <typename T>
HWY_INLINE VF LoadWide(DF d, const T* HWY_RESTRICT p) {
  if constexpr (InRegister<T>::value) {
    return LoadF(d, p);
  } else {
    HWY_ALIGN float buf[kMaxFloatLanes];
    for (size_t i = 0; i < hn::Lanes(d); ++i) buf[i] = to_f32(p[i]);
    return hn::Load(d, buf);
  }
}

// The narrowed vector of T (T = float: v itself), and its tag.
template <typename T>
struct Narrow;
template <>
struct Narrow<float> {
  using D = DF;
  static HWY_INLINE VF Of(DF, VF v) { return v; }
};
template <>
struct Narrow<bf16_t> {
  using D = hn::Rebind<uint16_t, DF>;
  // Round to nearest even, NaN quieted: the bits of StoreF (Bf16Bits of core/simd-inl.h).
  static HWY_INLINE hn::Vec<D> Of(DF d, VF v) { return Bf16Bits(d, v); }
};
#if MOEGRAD_ROWS_F16C
template <>
struct Narrow<half_t> {
  using D = hn::Rebind<hwy::float16_t, DF>;
  static HWY_INLINE hn::Vec<D> Of(DF, VF v) { return hn::DemoteTo(D(), v); }
};
#endif

// Whole vectors of T are narrowed in registers (otherwise: per element, see StoreN).
template <typename T>
constexpr bool kVecNarrow = !std::is_same_v<T, half_t> || MOEGRAD_ROWS_F16C;

// Stores v narrowed to T at p (any alignment).
template <typename T>
HWY_INLINE void StoreNarrow(DF d, VF v, T* HWY_RESTRICT p) {
  if constexpr (kVecNarrow<T>) {
    using N = Narrow<T>;
    using TN = hn::TFromD<typename N::D>;
    hn::StoreU(N::Of(d, v), typename N::D(), reinterpret_cast<TN*>(p));
  } else {
    HWY_ALIGN float buf[kMaxFloatLanes];
    hn::Store(v, d, buf);
    for (size_t i = 0; i < hn::Lanes(d); ++i) p[i] = from_f32<T>(buf[i]);
  }
}

// Like Store with a non-temporal store; p must be aligned to the narrowed vector (see
// StreamAligned). Call hwy::FlushStream() before another thread reads the data.
template <typename T>
HWY_INLINE void StreamNarrow(DF d, VF v, T* HWY_RESTRICT p) {
  if constexpr (kVecNarrow<T>) {
    using N = Narrow<T>;
    using TN = hn::TFromD<typename N::D>;
    hn::Stream(N::Of(d, v), typename N::D(), reinterpret_cast<TN*>(p));
  } else {
    StoreNarrow(d, v, p);
  }
}

// Whether a row of n elements of T at p can be written with Stream for its whole vectors.
template <typename T>
HWY_INLINE bool StreamAligned(DF d, const T* p) {
  const size_t vbytes = hn::Lanes(d) * sizeof(T);
  return kVecNarrow<T> && reinterpret_cast<uintptr_t>(p) % vbytes == 0;
}

// Two vectors narrowed to T, written with one full-width non-temporal store (whole cache lines
// for the 16-bit types on AVX-512); p must be aligned to 2 * Lanes(d) * sizeof(T) bytes.
template <typename T>
HWY_INLINE void StreamNarrow2(DF d, VF v0, VF v1, T* HWY_RESTRICT p) {
#if HWY_TARGET == HWY_SCALAR
  constexpr bool kSplit = true;
#else
  constexpr bool kSplit = std::is_same_v<T, float> || !kVecNarrow<T>;
#endif
  if constexpr (kSplit) {
    StreamNarrow(d, v0, p);
    StreamNarrow(d, v1, p + hn::Lanes(d));
  } else {
#if HWY_TARGET != HWY_SCALAR
    using N = Narrow<T>;
    const hn::RebindToUnsigned<typename N::D> dh;  // uint16 lanes, half a vector
    const hn::Twice<decltype(dh)> dw;
    const auto lo = hn::BitCast(dh, N::Of(d, v0));
    const auto hi = hn::BitCast(dh, N::Of(d, v1));
    hn::Stream(hn::Combine(dw, hi, lo), dw, reinterpret_cast<uint16_t*>(p));
#endif
  }
}

// Whether rows at p can be written with StreamNarrow2 for their pairs of whole vectors.
template <typename T>
HWY_INLINE bool Stream2Aligned(DF d, const T* p) {
  return StreamAligned(d, p) && reinterpret_cast<uintptr_t>(p) % (2 * hn::Lanes(d) * sizeof(T)) == 0;
}

// The first n < Lanes(d) elements of T at p, widened, the other lanes +0 (row tails).
template <typename T>
HWY_INLINE VF LoadWideN(DF d, const T* HWY_RESTRICT p, size_t n) {
  HWY_ALIGN T buf[kMaxFloatLanes] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return LoadWide(d, buf);
}

// Stores the first n < Lanes(d) lanes of v narrowed to T (the same bits as Store).
template <typename T>
HWY_INLINE void StoreNarrowN(DF d, VF v, T* HWY_RESTRICT p, size_t n) {
  HWY_ALIGN T buf[kMaxFloatLanes];
  StoreNarrow(d, v, buf);
  std::memcpy(p, buf, n * sizeof(T));
}

// n elements of T at p set to +0 (all bits zero), non-temporal stores for the whole aligned
// vectors. Call hwy::FlushStream() before another thread reads the data.
template <typename T>
HWY_INLINE void ZeroRow(DF /*d*/, T* HWY_RESTRICT p, size_t n) {
  const hn::ScalableTag<uint8_t> du8;
  const size_t v = hn::Lanes(du8);
  unsigned char* q = reinterpret_cast<unsigned char*>(p);
  const size_t bytes = n * sizeof(T);
  size_t head = (v - reinterpret_cast<uintptr_t>(q) % v) % v;
  if (head > bytes) head = bytes;
  std::memset(q, 0, head);
  size_t i = head;
  for (; i + v <= bytes; i += v) hn::Stream(hn::Zero(du8), du8, q + i);
  std::memset(q + i, 0, bytes - i);
}

// Prefetch distance of the gathered rows, in bytes ahead of the current read position. Measured
// on the development machine (Zen, DeepSeek-V3 and GPT-OSS rows, 1 thread): the kernels that
// read the K rows of a token at once (finalize forward, init routing grad) are flat between
// 1.5 and 4 KB and slower at 1 KB; the finalize grad, which reads one row at a time, gains
// 15-20 % from 2 KB to 4 KB.
constexpr size_t kPrefetchBytes = 2048;      // K read streams at once
constexpr size_t kPrefetchOneStream = 4096;  // one read stream

// A read stream over gathered rows that prefetches kAhead bytes ahead and, near the end of the
// current row, the start of the row that comes next (the next token's row of the same slot, or
// the next slot's row), so the stream does not stall at every random row start.
template <size_t kAhead = kPrefetchBytes>
HWY_INLINE void PrefetchAhead(const void* row, const void* next, size_t row_bytes, size_t at) {
  const size_t ahead = at + kAhead;
  if (ahead < row_bytes) {
    hwy::Prefetch(static_cast<const unsigned char*>(row) + ahead);
  } else if (next != nullptr && ahead - row_bytes < row_bytes) {
    hwy::Prefetch(static_cast<const unsigned char*>(next) + (ahead - row_bytes));
  }
}

// Fixed-order dot products: 64 partial sums (element i goes to partial sum i mod 64), summed
// by a fixed pairwise tree. The order is the same on every SIMD target (64 lanes = 4 AVX-512,
// 8 AVX2 or 16 SSE4 vectors) and for any thread count (D16).
constexpr size_t kDotLanes = 64;

struct Dot {
  HWY_ALIGN float part[kDotLanes];
  HWY_INLINE Dot() {
    for (size_t i = 0; i < kDotLanes; ++i) part[i] = 0.0f;
  }
  // part[off .. off + Lanes) += a * b; off = the element's position mod 64 (a vector multiple).
  HWY_INLINE void Add(DF d, size_t off, VF a, VF b) {
    hn::Store(hn::Add(hn::Load(d, part + off), hn::Mul(a, b)), d, part + off);
  }
  HWY_INLINE float Sum() {
    for (size_t w = kDotLanes / 2; w >= 1; w /= 2) {
      for (size_t i = 0; i < w; ++i) part[i] = part[i] + part[i + w];
    }
    return part[0];
  }
};

}  // namespace rows
}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#endif  // MOEGRAD_CORE_ROWS_INL_H_
