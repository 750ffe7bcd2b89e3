// Scalar fp32 -> FP8 encoders (float8_e4m3fn, float8_e5m2; round to nearest even, the same bits
// as PyTorch's float -> float8 casts) and the power-of-two scale rounding of §6.4. They are the
// reference of the vector encoder of fp8-inl.h (tests/cpp/test_fp8.cc compares the two) and
// encode the tails of the quantised SwiGLU forward and every code of the CUDA kernel (MOEGRAD_HD:
// one definition for both compilers).
#ifndef MOEGRAD_OPS_SWIGLU_FP8_H_
#define MOEGRAD_OPS_SWIGLU_FP8_H_

#include <cstdint>

#include "core/convert.h"

namespace moegrad {
namespace quant_detail {

// fp32 -> float8_e4m3fn code: 4 exponent bits (bias 7), 3 mantissa bits, no infinity; NaN and
// every |v| >= 480 (inf included) give the NaN code 0x7f (PyTorch's rule). Round to nearest even.
MOEGRAD_HD uint8_t to_e4m3fn(float v) {
  uint32_t u = bits_of(v);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  uint8_t r;
  if (u >= 0x43f00000u) {  // 480 (NaN and inf too)
    r = 0x7f;
  } else if (u < 0x3c800000u) {  // below 2^-6: subnormal codes, steps of 2^-9
    // Adding 2^14 rounds to a multiple of 2^-9 (fp32 round to nearest even).
    const float t = float_of(u) + 16384.0f;
    r = static_cast<uint8_t>(bits_of(t) - 0x46800000u);
  } else {
    const uint32_t odd = (u >> 20) & 1u;
    u += (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + odd;
    r = static_cast<uint8_t>(u >> 20);
  }
  return r | sign;
}

// fp32 -> float8_e5m2 code: 5 exponent bits (bias 15), 2 mantissa bits; |v| >= 65536 gives inf
// (0x7c), NaN gives 0x7f (PyTorch's rule). Round to nearest even.
MOEGRAD_HD uint8_t to_e5m2(float v) {
  uint32_t u = bits_of(v);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  uint8_t r;
  if (u >= 0x47800000u) {  // 65536
    r = u > 0x7f800000u ? 0x7f : 0x7c;
  } else if (u < 0x38800000u) {  // below 2^-14: subnormal codes, steps of 2^-16
    const float t = float_of(u) + 128.0f;
    r = static_cast<uint8_t>(bits_of(t) - 0x43000000u);
  } else {
    const uint32_t odd = (u >> 21) & 1u;
    u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffffu + odd;
    r = static_cast<uint8_t>(u >> 21);
  }
  return r | sign;
}

// The smallest power of two >= s for a positive normal s: the exponent from the fp32 bits,
// plus one when the mantissa is not zero (§6.4).
MOEGRAD_HD float pow2_ceil(float s) {
  uint32_t u = bits_of(s);
  const uint32_t e = (u >> 23) + ((u & 0x7fffffu) != 0 ? 1u : 0u);
  return float_of(e << 23);
}

}  // namespace quant_detail
}  // namespace moegrad

#endif  // MOEGRAD_OPS_SWIGLU_FP8_H_
