// CUDA kernels of ClippedSwiglu (docs/operators.md §9.4) and ClippedSwigluGrad (§9.5, clamp
// mode 1: docs/decisions.md L163) on the folded rows [pre, 2h] (clipped_swiglu.h). A grid-stride
// loop over (row, group of W output columns): W = one 16-byte vector of the output (4 fp32 or 8
// fp16/bf16 elements), read as 16-byte vectors (interleaved: two per W pairs) where every row is
// 16-byte aligned, else element by element. The group_index row count comes from the SwiGLU
// family's device kernel (launch_group_rows): no host synchronisation. Rows past it are +0.
// All on the caller's stream.
#include "core/cuda_backend.h"
#include "core/cuda_common.cuh"
#include "core/formula.h"
#include "ops/clipped_swiglu/clipped_swiglu.h"
#include "ops/swiglu/swiglu.h"
#include "ops/swiglu/swiglu_formula.h"

namespace moegrad {
namespace cuda {
namespace {

constexpr int kThreads = 256;

struct Attrs {
  float alpha, limit, bias;
  int mode;
  // The SwiGLU family's clamps (gate capped above, linear half clamped to [-limit, limit]; NaN
  // passes), always on here; the masks differ (inclusive, D32).
  __device__ __forceinline__ swiglu_formula::Clamp clamp() const {
    return swiglu_formula::Clamp{limit, true};
  }
};

__device__ __forceinline__ float sigmoid_f(float x) { return formula::sigmoid_stable(x); }

// y of one element (§9.4); the same fp32 operations as the CPU kernel.
__device__ __forceinline__ float clipped_f(float a, float b, const Attrs& k) {
  const swiglu_formula::Clamp cl = k.clamp();
  const float bc = cl.up(b);
  if (k.mode == 0) {
    const float ac = cl.gate(a);
    return ac * sigmoid_f(k.alpha * ac) * (bc + k.bias);
  }
  return cl.gate(a * sigmoid_f(a)) * bc;
}

// (dA, dB) of one element; inclusive masks (D32, L163), false for NaN.
__device__ __forceinline__ void clipped_grad_f(float a, float b, float g, const Attrs& k,
                                               float& da, float& db) {
  const swiglu_formula::Clamp cl = k.clamp();
  const float bc = cl.up(b);
  const bool mb = b >= -k.limit && b <= k.limit;
  if (k.mode == 0) {
    const float ac = cl.gate(a);
    const float s = sigmoid_f(k.alpha * ac);
    const float ds = s * (1.0f + k.alpha * ac * (1.0f - s));
    da = a <= k.limit ? g * (bc + k.bias) * ds : 0.0f;
    db = mb ? g * (ac * s) : 0.0f;
  } else {
    const float s = sigmoid_f(a);
    const float u = a * s;
    const float du = s * (1.0f + a * (1.0f - s));
    da = u <= k.limit ? g * bc * du : 0.0f;
    db = mb ? g * cl.gate(u) : 0.0f;
  }
}

struct Params {
  const void* x;
  const void* gy;
  void* out;               // y (forward) or grad_x (backward)
  const int64_t* active;   // device row count, or null: all rows
  int64_t pre, h;
  Attrs k;
  bool interleaved;
  bool vec;                // 16-byte vectors (h a multiple of W, bases aligned)
};

// Gate and linear elements of output column j of row xr.
template <typename T>
__device__ __forceinline__ void halves(const T* xr, int64_t h, int64_t j, bool inter, float& a,
                                       float& b) {
  a = ld(xr + (inter ? 2 * j : j));
  b = ld(xr + (inter ? 2 * j + 1 : h + j));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) clipped_fwd_kernel(Params p) {
  constexpr int W = Vec<T>::W;
  const int64_t h = p.h;
  const int64_t groups = p.vec ? h / W : h;  // per row: vectors, or single elements
  const int64_t total = p.pre * groups;
  const int64_t active = p.active ? *p.active : p.pre;
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.out);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / groups, gidx = i % groups;
    const T* xr = x + row * 2 * h;
    T* yr = y + row * h;
    if (!p.vec) {
      float a, b;
      halves(xr, h, gidx, p.interleaved, a, b);
      st(yr + gidx, row < active ? clipped_f(a, b, p.k) : 0.0f);
      continue;
    }
    const int64_t j = gidx * W;
    if (row >= active) {
      st_zero_vec(yr + j);
      continue;
    }
    Vec<T> o;
    if (p.interleaved) {
      const Vec<T> v0 = ld_vec(xr + 2 * j), v1 = ld_vec(xr + 2 * j + W);
#pragma unroll
      for (int e = 0; e < W / 2; ++e) {
        o.v[e] = clipped_f(v0.v[2 * e], v0.v[2 * e + 1], p.k);
        o.v[W / 2 + e] = clipped_f(v1.v[2 * e], v1.v[2 * e + 1], p.k);
      }
    } else {
      const Vec<T> a = ld_vec(xr + j), b = ld_vec(xr + h + j);
#pragma unroll
      for (int e = 0; e < W; ++e) o.v[e] = clipped_f(a.v[e], b.v[e], p.k);
    }
    st_vec(yr + j, o);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) clipped_bwd_kernel(Params p) {
  constexpr int W = Vec<T>::W;
  const int64_t h = p.h;
  const int64_t groups = p.vec ? h / W : h;
  const int64_t total = p.pre * groups;
  const int64_t active = p.active ? *p.active : p.pre;
  const T* x = static_cast<const T*>(p.x);
  const T* gy = static_cast<const T*>(p.gy);
  T* gx = static_cast<T*>(p.out);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / groups, gidx = i % groups;
    const T* xr = x + row * 2 * h;
    T* gr = gx + row * 2 * h;
    const int64_t ja = p.interleaved ? 2 * gidx * (p.vec ? W : 1) : gidx * (p.vec ? W : 1);
    const int64_t jb = p.interleaved ? ja + (p.vec ? W : 1) : ja + h;
    if (!p.vec) {
      float a, b, da = 0.0f, db = 0.0f;
      halves(xr, h, gidx, p.interleaved, a, b);
      if (row < active) clipped_grad_f(a, b, ld(gy + row * h + gidx), p.k, da, db);
      st(gr + (p.interleaved ? 2 * gidx : gidx), da);
      st(gr + (p.interleaved ? 2 * gidx + 1 : h + gidx), db);
      continue;
    }
    if (row >= active) {
      st_zero_vec(gr + ja);
      st_zero_vec(gr + jb);
      continue;
    }
    const int64_t j = gidx * W;
    const Vec<T> g = ld_vec(gy + row * h + j);
    Vec<T> o0, o1;
    if (p.interleaved) {
      // Output pairs 2j .. 2j + 2W: the first W/2 pairs into o0, the rest into o1.
      const Vec<T> v0 = ld_vec(xr + 2 * j), v1 = ld_vec(xr + 2 * j + W);
#pragma unroll
      for (int e = 0; e < W / 2; ++e) {
        clipped_grad_f(v0.v[2 * e], v0.v[2 * e + 1], g.v[e], p.k, o0.v[2 * e], o0.v[2 * e + 1]);
        clipped_grad_f(v1.v[2 * e], v1.v[2 * e + 1], g.v[W / 2 + e], p.k, o1.v[2 * e],
                       o1.v[2 * e + 1]);
      }
    } else {
      const Vec<T> a = ld_vec(xr + j), b = ld_vec(xr + h + j);
#pragma unroll
      for (int e = 0; e < W; ++e) clipped_grad_f(a.v[e], b.v[e], g.v[e], p.k, o0.v[e], o1.v[e]);
    }
    st_vec(gr + ja, o0);
    st_vec(gr + jb, o1);
  }
}

// The parameters both kernels share; launches the device row count of group_index first.
Params params_of(const char* op, int device_id, const ClippedSwigluShape& s, const void* x,
                 void* out, const Workspace& ws, void* stream) {
  set_device(op, device_id);
  Params p{};
  p.x = x;
  p.out = out;
  p.active = launch_group_rows(s.group_index, s.has_group_index, s.pre,
                               ws.get<int64_t>(s.ws_active), stream);
  p.pre = s.pre;
  p.h = s.h;
  p.k = Attrs{s.alpha, s.limit, s.bias, static_cast<int>(s.clamp_mode)};
  p.interleaved = s.interleaved;
  return p;
}

// Blocks of kThreads over the (row, output group) items of p.
template <typename T>
unsigned int blocks_of(const Params& p) {
  return grid_blocks(p.pre * (p.vec ? p.h / Vec<T>::W : p.h), kThreads);
}

void reserve_active(ClippedSwigluShape& s, WorkspaceLayout& layout) {
  if (s.has_group_index) s.ws_active = layout.add<int64_t>(1);
}

}  // namespace
}  // namespace cuda

void clipped_swiglu_cuda_size(ClippedSwigluPlan& plan, WorkspaceLayout& layout) {
  cuda::reserve_active(plan.s, layout);
}

void clipped_swiglu_grad_cuda_size(ClippedSwigluGradPlan& plan, WorkspaceLayout& layout) {
  cuda::reserve_active(plan.s, layout);
}

void clipped_swiglu_cuda(const ClippedSwigluPlan& plan, const Workspace& ws, void* stream) {
  using namespace cuda;
  if (plan.s.pre == 0 || plan.s.h == 0) return;  // empty: nothing to launch
  Params p = params_of(plan.op, plan.device_id, plan.s, plan.x.data, plan.y.data, ws, stream);
  p.vec = vec_ok(plan.s.h, plan.x.dtype, {p.x, p.out});
  dispatch(plan.x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const cudaStream_t cs = static_cast<cudaStream_t>(stream);
    clipped_fwd_kernel<T><<<blocks_of<T>(p), kThreads, 0, cs>>>(p);
  });
  check_launch(plan.op);
}

void clipped_swiglu_grad_cuda(const ClippedSwigluGradPlan& plan, const Workspace& ws,
                              void* stream) {
  using namespace cuda;
  if (plan.s.pre == 0 || plan.s.h == 0) return;
  Params p =
      params_of(plan.op, plan.device_id, plan.s, plan.x.data, plan.grad_x.data, ws, stream);
  p.gy = plan.grad_y.data;
  p.vec = vec_ok(plan.s.h, plan.x.dtype, {p.x, p.gy, p.out});
  dispatch(plan.x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const cudaStream_t cs = static_cast<cudaStream_t>(stream);
    clipped_bwd_kernel<T><<<blocks_of<T>(p), kThreads, 0, cs>>>(p);
  });
  check_launch(plan.op);
}

}  // namespace moegrad
