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
#include "core/rows-inl.h"
#include "hwy/highway.h"
#include "ops/finalize_routing/finalize_routing.h"

#ifndef MOEGRAD_FINALIZE_ROUTING_CPU_ONCE_
#define MOEGRAD_FINALIZE_ROUTING_CPU_ONCE_
namespace moegrad {
namespace finalize_detail {
// One slot of a token row in the forward: its expanded_x row (null: dropped, truncated or an
// invalid index), its bias row (null: none) and its scale.
struct SlotRef {
  const void* x;
  const void* b;
  float s;
};

// Calls f(tid, nt) on every thread of one parallel region of `threads` threads (nt: the
// threads the runtime gave); f may call team_barrier(), which every thread must reach.
template <typename F>
void run_team(int threads, F&& f) {
#ifdef _OPENMP
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    f(omp_get_thread_num(), omp_get_num_threads());
    return;
  }
#endif
  (void)threads;
  f(0, 1);
}
inline void team_barrier() {
#ifdef _OPENMP
#pragma omp barrier
#endif
}
}  // namespace finalize_detail
}  // namespace moegrad
#endif  // MOEGRAD_FINALIZE_ROUTING_CPU_ONCE_

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {
namespace {

using finalize_detail::run_team;
using finalize_detail::SlotRef;
using finalize_detail::team_barrier;

// The slots of token row r (forward).
template <typename T, typename S>
void forward_slots(const FinalizeRoutingPlan& p, const int32_t* idx, const int32_t* eidx,
                   int64_t r, SlotRef* t) {
  const int64_t R = p.R, K = p.K, H = p.H;
  const T* ex = typed<T>(p.expanded_x);
  const T* bias = p.has_bias ? typed<T>(p.bias) : nullptr;
  const S* scales = p.has_scales ? typed<S>(p.scales) : nullptr;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t flat = p.row_layout ? r * K + k : k * R + r;
    const int32_t d = idx[flat];
    const T* brow = nullptr;
    if (bias) {
      const int32_t e = eidx[r * K + k];
      if (e >= 0 && e < p.num_bias) brow = bias + static_cast<int64_t>(e) * H;
    }
    t[k].x = (d >= 0 && d < p.rows) ? ex + static_cast<int64_t>(d) * H : nullptr;
    t[k].b = brow;  // dropped or truncated slots keep their bias term (D7, L5)
    t[k].s = scales ? to_f32(scales[r * K + k]) : 1.0f;
  }
}

// U vectors of a token row at column j (kTail: one vector of n < Lanes elements):
// x1 + x2 + sum over k of s_k * (x_k + b_k), added in that order, in fp32 (the order and the
// operations of docs/operators.md §4.5; no contraction, L43). `next` (or null) is the next
// token's slot table, whose row starts are prefetched near the end of the current rows.
template <size_t U, bool kTail, typename T>
HWY_INLINE void forward_block(DF d, const T* a1, const T* a2, const SlotRef* t,
                              const SlotRef* next, int64_t K, size_t row_bytes, bool prefetch,
                              size_t j, size_t n, VF* acc) {
  const size_t L = hn::Lanes(d);
  auto load = [&](const T* q) { return kTail ? LoadFN(d, q, n) : LoadF(d, q); };
  for (size_t u = 0; u < U; ++u) acc[u] = a1 ? load(a1 + j + u * L) : hn::Zero(d);
  if (a2) {
    for (size_t u = 0; u < U; ++u) acc[u] = hn::Add(acc[u], load(a2 + j + u * L));
  }
  for (int64_t k = 0; k < K; ++k) {
    const T* x = static_cast<const T*>(t[k].x);
    const T* b = static_cast<const T*>(t[k].b);
    const VF s = hn::Set(d, t[k].s);
    if (x) {
      if (prefetch) {
        const void* nx = next ? next[k].x : nullptr;
        for (size_t off = 0; off < U * L * sizeof(T); off += 64) {
          rows::PrefetchAhead(x, nx, row_bytes, j * sizeof(T) + off);
        }
      }
      if (b) {
        for (size_t u = 0; u < U; ++u) {
          const size_t o = j + u * L;
          acc[u] = hn::Add(acc[u], hn::Mul(s, hn::Add(load(x + o), load(b + o))));
        }
      } else {
        for (size_t u = 0; u < U; ++u) acc[u] = hn::Add(acc[u], hn::Mul(s, load(x + j + u * L)));
      }
    } else if (b) {
      for (size_t u = 0; u < U; ++u) acc[u] = hn::Add(acc[u], hn::Mul(s, load(b + j + u * L)));
    }
  }
}

template <typename T, typename S>
void finalize_rows(const FinalizeRoutingPlan& p, const int32_t* idx, const int32_t* eidx,
                   const Workspace& ws, int tid, int64_t begin, int64_t end) {
  const DF d;
  const int64_t K = p.K;
  const size_t H = static_cast<size_t>(p.H);
  const size_t row_bytes = H * sizeof(T);
  const T* x1 = p.has_x1 ? typed<T>(p.x1) : nullptr;
  const T* x2 = p.has_x2 ? typed<T>(p.x2) : nullptr;
  T* out = typed<T>(p.out);
  // Non-temporal stores only for outputs too large to stay in the cache (L87).
  const bool big = stream_output(mul_sat(p.R, static_cast<int64_t>(row_bytes)));
  // No software prefetch for K rows of fp32 (K >= 8; 16-bit rows from K >= 16) read at once,
  // as in the init routing grad (docs/decisions.md L114, L118).
  const bool prefetch = K * static_cast<int64_t>(sizeof(T)) < 32;
  SlotRef* tabs = ws.get<SlotRef>(p.ws_slots, tid);  // two tables of K slots: this token, next
  if (begin < end) forward_slots<T, S>(p, idx, eidx, begin, tabs);
  for (int64_t r = begin; r < end; ++r) {
    const SlotRef* t = tabs + ((r - begin) & 1) * K;
    SlotRef* next = tabs + ((r - begin + 1) & 1) * K;
    if (r + 1 < end) forward_slots<T, S>(p, idx, eidx, r + 1, next);
    const SlotRef* nt = r + 1 < end ? next : nullptr;
    const T* a1 = x1 ? x1 + r * static_cast<int64_t>(H) : nullptr;
    const T* a2 = x2 ? x2 + r * static_cast<int64_t>(H) : nullptr;
    rows::WriteRow(d, out + r * static_cast<int64_t>(H), H, big,
                   [&](auto U, auto tail, size_t j, size_t n, VF* acc) {
                     forward_block<decltype(U)::value, decltype(tail)::value>(
                         d, a1, a2, t, nt, K, row_bytes, prefetch, j, n, acc);
                   });
  }
  hwy::FlushStream();
}

// The expanded_x row of slot i = r*K + k of the grad (null: no valid index), for prefetching.
template <typename T>
HWY_INLINE const T* grad_slot_row(const FinalizeRoutingGradPlan& p, const int32_t* idx,
                                  const T* ex, int64_t i) {
  if (ex == nullptr || i >= p.R * p.K) return nullptr;
  const int32_t d = idx[i];
  return (d >= 0 && d < p.rows) ? ex + static_cast<int64_t>(d) * p.H : nullptr;
}

// One slot of the grad over the columns [j, j + U*L) (kTail: one vector of n < Lanes
// elements): grad_expanded_x = g * s (streamed when `stream`; U = 2 pairs the vectors into
// one full-width store when `stream2`), and the dot product of (x + b) with g into `dot`
// (element positions mod 64 from `pos`).
template <size_t U, bool kTail, typename T>
HWY_INLINE void grad_block(DF d, const float* g, VF s, T* dst, bool stream, bool stream2,
                           const T* x, const T* b, const T* next_x, size_t row_bytes, size_t j,
                           size_t pos, size_t n, rows::Dot* dot) {
  const size_t L = hn::Lanes(d);
  auto load = [&](const T* q) { return kTail ? LoadFN(d, q, n) : LoadF(d, q); };
  if (x) {
    for (size_t off = 0; off < U * L * sizeof(T); off += 64) {
      rows::PrefetchAhead<rows::kPrefetchOneStream>(x, next_x, row_bytes, j * sizeof(T) + off);
    }
  }
  VF gv[U];
  for (size_t u = 0; u < U; ++u) gv[u] = hn::Load(d, g + j + u * L);  // padded with +0
  if (dst) {
    VF v[U];
    for (size_t u = 0; u < U; ++u) v[u] = hn::Mul(gv[u], s);
    if (kTail) {
      StoreFN(d, v[0], dst + j, n);
    } else {
      StoreBlock<U>(d, v, dst + j, stream, stream2);
    }
  }
  for (size_t u = 0; u < U; ++u) {
    const size_t o = j + u * L;
    if (x && b) {
      dot->Add(d, pos + u * L, hn::Add(load(x + o), load(b + o)), gv[u]);
    } else if (x) {
      dot->Add(d, pos + u * L, load(x + o), gv[u]);
    } else if (b) {
      dot->Add(d, pos + u * L, load(b + o), gv[u]);
    }
  }
}

// One slot of the grad over the 64 columns [j, j + 64) (kU = 64 / Lanes vectors, j a multiple
// of 64): grad_expanded_x = g * s and the dot product of (x + b) with g into the kU register
// accumulators acc, lane for lane the partial sums of rows::Dot (column j + i goes to partial
// sum i), so the bits are those of grad_block. g is widened straight from the grad_y row
// (exact), which the K slots of a token read from the cache.
template <size_t kU, typename T>
HWY_INLINE void grad_block64(DF d, const T* gyr, VF s, T* dst, bool stream, bool stream2,
                             const T* x, const T* b, const T* next_x, size_t row_bytes,
                             size_t j, VF* acc) {
  const size_t L = hn::Lanes(d);
  if (x) {
    for (size_t off = 0; off < kU * L * sizeof(T); off += 64) {
      rows::PrefetchAhead<rows::kPrefetchOneStream>(x, next_x, row_bytes, j * sizeof(T) + off);
    }
  }
  VF gv[kU];
  for (size_t u = 0; u < kU; ++u) gv[u] = LoadF(d, gyr + j + u * L);
  if (dst) {
    VF v[kU];
    for (size_t u = 0; u < kU; ++u) v[u] = hn::Mul(gv[u], s);
    StoreBlock<kU>(d, v, dst + j, stream, stream2);
  }
  for (size_t u = 0; u < kU; ++u) {
    const size_t o = j + u * L;
    if (x && b) {
      acc[u] = hn::Add(acc[u], hn::Mul(hn::Add(LoadF(d, x + o), LoadF(d, b + o)), gv[u]));
    } else if (x) {
      acc[u] = hn::Add(acc[u], hn::Mul(LoadF(d, x + o), gv[u]));
    } else if (b) {
      acc[u] = hn::Add(acc[u], hn::Mul(LoadF(d, b + o), gv[u]));
    }
  }
}

// Token rows [begin, end) of the grad: per slot, one pass over the row that writes
// grad_expanded_x and accumulates the slot's grad_scales dot product (fixed order, D16).
template <typename T, typename S>
void finalize_grad_rows(const FinalizeRoutingGradPlan& p, const int32_t* idx,
                        const int32_t* eidx, const Workspace& ws, int tid, int64_t begin,
                        int64_t end) {
  const DF d;
  const size_t L = hn::Lanes(d);
  const int64_t K = p.K;
  const size_t H = static_cast<size_t>(p.H);
  const size_t row_bytes = H * sizeof(T);
  const T* gy = typed<T>(p.grad_y);
  const T* ex = p.has_scales ? typed<T>(p.expanded_x) : nullptr;
  const S* scales = p.has_scales ? typed<S>(p.scales) : nullptr;
  const T* bias = p.has_bias ? typed<T>(p.bias) : nullptr;
  T* gex = typed<T>(p.grad_expanded_x);
  S* gs = typed<S>(p.grad_scales);
  const bool nt = stream_output(mul_sat(p.rows, static_cast<int64_t>(row_bytes)));
  float* g = ws.get<float>(p.ws_g, tid);  // H, padded to whole vectors with +0
  const size_t Hv = H / L * L;
  std::fill(g + Hv, g + Hv + L, 0.0f);
  // On 16-lane targets (AVX-512) whole blocks of 64 columns keep the 64 partial sums in
  // kU = 4 registers and read g from the grad_y row; the columns after them (and every column
  // on the other targets) go through the g buffer and rows::Dot.
  constexpr size_t kU = rows::kDotLanes / hn::MaxLanes(DF());
  constexpr bool kReg = kU == 4 && kU * hn::MaxLanes(DF()) == rows::kDotLanes;
  const size_t H64 = kReg && L * kU == rows::kDotLanes ? H / rows::kDotLanes * rows::kDotLanes
                                                        : 0;

  for (int64_t r = begin; r < end; ++r) {
    const T* gyr = gy + r * static_cast<int64_t>(H);
    for (size_t j = H64; j < Hv; j += L) hn::Store(LoadF(d, gyr + j), d, g + j);
    if (Hv < H) hn::Store(LoadFN(d, gyr + Hv, H - Hv), d, g + Hv);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = r * K + k;
      const int32_t di = idx[i];
      const bool valid = di >= 0 && di < p.rows;
      const VF s = hn::Set(d, scales ? to_f32(scales[i]) : 1.0f);
      // Streamed: grad_expanded_x is written once and not read back here.
      T* dst = valid ? gex + static_cast<int64_t>(di) * static_cast<int64_t>(H) : nullptr;
      const bool stream = nt && dst != nullptr && StreamAligned(dst);
      const T* brow = nullptr;
      if (bias && scales) {
        const int32_t e = eidx[i];
        if (e >= 0 && e < p.num_bias) brow = bias + static_cast<int64_t>(e) * p.H;
      }
      const T* xrow = valid && ex ? ex + static_cast<int64_t>(di) * p.H : nullptr;
      const T* next_x = xrow ? grad_slot_row(p, idx, ex, i + 1) : nullptr;
      const bool stream2 = nt && dst != nullptr && Stream2Aligned(dst);
      rows::Dot dot;
      size_t j = 0;
      if constexpr (kReg) {
        if (H64 > 0) {
          VF acc[kU];
          for (size_t u = 0; u < kU; ++u) acc[u] = hn::Zero(d);
          for (; j < H64; j += rows::kDotLanes) {
            grad_block64<kU>(d, gyr, s, dst, stream, stream2, xrow, brow, next_x, row_bytes, j,
                             acc);
          }
          for (size_t u = 0; u < kU; ++u) hn::Store(acc[u], d, dot.part + u * L);
        }
      }
      for (; j + 2 * L <= H; j += 2 * L) {
        grad_block<2, false>(d, g, s, dst, stream, stream2, xrow, brow, next_x, row_bytes, j,
                             j % rows::kDotLanes, 0, &dot);
      }
      for (; j + L <= H; j += L) {
        grad_block<1, false>(d, g, s, dst, stream, stream2, xrow, brow, next_x, row_bytes, j,
                             j % rows::kDotLanes, 0, &dot);
      }
      if (j < H) {
        grad_block<1, true>(d, g, s, dst, stream, stream2, xrow, brow, next_x, row_bytes, j,
                            j % rows::kDotLanes, H - j, &dot);
      }
      if (!scales) {
        gs[i] = from_f32<S>(0.0f);  // D5: zeros without scales
      } else {
        gs[i] = from_f32<S>(dot.Sum());
      }
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

// Rows of grad_expanded_x that no valid index addresses are zeroed; the others are written
// exactly once by the token rows (indices are unique, D6). One parallel region: the threads
// clear the covered map, mark the rows their share of the indices addresses, zero their share
// of the rows nobody addresses, then compute their share of the token rows. Each output row
// is written by one thread, the same whatever the thread count (D16).
template <typename T, typename S>
void finalize_backward_team(const FinalizeRoutingGradPlan& p, const int32_t* idx,
                            const int32_t* eidx, const Workspace& ws) {
  unsigned char* covered = ws.get<unsigned char>(p.ws_covered);
  const int64_t rows = p.rows, n_idx = p.R * p.K, H = p.H;
  const size_t row_bytes = static_cast<size_t>(H) * sizeof(T);
  T* gex = typed<T>(p.grad_expanded_x);
  const int team = std::max(std::max(p.threads, p.zero_threads), 1);
  run_team(team, [&](int tid, int nt) {
    const int64_t r0 = rows * tid / nt, r1 = rows * (tid + 1) / nt;
    if (r1 > r0) std::memset(covered + r0, 0, static_cast<size_t>(r1 - r0));
    team_barrier();
    for (int64_t i = n_idx * tid / nt, i1 = n_idx * (tid + 1) / nt; i < i1; ++i) {
      const int32_t di = idx[i];
      if (di >= 0 && di < rows) __atomic_store_n(covered + di, static_cast<unsigned char>(1),
                                                __ATOMIC_RELAXED);
    }
    team_barrier();
    for (int64_t di = r0; di < r1; ++di) {
      if (!covered[di]) rows::StreamBytes(nullptr, gex + di * H, row_bytes, true);
    }
    const int mt = std::min(nt, std::max(p.threads, 1));
    if (tid < mt) {
      const int64_t b = p.R * tid / mt, e = p.R * (tid + 1) / mt;
      if (b < e) finalize_grad_rows<T, S>(p, idx, eidx, ws, tid, b, e);
    }
    hwy::FlushStream();
  });
}

void FinalizeBackward(const FinalizeRoutingGradPlan& p, const Workspace& ws) {
  const int32_t* idx = index32(p.expanded_row_idx, ws.get<int32_t>(p.ws_idx));
  const int32_t* eidx = p.has_bias ? index32(p.expert_idx, ws.get<int32_t>(p.ws_eidx)) : nullptr;
  const DType sdt = p.grad_scales_dtype;
  dispatch_float(p.grad_y.dtype, "grad_y", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_float(sdt, "grad_scales", [&](auto stag) {
      using S = typename decltype(stag)::type;
      finalize_backward_team<T, S>(p, idx, eidx, ws);
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
  p.ws_slots = layout.add<finalize_detail::SlotRef>(2 * p.K, p.threads);  // this token, next
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
  p.ws_g = layout.add<float>(padded_max(p.H) + kMaxFloatLanes, p.threads);  // + a zero tail
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
