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
