// The stable slot sort of the CUDA routing kernels (core/cuda_sort.cuh).
#include <cub/device/device_radix_sort.cuh>

#include "core/cuda_common.cuh"
#include "core/cuda_sort.cuh"

namespace moegrad {
namespace cuda {
namespace {

template <typename I>
__global__ void keys_kernel(const I* __restrict__ ids, int64_t n, int64_t lo, int64_t limit,
                            uint32_t sentinel, uint32_t* __restrict__ keys,
                            int32_t* __restrict__ vals) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t e = ids[i];
    keys[i] = (e >= lo && e < limit) ? static_cast<uint32_t>(e - lo) : sentinel;
    vals[i] = static_cast<int32_t>(i);
  }
}

// First position of a key >= v in the ascending keys[0..n).
__device__ __forceinline__ int64_t lower_bound(const uint32_t* __restrict__ keys, int64_t n,
                                               uint32_t v) {
  int64_t a = 0, b = n;
  while (a < b) {
    const int64_t m = (a + b) / 2;
    if (keys[m] < v) {
      a = m + 1;
    } else {
      b = m;
    }
  }
  return a;
}

__global__ void starts_kernel(const uint32_t* __restrict__ keys, int64_t n, int64_t bins,
                              uint32_t in_limit, int32_t* __restrict__ starts) {
  for (int64_t b = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; b <= bins;
       b += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t v = b < bins ? static_cast<uint32_t>(b) : in_limit;
    starts[b] = static_cast<int32_t>(lower_bound(keys, n, v));
  }
}

int bit_width(uint32_t v) {
  int w = 0;
  while (w < 32 && (v >> w) != 0) ++w;
  return w > 0 ? w : 1;
}

}  // namespace

void slot_sort_size(const char* op, int device, SlotSort& s, WorkspaceLayout& layout) {
  s.end_bit = bit_width(s.sentinel);
  s.keys_in = layout.add<uint32_t>(s.n);
  s.keys_out = layout.add<uint32_t>(s.n);
  s.vals_in = layout.add<int32_t>(s.n);
  s.vals_out = layout.add<int32_t>(s.n);
  s.starts = layout.add<int32_t>(s.bins + 1);
  size_t bytes = 0;
  if (s.n > 0) {
    set_device(op, device);
    check_cuda(op, "cub::DeviceRadixSort::SortPairs (size)",
               cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                               static_cast<uint32_t*>(nullptr),
                                               static_cast<const int32_t*>(nullptr),
                                               static_cast<int32_t*>(nullptr),
                                               static_cast<int>(s.n), 0, s.end_bit));
  }
  s.temp_bytes = bytes;
  s.temp = layout.add<unsigned char>(static_cast<int64_t>(bytes));
}

SortedSlots slot_sort_run(const char* op, const SlotSort& s, const TensorView& ids,
                          const Workspace& ws, cudaStream_t stream) {
  uint32_t* keys_in = ws.get<uint32_t>(s.keys_in);
  uint32_t* keys_out = ws.get<uint32_t>(s.keys_out);
  int32_t* vals_in = ws.get<int32_t>(s.vals_in);
  int32_t* vals_out = ws.get<int32_t>(s.vals_out);
  int32_t* starts = ws.get<int32_t>(s.starts);
  if (s.n > 0) {
    const unsigned int blocks = grid_blocks(s.n, 256);
    if (ids.dtype == DType::kInt64) {
      keys_kernel<<<blocks, 256, 0, stream>>>(static_cast<const int64_t*>(ids.data), s.n, s.lo,
                                              s.limit, s.sentinel, keys_in, vals_in);
    } else {
      keys_kernel<<<blocks, 256, 0, stream>>>(static_cast<const int32_t*>(ids.data), s.n, s.lo,
                                              s.limit, s.sentinel, keys_in, vals_in);
    }
    check_launch(op);
    size_t bytes = s.temp_bytes;
    check_cuda(op, "cub::DeviceRadixSort::SortPairs",
               cub::DeviceRadixSort::SortPairs(ws.get<unsigned char>(s.temp), bytes, keys_in,
                                               keys_out, vals_in, vals_out,
                                               static_cast<int>(s.n), 0, s.end_bit, stream));
  }
  starts_kernel<<<grid_blocks(s.bins + 1, 256), 256, 0, stream>>>(keys_out, s.n, s.bins,
                                                                  s.in_limit, starts);
  check_launch(op);
  return {keys_out, vals_out, starts};
}

}  // namespace cuda
}  // namespace moegrad
