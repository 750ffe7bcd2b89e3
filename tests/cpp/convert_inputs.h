// Inputs shared by the scalar conversion tests (test_convert.cc) and the SIMD conversion tests
// of every compiled target (test_simd.cc).
#ifndef MOEGRAD_TESTS_CPP_CONVERT_INPUTS_H_
#define MOEGRAD_TESTS_CPP_CONVERT_INPUTS_H_

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace moegrad_test {

inline uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float ffrom(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline _Float16 hfrom(uint16_t u) {
  _Float16 h;
  std::memcpy(&h, &u, 2);
  return h;
}

// Every float tested for narrowing: a dense sweep (every 4099th bit pattern, so every exponent
// and a spread of mantissas), the neighbourhoods of every fp16/bf16 rounding boundary and tie,
// and the specials.
inline std::vector<uint32_t> narrowing_inputs() {
  std::vector<uint32_t> v;
  for (uint64_t u = 0; u <= 0xffffffffull; u += 4099) v.push_back(static_cast<uint32_t>(u));
  for (uint32_t h = 0; h < 0x10000; ++h) {
    // fp16 value h widened, and the halfway points to its neighbours (ties), +-1 ulp.
    const uint32_t f = fbits(static_cast<float>(hfrom(static_cast<uint16_t>(h))));
    const uint32_t b = static_cast<uint32_t>(h) << 16;  // bf16 value h widened
    for (uint32_t base : {f, b}) {
      for (int d = -2; d <= 2; ++d) v.push_back(base + static_cast<uint32_t>(d));
    }
    v.push_back(b | 0x8000u);  // bf16 tie
    v.push_back((b | 0x8000u) + 1u);
    v.push_back((b | 0x8000u) - 1u);
  }
  for (float s : {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::min(), std::numeric_limits<float>::denorm_min(),
                  65504.0f, 65519.99f, 65520.0f, 5.9604645e-08f, 2.9802322e-08f}) {
    v.push_back(fbits(s));
    v.push_back(fbits(-s));
  }
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0x7fbfffffu, 0xffc00001u, 0x7fffffffu}) {
    v.push_back(nan);
  }
  return v;
}

}  // namespace moegrad_test

#endif  // MOEGRAD_TESTS_CPP_CONVERT_INPUTS_H_
