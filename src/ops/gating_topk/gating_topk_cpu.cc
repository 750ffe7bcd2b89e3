// CPU kernels of the gating top-k forward (§2.4) and backward (§1.5), compiled once per SIMD
// target (Highway) and dispatched at run time. One token row per iteration, fp32 math,
// per-thread scratch rows from the workspace; rows are independent, so any thread count gives
// the same bits (D16).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/gating_topk/gating_topk_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <functional>

#include "core/dtype.h"
#include "core/host.h"
#include "core/parallel.h"
#include "core/simd-inl.h"
#include "core/rows-inl.h"
#include "hwy/highway.h"
#include "ops/gating_topk/gating_topk.h"

#ifndef MOEGRAD_GATING_TOPK_CPU_ONCE_
#define MOEGRAD_GATING_TOPK_CPU_ONCE_
namespace moegrad {
namespace gating_detail {

constexpr int64_t kMaxExpertsCpu = 2048;  // the validated bound on N

// Ranking key (L2): one unsigned compare orders larger scores first, NaN above every number,
// +0 == -0, and equal scores by lower index. Key 0 is below every score (excluded experts).
inline uint64_t rank_key(float v, int32_t index) {
  uint32_t u = f32_bits(v + 0.0f);  // -0 -> +0
  if (std::isnan(v)) {
    u = 0xffffffffu;
  } else {
    u ^= (u & 0x80000000u) ? 0xffffffffu : 0x80000000u;  // monotone float -> unsigned map
  }
  return (static_cast<uint64_t>(u) << 32) | (0xffffffffu - static_cast<uint32_t>(index));
}
inline int32_t key_index(uint64_t key) {
  return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(key));
}

// The k largest keys of keys[0..n), largest first, into out[0..k). Insertion into a sorted
// list for small k (one pass; most candidates fail the first compare), partial sort otherwise.
inline void top_k(const uint64_t* keys, int32_t n, int32_t k, uint64_t* out, uint64_t* scratch) {
  if (k <= 32) {
    int32_t len = 0;
    for (int32_t j = 0; j < n; ++j) {
      const uint64_t key = keys[j];
      if (len == k && key <= out[k - 1]) continue;
      int32_t pos = len < k ? len++ : k - 1;
      while (pos > 0 && key > out[pos - 1]) {
        out[pos] = out[pos - 1];
        --pos;
      }
      out[pos] = key;
    }
    return;
  }
  std::copy(keys, keys + n, scratch);
  std::partial_sort(scratch, scratch + k, scratch + n, std::greater<uint64_t>());
  std::copy(scratch, scratch + k, out);
}

}  // namespace gating_detail
}  // namespace moegrad
#endif  // MOEGRAD_GATING_TOPK_CPU_ONCE_

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {
namespace {

using gating_detail::key_index;
using gating_detail::kMaxExpertsCpu;
using gating_detail::rank_key;
using gating_detail::top_k;

// norm[0..n) = softmax / sigmoid / sqrt-softplus of the fp32 logits in `logits` (padded).
void Normalise(const float* logits, int64_t n, int64_t norm_type, float* norm) {
  if (norm_type == 1) {
    map_chunk(logits, norm, n, [](DF d, VF v) { return Sigmoid(d, v); });
  } else if (norm_type == 2) {
    map_chunk(logits, norm, n, [](DF d, VF v) { return SqrtSoftplus(d, v); });
  } else {
    float m = -std::numeric_limits<float>::infinity();
    bool has_nan = false;
    for (int64_t j = 0; j < n; ++j) {
      has_nan |= std::isnan(logits[j]);
      m = logits[j] > m ? logits[j] : m;
    }
    map_chunk(logits, norm, n, [m](DF d, VF v) { return ExpNaN(d, hn::Sub(v, hn::Set(d, m))); });
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += norm[j];
    const float inv = has_nan ? std::numeric_limits<float>::quiet_NaN() : 1.0f / sum;
    for (int64_t j = 0; j < n; ++j) norm[j] *= inv;
  }
}

template <typename T>
void ForwardRows(const GatingTopKPlan& p, const Workspace& ws, int tid, int64_t begin,
                 int64_t end) {
  const GatingTopKAttrs& a = p.attrs;
  const int64_t N = p.N, K = a.k, G = a.group_count, gsize = N / G;
  const size_t np = padded(static_cast<size_t>(N));
  float* logits = ws.get<float>(p.ws_rows, tid);  // 2 padded rows: logits, norm
  std::fill(logits, logits + 2 * np, 0.0f);
  float* norm = logits + np;
  uint64_t* keys = ws.get<uint64_t>(p.ws_keys, tid);  // keys, best, scratch: N each
  uint64_t* best = keys + N;
  uint64_t* scratch = best + N;
  uint64_t* gkeys = ws.get<uint64_t>(p.ws_gkeys, tid);  // gkeys, gbest, gscratch: G each
  uint64_t* gbest = gkeys + G;
  uint64_t* gscratch = gbest + G;
  int32_t* order = ws.get<int32_t>(p.ws_order, tid);
  char* kept = ws.get<char>(p.ws_kept, tid);
  const T* x = typed<T>(p.x);
  float* bias = ws.get<float>(p.ws_bias, tid);
  if (p.has_bias) load_chunk(typed<T>(p.bias), bias, N);
  T* y = typed<T>(p.y);
  int32_t* idx = typed<int32_t>(p.expert_idx);
  float* norm_out = typed<float>(p.norm_out);
  const float rsf = static_cast<float>(a.routed_scaling_factor);
  const float eps = static_cast<float>(a.eps);
  const bool renorm = a.norm_type != 0 || a.renorm == 1;

  for (int64_t r = begin; r < end; ++r) {
    load_chunk(x + r * N, logits, N);
    Normalise(logits, N, a.norm_type, norm);
    for (int64_t j = 0; j < N; ++j) {
      keys[j] = rank_key(p.has_bias ? norm[j] + bias[j] : norm[j], static_cast<int32_t>(j));
    }
    if (p.grouped) {
      const int32_t take = a.group_select_mode == 0 ? 1 : 2;
      for (int64_t g = 0; g < G; ++g) {
        uint64_t gb[2];
        top_k(keys + g * gsize, static_cast<int32_t>(gsize), take, gb, nullptr);
        // Scores are recomputed from the winners' indices (keys carry the order only).
        float gs = 0.0f;
        for (int32_t t = 0; t < take; ++t) {
          const int64_t j = key_index(gb[t]);  // a global expert index
          gs += p.has_bias ? norm[j] + bias[j] : norm[j];
        }
        gkeys[g] = rank_key(gs, static_cast<int32_t>(g));
      }
      top_k(gkeys, static_cast<int32_t>(G), static_cast<int32_t>(a.k_group), gbest, gscratch);
      // Experts of the groups not kept rank below every eligible one.
      std::fill(kept, kept + G, 0);
      for (int64_t i = 0; i < a.k_group; ++i) kept[key_index(gbest[i])] = 1;
      for (int64_t g = 0; g < G; ++g) {
        if (!kept[g]) std::fill_n(keys + g * gsize, gsize, uint64_t{0});
      }
    }
    top_k(keys, static_cast<int32_t>(N), static_cast<int32_t>(K), best, scratch);
    for (int64_t k = 0; k < K; ++k) order[k] = key_index(best[k]);

    float sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) sum += norm[order[k]];
    const float denom = sum + eps;
    for (int64_t k = 0; k < K; ++k) {
      const float g = norm[order[k]];
      const float w = renorm ? g / denom : g;
      y[r * K + k] = from_f32<T>(w * rsf);
      idx[r * K + k] = order[k];
    }
    float* nrow = norm_out + r * N;
    if (a.out_flag) {
      std::memcpy(nrow, norm, sizeof(float) * N);
    } else {
      std::memset(nrow, 0, sizeof(float) * N);
    }
  }
}

// One row of the backward (§1.5, D22). G = the gradient w.r.t. the normalised scores of the
// selected experts: the renorm backward of g = rsf * grad_y (sigmoid, sqrt-softplus, softmax with
// renorm 1) or g itself (softmax without renorm), scattered with repeats summed (D1). Then the
// chain rule through the normalisation: s(1 - s) (sigmoid), dn/dx (sqrt-softplus) or the softmax
// Jacobian s_j (G_j - sum_i s_i G_i) over all N columns, one vector at a time, narrowed to T in
// registers. Every fp32 operation rounds on its own, in the order written here (no contraction,
// L43), so the CUDA kernel gives the same bits.
// Rows of at most kRegisterExperts experts and kRegisterSlots slots build G in registers: a
// compare and a masked add per slot and vector instead of the scatter into a row buffer, whose
// lane-wise stores stall the vector loads that follow (store forwarding) on such short rows
// (~10 % faster at GPT-OSS shapes, E = 32). The same bits: lanes of no selected expert add +0
// to a sum that starts at +0 and so is never -0.
constexpr int64_t kRegisterExperts = 64;
constexpr int64_t kRegisterSlots = 16;

template <typename T>
void BackwardRows(const GatingTopKBackwardPlan& p, const int32_t* idx, int64_t begin,
                  int64_t end) {
  const DF d;
  const size_t L = hn::Lanes(d);
  const int64_t N = p.N, K = p.K;
  const size_t Nz = static_cast<size_t>(N), Nv = Nz / L * L;
  const int64_t norm_type = p.attrs.norm_type;
  const bool renorm = norm_type != 0 || p.attrs.renorm == 1;
  const float rsf = static_cast<float>(p.attrs.routed_scaling_factor);
  const float eps = static_cast<float>(p.attrs.eps);
  const float* xn = typed<float>(p.x_norm);
  const T* gy = typed<T>(p.grad_y);
  T* gx = typed<T>(p.grad_x);
  // N <= 2048 (validated): the row scratch fits the stack, so this op needs no workspace with
  // int32 indices (C callers may pass none, as its size is then 0).
  const size_t np = padded(Nz);
  HWY_ALIGN float G[kMaxExpertsCpu + kMaxFloatLanes];
  std::fill(G, G + np, 0.0f);
  float gs[kMaxExpertsCpu], w[kMaxExpertsCpu], gp[kMaxExpertsCpu];

  const bool regs = N <= kRegisterExperts && K <= kRegisterSlots;
  for (int64_t r = begin; r < end; ++r) {
    const float* xr = xn + r * N;
    const int32_t* er = idx + r * K;
    if (!regs) std::fill(G, G + N, 0.0f);
    float sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = er[k];
      // Out-of-range device indices are skipped (never read or written out of bounds).
      w[k] = (e >= 0 && e < N) ? xr[e] : 0.0f;
      gs[k] = rsf * to_f32(gy[r * K + k]);
      sum += w[k];
    }
    if (renorm) {
      const float denom = eps + sum;
      float beta = 0.0f;
      for (int64_t k = 0; k < K; ++k) beta += (w[k] / denom) * gs[k];
      for (int64_t k = 0; k < K; ++k) gp[k] = (gs[k] - beta) / denom;
    } else {
      for (int64_t k = 0; k < K; ++k) gp[k] = gs[k];
    }
    if (!regs) {
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = er[k];
        if (e >= 0 && e < N) G[e] += gp[k];  // scatter-add (D1)
      }
    }
    float dot = 0.0f;  // softmax: sum_j s_j G_j = sum_k s_{e_k} g'_k, in slot order
    if (norm_type == 0) {
      for (int64_t k = 0; k < K; ++k) dot += w[k] * gp[k];
    }
    auto value = [&](VF x, VF g) {
      if (norm_type == 1) return hn::Mul(hn::Mul(x, hn::Sub(hn::Set(d, 1.0f), x)), g);
      if (norm_type == 0) return hn::Mul(x, hn::Sub(g, hn::Set(d, dot)));
      return hn::Mul(SqrtSoftplusGrad(d, x), g);
    };
    auto grad_at = [&](size_t j) {
      if (!regs) return hn::Load(d, G + j);
      const hn::RebindToSigned<DF> di;
      const auto cols = hn::Add(hn::Iota(di, 0), hn::Set(di, static_cast<int32_t>(j)));
      VF acc = hn::Zero(d);
      for (int64_t k = 0; k < K; ++k) {  // scatter-add (D1); ids outside [0, N) match no column
        const auto hit = hn::RebindMask(d, hn::Eq(cols, hn::Set(di, er[k])));
        acc = hn::Add(acc, hn::IfThenElseZero(hit, hn::Set(d, gp[k])));
      }
      return acc;
    };
    T* o = gx + r * N;
    size_t j = 0;
    for (; j < Nv; j += L) {
      StoreF(d, value(hn::LoadU(d, xr + j), grad_at(j)), o + j);
    }
    if (j < Nz) {  // G is padded with +0
      StoreFN(d, value(LoadFN(d, xr + j, Nz - j), grad_at(j)),
                         o + j, Nz - j);
    }
  }
}

}  // namespace

void GatingForward(const GatingTopKPlan& p, const Workspace& ws) {
  dispatch_float(p.x.dtype, "x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    parallel_rows(p.M, p.threads,
                  [&](int tid, int64_t b, int64_t e) { ForwardRows<T>(p, ws, tid, b, e); });
  });
}

void GatingBackward(const GatingTopKBackwardPlan& p, const Workspace& ws) {
  const int32_t* idx = index32(p.expert_idx, ws.get<int32_t>(p.ws_idx));
  dispatch_float(p.grad_y.dtype, "grad_y", [&](auto tag) {
    using T = typename decltype(tag)::type;
    parallel_rows(p.M, p.threads,
                  [&](int, int64_t b, int64_t e) { BackwardRows<T>(p, idx, b, e); });
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moegrad {
HWY_EXPORT(GatingForward);
HWY_EXPORT(GatingBackward);

namespace {
// Rows per chunk: enough work per thread to amortise the fork.
int64_t grain_for(int64_t row_elems) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems));
}
}  // namespace

void gating_top_k_cpu_size(GatingTopKPlan& p, WorkspaceLayout& layout) {
  p.threads = plan_threads(p.M, grain_for(p.N));
  const int64_t N = p.N, G = p.attrs.group_count;
  p.ws_rows = layout.add<float>(2 * padded_max(N), p.threads);
  p.ws_keys = layout.add<uint64_t>(3 * N, p.threads);
  p.ws_gkeys = layout.add<uint64_t>(3 * G, p.threads);
  p.ws_order = layout.add<int32_t>(p.attrs.k, p.threads);
  p.ws_kept = layout.add<char>(G, p.threads);
  p.ws_bias = layout.add<float>(p.has_bias ? N : 0, p.threads);
}

void gating_top_k_cpu(const GatingTopKPlan& plan, const Workspace& ws, void*) {
  advise_output(plan.norm_out);
  HWY_DYNAMIC_DISPATCH(GatingForward)(plan, ws);
}

void gating_top_k_backward_cpu_size(GatingTopKBackwardPlan& p, WorkspaceLayout& layout) {
  p.threads = plan_threads(p.M, grain_for(p.N));
  p.ws_idx = index_scratch(layout, p.expert_idx);
}

void gating_top_k_backward_cpu(const GatingTopKBackwardPlan& plan, const Workspace& ws, void*) {
  advise_output(plan.grad_x);
  HWY_DYNAMIC_DISPATCH(GatingBackward)(plan, ws);
}
}  // namespace moegrad
#endif  // HWY_ONCE
