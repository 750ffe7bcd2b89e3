// CUDA kernels of finalize routing forward (docs/operators.md §4) and grad (§3).
// One block per token row; 16-byte vector loads and stores over the hidden dim with a scalar
// tail, so any H and any alignment works (misaligned views take the scalar path). The grad
// writes each covered row of grad_expanded_x once from its owning slot (the highest flat
// position that addresses it, found with integer atomics: deterministic even for repeated
// device indices), zeroes the uncovered rows on the device, and reduces grad_scales with a
// fixed-order block reduction (no floating-point atomics, D16; L44).
#include "core/cuda_backend.h"
#include "core/cuda_common.cuh"
#include "core/cuda_sort.cuh"
#include "core/host.h"
#include "ops/finalize_routing/finalize_routing.h"

namespace moegrad {
namespace cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kMetaK = 256;  // slots whose row offsets are staged in shared memory
constexpr int kFwdUnroll = 4;  // slots whose rows are loaded before they are added

struct FwdParams {
  const void* ex;
  const int32_t* idx;
  const void* x1;
  const void* x2;
  const void* bias;
  const void* scales;
  const int32_t* eidx;
  void* out;
  int64_t R, K, H, rows, num_bias;
  int sdt;
  bool row_layout, vec;
};

// Offsets (in elements) of slot k's expanded row and bias row, -1 where absent or invalid.
struct Slot {
  int64_t x, b;
  float s;
};

__device__ __forceinline__ Slot fwd_slot(const FwdParams& p, int64_t r, int64_t k) {
  const int64_t flat = p.row_layout ? r * p.K + k : k * p.R + r;
  const int32_t d = p.idx[flat];
  Slot sl;
  sl.s = p.scales ? ld_any(p.scales, p.sdt, r * p.K + k) : 1.0f;
  sl.b = -1;
  if (p.bias) {
    const int32_t e = p.eidx[r * p.K + k];
    if (e >= 0 && e < p.num_bias) sl.b = int64_t{e} * p.H;
  }
  sl.x = (d >= 0 && d < p.rows) ? int64_t{d} * p.H : -1;  // dropped / invalid: skipped (D6, D7)
  return sl;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) finalize_fwd_kernel(FwdParams p) {
  __shared__ int64_t s_x[kMetaK], s_b[kMetaK];
  __shared__ float s_s[kMetaK];
  constexpr int W = Vec<T>::W;
  const T* __restrict__ ex = static_cast<const T*>(p.ex);
  const T* __restrict__ x1 = static_cast<const T*>(p.x1);
  const T* __restrict__ x2 = static_cast<const T*>(p.x2);
  const T* __restrict__ bias = static_cast<const T*>(p.bias);
  const int64_t H = p.H, K = p.K;
  const bool staged = K <= kMetaK;
  const int64_t nv = p.vec ? H / W : 0;
  for (int64_t r = blockIdx.x; r < p.R; r += gridDim.x) {
    if (staged) {
      for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
        const Slot sl = fwd_slot(p, r, k);
        s_x[k] = sl.x;
        s_b[k] = sl.b;
        s_s[k] = sl.s;
      }
      __syncthreads();
    }
    auto slot = [&](int64_t k) {
      if (staged) return Slot{s_x[k], s_b[k], s_s[k]};
      return fwd_slot(p, r, k);
    };
    T* __restrict__ orow = static_cast<T*>(p.out) + r * H;
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
      const int64_t h = v * W;
      Vec<T> acc;
      if (x1) {
        acc = ld_vec_nc(x1 + r * H + h);
      } else {
#pragma unroll
        for (int i = 0; i < W; ++i) acc.v[i] = 0.0f;
      }
      if (x2) {
        const Vec<T> b = ld_vec_nc(x2 + r * H + h);
#pragma unroll
        for (int i = 0; i < W; ++i) acc.v[i] += b.v[i];
      }
      // kFwdUnroll slots at a time: every present row's 16-byte load issued first (up to
      // 2 * kFwdUnroll in flight), then the adds in slot order with the CPU's operations.
      for (int64_t k0 = 0; k0 < K; k0 += kFwdUnroll) {
        Slot sl[kFwdUnroll];
        Vec<T> xv[kFwdUnroll], bv[kFwdUnroll];
#pragma unroll
        for (int u = 0; u < kFwdUnroll; ++u) {
          sl[u] = k0 + u < K ? slot(k0 + u) : Slot{-1, -1, 0.0f};
          if (sl[u].x >= 0) xv[u] = ld_vec_nc(ex + sl[u].x + h);
          if (sl[u].b >= 0) bv[u] = ld_vec_nc(bias + sl[u].b + h);
        }
#pragma unroll
        for (int u = 0; u < kFwdUnroll; ++u) {
          if (sl[u].x >= 0 && sl[u].b >= 0) {
#pragma unroll
            for (int i = 0; i < W; ++i) acc.v[i] += sl[u].s * (xv[u].v[i] + bv[u].v[i]);
          } else if (sl[u].x >= 0) {
#pragma unroll
            for (int i = 0; i < W; ++i) acc.v[i] += sl[u].s * xv[u].v[i];
          } else if (sl[u].b >= 0) {  // dropped slots keep their bias term (D7, L5)
#pragma unroll
            for (int i = 0; i < W; ++i) acc.v[i] += sl[u].s * bv[u].v[i];
          }
        }
      }
      st_vec(orow + h, acc);
    }
    for (int64_t h = nv * W + threadIdx.x; h < H; h += blockDim.x) {
      float acc = x1 ? ld(x1 + r * H + h) : 0.0f;
      if (x2) acc += ld(x2 + r * H + h);
      for (int64_t k = 0; k < K; ++k) {
        const Slot sl = slot(k);
        if (sl.x >= 0 && sl.b >= 0) {
          acc += sl.s * (ld(ex + sl.x + h) + ld(bias + sl.b + h));
        } else if (sl.x >= 0) {
          acc += sl.s * ld(ex + sl.x + h);
        } else if (sl.b >= 0) {
          acc += sl.s * ld(bias + sl.b + h);
        }
      }
      st(orow + h, acc);
    }
    if (staged) __syncthreads();  // the staged slots are rewritten by the next row
  }
}

struct GradParams {
  const void* gy;
  const int32_t* idx;
  const void* ex;
  const void* scales;
  const int32_t* eidx;
  const void* bias;
  void* gex;
  void* gs;
  const long long* owner;
  int64_t R, K, H, rows, num_bias;
  int sdt, gsdt;
  bool vec;
};

// owner[d] = the highest flat position i with idx[i] == d (rows no valid index addresses keep
// -1). Integer atomics only.
__global__ void owner_kernel(const int32_t* __restrict__ idx, int64_t n, int64_t rows,
                             long long* owner) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int32_t d = idx[i];
    if (d >= 0 && d < rows) atomicMax(owner + d, static_cast<long long>(i));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) zero_rows_kernel(const long long* __restrict__ owner,
                                                             int64_t rows, int64_t H, bool vec,
                                                             T* gex) {
  constexpr int W = Vec<T>::W;
  const int64_t nv = vec ? H / W : 0;
  for (int64_t d = blockIdx.x; d < rows; d += gridDim.x) {
    if (owner[d] >= 0) continue;
    T* row = gex + d * H;
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) st_zero_vec(row + v * W);
    for (int64_t h = nv * W + threadIdx.x; h < H; h += blockDim.x) st(row + h, 0.0f);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) finalize_grad_kernel(GradParams p) {
  __shared__ float red[32];
  constexpr int W = Vec<T>::W;
  const T* gy = static_cast<const T*>(p.gy);
  const T* ex = static_cast<const T*>(p.ex);
  const T* bias = static_cast<const T*>(p.bias);
  T* gex = static_cast<T*>(p.gex);
  const int64_t H = p.H, K = p.K;
  const int64_t nv = p.vec ? H / W : 0;
  for (int64_t r = blockIdx.x; r < p.R; r += gridDim.x) {
    const T* grow = gy + r * H;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = r * K + k;
      const int32_t d = p.idx[i];
      const bool valid = d >= 0 && d < p.rows;
      const bool own = valid && p.owner[d] == i;
      const float s = p.scales ? ld_any(p.scales, p.sdt, i) : 1.0f;
      int64_t bo = -1;
      if (p.bias) {
        const int32_t e = p.eidx[i];
        if (e >= 0 && e < p.num_bias) bo = int64_t{e} * H;
      }
      const int64_t xo = (valid && p.scales) ? int64_t{d} * H : -1;
      T* drow = own ? gex + int64_t{d} * H : nullptr;
      const bool dot = p.scales && (xo >= 0 || bo >= 0);
      float part = 0.0f;
      for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
        const int64_t h = v * W;
        const Vec<T> g = ld_vec(grow + h);
        if (drow) {
          Vec<T> o;
#pragma unroll
          for (int j = 0; j < W; ++j) o.v[j] = g.v[j] * s;
          st_vec(drow + h, o);
        }
        if (dot) {
          Vec<T> a;
          if (xo >= 0 && bo >= 0) {
            const Vec<T> xv = ld_vec(ex + xo + h), bv = ld_vec(bias + bo + h);
#pragma unroll
            for (int j = 0; j < W; ++j) a.v[j] = xv.v[j] + bv.v[j];
          } else if (xo >= 0) {
            a = ld_vec(ex + xo + h);
          } else {
            a = ld_vec(bias + bo + h);
          }
#pragma unroll
          for (int j = 0; j < W; ++j) part += a.v[j] * g.v[j];
        }
      }
      for (int64_t h = nv * W + threadIdx.x; h < H; h += blockDim.x) {
        const float g = ld(grow + h);
        if (drow) st(drow + h, g * s);
        if (dot) {
          float a;
          if (xo >= 0 && bo >= 0) {
            a = ld(ex + xo + h) + ld(bias + bo + h);
          } else if (xo >= 0) {
            a = ld(ex + xo + h);
          } else {
            a = ld(bias + bo + h);
          }
          part += a * g;
        }
      }
      // Uniform across the block: every thread takes the same branch.
      const float total = dot ? block_sum(part, red) : 0.0f;
      if (threadIdx.x == 0) st_any(p.gs, p.gsdt, i, total);  // D5: zeros without scales
    }
  }
}


// Bias grad (D23): block (e, c) sums the slots of expert e over a chunk of columns, in slot
// order (the stable sort keeps each expert's list in slot order), s * g rounded and added on its
// own (no FMA) from +0: the CPU's operations in the CPU's order, so the same bits. Each thread
// owns one 16-byte vector of columns and keeps kBiasUnroll slots' loads in flight.
constexpr int kBiasUnroll = 4;
struct BiasGradParams {
  const void* gy;
  const void* scales;
  const int32_t* slots;
  const int32_t* starts;
  void* out;
  int64_t K, H, E;
  int sdt;
  bool vec;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) bias_grad_kernel(BiasGradParams p) {
  constexpr int W = Vec<T>::W;
  const T* __restrict__ gy = static_cast<const T*>(p.gy);
  const int64_t e = blockIdx.x, H = p.H;
  const int64_t q0 = p.starts[e], q1 = p.starts[e + 1];
  T* __restrict__ orow = static_cast<T*>(p.out) + e * H;
  if (p.vec) {
    const int64_t h = (int64_t{blockIdx.y} * blockDim.x + threadIdx.x) * W;
    if (h >= H) return;
    Vec<T> acc;
#pragma unroll
    for (int i = 0; i < W; ++i) acc.v[i] = 0.0f;
    for (int64_t q = q0; q < q1; q += kBiasUnroll) {
      Vec<T> g[kBiasUnroll];
      float sc[kBiasUnroll];
#pragma unroll
      for (int u = 0; u < kBiasUnroll; ++u) {
        if (q + u < q1) {
          const int64_t i = p.slots[q + u];
          sc[u] = p.scales ? ld_any(p.scales, p.sdt, i) : 1.0f;
          g[u] = ld_vec(gy + (i / p.K) * H + h);
        }
      }
#pragma unroll
      for (int u = 0; u < kBiasUnroll; ++u) {
        if (q + u >= q1) break;
#pragma unroll
        for (int i = 0; i < W; ++i) acc.v[i] += sc[u] * g[u].v[i];
      }
    }
    st_vec(orow + h, acc);
  } else {
    const int64_t h = int64_t{blockIdx.y} * blockDim.x + threadIdx.x;
    if (h >= H) return;
    float acc = 0.0f;
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t i = p.slots[q];
      const float sc = p.scales ? ld_any(p.scales, p.sdt, i) : 1.0f;
      acc += sc * ld(gy + (i / p.K) * H + h);
    }
    st(orow + h, acc);
  }
}

uint64_t strict_bytes(bool strict, int64_t limit, int64_t num_bias) {
  if (!strict) return 0;
  const uint64_t a = strict_ws_bytes(limit, true), b = strict_ws_bytes(num_bias, false);
  return a > b ? a : b;
}

}  // namespace
}  // namespace cuda

namespace {
Slot strict_slot(WorkspaceLayout& layout, int64_t limit, int64_t num_bias) {
  return layout.add<unsigned char>(static_cast<int64_t>(cuda::strict_bytes(true, limit, num_bias)));
}
}  // namespace

void finalize_routing_cuda_size(FinalizeRoutingPlan& plan, WorkspaceLayout& layout) {
  plan.ws_idx = index_scratch(layout, plan.expanded_row_idx);
  if (plan.has_bias) plan.ws_eidx = index_scratch(layout, plan.expert_idx);
  plan.strict_indices = strict_indices();
  const bool drop_pad = plan.drop_pad_mode == 1 || plan.drop_pad_mode == 3;
  if (plan.strict_indices) {
    plan.ws_strict = strict_slot(layout, drop_pad ? plan.rows : plan.R * plan.K, plan.num_bias);
  }
}

void finalize_routing_cuda(const FinalizeRoutingPlan& plan, const Workspace& ws, void* stream) {
  using namespace cuda;
  if (plan.R == 0) return;  // zero tokens launch nothing
  set_device(plan.op, plan.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int32_t* idx =
      device_index32(plan.op, plan.expanded_row_idx, ws.get<int32_t>(plan.ws_idx), s);
  const int32_t* eidx =
      plan.has_bias ? device_index32(plan.op, plan.expert_idx, ws.get<int32_t>(plan.ws_eidx), s)
                    : nullptr;
  const bool drop_pad = plan.drop_pad_mode == 1 || plan.drop_pad_mode == 3;
  if (plan.strict_indices) {
    void* sws = ws.get<unsigned char>(plan.ws_strict);
    strict_check(plan.op, kErrInnerNullptr, "expanded_row_idx", idx, plan.R * plan.K,
                 drop_pad ? -1 : 0, drop_pad ? plan.rows : plan.R * plan.K, true, sws, s);
    if (plan.has_bias) {
      strict_check(plan.op, kErrInnerNullptr, "expert_idx", eidx, plan.R * plan.K, 0,
                   plan.num_bias, false, sws, s);
    }
  }
  FwdParams p;
  p.ex = plan.expanded_x.data;
  p.idx = idx;
  p.x1 = plan.has_x1 ? plan.x1.data : nullptr;
  p.x2 = plan.has_x2 ? plan.x2.data : nullptr;
  p.bias = plan.has_bias ? plan.bias.data : nullptr;
  p.scales = plan.has_scales ? plan.scales.data : nullptr;
  p.eidx = eidx;
  p.out = plan.out.data;
  p.R = plan.R;
  p.K = plan.K;
  p.H = plan.H;
  p.rows = plan.rows;
  p.num_bias = plan.num_bias;
  p.sdt = static_cast<int>(plan.has_scales ? plan.scales.dtype : plan.expanded_x.dtype);
  p.row_layout = plan.row_layout;
  p.vec = vec_ok(plan.H, plan.expanded_x.dtype, {p.ex, p.x1, p.x2, p.bias, p.out});
  const unsigned int blocks = grid_blocks(plan.R, 1);
  dispatch(plan.expanded_x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    finalize_fwd_kernel<T><<<blocks, kThreads, 0, s>>>(p);
  });
  check_launch(plan.op);
}

void finalize_routing_grad_cuda_size(FinalizeRoutingGradPlan& plan, WorkspaceLayout& layout) {
  plan.ws_idx = index_scratch(layout, plan.expanded_row_idx);
  if (plan.has_bias) plan.ws_eidx = index_scratch(layout, plan.expert_idx);
  plan.ws_owner = layout.add<long long>(plan.rows);
  plan.strict_indices = strict_indices();
  if (plan.strict_indices) {
    const int64_t limit = plan.drop_pad_mode == 1 ? plan.rows : plan.R * plan.K;
    plan.ws_strict = strict_slot(layout, limit, plan.num_bias);
  }
}

void finalize_routing_grad_cuda(const FinalizeRoutingGradPlan& plan, const Workspace& ws,
                                void* stream) {
  using namespace cuda;
  const int64_t n_idx = plan.R * plan.K;
  if (plan.rows == 0 && n_idx == 0) return;
  set_device(plan.op, plan.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int32_t* idx =
      device_index32(plan.op, plan.expanded_row_idx, ws.get<int32_t>(plan.ws_idx), s);
  const int32_t* eidx =
      plan.has_bias ? device_index32(plan.op, plan.expert_idx, ws.get<int32_t>(plan.ws_eidx), s)
                    : nullptr;
  long long* owner = ws.get<long long>(plan.ws_owner);
  if (plan.strict_indices) {
    void* sws = ws.get<unsigned char>(plan.ws_strict);
    const bool drop_pad = plan.drop_pad_mode == 1;
    strict_check(plan.op, kErrInnerNullptr, "expanded_row_idx", idx, n_idx, drop_pad ? -1 : 0,
                 drop_pad ? plan.rows : n_idx, true, sws, s);
    if (plan.has_bias) {
      strict_check(plan.op, kErrInnerNullptr, "expert_idx", eidx, n_idx, 0, plan.num_bias, false,
                   sws, s);
    }
  }
  const DType dt = plan.grad_y.dtype;
  GradParams p;
  p.gy = plan.grad_y.data;
  p.idx = idx;
  p.ex = plan.has_scales ? plan.expanded_x.data : nullptr;
  p.scales = plan.has_scales ? plan.scales.data : nullptr;
  p.eidx = eidx;
  p.bias = plan.has_bias ? plan.bias.data : nullptr;
  p.gex = plan.grad_expanded_x.data;
  p.gs = plan.grad_scales.data;
  p.owner = owner;
  p.R = plan.R;
  p.K = plan.K;
  p.H = plan.H;
  p.rows = plan.rows;
  p.num_bias = plan.num_bias;
  p.sdt = static_cast<int>(plan.has_scales ? plan.scales.dtype : dt);
  p.gsdt = static_cast<int>(plan.grad_scales_dtype);
  p.vec = vec_ok(plan.H, dt, {p.gy, p.ex, p.bias, p.gex});
  if (plan.rows > 0) {
    check_cuda(plan.op, "cudaMemsetAsync",
               cudaMemsetAsync(owner, 0xff, sizeof(long long) * plan.rows, s));  // -1
  }
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (n_idx > 0 && plan.rows > 0) {
      owner_kernel<<<grid_blocks(n_idx, 256), 256, 0, s>>>(idx, n_idx, plan.rows, owner);
    }
    if (plan.rows > 0) {
      zero_rows_kernel<T><<<grid_blocks(plan.rows, 1), kThreads, 0, s>>>(
          owner, plan.rows, plan.H, p.vec, static_cast<T*>(p.gex));
    }
    if (plan.R > 0) finalize_grad_kernel<T><<<grid_blocks(plan.R, 1), kThreads, 0, s>>>(p);
  });
  check_launch(plan.op);
}

void finalize_routing_bias_grad_cuda_size(FinalizeRoutingBiasGradPlan& plan,
                                          WorkspaceLayout& layout) {
  // Slots sorted by expert (stable: each expert's list in slot order); invalid ids last.
  cuda::SlotSort so;
  so.n = plan.R * plan.K;
  so.lo = 0;
  so.limit = plan.E;
  so.sentinel = static_cast<uint32_t>(plan.E);
  so.bins = plan.E;
  so.in_limit = so.sentinel;
  cuda::slot_sort_size(plan.op, plan.device_id, so, layout);
  plan.cuda_sort = so;
}

void finalize_routing_bias_grad_cuda(const FinalizeRoutingBiasGradPlan& plan,
                                     const Workspace& ws, void* stream) {
  using namespace cuda;
  if (plan.E == 0 || plan.H == 0) return;
  set_device(plan.op, plan.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const SortedSlots sorted = slot_sort_run(plan.op, plan.cuda_sort, plan.expert_idx, ws, s);
  BiasGradParams p;
  p.gy = plan.grad_y.data;
  p.scales = plan.has_scales ? plan.scales.data : nullptr;
  p.sdt = static_cast<int>(plan.has_scales ? plan.scales.dtype : plan.grad_y.dtype);
  p.slots = sorted.slots;
  p.starts = sorted.starts;
  p.out = plan.grad_bias.data;
  p.K = plan.K;
  p.H = plan.H;
  p.E = plan.E;
  p.vec = vec_ok(plan.H, plan.grad_y.dtype, {p.gy, p.out});
  dispatch(plan.grad_y.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t cols = p.vec ? int64_t{kThreads} * Vec<T>::W : kThreads;
    const dim3 grid(static_cast<unsigned int>(plan.E),
                    static_cast<unsigned int>((plan.H + cols - 1) / cols));
    bias_grad_kernel<T><<<grid, kThreads, 0, s>>>(p);
  });
  check_launch(plan.op);
}

}  // namespace moegrad
