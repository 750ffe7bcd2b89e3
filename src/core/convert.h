// fp16/bf16 <-> fp32 conversions on raw bits, one definition for host and device code: the CPU
// scalar paths and the CUDA kernels round alike (widening is exact, narrowing is
// round-to-nearest-even, NaN stays NaN). No library calls, so nvcc compiles them for the device.
#ifndef MOEGRAD_CORE_CONVERT_H_
#define MOEGRAD_CORE_CONVERT_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MOEGRAD_HD __host__ __device__ __forceinline__
#else
#define MOEGRAD_HD inline
#endif

namespace moegrad {

MOEGRAD_HD uint32_t bits_of(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
#endif
}

MOEGRAD_HD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, 4);
  return v;
#endif
}

MOEGRAD_HD float bf16_bits_to_f32(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

MOEGRAD_HD uint16_t f32_to_bf16_bits(float v) {
  uint32_t u = bits_of(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays a quiet NaN
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // ties to even; overflow carries into inf
  return static_cast<uint16_t>(u >> 16);
}

MOEGRAD_HD float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) {  // inf, or NaN (quieted, payload kept, as the hardware converts)
    return float_of(sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0u));
  }
  if (exp != 0) return float_of(sign | ((exp + 112u) << 23) | (man << 13));
  if (man == 0) return float_of(sign);
  // Subnormal: normalise the mantissa.
  uint32_t e = 113;
  while ((man & 0x400u) == 0) {
    man <<= 1;
    --e;
  }
  return float_of(sign | (e << 23) | ((man & 0x3ffu) << 13));
}

MOEGRAD_HD uint16_t f32_to_f16_bits(float v) {
  const uint32_t u = bits_of(v);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65536: inf
  if (a >= 0x38800000u) {
    // Normal half: drop 13 mantissa bits, ties to even; a carry moves into the exponent.
    const uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15
    const uint32_t round = 0xfffu + ((r >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((r + round) >> 13));
  }
  if (a < 0x33000000u) return sign;  // below half the smallest subnormal (2^-25): +-0
  // Subnormal half: value = man * 2^-24; shift the full 24-bit significand into place.
  const uint32_t exp = a >> 23;
  const uint32_t sig = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exp;  // 14..24
  const uint32_t q = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  const uint32_t up = (rem > half || (rem == half && (q & 1u))) ? 1u : 0u;
  return static_cast<uint16_t>(sign | (q + up));
}

// int64 index -> int32. Values outside int32 map to INT32_MIN, which every kernel skips as
// invalid (host values are range-checked in stage one; device values cannot be).
MOEGRAD_HD int32_t narrow_index(int64_t v) {
  return (v < -2147483647 - 1 || v > 2147483647) ? (-2147483647 - 1) : static_cast<int32_t>(v);
}

}  // namespace moegrad

#endif  // MOEGRAD_CORE_CONVERT_H_
