// CPU kernels of finalize routing forward (§4.5) and grad (§3.5), compiled once per SIMD target
// (Highway; the row loops are vectorised by the compiler for each target) and dispatched at run
// time. One token row per iteration, fp32 accumulation in a per-thread row buffer, fixed
// summation order (D16).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/finalize_routing/finalize_routing_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "core/parallel.h"
#include "core/simd-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "ops/finalize_routing/finalize_routing.h"

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {
namespace {

int64_t grain_rows(int64_t H) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(1, H)); }

template <typename T, typename S>
void finalize_rows(const FinalizeRoutingPlan& p, int64_t begin, int64_t end) {
  const int64_t R = p.R, K = p.K, H = p.H;
  const T* ex = typed<T>(p.expanded_x);
  const int32_t* idx = typed<int32_t>(p.expanded_row_idx);
  const T* x1 = p.has_x1 ? typed<T>(p.x1) : nullptr;
  const T* x2 = p.has_x2 ? typed<T>(p.x2) : nullptr;
  const T* bias = p.has_bias ? typed<T>(p.bias) : nullptr;
  const S* scales = p.has_scales ? typed<S>(p.scales) : nullptr;
  const int32_t* eidx = p.has_bias ? typed<int32_t>(p.expert_idx) : nullptr;
  T* out = typed<T>(p.out);
  std::vector<float> acc(H);
  auto stage = hwy::AllocateAligned<T>(kChunk);

  for (int64_t r = begin; r < end; ++r) {
    if (x1) {
      const T* a = x1 + r * H;
      for (int64_t j = 0; j < H; ++j) acc[j] = to_f32(a[j]);
    } else {
      std::fill(acc.begin(), acc.end(), 0.0f);
    }
    if (x2) {
      const T* b = x2 + r * H;
      for (int64_t j = 0; j < H; ++j) acc[j] += to_f32(b[j]);
    }
    for (int64_t k = 0; k < K; ++k) {
      const int64_t flat = p.row_layout ? r * K + k : k * R + r;
      const int32_t d = idx[flat];
      const float s = scales ? to_f32(scales[r * K + k]) : 1.0f;
      const T* brow = nullptr;
      if (bias) {
        const int32_t e = eidx[r * K + k];
        if (e >= 0 && e < p.num_bias) brow = bias + static_cast<int64_t>(e) * H;
      }
      const bool valid = d >= 0 && d < p.rows;
      const T* xrow = valid ? ex + static_cast<int64_t>(d) * H : nullptr;
      // Dropped or truncated slots keep their bias term (D7, L5).
      if (xrow && brow) {
        for (int64_t j = 0; j < H; ++j) acc[j] += s * (to_f32(xrow[j]) + to_f32(brow[j]));
      } else if (xrow) {
        for (int64_t j = 0; j < H; ++j) acc[j] += s * to_f32(xrow[j]);
      } else if (brow) {
        for (int64_t j = 0; j < H; ++j) acc[j] += s * to_f32(brow[j]);
      }
    }
    T* o = out + r * H;
    for (int64_t h0 = 0; h0 < H; h0 += kChunk) {
      stream_chunk(acc.data() + h0, o + h0, static_cast<size_t>(std::min<int64_t>(kChunk, H - h0)),
                   stage.get());
    }
  }
  hwy::FlushStream();
}

template <typename T, typename S>
void finalize_grad_rows(const FinalizeRoutingGradPlan& p, int64_t begin, int64_t end) {
  const int64_t K = p.K, H = p.H;
  const T* gy = typed<T>(p.grad_y);
  const int32_t* idx = typed<int32_t>(p.expanded_row_idx);
  const T* ex = p.has_scales ? typed<T>(p.expanded_x) : nullptr;
  const S* scales = p.has_scales ? typed<S>(p.scales) : nullptr;
  const T* bias = p.has_bias ? typed<T>(p.bias) : nullptr;
  const int32_t* eidx = p.has_bias ? typed<int32_t>(p.expert_idx) : nullptr;
  T* gex = typed<T>(p.grad_expanded_x);
  S* gs = typed<S>(p.grad_scales);
  std::vector<float> g(H);
  auto scaled = hwy::AllocateAligned<float>(kChunk);
  auto stage = hwy::AllocateAligned<T>(kChunk);

  for (int64_t r = begin; r < end; ++r) {
    const T* gyr = gy + r * H;
    for (int64_t j = 0; j < H; ++j) g[j] = to_f32(gyr[j]);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = r * K + k;
      const int32_t d = idx[i];
      const bool valid = d >= 0 && d < p.rows;
      const float s = scales ? to_f32(scales[i]) : 1.0f;
      if (valid) {
        // Streamed: grad_expanded_x is written once and not read back here.
        T* dst = gex + static_cast<int64_t>(d) * H;
        for (int64_t h0 = 0; h0 < H; h0 += kChunk) {
          const size_t n = static_cast<size_t>(std::min<int64_t>(kChunk, H - h0));
          for (size_t j = 0; j < n; ++j) scaled[j] = g[h0 + j] * s;
          stream_chunk(scaled.get(), dst + h0, n, stage.get());
        }
      }
      if (!scales) {
        gs[i] = from_f32<S>(0.0f);  // D5: zeros without scales
        continue;
      }
      const T* brow = nullptr;
      if (bias) {
        const int32_t e = eidx[i];
        if (e >= 0 && e < p.num_bias) brow = bias + static_cast<int64_t>(e) * H;
      }
      const T* xrow = valid ? ex + static_cast<int64_t>(d) * H : nullptr;
      float dot = 0.0f;
      if (xrow && brow) {
        dot = Dot8(H, [&](int64_t j) { return to_f32(xrow[j]) + to_f32(brow[j]); },
                          [&](int64_t j) { return g[j]; });
      } else if (xrow) {
        dot = Dot8(H, [&](int64_t j) { return to_f32(xrow[j]); },
                          [&](int64_t j) { return g[j]; });
      } else if (brow) {
        dot = Dot8(H, [&](int64_t j) { return to_f32(brow[j]); },
                          [&](int64_t j) { return g[j]; });
      }
      gs[i] = from_f32<S>(dot);
    }
  }
  hwy::FlushStream();
}

// One tile of grad_bias: expert e, columns [h0, h0 + n). Sums the expert's slots in their
// slot order (r*K + k), so the bits depend on neither threads nor tiling (D16, D23).
template <typename T, typename S>
void bias_grad_tile(const FinalizeRoutingBiasGradPlan& p, const int64_t* offsets,
                    const int32_t* slots, int64_t e, int64_t h0, int64_t n, float* acc) {
  const int64_t K = p.K, H = p.H;
  const T* gy = typed<T>(p.grad_y);
  const S* scales = p.has_scales ? typed<S>(p.scales) : nullptr;
  std::fill(acc, acc + n, 0.0f);
  for (int64_t q = offsets[e]; q < offsets[e + 1]; ++q) {
    const int64_t i = slots[q];
    const float s = scales ? to_f32(scales[i]) : 1.0f;
    const T* row = gy + (i / K) * H + h0;
    for (int64_t j = 0; j < n; ++j) acc[j] += s * to_f32(row[j]);
  }
  store_chunk(acc, typed<T>(p.grad_bias) + e * H + h0, static_cast<size_t>(n));
}

}  // namespace

void FinalizeBiasGrad(const FinalizeRoutingBiasGradPlan& p, void* workspace) {
  // Counting sort of the slots by expert (stable, so each list is in slot order), into the
  // workspace: offsets[E + 1], then the slot numbers.
  const int64_t E = p.E, n_slots = p.R * p.K, H = p.H;
  int64_t* offsets = static_cast<int64_t*>(workspace);
  int32_t* slots = reinterpret_cast<int32_t*>(offsets + E + 1);
  const int32_t* eidx = typed<int32_t>(p.expert_idx);
  std::fill(offsets, offsets + E + 1, int64_t{0});
  for (int64_t i = 0; i < n_slots; ++i) {
    const int32_t e = eidx[i];
    if (e >= 0 && e < E) ++offsets[e + 1];  // invalid device indices are skipped
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  {
    std::vector<int64_t> fill(offsets, offsets + E);
    for (int64_t i = 0; i < n_slots; ++i) {
      const int32_t e = eidx[i];
      if (e >= 0 && e < E) slots[fill[e]++] = static_cast<int32_t>(i);
    }
  }
  // Tiles of (expert, column chunk) balance skewed expert loads across threads.
  const int64_t chunk = static_cast<int64_t>(kChunk);
  const int64_t n_chunks = (H + chunk - 1) / chunk;
  const DType sdt = p.has_scales ? p.scales.dtype : p.grad_y.dtype;
  dispatch_float(p.grad_y.dtype, "grad_y", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_float(sdt, "scales", [&](auto stag) {
      using S = typename decltype(stag)::type;
      parallel_for(E * n_chunks, 1, [&](int64_t b, int64_t end) {
        std::vector<float> acc(static_cast<size_t>(std::min(chunk, H)));
        for (int64_t t = b; t < end; ++t) {
          const int64_t e = t / n_chunks, h0 = (t % n_chunks) * chunk;
          bias_grad_tile<T, S>(p, offsets, slots, e, h0, std::min(chunk, H - h0), acc.data());
        }
      });
    });
  });
}

void FinalizeForward(const FinalizeRoutingPlan& p) {
  const DType sdt = p.has_scales ? p.scales.dtype : p.expanded_x.dtype;
  dispatch_float(p.expanded_x.dtype, "expanded_x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_float(sdt, "scales", [&](auto stag) {
      using S = typename decltype(stag)::type;
      parallel_for(p.R, grain_rows(p.H * p.K),
                   [&](int64_t b, int64_t e) { finalize_rows<T, S>(p, b, e); });
    });
  });
}

void FinalizeBackward(const FinalizeRoutingGradPlan& p) {
  // Rows of grad_expanded_x that no valid index addresses are zeroed; the others are written
  // exactly once by the scatter below (indices are unique, D6).
  std::vector<unsigned char> covered(static_cast<size_t>(p.rows), 0);
  const int32_t* idx = typed<int32_t>(p.expanded_row_idx);
  const int64_t n_idx = p.R * p.K;
  for (int64_t i = 0; i < n_idx; ++i) {
    if (idx[i] >= 0 && idx[i] < p.rows) covered[static_cast<size_t>(idx[i])] = 1;
  }
  const int64_t H = p.H;
  const size_t row_bytes = static_cast<size_t>(H * dtype_size(p.grad_y.dtype));
  unsigned char* gex = static_cast<unsigned char*>(p.grad_expanded_x.data);
  parallel_for(p.rows, grain_rows(H), [&](int64_t b, int64_t e) {
    for (int64_t d = b; d < e; ++d) {
      if (!covered[static_cast<size_t>(d)]) std::memset(gex + d * row_bytes, 0, row_bytes);
    }
  });
  const DType sdt = p.grad_scales_dtype;
  dispatch_float(p.grad_y.dtype, "grad_y", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_float(sdt, "grad_scales", [&](auto stag) {
      using S = typename decltype(stag)::type;
      parallel_for(p.R, grain_rows(H * p.K),
                   [&](int64_t b, int64_t e) { finalize_grad_rows<T, S>(p, b, e); });
    });
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moegrad {
HWY_EXPORT(FinalizeForward);
HWY_EXPORT(FinalizeBackward);
HWY_EXPORT(FinalizeBiasGrad);

void finalize_routing_cpu(const FinalizeRoutingPlan& plan) {
  HWY_DYNAMIC_DISPATCH(FinalizeForward)(plan);
}
void finalize_routing_grad_cpu(const FinalizeRoutingGradPlan& plan) {
  HWY_DYNAMIC_DISPATCH(FinalizeBackward)(plan);
}
void finalize_routing_bias_grad_cpu(const FinalizeRoutingBiasGradPlan& plan, void* workspace) {
  HWY_DYNAMIC_DISPATCH(FinalizeBiasGrad)(plan, workspace);
}
}  // namespace moegrad
#endif  // HWY_ONCE
