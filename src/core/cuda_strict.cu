// Host launch helpers of the CUDA backend and the strict index mode (MOEGRAD_STRICT_INDICES=1):
// index tensors are checked on the device and the first violation is reported with the same
// message as the CPU's host check (core/host.cc), before any output is written.
#include <cstdlib>
#include <cstring>

#include "core/cuda_backend.h"
#include "core/cuda_common.cuh"

namespace moegrad {

bool strict_indices() {
  const char* v = std::getenv("MOEGRAD_STRICT_INDICES");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

namespace cuda {

void throw_cuda(const char* op, const char* what, cudaError_t err) {
  throw Error(kErrParamInvalid,
              cat(op, ": device: ", what, " failed: ", cudaGetErrorName(err), " (",
                  cudaGetErrorString(err), ")"));
}

void set_device(const char* op, int device) {
  int cur = -1;
  check_cuda(op, "cudaGetDevice", cudaGetDevice(&cur));
  if (cur != device) check_cuda(op, "cudaSetDevice", cudaSetDevice(device));
}

namespace {

constexpr unsigned long long kNone = ~0ull;
constexpr uint64_t kInfoBytes = 5 * sizeof(unsigned long long);  // positions, then values

// bad[0] = smallest flat position whose value lies outside [lo, hi).
__global__ void range_kernel(const int32_t* __restrict__ idx, int64_t n, int64_t lo, int64_t hi,
                             unsigned long long* bad) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t v = idx[i];
    if (v < lo || v >= hi) atomicMin(bad, static_cast<unsigned long long>(i));
  }
}

// first[v] = smallest flat position holding value v (v >= 0).
__global__ void first_kernel(const int32_t* __restrict__ idx, int64_t n,
                             unsigned long long* first) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int32_t v = idx[i];
    if (v >= 0) atomicMin(first + v, static_cast<unsigned long long>(i));
  }
}

// bad[1] = smallest flat position whose value appeared at an earlier position.
__global__ void repeat_kernel(const int32_t* __restrict__ idx, int64_t n,
                              const unsigned long long* first, unsigned long long* bad) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int32_t v = idx[i];
    if (v >= 0 && first[v] != static_cast<unsigned long long>(i)) {
      atomicMin(bad + 1, static_cast<unsigned long long>(i));
    }
  }
}

// info[2..4] = the values the message names: idx at the first bad position, idx at the first
// repeat and the position where that value first appeared; read with the positions in one copy.
__global__ void details_kernel(const int32_t* __restrict__ idx, const unsigned long long* first,
                               unsigned long long* info) {
  info[2] = info[0] != kNone ? static_cast<unsigned long long>(
                                   static_cast<long long>(idx[info[0]]))
                             : 0;
  info[3] = 0;
  info[4] = 0;
  if (info[1] != kNone) {
    const int32_t v = idx[info[1]];
    info[3] = static_cast<unsigned long long>(static_cast<long long>(v));
    info[4] = first[v];
  }
}

}  // namespace

namespace {
__global__ void narrow_kernel(const int64_t* __restrict__ in, int64_t n, int32_t* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t v = in[i];
    out[i] = (v < INT32_MIN || v > INT32_MAX) ? INT32_MIN : static_cast<int32_t>(v);
  }
}
}  // namespace

const int32_t* device_index32(const char* op, const TensorView& t, int32_t* scratch,
                              cudaStream_t stream) {
  if (t.data == nullptr || t.dtype != DType::kInt64) return static_cast<const int32_t*>(t.data);
  const int64_t n = t.numel();
  if (n > 0) {
    narrow_kernel<<<grid_blocks(n, 256), 256, 0, stream>>>(static_cast<const int64_t*>(t.data),
                                                           n, scratch);
    check_launch(op);
  }
  return scratch;
}

uint64_t strict_ws_bytes(int64_t hi, bool unique) {
  return ws_round(kInfoBytes) + (unique ? ws_round(sizeof(unsigned long long) * static_cast<uint64_t>(hi)) : 0);
}

void strict_check(const char* op, int32_t code, const char* arg, const int32_t* idx, int64_t n,
                  int64_t lo, int64_t hi, bool unique, void* ws, cudaStream_t stream) {
  if (n == 0) return;
  auto* bad = static_cast<unsigned long long*>(ws);
  auto* first =
      reinterpret_cast<unsigned long long*>(static_cast<char*>(ws) + ws_round(kInfoBytes));
  const int threads = 256;
  const unsigned int blocks = grid_blocks(n, threads);
  check_cuda(op, "cudaMemsetAsync", cudaMemsetAsync(bad, 0xff, 16, stream));  // both positions
  range_kernel<<<blocks, threads, 0, stream>>>(idx, n, lo, hi, bad);
  if (unique && hi > 0) {
    check_cuda(op, "cudaMemsetAsync",
               cudaMemsetAsync(first, 0xff, sizeof(unsigned long long) * hi, stream));
    first_kernel<<<blocks, threads, 0, stream>>>(idx, n, first);
    repeat_kernel<<<blocks, threads, 0, stream>>>(idx, n, first, bad);
  }
  if (!(unique && hi > 0)) first = nullptr;
  details_kernel<<<1, 1, 0, stream>>>(idx, first, bad);
  check_launch(op);
  // One asynchronous copy on the caller's stream, then the one wait of strict mode.
  unsigned long long info[5];
  check_cuda(op, "strict index check copy",
             cudaMemcpyAsync(info, bad, sizeof(info), cudaMemcpyDeviceToHost, stream));
  check_cuda(op, "strict index check", cudaStreamSynchronize(stream));
  const Validator v(op, code);
  if (info[0] != kNone) {
    v.fail(code, arg, cat("values must lie in [", lo, ", ", hi, "); got ",
                          static_cast<int32_t>(info[2]), " at flat position ", info[0],
                          " (MOEGRAD_STRICT_INDICES=1)"));
  }
  if (info[1] != kNone) {
    v.fail(code, arg, cat("each valid value must appear at most once; got ",
                          static_cast<int32_t>(info[3]), " at flat positions ", info[4], " and ",
                          info[1], " (MOEGRAD_STRICT_INDICES=1)"));
  }
}

}  // namespace cuda
}  // namespace moegrad
