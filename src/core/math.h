// Scalar math shared by the kernels, all fp32 (D12).
#ifndef MOEGRAD_CORE_MATH_H_
#define MOEGRAD_CORE_MATH_H_

#include <cmath>
#include <cstdint>

namespace moegrad {

// Stable logistic function: never NaN for a finite input, exactly 0 or 1 at the extremes.
inline float stable_sigmoid(float x) {
  float e = std::exp(-std::fabs(x));
  float num = x >= 0.0f ? 1.0f : e;
  return num / (1.0f + e);
}

// log(1 + exp(x)) without overflow.
inline float stable_softplus(float x) {
  return std::fmax(x, 0.0f) + std::log1p(std::exp(-std::fabs(x)));
}

// Sum of a[i] * b[i] over n terms (b may be null: plain sum) in a fixed blocked order
// (8 partial sums, then a fixed tree), so the result does not depend on threads or ISA.
template <typename LoadA, typename LoadB>
inline float blocked_dot(int64_t n, LoadA&& a, LoadB&& b) {
  constexpr int kLanes = 8;
  float acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a(i + l) * b(i + l);
  }
  for (int l = 0; i < n; ++i, ++l) acc[l] += a(i) * b(i);
  float s01 = acc[0] + acc[1], s23 = acc[2] + acc[3], s45 = acc[4] + acc[5], s67 = acc[6] + acc[7];
  return (s01 + s23) + (s45 + s67);
}

}  // namespace moegrad

#endif  // MOEGRAD_CORE_MATH_H_
