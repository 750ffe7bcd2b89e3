// Concurrency through the C API (docs/decisions.md L54): 16 threads call every operator at once
// on distinct inputs and must reproduce the serial results bit for bit (D16); error messages are
// per thread and never mix; executors shared wrongly across threads give a status, never
// undefined behaviour (run under ASan/TSan by `make test-asan`).
#include <atomic>
#include <functional>
#include <memory>
#include <thread>

#include <moegrad/moegrad.h>

#include "test_util.h"

using namespace mgt;

namespace {

constexpr int kThreads = 16;

std::string cat_fail(int op, int round, const std::string& err) {
  return "op " + std::to_string(op) + " round " + std::to_string(round) +
         (err.empty() ? ": results differ from the serial run; " : ": failed: " + err + "; ");
}

aclDataType float_type(int i) {
  const aclDataType types[3] = {ACL_FLOAT, ACL_FLOAT16, ACL_BF16};
  return types[i % 3];
}

// One operator call with its own inputs and caller-allocated outputs.
struct Job {
  std::vector<Tensor> in, out;
  std::function<aclnnStatus(Job&, uint64_t*, aclOpExecutor**)> plan;
  aclnnStatus (*run)(void*, uint64_t, aclOpExecutor*, aclrtStream) = nullptr;

  Tensor& i(size_t k) { return in[k]; }
  aclTensor* h(size_t k) { return in[k].handle(); }
  aclTensor* o(size_t k) { return out[k].handle(); }

  // Plans and runs once; returns the concatenated output bytes (empty on failure).
  std::vector<unsigned char> call(std::string* error) {
    for (Tensor& t : out) {
      if (!t.is_null()) t.poison();
    }
    uint64_t ws = 0;
    aclOpExecutor* ex = nullptr;
    aclnnStatus st = plan(*this, &ws, &ex);
    if (st == ACLNN_SUCCESS) {
      std::vector<unsigned char> mem(ws);
      st = run(mem.empty() ? nullptr : mem.data(), ws, ex, nullptr);
    }
    if (st != ACLNN_SUCCESS) {
      *error = aclGetRecentErrMsg();
      return {};
    }
    std::vector<unsigned char> bytes;
    for (Tensor& t : out) bytes.insert(bytes.end(), t.bytes().begin(), t.bytes().end());
    return bytes;
  }
};

Tensor rand_tensor(Rng& rng, std::vector<int64_t> shape, aclDataType dt, double lo, double hi) {
  const int64_t n = numel_of(shape);
  return Tensor::from(std::move(shape), dt, rng.uniform_vec(static_cast<size_t>(n), lo, hi));
}

std::vector<int32_t> unique_rows(Rng& rng, int64_t M, int32_t N, int64_t K) {
  std::vector<int32_t> v;
  for (int64_t r = 0; r < M; ++r) {
    std::vector<int32_t> p = rng.permutation(N);
    v.insert(v.end(), p.begin(), p.begin() + K);
  }
  return v;
}

// Job `op` (0..5) for thread `t`: shapes, dtypes and attributes differ per thread.
Job make_job(int op, int t) {
  Rng rng(1000u + static_cast<uint32_t>(op * 64 + t));
  const aclDataType dt = float_type(t);
  Job j;
  switch (op) {
    case 0: {  // gating top-k forward
      const int64_t M = 17 + t, N = 64;
      j.in.push_back(rand_tensor(rng, {M, N}, dt, -3, 3));
      j.in.push_back(rand_tensor(rng, {N}, dt, -0.1, 0.1));
      j.out.emplace_back(std::vector<int64_t>{M, 4}, dt);
      j.out.emplace_back(std::vector<int64_t>{M, 4}, ACL_INT32);
      j.out.emplace_back(std::vector<int64_t>{M, N}, ACL_FLOAT);
      const int64_t norm = t % 3;
      j.plan = [norm](Job& s, uint64_t* ws, aclOpExecutor** ex) {
        return aclnnMoeGatingTopKGetWorkspaceSize(s.h(0), s.h(1), 4, 2, 4, norm == 1 ? 1 : 0,
                                                  norm == 0 ? 1 : 0, norm, true, 1.5, 1e-20,
                                                  s.o(0), s.o(1), s.o(2), ws, ex);
      };
      j.run = aclnnMoeGatingTopK;
      break;
    }
    case 1: {  // gating top-k backward
      const int64_t M = 9 + t, N = 32, K = 1 + t % 6;
      j.in.push_back(rand_tensor(rng, {M, N}, ACL_FLOAT, 0.05, 0.95));
      j.in.push_back(rand_tensor(rng, {M, K}, dt, -2, 2));
      j.in.push_back(Tensor::from_i32({M, K}, unique_rows(rng, M, static_cast<int32_t>(N), K)));
      j.out.emplace_back(std::vector<int64_t>{M, N}, dt);
      j.plan = [](Job& s, uint64_t* ws, aclOpExecutor** ex) {
        return aclnnMoeGatingTopKBackwardGetWorkspaceSize(s.h(0), s.h(1), s.h(2), 0, 1, 0.7,
                                                          1e-20, s.o(0), ws, ex);
      };
      j.run = aclnnMoeGatingTopKBackward;
      break;
    }
    case 2: {  // finalize routing forward, mode 0 (column layout)
      const int64_t R = 5 + t, K = 1 + t % 4, H = 24 + t, E = 6;
      j.in.push_back(rand_tensor(rng, {R * K, H}, dt, -2, 2));
      j.in.push_back(Tensor::from_i32({R * K}, rng.permutation(static_cast<int32_t>(R * K))));
      j.in.push_back(rand_tensor(rng, {R, H}, dt, -1, 1));
      j.in.push_back(rand_tensor(rng, {R, H}, dt, -1, 1));
      j.in.push_back(rand_tensor(rng, {E, H}, dt, -0.5, 0.5));
      j.in.push_back(rand_tensor(rng, {R, K}, dt, 0.05, 1.0));
      std::vector<int32_t> eid(static_cast<size_t>(R * K));
      for (auto& v : eid) v = static_cast<int32_t>(rng.integer(0, E - 1));
      j.in.push_back(Tensor::from_i32({R, K}, eid));
      j.out.emplace_back(std::vector<int64_t>{R, H}, dt);
      j.plan = [](Job& s, uint64_t* ws, aclOpExecutor** ex) {
        return aclnnMoeFinalizeRoutingV2GetWorkspaceSize(s.h(0), s.h(1), s.h(2), s.h(3), s.h(4),
                                                         s.h(5), s.h(6), 0, s.o(0), ws, ex);
      };
      j.run = aclnnMoeFinalizeRoutingV2;
      break;
    }
    case 3: {  // finalize routing grad, mode 0
      const int64_t R = 5 + t, K = 1 + t % 4, H = 24 + t, E = 6;
      j.in.push_back(rand_tensor(rng, {R, H}, dt, -2, 2));
      j.in.push_back(Tensor::from_i32({R * K}, rng.permutation(static_cast<int32_t>(R * K))));
      j.in.push_back(rand_tensor(rng, {R * K, H}, dt, -2, 2));
      j.in.push_back(rand_tensor(rng, {R, K}, dt, 0.05, 1.0));
      std::vector<int32_t> eid(static_cast<size_t>(R * K));
      for (auto& v : eid) v = static_cast<int32_t>(rng.integer(0, E - 1));
      j.in.push_back(Tensor::from_i32({R, K}, eid));
      j.in.push_back(rand_tensor(rng, {E, H}, dt, -0.5, 0.5));
      j.out.emplace_back(std::vector<int64_t>{R * K, H}, dt);
      j.out.emplace_back(std::vector<int64_t>{R, K}, dt);
      j.plan = [](Job& s, uint64_t* ws, aclOpExecutor** ex) {
        return aclnnMoeFinalizeRoutingV2GradGetWorkspaceSize(s.h(0), s.h(1), s.h(2), s.h(3),
                                                             s.h(4), s.h(5), 0, 0, 0, 0, s.o(0),
                                                             s.o(1), ws, ex);
      };
      j.run = aclnnMoeFinalizeRoutingV2Grad;
      break;
    }
    case 4: {  // SwiGLU backward
      const int64_t T = 11 + t, H = 16 + 2 * t;
      j.in.push_back(rand_tensor(rng, {T, H}, dt, -2, 2));
      j.in.push_back(rand_tensor(rng, {T, 2 * H}, dt, -4, 4));
      j.in.push_back(rand_tensor(rng, {T}, ACL_FLOAT, 0.1, 1.0));
      j.in.push_back(rand_tensor(rng, {T, H}, dt, -2, 2));
      j.in.push_back(Tensor::from_i64({3}, {3, T / 2, 1}));
      j.out.emplace_back(std::vector<int64_t>{T, 2 * H}, dt);
      j.out.emplace_back(std::vector<int64_t>{T}, ACL_FLOAT);
      j.plan = [](Job& s, uint64_t* ws, aclOpExecutor** ex) {
        return aclnnSwigluGroupQuantGradGetWorkspaceSize(s.h(0), s.h(1), s.h(2), s.h(3), s.h(4),
                                                         3.0, s.o(0), s.o(1), ws, ex);
      };
      j.run = aclnnSwigluGroupQuantGrad;
      break;
    }
    default: {  // SwiGLU forward
      const int64_t T = 11 + t, H = 16 + 2 * t;
      j.in.push_back(rand_tensor(rng, {T, 2 * H}, dt, -4, 4));
      j.in.push_back(rand_tensor(rng, {T}, ACL_FLOAT, 0.1, 1.0));
      j.in.push_back(Tensor::from_i64({2}, {T - 2, 1}));
      j.out.emplace_back(std::vector<int64_t>{T, H}, dt);
      j.plan = [](Job& s, uint64_t* ws, aclOpExecutor** ex) {
        return aclnnSwigluGroupGetWorkspaceSize(s.h(0), s.h(1), s.h(2), 3.0, s.o(0), ws, ex);
      };
      j.run = aclnnSwigluGroup;
      break;
    }
  }
  return j;
}

constexpr int kOps = 6;

TEST(Concurrency, SixteenThreadsCallEveryOpAndMatchTheSerialBits) {
  std::vector<std::vector<Job>> jobs(kThreads);
  std::vector<std::vector<std::vector<unsigned char>>> serial(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    for (int op = 0; op < kOps; ++op) {
      jobs[t].push_back(make_job(op, t));
      std::string err;
      serial[t].push_back(jobs[t].back().call(&err));
      ASSERT_FALSE(serial[t].back().empty()) << "op " << op << " thread " << t << ": " << err;
    }
  }
  std::vector<std::string> failures(kThreads);
  std::atomic<int> ready{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();  // start together
      for (int round = 0; round < 3; ++round) {
        for (int k = 0; k < kOps; ++k) {
          const int op = (k + t) % kOps;  // threads run different ops at the same moment
          std::string err;
          std::vector<unsigned char> got = jobs[t][op].call(&err);
          if (got != serial[t][op]) {
            failures[t] += cat_fail(op, round, err);
          }
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], "") << "thread " << t;
}

// Each thread fails with its own value, then succeeds, many times over: the message it reads is
// always its own (the failure's value, then "").
TEST(Concurrency, ErrorMessagesArePerThreadAndNeverMix) {
  std::vector<Job> jobs;
  for (int t = 0; t < kThreads; ++t) jobs.push_back(make_job(1, t));
  std::vector<int> bad(kThreads, 0);
  std::vector<std::string> example(kThreads);
  std::atomic<int> ready{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      Job& j = jobs[t];
      const int64_t norm_type = 1000 + t;
      const std::string want = "got " + std::to_string(norm_type);
      for (int i = 0; i < 200; ++i) {
        uint64_t ws = 0;
        aclOpExecutor* ex = nullptr;
        aclnnStatus st = aclnnMoeGatingTopKBackwardGetWorkspaceSize(
            j.h(0), j.h(1), j.h(2), 0, norm_type, 1.0, 1e-20, j.o(0), &ws, &ex);
        std::string msg = aclGetRecentErrMsg();
        if (st != ACLNN_ERR_PARAM_INVALID || msg.find(want) == std::string::npos ||
            !has_word(msg, "norm_type")) {
          if (bad[t]++ == 0) example[t] = msg;
        }
        std::this_thread::yield();  // let other threads fail in between
        if (aclGetRecentErrMsg() != msg) {
          if (bad[t]++ == 0) example[t] = "changed by another thread: " + msg;
        }
        st = aclnnMoeGatingTopKBackwardGetWorkspaceSize(j.h(0), j.h(1), j.h(2), 0, 1, 1.0, 1e-20,
                                                        j.o(0), &ws, &ex);
        if (st != ACLNN_SUCCESS || std::string(aclGetRecentErrMsg()) != "") {
          if (bad[t]++ == 0) example[t] = std::string("success left ") + aclGetRecentErrMsg();
        }
        if (st == ACLNN_SUCCESS) aclDestroyAclOpExecutor(ex);
      }
    });
  }
  for (auto& th : pool) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(bad[t], 0) << "thread " << t << ": " << example[t];
}

// Many threads race to run one one-shot executor: exactly one runs it, every other call gets
// ACLNN_ERR_PARAM_INVALID (never a double free).
TEST(Concurrency, OneShotExecutorSharedAcrossThreadsRunsExactlyOnce) {
  for (int trial = 0; trial < 20; ++trial) {
    Job j = make_job(trial % kOps, trial);
    std::string err;
    const std::vector<unsigned char> want = j.call(&err);
    ASSERT_FALSE(want.empty()) << err;
    uint64_t ws = 0;
    aclOpExecutor* ex = nullptr;
    ASSERT_EQ(j.plan(j, &ws, &ex), ACLNN_SUCCESS) << aclGetRecentErrMsg();
    for (Tensor& t : j.out) t.poison();
    std::atomic<int> ok{0}, refused{0}, other{0}, ready{0};
    std::vector<std::thread> pool;
    for (int t = 0; t < 8; ++t) {
      pool.emplace_back([&, t] {
        ready.fetch_add(1);
        while (ready.load() < 8) std::this_thread::yield();
        std::vector<unsigned char> mem(ws);
        // Half run it, half try to destroy it: exactly one of them wins.
        aclnnStatus st = t % 2 ? j.run(mem.empty() ? nullptr : mem.data(), ws, ex, nullptr)
                               : aclDestroyAclOpExecutor(ex);
        if (st == ACLNN_SUCCESS) {
          ok.fetch_add(1);
        } else if (st == ACLNN_ERR_PARAM_INVALID && has_word(aclGetRecentErrMsg(), "executor")) {
          refused.fetch_add(1);
        } else {
          other.fetch_add(1);
        }
      });
    }
    for (auto& th : pool) th.join();
    EXPECT_EQ(ok.load(), 1);
    EXPECT_EQ(refused.load(), 7);
    EXPECT_EQ(other.load(), 0);
  }
}

// A repeatable executor used by several threads at once: overlapping runs and destroys during a
// run are refused with a status; every run that is accepted gives the serial result.
TEST(Concurrency, RepeatableExecutorSharedAcrossThreadsGivesAStatus) {
  Job j = make_job(4, 3);
  std::string err;
  const std::vector<unsigned char> want = j.call(&err);
  ASSERT_FALSE(want.empty()) << err;
  uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  ASSERT_EQ(j.plan(j, &ws, &ex), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  ASSERT_EQ(aclSetAclOpExecutorRepeatable(ex), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  std::atomic<int> ran{0}, refused{0}, other{0}, ready{0};
  std::atomic<bool> destroyed{false};
  std::vector<std::thread> pool;
  for (int t = 0; t < 8; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < 8) std::this_thread::yield();
      std::vector<unsigned char> mem(ws);
      if (t == 0) {
        // The destroyer waits for a first run, then tries while the others keep running: it is
        // refused while a run is in progress and wins once none is.
        while (ran.load() == 0) std::this_thread::yield();
        for (int i = 0; i < 100000 && !destroyed.load(); ++i) {
          const aclnnStatus st = aclDestroyAclOpExecutor(ex);
          if (st == ACLNN_SUCCESS) destroyed.store(true);
          else if (st != ACLNN_ERR_PARAM_INVALID || !has_word(aclGetRecentErrMsg(), "executor")) other.fetch_add(1);
        }
        return;
      }
      for (int i = 0; i < 50; ++i) {
        const aclnnStatus st = j.run(mem.empty() ? nullptr : mem.data(), ws, ex, nullptr);
        if (st == ACLNN_SUCCESS) ran.fetch_add(1);
        else if (st == ACLNN_ERR_PARAM_INVALID && has_word(aclGetRecentErrMsg(), "executor")) refused.fetch_add(1);
        else other.fetch_add(1);
      }
    });
  }
  for (auto& th : pool) th.join();
  EXPECT_EQ(other.load(), 0);
  EXPECT_GT(ran.load(), 0);
  EXPECT_EQ(ran.load() + refused.load(), 7 * 50);
  if (!destroyed.load()) {
    EXPECT_EQ(aclDestroyAclOpExecutor(ex), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  }
  // Accepted runs never overlapped, so the outputs hold the serial result.
  std::vector<unsigned char> got;
  for (Tensor& t : j.out) got.insert(got.end(), t.bytes().begin(), t.bytes().end());
  EXPECT_EQ(got, want);
}

// The C++ API: one Executor run by 8 threads at once (docs/decisions.md L84). Overlapping runs
// are refused with Error(161002) naming the executor, never a data race; every accepted run
// writes the serial result, in both run forms (plan_* with outputs, prepare_* binding them).
// Runs are long enough (8192 x 64) that 8 threads on any machine overlap; the rounds repeat
// until a refusal was seen (without the guard none ever is, and the test fails).
TEST(Concurrency, CppExecutorSharedAcrossThreadsGivesAStatus) {
  const int64_t T = 8192, Hh = 64;
  Rng rng(77);
  std::vector<float> x = [&] {
    std::vector<double> d = rng.uniform_vec(static_cast<size_t>(T * 2 * Hh), -4, 4);
    return std::vector<float>(d.begin(), d.end());
  }();
  std::vector<float> want(static_cast<size_t>(T * Hh)), y(want.size());
  using moegrad::DType;
  using moegrad::TensorView;
  TensorView vx = TensorView::contiguous(x.data(), DType::kFloat32, {T, 2 * Hh});
  TensorView vw = TensorView::contiguous(want.data(), DType::kFloat32, {T, Hh});
  TensorView vy = TensorView::contiguous(y.data(), DType::kFloat32, {T, Hh});
  moegrad::plan_swiglu_group(&vx, nullptr, nullptr, {}, &vw)->run(nullptr, 0, nullptr);
  for (int form = 0; form < 2; ++form) {
    moegrad::ExecutorPtr e = form == 0 ? moegrad::plan_swiglu_group(&vx, nullptr, nullptr, {}, &vy)
                                       : moegrad::prepare_swiglu_group(&vx, nullptr, nullptr, {});
    int refused_total = 0;
    for (int round = 0; round < 20 && refused_total == 0; ++round) {
      std::fill(y.begin(), y.end(), -7.0f);
      std::atomic<int> ran{0}, refused{0}, other{0}, ready{0};
      std::vector<std::thread> pool;
      for (int t = 0; t < 8; ++t) {
        pool.emplace_back([&] {
          ready.fetch_add(1);
          while (ready.load() < 8) std::this_thread::yield();
          for (int i = 0; i < 10; ++i) {
            try {
              if (form == 0) {
                e->run(nullptr, 0, nullptr);
              } else {
                const TensorView* outs[1] = {&vy};
                e->run(outs, 1, nullptr, 0, nullptr);
              }
              ran.fetch_add(1);
            } catch (const moegrad::Error& err) {
              if (err.code() == 161002 && has_word(err.what(), "executor")) refused.fetch_add(1);
              else other.fetch_add(1);
            } catch (...) {
              other.fetch_add(1);
            }
          }
        });
      }
      for (auto& th : pool) th.join();
      EXPECT_EQ(other.load(), 0) << "form " << form;
      EXPECT_GT(ran.load(), 0) << "form " << form;
      EXPECT_EQ(ran.load() + refused.load(), 8 * 10) << "form " << form;
      EXPECT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * sizeof(float)))
          << "form " << form;
      refused_total += refused.load();
    }
    EXPECT_GT(refused_total, 0) << "form " << form << ": overlapping runs were never refused";
  }
}

}  // namespace

