// Per-target vector fp32 -> FP8 encoder of the quantised SwiGLU forward (§6.4): the same codes
// as the scalar encoders of fp8.h, bit for bit, for every fp32 input (tests/cpp/test_fp8.cc
// checks every sign, exponent and top-11 mantissa bit pattern against them on every target).
// Included once per Highway target after core/simd-inl.h.
#if defined(MOEGRAD_OPS_SWIGLU_FP8_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOEGRAD_OPS_SWIGLU_FP8_INL_H_
#undef MOEGRAD_OPS_SWIGLU_FP8_INL_H_
#else
#define MOEGRAD_OPS_SWIGLU_FP8_INL_H_
#endif

#include <cstdint>

#include "core/simd-inl.h"
#include "hwy/highway.h"
#include "ops/swiglu/fp8.h"

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {

// The constants of one FP8 format, as they act on |q|'s fp32 bits a (docs/decisions.md L97).
template <bool kE5M2>
struct Fp8Format {
  static constexpr int kShift = kE5M2 ? 21 : 20;  // 23 - mantissa bits
  // (bias - 127) << 23 plus half a code step less one: a + kBias (+ 1 when the lowest kept
  // mantissa bit is set) rounds to nearest even when shifted right by kShift.
  static constexpr uint32_t kBias = kE5M2 ? 0xc8000000u + 0xfffffu : 0xc4000000u + 0x7ffffu;
  // Below the normal range (2^-14 / 2^-6) the codes are multiples of the smallest subnormal:
  // a + kMagic in fp32 rounds to one, and the low byte of the sum's bits is the code (the
  // magic's own low byte is 0).
  static constexpr uint32_t kMinNormal = kE5M2 ? 0x38800000u : 0x3c800000u;
  static constexpr float kMagic = kE5M2 ? 128.0f : 16384.0f;
  // Above the finite range the shifted sum is at least the saturated code and at most 0x440
  // (no wrap: a < 2^31), so an unsigned min gives inf (e5m2) or the NaN code (e4m3fn, which
  // covers inf and NaN, |q| >= 480); e5m2's NaN (a above inf's bits) is set apart.
  static constexpr uint32_t kCap = kE5M2 ? 0x7cu : 0x7fu;
};

using VU32 = hn::Vec<hn::RebindToUnsigned<DF>>;

// 16 (AVX-512), 8 or 4 codes from as many fp32 values: the low byte of each lane is the code
// (sign in bit 7). AVX-512: the other bytes are zero (the packs of the quantised forward
// narrow them with saturation); elsewhere they are not zero on the subnormal lanes, so narrow
// by truncation.
template <bool kE5M2>
HWY_INLINE VU32 EncodeFp8(DF d, VF q) {
  using F = Fp8Format<kE5M2>;
#if MOEGRAD_SIMD_AVX512
  (void)d;
  // 11 instructions: the odd-bit test and the subnormal add as masked operations, the sign by
  // one ternary-logic instruction.
  const __m512i u = _mm512_castps_si512(q.raw);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 odd = _mm512_test_epi32_mask(a, _mm512_set1_epi32(1 << F::kShift));
  __m512i s = _mm512_add_epi32(a, _mm512_set1_epi32(static_cast<int32_t>(F::kBias)));
  s = _mm512_mask_add_epi32(s, odd, s, _mm512_set1_epi32(1));
  __m512i r = _mm512_min_epu32(_mm512_srli_epi32(s, F::kShift),
                               _mm512_set1_epi32(static_cast<int32_t>(F::kCap)));
  const __mmask16 small =
      _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(static_cast<int32_t>(F::kMinNormal)));
  r = _mm512_castps_si512(_mm512_mask_add_ps(_mm512_castsi512_ps(r), small,
                                             _mm512_castsi512_ps(a), _mm512_set1_ps(F::kMagic)));
  if (kE5M2) {
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7f));
  }
  // Bits 0-6 from r (the code; its bit 7 is clear), the others from u >> 24: the sign in bit 7
  // and zero above (one ternary-logic select, C ? B : A).
  r = _mm512_ternarylogic_epi32(r, _mm512_srli_epi32(u, 24),
                                _mm512_set1_epi32(static_cast<int32_t>(0xffffff80u)), 0xd8);
  return VU32{r};
#else
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto u = hn::BitCast(du, q);
  const auto a = hn::And(u, hn::Set(du, 0x7fffffffu));
  const auto ai = hn::BitCast(di, a);  // < 2^31: signed compares are exact
  const auto odd = hn::And(hn::ShiftRight<F::kShift>(a), hn::Set(du, 1u));
  auto r = hn::Min(hn::ShiftRight<F::kShift>(hn::Add(hn::Add(a, hn::Set(du, F::kBias)), odd)),
                   hn::Set(du, F::kCap));
  const auto sub = hn::BitCast(du, hn::Add(hn::BitCast(d, a), hn::Set(d, F::kMagic)));
  r = hn::IfThenElse(
      hn::RebindMask(du, hn::Lt(ai, hn::Set(di, static_cast<int32_t>(F::kMinNormal)))), sub, r);
  if (kE5M2) {
    r = hn::IfThenElse(hn::RebindMask(du, hn::Gt(ai, hn::Set(di, 0x7f800000))),
                       hn::Set(du, 0x7fu), r);
  }
  return hn::OrAnd(r, hn::ShiftRight<24>(u), hn::Set(du, 0x80u));
#endif
}

// Encodes n values times inv into n codes (the product rounded to fp32 first); with `stream`,
// whole vectors of codes at 16-byte aligned addresses go out with non-temporal stores
// (AVX-512: 16 codes, one 16-byte store); the tail through the scalar encoder.
template <bool kE5M2>
HWY_INLINE void EncodeBlock(const float* HWY_RESTRICT v, int64_t n, float inv, bool stream,
                            uint8_t* HWY_RESTRICT out) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const VF vinv = hn::Set(d, inv);
  int64_t i = 0;
#if MOEGRAD_SIMD_AVX512
  if (stream && reinterpret_cast<uintptr_t>(out) % 16 == 0) {
    for (; i + N <= n; i += N) {
      const VU32 c = EncodeFp8<kE5M2>(d, hn::Mul(hn::LoadU(d, v + i), vinv));
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(c.raw));
    }
  }
  for (; i + N <= n; i += N) {
    const VU32 c = EncodeFp8<kE5M2>(d, hn::Mul(hn::LoadU(d, v + i), vinv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(c.raw));
  }
#else
  (void)stream;
  const hn::Rebind<uint8_t, DF> d8;
  for (; i + N <= n; i += N) {
    const VU32 c = EncodeFp8<kE5M2>(d, hn::Mul(hn::LoadU(d, v + i), vinv));
    hn::StoreU(hn::TruncateTo(d8, c), d8, out + i);
  }
#endif
  for (; i < n; ++i) {
    const float q = v[i] * inv;
    out[i] = kE5M2 ? quant_detail::to_e5m2(q) : quant_detail::to_e4m3fn(q);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#endif  // MOEGRAD_OPS_SWIGLU_FP8_INL_H_ toggle
