// CUDA kernels of the gating top-k forward (docs/operators.md §2) and backward (§1).
// Forward: one warp per token; the normalised row and the selection scores live in shared
// memory; top-k is k rounds of a warp-wide max over packed (score, index) keys (L2), so the
// result is deterministic and ties go to the lower index (D13); group-limited selection reuses
// the same rounds per group and over the groups. Backward (all three norm types, D22): one warp
// per token; sigmoid and sqrt-softplus read only the K selected x_norm entries, softmax the row
// (its Jacobian touches every column); the row of grad_x is written once (L42).
#include "core/cuda_backend.h"
#include "core/cuda_common.cuh"
#include "core/host.h"
#include "ops/gating_topk/gating_formula.h"
#include "ops/gating_topk/gating_topk.h"

namespace moegrad {
namespace cuda {
namespace {

using u64 = unsigned long long;

// The ranking key (L2) and the scalar norm functions: one definition with the CPU.
using gating_formula::key_index;
using gating_formula::rank_key;
using gating_formula::sigmoid_stable;
using gating_formula::sqrt_softplus;
using gating_formula::sqrt_softplus_grad;

// The k largest keys among `count` (<= 2048) candidates, largest first: emit(t, id) is called
// by every lane for t = 0..k-1 with the winner's id (key_index of its key). Candidate i (id =
// base + i) belongs to lane i % 32, slot i / 32; each lane caches the best key it has left and
// only the winning lane rescans its slots.
template <class KeyFn, class Emit>
__device__ __forceinline__ void warp_top_k(int count, int k, int base, KeyFn key, Emit emit) {
  const int lane = threadIdx.x & 31;
  u64 taken = 0;
  auto lane_best = [&]() {
    u64 b = 0;
    for (int s = 0; lane + 32 * s < count; ++s) {
      if (!((taken >> s) & 1ull)) {
        const u64 kk = key(lane + 32 * s);
        b = kk > b ? kk : b;
      }
    }
    return b;
  };
  u64 mine = lane_best();
  for (int t = 0; t < k; ++t) {
    const u64 w = warp_max_u64(mine);
    const int id = key_index(w);
    emit(t, id);
    const int i = id - base;
    if ((i & 31) == lane) {
      taken |= 1ull << (i >> 5);
      mine = lane_best();
    }
  }
}

// ---- per-lane partial top-k with a warp merge ----

constexpr int kMergeK = 8;  // k of the merge path (DeepSeek-V3, Qwen3, Mixtral, GPT-OSS)

// Inserts v into the descending list top[0..kMergeK) (compile-time indices only: registers).
__device__ __forceinline__ void insert_desc(u64 (&top)[kMergeK], u64 v) {
#pragma unroll
  for (int i = 0; i < kMergeK; ++i) {
    const u64 hi = top[i] > v ? top[i] : v;
    v = top[i] > v ? v : top[i];
    top[i] = hi;
  }
}

// The lane's kMergeK best keys among candidates lane, lane + 32, ... < count.
template <class KeyFn>
__device__ __forceinline__ void lane_top_k(int count, int lane, u64 (&top)[kMergeK], KeyFn key) {
#pragma unroll
  for (int i = 0; i < kMergeK; ++i) top[i] = 0;
  for (int j = lane; j < count; j += 32) insert_desc(top, key(j));
}

// Butterfly merge over the warp: at each step a lane takes the kMergeK best of its list and its
// partner's. The elementwise maximum of one descending list and the other reversed holds the
// kMergeK best of the union as a bitonic sequence, which a half-cleaner network (strides 4, 2,
// 1) sorts. The keys are unique (index in the low bits; 0 only for excluded candidates), so
// every lane ends with the same list, largest first.
__device__ __forceinline__ void warp_merge_top_k(u64 (&top)[kMergeK]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    u64 q[kMergeK];
#pragma unroll
    for (int i = 0; i < kMergeK; ++i) q[i] = __shfl_xor_sync(0xffffffffu, top[i], o);
#pragma unroll
    for (int i = 0; i < kMergeK; ++i) {
      const u64 b = q[kMergeK - 1 - i];
      top[i] = top[i] > b ? top[i] : b;
    }
#pragma unroll
    for (int st = kMergeK / 2; st > 0; st >>= 1) {
#pragma unroll
      for (int i = 0; i < kMergeK; ++i) {
        if ((i & st) == 0) {
          const u64 a = top[i], b = top[i + st];
          top[i] = a > b ? a : b;
          top[i + st] = a > b ? b : a;
        }
      }
    }
  }
}

// Group scores of the grouped selection, all groups at once (G <= 32, take <= 2): the lanes of
// a group (a power of two of them, 32 / G rounded down) each keep the two best keys of their
// share of the group's candidates, merge them with xor shuffles, and the group's first lane
// writes the sum of the take best scores, best first: the same keys, order and sum as one
// warp_top_k per group.
template <class Params>
__device__ __forceinline__ void group_scores_parallel(const Params& p, const float* score,
                                                      float* gscore, int lane) {
  int lpg = 1;
  while (lpg * 2 * p.G <= 32) lpg *= 2;
  const int g = lane / lpg, sub = lane % lpg;
  const int base = g * p.gsize;
  u64 b0 = 0, b1 = 0;
  if (g < p.G) {
    for (int i = sub; i < p.gsize; i += lpg) {
      const u64 k = rank_key(score[base + i], base + i);
      if (k > b0) {
        b1 = b0;
        b0 = k;
      } else if (k > b1) {
        b1 = k;
      }
    }
  }
  for (int o = lpg / 2; o > 0; o >>= 1) {
    const u64 q0 = __shfl_xor_sync(0xffffffffu, b0, o), q1 = __shfl_xor_sync(0xffffffffu, b1, o);
    const u64 n0 = b0 > q0 ? b0 : q0;
    const u64 n1 = b0 > q0 ? (b1 > q0 ? b1 : q0) : (b0 > q1 ? b0 : q1);
    b0 = n0;
    b1 = n1;
  }
  if (g < p.G && sub == 0) {
    float gs = 0.0f;
    gs += score[key_index(b0)];
    if (p.take == 2) gs += score[key_index(b1)];
    gscore[g] = gs;
  }
  __syncwarp();
}

struct FwdParams {
  const void* x;
  const void* bias;
  void* y;
  int32_t* idx;
  float* norm_out;
  int64_t M;
  int N, K, G, gsize, k_group, take, norm_type;
  bool has_bias, renorm, out_flag, grouped;
  float rsf, eps;
  int per_warp_floats;  // shared floats per warp (2N + K + G, then G bytes of flags)
};

// Shared floats per warp: score[N], norm[N], order[K] (int), gscore[G], kept[G] (bytes).
inline int fwd_warp_floats(int N, int K, int G) { return 2 * N + K + G + (G + 3) / 4 + 1; }

template <typename T>
__global__ void gating_fwd_kernel(FwdParams p) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
  float* score = smem + warp * p.per_warp_floats;
  float* norm = score + p.N;
  int* order = reinterpret_cast<int*>(norm + p.N);
  float* gscore = reinterpret_cast<float*>(order + p.K);
  unsigned char* kept = reinterpret_cast<unsigned char*>(gscore + p.G);
  const T* x = static_cast<const T*>(p.x);
  const T* bias = static_cast<const T*>(p.bias);
  const int N = p.N, K = p.K;

  for (int64_t r = int64_t{blockIdx.x} * wpb + warp; r < p.M; r += int64_t{gridDim.x} * wpb) {
    const T* xr = x + r * N;
    // Normalise (softmax / sigmoid / sqrt-softplus), fp32.
    if (p.norm_type == 0) {
      float m = -INFINITY;
      bool has_nan = false;
      for (int j = lane; j < N; j += 32) {
        const float l = ld(xr + j);
        score[j] = l;
        has_nan |= isnan(l);
        m = l > m ? l : m;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, m, o);
        m = w > m ? w : m;
      }
      has_nan = __any_sync(0xffffffffu, has_nan);
      float part = 0.0f;
      for (int j = lane; j < N; j += 32) {
        const float d = score[j] - m;
        const float e = isnan(d) ? d : expf(d);
        norm[j] = e;
        part += e;
      }
      const float inv = has_nan ? __int_as_float(0x7fc00000) : 1.0f / warp_sum(part);
      for (int j = lane; j < N; j += 32) norm[j] *= inv;
    } else if (p.norm_type == 1) {
      for (int j = lane; j < N; j += 32) norm[j] = sigmoid_stable(ld(xr + j));
    } else {
      for (int j = lane; j < N; j += 32) {
        norm[j] = sqrt_softplus(ld(xr + j));
      }
    }
    for (int j = lane; j < N; j += 32) score[j] = p.has_bias ? norm[j] + ld(bias + j) : norm[j];
    __syncwarp();

    if (p.grouped) {
      if (p.G <= 32 && p.take <= 2) {
        group_scores_parallel(p, score, gscore, lane);
      } else {
        const int gsize = p.gsize;
        for (int g = 0; g < p.G; ++g) {
          const int base = g * gsize;
          float gs = 0.0f;
          warp_top_k(
              gsize, p.take, base, [&](int i) { return rank_key(score[base + i], base + i); },
              [&](int, int id) { gs += score[id]; });
          if (lane == 0) gscore[g] = gs;
        }
      }
      for (int g = lane; g < p.G; g += 32) kept[g] = 0;
      __syncwarp();
      warp_top_k(
          p.G, p.k_group, 0, [&](int i) { return rank_key(gscore[i], i); },
          [&](int, int id) {
            if (lane == 0) kept[id] = 1;
          });
      __syncwarp();
    }

    float sum = 0.0f;
    if (K <= kMergeK) {
      // Per-lane top-kMergeK over the lane's candidates, then a butterfly merge: every lane
      // ends with the same k best keys, largest first (5 dependent exchange steps instead of K
      // serial warp-max rounds).
      u64 top[kMergeK];
      lane_top_k(N, lane, top, [&](int j) -> u64 {
        if (p.grouped && !kept[j / p.gsize]) return 0;
        return rank_key(score[j], j);
      });
      warp_merge_top_k(top);
#pragma unroll
      for (int t = 0; t < kMergeK; ++t) {
        if (t < K) {
          const int id = key_index(top[t]);
          sum += norm[id];
          if (lane == 0) order[t] = id;
        }
      }
    } else {
    warp_top_k(
        N, K, 0,
        [&](int j) -> u64 {
          if (p.grouped && !kept[j / p.gsize]) return 0;
          return rank_key(score[j], j);
        },
        [&](int t, int id) {
          sum += norm[id];
          if (lane == 0) order[t] = id;
        });
    }
    __syncwarp();
    const float denom = sum + p.eps;
    T* yr = static_cast<T*>(p.y) + r * K;
    int32_t* ir = p.idx + r * K;
    for (int t = lane; t < K; t += 32) {
      const int o = order[t];
      const float g = norm[o];
      const float w = p.renorm ? g / denom : g;
      st(yr + t, w * p.rsf);
      ir[t] = o;
    }
    float* nr = p.norm_out + r * N;
    for (int j = lane; j < N; j += 32) nr[j] = p.out_flag ? norm[j] : 0.0f;
    __syncwarp();  // shared rows are rewritten by the next token
  }
}

struct BwdParams {
  const float* x_norm;
  const void* grad_y;
  const int32_t* idx;
  void* grad_x;
  int64_t M;
  int N, K, norm_type;
  bool renorm;
  float rsf, eps;
};

template <typename T>
__global__ void gating_bwd_kernel(BwdParams p) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
  const int N = p.N, K = p.K;
  float* sg = smem + warp * 2 * N;  // accumulated gradient of the selected entries
  float* sx = sg + N;               // their x_norm values (0 elsewhere)
  const T* gy = static_cast<const T*>(p.grad_y);
  for (int64_t r = int64_t{blockIdx.x} * wpb + warp; r < p.M; r += int64_t{gridDim.x} * wpb) {
    for (int j = lane; j < N; j += 32) {
      sg[j] = 0.0f;
      sx[j] = 0.0f;
    }
    const float* xr = p.x_norm + r * N;
    const int32_t* er = p.idx + r * K;
    const T* gr = gy + r * K;
    // Slot k = k0 + lane is loaded by one lane (chunks of 32 slots); the sums of §1.5 then run
    // over the slots in k order through shuffles, exactly the CPU's order, so the bits match.
    auto read = [&](int k0, int32_t& e, float& w, float& g) {
      const int k = k0 + lane;
      e = k < K ? er[k] : -1;
      w = (e >= 0 && e < N) ? xr[e] : 0.0f;  // invalid device indices are skipped (D6)
      g = k < K ? p.rsf * ld(gr + k) : 0.0f;
    };
    // K <= 32 (every MoE model): the slots are read once, into registers, and the three sums
    // below reuse them (a single pass over memory); larger K re-read their chunks.
    int32_t e1 = -1;
    float w1 = 0.0f, g1 = 0.0f;
    if (K <= 32) read(0, e1, w1, g1);
    auto load = [&](int k0, int32_t& e, float& w, float& g) {
      if (K <= 32) {
        e = e1;
        w = w1;
        g = g1;
      } else {
        read(k0, e, w, g);
      }
    };
    float sum = 0.0f;
    for (int k0 = 0; k0 < K; k0 += 32) {
      int32_t e;
      float w, g;
      load(k0, e, w, g);
      const int n = K - k0 < 32 ? K - k0 : 32;
      for (int t = 0; t < n; ++t) sum += __shfl_sync(0xffffffffu, w, t);
    }
    // g' = the renormalisation backward of g (sigmoid, sqrt-softplus, softmax with renorm) or
    // g itself (softmax without renorm), as the CPU (D22).
    const float denom = p.eps + sum;
    float beta = 0.0f;
    if (p.renorm) {
      for (int k0 = 0; k0 < K; k0 += 32) {
        int32_t e;
        float w, g;
        load(k0, e, w, g);
        const int n = K - k0 < 32 ? K - k0 : 32;
        for (int t = 0; t < n; ++t) {
          beta += (__shfl_sync(0xffffffffu, w, t) / denom) * __shfl_sync(0xffffffffu, g, t);
        }
      }
    }
    __syncwarp();
    float dot = 0.0f;  // sum_k w_k g'_k in slot order (softmax Jacobian)
    for (int k0 = 0; k0 < K; k0 += 32) {
      int32_t e;
      float w, g;
      load(k0, e, w, g);
      const float gp = p.renorm ? (g - beta) / denom : g;
      const int n = K - k0 < 32 ? K - k0 : 32;
      for (int t = 0; t < n; ++t) {
        const int32_t et = __shfl_sync(0xffffffffu, e, t);
        const float wt = __shfl_sync(0xffffffffu, w, t), gt = __shfl_sync(0xffffffffu, gp, t);
        dot += wt * gt;
        if (lane == 0 && et >= 0 && et < N) {
          sg[et] += gt;  // repeats are summed in k order (D1)
          sx[et] = wt;
        }
      }
    }
    __syncwarp();
    T* out = static_cast<T*>(p.grad_x) + r * N;
    if (p.norm_type == 1) {  // selected entries only; +0 elsewhere (L42)
      for (int j = lane; j < N; j += 32) st(out + j, sx[j] * (1.0f - sx[j]) * sg[j]);
    } else if (p.norm_type == 2) {
      for (int j = lane; j < N; j += 32) st(out + j, sqrt_softplus_grad(sx[j]) * sg[j]);
    } else {  // the softmax Jacobian touches every column: the whole row is read
      for (int j = lane; j < N; j += 32) st(out + j, xr[j] * (sg[j] - dot));
    }
    __syncwarp();
  }
}


constexpr int kSmemBudget = 32 * 1024;  // per block, below the 48 KiB default limit

int warps_for(int bytes_per_warp) {
  int w = kSmemBudget / bytes_per_warp;
  return w < 1 ? 1 : (w > 8 ? 8 : w);
}

}  // namespace
}  // namespace cuda

void gating_top_k_cuda_size(GatingTopKPlan&, WorkspaceLayout&) {}

void gating_top_k_cuda(const GatingTopKPlan& plan, const Workspace&, void* stream) {
  using namespace cuda;
  if (plan.M == 0) return;  // zero tokens launch nothing
  set_device(plan.op, plan.device_id);
  const GatingTopKAttrs& a = plan.attrs;
  FwdParams p;
  p.x = plan.x.data;
  p.bias = plan.has_bias ? plan.bias.data : nullptr;
  p.y = plan.y.data;
  p.idx = static_cast<int32_t*>(plan.expert_idx.data);
  p.norm_out = static_cast<float*>(plan.norm_out.data);
  p.M = plan.M;
  p.N = static_cast<int>(plan.N);
  p.K = static_cast<int>(a.k);
  p.G = static_cast<int>(a.group_count);
  p.gsize = static_cast<int>(plan.N / a.group_count);
  p.k_group = static_cast<int>(a.k_group);
  p.take = a.group_select_mode == 0 ? 1 : 2;
  p.norm_type = static_cast<int>(a.norm_type);
  p.has_bias = plan.has_bias;
  p.renorm = a.norm_type != 0 || a.renorm == 1;
  p.out_flag = a.out_flag;
  p.grouped = plan.grouped;
  p.rsf = static_cast<float>(a.routed_scaling_factor);
  p.eps = static_cast<float>(a.eps);
  p.per_warp_floats = fwd_warp_floats(p.N, p.K, p.G);
  const int wpb = warps_for(p.per_warp_floats * 4);
  const size_t smem = static_cast<size_t>(wpb) * p.per_warp_floats * 4;
  const unsigned int blocks = grid_blocks(plan.M, wpb);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  dispatch(plan.x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    gating_fwd_kernel<T><<<blocks, wpb * 32, smem, s>>>(p);
  });
  check_launch(plan.op);
}

void gating_top_k_backward_cuda_size(GatingTopKBackwardPlan& plan, WorkspaceLayout& layout) {
  plan.ws_idx = index_scratch(layout, plan.expert_idx);
  plan.strict_indices = strict_indices();
  if (plan.strict_indices) {
    plan.ws_strict = layout.add<unsigned char>(
        static_cast<int64_t>(cuda::strict_ws_bytes(plan.N, false)));
  }
}

void gating_top_k_backward_cuda(const GatingTopKBackwardPlan& plan, const Workspace& ws,
                                void* stream) {
  using namespace cuda;
  if (plan.M == 0) return;
  set_device(plan.op, plan.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int32_t* idx =
      device_index32(plan.op, plan.expert_idx, ws.get<int32_t>(plan.ws_idx), s);
  if (plan.strict_indices) {
    strict_check(plan.op, kErrParamInvalid, "expert_idx", idx, plan.M * plan.K, 0, plan.N, false,
                 ws.get<unsigned char>(plan.ws_strict), s);
  }
  BwdParams p;
  p.x_norm = static_cast<const float*>(plan.x_norm.data);
  p.grad_y = plan.grad_y.data;
  p.idx = idx;
  p.grad_x = plan.grad_x.data;
  p.M = plan.M;
  p.N = static_cast<int>(plan.N);
  p.K = static_cast<int>(plan.K);
  p.norm_type = static_cast<int>(plan.attrs.norm_type);
  p.renorm = plan.attrs.norm_type != 0 || plan.attrs.renorm == 1;
  p.rsf = static_cast<float>(plan.attrs.routed_scaling_factor);
  p.eps = static_cast<float>(plan.attrs.eps);
  const int wpb = warps_for(2 * p.N * 4);
  const size_t smem = static_cast<size_t>(wpb) * 2 * p.N * 4;
  const unsigned int blocks = grid_blocks(plan.M, wpb);
  dispatch(plan.grad_y.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    gating_bwd_kernel<T><<<blocks, wpb * 32, smem, s>>>(p);
  });
  check_launch(plan.op);
}

}  // namespace moegrad
