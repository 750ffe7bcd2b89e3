// Per-target helpers of the gather/scatter row kernels (finalize routing, init routing, gating
// backward): the output row walker, row copies and zero rows with non-temporal stores, the
// prefetch of gathered rows and a dot product with a fixed summation order. The loads, stores
// and conversions they use are the one family of core/simd-inl.h (LoadF, StoreF, StreamF, ...).
// Included after core/simd-inl.h, once per Highway target.
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

// Writes the output row o[0..H) of T column block by column block: block(U, kTail, j, n, acc)
// (U a std::integral_constant<size_t>, kTail a std::bool_constant) fills acc[0..U) with the
// fp32 vectors of the columns [j, j + U * Lanes(d)), or, with kTail, acc[0] with the n < Lanes
// columns of the row tail; blocks of 4 vectors, then single vectors, then the tail, each
// stored once (StoreBlock, StoreFN). With nt (an output large enough for non-temporal stores,
// core/parallel.h stream_output) whole vectors are streamed where the row is aligned for it;
// every path gives the same bits.
template <typename T, class Block>
HWY_INLINE void WriteRow(DF d, T* HWY_RESTRICT o, size_t H, bool nt, Block&& block) {
  const size_t L = hn::Lanes(d);
  const bool stream = nt && StreamAligned(o);
  const bool stream2 = nt && Stream2Aligned(o);
  VF acc[4];
  size_t j = 0;
  for (; j + 4 * L <= H; j += 4 * L) {
    block(std::integral_constant<size_t, 4>(), std::false_type(), j, size_t{0}, acc);
    StoreBlock<4>(d, acc, o + j, stream, stream2);
  }
  for (; j + L <= H; j += L) {
    block(std::integral_constant<size_t, 1>(), std::false_type(), j, size_t{0}, acc);
    StoreBlock<1>(d, acc, o + j, stream, stream2);
  }
  if (j < H) {
    block(std::integral_constant<size_t, 1>(), std::true_type(), j, H - j, acc);
    StoreFN(d, acc[0], o + j, H - j);
  }
}

// `bytes` bytes from src (null: +0, all bits zero) to dst. With nt, the whole aligned vectors
// go out with non-temporal stores (no read-for-ownership of the destination lines) and the
// ragged ends with memcpy / memset; without, memcpy / memset. Call hwy::FlushStream() before
// another thread reads the data.
HWY_INLINE void StreamBytes(const void* HWY_RESTRICT src, void* HWY_RESTRICT dst, size_t bytes,
                            bool nt) {
  const unsigned char* from = static_cast<const unsigned char*>(src);
  unsigned char* to = static_cast<unsigned char*>(dst);
  if (!nt) {
    if (from) {
      std::memcpy(to, from, bytes);
    } else {
      std::memset(to, 0, bytes);
    }
    return;
  }
  const hn::ScalableTag<uint8_t> du8;
  const size_t v = hn::Lanes(du8);
  size_t head = (v - reinterpret_cast<uintptr_t>(to) % v) % v;
  if (head > bytes) head = bytes;
  size_t i = head;
  if (from) {
    std::memcpy(to, from, head);
    for (; i + v <= bytes; i += v) hn::Stream(hn::LoadU(du8, from + i), du8, to + i);
    std::memcpy(to + i, from + i, bytes - i);
  } else {
    std::memset(to, 0, head);
    const auto z = hn::Zero(du8);
    for (; i + v <= bytes; i += v) hn::Stream(z, du8, to + i);
    std::memset(to + i, 0, bytes - i);
  }
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
