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

// grad_weight = sum of grad_y(h) * y_origin(h) in a fixed order (docs/decisions.md L95): 64
// partial sums (element h goes to partial sum h mod 64, added in column order, one fused
// multiply-add per element where the target has FMA), then a fixed pairwise tree (partial i +
// partial i + 32, then i + 16, ...). The order is the same on every SIMD target (64 lanes = 4
// AVX-512, 8 AVX2 or 16 SSE4 vectors) and for any thread count (D16); the 64 partial sums are
// independent register chains, so the loop is not bound by the latency of one chain.
constexpr size_t kGwLanes = 64;

template <typename T>
HWY_INLINE float GradWeightDot(int64_t n, const T* HWY_RESTRICT a, const T* HWY_RESTRICT b) {
  HWY_ALIGN float part[kGwLanes];
  int64_t i = 0;
  const DF d;
  const size_t N = hn::Lanes(d);
  constexpr size_t kMaxVecs = kGwLanes / hn::MaxLanes(DF()) > 0 ? kGwLanes / hn::MaxLanes(DF()) : 1;
  if constexpr (InRegister<T>::value && kGwLanes % hn::MaxLanes(DF()) == 0) {
    if (N * kMaxVecs == kGwLanes) {
      VF acc[kMaxVecs];
      for (size_t k = 0; k < kMaxVecs; ++k) acc[k] = hn::Zero(d);
      for (; i + static_cast<int64_t>(kGwLanes) <= n; i += kGwLanes) {
        for (size_t k = 0; k < kMaxVecs; ++k) {
          acc[k] = hn::MulAdd(LoadF(d, a + i + k * N), LoadF(d, b + i + k * N), acc[k]);
        }
      }
      for (size_t k = 0; k < kMaxVecs; ++k) hn::Store(acc[k], d, part + k * N);
    } else {
      for (size_t l = 0; l < kGwLanes; ++l) part[l] = 0.0f;
    }
  } else {
    for (size_t l = 0; l < kGwLanes; ++l) part[l] = 0.0f;
  }
  // The rest (and every element where the vectors above do not apply) one lane at a time, with
  // the same fused multiply-add semantics as the vectors (hn::MulAdd on one-lane vectors).
  const hn::CappedTag<float, 1> d1;
  for (size_t l = static_cast<size_t>(i) % kGwLanes; i < n; ++i, l = (l + 1) % kGwLanes) {
    const auto pa = hn::Set(d1, to_f32(a[i])), pb = hn::Set(d1, to_f32(b[i]));
    part[l] = hn::GetLane(hn::MulAdd(pa, pb, hn::Set(d1, part[l])));
  }
  for (size_t w = kGwLanes / 2; w >= 1; w /= 2) {
    for (size_t l = 0; l < w; ++l) part[l] = part[l] + part[l + w];
  }
  return part[0];
}

// Software prefetch distance of the forward's two input streams, in bytes (L107).
constexpr size_t kPrefetchAhead = 1024;

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
  // bf16 on AVX-512 with AVX512-BF16: pairs narrowed by one instruction (L106).
#if MOEGRAD_SIMD_AVX512
  const bool cvt2 = std::is_same_v<T, bf16_t> &&
                    simd_detail::use_avx512bf16.load(std::memory_order_relaxed);
#else
  constexpr bool cvt2 = false;
#endif
  for (int64_t t = begin; t < end; ++t) {
    T* yr = y + t * H;
    if (t >= active) {
      std::memset(static_cast<void*>(yr), 0, sizeof(T) * H);
      continue;
    }
    const VF vw = hn::Set(d, w ? w[t] : 1.0f);
    const T* x0 = x + t * 2 * H;
    const T* x1 = x0 + H;
    // bf16/fp16 outputs: the cheaper sigmoid (docs/decisions.md L96, L105).
    constexpr bool kSixteen = !std::is_same_v<T, float>;
    auto f = [&](VF va, VF vb) {
      return SwigluValue<kSixteen>(d, clamp.gate(va), clamp.up(vb), vw);
    };
    int64_t h0 = 0;
    if constexpr (InRegister<T>::value && !std::is_same_v<T, float>) {
      // 16-bit data: pairs of vectors (64 bytes of each input half, 64 bytes of output), with a
      // software prefetch of both input streams kPrefetchAhead bytes ahead (L107).
      auto pairs = [&](auto streamed, auto narrow2) {
        constexpr bool kStream = decltype(streamed)::value;
        for (; h0 + 2 * static_cast<int64_t>(N) <= H; h0 += 2 * N) {
          hwy::Prefetch(reinterpret_cast<const char*>(x0 + h0) + kPrefetchAhead);
          hwy::Prefetch(reinterpret_cast<const char*>(x1 + h0) + kPrefetchAhead);
          const VF v0 = f(LoadF(d, x0 + h0), LoadF(d, x1 + h0));
          const VF v1 = f(LoadF(d, x0 + h0 + N), LoadF(d, x1 + h0 + N));
#if MOEGRAD_SIMD_AVX512
          if constexpr (decltype(narrow2)::value && std::is_same_v<T, bf16_t>) {
            if (HWY_LIKELY(TryStoreBf16x2<kStream>(v0, v1, yr + h0))) continue;
          }
#else
          (void)narrow2;
#endif
          if constexpr (kStream) {
            StreamF2(d, v0, v1, yr + h0);
          } else {
            StoreF(d, v0, yr + h0);
            StoreF(d, v1, yr + h0 + N);
          }
        }
      };
      const bool s2 = stream && Stream2Aligned(yr);
      if (cvt2) {
        if (s2) {
          pairs(std::true_type{}, std::true_type{});
        } else {
          pairs(std::false_type{}, std::true_type{});
        }
      } else if (s2) {
        pairs(std::true_type{}, std::false_type{});
      } else {
        pairs(std::false_type{}, std::false_type{});
      }
    }
    if constexpr (InRegister<T>::value) {
      // Whole vectors straight from and to memory (non-temporal stores where the row is
      // aligned); the tail goes through the chunk path.
      if (stream && StreamAligned(yr)) {
        for (; h0 + static_cast<int64_t>(N) <= H; h0 += N) {
          hwy::Prefetch(reinterpret_cast<const char*>(x0 + h0) + kPrefetchAhead);
          hwy::Prefetch(reinterpret_cast<const char*>(x1 + h0) + kPrefetchAhead);
          StreamF(d, f(LoadF(d, x0 + h0), LoadF(d, x1 + h0)), yr + h0);
        }
      } else {
        for (; h0 + static_cast<int64_t>(N) <= H; h0 += N) {
          hwy::Prefetch(reinterpret_cast<const char*>(x0 + h0) + kPrefetchAhead);
          hwy::Prefetch(reinterpret_cast<const char*>(x1 + h0) + kPrefetchAhead);
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
