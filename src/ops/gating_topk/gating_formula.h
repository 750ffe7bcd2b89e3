// The scalar math of the gating top-k that the CPU and CUDA kernels share, one definition
// compiled for both (MOEGRAD_HD: __host__ __device__ under nvcc, plain inline otherwise): the
// ranking key of the selection (docs/decisions.md L2) and the scalar norm functions (D12, D22).
// docs/operators.md §1-§2. Vector CPU forms (Highway) live in core/simd-inl.h.
#ifndef MOEGRAD_OPS_GATING_TOPK_GATING_FORMULA_H_
#define MOEGRAD_OPS_GATING_TOPK_GATING_FORMULA_H_

#include <cmath>
#include <cstdint>

#include "core/convert.h"
#include "core/formula.h"

namespace moegrad {
namespace gating_formula {

// Ranking key (L2): one unsigned compare orders larger scores first, NaN above every number,
// +0 == -0, and equal scores by lower index. Key 0 is below every score (excluded experts).
MOEGRAD_HD uint64_t rank_key(float v, int32_t index) {
  uint32_t u = bits_of(v + 0.0f);  // -0 -> +0
  if (v != v) {                    // NaN
    u = 0xffffffffu;
  } else {
    u ^= (u & 0x80000000u) ? 0xffffffffu : 0x80000000u;  // monotone float -> unsigned map
  }
  return (static_cast<uint64_t>(u) << 32) | (0xffffffffu - static_cast<uint32_t>(index));
}
MOEGRAD_HD int32_t key_index(uint64_t key) {
  return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(key));
}

using formula::sigmoid_stable;  // (D12), core/formula.h

// sqrt(softplus(x)) = sqrt(max(x, 0) + log1p(exp(-|x|))); NaN propagates (D22).
MOEGRAD_HD float sqrt_softplus(float x) {
  const float sp = fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
  return x != x ? x : sqrtf(sp);
}

// d sqrt(softplus(x)) / dx expressed through n = sqrt(softplus(x)): (1 - e^-n^2) / (2n), its
// series n/2 near 0; NaN propagates.
MOEGRAD_HD float sqrt_softplus_grad(float n) {
  const float num = -expm1f(-(n * n));
  const float r = fabsf(n) < 1e-4f ? n * 0.5f : (num * 0.5f) / n;
  return n != n ? n : r;
}

}  // namespace gating_formula
}  // namespace moegrad

#endif  // MOEGRAD_OPS_GATING_TOPK_GATING_FORMULA_H_
