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
#include "ops/gating_topk/gating_formula.h"
#include "ops/gating_topk/gating_topk.h"

#ifndef MOEGRAD_GATING_TOPK_CPU_ONCE_
#define MOEGRAD_GATING_TOPK_CPU_ONCE_
namespace moegrad {
namespace gating_detail {

constexpr int64_t kMaxExpertsCpu = 2048;  // the validated bound on N

// The ranking key of L2, shared with the CUDA kernels (gating_formula.h).
using gating_formula::key_index;
using gating_formula::rank_key;

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

// The k largest keys of src[0..n), largest first, into out[0..k), for small k (kMaxSelect):
// k passes, each a vector maximum over the keys with the previous pass's winner zeroed (keys are
// unique, so exactly one lane holds it). Same result as top_k, without its data-dependent
// branches, which mispredict on every insertion (docs/decisions.md L143). work (n entries) holds
// the keys after the first pass; it may be src itself when src may be overwritten.
constexpr int32_t kMaxSelect = 8;
HWY_INLINE void TopKMax(const uint64_t* src, size_t n, int32_t k, uint64_t* out, uint64_t* work) {
  const hn::ScalableTag<uint64_t> du;
  const size_t L = hn::Lanes(du);
  const size_t nv = n / L * L;
  HWY_ALIGN uint64_t lanes[HWY_MAX_BYTES / sizeof(uint64_t)];
  uint64_t prev = 0;
  for (int32_t i = 0; i < k; ++i) {
    const uint64_t* from = i <= 1 ? src : work;
    auto m = hn::Zero(du);
    uint64_t ms = 0;
    if (i == 0) {
      for (size_t j = 0; j < nv; j += L) m = hn::Max(m, hn::LoadU(du, from + j));
      for (size_t j = nv; j < n; ++j) ms = std::max(ms, from[j]);
    } else {
      const auto pv = hn::Set(du, prev);
      for (size_t j = 0; j < nv; j += L) {
        auto v = hn::LoadU(du, from + j);
        v = hn::IfThenZeroElse(hn::Eq(v, pv), v);
        hn::StoreU(v, du, work + j);
        m = hn::Max(m, v);
      }
      for (size_t j = nv; j < n; ++j) {
        const uint64_t v = from[j] == prev ? 0 : from[j];
        work[j] = v;
        ms = std::max(ms, v);
      }
    }
    hn::Store(m, du, lanes);
    for (size_t l = 0; l < L; ++l) ms = std::max(ms, lanes[l]);
    out[i] = ms;
    prev = ms;
  }
}

// The k largest keys of keys[0..n), largest first, into out[0..k); keys is left as it was and
// work (n entries) is scratch. Small k by vector maxima (L143), larger k by top_k.
HWY_INLINE void SelectTopK(const uint64_t* keys, size_t n, int32_t k, uint64_t* out,
                           uint64_t* work) {
  if (k <= kMaxSelect) {
    TopKMax(keys, n, k, out, work);
  } else {
    top_k(keys, static_cast<int32_t>(n), k, out, work);
  }
}

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
    size_t n_cand = static_cast<size_t>(N);
    if (p.grouped) {
      const int32_t take = a.group_select_mode == 0 ? 1 : 2;
      for (int64_t g = 0; g < G; ++g) {
        uint64_t gb[2];
        SelectTopK(keys + g * gsize, static_cast<size_t>(gsize), take, gb, scratch);
        // Scores are recomputed from the winners' indices (keys carry the order only).
        float gs = 0.0f;
        for (int32_t t = 0; t < take; ++t) {
          const int64_t j = key_index(gb[t]);  // a global expert index
          gs += p.has_bias ? norm[j] + bias[j] : norm[j];
        }
        gkeys[g] = rank_key(gs, static_cast<int32_t>(g));
      }
      top_k(gkeys, static_cast<int32_t>(G), static_cast<int32_t>(a.k_group), gbest, gscratch);
      // Only the kept groups' keys stay candidates, moved to the front in group order (the
      // others rank below every eligible one; keys are unique, so the order does not matter).
      std::fill(kept, kept + G, 0);
      for (int64_t i = 0; i < a.k_group; ++i) kept[key_index(gbest[i])] = 1;
      n_cand = 0;
      for (int64_t g = 0; g < G; ++g) {
        if (!kept[g]) continue;
        if (n_cand != static_cast<size_t>(g * gsize)) {
          std::copy_n(keys + g * gsize, gsize, keys + n_cand);  // forward: n_cand < g * gsize
        }
        n_cand += static_cast<size_t>(gsize);
      }
    }
    SelectTopK(keys, n_cand, static_cast<int32_t>(K), best, scratch);
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

// The backward (§1.5, D22), per row: G = the gradient w.r.t. the normalised scores of the
// selected experts: the renorm backward of g = rsf * grad_y (sigmoid, sqrt-softplus, softmax
// with renorm 1) or g itself (softmax without renorm), scattered with repeats summed (D1). Then
// the chain rule through the normalisation: s(1 - s) (sigmoid), dn/dx (sqrt-softplus) or the
// softmax Jacobian s_j (G_j - sum_i s_i G_i) over all N columns, one vector at a time, narrowed
// to T in registers. Every fp32 operation rounds on its own, in the order written here (no
// contraction, L43), so the CUDA kernel gives the same bits.
//
// The per-slot scalars (the K selected scores, their sum, the renorm's beta and g'_k, the
// softmax dot) are computed for a batch of Lanes(d) rows at once, one row per lane, with the
// same operations in the same order as one row at a time (IEEE division, like every other
// operation here, is correctly rounded, so the vector division gives the scalar's bits). That
// replaces 2K dependent scalar divisions and three dependent sums of K terms per row by the
// same number of vector operations per batch (docs/decisions.md L91). The g'_k of the batch are
// then scattered into a tile of one G row per batch row (+0, then the slots in slot order:
// repeats summed, D1), and only then is each row's output computed from its G row: the vector
// loads of G no longer wait for the scalar stores of the scatter just before them (store
// forwarding; the earlier kernel built G in registers with a compare and a masked add per slot
// and vector for that reason). Each row leaves its G row +0 again. Rows past the last
// whole batch, and rows of more than kBatchSlots slots or kBatchExperts experts, take the
// one-row form of the same arithmetic (OneRows, software-pipelined, L119). On AVX-512 the
// batches of K in {2, 4, 8} slots and up to 256 experts are built in registers instead, and
// write each row at G = +0 before its selected lanes (reg::Rows, reg::Wide; L110, L120,
// L141).
constexpr int64_t kBatchSlots = 16;
constexpr int64_t kBatchExperts = 64;
constexpr size_t kBatchRows = 16;  // at most Lanes(d) rows a batch (AVX-512)

struct BackwardScalars {
  bool renorm;
  int64_t norm_type;
  float rsf, eps;
};

// grad_x of one vector of a row from its scores x, the scattered slot gradients g and the
// row's softmax dot product: sigmoid x(1 - x)g, softmax x(g - dot), sqrt-softplus n'(x)g (§1).
HWY_INLINE VF SlotGradValue(DF d, int64_t norm_type, VF x, VF g, VF dot) {
  if (norm_type == 1) return hn::Mul(hn::Mul(x, hn::Sub(hn::Set(d, 1.0f), x)), g);
  if (norm_type == 0) return hn::Mul(x, hn::Sub(g, dot));
  return hn::Mul(SqrtSoftplusGrad(d, x), g);
}

// The slot scalars of one row: gp[k * stride] = g'_k and *dot (softmax only) from the row's
// scores xr and expert ids er; gs holds the row's grad_y in fp32 and is scaled by rsf in place;
// w is scratch for the K selected scores.
HWY_INLINE void RowScalars(const BackwardScalars& c, const float* xr, const int32_t* er,
                           int64_t N, int64_t K, float* w, float* gs, float* gp, size_t stride,
                           float* dot) {
  float sum = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t e = er[k];
    // Out-of-range device indices are skipped (never read or written out of bounds).
    w[k] = (e >= 0 && e < N) ? xr[e] : 0.0f;
    gs[k] = c.rsf * gs[k];
    sum += w[k];
  }
  if (c.renorm) {
    const float denom = c.eps + sum;
    float beta = 0.0f;
    for (int64_t k = 0; k < K; ++k) beta += (w[k] / denom) * gs[k];
    for (int64_t k = 0; k < K; ++k) gp[k * stride] = (gs[k] - beta) / denom;
  } else {
    for (int64_t k = 0; k < K; ++k) gp[k * stride] = gs[k];
  }
  float dt = 0.0f;  // softmax: sum_j s_j G_j = sum_k s_{e_k} g'_k, in slot order
  if (c.norm_type == 0) {
    for (int64_t k = 0; k < K; ++k) dt += w[k] * gp[k * stride];
  }
  *dot = dt;
}


// Two output vectors at o (2 Lanes(d) elements, any alignment). With x2 (UseBf16x2) bf16 pairs
// are narrowed by one VCVTNE2PS2BF16 and written with one 64-byte store instead of two flag
// reads, checks and conversions; a pair with a denormal lane (which the instruction flushes)
// and every other case take StoreF per vector. Same bits either way (L90, L117).
template <typename T>
HWY_INLINE void StorePair(DF d, VF v0, VF v1, T* HWY_RESTRICT o, bool x2) {
#if MOEGRAD_SIMD_AVX512
  if constexpr (std::is_same_v<T, bf16_t>) {
    __m512i r;
    if (x2 && HWY_LIKELY(Bf16x2(v0, v1, r))) {
      _mm512_storeu_si512(o, r);
      return;
    }
  }
#endif
  (void)x2;
  StoreF(d, v0, o);
  StoreF(d, v1, o + hn::Lanes(d));
}

// RowScalars for the Lanes(d) rows r0 .. r0 + Lanes of a batch at once, lane i = row r0 + i:
// gpb[k * Lanes + i] = g'_k and dotb[i] of row r0 + i. gsb holds the rows' gradients, fp32,
// row-major (K per row). K <= kBatchSlots.
HWY_INLINE void BatchScalars(DF d, const BackwardScalars& c, const float* xn, const int32_t* idx,
                             const float* gsb, int64_t r0, int64_t N, int64_t K, float* gpb,
                             float* dotb) {
  const size_t L = hn::Lanes(d);
  HWY_ALIGN float wt[kBatchSlots * kMaxFloatLanes];  // [k][lane]: the selected scores
  HWY_ALIGN float gt[kBatchSlots * kMaxFloatLanes];  // [k][lane]: the gradients
  for (size_t i = 0; i < L; ++i) {
    const int64_t r = r0 + static_cast<int64_t>(i);
    const float* xr = xn + r * N;
    const int32_t* er = idx + r * K;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = er[k];
      wt[k * L + i] = (e >= 0 && e < N) ? xr[e] : 0.0f;
      gt[k * L + i] = gsb[i * K + k];
    }
  }
  const VF rsf = hn::Set(d, c.rsf);
  VF sum = hn::Zero(d);
  for (int64_t k = 0; k < K; ++k) sum = hn::Add(sum, hn::Load(d, wt + k * L));
  if (c.renorm) {
    const VF denom = hn::Add(hn::Set(d, c.eps), sum);
    VF beta = hn::Zero(d);
    for (int64_t k = 0; k < K; ++k) {
      const VF gs = hn::Mul(rsf, hn::Load(d, gt + k * L));
      beta = hn::Add(beta, hn::Mul(hn::Div(hn::Load(d, wt + k * L), denom), gs));
    }
    for (int64_t k = 0; k < K; ++k) {
      const VF gs = hn::Mul(rsf, hn::Load(d, gt + k * L));
      hn::Store(hn::Div(hn::Sub(gs, beta), denom), d, gpb + k * L);
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      hn::Store(hn::Mul(rsf, hn::Load(d, gt + k * L)), d, gpb + k * L);
    }
  }
  VF dot = hn::Zero(d);
  if (c.norm_type == 0) {
    for (int64_t k = 0; k < K; ++k) {
      dot = hn::Add(dot, hn::Mul(hn::Load(d, wt + k * L), hn::Load(d, gpb + k * L)));
    }
  }
  hn::Store(dot, d, dotb);
}

// One row's output from its G row Gr (+0 again afterwards) and softmax dot: the vectors of
// the row, in pairs where bf16 pairs narrow in one instruction (x2), then single vectors and
// the tail. ahead: the row to prefetch alongside (the batch path), or null. kZeroG: G = +0
// throughout, Gr is not read (the selected lanes are written afterwards; reg::Rows, reg::Wide).
template <typename T, bool kZeroG = false>
HWY_INLINE void RowOut(DF d, int64_t norm_type, const float* HWY_RESTRICT xr,
                       float* HWY_RESTRICT Gr, float dot_s, T* HWY_RESTRICT o, size_t Nz,
                       bool x2, const float* ahead) {
  const size_t L = hn::Lanes(d), Nv = Nz / L * L;
  const VF dot = hn::Set(d, dot_s);
  auto value = [&](VF x, VF g) { return SlotGradValue(d, norm_type, x, g, dot); };
  // Each G vector is read once and left +0 for the next row (whole-vector stores: a loop
  // resetting only the K entries the row touched compiles to a slow vector scatter).
  auto grad_at = [&](size_t j) {
    if constexpr (kZeroG) return hn::Zero(d);
    const VF g = hn::Load(d, Gr + j);
    hn::Store(hn::Zero(d), d, Gr + j);
    return g;
  };
  size_t j = 0;
  if (x2) {
    for (; j + 2 * L <= Nz; j += 2 * L) {
      if (ahead) {
        hwy::Prefetch(ahead + j);
        hwy::Prefetch(ahead + j + L);
      }
      const VF v0 = value(hn::LoadU(d, xr + j), grad_at(j));
      const VF v1 = value(hn::LoadU(d, xr + j + L), grad_at(j + L));
      StorePair(d, v0, v1, o + j, true);
    }
  }
  for (; j < Nv; j += L) {
    if (ahead) hwy::Prefetch(ahead + j);
    StoreF(d, value(hn::LoadU(d, xr + j), grad_at(j)), o + j);
  }
  if (j < Nz) StoreFN(d, value(LoadFN(d, xr + j, Nz - j), grad_at(j)), o + j, Nz - j);
}

// Prefetches the expert ids and gradients of rows [r, r + rows) (K slots each), one line at a
// time: a batch's slot inputs, fetched while the batch before it computes.
template <typename T>
HWY_INLINE void PrefetchSlots(const int32_t* idx, const T* gy, int64_t r, int64_t rows, int64_t K) {
  const char* ni = reinterpret_cast<const char*>(idx + r * K);
  const char* ng = reinterpret_cast<const char*>(gy + r * K);
  const size_t n = static_cast<size_t>(rows * K);
  for (size_t b = 0; b < n * sizeof(int32_t); b += 64) hwy::Prefetch(ni + b);
  for (size_t b = 0; b < n * sizeof(T); b += 64) hwy::Prefetch(ng + b);
}

#if MOEGRAD_SIMD_AVX512
// AVX-512 batches without scalar passes, for K in {2, 4, 8} slots and N <= 64 experts (GPT-OSS:
// E = 32, K = 4); docs/decisions.md L110. The batch's ids, selected scores and gradients are
// built in registers in the row-major layout of expert_idx (a vector holds 16 / K rows of K
// slots): the selected scores of a row by a lane permutation of its x_norm row (VPERMT2PS:
// rows of up to 32 experts are two vectors), merged into the row's K lanes. Log2(K) rounds of
// even/odd lane concatenations then turn the K row-major vectors into one vector per slot (lane
// = row), the layout of the batch arithmetic (BatchScalars). No G row is built: each row is
// written at G = +0, then its K selected lanes are overwritten with the values BatchSlots
// computed for the slots, one lane per row (L141; building G took a compare and a masked add
// per slot and vector). The scalar gather with a bounds branch per slot and the scatter took
// about 20 and 15 % of the kernel's time at GPT-OSS shapes; every value is computed by the
// same operations in the same order, so the bits are those of the portable batch.
namespace reg {

// Slot-major from row-major: v[0..K) hold L rows of K slots (row-major); afterwards v[s] is
// slot s of the L rows.
template <size_t K, class D, class V>
HWY_INLINE void Deinterleave(D d, V* v) {
  if constexpr (K >= 2) {
    V e[K / 2], o[K / 2];
    for (size_t m = 0; m < K / 2; ++m) {
      e[m] = hn::ConcatEven(d, v[2 * m + 1], v[2 * m]);
      o[m] = hn::ConcatOdd(d, v[2 * m + 1], v[2 * m]);
    }
    Deinterleave<K / 2>(d, e);
    Deinterleave<K / 2>(d, o);
    for (size_t s = 0; s < K / 2; ++s) {
      v[2 * s] = e[s];
      v[2 * s + 1] = o[s];
    }
  }
}

// The batch arithmetic of BatchScalars, slot vectors in registers: w[k], g[k] = slot k's
// selected scores and gradients (lane = row); out gp[k] = g'_k and the softmax dot.
template <size_t K>
HWY_INLINE void SlotMath(DF d, const BackwardScalars& c, const VF* w, const VF* g, VF* gp,
                         VF& dot) {
  const VF rsf = hn::Set(d, c.rsf);
  VF sum = hn::Zero(d);
  for (size_t k = 0; k < K; ++k) sum = hn::Add(sum, w[k]);
  if (c.renorm) {
    const VF denom = hn::Add(hn::Set(d, c.eps), sum);
    VF beta = hn::Zero(d);
    for (size_t k = 0; k < K; ++k) {
      beta = hn::Add(beta, hn::Mul(hn::Div(w[k], denom), hn::Mul(rsf, g[k])));
    }
    for (size_t k = 0; k < K; ++k) gp[k] = hn::Div(hn::Sub(hn::Mul(rsf, g[k]), beta), denom);
  } else {
    for (size_t k = 0; k < K; ++k) gp[k] = hn::Mul(rsf, g[k]);
  }
  dot = hn::Zero(d);
  if (c.norm_type == 0) {
    for (size_t k = 0; k < K; ++k) dot = hn::Add(dot, hn::Mul(w[k], gp[k]));
  }
}

// A batch's row-major w, e, g (K vectors each) made slot-major, then SlotMath, then the
// outputs of the selected lanes: slot k of row (lane) i gets SlotGradValue at x = w_k with G =
// the sum, from +0 in slot order, of the g'_k' of that row's slots with k's id (D1) - the value
// the dense form computes in that lane, from the same operations in the same order. Stored as
// vt[k * 16 + lane] (narrowed to T by StoreF, the exact conversion), et[k * 16 + lane] = id,
// dots[lane] (softmax dot). Every other lane of a row is its value at G = +0 (docs/decisions.md
// L141).
template <size_t K, typename T, class VI>
HWY_INLINE void BatchSlots(DF d, const BackwardScalars& c, VF* w, VI* e, VF* g, T* vt,
                           int32_t* et, float* dots) {
  const hn::RebindToSigned<DF> di;
  const size_t L = hn::Lanes(d);
  Deinterleave<K>(d, w);
  Deinterleave<K>(di, e);
  Deinterleave<K>(d, g);
  VF gp[K], dot;
  SlotMath<K>(d, c, w, g, gp, dot);
  hn::Store(dot, d, dots);
  for (size_t k = 0; k < K; ++k) {
    VF G = hn::Zero(d);
    for (size_t s = 0; s < K; ++s) {
      G = hn::IfThenElse(hn::RebindMask(d, hn::Eq(e[s], e[k])), hn::Add(G, gp[s]), G);
    }
    StoreF(d, SlotGradValue(d, c.norm_type, w[k], G, dot), vt + k * L);
    hn::Store(e[k], di, et + k * L);
  }
}

// Row i of a batch: the selected lanes' outputs over the dense G = +0 row just written at o
// (scalar stores into lines this thread owns; nothing reads them back).
template <size_t K, typename T>
HWY_INLINE void SlotStores(const T* vt, const int32_t* et, size_t i, int64_t N, T* HWY_RESTRICT o) {
  for (size_t k = 0; k < K; ++k) {
    const int32_t ek = et[k * 16 + i];
    // Out-of-range device indices are skipped (never written out of bounds).
    if (HWY_LIKELY(static_cast<uint32_t>(ek) < static_cast<uint32_t>(N))) o[ek] = vt[k * 16 + i];
  }
}

// The x_norm row xr of n <= 16 * NV experts in NV vectors (lanes past n: +0, not read).
template <size_t NV>
HWY_INLINE void LoadRow(const float* xr, size_t n, __m512* X) {
  for (size_t v = 0; v < NV; ++v) {
    const size_t have = n > 16 * v ? std::min<size_t>(n - 16 * v, 16) : 0;
    const __mmask16 m = static_cast<__mmask16>((uint32_t{1} << have) - 1u);
    X[v] = _mm512_maskz_loadu_ps(m, xr + 16 * v);
  }
}

// Lane i: X[idx_i] for idx_i in [0, 16 * NV) (NV in {1, 2, 4}); other ids give some lane of X.
template <size_t NV>
HWY_INLINE __m512 Lookup(const __m512* X, __m512i idx) {
  if constexpr (NV == 1) {
    return _mm512_permutexvar_ps(idx, X[0]);
  } else if constexpr (NV == 2) {
    return _mm512_permutex2var_ps(X[0], idx, X[1]);
  } else {
    const __m512 lo = _mm512_permutex2var_ps(X[0], idx, X[1]);
    const __m512 hi = _mm512_permutex2var_ps(X[2], idx, X[3]);
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), lo, hi);
  }
}

template <size_t K, size_t NV, typename T, int64_t kNorm>
HWY_NOINLINE void Rows(const GatingTopKBackwardPlan& p, const BackwardScalars& c,
                       const int32_t* idx, int64_t begin, int64_t end) {
  constexpr size_t L = 16, RPV = L / K;  // rows per row-major vector
  const DF d;
  const hn::RebindToSigned<DF> di;
  using VI = hn::Vec<decltype(di)>;
  const int64_t N = p.N;
  const size_t Nz = static_cast<size_t>(N);
  constexpr int64_t norm_type = kNorm;
  const float* xn = typed<float>(p.x_norm);
  const T* gy = typed<T>(p.grad_y);
  T* gx = typed<T>(p.grad_x);
  const VI below = hn::Set(di, static_cast<int32_t>(N));
  const VI none = hn::Set(di, -1);
  const bool x2 = UseBf16x2<T>();
  HWY_ALIGN T vt[K * L];        // [k][lane]: the outputs of the batch's selected lanes
  HWY_ALIGN int32_t et[K * L];  // [k][lane]: their ids
  HWY_ALIGN float dots[L];
  HWY_ALIGN float gsb[K * L];  // grad_y of a batch, fp32, row-major
  for (int64_t r0 = begin; r0 + static_cast<int64_t>(L) <= end; r0 += static_cast<int64_t>(L)) {
    const int32_t* ib = idx + r0 * static_cast<int64_t>(K);
    if (r0 + 2 * static_cast<int64_t>(L) <= end) {  // the next batch's ids and gradients
      PrefetchSlots(idx, gy, r0 + static_cast<int64_t>(L), static_cast<int64_t>(L), K);
    }
    load_chunk(gy + r0 * static_cast<int64_t>(K), gsb, L * K);
    VI e[K];
    VF w[K], g[K];
    for (size_t m = 0; m < K; ++m) {
      e[m] = hn::LoadU(di, ib + m * L);
      g[m] = hn::Load(d, gsb + m * L);
      w[m] = hn::Zero(d);
    }
    for (size_t i = 0; i < L; ++i) {  // row r0 + i: lanes [q K, q K + K) of vector m
      const size_t m = i / RPV, q = i % RPV;
      __m512 X[NV];
      LoadRow<NV>(xn + (r0 + static_cast<int64_t>(i)) * N, Nz, X);
      const __mmask16 lanes = static_cast<__mmask16>(((uint32_t{1} << K) - 1u) << (q * K));
      w[m].raw = _mm512_mask_mov_ps(w[m].raw, lanes, Lookup<NV>(X, e[m].raw));
    }
    for (size_t m = 0; m < K; ++m) {
      // Out-of-range device indices select +0 (never read or written out of bounds).
      const auto valid = hn::And(hn::Gt(e[m], none), hn::Lt(e[m], below));
      w[m] = hn::IfThenElseZero(hn::RebindMask(d, valid), w[m]);
    }
    BatchSlots<K>(d, c, w, e, g, vt, et, dots);
    for (size_t i = 0; i < L; ++i) {
      const int64_t r = r0 + static_cast<int64_t>(i);
      const float* xr = xn + r * N;
      // The same row of the next batch: the lookups above read each row of a batch before the
      // loop here streams it out.
      const float* ahead = r + static_cast<int64_t>(L) < end ? xr + L * Nz : nullptr;
      // The row at G = +0 (norm_type a constant: RowOut is inlined), then its K lanes.
      T* o = gx + r * N;
      RowOut<T, true>(d, norm_type, xr, nullptr, dots[i], o, Nz, x2, ahead);
      SlotStores<K>(vt, et, i, N, o);
    }
  }
}

// Rows of 64 < N <= 256 experts (DeepSeek-V3: N = 256, K = 8), 16 at a time as in Rows, with
// the selected scores fetched by one masked hardware gather per row-major vector (a row does
// not fit a lane permutation); docs/decisions.md L120. The one-row form did 2K dependent scalar
// divisions and two sums of K terms in a chain per row; here they serve 16 rows. As in Rows,
// each row is written at G = +0 and its K selected lanes are then overwritten (L141; before,
// each row's G was scattered into one of two G rows and read back). Each row also prefetches
// the same row of the next batch, whose gathers come before its sequential pass (the hardware
// prefetcher does not follow them). Same operations in the same order, so the same bits.
constexpr int64_t kWideExperts = 256;

template <size_t K, typename T>
HWY_NOINLINE void Wide(const GatingTopKBackwardPlan& p, const BackwardScalars& c,
                       const int32_t* idx, int64_t begin, int64_t end) {
  constexpr size_t L = 16, RPV = L / K;  // rows per row-major vector
  constexpr int64_t Lr = static_cast<int64_t>(L);
  const DF d;
  const hn::RebindToSigned<DF> di;
  using VI = hn::Vec<decltype(di)>;
  const int64_t N = p.N;
  const size_t Nz = static_cast<size_t>(N);
  const float* xn = typed<float>(p.x_norm);
  const T* gy = typed<T>(p.grad_y);
  T* gx = typed<T>(p.grad_x);
  const VI below = hn::Set(di, static_cast<int32_t>(N));
  const VI none = hn::Set(di, -1);
  const bool x2 = UseBf16x2<T>();
  HWY_ALIGN T vt[K * L];        // [k][lane]: the outputs of the batch's selected lanes
  HWY_ALIGN int32_t et[K * L];  // [k][lane]: their ids
  HWY_ALIGN float dots[L];
  HWY_ALIGN float gsb[K * L];   // grad_y of a batch, fp32, row-major
  // Lane l of row-major vector m is a slot of batch row m RPV + l / K: that row's offset.
  HWY_ALIGN int32_t off[K * L];
  for (size_t m = 0; m < K; ++m) {
    for (size_t l = 0; l < L; ++l) off[m * L + l] = static_cast<int32_t>((m * RPV + l / K) * Nz);
  }
  for (int64_t r0 = begin; r0 + Lr <= end; r0 += Lr) {
    const int32_t* ib = idx + r0 * static_cast<int64_t>(K);
    if (r0 + 2 * Lr <= end) {  // the next batch's ids and gradients
      PrefetchSlots(idx, gy, r0 + Lr, Lr, K);
    }
    load_chunk(gy + r0 * static_cast<int64_t>(K), gsb, L * K);
    const float* xb = xn + r0 * N;
    VI e[K];
    VF w[K], g[K];
    for (size_t m = 0; m < K; ++m) {
      e[m] = hn::LoadU(di, ib + m * L);
      g[m] = hn::Load(d, gsb + m * L);
      // Out-of-range device indices select +0 (never read or written out of bounds).
      const auto valid = hn::And(hn::Gt(e[m], none), hn::Lt(e[m], below));
      const VI at = hn::Add(hn::Load(di, off + m * L), e[m]);
      w[m].raw = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid.raw, at.raw, xb, 4);
    }
    BatchSlots<K>(d, c, w, e, g, vt, et, dots);
    for (size_t i = 0; i < L; ++i) {
      const int64_t r = r0 + static_cast<int64_t>(i);
      const float* xr = xn + r * N;
      // The same row of the next batch, whose gathers come before its sequential pass.
      const float* ahead = r + Lr < end ? xr + L * Nz : nullptr;
      T* o = gx + r * N;
      RowOut<T, true>(d, c.norm_type, xr, nullptr, dots[i], o, Nz, x2, ahead);
      SlotStores<K>(vt, et, i, N, o);
    }
  }
}

template <size_t K, typename T>
HWY_INLINE bool RowsK(const GatingTopKBackwardPlan& p, const BackwardScalars& c,
                      const int32_t* idx, int64_t begin, int64_t end) {
  // Rows of up to 64 experts with the norm type as a constant: no branch per output vector
  // (0.86-0.90 of the time at GPT-OSS shapes in fp32 and fp16, in cache; docs/decisions.md
  // L122). It made no difference to the wider rows of Wide.
  auto rows = [&](auto nv) {
    constexpr size_t NV = decltype(nv)::value;
    if (c.norm_type == 0) {
      Rows<K, NV, T, 0>(p, c, idx, begin, end);
    } else if (c.norm_type == 1) {
      Rows<K, NV, T, 1>(p, c, idx, begin, end);
    } else {
      Rows<K, NV, T, 2>(p, c, idx, begin, end);
    }
  };
  if (p.N <= 16) {
    rows(std::integral_constant<size_t, 1>());
  } else if (p.N <= 32) {
    rows(std::integral_constant<size_t, 2>());
  } else if (p.N <= 64) {
    rows(std::integral_constant<size_t, 4>());
  } else if (p.N <= kWideExperts) {
    Wide<K, T>(p, c, idx, begin, end);
  } else {
    return false;
  }
  return true;
}

// The whole batches of [begin, end) when K and N fit; returns the first row not done.
template <typename T>
HWY_INLINE int64_t Batches(const GatingTopKBackwardPlan& p, const BackwardScalars& c,
                           const int32_t* idx, int64_t begin, int64_t end) {
  if (hn::Lanes(DF()) != 16 || p.N > kWideExperts) return begin;
  const int64_t stop = begin + (end - begin) / 16 * 16;
  bool done = false;
  switch (p.K) {
    case 2: done = RowsK<2, T>(p, c, idx, begin, stop); break;
    case 4: done = RowsK<4, T>(p, c, idx, begin, stop); break;
    case 8: done = RowsK<8, T>(p, c, idx, begin, stop); break;
    default: break;
  }
  return done ? stop : begin;
}

}  // namespace reg
#endif  // MOEGRAD_SIMD_AVX512

// Rows [begin, end) one at a time, software-pipelined over two G rows: the slot scalars of row
// r + 1 and their scatter into one G row come before the vector pass of row r over the other.
// The scatter's scalar stores cannot be forwarded to the wide vector loads of G; a load that
// overlaps an unretired narrow store waits for it to commit, so reading G right after the
// scatter serialised each row's vector pass behind its own scalar chain (2K divisions) and
// the previous row's pass. One row later the stores have long committed, and the scalar chain
// of one row overlaps the vector pass of the other (docs/decisions.md L119).
template <typename T>
void OneRows(const GatingTopKBackwardPlan& p, const BackwardScalars& c, const int32_t* idx,
             int64_t begin, int64_t end) {
  if (begin >= end) return;
  const DF d;
  const int64_t N = p.N, K = p.K;
  const size_t Nz = static_cast<size_t>(N), np = padded(Nz);
  const float* xn = typed<float>(p.x_norm);
  const T* gy = typed<T>(p.grad_y);
  T* gx = typed<T>(p.grad_x);
  const bool x2 = UseBf16x2<T>();
  // N <= 2048 (validated): the row scratch fits the stack, so this op needs no workspace with
  // int32 indices (C callers may pass none, as its size is then 0). Two G rows, padded with +0
  // to whole vectors; all +0 between rows.
  HWY_ALIGN float G[2 * kMaxExpertsCpu];
  std::fill(G, G + 2 * np, 0.0f);
  float w[kMaxExpertsCpu], gs[kMaxExpertsCpu], gp[kMaxExpertsCpu];
  // Row r's slot scalars, scattered into Gr (slot order, repeats summed: D1); its dot.
  auto prepare = [&](int64_t r, float* Gr) {
    load_chunk(gy + r * K, gs, static_cast<size_t>(K));
    const int32_t* er = idx + r * K;
    float dot;
    RowScalars(c, xn + r * N, er, N, K, w, gs, gp, 1, &dot);
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = er[k];
      // Out-of-range device indices are skipped (never read or written out of bounds).
      if (e >= 0 && e < N) Gr[e] += gp[k];
    }
    return dot;
  };
  float dot = prepare(begin, G);
  for (int64_t r = begin; r < end; ++r) {
    float* Gc = G + static_cast<size_t>((r - begin) & 1) * np;
    float* Gn = G + static_cast<size_t>((r - begin + 1) & 1) * np;
    const float next = r + 1 < end ? prepare(r + 1, Gn) : 0.0f;
    RowOut(d, c.norm_type, xn + r * N, Gc, dot, gx + r * N, Nz, x2, nullptr);
    dot = next;
  }
}

template <typename T>
void BackwardRows(const GatingTopKBackwardPlan& p, const int32_t* idx, int64_t begin,
                  int64_t end) {
  const DF d;
  const size_t L = hn::Lanes(d);
  const int64_t N = p.N, K = p.K;
  const size_t Nz = static_cast<size_t>(N);
  const int64_t norm_type = p.attrs.norm_type;
  const BackwardScalars c{norm_type != 0 || p.attrs.renorm == 1, norm_type,
                          static_cast<float>(p.attrs.routed_scaling_factor),
                          static_cast<float>(p.attrs.eps)};
#if MOEGRAD_SIMD_AVX512
  begin = reg::Batches<T>(p, c, idx, begin, end);
#endif
  const bool batch = K <= kBatchSlots && N <= kBatchExperts && L <= kBatchRows;
  const int64_t Lr = static_cast<int64_t>(L);
  if (batch && end - begin >= Lr) {
    const float* xn = typed<float>(p.x_norm);
    const T* gy = typed<T>(p.grad_y);
    T* gx = typed<T>(p.grad_x);
    const bool x2 = UseBf16x2<T>();
    const size_t np = padded(Nz);
    // The G rows of a batch, padded with +0 to whole vectors; all +0 between batches.
    HWY_ALIGN float G[kBatchRows * kBatchExperts];
    std::fill(G, G + L * np, 0.0f);
    HWY_ALIGN float gp[kBatchSlots * kMaxFloatLanes];  // [k][lane]: g'_k of the batch's rows
    HWY_ALIGN float dots[kMaxFloatLanes];
    HWY_ALIGN float gsb[kBatchSlots * kMaxFloatLanes];  // grad_y of a batch, fp32, row-major
    for (; end - begin >= Lr; begin += Lr) {
      const int64_t r0 = begin;
      // The next batch's indices and gradients (its x_norm rows: in the row loop below).
      if (r0 + 2 * Lr <= end) PrefetchSlots(idx, gy, r0 + Lr, Lr, K);
      load_chunk(gy + r0 * K, gsb, static_cast<size_t>(Lr * K));
      BatchScalars(d, c, xn, idx, gsb, r0, N, K, gp, dots);
      for (int64_t i = 0; i < Lr; ++i) {  // scatter-add (D1), slot order
        const int32_t* er = idx + (r0 + i) * K;
        float* Gr = G + static_cast<size_t>(i) * np;
        for (int64_t k = 0; k < K; ++k) {
          const int32_t e = er[k];
          // Out-of-range device indices are skipped (never read or written out of bounds).
          if (e >= 0 && e < N) Gr[e] += gp[static_cast<size_t>(k) * L + static_cast<size_t>(i)];
        }
      }
      for (int64_t i = 0; i < Lr; ++i) {
        const int64_t r = r0 + i;
        const float* xr = xn + r * N;
        // The same row of the next batch: the scalar pass reads a few random elements of each
        // of its rows before this loop streams them, which the hardware prefetcher does not
        // follow.
        const float* ahead = r + Lr < end ? xr + Lr * N : nullptr;
        RowOut(d, norm_type, xr, G + static_cast<size_t>(i) * np, dots[i], gx + r * N, Nz, x2,
               ahead);
      }
    }
  }
  OneRows<T>(p, c, idx, begin, end);
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
