// CPU kernels of SwiGLU forward (§6.4 without quantisation) and backward (§5.5), compiled once
// per SIMD target (Highway) and dispatched at run time. Rows split across threads; each row in
// chunks widened to fp32 in L1 scratch; rows past the group_index total are zero-filled. The
// scratch is a fixed 32 KB (forward) / 48 KB (backward) per thread, so it lives on the stack and
// the ops need no workspace (C callers may pass none, as its size is then 0).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/swiglu/swiglu_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cstring>

#include "core/dtype.h"
#include "core/host.h"
#include "core/parallel.h"
#include "core/simd-inl.h"
#include "hwy/highway.h"
#include "ops/swiglu/swiglu-inl.h"
#include "ops/swiglu/swiglu.h"

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {
namespace {

// grad_weight = sum of grad_y(h) * y_origin(h) in a fixed order: 8 partial sums (element h to
// partial sum h mod 8, added in column order), then a fixed tree; the bits do not depend on
// the thread count (D16). Whole 8-element groups are widened in registers (8-lane vectors, or
// 2 x 4 / 8 x 1 lanes on narrower targets, with the same per-partial-sum order). Each step is
// one fused multiply-add where the target has FMA (AVX2, AVX-512), for every dtype
// (docs/decisions.md L95).
template <typename T>
HWY_INLINE float GradWeightDot(int64_t n, const T* HWY_RESTRICT a, const T* HWY_RESTRICT b) {
  constexpr int kLanes = 8;
  HWY_ALIGN float acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  if constexpr (InRegister<T>::value) {
    const hn::CappedTag<float, kLanes> d8;
    constexpr size_t kMax = hn::MaxLanes(hn::CappedTag<float, kLanes>());
    constexpr int kVecs = kLanes / static_cast<int>(kMax);
    const size_t n8 = hn::Lanes(d8);
    if (n8 == kMax) {
      hn::Vec<decltype(d8)> v[kVecs];
      for (int k = 0; k < kVecs; ++k) v[k] = hn::Zero(d8);
      for (; i + kLanes <= n; i += kLanes) {
        for (int k = 0; k < kVecs; ++k) {
          v[k] = hn::MulAdd(LoadF8(d8, a + i + k * kMax), LoadF8(d8, b + i + k * kMax), v[k]);
        }
      }
      for (int k = 0; k < kVecs; ++k) hn::Store(v[k], d8, acc + k * kMax);
    }
  }
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += to_f32(a[i + l]) * to_f32(b[i + l]);
  }
  for (int l = 0; i < n; ++i, ++l) acc[l] += to_f32(a[i]) * to_f32(b[i]);
  const float s01 = acc[0] + acc[1], s23 = acc[2] + acc[3];
  const float s45 = acc[4] + acc[5], s67 = acc[6] + acc[7];
  return (s01 + s23) + (s45 + s67);
}

template <typename T, bool kClamp>
void ForwardRows(const SwigluPlan& p, int64_t active, float* buf, int64_t begin, int64_t end) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const int64_t H = p.H;
  const T* x = typed<T>(p.x);
  const float* w = p.has_weight ? typed<float>(p.weight) : nullptr;
  T* y = typed<T>(p.y);
  const SwigluClamp<kClamp> clamp(d, p.clamp);
  const bool stream = stream_output(p.T * H * static_cast<int64_t>(sizeof(T)));
  std::fill(buf, buf + 4 * kChunk, 0.0f);
  float* a = buf;
  float* b = a + kChunk;
  float* o = b + kChunk;
  T* stage = reinterpret_cast<T*>(o + kChunk);
  for (int64_t t = begin; t < end; ++t) {
    T* yr = y + t * H;
    if (t >= active) {
      std::memset(static_cast<void*>(yr), 0, sizeof(T) * H);
      continue;
    }
    const VF vw = hn::Set(d, w ? w[t] : 1.0f);
    const T* x0 = x + t * 2 * H;
    const T* x1 = x0 + H;
    auto f = [&](VF va, VF vb) {
      va = clamp.gate(va);
      vb = clamp.up(vb);
      return hn::Mul(hn::Mul(hn::Mul(va, Sigmoid(d, va)), vb), vw);
    };
    int64_t h0 = 0;
    if constexpr (InRegister<T>::value) {
      // Whole vectors straight from and to memory (non-temporal stores where the row is
      // aligned); the tail goes through the chunk path.
      if (stream && StreamAligned(yr)) {
        for (; h0 + static_cast<int64_t>(N) <= H; h0 += N) {
          StreamF(d, f(LoadF(d, x0 + h0), LoadF(d, x1 + h0)), yr + h0);
        }
      } else {
        for (; h0 + static_cast<int64_t>(N) <= H; h0 += N) {
          StoreF(d, f(LoadF(d, x0 + h0), LoadF(d, x1 + h0)), yr + h0);
        }
      }
    }
    for (; h0 < H; h0 += kChunk) {
      const size_t n = static_cast<size_t>(std::min<int64_t>(kChunk, H - h0));
      load_chunk(x0 + h0, a, n);
      load_chunk(x1 + h0, b, n);
      for (size_t i = 0; i < padded(n); i += N) {
        hn::Store(f(hn::Load(d, a + i), hn::Load(d, b + i)), d, o + i);
      }
      if (stream) {
        stream_chunk(o, yr + h0, n, stage);
      } else {
        store_chunk(o, yr + h0, n);
      }
    }
  }
  hwy::FlushStream();
}

template <typename T, bool kClamp>
void BackwardRows(const SwigluGradPlan& p, int64_t active, float* buf, int64_t begin,
                  int64_t end) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const int64_t H = p.H;
  const T* gy = typed<T>(p.grad_y);
  const T* x = typed<T>(p.x);
  const float* w = p.has_weight ? typed<float>(p.weight) : nullptr;
  const bool want_gw = p.wants_grad_weight();
  const T* yo = want_gw ? typed<T>(p.y_origin) : nullptr;
  T* gx = typed<T>(p.grad_x);
  float* gw = want_gw ? typed<float>(p.grad_weight) : nullptr;
  const SwigluClamp<kClamp> clamp(d, p.clamp);
  const VF one = hn::Set(d, 1.0f);
  const bool stream = stream_output(p.T * 2 * H * static_cast<int64_t>(sizeof(T)));
  std::fill(buf, buf + 6 * kChunk, 0.0f);
  float* a = buf;
  float* b = a + kChunk;
  float* g = b + kChunk;
  float* ga = g + kChunk;
  float* gb = ga + kChunk;
  T* stage = reinterpret_cast<T*>(gb + kChunk);
  for (int64_t t = begin; t < end; ++t) {
    T* g0 = gx + t * 2 * H;
    if (t >= active) {
      std::memset(static_cast<void*>(g0), 0, sizeof(T) * 2 * H);
      if (gw) gw[t] = 0.0f;
      continue;
    }
    const T* gyr = gy + t * H;
    const T* x0 = x + t * 2 * H;
    const T* x1 = x0 + H;
    const VF vw = hn::Set(d, w ? w[t] : 1.0f);
    // (ga, gb) of §5.5 steps 2-6 for one vector of gate a0, up b0 and upstream gradient g.
    auto f = [&](VF a0, VF b0, VF g, VF& vga, VF& vgb) {
      const VF va = clamp.gate(a0), vb = clamp.up(b0);
      const VF gyw = hn::Mul(g, vw);
      const VF s = Sigmoid(d, va);
      const VF silu = hn::Mul(va, s);
      const VF dsilu = hn::Mul(s, hn::Add(one, hn::Mul(va, hn::Sub(one, s))));
      vga = hn::Mul(hn::Mul(gyw, vb), dsilu);
      vgb = hn::Mul(gyw, silu);
      if constexpr (kClamp) {
        // Masks on the unclamped inputs, strict inequalities (§5.5 step 6, D11).
        vga = hn::IfThenElseZero(hn::Lt(a0, clamp.c), vga);
        vgb = hn::IfThenElseZero(hn::And(hn::Gt(b0, clamp.nc), hn::Lt(b0, clamp.c)), vgb);
      }
    };
    int64_t h0 = 0;
    if constexpr (InRegister<T>::value) {
      // Whole vectors straight from and to memory (non-temporal stores where both halves of
      // the grad_x row are aligned); the tail goes through the chunk path.
      if (stream && StreamAligned(g0) && StreamAligned(g0 + H)) {
        for (; h0 + static_cast<int64_t>(N) <= H; h0 += N) {
          VF vga, vgb;
          f(LoadF(d, x0 + h0), LoadF(d, x1 + h0), LoadF(d, gyr + h0), vga, vgb);
          StreamF(d, vga, g0 + h0);
          StreamF(d, vgb, g0 + H + h0);
        }
      } else {
        for (; h0 + static_cast<int64_t>(N) <= H; h0 += N) {
          VF vga, vgb;
          f(LoadF(d, x0 + h0), LoadF(d, x1 + h0), LoadF(d, gyr + h0), vga, vgb);
          StoreF(d, vga, g0 + h0);
          StoreF(d, vgb, g0 + H + h0);
        }
      }
    }
    for (; h0 < H; h0 += kChunk) {
      const size_t n = static_cast<size_t>(std::min<int64_t>(kChunk, H - h0));
      load_chunk(x0 + h0, a, n);
      load_chunk(x1 + h0, b, n);
      load_chunk(gyr + h0, g, n);
      for (size_t i = 0; i < padded(n); i += N) {
        VF vga, vgb;
        f(hn::Load(d, a + i), hn::Load(d, b + i), hn::Load(d, g + i), vga, vgb);
        hn::Store(vga, d, ga + i);
        hn::Store(vgb, d, gb + i);
      }
      if (stream) {
        stream_chunk(ga, g0 + h0, n, stage);
        stream_chunk(gb, g0 + H + h0, n, stage);
      } else {
        store_chunk(ga, g0 + h0, n);
        store_chunk(gb, g0 + H + h0, n);
      }
    }
    if (gw) {
      const T* yr = yo + t * H;
      gw[t] = GradWeightDot(H, gyr, yr);
    }
  }
  hwy::FlushStream();
}

}  // namespace

void SwigluForward(const SwigluPlan& p) {
  const int64_t active = swiglu_active_rows(&p.group_index, p.has_group_index, p.T);
  dispatch_float(p.x.dtype, "x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    parallel_rows(p.T, p.threads, [&](int, int64_t b, int64_t e) {
      HWY_ALIGN float buf[4 * kChunk];
      WithClamp(p.clamp, [&](auto on) { ForwardRows<T, decltype(on)::value>(p, active, buf, b, e); });
    });
  });
}

void SwigluBackward(const SwigluGradPlan& p) {
  const int64_t active = swiglu_active_rows(&p.group_index, p.has_group_index, p.T);
  dispatch_float(p.x.dtype, "x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    parallel_rows(p.T, p.threads, [&](int, int64_t b, int64_t e) {
      HWY_ALIGN float buf[6 * kChunk];
      WithClamp(p.clamp, [&](auto on) { BackwardRows<T, decltype(on)::value>(p, active, buf, b, e); });
    });
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moegrad {
HWY_EXPORT(SwigluForward);
HWY_EXPORT(SwigluBackward);

namespace {
int64_t grain_rows(int64_t H) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(1, H)); }
}  // namespace

void swiglu_cpu_size(SwigluPlan& p, WorkspaceLayout&) {
  p.threads = plan_threads(p.T, grain_rows(p.H));  // scratch on the stack (bounded)
}

void swiglu_cpu(const SwigluPlan& plan, const Workspace&, void*) {
  advise_output(plan.y);
  HWY_DYNAMIC_DISPATCH(SwigluForward)(plan);
}

void swiglu_grad_cpu_size(SwigluGradPlan& p, WorkspaceLayout&) {
  p.threads = plan_threads(p.T, grain_rows(p.H));  // scratch on the stack (bounded)
}

void swiglu_grad_cpu(const SwigluGradPlan& plan, const Workspace&, void*) {
  advise_output(plan.grad_x);
  HWY_DYNAMIC_DISPATCH(SwigluBackward)(plan);
}
}  // namespace moegrad
#endif  // HWY_ONCE
