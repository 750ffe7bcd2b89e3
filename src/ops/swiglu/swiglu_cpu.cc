// CPU kernels of SwiGLU forward (§6.4 without quantisation) and backward (§5.5). Contiguous
// row loops, fp32 math, rows past the group_index total zero-filled.
#include <algorithm>
#include <cstring>

#include "core/dtype.h"
#include "core/math.h"
#include "core/parallel.h"
#include "ops/swiglu/swiglu.h"

namespace moegrad {

namespace {

int64_t grain_rows(int64_t H) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(1, H)); }

// Clamp of §5.5 step 2; NaN passes through.
inline float clamp_gate(float v, float c) { return v > c ? c : v; }
inline float clamp_up(float v, float c) { return v > c ? c : (v < -c ? -c : v); }

template <typename T>
void swiglu_rows(const SwigluPlan& p, int64_t active, int64_t begin, int64_t end) {
  const int64_t H = p.H;
  const T* x = typed<T>(p.x);
  const float* w = p.has_weight ? typed<float>(p.weight) : nullptr;
  T* y = typed<T>(p.y);
  const float c = p.clamp;
  const bool clamp = c > 0.0f;
  for (int64_t t = begin; t < end; ++t) {
    T* yr = y + t * H;
    if (t >= active) {
      std::memset(static_cast<void*>(yr), 0, sizeof(T) * H);
      continue;
    }
    const T* x0 = x + t * 2 * H;
    const T* x1 = x0 + H;
    const float wt = w ? w[t] : 1.0f;
    for (int64_t h = 0; h < H; ++h) {
      float a = to_f32(x0[h]), b = to_f32(x1[h]);
      if (clamp) {
        a = clamp_gate(a, c);
        b = clamp_up(b, c);
      }
      yr[h] = from_f32<T>(a * stable_sigmoid(a) * b * wt);
    }
  }
}

template <typename T>
void swiglu_grad_rows(const SwigluGradPlan& p, int64_t active, int64_t begin, int64_t end) {
  const int64_t H = p.H;
  const T* gy = typed<T>(p.grad_y);
  const T* x = typed<T>(p.x);
  const float* w = p.has_weight ? typed<float>(p.weight) : nullptr;
  const T* yo = p.has_grad_weight ? typed<T>(p.y_origin) : nullptr;
  T* gx = typed<T>(p.grad_x);
  float* gw = p.has_grad_weight ? typed<float>(p.grad_weight) : nullptr;
  const float c = p.clamp;
  const bool clamp = c > 0.0f;
  for (int64_t t = begin; t < end; ++t) {
    T* g0 = gx + t * 2 * H;
    T* g1 = g0 + H;
    if (t >= active) {
      std::memset(static_cast<void*>(g0), 0, sizeof(T) * 2 * H);
      if (gw) gw[t] = 0.0f;
      continue;
    }
    const T* x0 = x + t * 2 * H;
    const T* x1 = x0 + H;
    const T* gyr = gy + t * H;
    const float wt = w ? w[t] : 1.0f;
    for (int64_t h = 0; h < H; ++h) {
      const float a0 = to_f32(x0[h]), b0 = to_f32(x1[h]);
      float a = a0, b = b0;
      if (clamp) {
        a = clamp_gate(a, c);
        b = clamp_up(b, c);
      }
      const float gyw = to_f32(gyr[h]) * wt;
      const float s = stable_sigmoid(a);
      const float silu = a * s;
      const float dsilu = s * (1.0f + a * (1.0f - s));
      float ga = gyw * b * dsilu;
      float gb = gyw * silu;
      if (clamp) {
        // Masks on the unclamped inputs, strict inequalities (§5.5 step 6, D11).
        ga = a0 < c ? ga : 0.0f;
        gb = (b0 > -c && b0 < c) ? gb : 0.0f;
      }
      g0[h] = from_f32<T>(ga);
      g1[h] = from_f32<T>(gb);
    }
    if (gw) {
      const T* yr = yo + t * H;
      gw[t] = blocked_dot(H, [&](int64_t h) { return to_f32(gyr[h]); },
                          [&](int64_t h) { return to_f32(yr[h]); });
    }
  }
}

}  // namespace

void swiglu_cpu(const SwigluPlan& p) {
  const int64_t active = swiglu_active_rows(&p.group_index, p.has_group_index, p.T);
  dispatch_float(p.x.dtype, "x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    parallel_for(p.T, grain_rows(p.H),
                 [&](int64_t b, int64_t e) { swiglu_rows<T>(p, active, b, e); });
  });
}

void swiglu_grad_cpu(const SwigluGradPlan& p) {
  const int64_t active = swiglu_active_rows(&p.group_index, p.has_group_index, p.T);
  dispatch_float(p.x.dtype, "x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    parallel_for(p.T, grain_rows(p.H),
                 [&](int64_t b, int64_t e) { swiglu_grad_rows<T>(p, active, b, e); });
  });
}

}  // namespace moegrad
