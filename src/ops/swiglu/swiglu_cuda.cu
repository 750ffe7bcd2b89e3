// CUDA kernels of SwiGLU forward (docs/operators.md §6.4 without quantisation), backward (§5)
// and the quantised forward (§6.4: FP8 e4m3fn/e5m2 blocks of 128, MX blocks of 32 with e8m0
// scales). The per-element math is swiglu_formula.h, the CPU's definition, with the fast sigmoid
// (__expf and the approximate reciprocal) and FMA contraction on (this file is compiled with
// --fmad=true, docs/decisions.md L201): the results agree with the CPU within the dtype
// tolerances, not bitwise. One block per token row; each thread keeps two 16-byte vectors of
// each input in flight (kUnroll) before it computes; bf16 narrowing by the hardware's paired
// conversion (cvt.rn.bf16x2.f32). With group_index the processed row count (L8) is the exact
// 128-bit sum, computed by one block of the device in parallel into the workspace and read by
// the main kernel: no host synchronisation (L45). Rows past it are zero-filled. grad_weight is a
// fixed-order block reduction per row (D16).
#include <cuda_bf16.h>

#include "core/cuda_backend.h"
#include "core/cuda_common.cuh"
#include "ops/swiglu/swiglu.h"
#include "ops/swiglu/swiglu_formula.h"

namespace moegrad {
namespace cuda {
namespace {

namespace sf = swiglu_formula;
using sf::Clamp;

constexpr int kThreads = 256;
constexpr int kUnroll = 2;  // 16-byte vectors per input and thread in flight

// The row count of L8: each thread sums a strided share of group_index in 128 bits, then a tree
// over the block; exact, so the order does not matter and the count is the CPU's.
constexpr int kCountThreads = 512;
__global__ void __launch_bounds__(kCountThreads)
    active_rows_kernel(const int64_t* __restrict__ g, int64_t n, int64_t T, int64_t* active) {
  __shared__ sf::Sum128 part[kCountThreads];
  sf::Sum128 s = 0;
  for (int64_t i = threadIdx.x; i < n; i += kCountThreads) s += g[i];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = kCountThreads / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *active = sf::rows_of_sum(part[0], T);
}

// 16-byte vector stores narrowed by the hardware: bf16 pairs with one cvt.rn.bf16x2.f32 (round
// to nearest even like convert.h; a NaN becomes the canonical quiet NaN), fp16 pairs likewise.
template <typename T>
__device__ __forceinline__ void st_vec_fast(T* p, const Vec<T>& in) {
  if constexpr (sizeof(T) == 2) {
    uint4 u;
    uint32_t* w = reinterpret_cast<uint32_t*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same_v<T, bf16>) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(in.v[2 * i], in.v[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t*>(&h);
      } else {
        const __half2 h = __floats2half2_rn(in.v[2 * i], in.v[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t*>(&h);
      }
    }
    *reinterpret_cast<uint4*>(p) = u;
  } else {
    st_vec(p, in);
  }
}
template <typename T>
__device__ __forceinline__ void st_fast(T* p, float v) {
  if constexpr (std::is_same_v<T, bf16>) {
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    p->bits = *reinterpret_cast<const uint16_t*>(&h);
  } else {
    st(p, v);
  }
}

struct Params {
  const void* x;
  const float* weight;
  const int64_t* active;  // device row count, or null: all T rows
  const void* gy;
  const void* y_origin;
  void* out;  // y (forward) or grad_x (backward)
  float* grad_weight;
  int64_t T, H;
  Clamp clamp;
  bool vec;
};

template <typename T>
__device__ __forceinline__ void zero_row(T* __restrict__ row, int64_t H, int64_t nv) {
  constexpr int W = Vec<T>::W;
  for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) st_zero_vec(row + v * W);
  for (int64_t h = nv * W + threadIdx.x; h < H; h += blockDim.x) st(row + h, 0.0f);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) swiglu_fwd_kernel(Params p) {
  constexpr int W = Vec<T>::W;
  const int64_t H = p.H;
  const int64_t active = p.active ? *p.active : p.T;
  const int64_t nv = p.vec ? H / W : 0;
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const int64_t step = int64_t{kUnroll} * blockDim.x;
  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x) {
    T* __restrict__ yr = static_cast<T*>(p.out) + t * H;
    if (t >= active) {
      zero_row(yr, H, nv);
      continue;
    }
    const float w = p.weight ? __ldg(p.weight + t) : 1.0f;
    const T* __restrict__ x0 = x + t * 2 * H;
    const T* __restrict__ x1 = x0 + H;
    for (int64_t v0 = threadIdx.x; v0 < nv; v0 += step) {
      // All loads of this step first: 2 * kUnroll independent 16-byte loads in flight.
      Vec<T> a[kUnroll], b[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + int64_t{u} * blockDim.x;
        if (v < nv) {
          a[u] = ld_vec_nc(x0 + v * W);
          b[u] = ld_vec_nc(x1 + v * W);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + int64_t{u} * blockDim.x;
        if (v >= nv) break;
        Vec<T> o;
#pragma unroll
        for (int i = 0; i < W; ++i) o.v[i] = sf::forward<true>(a[u].v[i], b[u].v[i], w, p.clamp);
        st_vec_fast(yr + v * W, o);
      }
    }
    for (int64_t h = nv * W + threadIdx.x; h < H; h += blockDim.x) {
      st_fast(yr + h, sf::forward<true>(ld(x0 + h), ld(x1 + h), w, p.clamp));
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) swiglu_bwd_kernel(Params p) {
  __shared__ float red[32];
  constexpr int W = Vec<T>::W;
  const int64_t H = p.H;
  const int64_t active = p.active ? *p.active : p.T;
  const int64_t nv = p.vec ? H / W : 0;
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ gy = static_cast<const T*>(p.gy);
  const T* __restrict__ yo = static_cast<const T*>(p.y_origin);
  const int64_t step = int64_t{kUnroll} * blockDim.x;
  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x) {
    T* __restrict__ g0 = static_cast<T*>(p.out) + t * 2 * H;
    if (t >= active) {
      zero_row(g0, H, nv);
      zero_row(g0 + H, H, nv);
      if (p.grad_weight && threadIdx.x == 0) p.grad_weight[t] = 0.0f;
      continue;
    }
    const float w = p.weight ? __ldg(p.weight + t) : 1.0f;
    const T* __restrict__ x0 = x + t * 2 * H;
    const T* __restrict__ x1 = x0 + H;
    const T* __restrict__ gr = gy + t * H;
    const T* __restrict__ yr = p.grad_weight ? yo + t * H : nullptr;
    float part = 0.0f;
    for (int64_t v0 = threadIdx.x; v0 < nv; v0 += step) {
      Vec<T> a[kUnroll], b[kUnroll], g[kUnroll], y[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + int64_t{u} * blockDim.x;
        if (v < nv) {
          a[u] = ld_vec_nc(x0 + v * W);
          b[u] = ld_vec_nc(x1 + v * W);
          g[u] = ld_vec_nc(gr + v * W);
          if (yr) y[u] = ld_vec_nc(yr + v * W);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + int64_t{u} * blockDim.x;
        if (v >= nv) break;
        Vec<T> ga, gb;
#pragma unroll
        for (int i = 0; i < W; ++i) {
          sf::backward<true>(a[u].v[i], b[u].v[i], g[u].v[i], w, p.clamp, ga.v[i], gb.v[i]);
        }
        st_vec_fast(g0 + v * W, ga);
        st_vec_fast(g0 + H + v * W, gb);
        if (yr) {
#pragma unroll
          for (int i = 0; i < W; ++i) part += g[u].v[i] * y[u].v[i];
        }
      }
    }
    for (int64_t h = nv * W + threadIdx.x; h < H; h += blockDim.x) {
      float ga, gb;
      const float g = ld(gr + h);
      sf::backward<true>(ld(x0 + h), ld(x1 + h), g, w, p.clamp, ga, gb);
      st_fast(g0 + h, ga);
      st_fast(g0 + H + h, gb);
      if (yr) part += g * ld(yr + h);
    }
    if (p.grad_weight) {
      const float total = block_sum(part, red);
      if (threadIdx.x == 0) p.grad_weight[t] = total;
    }
  }
}

// ---- quantised forward ----

struct QuantParams {
  const void* x;
  const float* weight;
  const int64_t* active;
  uint8_t* y;
  float* sc32;    // FP8 blocks: fp32 scales
  uint8_t* sc8;   // MX: e8m0 codes
  void* y_origin;
  int64_t T, H, B, S, blocks;
  float fmax;
  Clamp clamp;
  bool e5m2, round_scale, vec;
};

// The codes of W values times inv, packed four to a word and stored together (W = 8: 8 bytes;
// W = 4: 4 bytes).
template <int W>
__device__ __forceinline__ void st_codes(uint8_t* p, const float (&v)[W], float inv, bool e5m2) {
  uint32_t w[W / 4];
#pragma unroll
  for (int j = 0; j < W / 4; ++j) {
    w[j] = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) w[j] |= uint32_t{sf::encode(v[4 * j + i], inv, e5m2)} << (8 * i);
  }
  if constexpr (W == 8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint32_t*>(p) = w[0];
  }
}

__device__ __forceinline__ void st_scale(const QuantParams& p, int64_t t, int64_t k, float s) {
  if (p.sc32) {
    p.sc32[t * p.S + k] = s;
  } else {
    p.sc8[t * p.S + k] = sf::e8m0_code(s);
  }
}

// Vector path (rows of whole 16-byte vectors, aligned): unit u of a row is vector u; the B / W
// consecutive lanes of a block (a power of two dividing 32) reduce its amax with xor shuffles
// (the maximum of non-negative finite values: any order gives the same bits), the block's first
// lane writes the scale, and every lane encodes its own W values.
template <typename T>
__device__ __forceinline__ void quant_row_vec(const QuantParams& p, int64_t t) {
  constexpr int W = Vec<T>::W;
  const int64_t H = p.H;
  const int lanes = static_cast<int>(p.B / W);  // 4, 8, 16 or 32
  const int64_t units = p.blocks * lanes;       // a multiple of the group size
  const int64_t units32 = (units + 31) / 32 * 32;
  const T* __restrict__ x0 = static_cast<const T*>(p.x) + t * 2 * H;
  const T* __restrict__ x1 = x0 + H;
  const float w = p.weight ? __ldg(p.weight + t) : 1.0f;
  T* yo = p.y_origin ? static_cast<T*>(p.y_origin) + t * H : nullptr;
  for (int64_t u = threadIdx.x; u < units32; u += blockDim.x) {
    const int64_t h = u * W;
    const bool in = u < units && h < H;  // H is a whole number of vectors
    Vec<T> o;
    float m = 0.0f;
    if (in) {
      const Vec<T> a = ld_vec_nc(x0 + h), b = ld_vec_nc(x1 + h);
#pragma unroll
      for (int i = 0; i < W; ++i) {
        o.v[i] = sf::forward<true>(a.v[i], b.v[i], w, p.clamp);
        m = sf::amax_step(m, o.v[i]);
      }
    }
    for (int o2 = lanes / 2; o2 > 0; o2 >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o2));
    if (!in) continue;
    float inv;
    const float s = sf::block_scale(m, p.fmax, p.round_scale, &inv);
    if ((u & (lanes - 1)) == 0) st_scale(p, t, u / lanes, s);
    st_codes<W>(p.y + t * H + h, o.v, inv, p.e5m2);
    if (yo) st_vec_fast(yo + h, o);
  }
}

// Scalar path (odd H, misaligned views): one thread per block, two passes over its values.
template <typename T>
__device__ __forceinline__ void quant_row_scalar(const QuantParams& p, int64_t t) {
  const int64_t H = p.H;
  const T* x0 = static_cast<const T*>(p.x) + t * 2 * H;
  const T* x1 = x0 + H;
  const float w = p.weight ? p.weight[t] : 1.0f;
  T* yo = p.y_origin ? static_cast<T*>(p.y_origin) + t * H : nullptr;
  for (int64_t k = threadIdx.x; k < p.blocks; k += blockDim.x) {
    const int64_t h0 = k * p.B, h1 = h0 + p.B < H ? h0 + p.B : H;
    float m = 0.0f;
    for (int64_t h = h0; h < h1; ++h) {
      m = sf::amax_step(m, sf::forward<true>(ld(x0 + h), ld(x1 + h), w, p.clamp));
    }
    float inv;
    st_scale(p, t, k, sf::block_scale(m, p.fmax, p.round_scale, &inv));
    for (int64_t h = h0; h < h1; ++h) {
      const float v = sf::forward<true>(ld(x0 + h), ld(x1 + h), w, p.clamp);
      p.y[t * H + h] = sf::encode(v, inv, p.e5m2);
      if (yo) st_fast(yo + h, v);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) swiglu_quant_kernel(QuantParams p) {
  const int64_t active = p.active ? *p.active : p.T;
  const int64_t H = p.H;
  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x) {
    if (t >= active) {  // zero codes, zero scales (e8m0 code 0), zero y_origin
      for (int64_t h = threadIdx.x; h < H; h += blockDim.x) p.y[t * H + h] = 0;
      for (int64_t k = threadIdx.x; k < p.S; k += blockDim.x) {
        if (p.sc32) {
          p.sc32[t * p.S + k] = 0.0f;
        } else {
          p.sc8[t * p.S + k] = 0;
        }
      }
      if (p.y_origin) {
        T* yo = static_cast<T*>(p.y_origin) + t * H;
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) st(yo + h, 0.0f);
      }
      continue;
    }
    if (p.vec) {
      quant_row_vec<T>(p, t);
    } else {
      quant_row_scalar<T>(p, t);
    }
    if (p.sc8 && p.S > p.blocks && threadIdx.x == 0) p.sc8[t * p.S + p.blocks] = 0;  // MX pad
  }
}

// Threads per block: whole warps, no more than the row needs.
int threads_for(int64_t H, DType dt, int unroll) {
  const int64_t vecs = (H * dtype_size(dt) + 15) / 16;
  const int64_t per = (vecs + unroll - 1) / unroll;
  const int64_t t = (per + 31) / 32 * 32;
  return static_cast<int>(t < kThreads ? t : kThreads);
}

// The common start of the three launchers: the device, the stream, and the row count of L8 on
// the device (null without group_index: all T rows).
template <class Plan>
const int64_t* launch_active(const Plan& plan, const Workspace& ws, cudaStream_t s) {
  set_device(plan.op, plan.device_id);
  if (!plan.has_group_index) return nullptr;
  int64_t* active = ws.get<int64_t>(plan.ws_active);
  active_rows_kernel<<<1, kCountThreads, 0, s>>>(
      static_cast<const int64_t*>(plan.group_index.data), plan.group_index.numel(), plan.T,
      active);
  check_launch(plan.op);
  return active;
}

// The parameters every SwiGLU kernel shares (Params or QuantParams).
template <class P, class Plan>
P common_params(const Plan& plan, const Workspace& ws, cudaStream_t s) {
  P p{};
  p.x = plan.x.data;
  p.weight = plan.has_weight ? static_cast<const float*>(plan.weight.data) : nullptr;
  p.active = launch_active(plan, ws, s);
  p.T = plan.T;
  p.H = plan.H;
  p.clamp = Clamp{plan.clamp, plan.clamp > 0.0f};
  return p;
}

}  // namespace
}  // namespace cuda

void swiglu_cuda_size(SwigluPlan& plan, WorkspaceLayout& layout) {
  if (plan.has_group_index) plan.ws_active = layout.add<int64_t>(1);
}

void swiglu_grad_cuda_size(SwigluGradPlan& plan, WorkspaceLayout& layout) {
  if (plan.has_group_index) plan.ws_active = layout.add<int64_t>(1);
}

void swiglu_quant_cuda_size(SwigluQuantPlan& plan, WorkspaceLayout& layout) {
  if (plan.has_group_index) plan.ws_active = layout.add<int64_t>(1);
}

void swiglu_cuda(const SwigluPlan& plan, const Workspace& ws, void* stream) {
  using namespace cuda;
  if (plan.T == 0) return;  // zero tokens launch nothing
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  Params p = common_params<Params>(plan, ws, s);
  p.out = plan.y.data;
  p.vec = vec_ok(plan.H, plan.x.dtype, {p.x, p.out});
  dispatch(plan.x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_fwd_kernel<T><<<grid_blocks(plan.T, 1), threads_for(plan.H, plan.x.dtype, kUnroll),
                           0, s>>>(p);
  });
  check_launch(plan.op);
}

void swiglu_grad_cuda(const SwigluGradPlan& plan, const Workspace& ws, void* stream) {
  using namespace cuda;
  if (plan.T == 0) return;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool want_gw = plan.wants_grad_weight();
  Params p = common_params<Params>(plan, ws, s);
  p.gy = plan.grad_y.data;
  p.y_origin = want_gw ? plan.y_origin.data : nullptr;
  p.out = plan.grad_x.data;
  p.grad_weight = want_gw ? static_cast<float*>(plan.grad_weight.data) : nullptr;
  p.vec = vec_ok(plan.H, plan.x.dtype, {p.x, p.gy, p.y_origin, p.out});
  dispatch(plan.x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_bwd_kernel<T><<<grid_blocks(plan.T, 1), threads_for(plan.H, plan.x.dtype, kUnroll),
                           0, s>>>(p);
  });
  check_launch(plan.op);
}

void swiglu_quant_cuda(const SwigluQuantPlan& plan, const Workspace& ws, void* stream) {
  using namespace cuda;
  if (plan.T == 0) return;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  QuantParams p = common_params<QuantParams>(plan, ws, s);
  p.y = static_cast<uint8_t*>(plan.y.data);
  p.sc32 = plan.quant_mode == 0 ? static_cast<float*>(plan.y_scale.data) : nullptr;
  p.sc8 = plan.quant_mode == 1 ? static_cast<uint8_t*>(plan.y_scale.data) : nullptr;
  p.y_origin = plan.write_origin ? plan.y_origin.data : nullptr;
  p.B = plan.block;
  p.S = plan.scale_stride;
  p.blocks = plan.blocks;
  p.fmax = swiglu_formula::fp8_max(plan.e5m2);
  p.e5m2 = plan.e5m2;
  p.round_scale = plan.round_scale;
  // The vector path also needs 8-byte (4-byte for fp32) aligned code rows.
  p.vec = vec_ok(plan.H, plan.x.dtype, {p.x, p.y_origin}) &&
          reinterpret_cast<uintptr_t>(p.y) % 8 == 0;
  dispatch(plan.x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_quant_kernel<T><<<grid_blocks(plan.T, 1), threads_for(plan.H, plan.x.dtype, 1), 0,
                             s>>>(p);
  });
  check_launch(plan.op);
}

}  // namespace moegrad
