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
#include "ops/gating_topk/gating_topk.h"

namespace moegrad {
namespace cuda {
namespace {

using u64 = unsigned long long;

// Ranking key (L2): larger scores first, NaN above every number, +0 == -0, equal scores by
// lower index; key 0 ranks below every score (experts of groups not kept).
__device__ __forceinline__ u64 rank_key(float v, int32_t index) {
  uint32_t u = __float_as_uint(v + 0.0f);  // -0 -> +0
  if (isnan(v)) {
    u = 0xffffffffu;
  } else {
    u ^= (u & 0x80000000u) ? 0xffffffffu : 0x80000000u;
  }
  return (static_cast<u64>(u) << 32) | (0xffffffffu - static_cast<uint32_t>(index));
}
__device__ __forceinline__ int32_t key_index(u64 key) {
  return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(key));
}

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

// norm[0..N) = softmax / sigmoid / sqrt-softplus of the row xr in fp32, by one warp; scratch
// (N floats) holds the widened logits for softmax.
template <typename T>
__device__ __forceinline__ void warp_normalise(const T* xr, int N, int norm_type, float* scratch,
                                               float* norm) {
  const int lane = threadIdx.x & 31;
  float* score = scratch;
  if (norm_type == 0) {
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
  } else if (norm_type == 1) {
    for (int j = lane; j < N; j += 32) norm[j] = sigmoid_f(ld(xr + j));
  } else {
    for (int j = lane; j < N; j += 32) {
      const float l = ld(xr + j);
      const float sp = fmaxf(l, 0.0f) + log1pf(expf(-fabsf(l)));
      norm[j] = isnan(l) ? l : sqrtf(sp);
    }
  }
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
    warp_normalise(xr, N, p.norm_type, score, norm);
    for (int j = lane; j < N; j += 32) score[j] = p.has_bias ? norm[j] + ld(bias + j) : norm[j];
    __syncwarp();

    if (p.grouped) {
      const int gsize = p.gsize;
      for (int g = 0; g < p.G; ++g) {
        const int base = g * gsize;
        float gs = 0.0f;
        warp_top_k(
            gsize, p.take, base, [&](int i) { return rank_key(score[base + i], base + i); },
            [&](int, int id) { gs += score[id]; });
        if (lane == 0) gscore[g] = gs;
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

struct ReplayParams {
  const void* x;
  const int32_t* idx;
  void* y;
  float* norm_out;
  int64_t M;
  int N, K, norm_type;
  bool renorm;
  float rsf, eps;
};

// Replay (§2.8, D34): one warp per token normalises the row into shared memory (2N floats per
// warp: logits, scores), then every lane sums the K selected scores in slot order (the CPU's
// order, so the same bits) and writes its slots. Device ids outside [0, N) count as score 0 and
// are never read (D6).
template <typename T>
__global__ void gating_replay_kernel(ReplayParams p) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
  const int N = p.N, K = p.K;
  float* scratch = smem + warp * 2 * N;
  float* norm = scratch + N;
  const T* x = static_cast<const T*>(p.x);
  for (int64_t r = int64_t{blockIdx.x} * wpb + warp; r < p.M; r += int64_t{gridDim.x} * wpb) {
    warp_normalise(x + r * N, N, p.norm_type, scratch, norm);
    __syncwarp();
    const int32_t* er = p.idx + r * K;
    auto score = [&](int k) {
      const int32_t e = er[k];
      return e >= 0 && e < N ? norm[e] : 0.0f;
    };
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) sum += score(k);
    const float denom = sum + p.eps;
    T* yr = static_cast<T*>(p.y) + r * K;
    for (int k = lane; k < K; k += 32) {
      const float g = score(k);
      st(yr + k, (p.renorm ? g / denom : g) * p.rsf);
    }
    float* nr = p.norm_out + r * N;
    for (int j = lane; j < N; j += 32) nr[j] = norm[j];
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

// d sqrt(softplus(x)) / dx expressed through n = sqrt(softplus(x)): (1 - e^-n^2) / (2n), its
// series n/2 near 0; NaN propagates (the CPU's SqrtSoftplusGrad).
__device__ __forceinline__ float sqrt_softplus_grad(float n) {
  const float num = -expm1f(-(n * n));
  const float r = fabsf(n) < 1e-4f ? n * 0.5f : (num * 0.5f) / n;
  return isnan(n) ? n : r;
}

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
    auto load = [&](int k0, int32_t& e, float& w, float& g) {
      const int k = k0 + lane;
      e = k < K ? er[k] : -1;
      w = (e >= 0 && e < N) ? xr[e] : 0.0f;  // invalid device indices are skipped (D6)
      g = k < K ? p.rsf * ld(gr + k) : 0.0f;
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


// The expert_idx input of the backward and the replay (both read [M, K] ids in [0, N)): stage
// one reserves its int32 copy and, in strict mode (L46), the check's scratch; stage two narrows
// it and runs the check.
template <class Plan>
void size_expert_idx(Plan& plan, WorkspaceLayout& layout) {
  plan.ws_idx = index_scratch(layout, plan.expert_idx);
  plan.strict_indices = strict_indices();
  if (plan.strict_indices) {
    plan.ws_strict =
        layout.add<unsigned char>(static_cast<int64_t>(strict_ws_bytes(plan.N, false)));
  }
}

template <class Plan>
const int32_t* expert_idx32(const Plan& plan, const Workspace& ws, cudaStream_t s) {
  const int32_t* idx =
      device_index32(plan.op, plan.expert_idx, ws.get<int32_t>(plan.ws_idx), s);
  if (plan.strict_indices) {
    strict_check(plan.op, kErrParamInvalid, "expert_idx", idx, plan.M * plan.K, 0, plan.N, false,
                 ws.get<unsigned char>(plan.ws_strict), s);
  }
  return idx;
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
  p.renorm = renormalises(a.norm_type, a.renorm, a.no_renorm);
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
  cuda::size_expert_idx(plan, layout);
}

void gating_top_k_backward_cuda(const GatingTopKBackwardPlan& plan, const Workspace& ws,
                                void* stream) {
  using namespace cuda;
  if (plan.M == 0) return;
  set_device(plan.op, plan.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int32_t* idx = expert_idx32(plan, ws, s);
  BwdParams p;
  p.x_norm = static_cast<const float*>(plan.x_norm.data);
  p.grad_y = plan.grad_y.data;
  p.idx = idx;
  p.grad_x = plan.grad_x.data;
  p.M = plan.M;
  p.N = static_cast<int>(plan.N);
  p.K = static_cast<int>(plan.K);
  p.norm_type = static_cast<int>(plan.attrs.norm_type);
  p.renorm = renormalises(plan.attrs.norm_type, plan.attrs.renorm, plan.attrs.no_renorm);
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

void gating_replay_cuda_size(GatingReplayPlan& plan, WorkspaceLayout& layout) {
  cuda::size_expert_idx(plan, layout);
}

void gating_replay_cuda(const GatingReplayPlan& plan, const Workspace& ws, void* stream) {
  using namespace cuda;
  if (plan.M == 0) return;
  set_device(plan.op, plan.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int32_t* idx = expert_idx32(plan, ws, s);
  const GatingReplayAttrs& a = plan.attrs;
  ReplayParams p;
  p.x = plan.x.data;
  p.idx = idx;
  p.y = plan.y.data;
  p.norm_out = static_cast<float*>(plan.norm_out.data);
  p.M = plan.M;
  p.N = static_cast<int>(plan.N);
  p.K = static_cast<int>(plan.K);
  p.norm_type = static_cast<int>(a.norm_type);
  p.renorm = renormalises(a.norm_type, a.renorm, a.no_renorm);
  p.rsf = static_cast<float>(a.routed_scaling_factor);
  p.eps = static_cast<float>(a.eps);
  const int wpb = warps_for(2 * p.N * 4);
  const size_t smem = static_cast<size_t>(wpb) * 2 * p.N * 4;
  const unsigned int blocks = grid_blocks(plan.M, wpb);
  dispatch(plan.x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    gating_replay_kernel<T><<<blocks, wpb * 32, smem, s>>>(p);
  });
  check_launch(plan.op);
}

}  // namespace moegrad
