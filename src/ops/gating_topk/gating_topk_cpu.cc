// CPU kernels of the gating top-k forward (§2.4) and backward (§1.5). One token row per
// iteration, fp32 math, per-thread scratch rows; rows are independent, so any thread count gives
// the same bits (D16).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "core/dtype.h"
#include "core/math.h"
#include "core/parallel.h"
#include "ops/gating_topk/gating_topk.h"

namespace moegrad {

namespace {

// Strict total order for ranking (L2): larger first, NaN above all numbers, ties to lower index.
struct RankBefore {
  const float* score;
  bool operator()(int32_t a, int32_t b) const {
    const float sa = score[a], sb = score[b];
    const bool na = std::isnan(sa), nb = std::isnan(sb);
    if (na || nb) return na != nb ? na : a < b;
    if (sa != sb) return sa > sb;
    return a < b;
  }
};

template <typename T>
void normalise_row(const T* x, int64_t n, int64_t norm_type, float* out) {
  if (norm_type == 0) {
    float m = -std::numeric_limits<float>::infinity();
    bool has_nan = false;
    for (int64_t j = 0; j < n; ++j) {
      const float v = to_f32(x[j]);
      has_nan |= std::isnan(v);
      m = v > m ? v : m;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      out[j] = std::exp(to_f32(x[j]) - m);
      sum += out[j];
    }
    if (has_nan) sum = std::numeric_limits<float>::quiet_NaN();
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; ++j) out[j] *= inv;
  } else if (norm_type == 1) {
    for (int64_t j = 0; j < n; ++j) out[j] = stable_sigmoid(to_f32(x[j]));
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = std::sqrt(stable_softplus(to_f32(x[j])));
  }
}

template <typename T>
void gating_rows(const GatingTopKPlan& p, int64_t begin, int64_t end) {
  const GatingTopKAttrs& a = p.attrs;
  const int64_t N = p.N, K = a.k, G = a.group_count, gsize = N / G;
  std::vector<float> norm(N), score(N), gscore(G);
  std::vector<int32_t> order(N), gorder(G);
  const T* x = typed<T>(p.x);
  const T* bias = p.has_bias ? typed<T>(p.bias) : nullptr;
  T* y = typed<T>(p.y);
  int32_t* idx = typed<int32_t>(p.expert_idx);
  float* norm_out = typed<float>(p.norm_out);
  const float rsf = static_cast<float>(a.routed_scaling_factor);
  const float eps = static_cast<float>(a.eps);
  const bool renorm = a.norm_type != 0 || a.renorm == 1;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  for (int64_t r = begin; r < end; ++r) {
    normalise_row(x + r * N, N, a.norm_type, norm.data());
    if (bias) {
      for (int64_t j = 0; j < N; ++j) score[j] = norm[j] + to_f32(bias[j]);
    } else {
      std::copy(norm.begin(), norm.end(), score.begin());
    }
    if (p.grouped) {
      for (int64_t g = 0; g < G; ++g) {
        const float* s = score.data() + g * gsize;
        if (a.group_select_mode == 0) {
          int32_t best = 0;
          for (int32_t j = 1; j < gsize; ++j) best = RankBefore{s}(j, best) ? j : best;
          gscore[g] = s[best];
        } else {
          int32_t b0 = 0, b1 = 1;
          if (RankBefore{s}(b1, b0)) std::swap(b0, b1);
          for (int32_t j = 2; j < gsize; ++j) {
            if (RankBefore{s}(j, b0)) {
              b1 = b0;
              b0 = j;
            } else if (RankBefore{s}(j, b1)) {
              b1 = j;
            }
          }
          gscore[g] = s[b0] + s[b1];
        }
        gorder[g] = static_cast<int32_t>(g);
      }
      std::partial_sort(gorder.begin(), gorder.begin() + a.k_group, gorder.end(),
                        RankBefore{gscore.data()});
      for (int64_t i = a.k_group; i < G; ++i) {
        std::fill_n(score.data() + gorder[i] * gsize, gsize, neg_inf);
      }
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(), RankBefore{score.data()});

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
      std::memcpy(nrow, norm.data(), sizeof(float) * N);
    } else {
      std::memset(nrow, 0, sizeof(float) * N);
    }
  }
}

template <typename T>
void gating_backward_rows(const GatingTopKBackwardPlan& p, int64_t begin, int64_t end) {
  const int64_t N = p.N, K = p.K;
  const float rsf = static_cast<float>(p.attrs.routed_scaling_factor);
  const float eps = static_cast<float>(p.attrs.eps);
  const float* xn = typed<float>(p.x_norm);
  const T* gy = typed<T>(p.grad_y);
  const int32_t* idx = typed<int32_t>(p.expert_idx);
  T* gx = typed<T>(p.grad_x);
  std::vector<float> G(N), gs(K), w(K);

  for (int64_t r = begin; r < end; ++r) {
    const float* xr = xn + r * N;
    const int32_t* er = idx + r * K;
    std::fill(G.begin(), G.end(), 0.0f);
    float sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = er[k];
      // Out-of-range device indices are skipped (never read or written out of bounds).
      w[k] = (e >= 0 && e < N) ? xr[e] : 0.0f;
      gs[k] = rsf * to_f32(gy[r * K + k]);
      sum += w[k];
    }
    const float denom = eps + sum;
    float beta = 0.0f;
    for (int64_t k = 0; k < K; ++k) beta += (w[k] / denom) * gs[k];
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = er[k];
      if (e >= 0 && e < N) G[e] += (gs[k] - beta) / denom;  // scatter-add (D1)
    }
    T* out = gx + r * N;
    for (int64_t j = 0; j < N; ++j) out[j] = from_f32<T>(xr[j] * (1.0f - xr[j]) * G[j]);
  }
}

// Rows per chunk: enough work per thread to amortise the fork.
int64_t grain_for(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

}  // namespace

void gating_top_k_cpu(const GatingTopKPlan& p) {
  dispatch_float(p.x.dtype, "x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    parallel_for(p.M, grain_for(p.N), [&](int64_t b, int64_t e) { gating_rows<T>(p, b, e); });
  });
}

void gating_top_k_backward_cpu(const GatingTopKBackwardPlan& p) {
  dispatch_float(p.grad_y.dtype, "grad_y", [&](auto tag) {
    using T = typename decltype(tag)::type;
    parallel_for(p.M, grain_for(p.N),
                 [&](int64_t b, int64_t e) { gating_backward_rows<T>(p, b, e); });
  });
}

}  // namespace moegrad
