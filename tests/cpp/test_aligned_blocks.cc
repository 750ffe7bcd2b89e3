// Aligned expert blocks (docs/operators.md §8.13, decisions D36) through the C++ API: init
// routing with align_block against a reference of the layout written here (stable sort, blocks
// rounded up to a multiple of m, zero padding), and finalize routing, its grad and the init
// routing grad consuming that layout give the results of the unpadded layout (bit for bit:
// the same rows are summed in the same order), with zero gradient rows for the padding.
#include <algorithm>
#include <numeric>

#include <moegrad/moegrad.h>

#include "test_util.h"

using namespace mgt;

namespace {

using moegrad::DType;
using moegrad::TensorView;

TensorView view(Tensor& t) {
  return TensorView::contiguous(t.data(), static_cast<DType>(t.dtype()), t.shape());
}

struct Layout {
  std::vector<int32_t> index;    // slot -> padded row
  std::vector<int64_t> offsets;  // block starts, bins + 1
  std::vector<int64_t> counts;   // real counts
  std::vector<int32_t> src;      // padded row -> slot (-1: zero row)
};

// The D36 layout of the window [lo, hi), from the definition.
Layout reference_layout(const std::vector<int32_t>& e, int64_t lo, int64_t hi, int64_t m,
                        int64_t rows) {
  const int64_t N = static_cast<int64_t>(e.size()), bins = hi - lo;
  Layout L;
  L.index.assign(N, -1);
  L.counts.assign(bins, 0);
  L.src.assign(rows, -1);
  for (int32_t v : e) {
    if (v >= lo && v < hi) ++L.counts[v - lo];
  }
  L.offsets.assign(bins + 1, 0);
  for (int64_t b = 0; b < bins; ++b) L.offsets[b + 1] = L.offsets[b] + (L.counts[b] + m - 1) / m * m;
  std::vector<int64_t> fill(bins, 0);
  for (int64_t s = 0; s < N; ++s) {  // slot order = the stable sort's order within an expert
    const int64_t b = e[s] - lo;
    if (b < 0 || b >= bins) continue;
    const int64_t row = L.offsets[b] + fill[b]++;
    L.index[s] = static_cast<int32_t>(row);
    L.src[row] = static_cast<int32_t>(s);
  }
  return L;
}

struct Aligned {
  Tensor ex, idx, counts, offsets;
};

Aligned run_init(Tensor& x, Tensor& e, int64_t E, int64_t m, bool window, int64_t lo, int64_t hi) {
  const int64_t R = x.shape()[0], H = x.shape()[1], K = e.shape()[1];
  const int64_t bins = hi - lo;
  const int64_t rows = m > 1 ? R * K + bins * (m - 1) : R * K;
  Aligned a{Tensor({rows, H}, x.dtype()), Tensor({R * K}, ACL_INT32), Tensor({bins}, ACL_INT64),
            Tensor({m > 1 ? bins + 1 : 0}, ACL_INT64)};
  a.ex.poison();
  a.idx.poison();
  a.counts.poison();
  a.offsets.poison();
  moegrad::InitRoutingAttrs at;
  at.expert_num = E;
  at.expert_tokens_num_flag = true;
  at.expert_tokens_num_type = 1;
  at.has_range = window;
  at.expert_start = lo;
  at.expert_end = hi;
  at.align_block = m;
  TensorView vx = view(x), ve = view(e), vex = view(a.ex), vidx = view(a.idx),
             vc = view(a.counts), vo = view(a.offsets);
  moegrad::run_now(*moegrad::plan_moe_init_routing(&vx, &ve, at, &vex, &vidx, &vc,
                                                   m > 1 ? &vo : nullptr));
  return a;
}

struct AlignCase {
  int64_t R, K, E, H, m;
  bool window;
  int64_t lo, hi;
};

class AlignedBlocks : public testing::TestWithParam<AlignCase> {};

TEST_P(AlignedBlocks, LayoutMatchesDefinition) {
  SCOPED_TRACE(seed_trace());
  const AlignCase c = GetParam();
  Rng rng(static_cast<uint32_t>(c.R * 7 + c.m));
  Tensor x = Tensor::from({c.R, c.H}, ACL_BF16, rng.uniform_vec(c.R * c.H, -2.0, 2.0));
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < c.R; ++r) {
    std::vector<int32_t> p = rng.permutation(static_cast<int32_t>(c.E));
    ids.insert(ids.end(), p.begin(), p.begin() + c.K);
  }
  Tensor e = Tensor::from_i32({c.R, c.K}, ids);
  const int64_t lo = c.window ? c.lo : 0, hi = c.window ? c.hi : c.E;
  Aligned a = run_init(x, e, c.E, c.m, c.window, lo, hi);
  const int64_t rows = a.ex.shape()[0];
  Layout ref = reference_layout(ids, lo, hi, c.m, rows);
  for (int64_t s = 0; s < c.R * c.K; ++s) ASSERT_EQ(a.idx.i32(s), ref.index[s]) << "slot " << s;
  for (int64_t b = 0; b < hi - lo; ++b) {
    ASSERT_EQ(a.counts.get(b), static_cast<double>(ref.counts[b])) << "real count " << b;
  }
  for (int64_t b = 0; c.m > 1 && b <= hi - lo; ++b) {
    ASSERT_EQ(a.offsets.get(b), static_cast<double>(ref.offsets[b])) << "offset " << b;
    ASSERT_EQ(ref.offsets[b] % c.m, 0);
  }
  for (int64_t d = 0; d < rows; ++d) {
    for (int64_t h = 0; h < c.H; ++h) {
      const double want = ref.src[d] < 0 ? 0.0 : x.get(ref.src[d] / c.K * c.H + h);
      ASSERT_EQ(a.ex.get(d * c.H + h), want) << "row " << d << " col " << h;
    }
  }
}

// Finalize routing (mode 2), its grad and the init routing grad on the padded layout equal the
// same calls on the unpadded layout; padding rows of grad_expanded_x are zero.
TEST_P(AlignedBlocks, ConsumersMatchUnpaddedLayout) {
  SCOPED_TRACE(seed_trace());
  const AlignCase c = GetParam();
  if (c.m <= 1) GTEST_SKIP();
  Rng rng(static_cast<uint32_t>(c.R * 5 + c.m));
  const int64_t R = c.R, K = c.K, H = c.H;
  Tensor x = Tensor::from({R, H}, ACL_FLOAT, rng.uniform_vec(R * H, -2.0, 2.0));
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < R; ++r) {
    std::vector<int32_t> p = rng.permutation(static_cast<int32_t>(c.E));
    ids.insert(ids.end(), p.begin(), p.begin() + K);
  }
  Tensor e = Tensor::from_i32({R, K}, ids);
  const int64_t lo = c.window ? c.lo : 0, hi = c.window ? c.hi : c.E;
  Aligned pad = run_init(x, e, c.E, c.m, c.window, lo, hi);
  Aligned flat = run_init(x, e, c.E, 1, c.window, lo, hi);
  const int64_t rows = pad.ex.shape()[0];
  Tensor scales = Tensor::from({R, K}, ACL_FLOAT, rng.uniform_vec(R * K, 0.1, 1.0));
  // Expert outputs: a per-row function of the expanded row (the same in both layouts).
  auto expert_out = [&](Aligned& a) {
    std::vector<double> y(static_cast<size_t>(a.ex.numel()));
    for (int64_t i = 0; i < a.ex.numel(); ++i) {
      const double v = a.ex.get(i);
      y[i] = v * v - 0.5 * v;
    }
    return Tensor::from({a.ex.shape()[0], H}, ACL_FLOAT, y);
  };
  Tensor yp = expert_out(pad), yf = expert_out(flat);
  auto finalize = [&](Tensor& ex, Tensor& idx, bool padded) {
    Tensor out({R, H}, ACL_FLOAT);
    out.poison();
    TensorView vex = view(ex), vidx = view(idx), vs = view(scales), vout = view(out);
    moegrad::FinalizeRoutingAttrs at;
    at.drop_pad_mode = 2;
    at.padded = padded;
    moegrad::run_now(*moegrad::plan_moe_finalize_routing(&vex, &vidx, nullptr, nullptr, nullptr,
                                                         &vs, nullptr, at, &vout));
    return out;
  };
  Tensor op = finalize(yp, pad.idx, true), of = finalize(yf, flat.idx, false);
  for (int64_t i = 0; i < R * H; ++i) ASSERT_EQ(op.get(i), of.get(i)) << "finalize " << i;

  Tensor gy = Tensor::from({R, H}, ACL_FLOAT, rng.uniform_vec(R * H, -1.0, 1.0));
  auto fgrad = [&](Tensor& ex, Tensor& idx, int64_t padded_rows, Tensor& gex, Tensor& gs) {
    gex.poison();
    gs.poison();
    TensorView vgy = view(gy), vidx = view(idx), vex = view(ex), vs = view(scales),
               vgex = view(gex), vgs = view(gs);
    moegrad::FinalizeRoutingGradAttrs at;
    at.drop_pad_mode = 0;
    at.padded_rows = padded_rows;
    moegrad::run_now(*moegrad::plan_moe_finalize_routing_grad(&vgy, &vidx, &vex, &vs, nullptr,
                                                              nullptr, at, &vgex, &vgs));
  };
  Tensor gexp({rows, H}, ACL_FLOAT), gsp({R, K}, ACL_FLOAT);
  Tensor gexf({R * K, H}, ACL_FLOAT), gsf({R, K}, ACL_FLOAT);
  fgrad(yp, pad.idx, rows, gexp, gsp);
  fgrad(yf, flat.idx, 0, gexf, gsf);
  for (int64_t i = 0; i < R * K; ++i) ASSERT_EQ(gsp.get(i), gsf.get(i)) << "grad_scales " << i;
  std::vector<bool> used(rows, false);
  for (int64_t s = 0; s < R * K; ++s) {
    const int32_t dp = pad.idx.i32(s), df = flat.idx.i32(s);
    ASSERT_EQ(dp < 0, df < 0);
    if (dp < 0) continue;
    used[dp] = true;
    for (int64_t h = 0; h < H; ++h) ASSERT_EQ(gexp.get(dp * H + h), gexf.get(df * H + h));
  }
  for (int64_t d = 0; d < rows; ++d) {
    if (used[d]) continue;
    for (int64_t h = 0; h < H; ++h) ASSERT_EQ(gexp.get(d * H + h), 0.0) << "padding row " << d;
  }

  auto igrad = [&](Tensor& gex, Tensor& idx, int64_t padded_rows) {
    Tensor gx({R, H}, ACL_FLOAT);
    gx.poison();
    TensorView vg = view(gex), vidx = view(idx), vgx = view(gx);
    moegrad::InitRoutingGradAttrs at;
    at.top_k = K;
    at.padded_rows = padded_rows;
    moegrad::run_now(*moegrad::plan_moe_init_routing_grad(&vg, &vidx, at, &vgx));
    return gx;
  };
  Tensor gxp = igrad(gexp, pad.idx, rows), gxf = igrad(gexf, flat.idx, 0);
  for (int64_t i = 0; i < R * H; ++i) ASSERT_EQ(gxp.get(i), gxf.get(i)) << "grad_x " << i;
}

INSTANTIATE_TEST_SUITE_P(
    MoeInitRouting, AlignedBlocks,
    testing::Values(AlignCase{37, 2, 8, 5, 16, false, 0, 0}, AlignCase{64, 4, 32, 3, 32, false, 0, 0},
                    AlignCase{23, 3, 6, 7, 4, true, 2, 5}, AlignCase{1, 1, 2, 1, 128, false, 0, 0},
                    AlignCase{0, 2, 4, 3, 16, false, 0, 0}, AlignCase{50, 2, 4, 4, 1, false, 0, 0},
                    AlignCase{300, 8, 16, 2, 16, true, 0, 8}),
    [](const testing::TestParamInfo<AlignCase>& info) {
      const AlignCase& c = info.param;
      return "R" + std::to_string(c.R) + "_K" + std::to_string(c.K) + "_E" + std::to_string(c.E) +
             "_m" + std::to_string(c.m) + (c.window ? "_window" : "");
    });

// Rules of D36: each names the argument and leaves the outputs untouched.
TEST(AlignedBlocks, Rejected) {
  Tensor x = Tensor::from({3, 2}, ACL_FLOAT, {0.1, 0.2, 1.1, 1.2, 2.1, 2.2});
  Tensor e = Tensor::from_i32({3, 2}, {3, 1, 1, 0, 3, 2});
  Tensor ex({6 + 4 * 15, 2}, ACL_FLOAT), idx({6}, ACL_INT32), off({5}, ACL_INT64);
  TensorView vx = view(x), ve = view(e), vex = view(ex), vidx = view(idx), vo = view(off);
  auto expect = [&](moegrad::InitRoutingAttrs at, const std::string& arg) {
    ex.poison();
    idx.poison();
    off.poison();
    try {
      moegrad::plan_moe_init_routing(&vx, &ve, at, &vex, &vidx, nullptr, &vo);
      ADD_FAILURE() << "accepted; expected an error naming " << arg;
    } catch (const moegrad::Error& err) {
      EXPECT_EQ(err.code(), ACLNN_ERR_INNER_NULLPTR) << err.what();
      EXPECT_TRUE(names_any(err.what(), arg)) << err.what();
    }
    EXPECT_TRUE(ex.all_poison() && idx.all_poison() && off.all_poison());
  };
  moegrad::InitRoutingAttrs base;
  base.expert_num = 4;
  base.align_block = 16;
  moegrad::run_now(*moegrad::plan_moe_init_routing(&vx, &ve, base, &vex, &vidx, nullptr, &vo));
  auto a = base;
  a.align_block = -1;
  expect(a, "align_block");
  a = base;
  a.align_block = 5000;
  expect(a, "align_block");
  a = base;
  a.active_num = 4;
  expect(a, "active_num");
  a = base;
  a.row_idx_type = 1;
  expect(a, "row_idx_type");
  a = base;
  a.expert_num = 0;
  expect(a, "expert_num");
  // Finalize: padded with a drop-pad mode; grads: padded_rows with active_num.
  moegrad::FinalizeRoutingAttrs fa;
  fa.drop_pad_mode = 3;
  fa.padded = true;
  Tensor ex3({4, 2, 2}, ACL_FLOAT), out({3, 2}, ACL_FLOAT);
  Tensor ridx = Tensor::from_i32({6}, {0, 1, 2, 3, 4, 5});
  Tensor sc = Tensor::from({3, 2}, ACL_FLOAT, {1, 1, 1, 1, 1, 1});
  TensorView v3 = view(ex3), vr = view(ridx), vs = view(sc), vout = view(out);
  try {
    moegrad::plan_moe_finalize_routing(&v3, &vr, nullptr, nullptr, nullptr, &vs, nullptr, fa,
                                       &vout);
    ADD_FAILURE() << "finalize accepted padded with drop_pad_mode 3";
  } catch (const moegrad::Error& err) {
    EXPECT_TRUE(names_any(err.what(), "padded")) << err.what();
  }
  moegrad::InitRoutingGradAttrs ga;
  ga.top_k = 2;
  ga.active_num = 3;
  ga.padded_rows = 66;
  Tensor gx({3, 2}, ACL_FLOAT);
  TensorView vgx = view(gx);
  try {
    moegrad::plan_moe_init_routing_grad(&vex, &vr, ga, &vgx);
    ADD_FAILURE() << "init routing grad accepted padded_rows with active_num";
  } catch (const moegrad::Error& err) {
    EXPECT_TRUE(names_any(err.what(), "padded_rows")) << err.what();
  }
}

}  // namespace
