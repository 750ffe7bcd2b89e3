// aclnnSwigluGroupQuant (§6, D24, docs/decisions.md L24-L28) through the C API: validation
// (161001 null, 161002 dtypes / modes / unsupported HiFloat8 and FP4, 561002 shapes and clamp),
// and values: the codes are decoded here (independently of the library) and compared with a
// float64 evaluation of the block formula; scales and their layout (fp32 per 128, e8m0 pairs per
// 32), partial last blocks, group_index truncation, y_origin, non-finite values, threads.
#include "reference.h"
#include "test_util.h"

using namespace mgt;

namespace {

// float8 code -> value (OCP definitions; e4m3fn has no infinity, 0x7f/0xff are NaN).
double decode_fp8(uint8_t c, bool e5m2) {
  const int sign = c & 0x80 ? -1 : 1;
  const int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
  const int e = (c & 0x7f) >> mbits, m = c & ((1 << mbits) - 1);
  if (e5m2 && e == 31) return m == 0 ? sign * INFINITY : NAN;
  if (!e5m2 && (c & 0x7f) == 0x7f) return NAN;
  if (e == 0) return sign * std::ldexp(m, 1 - bias - mbits);
  return sign * std::ldexp(1.0 + m / double(1 << mbits), e - bias);
}

struct QuantCase : OpCase {
  Tensor x, weight, group_index, scale, y, y_scale, y_origin;
  int64_t dst_type = ACL_FLOAT8_E4M3FN, quant_mode = 0, block_size = 0;
  bool round_scale = false, output_origin = true;
  double clamp = -1.0, dst_type_max = 15.0;
  std::vector<int64_t> lead;
  int64_t T, H;

  // A valid call: [lead..., 2H] input with a weight, y_origin on.
  explicit QuantCase(std::vector<int64_t> lead_dims = {3, 2}, int64_t h = 200,
                     aclDataType dt = ACL_BF16, int64_t mode = 0, uint32_t salt = 4)
      : quant_mode(mode), lead(std::move(lead_dims)), H(h) {
    Rng rng(salt);
    T = 1;
    for (int64_t v : lead) T *= v;
    std::vector<int64_t> xs = lead;
    xs.push_back(2 * H);
    std::vector<double> xv(T * 2 * H);
    for (auto& v : xv) v = rng.uniform(-4.0, 4.0);
    x = Tensor::from(xs, dt, xv);
    weight = Tensor::from({T}, ACL_FLOAT, rng.uniform_vec(T, 0.2, 1.5));
    round_scale = mode == 1;
    alloc_outputs();
  }
  std::vector<int64_t> with_last(std::vector<int64_t> s) const {
    std::vector<int64_t> r = lead;
    r.insert(r.end(), s.begin(), s.end());
    return r;
  }
  int64_t blocks() const { return (H + (quant_mode == 0 ? 127 : 31)) / (quant_mode == 0 ? 128 : 32); }
  void alloc_outputs() {
    y = Tensor(with_last({H}), static_cast<aclDataType>(dst_type));
    if (quant_mode == 0) {
      y_scale = Tensor(with_last({blocks()}), ACL_FLOAT);
    } else {
      y_scale = Tensor(with_last({(blocks() + 1) / 2, 2}), ACL_FLOAT8_E8M0);
    }
    y_origin = Tensor(with_last({H}), x.dtype());
  }
  aclnnStatus stage1(uint64_t* ws, aclOpExecutor** ex) override {
    return aclnnSwigluGroupQuantGetWorkspaceSize(
        x.handle(), weight.handle(), group_index.handle(), scale.handle(), dst_type, quant_mode,
        block_size, round_scale, clamp, dst_type_max, output_origin, y.handle(), y_scale.handle(),
        y_origin.handle(), ws, ex);
  }
  aclnnStatus stage2(void* ws, uint64_t size, aclOpExecutor* ex) override {
    return aclnnSwigluGroupQuant(ws, size, ex, nullptr);
  }
  std::vector<Tensor*> outputs() override { return {&y, &y_scale, &y_origin}; }

  // The weighted SwiGLU in float64 (§6.4), zero past the group_index total.
  std::vector<double> reference_w(int64_t* trunc_out = nullptr) const {
    std::vector<int64_t> gi;
    if (!group_index.is_null()) {
      for (int64_t i = 0; i < group_index.numel(); ++i) {
        int64_t v;
        std::memcpy(&v, static_cast<const unsigned char*>(group_index.data()) + 8 * i, 8);
        gi.push_back(v);
      }
    }
    const int64_t trunc = ref::swiglu_trunc(group_index.is_null() ? nullptr : &gi, T);
    if (trunc_out) *trunc_out = trunc;
    std::vector<double> r(T * H, 0.0);
    for (int64_t t = 0; t < trunc; ++t) {
      const double wt = weight.is_null() ? 1.0 : weight.get(t);
      for (int64_t h = 0; h < H; ++h) {
        double a = x.get(t * 2 * H + h), b = x.get(t * 2 * H + H + h);
        if (clamp > 0) {
          a = std::min(a, clamp);
          b = std::min(std::max(b, -clamp), clamp);
        }
        r[t * H + h] = a * ref::sigmoid(a) * b * wt;
      }
    }
    return r;
  }

  void check(const std::string& what) {
    const bool e5m2 = dst_type == ACL_FLOAT8_E5M2;
    const double fmax = e5m2 ? 57344.0 : 448.0;
    const int mbits = e5m2 ? 2 : 3, emin = e5m2 ? -14 : -6;
    const int64_t B = quant_mode == 0 ? 128 : 32, nb = blocks();
    const int64_t S = quant_mode == 0 ? nb : 2 * ((nb + 1) / 2);
    int64_t trunc = 0;
    const std::vector<double> ref = reference_w(&trunc);
    const auto& yb = y.bytes();
    const auto& sb = y_scale.bytes();
    int bad = 0;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t blk = 0; blk < nb; ++blk) {
        const int64_t h0 = blk * B, h1 = std::min(H, h0 + B);
        double scale;
        if (quant_mode == 0) {
          scale = y_scale.get(t * S + blk);
        } else {
          const uint8_t code = sb[t * S + blk];
          scale = t < trunc ? std::ldexp(1.0, static_cast<int>(code) - 127) : code;
        }
        if (t >= trunc) {
          EXPECT_EQ(scale, 0.0) << what << " truncated row " << t << " scale";
          for (int64_t h = h0; h < h1; ++h) EXPECT_EQ(yb[t * H + h], 0) << what << " row " << t;
          continue;
        }
        double amax = 0.0;
        for (int64_t h = h0; h < h1; ++h) amax = std::max(amax, std::fabs(ref[t * H + h]));
        const double want = std::max(amax, 1e-4) / fmax;
        if (quant_mode == 0 && !round_scale) {
          if (std::fabs(scale - want) > 4e-6 * want && bad++ < 8) {
            ADD_FAILURE() << what << " scale (" << t << "," << blk << "): got " << scale
                          << ", reference " << want << "; " << seed_trace();
          }
        } else {
          // The smallest power of two >= want (unless want sits within fp32 error of one).
          const double p2 = std::ldexp(1.0, static_cast<int>(std::ceil(std::log2(want))));
          const bool near = std::fabs(std::log2(want) - std::round(std::log2(want))) < 1e-6;
          if (!near && scale != p2 && bad++ < 8) {
            ADD_FAILURE() << what << " pow2 scale (" << t << "," << blk << "): got " << scale
                          << ", reference " << p2 << "; " << seed_trace();
          }
        }
        for (int64_t h = h0; h < h1; ++h) {
          const double q = ref[t * H + h] / scale;  // the value the code should round
          const double got = decode_fp8(yb[t * H + h], e5m2);
          int e;
          std::frexp(std::fabs(q), &e);
          const double ulp = std::ldexp(1.0, std::max(e - 1, emin) - mbits);
          const double tol = 0.5 * ulp + 2e-6 * std::fabs(q) + 1e-30;
          if (!(std::fabs(got - q) <= tol) && bad++ < 8) {
            ADD_FAILURE() << what << " y (" << t << "," << h << "): decoded " << got
                          << ", reference " << q << " (scale " << scale << ", tol " << tol
                          << "); " << seed_trace();
          }
        }
      }
      if (quant_mode == 1 && S > nb) {
        EXPECT_EQ(sb[t * S + nb], 0) << what << " pad scale " << t;
      }
    }
    EXPECT_EQ(bad, 0) << what;
    if (output_origin) expect_close(y_origin, ref, what + " y_origin");
  }
};

using R_ = Rule<QuantCase>;
constexpr aclnnStatus kNull = ACLNN_ERR_PARAM_NULLPTR;
constexpr aclnnStatus kInv = ACLNN_ERR_PARAM_INVALID;
constexpr aclnnStatus kShape = ACLNN_ERR_INNER_TILING_ERROR;

const std::vector<R_> kRules = {
    {"NullX", [](QuantCase& c) { c.x = Tensor(); }, kNull, "x"},
    {"NullY", [](QuantCase& c) { c.y = Tensor(); }, kNull, "y|yOut"},
    {"NullYScale", [](QuantCase& c) { c.y_scale = Tensor(); }, kNull, "y_scale|yScaleOut"},
    {"NullYOriginWithOutputOrigin", [](QuantCase& c) { c.y_origin = Tensor(); }, kNull, "y_origin|yOriginOut"},
    {"NullWorkspaceSize", [](QuantCase& c) { c.null_workspace_size = true; }, kNull, "workspaceSize"},
    {"HiFloat8Static", [](QuantCase& c) { c.quant_mode = 2; }, kInv, "quant_mode|quantMode", {"2", "HiFloat8"}},
    {"HiFloat8Dynamic", [](QuantCase& c) { c.quant_mode = 3; }, kInv, "quant_mode|quantMode", {"3"}},
    {"QuantMode4", [](QuantCase& c) { c.quant_mode = 4; }, kInv, "quant_mode|quantMode", {"4"}},
    {"DstHiFloat8", [](QuantCase& c) { c.dst_type = ACL_HIFLOAT8; }, kInv, "dst_type|dstType", {"34", "HiFloat8"}},
    {"DstFp4E2M1", [](QuantCase& c) { c.dst_type = ACL_FLOAT4_E2M1; }, kInv, "dst_type|dstType", {"40"}},
    {"DstFp4E1M2", [](QuantCase& c) { c.dst_type = ACL_FLOAT4_E1M2; }, kInv, "dst_type|dstType", {"41"}},
    {"DstFloat16", [](QuantCase& c) { c.dst_type = ACL_FLOAT16; }, kInv, "dst_type|dstType", {"1"}},
    {"BlockSize64", [](QuantCase& c) { c.block_size = 64; }, kInv, "block_size|blockSize", {"64"}},
    {"MxBlockSize128", [](QuantCase& c) { c.quant_mode = 1; c.round_scale = true; c.block_size = 128; c.alloc_outputs(); }, kInv, "block_size|blockSize", {"128"}},
    {"MxWithoutRoundScale", [](QuantCase& c) { c.quant_mode = 1; c.round_scale = false; c.alloc_outputs(); }, kInv, "round_scale|roundScale"},
    {"ScaleGiven", [](QuantCase& c) { c.scale = Tensor::from({1}, ACL_FLOAT, {1.0}); }, kInv, "scale|scaleOptional"},
    {"XFloat64", [](QuantCase& c) { c.x = Tensor({3, 2, 400}, ACL_DOUBLE); }, kInv, "x"},
    {"WeightFp16", [](QuantCase& c) { c.weight = Tensor({6}, ACL_FLOAT16); }, kInv, "weight|weightOptional"},
    {"GroupIndexInt32", [](QuantCase& c) { c.group_index = Tensor::from_i32({2}, {1, 2}); }, kInv, "group_index|groupIndexOptional"},
    {"YWrongFp8", [](QuantCase& c) { c.y = Tensor({3, 2, 200}, ACL_FLOAT8_E5M2); }, kInv, "y|yOut"},
    {"YFp16", [](QuantCase& c) { c.y = Tensor({3, 2, 200}, ACL_FLOAT16); }, kInv, "y|yOut"},
    {"YScaleFp16", [](QuantCase& c) { c.y_scale = Tensor({3, 2, 2}, ACL_FLOAT16); }, kInv, "y_scale|yScaleOut"},
    {"MxYScaleFp32", [](QuantCase& c) { c.quant_mode = 1; c.round_scale = true; c.alloc_outputs(); c.y_scale = Tensor({3, 2, 4, 2}, ACL_FLOAT); }, kInv, "y_scale|yScaleOut"},
    {"YOriginDtype", [](QuantCase& c) { c.y_origin = Tensor({3, 2, 200}, ACL_FLOAT); }, kInv, "y_origin|yOriginOut"},
    {"XStrided", [](QuantCase& c) { c.x = Tensor::strided({6, 400}, ACL_BF16); c.lead = {6}; c.alloc_outputs(); c.weight = Tensor({6}, ACL_FLOAT); }, kInv, "x"},
    {"XFormatNZ", [](QuantCase& c) { c.x = Tensor::formatted(ACL_FORMAT_FRACTAL_NZ, {6, 400}, ACL_BF16); c.lead = {6}; c.alloc_outputs(); c.weight = Tensor({6}, ACL_FLOAT); }, kInv, "x"},
    {"ClampZero", [](QuantCase& c) { c.clamp = 0.0; }, kShape, "clamp_limit|clampLimit"},
    {"ClampNaN", [](QuantCase& c) { c.clamp = std::nan(""); }, kShape, "clamp_limit|clampLimit"},
    {"XRank1", [](QuantCase& c) { c.x = Tensor({400}, ACL_BF16); }, kShape, "x"},
    {"XRank9", [](QuantCase& c) { c.x = Tensor({1, 1, 1, 1, 1, 1, 1, 6, 400}, ACL_BF16); }, kShape, "x"},
    {"XOddLastDim", [](QuantCase& c) { c.x = Tensor({3, 2, 399}, ACL_BF16); }, kShape, "x"},
    {"WeightNumel", [](QuantCase& c) { c.weight = Tensor({5}, ACL_FLOAT); }, kShape, "weight|weightOptional"},
    {"GroupIndexRank2", [](QuantCase& c) { c.group_index = Tensor::from_i64({1, 2}, {1, 2}); }, kShape, "group_index|groupIndexOptional"},
    {"YShape", [](QuantCase& c) { c.y = Tensor({3, 2, 201}, ACL_FLOAT8_E4M3FN); }, kShape, "y|yOut"},
    {"YScaleShape", [](QuantCase& c) { c.y_scale = Tensor({3, 2, 1}, ACL_FLOAT); }, kShape, "y_scale|yScaleOut"},
    {"MxYScaleNotPaired", [](QuantCase& c) { c.quant_mode = 1; c.round_scale = true; c.alloc_outputs(); c.y_scale = Tensor({3, 2, 7}, ACL_FLOAT8_E8M0); }, kShape, "y_scale|yScaleOut"},
    {"YOriginShape", [](QuantCase& c) { c.y_origin = Tensor({3, 2, 100}, ACL_BF16); }, kShape, "y_origin|yOriginOut"},
};

class QuantRules : public testing::TestWithParam<R_> {};

TEST_P(QuantRules, Rejected) {
  QuantCase c;
  GetParam().mutate(c);
  expect_rejected(c, GetParam().code, GetParam().arg, GetParam().words);
}

INSTANTIATE_TEST_SUITE_P(SwigluGroupQuant, QuantRules, testing::ValuesIn(kRules),
                         rule_name<QuantCase>);

TEST(SwigluGroupQuant, BaselineOfRuleTableIsValid) {
  QuantCase c;
  ASSERT_TRUE(run_ok(c));
  c.check("baseline");
}

struct QuantConfig {
  int64_t mode;
  aclDataType dst;
  bool round_scale;
  int64_t H;
};

class QuantValues
    : public testing::TestWithParam<std::tuple<aclDataType, QuantConfig, std::vector<int64_t>>> {};

TEST_P(QuantValues, MatchesFloat64BlockFormula) {
  SCOPED_TRACE(seed_trace());
  const auto [dt, q, lead] = GetParam();
  QuantCase c(lead, q.H, dt, q.mode, static_cast<uint32_t>(q.H * 3 + q.mode));
  c.dst_type = q.dst;
  c.round_scale = q.round_scale;
  c.alloc_outputs();
  ASSERT_TRUE(run_ok(c));
  c.check("values");
}

INSTANTIATE_TEST_SUITE_P(
    SwigluGroupQuant, QuantValues,
    testing::Combine(
        testing::Values(ACL_FLOAT, ACL_FLOAT16, ACL_BF16),
        testing::Values(QuantConfig{0, ACL_FLOAT8_E4M3FN, false, 256},
                        QuantConfig{0, ACL_FLOAT8_E4M3FN, true, 300},
                        QuantConfig{0, ACL_FLOAT8_E5M2, false, 129},
                        QuantConfig{0, ACL_FLOAT8_E5M2, true, 1},
                        QuantConfig{1, ACL_FLOAT8_E4M3FN, true, 96},
                        QuantConfig{1, ACL_FLOAT8_E4M3FN, true, 2600},
                        QuantConfig{1, ACL_FLOAT8_E5M2, true, 33},
                        QuantConfig{0, ACL_FLOAT8_E4M3FN, false, 4100}),
        testing::Values(std::vector<int64_t>{5}, std::vector<int64_t>{2, 3},
                        std::vector<int64_t>{1, 1, 1, 1, 1, 1, 3})),
    [](const testing::TestParamInfo<QuantValues::ParamType>& info) {
      const auto& q = std::get<1>(info.param);
      return std::string(dt_name(std::get<0>(info.param))) + "_mode" + std::to_string(q.mode) +
             (q.dst == ACL_FLOAT8_E5M2 ? "_e5m2" : "_e4m3") + (q.round_scale ? "_pow2" : "") +
             "_H" + std::to_string(q.H) + "_rank" +
             std::to_string(std::get<2>(info.param).size() + 1);
    });

// Rows at or past the group_index total are zero in y, y_scale and y_origin (D24); clamp and
// no weight.
TEST(SwigluGroupQuant, GroupIndexTruncationClampNoWeight) {
  SCOPED_TRACE(seed_trace());
  for (int64_t mode : {0, 1}) {
    QuantCase c({7}, 70, ACL_FLOAT, mode, 11);
    c.weight = Tensor();
    c.clamp = 1.5;
    c.group_index = Tensor::from_i64({3}, {2, 0, 2});
    c.poison_outputs();
    ASSERT_TRUE(run_ok(c));
    c.check("truncated mode " + std::to_string(mode));
    for (int64_t t = 4; t < 7; ++t) {
      for (int64_t h = 0; h < 70; ++h) EXPECT_EQ(c.y_origin.get(t * 70 + h), 0.0);
    }
  }
}

// output_origin off: y_origin may be null and is not written when given.
TEST(SwigluGroupQuant, NoOriginOutput) {
  QuantCase c;
  c.output_origin = false;
  c.y_origin = Tensor();
  ASSERT_TRUE(run_ok(c));
  c.check("no origin");
  QuantCase d;
  d.output_origin = false;
  d.y_origin = Tensor({4}, ACL_FLOAT);
  d.y_origin.poison();
  uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(d.stage1(&ws, &ex), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  ASSERT_EQ(d.stage2(nullptr, 0, ex), ACLNN_SUCCESS);
  EXPECT_TRUE(d.y_origin.all_poison());
}

// uint8 tensors are accepted as the storage of y and of the e8m0 scales and give the same bytes.
TEST(SwigluGroupQuant, Uint8StorageGivesSameBytes) {
  QuantCase a({4}, 80, ACL_BF16, 1, 21), b({4}, 80, ACL_BF16, 1, 21);
  b.y = Tensor({4, 80}, ACL_UINT8);
  b.y_scale = Tensor({4, 2, 2}, ACL_UINT8);
  ASSERT_TRUE(run_ok(a));
  ASSERT_TRUE(run_ok(b));
  expect_bitwise_equal(a.y, b.y, "y");
  expect_bitwise_equal(a.y_scale, b.y_scale, "y_scale");
}

// Non-finite values: the amax ignores them; +-inf gives e4m3fn NaN (0x7f/0xff) and e5m2 inf,
// NaN stays NaN, and the finite values of the block keep their scale.
TEST(SwigluGroupQuant, NonFiniteValues) {
  for (aclDataType dst : {ACL_FLOAT8_E4M3FN, ACL_FLOAT8_E5M2}) {
    QuantCase c({1}, 4, ACL_FLOAT, 0, 1);
    c.weight = Tensor();
    c.dst_type = dst;
    c.alloc_outputs();
    // gates: 2, inf, nan, 1; ups: 1, 1, 1, -3 -> y_w = silu(2), inf, nan, -3 silu(1)
    c.x = Tensor::from({1, 8}, ACL_FLOAT, {2.0, INFINITY, NAN, 1.0, 1.0, 1.0, 1.0, -3.0});
    ASSERT_TRUE(run_ok(c));
    const double fmax = dst == ACL_FLOAT8_E5M2 ? 57344.0 : 448.0;
    const double amax = 3.0 * 1.0 * ref::sigmoid(1.0);
    EXPECT_NEAR(c.y_scale.get(0), amax / fmax, 1e-6 * amax / fmax);
    const auto& yb = c.y.bytes();
    EXPECT_EQ(yb[1], dst == ACL_FLOAT8_E5M2 ? 0x7c : 0x7f);
    EXPECT_TRUE(std::isnan(decode_fp8(yb[2], dst == ACL_FLOAT8_E5M2)));
    EXPECT_EQ(decode_fp8(yb[3], dst == ACL_FLOAT8_E5M2), -fmax);
  }
}

// An all-zero block uses the 1e-4 floor: scale 1e-4 / fmax, zero codes.
TEST(SwigluGroupQuant, ZeroBlockUsesFloor) {
  QuantCase c({2}, 10, ACL_FLOAT, 0, 1);
  c.weight = Tensor::from({2}, ACL_FLOAT, {0.0, 1.0});
  ASSERT_TRUE(run_ok(c));
  EXPECT_FLOAT_EQ(static_cast<float>(c.y_scale.get(0)), static_cast<float>(1e-4 / 448.0));
  for (int h = 0; h < 10; ++h) EXPECT_EQ(c.y.bytes()[h] & 0x7f, 0);
  c.check("zero block");
}

// D4: zero tokens are valid (empty outputs).
TEST(SwigluGroupQuant, ZeroTokens) {
  QuantCase c({0, 3}, 64, ACL_BF16, 1, 2);
  ASSERT_TRUE(run_ok(c));
  EXPECT_EQ(c.y.numel(), 0);
}

// D16: bitwise identical with 1 and 2 threads.
TEST(SwigluGroupQuant, DeterministicAcrossThreads) {
  QuantCase one({64, 8}, 200, ACL_BF16, 0, 8), two({64, 8}, 200, ACL_BF16, 0, 8);
  expect_deterministic_across_threads(one, two);
  QuantCase m1({300}, 160, ACL_FLOAT, 1, 9), m2({300}, 160, ACL_FLOAT, 1, 9);
  expect_deterministic_across_threads(m1, m2);
}

TEST(SwigluGroupQuant, WorkspaceSizeIdempotent) {
  QuantCase c;
  expect_workspace_idempotent(c);
}

}  // namespace
