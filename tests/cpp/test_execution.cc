// The execution path (docs/architecture.md): the backend is chosen in stage one from the
// tensors' device, the workspace size is honoured, each plan validates once, and the C++ API
// takes int64 indices (the C API keeps int32).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <moegrad/aclnn.h>
#include <moegrad/moegrad.h>

#include "core/acl_api.h"  // struct aclTensor: the tests set a device no pointer can have
#include "core/check.h"

namespace {

using moegrad::Device;
using moegrad::DType;
using moegrad::Error;
using moegrad::TensorView;

uint32_t seed() {
  static const uint32_t s = [] {
    const char* env = std::getenv("MOEGRAD_TEST_SEED");
    const uint32_t v = env ? static_cast<uint32_t>(std::strtoul(env, nullptr, 10))
                           : std::random_device{}();
    std::cout << "MOEGRAD_TEST_SEED=" << v << "\n";
    return v;
  }();
  return s;
}

// The status and message of a C++ call that must throw.
template <typename F>
std::pair<int32_t, std::string> error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
  return {0, ""};
}

// A valid finalize-routing forward problem (R tokens, K experts each, H hidden), host memory.
struct Finalize {
  int64_t R = 5, K = 3, H = 7;
  std::vector<float> ex, scales, out;
  std::vector<int32_t> idx32;
  std::vector<int64_t> idx64;
  Finalize() {
    std::mt19937 g(seed());
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    ex.resize(R * K * H);
    for (float& v : ex) v = u(g);
    scales.resize(R * K);
    for (float& v : scales) v = u(g);
    idx32.resize(R * K);
    for (int64_t i = 0; i < R * K; ++i) idx32[i] = static_cast<int32_t>(i);
    std::shuffle(idx32.begin(), idx32.end(), g);
    idx64.assign(idx32.begin(), idx32.end());
    out.assign(R * H, std::nanf(""));
  }
  TensorView ex_v() { return TensorView::contiguous(ex.data(), DType::kFloat32, {R * K, H}); }
  TensorView sc_v() { return TensorView::contiguous(scales.data(), DType::kFloat32, {R, K}); }
  TensorView out_v() { return TensorView::contiguous(out.data(), DType::kFloat32, {R, H}); }
  TensorView idx_v(bool wide) {
    return wide ? TensorView::contiguous(idx64.data(), DType::kInt64, {R * K})
                : TensorView::contiguous(idx32.data(), DType::kInt32, {R * K});
  }
};

// ---- stage one picks the backend ----------------------------------------------------------

TEST(Backend, CudaTensorFailsInStageOneWithoutCuda) {
#if defined(MOEGRAD_WITH_CUDA)
  GTEST_SKIP() << "CUDA build";
#else
  std::vector<float> x(8 * 4), y(8 * 2);
  TensorView xv = TensorView::contiguous(x.data(), DType::kFloat32, {8, 4}, Device::kCUDA, 0);
  TensorView yv = TensorView::contiguous(y.data(), DType::kFloat32, {8, 2}, Device::kCUDA, 0);
  auto [code, msg] = error_of([&] {
    moegrad::plan_swiglu_group(&xv, nullptr, nullptr, moegrad::SwigluAttrs{}, &yv);
  });
  EXPECT_EQ(code, moegrad::kErrParamInvalid) << msg;
  EXPECT_NE(msg.find("swiglu_group: x:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("built without CUDA"), std::string::npos) << msg;
#endif
}

TEST(Backend, MixedDevicesNameTheTensorThatDiffers) {
  Finalize f;
  TensorView ex = f.ex_v(), idx = f.idx_v(false), sc = f.sc_v(), out = f.out_v();
  sc.device = static_cast<Device>(13);
  auto [code, msg] = error_of([&] {
    moegrad::plan_moe_finalize_routing(&ex, &idx, nullptr, nullptr, nullptr, &sc, nullptr,
                                       moegrad::FinalizeRoutingAttrs{}, &out);
  });
  EXPECT_EQ(code, moegrad::kErrParamInvalid) << msg;
  EXPECT_NE(msg.find("moe_finalize_routing: scales:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("device type 13"), std::string::npos) << msg;
}

// A fake device type through the C API fails in GetWorkspaceSize (not in the run call), names
// the tensor, creates no executor and writes nothing.
TEST(Backend, FakeDeviceFailsInCStageOne) {
  for (int which = 0; which < 2; ++which) {
    std::vector<float> x(6 * 8, 0.5f), y(6 * 4, -7.0f);
    const int64_t dx[2] = {6, 8}, dy[2] = {6, 4};
    aclTensor* tx = aclCreateTensor(dx, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, dx, 2, x.data());
    aclTensor* ty = aclCreateTensor(dy, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, dy, 2, y.data());
    ASSERT_NE(tx, nullptr);
    ASSERT_NE(ty, nullptr);
    (which == 0 ? tx : ty)->view.device = static_cast<Device>(42);
    uint64_t ws = 12345;
    aclOpExecutor* ex = nullptr;
    const aclnnStatus st = aclnnSwigluGroupGetWorkspaceSize(tx, nullptr, nullptr, -1.0, ty, &ws, &ex);
    const std::string msg = aclGetRecentErrMsg();
    EXPECT_EQ(st, ACLNN_ERR_PARAM_INVALID) << msg;
    EXPECT_NE(msg.find(which == 0 ? ": x:" : ": y:"), std::string::npos) << msg;
    EXPECT_EQ(ex, nullptr);
    for (float v : y) EXPECT_EQ(v, -7.0f);
    aclDestroyTensor(tx);
    aclDestroyTensor(ty);
  }
}

// aclCreateTensor places host memory on the CPU (a CUDA build asks the runtime where a pointer
// lives; host memory stays a CPU view there too).
TEST(Backend, HostPointersMakeCpuViews) {
  std::vector<float> x(6);
  const int64_t d[1] = {6};
  aclTensor* t = aclCreateTensor(d, 1, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, d, 1, x.data());
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->view.device, Device::kCPU);
  EXPECT_EQ(t->view.device_id, 0);
  aclDestroyTensor(t);
}

// ---- workspace --------------------------------------------------------------------------

TEST(Workspace, SmallerWorkspaceIsRefusedAndNothingWritten) {
  Finalize f;
  const int64_t dex[2] = {f.R * f.K, f.H}, didx[1] = {f.R * f.K}, dsc[2] = {f.R, f.K},
                dout[2] = {f.R, f.H};
  aclTensor* tex = aclCreateTensor(dex, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, dex, 2, f.ex.data());
  aclTensor* tidx = aclCreateTensor(didx, 1, ACL_INT32, nullptr, 0, ACL_FORMAT_ND, didx, 1, f.idx32.data());
  aclTensor* tsc = aclCreateTensor(dsc, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, dsc, 2, f.scales.data());
  aclTensor* tout = aclCreateTensor(dout, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, dout, 2, f.out.data());
  uint64_t need = 0;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(aclnnMoeFinalizeRoutingV2GetWorkspaceSize(tex, tidx, nullptr, nullptr, nullptr, tsc,
                                                      nullptr, 0, tout, &need, &ex),
            ACLNN_SUCCESS)
      << aclGetRecentErrMsg();
  ASSERT_GT(need, 0u) << "the CPU kernel takes its row buffers from the workspace";
  ASSERT_EQ(aclSetAclOpExecutorRepeatable(ex), ACLNN_SUCCESS);
  std::vector<unsigned char> mem(need);
  std::vector<float> poison(f.out.size());
  std::memset(poison.data(), 0xFF, poison.size() * sizeof(float));
  std::memcpy(f.out.data(), poison.data(), poison.size() * sizeof(float));
  for (uint64_t bytes : {need - 1, uint64_t{0}}) {
    EXPECT_EQ(aclnnMoeFinalizeRoutingV2(mem.data(), bytes, ex, nullptr), ACLNN_ERR_PARAM_INVALID);
    EXPECT_NE(std::string(aclGetRecentErrMsg()).find("workspace"), std::string::npos);
    EXPECT_EQ(0, std::memcmp(f.out.data(), poison.data(), poison.size() * sizeof(float)));
  }
  EXPECT_EQ(aclnnMoeFinalizeRoutingV2(nullptr, need, ex, nullptr), ACLNN_ERR_PARAM_INVALID);
  // The exact size runs, from an unaligned base too.
  std::vector<unsigned char> odd(need + 1);
  EXPECT_EQ(aclnnMoeFinalizeRoutingV2(odd.data() + 1, need, ex, nullptr), ACLNN_SUCCESS)
      << aclGetRecentErrMsg();
  EXPECT_NE(0, std::memcmp(f.out.data(), poison.data(), poison.size() * sizeof(float)));
  aclDestroyAclOpExecutor(ex);
  for (aclTensor* t : {tex, tidx, tsc, tout}) aclDestroyTensor(t);
}

// ---- planning without outputs -------------------------------------------------------------

TEST(Prepare, OutputsAreInferredAndBoundOutputsChecked) {
  Finalize f;
  TensorView ex = f.ex_v(), idx = f.idx_v(false), sc = f.sc_v();
  moegrad::ExecutorPtr e = moegrad::prepare_moe_finalize_routing(
      &ex, &idx, nullptr, nullptr, nullptr, &sc, nullptr, moegrad::FinalizeRoutingAttrs{}, 1);
  ASSERT_EQ(e->outputs().size(), 1u);
  EXPECT_EQ(e->outputs()[0].shape, (moegrad::Shape{f.R, f.H}));
  EXPECT_EQ(e->outputs()[0].dtype, DType::kFloat32);
  std::vector<unsigned char> ws(e->workspace_size());
  // Without outputs the plain run refuses (nothing to write to).
  EXPECT_EQ(error_of([&] { e->run(ws.data(), ws.size(), nullptr); }).first, moegrad::kErrNullptr);
  std::vector<float> wrong(f.R * (f.H + 1));
  TensorView bad = TensorView::contiguous(wrong.data(), DType::kFloat32, {f.R, f.H + 1});
  const TensorView* outs_bad[1] = {&bad};
  EXPECT_EQ(error_of([&] { e->run(outs_bad, 1, ws.data(), ws.size(), nullptr); }).first,
            moegrad::kErrInnerNullptr);
  TensorView half = TensorView::contiguous(f.out.data(), DType::kFloat16, {f.R, f.H});
  const TensorView* outs_half[1] = {&half};
  EXPECT_EQ(error_of([&] { e->run(outs_half, 1, ws.data(), ws.size(), nullptr); }).first,
            moegrad::kErrParamInvalid);
  TensorView out = f.out_v();
  const TensorView* outs[1] = {&out};
  e->run(outs, 1, ws.data(), ws.size(), nullptr);
  // Same bits as the one-call plan.
  std::vector<float> ref(f.out.size());
  TensorView rv = TensorView::contiguous(ref.data(), DType::kFloat32, {f.R, f.H});
  moegrad::ExecutorPtr e2 = moegrad::plan_moe_finalize_routing(
      &ex, &idx, nullptr, nullptr, nullptr, &sc, nullptr, moegrad::FinalizeRoutingAttrs{}, &rv);
  moegrad::run_now(*e2);
  EXPECT_EQ(0, std::memcmp(ref.data(), f.out.data(), ref.size() * sizeof(float)));
}

TEST(Prepare, EachPlanValidatesOnce) {
  Finalize f;
  TensorView ex = f.ex_v(), idx = f.idx_v(false), sc = f.sc_v(), out = f.out_v();
  const uint64_t before = moegrad::validation_count();
  moegrad::ExecutorPtr e = moegrad::prepare_moe_finalize_routing(
      &ex, &idx, nullptr, nullptr, nullptr, &sc, nullptr, moegrad::FinalizeRoutingAttrs{}, 1);
  std::vector<unsigned char> ws(e->workspace_size());
  const TensorView* outs[1] = {&out};
  e->run(outs, 1, ws.data(), ws.size(), nullptr);
  EXPECT_EQ(moegrad::validation_count() - before, 1u);
}

// ---- int64 indices in the C++ API ---------------------------------------------------------

TEST(Int64Indices, SameBitsAsInt32) {
  Finalize f;
  TensorView ex = f.ex_v(), sc = f.sc_v();
  std::vector<float> a(f.out.size()), b(f.out.size());
  for (bool wide : {false, true}) {
    TensorView idx = f.idx_v(wide);
    TensorView out = TensorView::contiguous(wide ? b.data() : a.data(), DType::kFloat32, {f.R, f.H});
    moegrad::run_now(*moegrad::plan_moe_finalize_routing(
        &ex, &idx, nullptr, nullptr, nullptr, &sc, nullptr, moegrad::FinalizeRoutingAttrs{}, &out));
  }
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));

  // Gating backward with torch.topk-style int64 indices.
  const int64_t M = 4, N = 9, K = 3;
  std::vector<float> xn(M * N, 0.3f), gy(M * K, 1.0f), g32(M * N), g64(M * N);
  std::vector<int32_t> e32 = {0, 4, 8, 1, 2, 3, 8, 7, 6, 5, 0, 2};
  std::vector<int64_t> e64(e32.begin(), e32.end());
  for (bool wide : {false, true}) {
    TensorView xv = TensorView::contiguous(xn.data(), DType::kFloat32, {M, N});
    TensorView gv = TensorView::contiguous(gy.data(), DType::kFloat32, {M, K});
    TensorView ev = wide ? TensorView::contiguous(e64.data(), DType::kInt64, {M, K})
                         : TensorView::contiguous(e32.data(), DType::kInt32, {M, K});
    TensorView ov = TensorView::contiguous(wide ? g64.data() : g32.data(), DType::kFloat32, {M, N});
    moegrad::run_now(*moegrad::plan_moe_gating_top_k_backward(
        &xv, &gv, &ev, moegrad::GatingTopKBackwardAttrs{}, &ov));
  }
  EXPECT_EQ(0, std::memcmp(g32.data(), g64.data(), g32.size() * sizeof(float)));
}

TEST(Int64Indices, OutOfInt32NamesPositionAndValue) {
  Finalize f;
  TensorView ex = f.ex_v(), sc = f.sc_v(), out = f.out_v();
  const int64_t pos = 4;
  const int64_t bad = (int64_t{1} << 32) + f.idx64[pos];  // would wrap to a valid int32 value
  f.idx64[pos] = bad;
  TensorView idx = f.idx_v(true);
  auto [code, msg] = error_of([&] {
    moegrad::plan_moe_finalize_routing(&ex, &idx, nullptr, nullptr, nullptr, &sc, nullptr,
                                       moegrad::FinalizeRoutingAttrs{}, &out);
  });
  EXPECT_EQ(code, moegrad::kErrInnerNullptr) << msg;
  EXPECT_NE(msg.find("expanded_row_idx"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
  EXPECT_NE(msg.find("position " + std::to_string(pos)), std::string::npos) << msg;
}

TEST(Int64Indices, CApiKeepsInt32) {
  Finalize f;
  const int64_t dex[2] = {f.R * f.K, f.H}, didx[1] = {f.R * f.K}, dout[2] = {f.R, f.H};
  aclTensor* tex = aclCreateTensor(dex, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, dex, 2, f.ex.data());
  aclTensor* tidx = aclCreateTensor(didx, 1, ACL_INT64, nullptr, 0, ACL_FORMAT_ND, didx, 1, f.idx64.data());
  aclTensor* tout = aclCreateTensor(dout, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, dout, 2, f.out.data());
  uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  EXPECT_EQ(aclnnMoeFinalizeRoutingV2GetWorkspaceSize(tex, tidx, nullptr, nullptr, nullptr, nullptr,
                                                      nullptr, 0, tout, &ws, &ex),
            ACLNN_ERR_PARAM_INVALID);
  EXPECT_NE(std::string(aclGetRecentErrMsg()).find("expanded_row_idx"), std::string::npos);
  EXPECT_EQ(ex, nullptr);
  for (aclTensor* t : {tex, tidx, tout}) aclDestroyTensor(t);
}

}  // namespace

// Messages are built without iostreams (docs/decisions.md L219): every argument type cat takes,
// integers at their extremes, 8-bit integers as numbers, floating point in Python's repr form.
TEST(Messages, CatWritesEveryArgumentTypeWithoutStreams) {
  using moegrad::cat;
  EXPECT_EQ(cat("op: ", std::string("arg"), ':', ' ', true, false), "op: arg: 10");
  EXPECT_EQ(cat(std::numeric_limits<int64_t>::min(), " ", std::numeric_limits<uint64_t>::max()),
            "-9223372036854775808 18446744073709551615");
  EXPECT_EQ(cat(int8_t{-5}, ",", uint8_t{200}, ",", int32_t{0}), "-5,200,0");
  EXPECT_EQ(cat(moegrad::DType::kFloat32),
            std::to_string(static_cast<int>(moegrad::DType::kFloat32)));
  EXPECT_EQ(cat(-0.9999999, " ", 3.0, " ", 1e-4, " ", 1e-5, " ", 1e20, " ", 123456789.5),
            "-0.9999999 3.0 0.0001 1e-05 1e+20 123456789.5");
  EXPECT_EQ(cat(0.1f), "0.10000000149011612");
  EXPECT_EQ(cat(std::nan(""), " ", -HUGE_VAL, " ", HUGE_VAL), "nan -inf inf");
  const char* null = nullptr;
  EXPECT_EQ(cat(null), "(null)");
}
