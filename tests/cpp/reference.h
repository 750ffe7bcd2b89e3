// Plain float64 reference loops of the six operators, written from docs/operators.md and
// decisions.md only (no library code). Inputs are the values the tensors hold (already rounded
// to their dtype), row-major. Each function also returns a per-element `scale` (magnitude of
// the terms that were summed or cancelled) for the tolerance model of test_util.h.
#ifndef MOEGRAD_TESTS_CPP_REFERENCE_H_
#define MOEGRAD_TESTS_CPP_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace ref {

using Vec = std::vector<double>;
using IVec = std::vector<int32_t>;

// ---- §1.5 MoeGatingTopKBackward -------------------------------------------------------------
struct GatingBwd {
  Vec grad_x, scale;
};
inline GatingBwd gating_backward(const Vec& xn, const Vec& gy, const IVec& idx, int64_t M,
                                 int64_t N, int64_t K, double rsf, double eps) {
  GatingBwd r{Vec(M * N, 0.0), Vec(M * N, 0.0)};
  for (int64_t i = 0; i < M; ++i) {
    Vec gs(K), w(K);
    double D = eps, Dabs = std::fabs(eps);
    for (int64_t p = 0; p < K; ++p) {
      gs[p] = rsf * gy[i * K + p];
      D += xn[i * N + idx[i * K + p]];
      Dabs += std::fabs(xn[i * N + idx[i * K + p]]);
    }
    double beta = 0.0, beta_abs = 0.0;
    for (int64_t p = 0; p < K; ++p) {
      w[p] = xn[i * N + idx[i * K + p]] / D;
      beta += w[p] * gs[p];
      beta_abs += std::fabs(w[p] * gs[p]);
    }
    Vec G(N, 0.0), Gabs(N, 0.0);
    for (int64_t p = 0; p < K; ++p) {
      const int32_t e = idx[i * K + p];
      G[e] += (gs[p] - beta) / D;  // scatter-add (D1)
      Gabs[e] += (std::fabs(gs[p]) + beta_abs) / std::fabs(D);
    }
    for (int64_t j = 0; j < N; ++j) {
      const double x = xn[i * N + j];
      r.grad_x[i * N + j] = x * (1.0 - x) * G[j];
      r.scale[i * N + j] = std::fabs(x * (1.0 - x)) * Gabs[j];
    }
  }
  return r;
}

// ---- D22: the gating backward for every norm type --------------------------------------------
// xn is the forward's normalised score (softmax output, sigmoid, or n = sqrt(softplus(x))).
// Softmax: u = g (renorm 0) or its renorm backward (renorm 1), grad_j = s_j (u_j - sum_i s_i u_i).
// sqrt-softplus: grad_j = u_j (1 - exp(-n_j^2)) / (2 n_j) (0 at n = 0), u the renorm backward.
// no_renorm (D33): u = g for every norm type; sigmoid then gives s(1 - s) u.
inline GatingBwd gating_backward_any(const Vec& xn, const Vec& gy, const IVec& idx, int64_t M,
                                     int64_t N, int64_t K, double rsf, double eps,
                                     int64_t norm_type, int64_t renorm, bool no_renorm = false) {
  if (norm_type == 1 && !no_renorm) return gating_backward(xn, gy, idx, M, N, K, rsf, eps);
  const bool rn = !no_renorm && (norm_type == 2 || renorm == 1);
  GatingBwd r{Vec(M * N, 0.0), Vec(M * N, 0.0)};
  for (int64_t i = 0; i < M; ++i) {
    Vec gs(K), gp(K), gpabs(K);
    double D = eps, beta = 0.0, beta_abs = 0.0;
    for (int64_t p = 0; p < K; ++p) {
      gs[p] = rsf * gy[i * K + p];
      D += xn[i * N + idx[i * K + p]];
    }
    for (int64_t p = 0; p < K; ++p) {
      const double w = xn[i * N + idx[i * K + p]] / D;
      beta += w * gs[p];
      beta_abs += std::fabs(w * gs[p]);
    }
    for (int64_t p = 0; p < K; ++p) {
      gp[p] = rn ? (gs[p] - beta) / D : gs[p];
      gpabs[p] = rn ? (std::fabs(gs[p]) + beta_abs) / std::fabs(D) : std::fabs(gs[p]);
    }
    Vec G(N, 0.0), Gabs(N, 0.0);
    for (int64_t p = 0; p < K; ++p) {
      G[idx[i * K + p]] += gp[p];
      Gabs[idx[i * K + p]] += gpabs[p];
    }
    double dot = 0.0, dot_abs = 0.0;
    for (int64_t j = 0; j < N; ++j) {
      dot += xn[i * N + j] * G[j];
      dot_abs += std::fabs(xn[i * N + j]) * Gabs[j];
    }
    for (int64_t j = 0; j < N; ++j) {
      const double x = xn[i * N + j];
      if (norm_type == 0) {
        r.grad_x[i * N + j] = x * (G[j] - dot);
        r.scale[i * N + j] = std::fabs(x) * (Gabs[j] + dot_abs);
      } else if (norm_type == 1) {
        r.grad_x[i * N + j] = x * (1.0 - x) * G[j];
        r.scale[i * N + j] = std::fabs(x * (1.0 - x)) * Gabs[j];
      } else {
        const double dn = x == 0.0 ? 0.0 : -std::expm1(-x * x) / (2.0 * x);
        r.grad_x[i * N + j] = dn * G[j];
        r.scale[i * N + j] = std::fabs(dn) * Gabs[j];
      }
    }
  }
  return r;
}

// ---- §2.4 MoeGatingTopK (decisions D13, L1, L2) --------------------------------------------
struct GatingFwdAttrs {
  int64_t k = 1, k_group = 1, group_count = 1, group_select_mode = 0, renorm = 0, norm_type = 0;
  bool out_flag = false;
  double rsf = 1.0, eps = 1e-20;
  bool no_renorm = false;  // D33: never renormalise
};
struct GatingFwd {
  Vec y, norm_out, score;  // score: the ranking scores (norm + bias), for the tie-gap check
  IVec idx;
  double min_gap = 0;  // smallest relative gap between distinct ranking values (scores, group scores)
};
inline double normalise(double x, int64_t norm_type) {
  if (norm_type == 1) return 1.0 / (1.0 + std::exp(-x));
  const double sp = std::max(x, 0.0) + std::log1p(std::exp(-std::fabs(x)));
  return std::sqrt(sp);
}
// Smallest relative gap between two distinct values (exactly equal values are true ties, which
// the stable order resolves the same way in fp32 and in float64).
inline double min_gap_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  double g = std::numeric_limits<double>::infinity();
  for (size_t i = 1; i < v.size(); ++i) {
    if (!std::isfinite(v[i]) || !std::isfinite(v[i - 1]) || v[i] == v[i - 1]) continue;
    const double m = std::max(std::fabs(v[i]), std::fabs(v[i - 1]));
    g = std::min(g, (v[i] - v[i - 1]) / m);
  }
  return g;
}
inline GatingFwd gating_forward(const Vec& x, const Vec* bias, int64_t M, int64_t N,
                                const GatingFwdAttrs& a) {
  GatingFwd r;
  r.y.assign(M * a.k, 0.0);
  r.idx.assign(M * a.k, 0);
  r.norm_out.assign(M * N, 0.0);
  r.score.assign(M * N, 0.0);
  r.min_gap = std::numeric_limits<double>::infinity();
  const int64_t G = a.group_count, gs = N / G;
  for (int64_t i = 0; i < M; ++i) {
    Vec norm(N), score(N);
    if (a.norm_type == 0) {
      double m = -std::numeric_limits<double>::infinity(), s = 0;
      for (int64_t j = 0; j < N; ++j) m = std::max(m, x[i * N + j]);
      for (int64_t j = 0; j < N; ++j) s += std::exp(x[i * N + j] - m);
      for (int64_t j = 0; j < N; ++j) norm[j] = std::exp(x[i * N + j] - m) / s;
    } else {
      for (int64_t j = 0; j < N; ++j) norm[j] = normalise(x[i * N + j], a.norm_type);
    }
    for (int64_t j = 0; j < N; ++j) score[j] = norm[j] + (bias ? (*bias)[j] : 0.0);
    r.min_gap = std::min(r.min_gap, min_gap_of(score));
    if (G > 1 && a.k_group < G) {
      Vec gscore(G);
      for (int64_t g = 0; g < G; ++g) {
        Vec s(score.begin() + g * gs, score.begin() + (g + 1) * gs);
        std::sort(s.begin(), s.end(), std::greater<double>());
        gscore[g] = a.group_select_mode == 0 ? s[0] : s[0] + s[1];
      }
      r.min_gap = std::min(r.min_gap, min_gap_of(gscore));
      std::vector<int64_t> order(G);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t p, int64_t q) { return gscore[p] > gscore[q]; });
      for (int64_t o = a.k_group; o < G; ++o) {
        for (int64_t j = 0; j < gs; ++j) score[order[o] * gs + j] = -std::numeric_limits<double>::infinity();
      }
    }
    std::vector<int32_t> order(N);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t p, int32_t q) { return score[p] > score[q]; });
    double sum = 0;
    for (int64_t p = 0; p < a.k; ++p) sum += norm[order[p]];
    const bool renorm = !a.no_renorm && (a.norm_type != 0 || a.renorm == 1);
    for (int64_t p = 0; p < a.k; ++p) {
      const double g = norm[order[p]];
      r.y[i * a.k + p] = (renorm ? g / (sum + a.eps) : g) * a.rsf;
      r.idx[i * a.k + p] = order[p];
    }
    for (int64_t j = 0; j < N; ++j) {
      r.norm_out[i * N + j] = a.out_flag ? norm[j] : 0.0;
      r.score[i * N + j] = score[j];
    }
  }
  return r;
}

// ---- D34 MoeGatingReplay: the forward's weights at given ids --------------------------------
struct GatingReplay {
  Vec y, norm_out;
};
inline GatingReplay gating_replay(const Vec& x, const IVec& idx, int64_t M, int64_t N, int64_t K,
                                  int64_t norm_type, int64_t renorm, bool no_renorm, double rsf,
                                  double eps) {
  GatingReplay r{Vec(M * K, 0.0), Vec(M * N, 0.0)};
  const bool rn = !no_renorm && (norm_type != 0 || renorm == 1);
  for (int64_t i = 0; i < M; ++i) {
    Vec norm(N);
    if (norm_type == 0) {
      double m = -std::numeric_limits<double>::infinity(), s = 0;
      for (int64_t j = 0; j < N; ++j) m = std::max(m, x[i * N + j]);
      for (int64_t j = 0; j < N; ++j) s += std::exp(x[i * N + j] - m);
      for (int64_t j = 0; j < N; ++j) norm[j] = std::exp(x[i * N + j] - m) / s;
    } else {
      for (int64_t j = 0; j < N; ++j) norm[j] = normalise(x[i * N + j], norm_type);
    }
    double sum = 0;
    for (int64_t p = 0; p < K; ++p) sum += norm[idx[i * K + p]];
    for (int64_t p = 0; p < K; ++p) {
      const double g = norm[idx[i * K + p]];
      r.y[i * K + p] = (rn ? g / (sum + eps) : g) * rsf;
    }
    for (int64_t j = 0; j < N; ++j) r.norm_out[i * N + j] = norm[j];
  }
  return r;
}

// ---- §4.5 MoeFinalizeRoutingV2 (D7, D8, L5) ------------------------------------------------
// ex: rows x H (the (E,C,H) layout viewed as (E*C, H)); optional tensors may be null.
struct FinalizeFwd {
  Vec out, scale;
};
inline FinalizeFwd finalize_forward(const Vec& ex, int64_t rows, const IVec& idx, const Vec* x1,
                                    const Vec* x2, const Vec* bias, const Vec* scales,
                                    const IVec* eidx, int64_t mode, int64_t R, int64_t K,
                                    int64_t H) {
  FinalizeFwd f{Vec(R * H, 0.0), Vec(R * H, 0.0)};
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < H; ++j) {
      double acc = 0, mag = 0;
      if (x1) { acc += (*x1)[r * H + j]; mag += std::fabs((*x1)[r * H + j]); }
      if (x2) { acc += (*x2)[r * H + j]; mag += std::fabs((*x2)[r * H + j]); }
      for (int64_t k = 0; k < K; ++k) {
        const int64_t flat = mode >= 2 ? r * K + k : k * R + r;
        const int32_t d = idx[flat];
        const double s = scales ? (*scales)[r * K + k] : 1.0;
        double term = 0;
        if (d >= 0 && d < rows) term += ex[d * H + j];
        if (bias) term += (*bias)[(*eidx)[r * K + k] * H + j];
        acc += s * term;
        mag += std::fabs(s) * ((d >= 0 && d < rows ? std::fabs(ex[d * H + j]) : 0.0) +
                               (bias ? std::fabs((*bias)[(*eidx)[r * K + k] * H + j]) : 0.0));
      }
      f.out[r * H + j] = acc;
      f.scale[r * H + j] = mag;
    }
  }
  return f;
}

// ---- §3.5 MoeFinalizeRoutingV2Grad (D5, D7) ------------------------------------------------
// Row layout (r*K + k). rows = number of rows of grad_expanded_x (viewed 2-D).
struct FinalizeGrad {
  Vec grad_ex, grad_scales, scales_scale;
};
inline FinalizeGrad finalize_grad(const Vec& gy, const IVec& idx, const Vec* ex,
                                  const Vec* scales, const IVec* eidx, const Vec* bias,
                                  int64_t R, int64_t K, int64_t H, int64_t rows) {
  FinalizeGrad g{Vec(rows * H, 0.0), Vec(R * K, 0.0), Vec(R * K, 0.0)};
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = r * K + k;
      const int32_t d = idx[i];
      const bool valid = d >= 0 && d < rows;
      const double s = scales ? (*scales)[i] : 1.0;
      if (valid) {
        for (int64_t j = 0; j < H; ++j) g.grad_ex[d * H + j] = gy[r * H + j] * s;
      }
      if (!scales) continue;
      double dot = 0, mag = 0;
      for (int64_t j = 0; j < H; ++j) {
        double v = 0;
        if (valid) v += (*ex)[d * H + j];
        if (bias) v += (*bias)[(*eidx)[i] * H + j];
        dot += v * gy[r * H + j];
        mag += std::fabs(v * gy[r * H + j]);
      }
      g.grad_scales[i] = dot;
      g.scales_scale[i] = mag;
    }
  }
  return g;
}

// ---- §5.5 SwigluGroupQuantGrad and the SwigluGroup forward (D10, D11, L8) -------------------
inline int64_t swiglu_trunc(const std::vector<int64_t>* group_index, int64_t T) {
  if (!group_index) return T;
  int64_t s = 0;
  for (int64_t v : *group_index) s += v;
  return std::min<int64_t>(std::max<int64_t>(s, 0), T);
}
inline double sigmoid(double a) { return 1.0 / (1.0 + std::exp(-a)); }

struct SwigluGrad {
  Vec grad_x, grad_x_scale, grad_weight, grad_weight_scale;
};
inline SwigluGrad swiglu_grad(const Vec& gy, const Vec& x, const Vec* w, const Vec* yo,
                              const std::vector<int64_t>* gi, double c, int64_t T, int64_t H) {
  SwigluGrad r{Vec(T * 2 * H, 0.0), Vec(T * 2 * H, 0.0), Vec(w ? T : 0, 0.0), Vec(w ? T : 0, 0.0)};
  const int64_t trunc = swiglu_trunc(gi, T);
  const bool clamp = c > 0;
  for (int64_t t = 0; t < trunc; ++t) {
    const double wt = w ? (*w)[t] : 1.0;
    for (int64_t h = 0; h < H; ++h) {
      const double x0 = x[t * 2 * H + h], x1 = x[t * 2 * H + H + h];
      const double a = clamp ? std::min(x0, c) : x0;
      const double b = clamp ? std::min(std::max(x1, -c), c) : x1;
      const double gy0 = gy[t * H + h] * wt;
      const double s = sigmoid(a);
      const double silu = a * s;
      const double dsilu = s * (1.0 + a * (1.0 - s));
      double g0 = gy0 * b * dsilu, g1 = gy0 * silu;
      const double g0_mag = std::fabs(gy0 * b) * s * (1.0 + std::fabs(a) * (1.0 - s));
      if (clamp) {
        if (!(x0 < c)) g0 = 0.0;
        if (!(x1 > -c && x1 < c)) g1 = 0.0;
      }
      r.grad_x[t * 2 * H + h] = g0;
      r.grad_x[t * 2 * H + H + h] = g1;
      r.grad_x_scale[t * 2 * H + h] = g0 == 0.0 ? 0.0 : g0_mag;
      r.grad_x_scale[t * 2 * H + H + h] = std::fabs(g1);
    }
    if (w) {
      double dot = 0, mag = 0;
      for (int64_t h = 0; h < H; ++h) {
        dot += gy[t * H + h] * (*yo)[t * H + h];
        mag += std::fabs(gy[t * H + h] * (*yo)[t * H + h]);
      }
      r.grad_weight[t] = dot;
      r.grad_weight_scale[t] = mag;
    }
  }
  return r;
}

inline Vec swiglu_forward(const Vec& x, const Vec* w, const std::vector<int64_t>* gi, double c,
                          int64_t T, int64_t H) {
  Vec y(T * H, 0.0);
  const int64_t trunc = swiglu_trunc(gi, T);
  for (int64_t t = 0; t < trunc; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      double a = x[t * 2 * H + h], b = x[t * 2 * H + H + h];
      if (c > 0) {
        a = std::min(a, c);
        b = std::min(std::max(b, -c), c);
      }
      y[t * H + h] = a * sigmoid(a) * b * (w ? (*w)[t] : 1.0);
    }
  }
  return y;
}

}  // namespace ref

#endif  // MOEGRAD_TESTS_CPP_REFERENCE_H_
