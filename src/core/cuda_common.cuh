// Device helpers shared by the CUDA kernels (src/ops/<family>/<family>_cuda.cu): element loads
// and stores widened to / narrowed from fp32 (RNE, the CPU's rounding via core/convert.h),
// 16-byte vectors, deterministic warp and block reductions, and host-side launch helpers.
// Included only by .cu files.
#ifndef MOEGRAD_CORE_CUDA_COMMON_CUH_
#define MOEGRAD_CORE_CUDA_COMMON_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "core/check.h"
#include "core/convert.h"
#include "moegrad/moegrad.h"

namespace moegrad {
namespace cuda {

// Storage types of the three float dtypes on the device.
struct bf16 {
  uint16_t bits;
};
using f16 = __half;

__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const f16* p) { return __half2float(*p); }
__device__ __forceinline__ float ld(const bf16* p) {
  return bf16_bits_to_f32(p->bits);
}
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(f16 v) { return __half2float(v); }
__device__ __forceinline__ float to_f(bf16 v) { return bf16_bits_to_f32(v.bits); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ f16 from_f<f16>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ bf16 from_f<bf16>(float v) {
  return bf16{f32_to_bf16_bits(v)};
}
template <typename T>
__device__ __forceinline__ void st(T* p, float v) {
  *p = from_f<T>(v);
}

// Loads element i of a float tensor whose dtype is only known at run time (scales).
__device__ __forceinline__ float ld_any(const void* p, int dtype, int64_t i) {
  if (dtype == static_cast<int>(DType::kFloat32)) return static_cast<const float*>(p)[i];
  if (dtype == static_cast<int>(DType::kFloat16)) return ld(static_cast<const f16*>(p) + i);
  return ld(static_cast<const bf16*>(p) + i);
}
__device__ __forceinline__ void st_any(void* p, int dtype, int64_t i, float v) {
  if (dtype == static_cast<int>(DType::kFloat32)) {
    static_cast<float*>(p)[i] = v;
  } else if (dtype == static_cast<int>(DType::kFloat16)) {
    st(static_cast<f16*>(p) + i, v);
  } else {
    st(static_cast<bf16*>(p) + i, v);
  }
}

// A 16-byte vector of T widened to fp32: W = 4 (fp32) or 8 (fp16/bf16) lanes.
template <typename T>
struct Vec {
  static constexpr int W = 16 / sizeof(T);
  float v[W];
};

template <typename T>
__device__ __forceinline__ Vec<T> ld_vec(const T* p) {  // p is 16-byte aligned
  union {
    uint4 u;
    T e[Vec<T>::W];
  } raw;
  raw.u = *reinterpret_cast<const uint4*>(p);
  Vec<T> out;
#pragma unroll
  for (int i = 0; i < Vec<T>::W; ++i) out.v[i] = to_f(raw.e[i]);
  return out;
}
// The same through the read-only (non-coherent) data cache: for inputs the kernel never writes.
template <typename T>
__device__ __forceinline__ Vec<T> ld_vec_nc(const T* __restrict__ p) {  // 16-byte aligned
  union {
    uint4 u;
    T e[Vec<T>::W];
  } raw;
  raw.u = __ldg(reinterpret_cast<const uint4*>(p));
  Vec<T> out;
#pragma unroll
  for (int i = 0; i < Vec<T>::W; ++i) out.v[i] = to_f(raw.e[i]);
  return out;
}
template <typename T>
__device__ __forceinline__ void st_vec(T* p, const Vec<T>& in) {  // p is 16-byte aligned
  union {
    uint4 u;
    T e[Vec<T>::W];
  } raw;
#pragma unroll
  for (int i = 0; i < Vec<T>::W; ++i) raw.e[i] = from_f<T>(in.v[i]);
  *reinterpret_cast<uint4*>(p) = raw.u;
}
template <typename T>
__device__ __forceinline__ void st_zero_vec(T* p) {
  *reinterpret_cast<uint4*>(p) = make_uint4(0, 0, 0, 0);
}

// Sum over the warp in a fixed butterfly order: every lane gets the same bits on every run.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// Block-wide sum in a fixed order (warp butterflies, then warp 0 over the warp partials);
// the result is valid in thread 0. `scratch` holds 32 floats; blockDim.x is a multiple of 32.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = 0.0f;
  if (warp == 0) {
    r = lane < warps ? scratch[lane] : 0.0f;
    r = warp_sum(r);
  }
  return r;
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// ---- host side ----

// Throws Error(161002) naming the operator when a CUDA call failed.
void throw_cuda(const char* op, const char* what, cudaError_t err);
inline void check_cuda(const char* op, const char* what, cudaError_t err) {
  if (err != cudaSuccess) throw_cuda(op, what, err);
}
// Makes `device` current for this runtime (the static runtime keeps its own notion of the
// current device, so every launch sets it; a no-op when it already is).
void set_device(const char* op, int device);
// Checks the launches just made (launch configuration errors only; no synchronisation).
inline void check_launch(const char* op) { check_cuda(op, "kernel launch", cudaGetLastError()); }

inline bool host_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Calls f with a null pointer of the device storage type of a float dtype (validated before).
template <typename F>
void dispatch(DType dt, F&& f) {
  switch (dt) {
    case DType::kFloat32: f(static_cast<float*>(nullptr)); break;
    case DType::kFloat16: f(static_cast<f16*>(nullptr)); break;
    default: f(static_cast<bf16*>(nullptr)); break;
  }
}

// 16-byte vector paths need rows of a whole number of vectors and aligned base pointers.
inline bool vec_ok(int64_t H, DType dt, std::initializer_list<const void*> ptrs) {
  if ((H * dtype_size(dt)) % 16 != 0) return false;
  for (const void* q : ptrs) {
    if (q != nullptr && !host_aligned16(q)) return false;
  }
  return true;
}

// Blocks for a grid-stride loop over n items (n >= 1), capped well below the 2^31 - 1 limit.
inline unsigned int grid_blocks(int64_t n, int64_t per_block) {
  const int64_t b = (n + per_block - 1) / per_block;
  return static_cast<unsigned int>(b < (int64_t{1} << 20) ? b : (int64_t{1} << 20));
}

// Workspace carving: 256-byte aligned slices.
inline uint64_t ws_round(uint64_t b) { return (b + 255) / 256 * 256; }

// Stage two: the int32 values of a device index tensor: its own data when int32, else its int64
// values narrowed into `scratch` (reserved with index_scratch in stage one) by a kernel on
// `stream`; values outside int32 become INT32_MIN, an invalid index that kernels skip (D6).
const int32_t* device_index32(const char* op, const TensorView& t, int32_t* scratch,
                              cudaStream_t stream);

// ---- strict index mode (MOEGRAD_STRICT_INDICES=1; docs/decisions.md L46) ----

// Workspace bytes of one strict check of an index tensor whose valid values lie below `hi`.
uint64_t strict_ws_bytes(int64_t hi, bool unique);
// Checks on the device that every value of idx[0..n) lies in [lo, hi) and, when `unique`,
// that every value >= 0 appears once; waits for the answer and throws Error(code) with the
// CPU's message naming the first bad position. Stage-two data are not touched.
void strict_check(const char* op, int32_t code, const char* arg, const int32_t* idx, int64_t n,
                  int64_t lo, int64_t hi, bool unique, void* ws, cudaStream_t stream);

}  // namespace cuda
}  // namespace moegrad

#endif  // MOEGRAD_CORE_CUDA_COMMON_CUH_
