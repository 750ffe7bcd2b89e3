// CUDA kernels of init routing (docs/operators.md §8.5, §8.8) and its grad (§8.9).
//
// Forward: the R*K slots are sorted by expert id with the stable slot sort of core/cuda_sort.cuh
// (CUB's radix sort; the unique stable order, D16), keyed so that one sort gives every order the
// CPU produces: ids in the window [lo, hi) first by id, then ids >= hi by id, then ids < lo (and
// invalid device ids) in slot order (L32). Each expert's first sorted position comes by binary
// search. Then, all on the caller's stream and without a host synchronisation: expanded_row_idx
// (one thread per sorted position), expanded_x (one block per expanded row, bit copies of x rows
// with four 16-byte loads in flight per thread, zero rows where no slot lands, D27), the aligned
// block starts (D36, one block's scan, before both) and the expert token counts in their three
// encodings (one block). Destination rows, the drop-pad
// capacity and the count encodings are init_routing_formula.h, the CPU's definitions.
// Grad: one block per token, the fp32 sum of its valid rows in k order from +0, the CPU's
// operations in the CPU's order (no FMA): the same bits.
#include <cub/block/block_scan.cuh>

#include "core/cuda_backend.h"
#include "core/cuda_common.cuh"
#include "core/cuda_sort.cuh"
#include "core/host.h"
#include "ops/init_routing/init_routing.h"
#include "ops/init_routing/init_routing_formula.h"

namespace moegrad {
namespace cuda {
namespace {

namespace irf = init_routing_formula;

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread in the row copies

// expanded_row_idx. Gather (type 0): idx[slot] = its destination row, -1 outside the window or
// past the capacity (D25). Scatter (type 1): idx[d] = the slot at sorted position d (L32).
// poff: the aligned block starts (D36, align > 1), else null.
__global__ void row_idx_kernel(SortedSlots s, int64_t n, uint32_t in_limit, bool window_all,
                               bool gather, bool drop_pad, int64_t cap,
                               const int32_t* __restrict__ poff, int32_t* __restrict__ idx) {
  for (int64_t d = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; d < n;
       d += int64_t{gridDim.x} * blockDim.x) {
    const int32_t slot = s.slots[d];
    if (!gather) {
      idx[d] = slot;
      continue;
    }
    const uint32_t key = s.keys[d];
    int32_t row = -1;
    if (key < in_limit) {
      const int64_t b = window_all ? 0 : key;
      const int64_t start = window_all ? 0 : s.starts[b];
      row = poff ? static_cast<int32_t>(poff[b] + (d - start))
                 : irf::dest_row(d, b, start, drop_pad, cap);
    }
    idx[slot] = row;
  }
}

// Copies one row of n vectors of type V (src null: zeros), kUnroll loads of each
// thread issued before its stores.
template <typename V>
__device__ __forceinline__ void copy_row(const V* __restrict__ src, V* __restrict__ dst,
                                         int64_t n) {
  const int64_t step = int64_t{kUnroll} * blockDim.x;
  for (int64_t i0 = threadIdx.x; i0 < n; i0 += step) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = i0 + int64_t{u} * blockDim.x;
      if (i < n) {
        if (src) {
          v[u] = __ldg(src + i);
        } else {
          v[u] = V{};
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = i0 + int64_t{u} * blockDim.x;
      if (i < n) dst[i] = v[u];
    }
  }
}

struct CopyParams {
  const unsigned char* x;
  unsigned char* ex;
  SortedSlots s;
  const int32_t* poff;  // D36 aligned block starts, or null
  int64_t rows, K, row_bytes, cap, sort_bins;
  bool drop_pad, vec;
};

// One block per expanded row: the x row of its slot, or zeros (D27).
__global__ void __launch_bounds__(kThreads) copy_rows_kernel(CopyParams p) {
  const int64_t n_act = p.s.starts[p.sort_bins];  // slots in the window
  for (int64_t j = blockIdx.x; j < p.rows; j += gridDim.x) {
    const int64_t d = p.poff       ? irf::aligned_source(j, p.sort_bins, p.poff, p.s.starts)
                      : p.drop_pad ? irf::drop_pad_source(j, p.cap, p.s.starts)
                                   : (j < n_act ? j : -1);
    const unsigned char* src = nullptr;
    if (d >= 0) src = p.x + static_cast<int64_t>(p.s.slots[d] / p.K) * p.row_bytes;
    unsigned char* dst = p.ex + j * p.row_bytes;
    if (p.vec) {
      copy_row(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst),
               p.row_bytes / 16);
    } else {
      copy_row(reinterpret_cast<const uint16_t*>(src), reinterpret_cast<uint16_t*>(dst),
               p.row_bytes / 2);
    }
  }
}

constexpr int kTokThreads = 256;

// One block's running exclusive scan over the bins, kTokThreads at a time: emit(b, v, offset)
// for every bin b with v = value(b) and offset = the sum of value over the bins before it.
// Returns the total (in every thread).
template <class Value, class Emit>
__device__ __forceinline__ int64_t scan_bins(int64_t bins, Value value, Emit emit) {
  using Scan = cub::BlockScan<int64_t, kTokThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int64_t base;
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  for (int64_t b0 = 0; b0 < bins; b0 += kTokThreads) {
    const int64_t b = b0 + threadIdx.x;
    const int64_t v = b < bins ? value(b) : 0;
    int64_t pos, total;
    Scan(tmp).ExclusiveSum(v, pos, total);
    if (b < bins) emit(b, v, base + pos);
    __syncthreads();  // every thread has read base and tmp
    if (threadIdx.x == 0) base += total;
    __syncthreads();
  }
  return base;
}

// Token counts: types 0 and 1 one value per bin; type 2 (id, count) for the non-empty bins in
// ascending order (a scan of the non-empty flags places them), then (0, 0) rows up to E (D26,
// D27).
template <typename C>
__global__ void __launch_bounds__(kTokThreads)
    tokens_kernel(const int32_t* __restrict__ starts, int64_t bins, int64_t lo, int64_t E,
                  int64_t type, C* __restrict__ out) {
  if (type != 2) {
    for (int64_t b = threadIdx.x; b < bins; b += kTokThreads) {
      out[b] = static_cast<C>(irf::token_value(type, starts[b], starts[b + 1]));
    }
    return;
  }
  const int64_t used = scan_bins(
      bins, [&](int64_t b) { return int64_t{starts[b + 1] > starts[b]}; },
      [&](int64_t b, int64_t v, int64_t at) {
        if (v == 0) return;
        out[2 * at] = static_cast<C>(lo + b);
        out[2 * at + 1] = static_cast<C>(int64_t{starts[b + 1]} - starts[b]);
      });
  for (int64_t r = used + threadIdx.x; r < E; r += kTokThreads) out[2 * r] = out[2 * r + 1] = 0;
}

// D36 aligned blocks: each expert's block rounded up to a multiple of align, the starts by a
// block-wide exclusive scan (int32 for the kernels, int64 for the padded_offsets output).
__global__ void __launch_bounds__(kTokThreads)
    padded_offsets_kernel(const int32_t* __restrict__ starts, int64_t bins, int64_t align,
                          int32_t* __restrict__ poff, int64_t* __restrict__ out) {
  const int64_t end = scan_bins(
      bins,
      [&](int64_t b) {
        return irf::padded_block_rows(int64_t{starts[b + 1]} - starts[b], align);
      },
      [&](int64_t b, int64_t, int64_t at) {
        poff[b] = static_cast<int32_t>(at);
        out[b] = at;
      });
  if (threadIdx.x == 0) {
    poff[bins] = static_cast<int32_t>(end);
    out[bins] = end;
  }
}

// ---- grad ----

struct GradParams {
  const void* g;
  const int32_t* idx;
  void* out;
  int64_t R, K, H, rows;
  bool vec;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) grad_kernel(GradParams p) {
  constexpr int W = Vec<T>::W;
  const T* __restrict__ g = static_cast<const T*>(p.g);
  const int64_t H = p.H, K = p.K;
  const int64_t nv = p.vec ? H / W : 0;
  for (int64_t r = blockIdx.x; r < p.R; r += gridDim.x) {
    T* __restrict__ orow = static_cast<T*>(p.out) + r * H;
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
      Vec<T> acc;
#pragma unroll
      for (int i = 0; i < W; ++i) acc.v[i] = 0.0f;
      // Up to kUnroll rows loaded before they are added (in k order, as on the CPU).
      for (int64_t k0 = 0; k0 < K; k0 += kUnroll) {
        Vec<T> x[kUnroll];
        bool ok[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t k = k0 + u;
          const int64_t d = k < K ? p.idx[r * K + k] : -1;
          ok[u] = irf::grad_row_valid(d, p.rows);
          if (ok[u]) x[u] = ld_vec(g + d * H + v * W);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (!ok[u]) continue;
#pragma unroll
          for (int i = 0; i < W; ++i) acc.v[i] += x[u].v[i];
        }
      }
      st_vec(orow + v * W, acc);
    }
    for (int64_t h = nv * W + threadIdx.x; h < H; h += blockDim.x) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t d = p.idx[r * K + k];
        if (irf::grad_row_valid(d, p.rows)) acc += ld(g + d * H + h);
      }
      st(orow + h, acc);
    }
  }
}

}  // namespace
}  // namespace cuda

namespace {

// The slot sort of the forward: window keys (see the file comment).
cuda::SlotSort routing_sort(const InitRoutingPlan& p) {
  cuda::SlotSort s;
  s.n = p.R * p.K;
  if (p.window_all) {  // E unknown: every id >= 0 is in, ordered by id
    s.lo = 0;
    s.limit = int64_t{1} << 31;
    s.sentinel = 0x80000000u;
    s.bins = 0;
    s.in_limit = s.sentinel;
  } else {  // ids in [lo, E) by id; ids below lo and invalid ids last
    s.lo = p.lo;
    s.limit = p.expert_num;
    s.sentinel = static_cast<uint32_t>(p.expert_num - p.lo);
    s.bins = p.hi - p.lo;
    s.in_limit = static_cast<uint32_t>(s.bins);
  }
  return s;
}

}  // namespace

void init_routing_cuda_size(InitRoutingPlan& plan, WorkspaceLayout& layout) {
  cuda::SlotSort s = routing_sort(plan);
  cuda::slot_sort_size(plan.op, plan.device_id, s, layout);
  plan.cuda_sort = s;
  plan.ws_poff = layout.add<int32_t>(plan.align > 1 ? s.bins + 1 : 0);
}

void init_routing_cuda(const InitRoutingPlan& plan, const Workspace& ws, void* stream) {
  using namespace cuda;
  set_device(plan.op, plan.device_id);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const SlotSort& so = plan.cuda_sort;
  const SortedSlots s = slot_sort_run(plan.op, so, plan.expert_idx, ws, st);
  const int64_t N = so.n;
  const bool drop_pad = plan.mode == 1;
  // D36: aligned blocks (validation: dropless, E known, so the window has bins = hi - lo).
  int32_t* poff = nullptr;
  if (plan.align > 1) {
    poff = ws.get<int32_t>(plan.ws_poff);
    padded_offsets_kernel<<<1, kTokThreads, 0, st>>>(
        s.starts, so.bins, plan.align, poff, static_cast<int64_t*>(plan.padded_offsets.data));
  }
  if (N > 0) {
    row_idx_kernel<<<grid_blocks(N, 256), 256, 0, st>>>(
        s, N, so.in_limit, plan.window_all, plan.row_idx_type == 0, drop_pad, plan.capacity,
        poff, static_cast<int32_t*>(plan.expanded_row_idx.data));
  }
  if (plan.rows > 0) {
    CopyParams c;
    c.x = static_cast<const unsigned char*>(plan.x.data);
    c.ex = static_cast<unsigned char*>(plan.expanded_x.data);
    c.s = s;
    c.poff = poff;
    c.rows = plan.rows;
    c.K = plan.K;
    c.row_bytes = plan.H * dtype_size(plan.x.dtype);
    c.cap = plan.capacity;
    c.sort_bins = so.bins;
    c.drop_pad = drop_pad;
    c.vec = c.row_bytes % 16 == 0 && host_aligned16(c.x) && host_aligned16(c.ex);
    copy_rows_kernel<<<grid_blocks(plan.rows, 1), kThreads, 0, st>>>(c);
  }
  if (plan.has_tokens) {
    const int64_t bins = plan.hi - plan.lo;
    if (plan.expert_tokens.dtype == DType::kInt64) {
      tokens_kernel<<<1, kTokThreads, 0, st>>>(s.starts, bins, plan.lo, plan.expert_num,
                                               plan.token_type,
                                               static_cast<int64_t*>(plan.expert_tokens.data));
    } else {
      tokens_kernel<<<1, kTokThreads, 0, st>>>(s.starts, bins, plan.lo, plan.expert_num,
                                               plan.token_type,
                                               static_cast<int32_t*>(plan.expert_tokens.data));
    }
  }
  check_launch(plan.op);
}

void init_routing_grad_cuda_size(InitRoutingGradPlan& plan, WorkspaceLayout& layout) {
  plan.ws_idx = index_scratch(layout, plan.expanded_row_idx);
}

void init_routing_grad_cuda(const InitRoutingGradPlan& plan, const Workspace& ws, void* stream) {
  using namespace cuda;
  if (plan.R == 0) return;
  set_device(plan.op, plan.device_id);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  GradParams p;
  p.g = plan.grad_expanded_x.data;
  p.idx = device_index32(plan.op, plan.expanded_row_idx, ws.get<int32_t>(plan.ws_idx), st);
  p.out = plan.grad_x.data;
  p.R = plan.R;
  p.K = plan.K;
  p.H = plan.H;
  p.rows = plan.rows;
  p.vec = vec_ok(plan.H, plan.grad_x.dtype, {p.g, p.out});
  dispatch(plan.grad_x.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    grad_kernel<T><<<grid_blocks(plan.R, 1), kThreads, 0, st>>>(p);
  });
  check_launch(plan.op);
}

}  // namespace moegrad
