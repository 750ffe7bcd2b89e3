// CPU kernels of SwiGLU forward (§6.4 without quantisation) and backward (§5.5), compiled once
// per SIMD target (Highway) and dispatched at run time. Rows split across threads; each row in
// chunks widened to fp32 in L1 scratch; rows past the group_index total are zero-filled. The
// scratch is a fixed 32 KB (forward) / 48 KB (backward) per thread, so it lives on the stack and
// the ops need no workspace (C callers may pass none, as its size is then 0).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/swiglu/swiglu_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cstring>

#include "core/dtype.h"
#include "core/host.h"
#include "core/parallel.h"
#include "core/simd-inl.h"
#include "hwy/highway.h"
#include "ops/swiglu/swiglu-inl.h"
#include "ops/swiglu/swiglu.h"

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {
namespace {

// grad_weight = sum of grad_y(h) * y_origin(h) in a fixed order (docs/decisions.md L95): 64
// partial sums (element h goes to partial sum h mod 64, added in column order, one fused
// multiply-add per element where the target has FMA), then a fixed pairwise tree (partial i +
// partial i + 32, then i + 16, ...). The order is the same on every SIMD target (64 lanes = 4
// AVX-512, 8 AVX2 or 16 SSE4 vectors) and for any thread count (D16); the 64 partial sums are
// independent register chains, so the loop is not bound by the latency of one chain.
constexpr size_t kGwLanes = 64;

// The end of the sum: part[] holds the partial sums of the first i elements (i a multiple of
// 64); the rest one lane at a time, with the same fused multiply-add semantics as the vectors
// (hn::MulAdd on one-lane vectors), then the tree.
template <typename T>
HWY_INLINE float GradWeightFinish(float* HWY_RESTRICT part, int64_t i, int64_t n,
                                  const T* HWY_RESTRICT a, const T* HWY_RESTRICT b) {
  const hn::CappedTag<float, 1> d1;
  for (size_t l = static_cast<size_t>(i) % kGwLanes; i < n; ++i, l = (l + 1) % kGwLanes) {
    const auto pa = hn::Set(d1, to_f32(a[i])), pb = hn::Set(d1, to_f32(b[i]));
    part[l] = hn::GetLane(hn::MulAdd(pa, pb, hn::Set(d1, part[l])));
  }
  for (size_t w = kGwLanes / 2; w >= 1; w /= 2) {
    for (size_t l = 0; l < w; ++l) part[l] = part[l] + part[l + w];
  }
  return part[0];
}

// Vectors per block of 64 partial sums, and whether the vector blocks apply on this target
// (whole vectors of an in-register type; every x86 target).
constexpr size_t kGwVecs =
    kGwLanes / hn::MaxLanes(DF()) > 0 ? kGwLanes / hn::MaxLanes(DF()) : 1;
template <typename T>
HWY_INLINE bool GwBlocks() {
  if constexpr (InRegister<T>::value && kGwLanes % hn::MaxLanes(DF()) == 0) {
    return hn::Lanes(DF()) * kGwVecs == kGwLanes;
  }
  return false;
}

template <typename T>
HWY_INLINE float GradWeightDot(int64_t n, const T* HWY_RESTRICT a, const T* HWY_RESTRICT b) {
  HWY_ALIGN float part[kGwLanes];
  int64_t i = 0;
  const DF d;
  const size_t N = hn::Lanes(d);
  if (GwBlocks<T>()) {
    VF acc[kGwVecs];
    for (size_t k = 0; k < kGwVecs; ++k) acc[k] = hn::Zero(d);
    for (; i + static_cast<int64_t>(kGwLanes) <= n; i += kGwLanes) {
      for (size_t k = 0; k < kGwVecs; ++k) {
        acc[k] = hn::MulAdd(LoadF(d, a + i + k * N), LoadF(d, b + i + k * N), acc[k]);
      }
    }
    for (size_t k = 0; k < kGwVecs; ++k) hn::Store(acc[k], d, part + k * N);
  } else {
    for (size_t l = 0; l < kGwLanes; ++l) part[l] = 0.0f;
  }
  return GradWeightFinish(part, i, n, a, b);
}

// Software prefetch of the forward's two input streams (gate x0 and up x1 = x0 + H of row t),
// kPrefetchAhead bytes ahead of the column being read, one PREFETCHT0 per stream and 64 bytes
// (L107). Near the row end the targets continue into the next row's same half (x0 + 2H and
// x1 + 2H), so that each row starts with both streams already in flight (L123):
// PrefetchSameRow gives the bases for the columns h < H - ahead (PrefetchSplit), PrefetchNextRow
// those of the rest. Past the tensor's end (the last rows) prefetches do not fault.
constexpr size_t kPrefetchAhead = 2048;

template <typename T>
struct PrefetchPair {
  const char* a;  // prefetch address of column 0 for the gate stream
  const char* b;  // for the up stream
  HWY_INLINE void At(int64_t h) const {
    hwy::Prefetch(a + h * static_cast<int64_t>(sizeof(T)));
    hwy::Prefetch(b + h * static_cast<int64_t>(sizeof(T)));
  }
};
template <typename T>
HWY_INLINE PrefetchPair<T> PrefetchSameRow(const T* x0, const T* x1) {
  return {reinterpret_cast<const char*>(x0) + kPrefetchAhead,
          reinterpret_cast<const char*>(x1) + kPrefetchAhead};
}
template <typename T>
HWY_INLINE PrefetchPair<T> PrefetchNextRow(const T* x1, int64_t H) {
  // Column h + ahead of gate (x0 + 2H) and up (x1 + 2H) of the next row is at x1 + h + ahead
  // and x1 + H + h + ahead (ahead counted from h past H).
  return {reinterpret_cast<const char*>(x1) + kPrefetchAhead,
          reinterpret_cast<const char*>(x1 + H) + kPrefetchAhead};
}
// The first column whose prefetch target lies in the next row, rounded down to a multiple of
// `step` (whole iterations).
template <typename T>
HWY_INLINE int64_t PrefetchSplit(int64_t H, int64_t step) {
  const int64_t ahead = static_cast<int64_t>(kPrefetchAhead / sizeof(T));
  const int64_t s = std::max<int64_t>(0, H - ahead);
  return s / step * step;
}

// Two vectors of outputs at p (row pairs of the 16-bit forward): with kNarrow2 (bf16 where
// AVX512-BF16 is used) one VCVTNE2PS2BF16 and one 64-byte store (L106), else and for a pair
// with a denormal lane the per-vector narrowing; non-temporal with kStream (Stream2Aligned).
template <bool kStream, bool kNarrow2, typename T>
HWY_INLINE void StorePair(DF d, VF v0, VF v1, T* HWY_RESTRICT p) {
#if MOEGRAD_SIMD_AVX512
  if constexpr (kNarrow2 && std::is_same_v<T, bf16_t>) {
    if (HWY_LIKELY(TryStoreBf16x2<kStream>(v0, v1, p))) return;
  }
#endif
  if constexpr (kStream) {
    StreamF2(d, v0, v1, p);
  } else {
    StoreF(d, v0, p);
    StoreF(d, v1, p + hn::Lanes(d));
  }
}

// For the lambdas of the row loops: called several times, a plain lambda may be compiled out of
// line (then every constant is reloaded per call).
#if defined(__GNUC__) || defined(__clang__)
#define MOEGRAD_LAMBDA_INLINE __attribute__((always_inline))
#else
#define MOEGRAD_LAMBDA_INLINE
#endif

// The forward value of one vector (bf16/fp16 data: the cheaper sigmoid, docs/decisions.md
// L96, L105).
template <typename T, bool kClamp>
HWY_INLINE VF ForwardValue(DF d, const SwigluClamp<kClamp>& clamp, VF a, VF b, VF w) {
  return SwigluValue<!std::is_same_v<T, float>>(d, clamp.gate(a), clamp.up(b), w);
}

// The whole vectors of one row straight from and to memory, from column h on; returns the
// first column left for the chunk path. 16-bit data (kPairs): quads of vectors (128 bytes of
// each input half and of the output) as two pairs, each stored by StorePair, then the last
// pair, if any; then single vectors. Both input streams are prefetched (L107, L123). All
// values by argument, so that the loop keeps them in registers (the non-temporal stores'
// vector types may alias anything a lambda would reach through its closure).
template <bool kPairs, bool kStream, bool kNarrow2, typename T, bool kClamp>
HWY_INLINE int64_t ForwardRowVectors(const T* HWY_RESTRICT x0, const T* HWY_RESTRICT x1,
                                     T* HWY_RESTRICT yr, int64_t H, VF w,
                                     const SwigluClamp<kClamp> clamp) {
  const DF d;
  const int64_t V = static_cast<int64_t>(hn::Lanes(d));
  int64_t h = 0;
  if constexpr (kPairs) {
    const int64_t P = 2 * V;  // one pair: 64 bytes on AVX-512
    auto pair = [&](int64_t c) MOEGRAD_LAMBDA_INLINE {
      StorePair<kStream, kNarrow2>(
          d, ForwardValue<T>(d, clamp, LoadF(d, x0 + c), LoadF(d, x1 + c), w),
          ForwardValue<T>(d, clamp, LoadF(d, x0 + c + V), LoadF(d, x1 + c + V), w), yr + c);
    };
    const int64_t H4 = H / (2 * P) * (2 * P);
    const int64_t split = std::min(H4, PrefetchSplit<T>(H, 2 * P));
    const PrefetchPair<T> same = PrefetchSameRow(x0, x1), next = PrefetchNextRow(x1, H);
    for (; h < split; h += 2 * P) {
      same.At(h);
      same.At(h + P);
      pair(h);
      pair(h + P);
    }
    for (; h < H4; h += 2 * P) {
      next.At(h);
      next.At(h + P);
      pair(h);
      pair(h + P);
    }
    for (; h + P <= H; h += P) pair(h);
  }
  auto one = [&](int64_t c) MOEGRAD_LAMBDA_INLINE {
    const VF v = ForwardValue<T>(d, clamp, LoadF(d, x0 + c), LoadF(d, x1 + c), w);
    if constexpr (kStream) {
      StreamF(d, v, yr + c);
    } else {
      StoreF(d, v, yr + c);
    }
  };
  const PrefetchPair<T> same = PrefetchSameRow(x0, x1), next = PrefetchNextRow(x1, H);
  if constexpr (!kPairs) {
    // Single vectors (fp32, or 16-bit rows not aligned for pairs): four per iteration.
    const int64_t H4 = H / (4 * V) * (4 * V);
    const int64_t split4 = std::min(H4, PrefetchSplit<T>(H, 4 * V));
    for (; h < split4; h += 4 * V) {
      for (int64_t u = 0; u < 4 * V; u += V) same.At(h + u);
      for (int64_t u = 0; u < 4 * V; u += V) one(h + u);
    }
    for (; h < H4; h += 4 * V) {
      for (int64_t u = 0; u < 4 * V; u += V) next.At(h + u);
      for (int64_t u = 0; u < 4 * V; u += V) one(h + u);
    }
  }
  const int64_t HV = H / V * V;
  const int64_t split = std::min(HV, std::max(h, PrefetchSplit<T>(H, V)));
  for (; h < split; h += V) {
    same.At(h);
    one(h);
  }
  for (; h < HV; h += V) {
    next.At(h);
    one(h);
  }
  return h;
}

template <typename T, bool kClamp>
void ForwardRows(const SwigluPlan& p, int64_t active, float* buf, int64_t begin, int64_t end) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const int64_t H = p.H;
  const T* x = typed<T>(p.x);
  const float* w = p.has_weight ? typed<float>(p.weight) : nullptr;
  T* y = typed<T>(p.y);
  const SwigluClamp<kClamp> clamp(d, p.clamp);
  const bool stream = stream_output(p.T * H * static_cast<int64_t>(sizeof(T)));
  std::fill(buf, buf + 4 * kChunk, 0.0f);
  float* a = buf;
  float* b = a + kChunk;
  float* o = b + kChunk;
  T* stage = reinterpret_cast<T*>(o + kChunk);
  // bf16 on AVX-512 with AVX512-BF16: pairs narrowed by one instruction (L106).
  const bool cvt2 = UseBf16x2<T>();
  for (int64_t t = begin; t < end; ++t) {
    T* yr = y + t * H;
    if (t >= active) {
      std::memset(static_cast<void*>(yr), 0, sizeof(T) * H);
      continue;
    }
    const VF vw = hn::Set(d, w ? w[t] : 1.0f);
    const T* x0 = x + t * 2 * H;
    const T* x1 = x0 + H;
    auto f = [&](VF va, VF vb) { return ForwardValue<T>(d, clamp, va, vb, vw); };
    int64_t h0 = 0;
    if constexpr (InRegister<T>::value && !std::is_same_v<T, float>) {
      // 16-bit data: pairs of vectors, non-temporal where the row is 64-byte aligned.
      if (stream && Stream2Aligned(yr)) {
        h0 = cvt2 ? ForwardRowVectors<true, true, true>(x0, x1, yr, H, vw, clamp)
                  : ForwardRowVectors<true, true, false>(x0, x1, yr, H, vw, clamp);
      } else if (stream && StreamAligned(yr)) {
        h0 = ForwardRowVectors<false, true, false>(x0, x1, yr, H, vw, clamp);
      } else {
        h0 = cvt2 ? ForwardRowVectors<true, false, true>(x0, x1, yr, H, vw, clamp)
                  : ForwardRowVectors<true, false, false>(x0, x1, yr, H, vw, clamp);
      }
    } else if constexpr (InRegister<T>::value) {
      // fp32: single vectors, non-temporal where the row is aligned.
      h0 = stream && StreamAligned(yr)
               ? ForwardRowVectors<false, true, false>(x0, x1, yr, H, vw, clamp)
               : ForwardRowVectors<false, false, false>(x0, x1, yr, H, vw, clamp);
    }
    for (; h0 < H; h0 += kChunk) {
      const size_t n = static_cast<size_t>(std::min<int64_t>(kChunk, H - h0));
      load_chunk(x0 + h0, a, n);
      load_chunk(x1 + h0, b, n);
      for (size_t i = 0; i < padded(n); i += N) {
        hn::Store(f(hn::Load(d, a + i), hn::Load(d, b + i)), d, o + i);
      }
      if (stream) {
        stream_chunk(o, yr + h0, n, stage);
      } else {
        store_chunk(o, yr + h0, n);
      }
    }
  }
  hwy::FlushStream();
}

// (ga, gb) of §5.5 steps 2-6 for one vector of gate a0, up b0 and upstream gradient g.
template <bool kClamp>
HWY_INLINE void BackwardValue(DF d, const SwigluClamp<kClamp>& clamp, VF w, VF a0, VF b0, VF g,
                              VF& vga, VF& vgb) {
  const VF one = hn::Set(d, 1.0f);
  const VF va = clamp.gate(a0), vb = clamp.up(b0);
  const VF gyw = hn::Mul(g, w);
  const VF s = Sigmoid(d, va);
  const VF silu = hn::Mul(va, s);
  const VF dsilu = hn::Mul(s, hn::Add(one, hn::Mul(va, hn::Sub(one, s))));
  vga = hn::Mul(hn::Mul(gyw, vb), dsilu);
  vgb = hn::Mul(gyw, silu);
  if constexpr (kClamp) {
    // Masks on the unclamped inputs, strict inequalities (§5.5 step 6, D11).
    vga = hn::IfThenElseZero(hn::Lt(a0, clamp.c), vga);
    vgb = hn::IfThenElseZero(hn::And(hn::Gt(b0, clamp.nc), hn::Lt(b0, clamp.c)), vgb);
  }
}

// Software prefetch of the backward's input streams (L124): gate and up as in the forward
// (continued into the next row), grad_y and y_origin straight on (their rows are contiguous).
constexpr bool kBackwardPrefetch = true;

// The whole blocks of 64 columns of one backward row, straight from and to memory (docs/
// decisions.md L124): kGwVecs vectors of (ga, gb) per block, stored in pairs by StorePair
// (kPairs: 16-bit data) or one by one (non-temporal with kStream), and with kGw the block's
// grad_y * y_origin products added into acc[] (the 64 partial sums of L95, in column order, from
// the widened grad_y of the gradient). Returns the first column not done (a multiple of 64).
// grad_x may be x itself (docs/decisions.md L228): a block's gate and up are loaded before its
// gradient is stored over them, hence no restrict on x0, x1 and g0.
template <bool kPairs, bool kStream, bool kNarrow2, bool kGw, typename T, bool kClamp>
HWY_INLINE int64_t BackwardRowBlocks(const T* x0, const T* x1,
                                     const T* HWY_RESTRICT gyr, const T* HWY_RESTRICT yor,
                                     T* g0, int64_t H, VF w,
                                     const SwigluClamp<kClamp> clamp, VF* HWY_RESTRICT acc) {
  const DF d;
  const int64_t V = static_cast<int64_t>(hn::Lanes(d));
  constexpr int64_t B = static_cast<int64_t>(kGwLanes);
  constexpr int64_t kLine = 64;  // bytes per prefetch
  T* g1 = g0 + H;
  VF sum[kGwVecs];
  if constexpr (kGw) {
    for (size_t k = 0; k < kGwVecs; ++k) sum[k] = acc[k];
  }
  auto block = [&](int64_t h, const PrefetchPair<T>& pf) MOEGRAD_LAMBDA_INLINE {
    if constexpr (kBackwardPrefetch) {
      for (int64_t c = 0; c < B * static_cast<int64_t>(sizeof(T)); c += kLine) {
        const int64_t e = c / static_cast<int64_t>(sizeof(T));
        pf.At(h + e);
        hwy::Prefetch(reinterpret_cast<const char*>(gyr + h + e) + kPrefetchAhead);
        if constexpr (kGw) hwy::Prefetch(reinterpret_cast<const char*>(yor + h + e) + kPrefetchAhead);
      }
    }
    VF ga[kGwVecs], gb[kGwVecs];
    for (size_t k = 0; k < kGwVecs; ++k) {
      const int64_t c = h + static_cast<int64_t>(k) * V;
      const VF g = LoadF(d, gyr + c);
      BackwardValue(d, clamp, w, LoadF(d, x0 + c), LoadF(d, x1 + c), g, ga[k], gb[k]);
      if constexpr (kGw) sum[k] = hn::MulAdd(g, LoadF(d, yor + c), sum[k]);
    }
    if constexpr (kPairs) {
      for (size_t k = 0; k + 1 < kGwVecs; k += 2) {
        const int64_t c = h + static_cast<int64_t>(k) * V;
        StorePair<kStream, kNarrow2>(d, ga[k], ga[k + 1], g0 + c);
        StorePair<kStream, kNarrow2>(d, gb[k], gb[k + 1], g1 + c);
      }
    } else {
      for (size_t k = 0; k < kGwVecs; ++k) {
        const int64_t c = h + static_cast<int64_t>(k) * V;
        if constexpr (kStream) {
          StreamF(d, ga[k], g0 + c);
          StreamF(d, gb[k], g1 + c);
        } else {
          StoreF(d, ga[k], g0 + c);
          StoreF(d, gb[k], g1 + c);
        }
      }
    }
  };
  const int64_t HB = H / B * B;
  const int64_t split = std::min(HB, PrefetchSplit<T>(H, B));
  const PrefetchPair<T> same = PrefetchSameRow(x0, x1), next = PrefetchNextRow(x1, H);
  int64_t h = 0;
  for (; h < split; h += B) block(h, same);
  for (; h < HB; h += B) block(h, next);
  if constexpr (kGw) {
    for (size_t k = 0; k < kGwVecs; ++k) acc[k] = sum[k];
  }
  return h;
}

template <typename T, bool kClamp>
void BackwardRows(const SwigluGradPlan& p, int64_t active, float* buf, int64_t begin,
                  int64_t end) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const int64_t H = p.H;
  const T* gy = typed<T>(p.grad_y);
  const T* x = typed<T>(p.x);
  const float* w = p.has_weight ? typed<float>(p.weight) : nullptr;
  const bool want_gw = p.wants_grad_weight();
  const T* yo = want_gw ? typed<T>(p.y_origin) : nullptr;
  T* gx = typed<T>(p.grad_x);
  float* gw = want_gw ? typed<float>(p.grad_weight) : nullptr;
  const SwigluClamp<kClamp> clamp(d, p.clamp);
  const bool stream = stream_output(p.T * 2 * H * static_cast<int64_t>(sizeof(T)));
  const bool cvt2 = UseBf16x2<T>();
  std::fill(buf, buf + 6 * kChunk, 0.0f);
  float* a = buf;
  float* b = a + kChunk;
  float* g = b + kChunk;
  float* ga = g + kChunk;
  float* gb = ga + kChunk;
  T* stage = reinterpret_cast<T*>(gb + kChunk);
  for (int64_t t = begin; t < end; ++t) {
    T* g0 = gx + t * 2 * H;
    if (t >= active) {
      std::memset(static_cast<void*>(g0), 0, sizeof(T) * 2 * H);
      if (gw) gw[t] = 0.0f;
      continue;
    }
    const T* gyr = gy + t * H;
    const T* x0 = x + t * 2 * H;
    const T* x1 = x0 + H;
    const VF vw = hn::Set(d, w ? w[t] : 1.0f);
    auto f = [&](VF a0, VF b0, VF g, VF& vga, VF& vgb) {
      BackwardValue(d, clamp, vw, a0, b0, g, vga, vgb);
    };
    const T* yr = gw ? yo + t * H : nullptr;
    int64_t h0 = 0;
    // The 64 partial sums of grad_weight (L95) of the whole blocks, where the row loop forms
    // them (GwBlocks); the rest of the row is added by GradWeightFinish.
    HWY_ALIGN float part[kGwLanes];
    bool fused = false;
    if constexpr (InRegister<T>::value) {
      if (GwBlocks<T>()) {
        // Whole blocks of 64 columns (L124), non-temporal stores where both halves of the
        // grad_x row are aligned (for pairs: 64-byte aligned on AVX-512).
        constexpr bool kSixteen = !std::is_same_v<T, float>;
        VF acc[kGwVecs];
        for (size_t k = 0; k < kGwVecs; ++k) acc[k] = hn::Zero(d);
        auto blocks = [&](auto gw_on) {
          constexpr bool kG = decltype(gw_on)::value;
          if (kSixteen && stream && Stream2Aligned(g0) && Stream2Aligned(g0 + H)) {
            return cvt2 ? BackwardRowBlocks<kSixteen, true, true, kG>(x0, x1, gyr, yr, g0, H, vw, clamp, acc)
                        : BackwardRowBlocks<kSixteen, true, false, kG>(x0, x1, gyr, yr, g0, H, vw, clamp, acc);
          }
          if (stream && StreamAligned(g0) && StreamAligned(g0 + H)) {
            return BackwardRowBlocks<false, true, false, kG>(x0, x1, gyr, yr, g0, H, vw, clamp, acc);
          }
          return cvt2 ? BackwardRowBlocks<kSixteen, false, true, kG>(x0, x1, gyr, yr, g0, H, vw, clamp, acc)
                      : BackwardRowBlocks<kSixteen, false, false, kG>(x0, x1, gyr, yr, g0, H, vw, clamp, acc);
        };
        h0 = gw ? blocks(std::true_type{}) : blocks(std::false_type{});
        if (gw) {
          for (size_t k = 0; k < kGwVecs; ++k) hn::Store(acc[k], d, part + k * N);
          fused = true;
        }
      }
      // Whole vectors of the rest straight from and to memory (non-temporal stores where both
      // halves of the grad_x row are aligned); the tail goes through the chunk path.
      if (stream && StreamAligned(g0) && StreamAligned(g0 + H)) {
        for (; h0 + static_cast<int64_t>(N) <= H; h0 += N) {
          VF vga, vgb;
          f(LoadF(d, x0 + h0), LoadF(d, x1 + h0), LoadF(d, gyr + h0), vga, vgb);
          StreamF(d, vga, g0 + h0);
          StreamF(d, vgb, g0 + H + h0);
        }
      } else {
        for (; h0 + static_cast<int64_t>(N) <= H; h0 += N) {
          VF vga, vgb;
          f(LoadF(d, x0 + h0), LoadF(d, x1 + h0), LoadF(d, gyr + h0), vga, vgb);
          StoreF(d, vga, g0 + h0);
          StoreF(d, vgb, g0 + H + h0);
        }
      }
    }
    for (; h0 < H; h0 += kChunk) {
      const size_t n = static_cast<size_t>(std::min<int64_t>(kChunk, H - h0));
      load_chunk(x0 + h0, a, n);
      load_chunk(x1 + h0, b, n);
      load_chunk(gyr + h0, g, n);
      for (size_t i = 0; i < padded(n); i += N) {
        VF vga, vgb;
        f(hn::Load(d, a + i), hn::Load(d, b + i), hn::Load(d, g + i), vga, vgb);
        hn::Store(vga, d, ga + i);
        hn::Store(vgb, d, gb + i);
      }
      if (stream) {
        stream_chunk(ga, g0 + h0, n, stage);
        stream_chunk(gb, g0 + H + h0, n, stage);
      } else {
        store_chunk(ga, g0 + h0, n);
        store_chunk(gb, g0 + H + h0, n);
      }
    }
    if (gw) {
      gw[t] = fused ? GradWeightFinish(part, H / static_cast<int64_t>(kGwLanes) *
                                                 static_cast<int64_t>(kGwLanes),
                                       H, gyr, yr)
                    : GradWeightDot(H, gyr, yr);
    }
  }
  hwy::FlushStream();
}

}  // namespace

void SwigluForward(const SwigluPlan& p) {
  const int64_t active = swiglu_active_rows(&p.group_index, p.has_group_index, p.T);
  dispatch_float(p.x.dtype, "x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    parallel_rows(p.T, p.threads, [&](int, int64_t b, int64_t e) {
      HWY_ALIGN float buf[4 * kChunk];
      WithClamp(p.clamp, [&](auto on) { ForwardRows<T, decltype(on)::value>(p, active, buf, b, e); });
    });
  });
}

void SwigluBackward(const SwigluGradPlan& p) {
  const int64_t active = swiglu_active_rows(&p.group_index, p.has_group_index, p.T);
  dispatch_float(p.x.dtype, "x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    parallel_rows(p.T, p.threads, [&](int, int64_t b, int64_t e) {
      HWY_ALIGN float buf[6 * kChunk];
      WithClamp(p.clamp, [&](auto on) { BackwardRows<T, decltype(on)::value>(p, active, buf, b, e); });
    });
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moegrad {
HWY_EXPORT(SwigluForward);
HWY_EXPORT(SwigluBackward);

namespace {
int64_t grain_rows(int64_t H) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(1, H)); }
}  // namespace

void swiglu_cpu_size(SwigluPlan& p, WorkspaceLayout&) {
  p.threads = plan_threads(p.T, grain_rows(p.H));  // scratch on the stack (bounded)
}

void swiglu_cpu(const SwigluPlan& plan, const Workspace&, void*) {
  advise_output(plan.y);
  HWY_DYNAMIC_DISPATCH(SwigluForward)(plan);
}

void swiglu_grad_cpu_size(SwigluGradPlan& p, WorkspaceLayout&) {
  p.threads = plan_threads(p.T, grain_rows(p.H));  // scratch on the stack (bounded)
}

void swiglu_grad_cpu(const SwigluGradPlan& plan, const Workspace&, void*) {
  advise_output(plan.grad_x);
  HWY_DYNAMIC_DISPATCH(SwigluBackward)(plan);
}
}  // namespace moegrad
#endif  // HWY_ONCE
