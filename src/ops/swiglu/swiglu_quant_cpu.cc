// CPU kernel of the quantised SwiGLU forward (§6.4, D24), compiled once per SIMD target
// (Highway) and dispatched at run time. Rows split across threads; per block along H: the fp32
// SwiGLU values, their amax over the finite values, the scale, and the FP8 codes (round to
// nearest even, the same bits as PyTorch's float -> float8 casts). On AVX-512 whole blocks go
// through QuantBlocks (L130); elsewhere, and for y_origin and short last blocks, each row in
// chunks of fp32 values (L1 scratch).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/swiglu/swiglu_quant_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/parallel.h"
#include "core/simd-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "ops/swiglu/fp8-inl.h"
#include "ops/swiglu/fp8.h"
#include "ops/swiglu/swiglu-inl.h"
#include "ops/swiglu/swiglu.h"
#include "ops/swiglu/swiglu_formula.h"

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {
namespace {

// The block scale of §6.4, shared with the CUDA kernel (swiglu_formula.h).
HWY_INLINE float BlockScale(float amax, float fmax, bool round_scale, float* inv) {
  return swiglu_formula::block_scale(amax, fmax, round_scale, inv);
}

// Encodes the n values of a chunk, block by block (inv[k]: block k's multiplier). Not inlined:
// in the row loop the SwiGLU's constants hold most vector registers and the encoder's were
// rebuilt every vector (docs/decisions.md L97).
template <bool kE5M2>
HWY_NOINLINE void EncodeChunk(const float* HWY_RESTRICT v, int64_t n, int64_t B,
                              const float* HWY_RESTRICT inv, bool stream,
                              uint8_t* HWY_RESTRICT out) {
  for (int64_t j = 0, k = 0; j < n; j += B, ++k) {
    EncodeBlock<kE5M2>(v + j, std::min(B, n - j), inv[k], stream, out + j);
  }
}

#if MOEGRAD_SIMD_AVX512
// The 16 lane maxima of 16 vectors (v: 16 x 16 floats) into out[0..16): a tree of 128-, 64- and
// 32-bit shuffles and maxima, then one permute to block order (46 instructions instead of 16
// horizontal reductions of about 8 each and an extract). The values are non-negative finite
// floats without -0, so the maximum does not depend on the order (the bits of MaxOfLanes).
HWY_INLINE void LaneMaxima16(const float* HWY_RESTRICT v, float* HWY_RESTRICT out) {
  __m512 w[8];
  for (int j = 0; j < 8; ++j) {  // quarters: v_2j's halves folded in 0-1, v_2j+1's in 2-3
    const __m512 a = _mm512_load_ps(v + 32 * j), b = _mm512_load_ps(v + 32 * j + 16);
    w[j] = _mm512_max_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
  }
  __m512 x[4];
  for (int j = 0; j < 4; ++j) {  // quarter q: v_4j+q
    x[j] = _mm512_max_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xdd));
  }
  __m512 y[2];
  for (int j = 0; j < 2; ++j) {  // quarter q: 2 lanes of v_8j+q, 2 of v_8j+4+q
    const __m512d lo = _mm512_castps_pd(x[2 * j]), hi = _mm512_castps_pd(x[2 * j + 1]);
    y[j] = _mm512_max_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  // Lane 4q + r: v_q+4r.
  const __m512 z = _mm512_max_ps(_mm512_shuffle_ps(y[0], y[1], 0x88),
                                 _mm512_shuffle_ps(y[0], y[1], 0xdd));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, z));
}
#endif

// The largest finite code of the FP8 format, the scale's target for a block's amax.
template <bool kE5M2>
constexpr float Fp8Max() { return kE5M2 ? 57344.0f : 448.0f; }

constexpr float kMaxFiniteF = swiglu_formula::kMaxFinite;

// max(vmax, av) where av (an |value|) is finite: inf and NaN take no part in a block's amax
// (L73); `fin` holds kMaxFiniteF in every lane.
HWY_INLINE VF MaxFinite(VF vmax, VF av, VF fin) {
  return hn::IfThenElse(hn::Le(av, fin), hn::Max(vmax, av), vmax);
}

// Software prefetch distance of the two input streams, in bytes (L107, L123).
constexpr size_t kPrefetchAhead = 2048;

#if MOEGRAD_SIMD_AVX512
// AVX-512: whole blocks of kB = 128 (FP8) or 32 (MX) values read straight from memory
// (docs/decisions.md L130): the block's amax from the SwiGLU values in registers (one VRANGEPS
// per vector, no chunk pass and 16-block reduction), its scale at once, and the previous
// block's codes from a two-block L1 buffer, four vectors packed into one 64-byte store.

// 32 consecutive elements of T at p, widened into two vectors (elements 0-15 and 16-31). bf16:
// one 64-byte load and one VPERMW per vector that moves element i to the high half of lane i
// and zeroes the low half (the shift of Reg<bf16_t>::Widen and its load in one instruction).
template <typename T>
HWY_INLINE void LoadPair(DF d, const T* HWY_RESTRICT p, __m512i wlo, __m512i whi, VF& lo,
                         VF& hi) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    (void)d;
    const __m512i r = _mm512_loadu_si512(p);
    lo = VF{_mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xaaaaaaaau, wlo, r))};
    hi = VF{_mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xaaaaaaaau, whi, r))};
  } else {
    (void)wlo;
    (void)whi;
    lo = LoadF(d, p);
    hi = LoadF(d, p + 16);
  }
}

// max(|a|, |b|) (VRANGEPS imm 0x0b: larger magnitude, sign cleared). A quiet NaN operand gives
// the other one and two NaN give NaN, so a tree of them gives the maximum over the finite
// values, or inf or NaN when the values hold an inf or a lane is NaN throughout (the caller
// then filters, as the chunk path does). The values are products, never signalling NaN.
HWY_INLINE __m512 MaxAbs(__m512 a, __m512 b) { return _mm512_range_ps(a, b, 0x0b); }
HWY_INLINE float MaxAbsOfLanes(__m512 m) {
  const __m256 h8 =
      _mm256_range_ps(_mm512_castps512_ps256(m), _mm512_extractf32x8_ps(m, 1), 0x0b);
  __m128 h4 = _mm_range_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1), 0x0b);
  h4 = _mm_range_ps(h4, _mm_movehl_ps(h4, h4), 0x0b);
  h4 = _mm_range_ss(h4, _mm_movehdup_ps(h4), 0x0b);
  return _mm_cvtss_f32(h4);
}

// The codes of 4 (2) vectors, one per 32-bit lane with zero upper bytes (EncodeFp8), narrowed
// into 64 (32) bytes in element order: two unsigned-saturating packs (exact: the lanes are
// below 256) work within 128-bit lanes, so one VPERMD puts the 4-byte groups in order.
HWY_INLINE __m512i Pack4(__m512i c0, __m512i c1, __m512i c2, __m512i c3) {
  const __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
  // 128-bit lane L holds the groups c0[4L..4L+3], c1[..], c2[..], c3[..]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_epi32(order, b);
}
HWY_INLINE __m256i Pack2(__m512i c0, __m512i c1) {
  const __m512i w = _mm512_packus_epi32(c0, c1);
  const __m512i b = _mm512_packus_epi16(w, w);  // lane L: c0[4L..4L+3], c1[..], twice
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, b));
}

// The codes of one block of kV vectors at v times inv, stored at out (non-temporal with
// `stream`: out is then 64-byte aligned, or 32-byte for two vectors).
template <size_t kV, bool kE5M2>
HWY_INLINE void EncodeBlockRegs(const float* HWY_RESTRICT v, float inv, bool stream,
                                uint8_t* HWY_RESTRICT out) {
  const DF d;
  const VF vinv = hn::Set(d, inv);
  __m512i c[kV];
  for (size_t u = 0; u < kV; ++u) {
    c[u] = EncodeFp8<kE5M2>(d, hn::Mul(hn::Load(d, v + 16 * u), vinv)).raw;
  }
  if constexpr (kV == 2) {
    const __m256i r = Pack2(c[0], c[1]);
    if (stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out), r);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), r);
    }
  } else {
    for (size_t u = 0; u < kV; u += 4) {
      const __m512i r = Pack4(c[u], c[u + 1], c[u + 2], c[u + 3]);
      if (stream) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(out + 16 * u), r);
      } else {
        _mm512_storeu_si512(out + 16 * u, r);
      }
    }
  }
}

template <typename T, int64_t kB, bool kE5M2, bool kClamp>
HWY_NOINLINE void QuantBlocks(const T* HWY_RESTRICT x0, const T* HWY_RESTRICT x1, int64_t H,
                              int64_t n, float w, float limit, bool round_scale,
                              uint8_t* HWY_RESTRICT y, float* HWY_RESTRICT sc32,
                              uint8_t* HWY_RESTRICT sc8, bool stream) {
  constexpr size_t kV = static_cast<size_t>(kB) / 16;  // vectors per block
  static_assert(kV == 2 || kV == 8, "blocks of 32 or 128");
  const DF d;
  const VF vw = hn::Set(d, w);
  const SwigluClamp<kClamp> clamp(d, limit);
  const float fmax = Fp8Max<kE5M2>();
  __m512i wlo = _mm512_setzero_si512(), whi = _mm512_setzero_si512();
  if constexpr (std::is_same_v<T, bf16_t>) {
    alignas(64) uint16_t lo16[32], hi16[32];
    for (int i = 0; i < 32; ++i) {  // lane i's high half: element i (lo) or 16 + i (hi)
      lo16[i] = static_cast<uint16_t>(i / 2);
      hi16[i] = static_cast<uint16_t>(16 + i / 2);
    }
    wlo = _mm512_load_si512(lo16);
    whi = _mm512_load_si512(hi16);
  }
  // Non-temporal stores need 64-byte (32-byte for MX blocks) aligned code rows.
  stream = stream && reinterpret_cast<uintptr_t>(y) % 64 == 0;
  constexpr int64_t kAhead = static_cast<int64_t>(kPrefetchAhead / sizeof(T));
  constexpr int64_t kLine = static_cast<int64_t>(64 / sizeof(T));
  HWY_ALIGN float vbuf[2 * kB];  // the values of this block and of the previous one
  float prev = 0.0f;                // the previous block's multiplier
  for (int64_t h = 0, k = 0; h < n; h += kB, ++k) {
    // The prefetch of L107 / L123: each 64-byte line of both halves kAhead elements ahead,
    // continued into the next row's gate and up halves past the row end.
    const int64_t col = h + kAhead;
    if (col + kB <= H) {
      for (int64_t c = 0; c < kB; c += kLine) {
        hwy::Prefetch(x0 + col + c);
        hwy::Prefetch(x1 + col + c);
      }
    } else {
      for (int64_t c = 0; c < kB; c += kLine) {
        const int64_t off = col + c >= H ? H : 0;
        hwy::Prefetch(x0 + off + col + c);
        hwy::Prefetch(x1 + off + col + c);
      }
    }
    VF v[kV];
    for (size_t g = 0; g < kV; g += 2) {
      VF a0, a1, b0, b1;
      LoadPair(d, x0 + h + 16 * static_cast<int64_t>(g), wlo, whi, a0, a1);
      LoadPair(d, x1 + h + 16 * static_cast<int64_t>(g), wlo, whi, b0, b1);
      v[g] = SwigluValue<true>(d, clamp.gate(a0), clamp.up(b0), vw);
      v[g + 1] = SwigluValue<true>(d, clamp.gate(a1), clamp.up(b1), vw);
    }
    float* cur = vbuf + (k % 2) * kB;
    for (size_t u = 0; u < kV; ++u) hn::Store(v[u], d, cur + 16 * u);
    // The block's amax, a tree of VRANGEPS; an inf or NaN result (rare) is redone over the
    // finite values only, as in the chunk path. Either way the maximum of the same values.
    __m512 m = MaxAbs(v[0].raw, v[1].raw);
    if constexpr (kV == 8) {  // written out: as a loop GCC kept the partial maxima in memory
      const __m512 m23 = MaxAbs(v[2].raw, v[3].raw);
      m = MaxAbs(MaxAbs(m, m23), MaxAbs(MaxAbs(v[4].raw, v[5].raw), MaxAbs(v[6].raw, v[7].raw)));
    }
    float amax = MaxAbsOfLanes(m);
    if (HWY_UNLIKELY(!(amax <= kMaxFiniteF))) {
      const VF fin = hn::Set(d, kMaxFiniteF);
      VF vmax = hn::Zero(d);
      for (size_t u = 0; u < kV; ++u) vmax = MaxFinite(vmax, hn::Abs(v[u]), fin);
      amax = hn::GetLane(hn::MaxOfLanes(d, vmax));
    }
    float inv;
    const float s = BlockScale(amax, fmax, round_scale, &inv);
    if (sc32) {
      sc32[k] = s;
    } else {
      sc8[k] = swiglu_formula::e8m0_code(s);  // e8m0: the biased exponent
    }
    // The previous block's codes now: they do not wait on this block's amax, so the core
    // overlaps the two (encoding each block right after its own amax left the scheduler
    // full of instructions waiting on that one chain, and was no faster than the chunk path).
    if (k > 0) EncodeBlockRegs<kV, kE5M2>(vbuf + ((k - 1) % 2) * kB, prev, stream, y + h - kB);
    prev = inv;
  }
  if (n > 0) EncodeBlockRegs<kV, kE5M2>(vbuf + ((n / kB - 1) % 2) * kB, prev, stream, y + n - kB);
}
#endif

template <typename T, bool kE5M2, bool kClamp, bool kCheap>
void QuantRows(const SwigluQuantPlan& p, int64_t active, float* buf, int64_t begin,
               int64_t end) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const int64_t H = p.H, B = p.block, S = p.scale_stride;
  const float fmax = Fp8Max<kE5M2>();
  const T* x = typed<T>(p.x);
  const float* w = p.has_weight ? typed<float>(p.weight) : nullptr;
  uint8_t* y = static_cast<uint8_t*>(p.y.data);
  T* yo = p.write_origin ? typed<T>(p.y_origin) : nullptr;
  float* sc32 = p.quant_mode == 0 ? typed<float>(p.y_scale) : nullptr;
  uint8_t* sc8 = p.quant_mode == 1 ? static_cast<uint8_t*>(p.y_scale.data) : nullptr;
  const SwigluClamp<kClamp> clamp(d, p.clamp);
  const VF fin = hn::Set(d, kMaxFiniteF);
  // Non-temporal stores once the codes (and y_origin) are too big to stay cached (L72).
  const bool stream = stream_output(p.T * H * static_cast<int64_t>(yo ? 1 + sizeof(T) : 1));
  std::fill(buf, buf + 4 * kChunk, 0.0f);
  float* a = buf;
  float* b = a + kChunk;
  float* o = b + kChunk;
  T* stage = reinterpret_cast<T*>(o + kChunk);
  float amax[kChunk / 32];  // per block of the current chunk (blocks of 32 or 128)
#if MOEGRAD_SIMD_AVX512
  // AVX-512: each block's vector of partial maxima, reduced 16 blocks at a time.
  HWY_ALIGN float bmax[kChunk / 32 * 16];
#endif
  // AVX-512: whole blocks through QuantBlocks (not with y_origin, which the chunk path writes
  // from its buffer; kCheap is false only with a fp32 y_origin); the rest of the row (a short
  // last block) through the chunks.
  int64_t nfast = 0;
#if MOEGRAD_SIMD_AVX512
  if constexpr (InRegister<T>::value && kCheap) {
    if (!yo && (B == 128 || B == 32)) nfast = H / B * B;
  }
#endif
  for (int64_t t = begin; t < end; ++t) {
    uint8_t* yr = y + t * H;
    if (t >= active) {
      // Rows past the group_index total: zero codes, zero scales (e8m0 code 0), zero y_origin.
      std::memset(yr, 0, static_cast<size_t>(H));
      if (sc32) std::fill(sc32 + t * S, sc32 + (t + 1) * S, 0.0f);
      if (sc8) std::memset(sc8 + t * S, 0, static_cast<size_t>(S));
      if (yo) std::memset(static_cast<void*>(yo + t * H), 0, sizeof(T) * H);
      continue;
    }
    const VF vw = hn::Set(d, w ? w[t] : 1.0f);
    const T* x0 = x + t * 2 * H;
    const T* x1 = x0 + H;
#if MOEGRAD_SIMD_AVX512
    if constexpr (InRegister<T>::value && kCheap) {
      if (nfast > 0) {
        const float wt = w ? w[t] : 1.0f;
        float* s32 = sc32 ? sc32 + t * S : nullptr;
        uint8_t* s8 = sc8 ? sc8 + t * S : nullptr;
        if (B == 128) {
          QuantBlocks<T, 128, kE5M2, kClamp>(x0, x1, H, nfast, wt, p.clamp, p.round_scale, yr,
                                             s32, s8, stream);
        } else {
          QuantBlocks<T, 32, kE5M2, kClamp>(x0, x1, H, nfast, wt, p.clamp, p.round_scale, yr,
                                            s32, s8, stream);
        }
      }
    }
#endif
    for (int64_t h0 = nfast; h0 < H; h0 += kChunk) {
      // kChunk is a multiple of both block sizes, so blocks never straddle chunks; a block is a
      // whole number of vectors. One pass computes the SwiGLU values into `o` and each block's
      // amax over the finite values (masked for the lanes past n), block by block (no division
      // per vector); a second one encodes.
      const size_t n = static_cast<size_t>(std::min<int64_t>(kChunk, H - h0));
      // kCheap: the cheaper SiLU of the 16-bit forward (docs/decisions.md L96, L105, L130).
      auto f = [&](VF va, VF vb) {
        return SwigluValue<kCheap>(d, clamp.gate(va), clamp.up(vb), vw);
      };
      const size_t Bs = static_cast<size_t>(B);
      // Stores one vector of values and returns the running amax of its block's finite values
      // (with kTail, lanes past n masked; the vectors read from memory are whole).
      auto step = [&](VF vmax, VF v, size_t i, auto tail) {
        hn::Store(v, d, o + i);
        VF av = hn::Abs(v);
        if constexpr (decltype(tail)::value) {
          if (i + N > n) av = hn::IfThenElseZero(hn::FirstN(d, n - i), av);
        }
        return MaxFinite(vmax, av, fin);
      };
      // Whole vectors come straight from memory; the rest (the tail, or every element of a
      // type without an in-register conversion) from the widened chunk.
      size_t nv = 0;
      if constexpr (InRegister<T>::value) nv = n / N * N;
      if (nv < n) {
        load_chunk(x0 + h0 + nv, a + nv, n - nv);
        load_chunk(x1 + h0 + nv, b + nv, n - nv);
      }
      const size_t nb = (n + Bs - 1) / Bs;
      // AVX-512: the blocks' lane maxima 16 at a time, unless the chunk has few blocks.
      [[maybe_unused]] const bool tree = nb >= 8;
      for (size_t j = 0, k = 0; j < n; j += Bs, ++k) {
        const size_t jend = std::min(j + Bs, n);
        [[maybe_unused]] const size_t jv = std::min(jend, nv);
        VF vmax = hn::Zero(d);
        size_t i = j;
        if constexpr (InRegister<T>::value) {
          // Software prefetch of both input streams, kPrefetchAhead bytes ahead (L107),
          // continued into the next row's gate (x0 + 2H = x1 + H) and up (x1 + 2H) halves
          // near the row end (L123).
          for (size_t c = 0; j + c / sizeof(T) < jv; c += 64) {
            const int64_t col = h0 + static_cast<int64_t>(j + c / sizeof(T)) +
                                static_cast<int64_t>(kPrefetchAhead / sizeof(T));
            const bool same = col < H;
            const T* pa = same ? x0 : x1;
            const T* pb = same ? x1 : x1 + H;
            hwy::Prefetch(pa + col);
            hwy::Prefetch(pb + col);
          }
          for (; i < jv; i += N) {
            vmax = step(vmax, f(LoadF(d, x0 + h0 + i), LoadF(d, x1 + h0 + i)), i,
                        std::false_type{});
          }
        }
        for (; i < jend; i += N) {
          vmax = step(vmax, f(hn::Load(d, a + i), hn::Load(d, b + i)), i, std::true_type{});
        }
#if MOEGRAD_SIMD_AVX512
        if (tree) {
          hn::Store(vmax, d, bmax + 16 * k);
          continue;
        }
#endif
        amax[k] = hn::GetLane(hn::MaxOfLanes(d, vmax));
      }
#if MOEGRAD_SIMD_AVX512
      if (tree) {
        for (size_t k = nb; k % 16 != 0; ++k) hn::Store(hn::Zero(d), d, bmax + 16 * k);
        for (size_t k = 0; k < nb; k += 16) LaneMaxima16(bmax + 16 * k, amax + k);
      }
#endif
      if (yo) {
        if (stream) {
          stream_chunk(o, yo + t * H + h0, n, stage);
        } else {
          store_chunk(o, yo + t * H + h0, n);
        }
      }
      float inv[kChunk / 32];
      const int64_t blk0 = h0 / B;
      for (size_t k = 0; k < nb; ++k) {
        const float s = BlockScale(amax[k], fmax, p.round_scale, &inv[k]);
        if (sc32) {
          sc32[t * S + blk0 + static_cast<int64_t>(k)] = s;
        } else {
          // e8m0: the biased exponent
          sc8[t * S + blk0 + static_cast<int64_t>(k)] = swiglu_formula::e8m0_code(s);
        }
      }
      EncodeChunk<kE5M2>(o, static_cast<int64_t>(n), B, inv, stream, yr + h0);
    }
    if (sc8 && S > p.blocks) sc8[t * S + p.blocks] = 0;  // the pad of an odd block count
  }
  hwy::FlushStream();
}

}  // namespace

void SwigluQuantForward(const SwigluQuantPlan& p) {
  const int64_t active = swiglu_active_rows(&p.group_index, p.has_group_index, p.T);
  dispatch_float(p.x.dtype, "x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    parallel_rows(p.T, p.threads, [&](int, int64_t b, int64_t e) {
      HWY_ALIGN float buf[4 * kChunk];  // bounded scratch on the stack (L14)
      WithClamp(p.clamp, [&](auto on) {
        constexpr bool kClamp = decltype(on)::value;
        // The SiLU of the 16-bit forward (L96, L105) for bf16/fp16 data, and for fp32 data
        // when only FP8 codes leave the kernel; fp32 y_origin keeps the fp32 sigmoid of L71
        // (the values of swiglu_group, L130).
        auto rows = [&](auto cheap) {
          constexpr bool kCheap = decltype(cheap)::value;
          if (p.e5m2) {
            QuantRows<T, true, kClamp, kCheap>(p, active, buf, b, e);
          } else {
            QuantRows<T, false, kClamp, kCheap>(p, active, buf, b, e);
          }
        };
        if constexpr (!std::is_same_v<T, float>) {
          rows(std::true_type{});
        } else if (!p.write_origin) {
          rows(std::true_type{});
        } else {
          rows(std::false_type{});
        }
      });
    });
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moegrad {
HWY_EXPORT(SwigluQuantForward);

void swiglu_quant_cpu_size(SwigluQuantPlan& p, WorkspaceLayout&) {
  p.threads = plan_threads(p.T, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, p.H)));
}

void swiglu_quant_cpu(const SwigluQuantPlan& plan, const Workspace&, void*) {
  HWY_DYNAMIC_DISPATCH(SwigluQuantForward)(plan);
}
}  // namespace moegrad
#endif  // HWY_ONCE
