// The scalar SwiGLU math that the CPU and CUDA kernels share, one definition compiled for both
// (MOEGRAD_HD: __host__ __device__ under nvcc, plain inline otherwise): the processed row count
// of group_index (docs/decisions.md L8), the clamp and its gradient masks (§5.5 steps 2-6,
// D11), the forward and backward values, and the block scale of the quantised forward (§6.4,
// D24). docs/operators.md §5, §6.4. The Highway vector forms of the CPU kernels are in
// swiglu-inl.h and core/simd-inl.h; the FP8 encoders in fp8.h.
#ifndef MOEGRAD_OPS_SWIGLU_SWIGLU_FORMULA_H_
#define MOEGRAD_OPS_SWIGLU_SWIGLU_FORMULA_H_

#include <cstdint>

#include "core/convert.h"
#include "core/formula.h"
#include "ops/swiglu/fp8.h"

namespace moegrad {
namespace swiglu_formula {

// Rows processed with group_index (L8): min(max(sum, 0), T) of the exact sum of the int64
// counts. The sum is kept in 128 bits, where no int64 element count can overflow it, and integer
// addition is associative, so any summation order (a serial loop on the CPU, a parallel tree on
// the GPU) gives the same count. Garbage or huge counts can neither overflow nor wrap around.
using Sum128 = __int128;
MOEGRAD_HD int64_t rows_of_sum(Sum128 sum, int64_t T) {
  if (sum <= 0) return 0;
  return sum >= static_cast<Sum128>(T) ? T : static_cast<int64_t>(sum);
}

// The clamp of §5.5 step 2 (limit c > 0 turns it on): the gate half capped above, the up half
// clamped to [-c, c]; NaN passes through.
struct Clamp {
  float c;
  bool on;
  MOEGRAD_HD float gate(float v) const { return on && v > c ? c : v; }
  MOEGRAD_HD float up(float v) const { return on ? (v > c ? c : (v < -c ? -c : v)) : v; }
  // Gradient masks (D11): strict inequalities on the unclamped inputs.
  MOEGRAD_HD bool gate_passes(float a0) const { return !on || a0 < c; }
  MOEGRAD_HD bool up_passes(float b0) const { return !on || (b0 > -c && b0 < c); }
};

// The sigmoid form: formula::sigmoid_fast with kFast, else formula::sigmoid_stable.
template <bool kFast>
MOEGRAD_HD float sigmoid(float x) {
  return kFast ? formula::sigmoid_fast(x) : formula::sigmoid_stable(x);
}

// silu(a) * b * w after the clamp, silu first (a * b * w can overflow where the result does
// not).
template <bool kFast>
MOEGRAD_HD float forward(float a0, float b0, float w, const Clamp& cl) {
  const float a = cl.gate(a0), b = cl.up(b0);
  return a * sigmoid<kFast>(a) * b * w;
}

// (ga, gb) of §5.5 steps 2-6: d/da = g w b s (1 + a (1 - s)), d/db = g w silu(a), zeroed where
// the clamp's mask is closed.
template <bool kFast>
MOEGRAD_HD void backward(float a0, float b0, float g, float w, const Clamp& cl, float& ga,
                         float& gb) {
  const float a = cl.gate(a0), b = cl.up(b0);
  const float gyw = g * w;
  const float s = sigmoid<kFast>(a);
  const float silu = a * s;
  const float dsilu = s * (1.0f + a * (1.0f - s));
  ga = cl.gate_passes(a0) ? gyw * b * dsilu : 0.0f;
  gb = cl.up_passes(b0) ? gyw * silu : 0.0f;
}

// ---- quantised forward (§6.4, D24) ----

constexpr float kAmaxFloor = 1e-4f;              // a block's amax is at least 1e-4
constexpr float kMaxFinite = 3.4028235e38f;      // inf and NaN take no part in the amax (L73)
MOEGRAD_HD float fp8_max(bool e5m2) { return e5m2 ? 57344.0f : 448.0f; }

// The running amax of a block: max(m, |v|) over the finite values only.
MOEGRAD_HD float amax_step(float m, float v) {
  const float a = fabsf(v);
  return a <= kMaxFinite && a > m ? a : m;
}

using quant_detail::pow2_ceil;  // fp8.h

// The scale of a block from its amax over the finite values; *inv is what the values are
// multiplied by before encoding. With round_scale the scale is a power of two and *inv its
// exact reciprocal 2^(127 - e) for the biased exponent e of the scale, which lies in [98, 247]
// (amax between 1e-4 and the largest float, fmax 448 or 57344).
MOEGRAD_HD float block_scale(float amax, float fmax, bool round_scale, float* inv) {
  const float ah = amax > kAmaxFloor ? amax : kAmaxFloor;
  float scale = ah / fmax;
  if (round_scale) {
    scale = pow2_ceil(scale);
    *inv = float_of((254u - (bits_of(scale) >> 23)) << 23);
  } else {
    *inv = fmax / ah;
  }
  return scale;
}

// The MX (e8m0) scale code of a block: the biased exponent of its power-of-two scale.
MOEGRAD_HD uint8_t e8m0_code(float scale) { return static_cast<uint8_t>(bits_of(scale) >> 23); }

// The FP8 code of one value times its block's multiplier (the product rounded to fp32 first).
MOEGRAD_HD uint8_t encode(float v, float inv, bool e5m2) {
  const float q = v * inv;
  return e5m2 ? quant_detail::to_e5m2(q) : quant_detail::to_e4m3fn(q);
}

}  // namespace swiglu_formula
}  // namespace moegrad

#endif  // MOEGRAD_OPS_SWIGLU_SWIGLU_FORMULA_H_
