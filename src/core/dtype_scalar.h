// Scalar fp32 <-> bf16 bit conversions shared by the CPU and CUDA kernels, so both backends
// narrow with the same round-to-nearest-even and the same NaN quieting (D12). Host and device
// callable; depends on nothing else of moegrad.
#ifndef MOEGRAD_CORE_DTYPE_SCALAR_H_
#define MOEGRAD_CORE_DTYPE_SCALAR_H_

#include <cstdint>

#if defined(__CUDACC__)
#define MOEGRAD_HD __host__ __device__ __forceinline__
#else
#define MOEGRAD_HD inline
#endif

namespace moegrad {

// bf16 bits of an fp32 value given by its bits: round to nearest, ties to even; NaN stays NaN
// (quiet bit set, sign and high payload kept).
MOEGRAD_HD uint16_t bf16_bits_from_f32_bits(uint32_t u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// fp32 bits of a bf16 value (exact).
MOEGRAD_HD uint32_t f32_bits_from_bf16_bits(uint16_t b) { return static_cast<uint32_t>(b) << 16; }

}  // namespace moegrad

#endif  // MOEGRAD_CORE_DTYPE_SCALAR_H_
