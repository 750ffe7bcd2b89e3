// CPU kernels of init routing (docs/operators.md §8.5, §8.8) and its grad (§8.9).
//
// Forward: a stable counting sort of the R*K slots by expert id. Slots are split into a fixed
// number of chunks (chosen at plan time); each chunk counts its ids, one serial pass turns the
// (expert, chunk) counts into start offsets, and each chunk then places its slots in slot order.
// The result is the unique stable order, whatever the thread count (D16). Rows are bit copies.
// Grad: per token, the fp32 sum of its valid rows in k order, compiled once per SIMD target
// (Highway) and dispatched at run time.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/init_routing/init_routing_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cstring>
#include <numeric>

#include "core/dtype.h"
#include "core/host.h"
#include "core/parallel.h"
#include "core/simd-inl.h"
#include "core/rows-inl.h"
#include "hwy/highway.h"
#include "ops/init_routing/init_routing.h"
#include "ops/init_routing/init_routing_formula.h"

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {
namespace {

// The grad_expanded_x row of slot i (null: dropped, outside the window or truncated, D29).
template <typename T>
HWY_INLINE const T* grad_src(const InitRoutingGradPlan& p, const int32_t* idx, const T* g,
                             int64_t i) {
  const int64_t d = idx[i];
  return init_routing_formula::grad_row_valid(d, p.rows) ? g + d * p.H : nullptr;
}

// Whether the init routing grad prefetches its gathered rows in software: not when K rows of
// fp32 (K >= 8; 16-bit rows from K >= 16) are read at once, whole lines per vector. Measured
// (1 and 2 threads, T = 4096): DeepSeek-V3 fp32 (K = 8, 28 KB rows) 1.2-1.3x faster without,
// GPT-OSS fp32 (K = 4) and DeepSeek-V3 bf16/fp16 (K = 8) 1.1-1.6x faster with it; most likely
// the hardware prefetchers already keep enough lines in flight for 8 full-line streams and the
// software prefetches compete with them for the miss buffers (docs/decisions.md L114).
template <typename T>
HWY_INLINE bool grad_prefetch(int64_t K) {
  return K * static_cast<int64_t>(sizeof(T)) < 32;
}

// U vectors of token row r at column j (kTail: one vector of n < Lanes elements): +0 plus the
// valid slots' rows in k order, in fp32. With prefetch: prefetches ahead in each gathered row
// and, near its end, the start of the next token's row of the same slot.
template <size_t U, bool kTail, typename T>
HWY_INLINE void grad_block(DF d, const InitRoutingGradPlan& p, const int32_t* idx, const T* g,
                           int64_t r, bool prefetch, bool has_next, size_t j, size_t n,
                           VF* acc) {
  const size_t L = hn::Lanes(d);
  const int64_t K = p.K;
  const size_t row_bytes = static_cast<size_t>(p.H) * sizeof(T);
  for (size_t u = 0; u < U; ++u) acc[u] = hn::Zero(d);
  for (int64_t k = 0; k < K; ++k) {
    const T* src = grad_src(p, idx, g, r * K + k);
    if (!src) continue;
    if (prefetch) {
      const T* next = has_next ? grad_src(p, idx, g, (r + 1) * K + k) : nullptr;
      for (size_t off = 0; off < U * L * sizeof(T); off += 64) {
        rows::PrefetchAhead(src, next, row_bytes, j * sizeof(T) + off);
      }
    }
    for (size_t u = 0; u < U; ++u) {
      const VF v = kTail ? LoadFN(d, src + j, n) : LoadF(d, src + j + u * L);
      acc[u] = hn::Add(acc[u], v);
    }
  }
}

template <typename T>
void grad_rows(const InitRoutingGradPlan& p, const int32_t* idx, int64_t begin, int64_t end) {
  const DF d;
  const size_t H = static_cast<size_t>(p.H);
  const T* g = typed<T>(p.grad_expanded_x);
  T* out = typed<T>(p.grad_x);
  const bool nt = stream_output(mul_sat(p.R, p.H * static_cast<int64_t>(sizeof(T))));
  const bool prefetch = grad_prefetch<T>(p.K);
  for (int64_t r = begin; r < end; ++r) {
    const bool has_next = r + 1 < end;
    rows::WriteRow(d, out + r * p.H, H, nt, [&](auto U, auto tail, size_t j, size_t n, VF* acc) {
      grad_block<decltype(U)::value, decltype(tail)::value>(d, p, idx, g, r, prefetch, has_next, j, n,
                                                            acc);
    });
  }
  hwy::FlushStream();
}

}  // namespace

// poff: the aligned block starts (D36, align > 1), else null.
void InitRoutingCopyRows(const InitRoutingPlan& p, const int32_t* sorted, const int32_t* starts,
                         const int32_t* poff, int64_t n_act) {
  const int64_t K = p.K;
  const size_t rb = static_cast<size_t>(p.H * dtype_size(p.x.dtype));
  const unsigned char* x = static_cast<const unsigned char*>(p.x.data);
  unsigned char* ex = static_cast<unsigned char*>(p.expanded_x.data);
  const bool nt = stream_output(mul_sat(p.rows, static_cast<int64_t>(rb)));
  if (poff) {
    // Each row's source from the shared formula (the CUDA kernel's): the block's q-th sorted
    // slot while q < the real count, padding (+0.0) after it and from poff[bins] on.
    const int64_t bins = p.hi - p.lo;
    parallel_rows(p.rows, p.threads, [&](int, int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t d = init_routing_formula::aligned_source(j, bins, poff, starts);
        const unsigned char* src = d >= 0 ? x + static_cast<int64_t>(sorted[d] / K) * rb : nullptr;
        rows::StreamBytes(src, ex + j * rb, rb, nt);
      }
      hwy::FlushStream();
    });
  } else if (p.mode == 0) {
    parallel_rows(p.rows, p.threads, [&](int, int64_t d0, int64_t d1) {
      for (int64_t d = d0; d < d1; ++d) {
        const unsigned char* src =
            d < n_act ? x + static_cast<int64_t>(sorted[d] / K) * rb : nullptr;
        rows::StreamBytes(src, ex + d * rb, rb, nt);
      }
      hwy::FlushStream();
    });
  } else {
    const int64_t cap = p.capacity;
    parallel_rows(p.rows, p.threads, [&](int, int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t d = init_routing_formula::drop_pad_source(j, cap, starts);
        const unsigned char* src = d >= 0 ? x + static_cast<int64_t>(sorted[d] / K) * rb : nullptr;
        rows::StreamBytes(src, ex + j * rb, rb, nt);
      }
      hwy::FlushStream();
    });
  }
}

// Token order (L113): x row r goes to the destination rows dest[r K + k] in [0, rows), each
// read once (the destination order reads every row K times, from memory once x outgrows the
// cache); then the rows no slot addresses are zeroed (D27). Every destination row is written by
// one slot (or zeroed once), so the bits do not depend on the thread count.
void InitRoutingCopyBySource(const InitRoutingPlan& p, const int32_t* dest, const int32_t* starts,
                             int64_t n_act) {
  const int64_t K = p.K, rows = p.rows;
  const size_t rb = static_cast<size_t>(p.H * dtype_size(p.x.dtype));
  const unsigned char* x = static_cast<const unsigned char*>(p.x.data);
  unsigned char* ex = static_cast<unsigned char*>(p.expanded_x.data);
  const bool nt = stream_output(mul_sat(p.rows, static_cast<int64_t>(rb)));
  parallel_rows(p.R, p.threads, [&](int, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const unsigned char* src = x + r * static_cast<int64_t>(rb);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t d = dest[r * K + k];
        if (d >= 0 && d < rows) rows::StreamBytes(src, ex + d * static_cast<int64_t>(rb), rb, nt);
      }
    }
    hwy::FlushStream();
  });
  if (p.mode == 0) {
    const int64_t z0 = std::min(n_act, rows);
    parallel_rows(rows - z0, p.threads, [&](int, int64_t j0, int64_t j1) {
      for (int64_t j = z0 + j0; j < z0 + j1; ++j) {
        rows::StreamBytes(nullptr, ex + j * static_cast<int64_t>(rb), rb, nt);
      }
      hwy::FlushStream();
    });
  } else {
    const int64_t cap = p.capacity;
    parallel_rows(rows, p.threads, [&](int, int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        if (init_routing_formula::drop_pad_source(j, cap, starts) < 0) {
          rows::StreamBytes(nullptr, ex + j * static_cast<int64_t>(rb), rb, nt);
        }
      }
      hwy::FlushStream();
    });
  }
}

void InitRoutingBackward(const InitRoutingGradPlan& p, const Workspace& ws) {
  const int32_t* idx = index32(p.expanded_row_idx, ws.get<int32_t>(p.ws_idx));
  dispatch_float(p.grad_expanded_x.dtype, "grad_expanded_x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    parallel_rows(p.R, p.threads,
                  [&](int, int64_t b, int64_t e) { grad_rows<T>(p, idx, b, e); });
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moegrad {
HWY_EXPORT(InitRoutingBackward);
HWY_EXPORT(InitRoutingCopyRows);
HWY_EXPORT(InitRoutingCopyBySource);

int64_t grain(int64_t H) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(1, H)); }

void init_routing_grad_cpu_size(InitRoutingGradPlan& p, WorkspaceLayout& layout) {
  p.threads = plan_threads(p.R, grain(mul_sat(p.H, p.K)));  // top_k is unbounded when R = 0
  p.ws_idx = index_scratch(layout, p.expanded_row_idx);
}

void init_routing_grad_cpu(const InitRoutingGradPlan& plan, const Workspace& ws, void*) {
  advise_output(plan.grad_x);
  HWY_DYNAMIC_DISPATCH(InitRoutingBackward)(plan, ws);
}

namespace {

template <typename C>
void write_tokens(const InitRoutingPlan& p, const int32_t* starts, int64_t bins, int64_t n_act) {
  C* out = static_cast<C*>(p.expert_tokens.data);
  auto count = [&](int64_t b) {
    return static_cast<int64_t>((b + 1 < bins ? starts[b + 1] : n_act) - starts[b]);
  };
  if (p.token_type == 2) {
    // (expert id, count) for experts with tokens, ascending, then (0, 0) rows (D26, D27).
    int64_t row = 0;
    for (int64_t b = 0; b < bins; ++b) {
      const int64_t c = count(b);
      if (c == 0) continue;
      out[2 * row] = static_cast<C>(p.lo + b);
      out[2 * row + 1] = static_cast<C>(c);
      ++row;
    }
    for (; row < p.expert_num; ++row) out[2 * row] = out[2 * row + 1] = 0;
    return;
  }
  int64_t run = 0;
  for (int64_t b = 0; b < bins; ++b) {
    const int64_t start = run;
    run += count(b);
    out[b] = static_cast<C>(init_routing_formula::token_value(p.token_type, start, run));
  }
}

}  // namespace

// x of this many bytes and more is copied in token order (L113).
constexpr int64_t kSourceOrderMinBytes = int64_t{8} << 20;

void init_routing_cpu_size(InitRoutingPlan& p, WorkspaceLayout& layout) {
  const int64_t N = p.R * p.K;
  const int64_t bins = p.comparison_sort ? 0 : std::max<int64_t>(p.hi - p.lo, 0);
  p.threads = plan_threads(p.rows, grain(p.H));
  p.sort_threads = plan_threads(p.chunks, 1);
  p.ws_eidx = index_scratch(layout, p.expert_idx);
  p.ws_sorted = layout.add<int32_t>(N);
  p.ws_starts = layout.add<int32_t>(bins + 1);
  p.ws_hist = layout.add<int32_t>(p.chunks * (bins + 1));
  p.ws_poff = layout.add<int32_t>(p.align > 1 ? bins + 1 : 0);
  // Token order once x no longer stays in the cache between the K reads of each of its rows
  // (not for aligned blocks, whose padding rows the destination-order copy zeroes in passing).
  p.source_order = p.align == 1 &&
                   mul_sat(p.R, p.H * dtype_size(p.x.dtype)) >= kSourceOrderMinBytes;
  p.ws_dest = layout.add<int32_t>(p.source_order ? N : 0);
}

void init_routing_cpu(const InitRoutingPlan& p, const Workspace& ws, void*) {
  advise_output(p.expanded_x);
  const int64_t N = p.R * p.K;
  const int32_t* e = index32(p.expert_idx, ws.get<int32_t>(p.ws_eidx));
  int32_t* idx = static_cast<int32_t*>(p.expanded_row_idx.data);
  int32_t* sorted = ws.get<int32_t>(p.ws_sorted);  // dst -> src for the in-window slots
  const int64_t lo = p.lo, hi = p.hi;
  const int64_t bins = p.comparison_sort ? 0 : std::max<int64_t>(hi - lo, 0);
  int32_t* starts = ws.get<int32_t>(p.ws_starts);
  int32_t* dest = p.source_order ? ws.get<int32_t>(p.ws_dest) : nullptr;  // slot -> row
  int32_t* poff = p.align > 1 ? ws.get<int32_t>(p.ws_poff) : nullptr;   // D36 block starts
  int64_t n_act = 0;

  if (p.comparison_sort) {
    // Sparse ids without a window: every slot is in; stable sort by id.
    std::iota(sorted, sorted + N, 0);
    std::stable_sort(sorted, sorted + N, [&](int32_t a, int32_t b) { return e[a] < e[b]; });
    n_act = N;
    if (p.row_idx_type == 0) {
      for (int64_t d = 0; d < N; ++d) idx[sorted[d]] = static_cast<int32_t>(d);
    }
    if (dest) {
      for (int64_t d = 0; d < N; ++d) dest[sorted[d]] = static_cast<int32_t>(d);
    }
  } else {
    const int64_t C = p.chunks, W = bins + 1;
    int32_t* hist = ws.get<int32_t>(p.ws_hist);
    auto chunk_begin = [&](int64_t c) { return N * c / C; };
    parallel_rows(C, p.sort_threads, [&](int, int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        int32_t* h = hist + c * W;
        std::fill(h, h + W, 0);
        for (int64_t s = chunk_begin(c), s1 = chunk_begin(c + 1); s < s1; ++s) {
          const int64_t b = static_cast<int64_t>(e[s]) - lo;
          ++h[(b >= 0 && b < bins) ? b : bins];
        }
      }
    });
    int64_t run = 0;
    for (int64_t b = 0; b < bins; ++b) {
      starts[b] = static_cast<int32_t>(run);
      for (int64_t c = 0; c < C; ++c) {
        const int32_t t = hist[c * W + b];
        hist[c * W + b] = static_cast<int32_t>(run);
        run += t;
      }
    }
    starts[bins] = static_cast<int32_t>(run);
    n_act = run;
    if (poff) {  // D36: each block rounded up to a multiple of align
      int64_t at = 0;
      for (int64_t b = 0; b < bins; ++b) {
        poff[b] = static_cast<int32_t>(at);
        at += init_routing_formula::padded_block_rows(starts[b + 1] - starts[b], p.align);
      }
      poff[bins] = static_cast<int32_t>(at);
    }
    const bool drop_pad = p.mode == 1;
    const int64_t cap = p.capacity;
    const bool gather = p.row_idx_type == 0;
    parallel_rows(C, p.sort_threads, [&](int, int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        int32_t* h = hist + c * W;
        for (int64_t s = chunk_begin(c), s1 = chunk_begin(c + 1); s < s1; ++s) {
          const int64_t b = static_cast<int64_t>(e[s]) - lo;
          if (b < 0 || b >= bins) {
            if (gather) idx[s] = -1;  // outside the window (D25)
            if (dest) dest[s] = -1;
            continue;
          }
          const int32_t d = h[b]++;
          sorted[d] = static_cast<int32_t>(s);
          if (!gather && !dest) continue;
          // D36: aligned blocks (dropless only) start at poff[b].
          const int32_t row =
              poff ? static_cast<int32_t>(poff[b] + (d - starts[b]))
                   : init_routing_formula::dest_row(d, b, starts[b], drop_pad, cap);
          if (gather) idx[s] = row;
          if (dest) dest[s] = row;
        }
      }
    });
  }

  if (p.row_idx_type == 1) {
    // dst -> src: the in-window order, then the other slots in the reference order (L32): ids
    // >= end by id (stable), then ids < start in slot order.
    std::copy(sorted, sorted + n_act, idx);
    int64_t pos = n_act;
    for (int64_t s = 0; s < N; ++s) {
      if (e[s] >= hi) idx[pos++] = static_cast<int32_t>(s);
    }
    std::stable_sort(idx + n_act, idx + pos, [&](int32_t a, int32_t b) { return e[a] < e[b]; });
    for (int64_t s = 0; s < N; ++s) {
      if (e[s] < lo) idx[pos++] = static_cast<int32_t>(s);
    }
  }

  // expanded_x: bit copies of token rows; rows with no slot are +0.0 (D27).
  if (dest) {
    HWY_DYNAMIC_DISPATCH(InitRoutingCopyBySource)(p, dest, starts, n_act);
  } else {
    HWY_DYNAMIC_DISPATCH(InitRoutingCopyRows)(p, sorted, starts, poff, n_act);
  }
  if (poff) {
    int64_t* out = static_cast<int64_t*>(p.padded_offsets.data);
    for (int64_t b = 0; b <= bins; ++b) out[b] = poff[b];
  }

  if (p.has_tokens) {
    if (p.expert_tokens.dtype == DType::kInt64) {
      write_tokens<int64_t>(p, starts, bins, n_act);
    } else {
      write_tokens<int32_t>(p, starts, bins, n_act);
    }
  }
}

}  // namespace moegrad
#endif  // HWY_ONCE
