// The scalar formula headers shared by the CPU and CUDA kernels (docs/cuda.md "One formula, two
// backends", docs/decisions.md L200), compiled here by the host compiler: the SwiGLU row count
// (L202), clamp masks, values and quantisation scale; the gating ranking key (L2); the
// init-routing rows and count encodings.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "ops/gating_topk/gating_formula.h"
#include "ops/init_routing/init_routing_formula.h"
#include "ops/swiglu/swiglu_formula.h"

namespace {

using namespace moegrad;
namespace sf = moegrad::swiglu_formula;
namespace gf = moegrad::gating_formula;
namespace irf = moegrad::init_routing_formula;

TEST(SwigluFormula, RowCountIsTheExactSumClamped) {
  const int64_t big = int64_t{1} << 62, mx = std::numeric_limits<int64_t>::max();
  auto rows = [](std::initializer_list<int64_t> g, int64_t T) {
    sf::Sum128 s = 0;
    for (int64_t v : g) s += v;
    return sf::rows_of_sum(s, T);
  };
  EXPECT_EQ(rows({big + 10, -big}, 100), 10);  // saturating terms at 2^62 would give 0
  EXPECT_EQ(rows({mx, mx, -mx - 1, -mx + 2}, 100), 1);
  EXPECT_EQ(rows({mx, mx, mx}, 7), 7);
  EXPECT_EQ(rows({-mx - 1, 5}, 7), 0);
  EXPECT_EQ(rows({}, 7), 0);
  EXPECT_EQ(rows({3, 4}, 7), 7);
}

TEST(SwigluFormula, ClampMasksAreStrictOnTheUnclampedInputs) {
  const sf::Clamp on{2.0f, true}, off{2.0f, false};
  EXPECT_EQ(on.gate(3.0f), 2.0f);
  EXPECT_EQ(on.gate(-5.0f), -5.0f);  // the gate half is capped above only
  EXPECT_EQ(on.up(-5.0f), -2.0f);
  EXPECT_TRUE(std::isnan(on.up(std::nanf(""))));
  EXPECT_FALSE(on.gate_passes(2.0f));
  EXPECT_TRUE(on.gate_passes(1.999f));
  EXPECT_FALSE(on.up_passes(-2.0f));
  EXPECT_TRUE(on.up_passes(0.5f));
  EXPECT_TRUE(off.gate_passes(1e30f) && off.up_passes(-1e30f));
  float ga = 1.0f, gb = 1.0f;
  sf::backward<false>(3.0f, -3.0f, 1.5f, 0.5f, on, ga, gb);
  EXPECT_EQ(ga, 0.0f);
  EXPECT_EQ(gb, 0.0f);
}

TEST(SwigluFormula, ValuesAgainstDouble) {
  const sf::Clamp off{0.0f, false};
  for (float a : {-30.0f, -3.0f, -0.5f, 0.0f, 0.25f, 2.0f, 12.0f}) {
    for (bool fast : {false, true}) {
      const float b = 1.25f, w = 0.75f, g = -0.5f;
      const double s = 1.0 / (1.0 + std::exp(-static_cast<double>(a)));
      const double y = a * s * b * w;
      const float got = fast ? sf::forward<true>(a, b, w, off) : sf::forward<false>(a, b, w, off);
      EXPECT_NEAR(got, y, 2e-6 * std::fabs(y) + 1e-30) << a;
      float ga, gb;
      if (fast) {
        sf::backward<true>(a, b, g, w, off, ga, gb);
      } else {
        sf::backward<false>(a, b, g, w, off, ga, gb);
      }
      const double dga = g * w * b * s * (1.0 + a * (1.0 - s)), dgb = g * w * a * s;
      EXPECT_NEAR(ga, dga, 4e-6 * std::fabs(dga) + 1e-30) << a;
      EXPECT_NEAR(gb, dgb, 4e-6 * std::fabs(dgb) + 1e-30) << a;
    }
  }
  EXPECT_TRUE(std::isnan(formula::sigmoid_stable(std::nanf(""))));
  EXPECT_EQ(formula::sigmoid_stable(-200.0f), 0.0f);
  EXPECT_EQ(formula::sigmoid_stable(200.0f), 1.0f);
}

TEST(SwigluFormula, BlockScaleAndCodes) {
  float inv = 0.0f;
  // Plain scale: amax / fmax, multiplier fmax / amax; the amax floor is 1e-4.
  EXPECT_EQ(sf::block_scale(896.0f, 448.0f, false, &inv), 2.0f);
  EXPECT_EQ(inv, 0.5f);
  EXPECT_EQ(sf::block_scale(0.0f, 448.0f, false, &inv), 1e-4f / 448.0f);
  // Power-of-two scale: the next power of two and its exact reciprocal.
  const float s = sf::block_scale(1000.0f, 448.0f, true, &inv);
  EXPECT_EQ(s, 4.0f);
  EXPECT_EQ(inv, 0.25f);
  EXPECT_EQ(sf::e8m0_code(4.0f), 129);
  // Finite amax only.
  EXPECT_EQ(sf::amax_step(1.0f, -3.0f), 3.0f);
  EXPECT_EQ(sf::amax_step(1.0f, std::numeric_limits<float>::infinity()), 1.0f);
  EXPECT_EQ(sf::amax_step(1.0f, std::nanf("")), 1.0f);
  // PyTorch's float8 codes: 448 is e4m3fn's largest, 480 and above its NaN code; e5m2 overflows
  // to inf.
  EXPECT_EQ(sf::encode(448.0f, 1.0f, false), 0x7e);
  EXPECT_EQ(sf::encode(-480.0f, 1.0f, false), 0xff);
  EXPECT_EQ(sf::encode(65536.0f, 1.0f, true), 0x7c);
  EXPECT_EQ(sf::encode(1.0f, 2.0f, false), 0x40);  // 2.0
  EXPECT_EQ(sf::fp8_max(false), 448.0f);
  EXPECT_EQ(sf::fp8_max(true), 57344.0f);
}

TEST(GatingFormula, RankKeyOrder) {
  const float nan = std::nanf("");
  EXPECT_GT(gf::rank_key(2.0f, 5), gf::rank_key(1.0f, 0));
  EXPECT_GT(gf::rank_key(-1.0f, 5), gf::rank_key(-2.0f, 0));
  EXPECT_GT(gf::rank_key(nan, 9), gf::rank_key(1e30f, 0));  // NaN ranks first
  EXPECT_GT(gf::rank_key(0.0f, 1), gf::rank_key(-0.0f, 2));  // -0 == +0: lower index first
  EXPECT_GT(gf::rank_key(-0.0f, 1), gf::rank_key(0.0f, 2));
  EXPECT_GT(gf::rank_key(-std::numeric_limits<float>::infinity(), 3), uint64_t{0});
  for (int32_t i : {0, 1, 77, 2047}) EXPECT_EQ(gf::key_index(gf::rank_key(0.5f, i)), i);
  EXPECT_NEAR(gf::sqrt_softplus(0.0f), std::sqrt(std::log(2.0)), 1e-6);
  EXPECT_NEAR(gf::sqrt_softplus_grad(1e-6f), 5e-7f, 1e-12);
}

TEST(InitRoutingFormula, RowsAndCounts) {
  EXPECT_EQ(irf::dest_row(7, 2, 5, false, 3), 7);
  EXPECT_EQ(irf::dest_row(7, 2, 5, true, 3), 2 * 3 + 2);
  EXPECT_EQ(irf::dest_row(8, 2, 5, true, 3), -1);  // past the capacity
  const int32_t starts[] = {0, 2, 2, 7};
  EXPECT_EQ(irf::drop_pad_source(0, 3, starts), 0);
  EXPECT_EQ(irf::drop_pad_source(2, 3, starts), -1);  // bin 0 holds 2
  EXPECT_EQ(irf::drop_pad_source(3, 3, starts), -1);  // bin 1 is empty
  EXPECT_EQ(irf::drop_pad_source(8, 3, starts), 4);   // bin 2, rank 2
  EXPECT_EQ(irf::token_value(0, 2, 7), 7);
  EXPECT_EQ(irf::token_value(1, 2, 7), 5);
  EXPECT_TRUE(irf::grad_row_valid(0, 1));
  EXPECT_FALSE(irf::grad_row_valid(-1, 5));
  EXPECT_FALSE(irf::grad_row_valid(5, 5));
}

}  // namespace
