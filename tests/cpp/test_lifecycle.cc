// Executor lifetime, stage-two argument checks, the per-thread error message and tensor handles
// of the C API (aclnn.h header comment, operators.md §0.2).
#include <memory>
#include <thread>

#include "test_util.h"

using namespace mgt;

namespace {

// A small valid gating-backward call on raw handles (§1.9 shapes: M=2, N=4, K=2).
struct Small {
  std::vector<float> xn = {0.5f, 0.7f, 0.3f, 0.8f, 0.6f, 0.4f, 0.8f, 0.1f};
  std::vector<float> gy = {1.0f, -0.5f, 0.8f, 0.3f};
  std::vector<int32_t> idx = {3, 1, 2, 0};
  std::vector<float> out = std::vector<float>(8, -7.0f);
  aclTensor *t_xn = nullptr, *t_gy = nullptr, *t_idx = nullptr, *t_out = nullptr;

  Small() {
    const int64_t mn[2] = {2, 4}, mk[2] = {2, 2};
    t_xn = aclCreateTensor(mn, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, mn, 2, xn.data());
    t_gy = aclCreateTensor(mk, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, mk, 2, gy.data());
    t_idx = aclCreateTensor(mk, 2, ACL_INT32, nullptr, 0, ACL_FORMAT_ND, mk, 2, idx.data());
    t_out = aclCreateTensor(mn, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, mn, 2, out.data());
  }
  ~Small() { destroy_handles(); }
  void destroy_handles() {
    for (aclTensor** t : {&t_xn, &t_gy, &t_idx, &t_out}) {
      if (*t) aclDestroyTensor(*t);
      *t = nullptr;
    }
  }
  aclnnStatus plan(aclOpExecutor** ex, double rsf = 1.0) {
    uint64_t ws = 0;
    return aclnnMoeGatingTopKBackwardGetWorkspaceSize(t_xn, t_gy, t_idx, 0, 1, rsf, 1e-20, t_out,
                                                      &ws, ex);
  }
  aclnnStatus fail() {  // norm_type 3 is rejected (0, 1 and 2 are valid, D22)
    uint64_t ws = 0;
    aclOpExecutor* ex = nullptr;
    return aclnnMoeGatingTopKBackwardGetWorkspaceSize(t_xn, t_gy, t_idx, 0, 3, 1.0, 1e-20, t_out,
                                                      &ws, &ex);
  }
  // Expected output from the §1.5 formula in double (independent of the library).
  std::vector<double> expected(double rsf = 1.0) const {
    std::vector<double> g(8, 0.0);
    for (int i = 0; i < 2; ++i) {
      double w0 = xn[i * 4 + idx[i * 2]], w1 = xn[i * 4 + idx[i * 2 + 1]];
      double D = w0 + w1 + 1e-20;
      double g0 = rsf * gy[i * 2], g1 = rsf * gy[i * 2 + 1];
      double beta = (w0 * g0 + w1 * g1) / D;
      g[i * 4 + idx[i * 2]] += (g0 - beta) / D;
      g[i * 4 + idx[i * 2 + 1]] += (g1 - beta) / D;
    }
    for (int j = 0; j < 8; ++j) g[j] *= xn[j] * (1.0 - xn[j]);
    return g;
  }
  void expect_result(double rsf = 1.0) const {
    std::vector<double> e = expected(rsf);
    for (int j = 0; j < 8; ++j) EXPECT_NEAR(out[j], e[j], 1e-6 * (1 + std::fabs(e[j]))) << j;
  }
};

TEST(ExecutorLifetime, OneShotExecutorIsConsumed) {
  Small s;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(s.plan(&ex), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  ASSERT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, ex, nullptr), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  s.expect_result();
  std::fill(s.out.begin(), s.out.end(), -7.0f);
  EXPECT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, ex, nullptr), ACLNN_ERR_PARAM_INVALID);
  EXPECT_TRUE(has_word(aclGetRecentErrMsg(), "executor")) << aclGetRecentErrMsg();
  for (float v : s.out) EXPECT_EQ(v, -7.0f) << "a consumed executor must not run again";
}

TEST(ExecutorLifetime, RepeatableExecutorRunsTwiceIdentically) {
  Small s;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(s.plan(&ex, 2.5), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  ASSERT_EQ(aclSetAclOpExecutorRepeatable(ex), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  ASSERT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, ex, nullptr), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  s.expect_result(2.5);
  const std::vector<float> first = s.out;
  std::fill(s.out.begin(), s.out.end(), std::nanf(""));
  ASSERT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, ex, nullptr), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  EXPECT_EQ(0, std::memcmp(first.data(), s.out.data(), first.size() * sizeof(float)));
  // New inputs in the same memory are picked up: the executor holds the data pointers.
  s.gy[0] = 3.0f;
  ASSERT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, ex, nullptr), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  s.expect_result(2.5);
  EXPECT_EQ(aclDestroyAclOpExecutor(ex), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  // Destroyed: stage two rejects it (tracked, not undefined).
  std::fill(s.out.begin(), s.out.end(), -7.0f);
  EXPECT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, ex, nullptr), ACLNN_ERR_PARAM_INVALID);
  for (float v : s.out) EXPECT_EQ(v, -7.0f);
}

TEST(ExecutorLifetime, DestroyWithoutRunning) {
  Small s;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(s.plan(&ex), ACLNN_SUCCESS);
  EXPECT_EQ(aclDestroyAclOpExecutor(ex), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  EXPECT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, ex, nullptr), ACLNN_ERR_PARAM_INVALID);
  for (float v : s.out) EXPECT_EQ(v, -7.0f) << "planning alone must not write outputs";
}

// Stage two of another operator refuses an executor and leaves it as it was: a one-shot one
// still runs once under its own operator, and nothing is written by the refused call.
TEST(ExecutorLifetime, AnotherOperatorsStageTwoIsRefused) {
  Small s;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(s.plan(&ex), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  using StageTwo = aclnnStatus (*)(void*, uint64_t, aclOpExecutor*, aclrtStream);
  for (StageTwo other : {StageTwo{aclnnMoeFinalizeRoutingV2}, StageTwo{aclnnSwigluGroupQuantGrad},
                         StageTwo{aclnnMoeGatingTopK}, StageTwo{aclnnMoeInitRoutingV2Grad}}) {
    EXPECT_EQ(other(nullptr, 0, ex, nullptr), ACLNN_ERR_PARAM_INVALID);
    const std::string msg = aclGetRecentErrMsg();
    EXPECT_TRUE(has_word(msg, "executor") && has_word(msg, "moe_gating_top_k_backward")) << msg;
    for (float v : s.out) EXPECT_EQ(v, -7.0f) << "a refused stage two must not run";
  }
  ASSERT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, ex, nullptr), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  s.expect_result();
}

// A consumed or destroyed executor stays unknown for good (docs/decisions.md L83): even when
// the executors planned after it (same operator, same size) would reuse its memory, the stale
// handle never reaches them. Before handles were serial numbers, a freed handle passed again
// ran whichever executor had been allocated at its address.
TEST(ExecutorLifetime, StaleHandlesStayUnknownAfterReuse) {
  Small s;
  aclOpExecutor* consumed = nullptr;
  aclOpExecutor* destroyed = nullptr;
  ASSERT_EQ(s.plan(&consumed), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  ASSERT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, consumed, nullptr), ACLNN_SUCCESS);
  ASSERT_EQ(s.plan(&destroyed), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  ASSERT_EQ(aclDestroyAclOpExecutor(destroyed), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  std::vector<aclOpExecutor*> live;
  for (int i = 0; i < 64; ++i) {  // plenty of chances for the allocator to hand the memory back
    aclOpExecutor* e = nullptr;
    ASSERT_EQ(s.plan(&e, 2.0), ACLNN_SUCCESS) << aclGetRecentErrMsg();
    EXPECT_NE(e, consumed);
    EXPECT_NE(e, destroyed);
    for (aclOpExecutor* other : live) EXPECT_NE(e, other);
    live.push_back(e);
    ASSERT_EQ(aclSetAclOpExecutorRepeatable(e), ACLNN_SUCCESS);
  }
  for (aclOpExecutor* stale : {consumed, destroyed}) {
    std::fill(s.out.begin(), s.out.end(), -7.0f);
    EXPECT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, stale, nullptr), ACLNN_ERR_PARAM_INVALID);
    EXPECT_TRUE(has_word(aclGetRecentErrMsg(), "executor")) << aclGetRecentErrMsg();
    for (float v : s.out) EXPECT_EQ(v, -7.0f) << "a stale handle ran a live executor";
    EXPECT_EQ(aclSetAclOpExecutorRepeatable(stale), ACLNN_ERR_PARAM_INVALID);
    EXPECT_EQ(aclDestroyAclOpExecutor(stale), ACLNN_ERR_PARAM_INVALID);
  }
  // The live ones are unaffected and still run (and are destroyed exactly once).
  for (aclOpExecutor* e : live) {
    std::fill(s.out.begin(), s.out.end(), -7.0f);
    ASSERT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, e, nullptr), ACLNN_SUCCESS)
        << aclGetRecentErrMsg();
    s.expect_result(2.0);
    EXPECT_EQ(aclDestroyAclOpExecutor(e), ACLNN_SUCCESS) << aclGetRecentErrMsg();
    EXPECT_EQ(aclDestroyAclOpExecutor(e), ACLNN_ERR_PARAM_INVALID);
  }
}

// Values that were never handles (a stack address, a heap address, small integers, all ones,
// a handle-looking value with a serial never issued) are refused by every executor call.
TEST(ExecutorLifetime, BogusHandlesAreRefused) {
  Small s;
  aclOpExecutor* real = nullptr;
  ASSERT_EQ(s.plan(&real), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  int on_stack = 0;
  auto heap = std::make_unique<int>(0);
  const uintptr_t r = reinterpret_cast<uintptr_t>(real);
  const uintptr_t bogus[] = {reinterpret_cast<uintptr_t>(&on_stack),
                             reinterpret_cast<uintptr_t>(heap.get()),
                             1,
                             8,
                             4096,
                             ~uintptr_t{0},
                             r + 1,
                             r ^ (uintptr_t{1} << 52),
                             r + (uintptr_t{1} << 40)};
  for (uintptr_t b : bogus) {
    auto* h = reinterpret_cast<aclOpExecutor*>(b);
    EXPECT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, h, nullptr), ACLNN_ERR_PARAM_INVALID) << b;
    EXPECT_EQ(aclSetAclOpExecutorRepeatable(h), ACLNN_ERR_PARAM_INVALID) << b;
    EXPECT_EQ(aclDestroyAclOpExecutor(h), ACLNN_ERR_PARAM_INVALID) << b;
  }
  for (float v : s.out) EXPECT_EQ(v, -7.0f);
  ASSERT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, real, nullptr), ACLNN_SUCCESS)
      << aclGetRecentErrMsg();
  s.expect_result();
}

// Handles may be destroyed after stage one; the memory must live until stage two returns.
TEST(ExecutorLifetime, HandlesMayBeDestroyedAfterStageOne) {
  Small s;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(s.plan(&ex), ACLNN_SUCCESS);
  s.destroy_handles();
  ASSERT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, ex, nullptr), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  s.expect_result();
}

// Stage two of every operator with a NULL executor: 161001 naming the executor.
TEST(ExecutorLifetime, StageTwoNullExecutorEveryOp) {
  using Fn = aclnnStatus (*)(void*, uint64_t, aclOpExecutor*, aclrtStream);
  const std::pair<const char*, Fn> ops[] = {
      {"MoeGatingTopK", aclnnMoeGatingTopK},
      {"MoeGatingTopKBackward", aclnnMoeGatingTopKBackward},
      {"MoeFinalizeRoutingV2", aclnnMoeFinalizeRoutingV2},
      {"MoeFinalizeRoutingV2Grad", aclnnMoeFinalizeRoutingV2Grad},
      {"SwigluGroupQuantGrad", aclnnSwigluGroupQuantGrad},
      {"SwigluGroup", aclnnSwigluGroup},
  };
  for (const auto& [name, fn] : ops) {
    EXPECT_EQ(fn(nullptr, 0, nullptr, nullptr), ACLNN_ERR_PARAM_NULLPTR) << name;
    EXPECT_TRUE(has_word(aclGetRecentErrMsg(), "executor")) << name << ": " << aclGetRecentErrMsg();
  }
}

TEST(ErrorMessage, EmptyAfterSuccess) {
  Small s;
  ASSERT_EQ(s.fail(), ACLNN_ERR_PARAM_INVALID);
  ASSERT_STRNE(aclGetRecentErrMsg(), "");
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(s.plan(&ex), ACLNN_SUCCESS);
  EXPECT_STREQ(aclGetRecentErrMsg(), "");
  ASSERT_EQ(s.fail(), ACLNN_ERR_PARAM_INVALID);
  ASSERT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, ex, nullptr), ACLNN_SUCCESS);
  EXPECT_STREQ(aclGetRecentErrMsg(), "");
}

TEST(ErrorMessage, PerThread) {
  Small s;
  ASSERT_EQ(s.fail(), ACLNN_ERR_PARAM_INVALID);
  const std::string mine = aclGetRecentErrMsg();
  ASSERT_TRUE(has_word(mine, "norm_type") || has_word(mine, "normType")) << mine;

  std::string theirs_before, theirs_after, theirs_success;
  std::thread other([&] {
    theirs_before = aclGetRecentErrMsg();  // fresh thread: no failure yet
    float x[8] = {0};
    // A different failure: null workspaceSize of the SwiGLU grad.
    const int64_t d[2] = {1, 2};
    const int64_t g[2] = {1, 1};
    aclTensor* tx = aclCreateTensor(d, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, d, 2, x);
    aclTensor* tg = aclCreateTensor(g, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, g, 2, x + 4);
    aclTensor* tgx = aclCreateTensor(d, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, d, 2, x + 6);
    aclOpExecutor* ex = nullptr;
    EXPECT_EQ(aclnnSwigluGroupQuantGradGetWorkspaceSize(tg, tx, nullptr, nullptr, nullptr, -1.0,
                                                        tgx, nullptr, nullptr, &ex),
              ACLNN_ERR_PARAM_NULLPTR);
    theirs_after = aclGetRecentErrMsg();
    uint64_t ws = 0;
    EXPECT_EQ(aclnnSwigluGroupQuantGradGetWorkspaceSize(tg, tx, nullptr, nullptr, nullptr, -1.0,
                                                        tgx, nullptr, &ws, &ex),
              ACLNN_SUCCESS);
    theirs_success = aclGetRecentErrMsg();
    aclDestroyAclOpExecutor(ex);
    aclDestroyTensor(tx);
    aclDestroyTensor(tg);
    aclDestroyTensor(tgx);
  });
  other.join();
  EXPECT_EQ(theirs_before, "") << "a new thread starts with an empty message";
  EXPECT_TRUE(has_word(theirs_after, "workspaceSize")) << theirs_after;
  EXPECT_EQ(theirs_success, "");
  EXPECT_EQ(std::string(aclGetRecentErrMsg()), mine)
      << "another thread's calls must not change this thread's message";
}

// aclCreateTensor returns NULL on invalid arguments (more than 16 dims, negative dims).
TEST(TensorHandles, CreateTensorRejectsInvalidArguments) {
  float buf[16] = {0};
  const int64_t nine[17] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  EXPECT_EQ(aclCreateTensor(nine, 17, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, nine, 17, buf), nullptr);
  EXPECT_STRNE(aclGetRecentErrMsg(), "");
  const int64_t neg[2] = {2, -1};
  EXPECT_EQ(aclCreateTensor(neg, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, neg, 2, buf), nullptr);
  const int64_t ok[2] = {2, 8};
  aclTensor* t = aclCreateTensor(ok, 2, ACL_FLOAT, nullptr, 0, ACL_FORMAT_ND, ok, 2, buf);
  EXPECT_NE(t, nullptr);
  EXPECT_EQ(aclDestroyTensor(t), ACLNN_SUCCESS);
}

// offset is in elements from tensorData (aclnn.h).
TEST(TensorHandles, OffsetIsInElements) {
  Small s;
  std::vector<float> padded(3, 123.0f);
  padded.insert(padded.end(), s.xn.begin(), s.xn.end());
  const int64_t mn[2] = {2, 4};
  const int64_t storage[1] = {11};
  aclTensor* xn = aclCreateTensor(mn, 2, ACL_FLOAT, nullptr, 3, ACL_FORMAT_ND, storage, 1, padded.data());
  ASSERT_NE(xn, nullptr);
  uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(aclnnMoeGatingTopKBackwardGetWorkspaceSize(xn, s.t_gy, s.t_idx, 0, 1, 1.0, 1e-20,
                                                       s.t_out, &ws, &ex),
            ACLNN_SUCCESS) << aclGetRecentErrMsg();
  ASSERT_EQ(aclnnMoeGatingTopKBackward(nullptr, ws, ex, nullptr), ACLNN_SUCCESS);
  aclDestroyTensor(xn);
  s.expect_result();
}

// "All calls are thread-safe": concurrent plan + run from several threads give the same bits.
TEST(Threads, ConcurrentCalls) {
  Small ref;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(ref.plan(&ex), ACLNN_SUCCESS);
  ASSERT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, ex, nullptr), ACLNN_SUCCESS);
  std::vector<int> mismatches(4, 0), errors(4, 0);
  std::vector<std::thread> pool;
  for (int t = 0; t < 4; ++t) {
    pool.emplace_back([&, t] {
      for (int it = 0; it < 200; ++it) {
        Small s;
        aclOpExecutor* e = nullptr;
        if (s.plan(&e) != ACLNN_SUCCESS || aclnnMoeGatingTopKBackward(nullptr, 0, e, nullptr) != ACLNN_SUCCESS) {
          ++errors[t];
          continue;
        }
        if (std::memcmp(s.out.data(), ref.out.data(), sizeof(float) * 8) != 0) ++mismatches[t];
        if (s.fail() != ACLNN_ERR_PARAM_INVALID) ++errors[t];
      }
    });
  }
  for (auto& th : pool) th.join();
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(errors[t], 0) << "thread " << t;
    EXPECT_EQ(mismatches[t], 0) << "thread " << t;
  }
}

TEST(Threads, SetAndRestore) {
  ThreadsGuard guard;
  moegradSetNumThreads(1);
  EXPECT_EQ(moegradGetNumThreads(), 1);
  moegradSetNumThreads(2);
  EXPECT_EQ(moegradGetNumThreads(), 2);
  moegradSetNumThreads(0);
  EXPECT_GE(moegradGetNumThreads(), 1);
  EXPECT_NE(moegradVersion(), nullptr);
}

}  // namespace

// A format stage one does not read as ND (a blocked one, or any other int a C caller passes)
// is refused with 161002 naming the tensor; NCHW and the other plain layouts are read as ND.
TEST(TensorHandles, FormatsOtherThanNdAreRefused) {
  for (int32_t f : {3, 4, 29, -1, 999, 0, 1, 27, 30}) {
    Small s;
    aclDestroyTensor(s.t_xn);
    const int64_t mn[2] = {2, 4};
    aclFormat fmt;
    std::memcpy(&fmt, &f, sizeof fmt);
    s.t_xn = aclCreateTensor(mn, 2, ACL_FLOAT, nullptr, 0, fmt, mn, 2, s.xn.data());
    ASSERT_NE(s.t_xn, nullptr) << aclGetRecentErrMsg();
    aclOpExecutor* ex = nullptr;
    const bool nd = f == 0 || f == 1 || f == 27 || f == 30;
    const aclnnStatus st = s.plan(&ex);
    if (nd) {
      ASSERT_EQ(st, ACLNN_SUCCESS) << f << ": " << aclGetRecentErrMsg();
      ASSERT_EQ(aclnnMoeGatingTopKBackward(nullptr, 0, ex, nullptr), ACLNN_SUCCESS);
      s.expect_result();
    } else {
      EXPECT_EQ(st, ACLNN_ERR_PARAM_INVALID) << f;
      const std::string msg = aclGetRecentErrMsg();
      EXPECT_TRUE(has_word(msg, "x_norm") && has_word(msg, "format") &&
                  has_word(msg, std::to_string(f))) << msg;
      for (float v : s.out) EXPECT_EQ(v, -7.0f);
    }
  }
}
