// The vector FP8 encoder of the quantised SwiGLU forward (src/ops/swiglu/fp8-inl.h) against the
// scalar encoders of fp8.h, byte for byte, on EVERY compiled Highway target the CPU supports,
// e4m3fn and e5m2. Inputs: every fp32 whose top 20 bits (sign, exponent, the 11 high mantissa
// bits) take each of their 2^20 values, combined with low 12 bits chosen to decide the rounding
// (0, 1, half, half +- 1, all ones, ...): every exponent, the subnormal FP8 results, the exact
// ties and the values one bit either side of them, saturation and overflow, inf, every NaN class,
// +-0 and the fp32 subnormals. Then the same values through the block path with the multipliers
// of fp32 scales, power-of-two scales and MX e8m0 scales, in blocks of 128 and 32 with tails,
// streamed and plain stores, aligned and unaligned outputs. The scalar encoders themselves are
// checked against PyTorch's casts by the Python suite.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "test_fp8.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <vector>

#include "core/simd-inl.h"
#include "hwy/highway.h"
#include "ops/swiglu/fp8-inl.h"

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {

// n values times inv into codes, in blocks of `block` (the last one short when n is not a
// multiple), each through the kernel's EncodeBlock.
void Encode(bool e5m2, const float* v, int64_t n, int64_t block, float inv, bool stream,
            uint8_t* out) {
  for (int64_t j = 0; j < n; j += block) {
    const int64_t len = std::min(block, n - j);
    if (e5m2) {
      EncodeBlock<true>(v + j, len, inv, stream, out + j);
    } else {
      EncodeBlock<false>(v + j, len, inv, stream, out + j);
    }
  }
  hwy::FlushStream();
}

}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>

#include "hwy/aligned_allocator.h"
#include "convert_inputs.h"
#include "hwy_targets.h"
#include "ops/swiglu/fp8.h"

namespace moegrad {
HWY_EXPORT(Encode);
}  // namespace moegrad

namespace {

using moegrad_test::fbits;
using moegrad_test::ffrom;

// Low 12 bits that decide the rounding of every FP8 result (the round bit is bit 19 or higher).
constexpr uint32_t kLow[] = {0x000, 0x001, 0x002, 0x7ff, 0x800, 0x801, 0xfff, 0x555, 0xaaa};

std::vector<float> class_inputs() {
  std::vector<float> v;
  v.reserve((size_t{1} << 20) * std::size(kLow));
  for (uint32_t hi = 0; hi < (1u << 20); ++hi) {
    for (uint32_t lo : kLow) v.push_back(ffrom((hi << 12) | lo));
  }
  return v;
}

uint8_t ref(bool e5m2, float q) {
  return e5m2 ? moegrad::quant_detail::to_e5m2(q) : moegrad::quant_detail::to_e4m3fn(q);
}

using moegrad_test::for_each_target;

// Encodes v (times inv) on every target and compares each code with the scalar encoder's.
void check(bool e5m2, const std::vector<float>& v, int64_t block, float inv, bool stream,
           size_t misalign) {
  std::vector<uint8_t> want(v.size());
  for (size_t i = 0; i < v.size(); ++i) want[i] = ref(e5m2, v[i] * inv);
  auto buf = hwy::AllocateAligned<uint8_t>(v.size() + 64);
  uint8_t* out = buf.get() + misalign;
  for_each_target([&](int64_t) {
    std::memset(out, 0xa5, v.size());
    HWY_DYNAMIC_DISPATCH(moegrad::Encode)(e5m2, v.data(), static_cast<int64_t>(v.size()), block,
                                          inv, stream, out);
    for (size_t i = 0; i < v.size(); ++i) {
      ASSERT_EQ(static_cast<int>(out[i]), static_cast<int>(want[i]))
          << (e5m2 ? "e5m2" : "e4m3fn") << " input bits 0x" << std::hex << fbits(v[i])
          << " times 0x" << fbits(inv) << " (element " << std::dec << i << ", block " << block
          << ", stream " << stream << ", misalign " << misalign << ")";
    }
  });
}

// Every class of fp32 input, encoded as it is (multiplier 1).
void check_all_classes(bool e5m2) {
  const std::vector<float> v = class_inputs();
  check(e5m2, v, 128, 1.0f, false, 0);
  check(e5m2, v, 128, 1.0f, true, 0);
}

TEST(Fp8Encode, E4m3fnEveryInputClassOnEveryTarget) { check_all_classes(false); }
TEST(Fp8Encode, E5m2EveryInputClassOnEveryTarget) { check_all_classes(true); }

// The same inputs (every 7th, so each multiplier moves them across classes) through the block
// path with the multipliers the kernel uses: fmax / amax (fp32 scales), the reciprocal of a
// power-of-two scale (round_scale, and the e8m0 scales of MX blocks of 32), blocks of 128 and
// 32 with a short last block, streamed and plain stores, 16-byte aligned and unaligned codes.
void check_scaled(bool e5m2) {
  const std::vector<float> all = class_inputs();
  std::vector<float> v;
  for (size_t i = 0; i < all.size(); i += 7) v.push_back(all[i]);
  v.resize(v.size() / 128 * 128 - 37);  // a short last block of either size
  const float fmax = e5m2 ? 57344.0f : 448.0f;
  // fp32-scale multipliers fmax / amax for a few amax values (1e-4 is the floor).
  for (float amax : {1e-4f, 0.37f, 1.0f, 3.1415927f, 1000.5f, 6.5e4f}) {
    check(e5m2, v, 128, fmax / amax, false, 0);
  }
  // power-of-two scales 2^k: multipliers 2^-k (round_scale; MX e8m0 codes 127 + k).
  for (int k : {-20, -9, -3, 0, 1, 7, 15, 30}) {
    const float inv = ffrom(static_cast<uint32_t>(127 - k) << 23);
    check(e5m2, v, 128, inv, k % 2 == 0, 0);
    check(e5m2, v, 32, inv, true, 0);
    check(e5m2, v, 32, inv, true, 3);   // unaligned codes: the plain stores
    check(e5m2, v, 128, inv, false, 1);
  }
}

TEST(Fp8Encode, E4m3fnScaledBlocksOnEveryTarget) { check_scaled(false); }
TEST(Fp8Encode, E5m2ScaledBlocksOnEveryTarget) { check_scaled(true); }

// Known codes, so that the comparison above cannot pass with two wrong encoders.
TEST(Fp8Encode, ScalarReferenceKnownCodes) {
  using moegrad::quant_detail::to_e4m3fn;
  using moegrad::quant_detail::to_e5m2;
  EXPECT_EQ(to_e4m3fn(0.0f), 0x00);
  EXPECT_EQ(to_e4m3fn(-0.0f), 0x80);
  EXPECT_EQ(to_e4m3fn(1.0f), 0x38);
  EXPECT_EQ(to_e4m3fn(448.0f), 0x7e);
  EXPECT_EQ(to_e4m3fn(-448.0f), 0xfe);
  EXPECT_EQ(to_e4m3fn(464.0f), 0x7e);  // a tie between 448 and 480: even
  EXPECT_EQ(to_e4m3fn(ffrom(fbits(464.0f) + 1)), 0x7f);
  EXPECT_EQ(to_e4m3fn(1e30f), 0x7f);
  EXPECT_EQ(to_e4m3fn(-std::numeric_limits<float>::infinity()), 0xff);
  EXPECT_EQ(to_e4m3fn(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(to_e4m3fn(0x1p-9f), 0x01);   // the smallest subnormal
  EXPECT_EQ(to_e4m3fn(0x1p-10f), 0x00);  // half of it: a tie to even (0)
  EXPECT_EQ(to_e4m3fn(0x3p-10f), 0x02);  // 1.5 steps: a tie to even (2)
  EXPECT_EQ(to_e4m3fn(0x1.1p0f), 0x38);  // 1 + 1/16: a tie between 1 and 1.125, to even
  EXPECT_EQ(to_e4m3fn(0x1.3p0f), 0x3a);  // 1 + 3/16: a tie, to even (1.25)
  EXPECT_EQ(to_e5m2(1.0f), 0x3c);
  EXPECT_EQ(to_e5m2(57344.0f), 0x7b);
  EXPECT_EQ(to_e5m2(61440.0f), 0x7c);  // the tie above the largest finite: inf
  EXPECT_EQ(to_e5m2(-std::numeric_limits<float>::infinity()), 0xfc);
  EXPECT_EQ(to_e5m2(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(to_e5m2(0x1p-16f), 0x01);
  EXPECT_EQ(to_e5m2(0x1p-17f), 0x00);
  EXPECT_EQ(to_e5m2(-0x3p-17f), 0x82);
}

}  // namespace
#endif  // HWY_ONCE
