// CUDA kernels of SwiGLU forward (docs/operators.md §6.4 without quantisation) and backward
// (§5). One block per token row, 16-byte vectors over H with a scalar tail. With group_index,
// the processed row count min(max(sum, 0), T) (L8) is computed by a one-thread kernel into the
// workspace and read by the main kernel on the device: no host synchronisation (L45). Rows past
// it are zero-filled. grad_weight is a fixed-order block reduction per row (D16).
#include "core/cuda_backend.h"
#include "core/cuda_common.cuh"
#include "ops/swiglu/swiglu.h"

namespace moegrad {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// The saturating sum of L8, in index order like the CPU.
__global__ void active_rows_kernel(const int64_t* __restrict__ g, int64_t n, int64_t T,
                                   int64_t* active) {
  constexpr int64_t kCap = int64_t{1} << 62;
  int64_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = max(-kCap, min(kCap, g[i]));
    sum = max(-kCap, min(kCap, sum + v));
  }
  *active = max(int64_t{0}, min(sum, T));
}

struct Clamp {
  float c;
  bool on;
  __device__ __forceinline__ float gate(float v) const { return on && v > c ? c : v; }
  __device__ __forceinline__ float up(float v) const {
    return on ? (v > c ? c : (v < -c ? -c : v)) : v;
  }
};

__device__ __forceinline__ float swiglu_f(float a0, float b0, float w, const Clamp& cl) {
  const float a = cl.gate(a0), b = cl.up(b0);
  return a * sigmoid_f(a) * b * w;
}

// (ga, gb) of §5.5 steps 2-6, masks on the unclamped inputs with strict inequalities (D11).
__device__ __forceinline__ void swiglu_grad_f(float a0, float b0, float g, float w,
                                              const Clamp& cl, float& ga, float& gb) {
  const float a = cl.gate(a0), b = cl.up(b0);
  const float gyw = g * w;
  const float s = sigmoid_f(a);
  const float silu = a * s;
  const float dsilu = s * (1.0f + a * (1.0f - s));
  ga = gyw * b * dsilu;
  gb = gyw * silu;
  if (cl.on) {
    if (!(a0 < cl.c)) ga = 0.0f;
    if (!(b0 > -cl.c && b0 < cl.c)) gb = 0.0f;
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
__global__ void __launch_bounds__(kThreads) swiglu_fwd_kernel(Params p) {
  constexpr int W = Vec<T>::W;
  const int64_t H = p.H;
  const int64_t active = p.active ? *p.active : p.T;
  const int64_t nv = p.vec ? H / W : 0;
  const T* x = static_cast<const T*>(p.x);
  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x) {
    T* yr = static_cast<T*>(p.out) + t * H;
    if (t >= active) {
      for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) st_zero_vec(yr + v * W);
      for (int64_t h = nv * W + threadIdx.x; h < H; h += blockDim.x) st(yr + h, 0.0f);
      continue;
    }
    const float w = p.weight ? p.weight[t] : 1.0f;
    const T* x0 = x + t * 2 * H;
    const T* x1 = x0 + H;
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
      const Vec<T> a = ld_vec(x0 + v * W), b = ld_vec(x1 + v * W);
      Vec<T> o;
#pragma unroll
      for (int i = 0; i < W; ++i) o.v[i] = swiglu_f(a.v[i], b.v[i], w, p.clamp);
      st_vec(yr + v * W, o);
    }
    for (int64_t h = nv * W + threadIdx.x; h < H; h += blockDim.x) {
      st(yr + h, swiglu_f(ld(x0 + h), ld(x1 + h), w, p.clamp));
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
  const T* x = static_cast<const T*>(p.x);
  const T* gy = static_cast<const T*>(p.gy);
  const T* yo = static_cast<const T*>(p.y_origin);
  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x) {
    T* g0 = static_cast<T*>(p.out) + t * 2 * H;
    if (t >= active) {
      for (int64_t v = threadIdx.x; v < 2 * nv; v += blockDim.x) st_zero_vec(g0 + v * W);
      for (int64_t h = nv * W + threadIdx.x; h < H; h += blockDim.x) {
        st(g0 + h, 0.0f);
        st(g0 + H + h, 0.0f);
      }
      if (p.grad_weight && threadIdx.x == 0) p.grad_weight[t] = 0.0f;
      continue;
    }
    const float w = p.weight ? p.weight[t] : 1.0f;
    const T* x0 = x + t * 2 * H;
    const T* x1 = x0 + H;
    const T* gr = gy + t * H;
    const T* yr = p.grad_weight ? yo + t * H : nullptr;
    float part = 0.0f;
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
      const int64_t h = v * W;
      const Vec<T> a = ld_vec(x0 + h), b = ld_vec(x1 + h), g = ld_vec(gr + h);
      Vec<T> ga, gb;
#pragma unroll
      for (int i = 0; i < W; ++i) swiglu_grad_f(a.v[i], b.v[i], g.v[i], w, p.clamp, ga.v[i], gb.v[i]);
      st_vec(g0 + h, ga);
      st_vec(g0 + H + h, gb);
      if (yr) {
        const Vec<T> y = ld_vec(yr + h);
#pragma unroll
        for (int i = 0; i < W; ++i) part += g.v[i] * y.v[i];
      }
    }
    for (int64_t h = nv * W + threadIdx.x; h < H; h += blockDim.x) {
      float ga, gb;
      const float g = ld(gr + h);
      swiglu_grad_f(ld(x0 + h), ld(x1 + h), g, w, p.clamp, ga, gb);
      st(g0 + h, ga);
      st(g0 + H + h, gb);
      if (yr) part += g * ld(yr + h);
    }
    if (p.grad_weight) {
      const float total = block_sum(part, red);
      if (threadIdx.x == 0) p.grad_weight[t] = total;
    }
  }
}


// Threads per block: whole warps, no more than the row needs.
int threads_for(int64_t H, DType dt) {
  const int64_t vecs = (H * dtype_size(dt) + 15) / 16;
  const int64_t t = (vecs + 31) / 32 * 32;
  return static_cast<int>(t < kThreads ? t : kThreads);
}

}  // namespace
}  // namespace cuda

void swiglu_cuda_size(SwigluPlan& plan, WorkspaceLayout& layout) {
  if (plan.has_group_index) plan.ws_active = layout.add<int64_t>(1);
}

void swiglu_grad_cuda_size(SwigluGradPlan& plan, WorkspaceLayout& layout) {
  if (plan.has_group_index) plan.ws_active = layout.add<int64_t>(1);
}

const int64_t* launch_active(const TensorView& gi, bool has, int64_t T, int64_t* active,
                             void* stream) {
  if (!has) return nullptr;
  cuda::active_rows_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const int64_t*>(gi.data), gi.numel(), T, active);
  return active;
}

void swiglu_cuda(const SwigluPlan& plan, const Workspace& ws, void* stream) {
  using namespace cuda;
  if (plan.T == 0) return;  // zero tokens launch nothing
  set_device(plan.op, plan.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  Params p{};
  p.x = plan.x.data;
  p.weight = plan.has_weight ? static_cast<const float*>(plan.weight.data) : nullptr;
  p.active = launch_active(plan.group_index, plan.has_group_index, plan.T,
                           ws.get<int64_t>(plan.ws_active), s);
  p.out = plan.y.data;
  p.T = plan.T;
  p.H = plan.H;
  p.clamp = Clamp{plan.clamp, plan.clamp > 0.0f};
  p.vec = vec_ok(plan.H, plan.x.dtype, {p.x, p.out});
  dispatch(plan.x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_fwd_kernel<T><<<grid_blocks(plan.T, 1), threads_for(plan.H, plan.x.dtype), 0, s>>>(p);
  });
  check_launch(plan.op);
}

void swiglu_grad_cuda(const SwigluGradPlan& plan, const Workspace& ws, void* stream) {
  using namespace cuda;
  if (plan.T == 0) return;
  set_device(plan.op, plan.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool want_gw = plan.wants_grad_weight();
  Params p{};
  p.x = plan.x.data;
  p.weight = plan.has_weight ? static_cast<const float*>(plan.weight.data) : nullptr;
  p.active = launch_active(plan.group_index, plan.has_group_index, plan.T,
                           ws.get<int64_t>(plan.ws_active), s);
  p.gy = plan.grad_y.data;
  p.y_origin = want_gw ? plan.y_origin.data : nullptr;
  p.out = plan.grad_x.data;
  p.grad_weight = want_gw ? static_cast<float*>(plan.grad_weight.data) : nullptr;
  p.T = plan.T;
  p.H = plan.H;
  p.clamp = Clamp{plan.clamp, plan.clamp > 0.0f};
  p.vec = vec_ok(plan.H, plan.x.dtype, {p.x, p.gy, p.y_origin, p.out});
  dispatch(plan.x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_bwd_kernel<T><<<grid_blocks(plan.T, 1), threads_for(plan.H, plan.x.dtype), 0, s>>>(p);
  });
  check_launch(plan.op);
}

}  // namespace moegrad
