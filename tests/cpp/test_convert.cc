// The shared fp16/bf16 conversions (core/convert.h, also compiled for CUDA device code) against
// the compiler's: fp16 against _Float16 casts (round-to-nearest-even), bf16 against a
// round-to-nearest-even computed here in double precision.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "convert_inputs.h"
#include "core/convert.h"

namespace {

using moegrad_test::fbits;
using moegrad_test::ffrom;

uint16_t half_bits(_Float16 h) {
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}
_Float16 half_from(uint16_t u) {
  _Float16 h;
  std::memcpy(&h, &u, 2);
  return h;
}

// Round-to-nearest-even of a finite float to bf16, computed with double arithmetic.
uint16_t bf16_reference(float f) {
  const uint32_t u = fbits(f);
  const uint32_t lo = u & 0xffff0000u;  // truncation toward zero (same sign)
  const uint32_t hi = lo + 0x10000u;    // next bf16 away from zero (may be inf)
  const double d = std::fabs(static_cast<double>(f));
  const double dlo = std::fabs(static_cast<double>(ffrom(lo)));
  // Past the largest bf16 the next step up is 2^128, which rounds to inf.
  const bool top = (hi & 0x7fffffffu) >= 0x7f800000u;
  const double dhi = top ? std::ldexp(1.0, 128) : std::fabs(static_cast<double>(ffrom(hi)));
  const double up_gap = dhi - d;
  const double down_gap = d - dlo;
  uint32_t r;
  if (down_gap < up_gap) {
    r = lo;
  } else if (up_gap < down_gap) {
    r = top ? ((u & 0x80000000u) | 0x7f800000u) : hi;
  } else {
    r = ((lo >> 16) & 1u) ? (top ? ((u & 0x80000000u) | 0x7f800000u) : hi) : lo;
  }
  return static_cast<uint16_t>(r >> 16);
}

TEST(Convert, Fp16WideningMatchesTheCompilerForAll65536) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float want = static_cast<float>(half_from(static_cast<uint16_t>(h)));
    const float got = moegrad::f16_bits_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << h;
      EXPECT_EQ(fbits(got) & 0x80000000u, fbits(want) & 0x80000000u) << std::hex << h;
    } else {
      ASSERT_EQ(fbits(got), fbits(want)) << std::hex << h;
    }
  }
}

TEST(Convert, Bf16WideningIsExactForAll65536) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    ASSERT_EQ(fbits(moegrad::bf16_bits_to_f32(static_cast<uint16_t>(b))), b << 16) << std::hex << b;
  }
}

TEST(Convert, Fp16NarrowingMatchesTheCompiler) {
  int64_t n = 0;
  for (uint32_t u : moegrad_test::narrowing_inputs()) {
    const float f = ffrom(u);
    const uint16_t want = half_bits(static_cast<_Float16>(f));
    const uint16_t got = moegrad::f32_to_f16_bits(f);
    if (std::isnan(f)) {
      ASSERT_EQ(got & 0x7c00u, 0x7c00u) << std::hex << u;
      ASSERT_NE(got & 0x3ffu, 0u) << std::hex << u;
      EXPECT_EQ(got & 0x8000u, want & 0x8000u) << std::hex << u;
    } else {
      ASSERT_EQ(got, want) << "input bits 0x" << std::hex << u << " (" << f << ")";
    }
    ++n;
  }
  EXPECT_GT(n, 1000000);
}

TEST(Convert, Bf16NarrowingIsRoundToNearestEven) {
  for (uint32_t u : moegrad_test::narrowing_inputs()) {
    const float f = ffrom(u);
    const uint16_t got = moegrad::f32_to_bf16_bits(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(moegrad::bf16_bits_to_f32(got))) << std::hex << u;
      EXPECT_EQ(got & 0x8000u, (u >> 16) & 0x8000u);
      continue;
    }
    ASSERT_EQ(got, bf16_reference(f)) << "input bits 0x" << std::hex << u << " (" << f << ")";
  }
}

TEST(Convert, NarrowIndexMapsOutOfRangeToInvalid) {
  EXPECT_EQ(moegrad::narrow_index(5), 5);
  EXPECT_EQ(moegrad::narrow_index(-1), -1);
  EXPECT_EQ(moegrad::narrow_index(2147483647), 2147483647);
  EXPECT_EQ(moegrad::narrow_index((int64_t{1} << 32) + 6), std::numeric_limits<int32_t>::min());
  EXPECT_EQ(moegrad::narrow_index(-(int64_t{1} << 40)), std::numeric_limits<int32_t>::min());
}

}  // namespace
