// CPU kernels of finalize routing forward (§4.5) and grad (§3.5), compiled once per SIMD target
// (Highway; the row loops are vectorised by the compiler for each target) and dispatched at run
// time. One token row per iteration, fp32 accumulation in a per-thread row buffer taken from the
// workspace, fixed summation order (D16).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/finalize_routing/finalize_routing_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cstring>

#include "core/dtype.h"
#include "core/host.h"
#include "core/parallel.h"
#include "core/simd-inl.h"
#include "hwy/highway.h"
#include "ops/finalize_routing/finalize_routing.h"

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {
namespace {

template <typename T, typename S>
void finalize_rows(const FinalizeRoutingPlan& p, const int32_t* idx, const int32_t* eidx,
                   const Workspace& ws, int tid, int64_t begin, int64_t end) {
  const int64_t R = p.R, K = p.K, H = p.H;
  const T* ex = typed<T>(p.expanded_x);
  const T* x1 = p.has_x1 ? typed<T>(p.x1) : nullptr;
  const T* x2 = p.has_x2 ? typed<T>(p.x2) : nullptr;
  const T* bias = p.has_bias ? typed<T>(p.bias) : nullptr;
  const S* scales = p.has_scales ? typed<S>(p.scales) : nullptr;
  T* out = typed<T>(p.out);
  float* acc = ws.get<float>(p.ws_acc, tid);
  T* stage = ws.get<T>(p.ws_stage, tid);

  for (int64_t r = begin; r < end; ++r) {
    if (x1) {
      const T* a = x1 + r * H;
      for (int64_t j = 0; j < H; ++j) acc[j] = to_f32(a[j]);
    } else {
      std::fill(acc, acc + H, 0.0f);
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
      stream_chunk(acc + h0, o + h0, static_cast<size_t>(std::min<int64_t>(kChunk, H - h0)),
                   stage);
    }
  }
  hwy::FlushStream();
}

template <typename T, typename S>
void finalize_grad_rows(const FinalizeRoutingGradPlan& p, const int32_t* idx,
                        const int32_t* eidx, const Workspace& ws, int tid, int64_t begin,
                        int64_t end) {
  const int64_t K = p.K, H = p.H;
  const T* gy = typed<T>(p.grad_y);
  const T* ex = p.has_scales ? typed<T>(p.expanded_x) : nullptr;
  const S* scales = p.has_scales ? typed<S>(p.scales) : nullptr;
  const T* bias = p.has_bias ? typed<T>(p.bias) : nullptr;
  T* gex = typed<T>(p.grad_expanded_x);
  S* gs = typed<S>(p.grad_scales);
  float* g = ws.get<float>(p.ws_g, tid);
  float* scaled = ws.get<float>(p.ws_scaled, tid);
  T* stage = ws.get<T>(p.ws_stage, tid);

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
          stream_chunk(scaled, dst + h0, n, stage);
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

void FinalizeBiasGrad(const FinalizeRoutingBiasGradPlan& p, const Workspace& ws) {
  // Counting sort of the slots by expert (stable, so each list is in slot order), into the
  // workspace: offsets[E + 1], then the slot numbers.
  const int64_t E = p.E, n_slots = p.R * p.K, H = p.H;
  int64_t* offsets = ws.get<int64_t>(p.ws_offsets);
  int64_t* fill = ws.get<int64_t>(p.ws_fill);
  int32_t* slots = ws.get<int32_t>(p.ws_slots);
  const int32_t* eidx = index32(p.expert_idx, ws.get<int32_t>(p.ws_eidx));
  std::fill(offsets, offsets + E + 1, int64_t{0});
  for (int64_t i = 0; i < n_slots; ++i) {
    const int32_t e = eidx[i];
    if (e >= 0 && e < E) ++offsets[e + 1];  // invalid device indices are skipped
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::copy(offsets, offsets + E, fill);
  for (int64_t i = 0; i < n_slots; ++i) {
    const int32_t e = eidx[i];
    if (e >= 0 && e < E) slots[fill[e]++] = static_cast<int32_t>(i);
  }
  // Tiles of (expert, column chunk) balance skewed expert loads across threads.
  const int64_t chunk = static_cast<int64_t>(kChunk);
  const int64_t n_chunks = (H + chunk - 1) / chunk;
  const DType sdt = p.has_scales ? p.scales.dtype : p.grad_y.dtype;
  dispatch_float(p.grad_y.dtype, "grad_y", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_float(sdt, "scales", [&](auto stag) {
      using S = typename decltype(stag)::type;
      parallel_rows(E * n_chunks, p.threads, [&](int tid, int64_t b, int64_t end) {
        float* acc = ws.get<float>(p.ws_acc, tid);
        for (int64_t t = b; t < end; ++t) {
          const int64_t e = t / n_chunks, h0 = (t % n_chunks) * chunk;
          bias_grad_tile<T, S>(p, offsets, slots, e, h0, std::min(chunk, H - h0), acc);
        }
      });
    });
  });
}

void FinalizeForward(const FinalizeRoutingPlan& p, const Workspace& ws) {
  const DType sdt = p.has_scales ? p.scales.dtype : p.expanded_x.dtype;
  const int32_t* idx = index32(p.expanded_row_idx, ws.get<int32_t>(p.ws_idx));
  const int32_t* eidx = p.has_bias ? index32(p.expert_idx, ws.get<int32_t>(p.ws_eidx)) : nullptr;
  dispatch_float(p.expanded_x.dtype, "expanded_x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_float(sdt, "scales", [&](auto stag) {
      using S = typename decltype(stag)::type;
      parallel_rows(p.R, p.threads, [&](int tid, int64_t b, int64_t e) {
        finalize_rows<T, S>(p, idx, eidx, ws, tid, b, e);
      });
    });
  });
}

void FinalizeBackward(const FinalizeRoutingGradPlan& p, const Workspace& ws) {
  const int32_t* idx = index32(p.expanded_row_idx, ws.get<int32_t>(p.ws_idx));
  const int32_t* eidx = p.has_bias ? index32(p.expert_idx, ws.get<int32_t>(p.ws_eidx)) : nullptr;
  // Rows of grad_expanded_x that no valid index addresses are zeroed; the others are written
  // exactly once by the scatter below (indices are unique, D6).
  unsigned char* covered = ws.get<unsigned char>(p.ws_covered);
  std::memset(covered, 0, static_cast<size_t>(p.rows));
  const int64_t n_idx = p.R * p.K;
  for (int64_t i = 0; i < n_idx; ++i) {
    if (idx[i] >= 0 && idx[i] < p.rows) covered[static_cast<size_t>(idx[i])] = 1;
  }
  const int64_t H = p.H;
  const size_t row_bytes = static_cast<size_t>(H * dtype_size(p.grad_y.dtype));
  unsigned char* gex = static_cast<unsigned char*>(p.grad_expanded_x.data);
  parallel_rows(p.rows, p.zero_threads, [&](int, int64_t b, int64_t e) {
    for (int64_t d = b; d < e; ++d) {
      if (!covered[static_cast<size_t>(d)]) std::memset(gex + d * row_bytes, 0, row_bytes);
    }
  });
  const DType sdt = p.grad_scales_dtype;
  dispatch_float(p.grad_y.dtype, "grad_y", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_float(sdt, "grad_scales", [&](auto stag) {
      using S = typename decltype(stag)::type;
      parallel_rows(p.R, p.threads, [&](int tid, int64_t b, int64_t e) {
        finalize_grad_rows<T, S>(p, idx, eidx, ws, tid, b, e);
      });
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

namespace {
int64_t grain_rows(int64_t H) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(1, H)); }
}  // namespace

void finalize_routing_cpu_size(FinalizeRoutingPlan& p, WorkspaceLayout& layout) {
  p.threads = plan_threads(p.R, grain_rows(p.H * p.K));
  p.ws_idx = index_scratch(layout, p.expanded_row_idx);
  p.ws_eidx = index_scratch(layout, p.expert_idx);
  p.ws_acc = layout.add<float>(p.H, p.threads);
  p.ws_stage = layout.add<float>(kRowChunk, p.threads);  // kRowChunk elements of any T <= 4 B
}

void finalize_routing_cpu(const FinalizeRoutingPlan& plan, const Workspace& ws, void*) {
  advise_output(plan.out);
  HWY_DYNAMIC_DISPATCH(FinalizeForward)(plan, ws);
}

void finalize_routing_grad_cpu_size(FinalizeRoutingGradPlan& p, WorkspaceLayout& layout) {
  p.threads = plan_threads(p.R, grain_rows(p.H * p.K));
  p.zero_threads = plan_threads(p.rows, grain_rows(p.H));
  p.ws_idx = index_scratch(layout, p.expanded_row_idx);
  p.ws_eidx = index_scratch(layout, p.expert_idx);
  p.ws_covered = layout.add<unsigned char>(p.rows);
  p.ws_g = layout.add<float>(p.H, p.threads);
  p.ws_scaled = layout.add<float>(kRowChunk, p.threads);
  p.ws_stage = layout.add<float>(kRowChunk, p.threads);
}

void finalize_routing_grad_cpu(const FinalizeRoutingGradPlan& plan, const Workspace& ws, void*) {
  advise_output(plan.grad_expanded_x);
  HWY_DYNAMIC_DISPATCH(FinalizeBackward)(plan, ws);
}

void finalize_routing_bias_grad_cpu_size(FinalizeRoutingBiasGradPlan& p,
                                         WorkspaceLayout& layout) {
  const int64_t chunk = kRowChunk;
  p.threads = plan_threads(p.E * ((p.H + chunk - 1) / chunk), 1);
  p.ws_eidx = index_scratch(layout, p.expert_idx);
  p.ws_offsets = layout.add<int64_t>(p.E + 1);
  p.ws_fill = layout.add<int64_t>(p.E);
  p.ws_slots = layout.add<int32_t>(p.R * p.K);
  p.ws_acc = layout.add<float>(std::min(chunk, p.H), p.threads);
}

void finalize_routing_bias_grad_cpu(const FinalizeRoutingBiasGradPlan& plan, const Workspace& ws,
                                    void*) {
  HWY_DYNAMIC_DISPATCH(FinalizeBiasGrad)(plan, ws);
}
}  // namespace moegrad
#endif  // HWY_ONCE
