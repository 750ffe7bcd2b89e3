// Scalar math shared by the CPU and CUDA kernels of several families, one definition for both
// compilers (MOEGRAD_HD of core/convert.h: __host__ __device__ under nvcc, inline otherwise).
// Each family's own formulas are in src/ops/<family>/<family>_formula.h.
#ifndef MOEGRAD_CORE_FORMULA_H_
#define MOEGRAD_CORE_FORMULA_H_

#include <cmath>
#include <cstdint>

#include "core/convert.h"

namespace moegrad {
namespace formula {

// Stable logistic function (D12): exp of a non-positive argument only, one IEEE division; NaN
// propagates. The gating norm and every result compared bitwise with the CPU use it.
MOEGRAD_HD float sigmoid_stable(float x) {
  const float e = expf(-fabsf(x));
  const float num = x >= 0.0f ? 1.0f : e;
  return x != x ? x : num / (1.0f + e);
}

// The fast logistic function of the CUDA SwiGLU (docs/cuda.md, docs/decisions.md L201):
// 1 / (1 + e^-x) with the hardware exponential (__expf, ex2.approx: 2 ulp plus a relative error
// that grows with |x|) and the approximate reciprocal (rcp.approx, 1 ulp); saturates to 0 and 1
// without NaN for |x| large, NaN propagates. On the host the same expression in IEEE arithmetic,
// the function the fast form approximates (the reference of the device results' tolerance).
MOEGRAD_HD float sigmoid_fast(float x) {
#if defined(__CUDA_ARCH__)
  return __fdividef(1.0f, 1.0f + __expf(-x));
#else
  return 1.0f / (1.0f + expf(-x));
#endif
}

}  // namespace formula
}  // namespace moegrad

#endif  // MOEGRAD_CORE_FORMULA_H_
