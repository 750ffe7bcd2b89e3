// Every operator at 0 rows (0 tokens), through the C API and the C++ API, with the workspace
// exactly as planned: a null pointer when the size is 0. Regression test of the finalize grad
// that once memset the null workspace slot of a 0-row call (found by the fuzz smoke run,
// docs/testing.md); that fault is undefined behaviour rather than a crash, so it is reported by
// `make test-asan` (UBSan), while the plain build checks the results: every output that is not
// empty at 0 rows (drop/pad rows, counts, the bias gradient) is written, all zeros.
#include <functional>

#include <moegrad/moegrad.h>

#include "test_util.h"

using namespace mgt;

namespace {

using moegrad::DType;
using moegrad::TensorView;

struct Case {
  std::string name;
  std::vector<Tensor> in, out;
  std::function<aclnnStatus(Case&, uint64_t*, aclOpExecutor**)> plan;
  aclnnStatus (*run)(void*, uint64_t, aclOpExecutor*, aclrtStream) = nullptr;
  // The same call through the C++ API, on views of the same buffers.
  std::function<moegrad::ExecutorPtr(Case&)> plan_cpp;

  aclTensor* h(size_t k) { return in[k].handle(); }
  aclTensor* o(size_t k) { return out[k].handle(); }
  // Views of the tensors (nullptr for an absent one), kept alive by the case.
  std::vector<TensorView> views;
  const TensorView* vi(size_t k) { return view(in[k]); }
  const TensorView* vo(size_t k) { return view(out[k]); }
  const TensorView* view(Tensor& t) {
    if (t.is_null()) return nullptr;
    views.reserve(32);  // stable addresses
    views.push_back(TensorView::contiguous(t.data(), static_cast<DType>(t.dtype()), t.shape()));
    return &views.back();
  }
};

Tensor none() { return Tensor(); }
template <typename... T>
std::vector<Tensor> tv(T&&... t) {  // Tensor is move-only: no initializer lists
  std::vector<Tensor> v;
  (v.push_back(std::forward<T>(t)), ...);
  return v;
}
Tensor f32(std::vector<int64_t> s) { return Tensor(std::move(s), ACL_FLOAT); }
Tensor i32(std::vector<int64_t> s) { return Tensor(std::move(s), ACL_INT32); }
Tensor i64(std::vector<int64_t> s) { return Tensor(std::move(s), ACL_INT64); }

constexpr int64_t H = 5, K = 2, N = 8, E = 3, C = 2;

std::vector<Case> cases() {
  std::vector<Case> v;
  auto add = [&](std::string name, std::vector<Tensor> in, std::vector<Tensor> out) -> Case& {
    v.emplace_back();
    v.back().name = std::move(name);
    v.back().in = std::move(in);
    v.back().out = std::move(out);
    return v.back();
  };
  {
    Case& c = add("gating_top_k", tv(f32({0, N}), f32({N})),
                  tv(f32({0, K}), i32({0, K}), f32({0, N})));
    c.plan = [](Case& s, uint64_t* ws, aclOpExecutor** ex) {
      return aclnnMoeGatingTopKGetWorkspaceSize(s.h(0), s.h(1), K, 1, 1, 0, 0, 0, true, 1.0,
                                                1e-20, s.o(0), s.o(1), s.o(2), ws, ex);
    };
    c.run = aclnnMoeGatingTopK;
    c.plan_cpp = [](Case& s) {
      moegrad::GatingTopKAttrs a;
      a.k = K;
      a.out_flag = true;
      return moegrad::plan_moe_gating_top_k(s.vi(0), s.vi(1), a, s.vo(0), s.vo(1), s.vo(2));
    };
  }
  {
    Case& c = add("gating_top_k_backward", tv(f32({0, N}), f32({0, K}), i32({0, K})),
                  tv(f32({0, N})));
    c.plan = [](Case& s, uint64_t* ws, aclOpExecutor** ex) {
      return aclnnMoeGatingTopKBackwardGetWorkspaceSize(s.h(0), s.h(1), s.h(2), 0, 1, 1.0, 1e-20,
                                                        s.o(0), ws, ex);
    };
    c.run = aclnnMoeGatingTopKBackward;
    c.plan_cpp = [](Case& s) {
      return moegrad::plan_moe_gating_top_k_backward(s.vi(0), s.vi(1), s.vi(2), {}, s.vo(0));
    };
  }
  for (int64_t mode : {2, 3}) {
    Case& c = add("finalize_routing mode " + std::to_string(mode),
                  tv(mode == 2 ? f32({0, H}) : f32({E, C, H}), i32({0}), f32({0, H}), none(),
                   f32({E, H}), f32({0, K}), i32({0, K})),
                  tv(f32({0, H})));
    c.plan = [mode](Case& s, uint64_t* ws, aclOpExecutor** ex) {
      return aclnnMoeFinalizeRoutingV2GetWorkspaceSize(s.h(0), s.h(1), s.h(2), s.h(3), s.h(4),
                                                       s.h(5), s.h(6), mode, s.o(0), ws, ex);
    };
    c.run = aclnnMoeFinalizeRoutingV2;
    c.plan_cpp = [mode](Case& s) {
      return moegrad::plan_moe_finalize_routing(s.vi(0), s.vi(1), s.vi(2), s.vi(3), s.vi(4),
                                                s.vi(5), s.vi(6), {mode}, s.vo(0));
    };
  }
  for (int64_t mode : {0, 1}) {
    // Mode 1 at 0 rows still has an [E, C, H] grad_expanded_x to zero.
    Case& c = add("finalize_routing_grad mode " + std::to_string(mode),
                  tv(f32({0, H}), i32({0}), mode == 0 ? f32({0, H}) : f32({E, C, H}), f32({0, K}),
                   i32({0, K}), f32({E, H})),
                  tv(mode == 0 ? f32({0, H}) : f32({E, C, H}), f32({0, K})));
    c.plan = [mode](Case& s, uint64_t* ws, aclOpExecutor** ex) {
      return aclnnMoeFinalizeRoutingV2GradGetWorkspaceSize(
          s.h(0), s.h(1), s.h(2), s.h(3), s.h(4), s.h(5), mode, 0, mode ? E : 0, mode ? C : 0,
          s.o(0), s.o(1), ws, ex);
    };
    c.run = aclnnMoeFinalizeRoutingV2Grad;
    c.plan_cpp = [mode](Case& s) {
      moegrad::FinalizeRoutingGradAttrs a;
      a.drop_pad_mode = mode;
      a.expert_num = mode ? E : 0;
      a.expert_capacity = mode ? C : 0;
      return moegrad::plan_moe_finalize_routing_grad(s.vi(0), s.vi(1), s.vi(2), s.vi(3),
                                                     s.vi(4), s.vi(5), a, s.vo(0), s.vo(1));
    };
  }
  {
    Case& c = add("finalize_routing_bias_grad", tv(f32({0, H}), i32({0, K}), f32({0, K})),
                  tv(f32({E, H})));
    c.plan = [](Case& s, uint64_t* ws, aclOpExecutor** ex) {
      return aclnnMoeFinalizeRoutingBiasGradGetWorkspaceSize(s.h(0), s.h(1), s.h(2), E, s.o(0),
                                                             ws, ex);
    };
    c.run = aclnnMoeFinalizeRoutingBiasGrad;
    c.plan_cpp = [](Case& s) {
      return moegrad::plan_moe_finalize_routing_bias_grad(s.vi(0), s.vi(1), s.vi(2), {E},
                                                          s.vo(0));
    };
  }
  {
    Case& c = add("swiglu_group_quant_grad",
                  tv(f32({0, H}), f32({0, 2 * H}), f32({0}), f32({0, H}), i64({2})),
                  tv(f32({0, 2 * H}), f32({0})));
    c.plan = [](Case& s, uint64_t* ws, aclOpExecutor** ex) {
      return aclnnSwigluGroupQuantGradGetWorkspaceSize(s.h(0), s.h(1), s.h(2), s.h(3), s.h(4),
                                                       -1.0, s.o(0), s.o(1), ws, ex);
    };
    c.run = aclnnSwigluGroupQuantGrad;
    c.plan_cpp = [](Case& s) {
      return moegrad::plan_swiglu_group_quant_grad(s.vi(0), s.vi(1), s.vi(2), s.vi(3), s.vi(4),
                                                   {}, s.vo(0), s.vo(1));
    };
  }
  {
    Case& c = add("swiglu_group", tv(f32({0, 2 * H}), f32({0}), i64({2})), tv(f32({0, H})));
    c.plan = [](Case& s, uint64_t* ws, aclOpExecutor** ex) {
      return aclnnSwigluGroupGetWorkspaceSize(s.h(0), s.h(1), s.h(2), -1.0, s.o(0), ws, ex);
    };
    c.run = aclnnSwigluGroup;
    c.plan_cpp = [](Case& s) {
      return moegrad::plan_swiglu_group(s.vi(0), s.vi(1), s.vi(2), {}, s.vo(0));
    };
  }
  for (int64_t qm : {0, 1}) {
    // quant_mode 0: fp32 scales [0, ceil(H/128)]; 1 (MX): e8m0 scales [0, 1, 2].
    Case& c = add("swiglu_group_quant mode " + std::to_string(qm),
                  tv(f32({0, 2 * H}), f32({0}), i64({2})),
                  tv(Tensor({0, H}, ACL_FLOAT8_E4M3FN),
                   qm == 0 ? f32({0, 1}) : Tensor({0, 1, 2}, ACL_FLOAT8_E8M0), f32({0, H})));
    c.plan = [qm](Case& s, uint64_t* ws, aclOpExecutor** ex) {
      return aclnnSwigluGroupQuantGetWorkspaceSize(s.h(0), s.h(1), s.h(2), nullptr,
                                                   ACL_FLOAT8_E4M3FN, qm, 0, qm == 1, -1.0, 15.0,
                                                   true, s.o(0), s.o(1), s.o(2), ws, ex);
    };
    c.run = aclnnSwigluGroupQuant;
    c.plan_cpp = [qm](Case& s) {
      moegrad::SwigluQuantAttrs a;
      a.quant_mode = qm;
      a.round_scale = qm == 1;
      a.output_origin = true;
      return moegrad::plan_swiglu_group_quant(s.vi(0), s.vi(1), s.vi(2), nullptr, a, s.vo(0),
                                              s.vo(1), s.vo(2));
    };
  }
  for (int64_t mode : {0, 1}) {
    // V2: counts flag 2 (count) in int32 [E]; drop/pad also the before-capacity counts.
    Case& c = add("init_routing_v2 mode " + std::to_string(mode), tv(f32({0, H}), i32({0, K})),
                  tv(mode == 0 ? f32({0, H}) : f32({E, C, H}), i32({0}),
                   mode == 0 ? i32({E}) : none(), mode == 1 ? i32({E}) : none()));
    c.plan = [mode](Case& s, uint64_t* ws, aclOpExecutor** ex) {
      return aclnnMoeInitRoutingV2GetWorkspaceSize(s.h(0), s.h(1), 0, mode ? C : 0, E, mode,
                                                   mode ? 0 : 2, mode == 1, s.o(0), s.o(1),
                                                   s.o(2), s.o(3), ws, ex);
    };
    c.run = aclnnMoeInitRoutingV2;
    c.plan_cpp = nullptr;  // the C++ form is V3's (below)
  }
  for (int64_t mode : {0, 1}) {
    for (int64_t type : {0, 2}) {
      Case& c = add("init_routing_v3 mode " + std::to_string(mode) + " type " +
                        std::to_string(type),
                    tv(f32({0, H}), i32({0, K})),
                    tv(mode == 0 ? f32({0, H}) : f32({E, C, H}), i32({0}),
                     type == 2 ? i64({E, 2}) : i64({E})));
      c.plan = [mode, type](Case& s, uint64_t* ws, aclOpExecutor** ex) {
        return aclnnMoeInitRoutingV3GetWorkspaceSize(s.h(0), s.h(1), nullptr, nullptr, 0,
                                                     mode ? C : 0, E, mode, type, true, -1,
                                                     nullptr, 0, s.o(0), s.o(1), s.o(2), nullptr,
                                                     ws, ex);
      };
      c.run = aclnnMoeInitRoutingV3;
      c.plan_cpp = [mode, type](Case& s) {
        moegrad::InitRoutingAttrs a;
        a.expert_capacity = mode ? C : 0;
        a.expert_num = E;
        a.drop_pad_mode = mode;
        a.expert_tokens_num_type = type;
        a.expert_tokens_num_flag = true;
        return moegrad::plan_moe_init_routing(s.vi(0), s.vi(1), a, s.vo(0), s.vo(1), s.vo(2));
      };
    }
  }
  for (int64_t mode : {0, 1}) {
    Case& c = add("init_routing_grad mode " + std::to_string(mode),
                  tv(mode == 0 ? f32({0, H}) : f32({E, C, H}), i32({0})), tv(f32({0, H})));
    c.plan = [mode](Case& s, uint64_t* ws, aclOpExecutor** ex) {
      return aclnnMoeInitRoutingV2GradGetWorkspaceSize(s.h(0), s.h(1), K, mode, 0, s.o(0), ws,
                                                       ex);
    };
    c.run = aclnnMoeInitRoutingV2Grad;
    c.plan_cpp = [mode](Case& s) {
      moegrad::InitRoutingGradAttrs a;
      a.top_k = K;
      a.drop_pad_mode = mode;
      return moegrad::plan_moe_init_routing_grad(s.vi(0), s.vi(1), a, s.vo(0));
    };
  }
  return v;
}

// Outputs after a 0-row call: every byte written, and written 0.
void expect_zero_outputs(const Case& c, const char* api) {
  for (size_t k = 0; k < c.out.size(); ++k) {
    for (unsigned char b : c.out[k].bytes()) {
      if (b != 0) {
        ADD_FAILURE() << c.name << " (" << api << "): output " << k
                      << " is not all zeros after a 0-row call";
        break;
      }
    }
  }
}

// The workspace as planned: null when the size is 0, else exactly `bytes` bytes.
struct PlannedWorkspace {
  std::vector<unsigned char> mem;
  explicit PlannedWorkspace(uint64_t bytes) : mem(static_cast<size_t>(bytes)) {}
  void* ptr() { return mem.empty() ? nullptr : mem.data(); }
};

TEST(ZeroRows, EveryOpThroughTheCApiWithThePlannedWorkspace) {
  std::vector<Case> all = cases();
  for (Case& c : all) {
    for (Tensor& t : c.out) t.poison();
    uint64_t ws = ~uint64_t{0};
    aclOpExecutor* ex = nullptr;
    ASSERT_EQ(c.plan(c, &ws, &ex), ACLNN_SUCCESS) << c.name << ": " << aclGetRecentErrMsg();
    PlannedWorkspace mem(ws);
    ASSERT_EQ(c.run(mem.ptr(), ws, ex, nullptr), ACLNN_SUCCESS)
        << c.name << " (workspace " << ws << " bytes): " << aclGetRecentErrMsg();
    expect_zero_outputs(c, "C");
  }
}

TEST(ZeroRows, RepeatableExecutorsRunTwiceAtZeroRows) {
  std::vector<Case> all = cases();
  for (Case& c : all) {
    uint64_t ws = 0;
    aclOpExecutor* ex = nullptr;
    ASSERT_EQ(c.plan(c, &ws, &ex), ACLNN_SUCCESS) << c.name << ": " << aclGetRecentErrMsg();
    ASSERT_EQ(aclSetAclOpExecutorRepeatable(ex), ACLNN_SUCCESS) << aclGetRecentErrMsg();
    PlannedWorkspace mem(ws);
    for (int round = 0; round < 2; ++round) {
      for (Tensor& t : c.out) t.poison();
      ASSERT_EQ(c.run(mem.ptr(), ws, ex, nullptr), ACLNN_SUCCESS)
          << c.name << " round " << round << ": " << aclGetRecentErrMsg();
      expect_zero_outputs(c, "C, repeatable");
    }
    EXPECT_EQ(aclDestroyAclOpExecutor(ex), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  }
}

TEST(ZeroRows, EveryOpThroughTheCppApiWithThePlannedWorkspace) {
  std::vector<Case> all = cases();
  int covered = 0;
  for (Case& c : all) {
    if (!c.plan_cpp) continue;
    for (Tensor& t : c.out) t.poison();
    moegrad::ExecutorPtr e;
    try {
      e = c.plan_cpp(c);
    } catch (const moegrad::Error& err) {
      FAIL() << c.name << ": " << err.what();
    }
    PlannedWorkspace mem(e->workspace_size());
    try {
      e->run(mem.ptr(), e->workspace_size(), nullptr);
    } catch (const moegrad::Error& err) {
      FAIL() << c.name << " (workspace " << e->workspace_size() << " bytes): " << err.what();
    }
    expect_zero_outputs(c, "C++");
    ++covered;
  }
  EXPECT_GE(covered, 14);
}

}  // namespace
