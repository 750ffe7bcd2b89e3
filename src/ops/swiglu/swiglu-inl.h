// Per-target pieces shared by the SwiGLU CPU kernels (swiglu_cpu.cc, swiglu_quant_cpu.cc):
// the clamp of §5.5 step 2 and the forward formula. Included once per Highway target after
// core/simd-inl.h.
#if defined(MOEGRAD_OPS_SWIGLU_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOEGRAD_OPS_SWIGLU_INL_H_
#undef MOEGRAD_OPS_SWIGLU_INL_H_
#else
#define MOEGRAD_OPS_SWIGLU_INL_H_
#endif

#include "core/simd-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {

// x0 <- min(x0, c) and x1 <- clamp(x1, -c, c), NaN passing through. On x86 MINPS/MAXPS return
// their second operand when either is NaN (and when both are equal), so min(c, v) is one
// instruction with exactly the bits of "v > c ? c : v"; Highway's portable Min returns the
// non-NaN operand, so other targets keep the compare-and-select.
HWY_INLINE VF ClampGate(VF c, VF v) {
#if HWY_ARCH_X86 && HWY_TARGET != HWY_SCALAR
  return hn::Min(c, v);
#else
  return hn::IfThenElse(hn::Gt(v, c), c, v);
#endif
}
HWY_INLINE VF ClampUp(VF c, VF nc, VF v) {
#if HWY_ARCH_X86 && HWY_TARGET != HWY_SCALAR
  return hn::Max(nc, hn::Min(c, v));
#else
  return hn::IfThenElse(hn::Gt(v, c), c, hn::IfThenElse(hn::Lt(v, nc), nc, v));
#endif
}

// The clamp with its on/off state as a template parameter, so that the row loops carry no
// per-vector test of it.
template <bool kOn>
struct SwigluClamp {
  VF c, nc;
  SwigluClamp(DF d, float limit) : c(hn::Set(d, limit)), nc(hn::Set(d, -limit)) {}
  VF gate(VF v) const {
    if constexpr (kOn) return ClampGate(c, v);
    return v;
  }
  VF up(VF v) const {
    if constexpr (kOn) return ClampUp(c, nc, v);
    return v;
  }
};

// The forward value silu(a) * b * w of one vector (after the clamp). kSixteen (bf16/fp16 data):
// on AVX-512 silu(a) = MulSigmoid16(a, a) (docs/decisions.md L105), elsewhere with the shorter
// sigmoid of L96; fp32 keeps the sigmoid of L71. silu(a) first, as in the reference: a * b * w
// can overflow where the result does not (a large and negative).
template <bool kSixteen>
HWY_INLINE VF SwigluValue(DF d, VF a, VF b, VF w) {
#if MOEGRAD_SIMD_AVX512
  if constexpr (kSixteen) return hn::Mul(hn::Mul(MulSigmoid16(d, a, a), b), w);
#endif
  return hn::Mul(hn::Mul(hn::Mul(a, SigmoidT<kSixteen>(d, a)), b), w);
}

#if MOEGRAD_SIMD_AVX512
// Two vectors narrowed to bf16 by Bf16x2 (one VCVTNE2PS2BF16; AVX512-BF16: only where
// simd_detail::use_avx512bf16) and written as one 64-byte store, non-temporal with kStream (p
// then 64-byte aligned). Returns false, writing nothing, when a lane is denormal (the instruction
// flushes those, L70): the caller then stores with StoreF / StreamF2, which give the same bits
// for the other lanes.
template <bool kStream>
HWY_INLINE bool TryStoreBf16x2(VF v0, VF v1, bf16_t* HWY_RESTRICT p) {
  __m512i r;
  if (HWY_UNLIKELY(!Bf16x2(v0, v1, r))) return false;
  if constexpr (kStream) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), r);
  } else {
    _mm512_storeu_si512(p, r);
  }
  return true;
}
#endif

// Calls f(std::integral_constant<bool, on>) with the clamp state as a compile-time constant.
template <class F>
HWY_INLINE void WithClamp(float limit, F&& f) {
  if (limit > 0.0f) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#endif  // MOEGRAD_OPS_SWIGLU_INL_H_
