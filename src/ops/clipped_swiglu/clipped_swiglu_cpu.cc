// CPU kernels of ClippedSwiglu (docs/operators.md §9.4) and ClippedSwigluGrad (§9.5 and the
// clamp_mode 1 backward of docs/decisions.md L163), compiled once per SIMD target (Highway) and
// dispatched at run time. Every dim is the same problem on the folded rows [pre, 2h] (see
// clipped_swiglu.h): the work is split into (row, block of output columns) units across threads,
// so a single long row (a leading dim) is as parallel as many short ones. Vectors come straight
// from and go straight to memory, fp32/fp16/bf16 widened to fp32 in registers; interleaved halves
// are split by the loads (LoadPairF) and merged by the stores (StorePairF). Rows past the
// group_index total are +0. No workspace.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/clipped_swiglu/clipped_swiglu_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cstring>

#include "core/dtype.h"
#include "core/host.h"
#include "core/parallel.h"
#include "core/simd-inl.h"
#include "hwy/highway.h"
#include "ops/clipped_swiglu/clipped_swiglu.h"
#include "ops/swiglu/swiglu-inl.h"
#include "ops/swiglu/swiglu.h"

// The 16-bit pair loads and stores read an (even, odd) pair as one 32-bit lane.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "little-endian pairs");

#ifndef MOEGRAD_OPS_CLIPPED_SWIGLU_CPU_ONCE_
#define MOEGRAD_OPS_CLIPPED_SWIGLU_CPU_ONCE_
namespace moegrad {
// Output columns per work unit: a multiple of every target's vector, so each unit of a row
// starts as aligned as the row.
constexpr int64_t kClippedBlock = 4096;
}  // namespace moegrad
#endif

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {
namespace {

// Whole-vector interleave of a and b into lo (lanes 0..N/2 of both) and hi, for non-temporal
// fp32 pair stores on x86 (Highway's InterleaveLower/Upper work per 128-bit block).
constexpr bool kZipStream = HWY_ARCH_X86 && HWY_TARGET != HWY_SCALAR;
HWY_INLINE void Zip2(DF d, VF a, VF b, VF& lo, VF& hi) {
#if MOEGRAD_SIMD_AVX512
  (void)d;
  const __m512i il = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i ih =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  lo = VF{_mm512_permutex2var_ps(a.raw, il, b.raw)};
  hi = VF{_mm512_permutex2var_ps(a.raw, ih, b.raw)};
#elif HWY_TARGET == HWY_SCALAR
  (void)d;
  lo = a;
  hi = b;
#else
  const VF l = hn::InterleaveLower(d, a, b), u = hn::InterleaveUpper(d, a, b);
  if constexpr (hn::MaxLanes(DF()) == 8) {  // AVX2: two 128-bit blocks
    lo = hn::ConcatLowerLower(d, u, l);
    hi = hn::ConcatUpperUpper(d, u, l);
  } else {
    lo = l;
    hi = u;
  }
#endif
}

// Lanes(d) (even, odd) pairs at p, split and widened: a = even elements, b = odd ones.
template <typename T>
HWY_INLINE void LoadPairF(DF d, const T* HWY_RESTRICT p, VF& a, VF& b) {
  if constexpr (std::is_same_v<T, float>) {
    hn::LoadInterleaved2(d, p, a, b);
  } else if constexpr (InRegister<T>::value) {
    const hn::RebindToUnsigned<DF> du;
    const auto u = hn::LoadU(du, reinterpret_cast<const uint32_t*>(p));
    if constexpr (std::is_same_v<T, bf16_t>) {
      a = hn::BitCast(d, hn::ShiftLeft<16>(u));
      b = hn::BitCast(d, hn::And(u, hn::Set(du, 0xFFFF0000u)));
    } else {
      const hn::Rebind<uint16_t, DF> d16;
      using DH = typename Reg<T>::D;
      a = hn::PromoteTo(d, hn::BitCast(DH(), hn::TruncateTo(d16, u)));
      b = hn::PromoteTo(d, hn::BitCast(DH(), hn::TruncateTo(d16, hn::ShiftRight<16>(u))));
    }
  } else {
    HWY_ALIGN float ba[kMaxFloatLanes], bb[kMaxFloatLanes];
    for (size_t i = 0; i < hn::Lanes(d); ++i) {
      ba[i] = to_f32(p[2 * i]);
      bb[i] = to_f32(p[2 * i + 1]);
    }
    a = hn::Load(d, ba);
    b = hn::Load(d, bb);
  }
}

// Where StorePairF<T, true> may write non-temporally.
template <typename T>
HWY_INLINE bool PairStreamAligned(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return kZipStream && StreamAligned(p);
  } else {
    return kStreams<T> &&
           reinterpret_cast<uintptr_t>(p) % (hn::Lanes(DF()) * sizeof(uint32_t)) == 0;
  }
}

// a and b narrowed to T and stored interleaved (a at the even positions) at p; non-temporal with
// kStream (p then PairStreamAligned).
template <bool kStream, typename T>
HWY_INLINE void StorePairF(DF d, VF a, VF b, T* HWY_RESTRICT p) {
  if constexpr (std::is_same_v<T, float>) {
    if constexpr (kStream && kZipStream) {
      VF lo, hi;
      Zip2(d, a, b, lo, hi);
      StreamF(d, lo, p);
      StreamF(d, hi, p + hn::Lanes(d));
    } else {
      hn::StoreInterleaved2(a, b, d, p);
    }
  } else if constexpr (InRegister<T>::value) {
#if MOEGRAD_SIMD_AVX512
    if constexpr (std::is_same_v<T, bf16_t>) {
      // Both halves in one VCVTNE2PS2BF16 (a's 16 values, then b's; no denormal lane), their
      // 16-bit words interleaved by one VPERMW: two instructions instead of two conversions,
      // two widenings, a shift and an OR. The same bits (Bf16x2 is Bf16Bits' rule).
      alignas(64) static constexpr int16_t kZipIdx[32] = {
          0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
      __m512i r;
      if (simd_detail::use_avx512bf16.load(std::memory_order_relaxed) && Bf16x2(a, b, r)) {
        r = _mm512_permutexvar_epi16(_mm512_load_si512(kZipIdx), r);
        if constexpr (kStream) {
          _mm512_stream_si512(reinterpret_cast<__m512i*>(p), r);
        } else {
          _mm512_storeu_si512(p, r);
        }
        return;
      }
    }
#endif
    const hn::RebindToUnsigned<DF> du;
    const hn::Rebind<uint16_t, DF> d16;
    using R = Reg<T>;
    const auto lo = hn::PromoteTo(du, hn::BitCast(d16, R::Narrow(d, a)));
    const auto hi = hn::PromoteTo(du, hn::BitCast(d16, R::Narrow(d, b)));
    const auto u = hn::Or(lo, hn::ShiftLeft<16>(hi));
    if constexpr (kStream) {
      hn::Stream(u, du, reinterpret_cast<uint32_t*>(p));
    } else {
      hn::StoreU(u, du, reinterpret_cast<uint32_t*>(p));
    }
  } else {
    HWY_ALIGN float ba[kMaxFloatLanes], bb[kMaxFloatLanes];
    hn::Store(a, d, ba);
    hn::Store(b, d, bb);
    for (size_t i = 0; i < hn::Lanes(d); ++i) {
      p[2 * i] = from_f32<T>(ba[i]);
      p[2 * i + 1] = from_f32<T>(bb[i]);
    }
  }
}

template <bool kStream, typename T>
HWY_INLINE void Put(DF d, VF v, T* HWY_RESTRICT p) {
  if constexpr (kStream) {
    StreamF(d, v, p);
  } else {
    StoreF(d, v, p);
  }
}

// The attributes as vectors, and the per-element formulas of §9.4 / §9.5 with the clamps of the
// SwiGLU family (ClampGate: min(c, v), ClampUp: clamp to [-c, c]; NaN passes through).
struct Consts {
  VF alpha, bias, c, nc, one;
  Consts(DF d, const ClippedSwigluShape& s)
      : alpha(hn::Set(d, s.alpha)),
        bias(hn::Set(d, s.bias)),
        c(hn::Set(d, s.limit)),
        nc(hn::Set(d, -s.limit)),
        one(hn::Set(d, 1.0f)) {}
};

// p * sigmoid(x). kSixteen (bf16/fp16 data): as in the SwiGLU forward, MulSigmoid16 on AVX-512
// (L105), else the shorter sigmoid (L96); fp32 the sigmoid of L71.
template <bool kSixteen>
HWY_INLINE VF MulSigmoidT(DF d, VF x, VF p) {
#if MOEGRAD_SIMD_AVX512
  if constexpr (kSixteen) return MulSigmoid16(d, x, p);
#endif
  return hn::Mul(p, SigmoidT<kSixteen>(d, x));
}

// y of one vector. Mode 0: A' sigmoid(alpha A') (B' + bias); mode 1: min(A sigmoid(A), limit) B'.
template <int kMode, bool kSixteen>
HWY_INLINE VF ForwardValue(DF d, const Consts& k, VF a, VF b) {
  const VF bc = ClampUp(k.c, k.nc, b);
  if constexpr (kMode == 0) {
    const VF ac = ClampGate(k.c, a);
    return hn::Mul(MulSigmoidT<kSixteen>(d, hn::Mul(k.alpha, ac), ac), hn::Add(bc, k.bias));
  } else {
    return hn::Mul(ClampGate(k.c, MulSigmoidT<kSixteen>(d, a, a)), bc);
  }
}

// (dA, dB) of one vector for upstream gradient g. Masks are inclusive (D32; L163): mode 0
// [A <= limit], mode 1 [A sigmoid(A) <= limit], both modes [-limit <= B <= limit]; a NaN input
// fails its mask.
// kSixteen (bf16/fp16 data): SigmoidGrad16 (L217), whose error is far below the output's
// rounding.
template <bool kSixteen>
HWY_INLINE VF SigmoidB(DF d, VF x) {
  if constexpr (kSixteen) return SigmoidGrad16(d, x);
  return SigmoidT<false>(d, x);
}

template <int kMode, bool kSixteen>
HWY_INLINE void BackwardValue(DF d, const Consts& k, VF a, VF b, VF g, VF& da, VF& db) {
  const VF bc = ClampUp(k.c, k.nc, b);
  // [-limit <= B <= limit] as "the clamp left B alone": one compare (NaN: clamped NaN != NaN).
  const auto mb = hn::Eq(bc, b);
  if constexpr (kMode == 0) {
    const VF ac = ClampGate(k.c, a);
    const VF s = SigmoidB<kSixteen>(d, hn::Mul(k.alpha, ac));
    const VF ds = hn::Mul(s, hn::Add(k.one, hn::Mul(hn::Mul(k.alpha, ac), hn::Sub(k.one, s))));
    da = hn::IfThenElseZero(hn::Le(a, k.c), hn::Mul(hn::Mul(g, hn::Add(bc, k.bias)), ds));
    db = hn::IfThenElseZero(mb, hn::Mul(g, hn::Mul(ac, s)));
  } else {
    const VF s = SigmoidB<kSixteen>(d, a);
    const VF u = hn::Mul(a, s);
    const VF du = hn::Mul(s, hn::Add(k.one, hn::Mul(a, hn::Sub(k.one, s))));
    da = hn::IfThenElseZero(hn::Le(u, k.c), hn::Mul(hn::Mul(g, bc), du));
    db = hn::IfThenElseZero(mb, hn::Mul(g, ClampGate(k.c, u)));
  }
}

// Gate and linear vectors of output columns [j, j + N) of a folded row xr of 2h elements.
template <bool kInter, typename T>
HWY_INLINE void LoadHalves(DF d, const T* HWY_RESTRICT xr, int64_t h, int64_t j, VF& a, VF& b) {
  if constexpr (kInter) {
    LoadPairF(d, xr + 2 * j, a, b);
  } else {
    a = LoadF(d, xr + j);
    b = LoadF(d, xr + h + j);
  }
}
// The same for the last n < N columns (the other lanes read +0).
template <bool kInter, typename T>
HWY_INLINE void LoadHalvesN(DF d, const T* HWY_RESTRICT xr, int64_t h, int64_t j, size_t n,
                            VF& a, VF& b) {
  if constexpr (kInter) {
    HWY_ALIGN T buf[2 * kMaxFloatLanes] = {};
    std::memcpy(static_cast<void*>(buf), xr + 2 * j, 2 * n * sizeof(T));
    LoadPairF(d, buf, a, b);
  } else {
    a = LoadFN(d, xr + j, n);
    b = LoadFN(d, xr + h + j, n);
  }
}

// Output columns [j0, j1) of one forward row.
template <bool kStream, bool kInter, int kMode, typename T>
HWY_INLINE void ForwardSegment(const Consts& k, const T* HWY_RESTRICT xr, T* HWY_RESTRICT yr,
                               int64_t h, int64_t j0, int64_t j1) {
  constexpr bool kSixteen = !std::is_same_v<T, float>;
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  int64_t j = j0;
  for (; j + 2 * N <= j1; j += 2 * N) {
    VF a0, b0, a1, b1;
    LoadHalves<kInter>(d, xr, h, j, a0, b0);
    LoadHalves<kInter>(d, xr, h, j + N, a1, b1);
    Put<kStream>(d, ForwardValue<kMode, kSixteen>(d, k, a0, b0), yr + j);
    Put<kStream>(d, ForwardValue<kMode, kSixteen>(d, k, a1, b1), yr + j + N);
  }
  for (; j + N <= j1; j += N) {
    VF a, b;
    LoadHalves<kInter>(d, xr, h, j, a, b);
    Put<kStream>(d, ForwardValue<kMode, kSixteen>(d, k, a, b), yr + j);
  }
  if (j < j1) {
    const size_t n = static_cast<size_t>(j1 - j);
    VF a, b;
    LoadHalvesN<kInter>(d, xr, h, j, n, a, b);
    StoreFN(d, ForwardValue<kMode, kSixteen>(d, k, a, b), yr + j, n);
  }
}

// Output columns [j0, j1) of one backward row: grad_y row gr, grad_x row gxr (2h elements).
template <bool kStream, bool kInter, int kMode, typename T>
HWY_INLINE void BackwardSegment(const Consts& k, const T* HWY_RESTRICT xr,
                                const T* HWY_RESTRICT gr, T* HWY_RESTRICT gxr, int64_t h,
                                int64_t j0, int64_t j1) {
  constexpr bool kSixteen = !std::is_same_v<T, float>;
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  int64_t j = j0;
  // Two independent vectors per step: the sigmoid chain of one overlaps the other's.
  for (; j + 2 * N <= j1; j += 2 * N) {
    VF a0, b0, a1, b1, da0, db0, da1, db1;
    LoadHalves<kInter>(d, xr, h, j, a0, b0);
    LoadHalves<kInter>(d, xr, h, j + N, a1, b1);
    BackwardValue<kMode, kSixteen>(d, k, a0, b0, LoadF(d, gr + j), da0, db0);
    BackwardValue<kMode, kSixteen>(d, k, a1, b1, LoadF(d, gr + j + N), da1, db1);
    if constexpr (kInter) {
      StorePairF<kStream>(d, da0, db0, gxr + 2 * j);
      StorePairF<kStream>(d, da1, db1, gxr + 2 * (j + N));
    } else {
      Put<kStream>(d, da0, gxr + j);
      Put<kStream>(d, da1, gxr + j + N);
      Put<kStream>(d, db0, gxr + h + j);
      Put<kStream>(d, db1, gxr + h + j + N);
    }
  }
  for (; j + N <= j1; j += N) {
    VF a, b, da, db;
    LoadHalves<kInter>(d, xr, h, j, a, b);
    BackwardValue<kMode, kSixteen>(d, k, a, b, LoadF(d, gr + j), da, db);
    if constexpr (kInter) {
      StorePairF<kStream>(d, da, db, gxr + 2 * j);
    } else {
      Put<kStream>(d, da, gxr + j);
      Put<kStream>(d, db, gxr + h + j);
    }
  }
  if (j < j1) {
    const size_t n = static_cast<size_t>(j1 - j);
    VF a, b, da, db;
    LoadHalvesN<kInter>(d, xr, h, j, n, a, b);
    BackwardValue<kMode, kSixteen>(d, k, a, b, LoadFN(d, gr + j, n), da, db);
    if constexpr (kInter) {
      HWY_ALIGN T buf[2 * kMaxFloatLanes];
      StorePairF<false>(d, da, db, buf);
      std::memcpy(static_cast<void*>(gxr + 2 * j), buf, 2 * n * sizeof(T));
    } else {
      StoreFN(d, da, gxr + j, n);
      StoreFN(d, db, gxr + h + j, n);
    }
  }
}

// Calls f(row, j0, j1) for the work units [begin, end) of rows of h output columns.
template <class F>
HWY_INLINE void ForUnits(int64_t h, int64_t begin, int64_t end, F&& f) {
  const int64_t blocks = std::max<int64_t>(1, (h + kClippedBlock - 1) / kClippedBlock);
  for (int64_t u = begin; u < end; ++u) {
    const int64_t row = u / blocks, j0 = u % blocks * kClippedBlock;
    f(row, j0, std::min(h, j0 + kClippedBlock));
  }
}

template <typename T, bool kInter, int kMode>
void ForwardAll(const ClippedSwigluPlan& p, int64_t active, int64_t units) {
  const int64_t h = p.s.h;
  const T* x = typed<T>(p.x);
  T* y = typed<T>(p.y);
  const bool stream = stream_output(p.s.pre * h * static_cast<int64_t>(sizeof(T)));
  parallel_rows(units, p.threads, [&](int, int64_t begin, int64_t end) {
    const Consts k(DF(), p.s);
    ForUnits(h, begin, end, [&](int64_t row, int64_t j0, int64_t j1) {
      T* yr = y + row * h;
      if (row >= active) {
        std::memset(static_cast<void*>(yr + j0), 0, sizeof(T) * (j1 - j0));
        return;
      }
      const T* xr = x + row * 2 * h;
      if (stream && StreamAligned(yr + j0)) {
        ForwardSegment<true, kInter, kMode>(k, xr, yr, h, j0, j1);
      } else {
        ForwardSegment<false, kInter, kMode>(k, xr, yr, h, j0, j1);
      }
    });
    hwy::FlushStream();
  });
}

template <typename T, bool kInter, int kMode>
void BackwardAll(const ClippedSwigluGradPlan& p, int64_t active, int64_t units) {
  const int64_t h = p.s.h;
  const T* x = typed<T>(p.x);
  const T* gy = typed<T>(p.grad_y);
  T* gx = typed<T>(p.grad_x);
  const bool stream = stream_output(p.s.pre * 2 * h * static_cast<int64_t>(sizeof(T)));
  parallel_rows(units, p.threads, [&](int, int64_t begin, int64_t end) {
    const Consts k(DF(), p.s);
    ForUnits(h, begin, end, [&](int64_t row, int64_t j0, int64_t j1) {
      T* gxr = gx + row * 2 * h;
      if (row >= active) {
        if constexpr (kInter) {
          std::memset(static_cast<void*>(gxr + 2 * j0), 0, sizeof(T) * 2 * (j1 - j0));
        } else {
          std::memset(static_cast<void*>(gxr + j0), 0, sizeof(T) * (j1 - j0));
          std::memset(static_cast<void*>(gxr + h + j0), 0, sizeof(T) * (j1 - j0));
        }
        return;
      }
      const T* xr = x + row * 2 * h;
      const T* gr = gy + row * h;
      const bool aligned = kInter ? PairStreamAligned(gxr + 2 * j0)
                                  : StreamAligned(gxr + j0) && StreamAligned(gxr + h + j0);
      if (stream && aligned) {
        BackwardSegment<true, kInter, kMode>(k, xr, gr, gxr, h, j0, j1);
      } else {
        BackwardSegment<false, kInter, kMode>(k, xr, gr, gxr, h, j0, j1);
      }
    });
    hwy::FlushStream();
  });
}

// Calls f(TypeTag<T>, interleaved, mode) with all three as compile-time constants.
template <class F>
HWY_INLINE void WithVariant(const ClippedSwigluShape& s, DType dt, F&& f) {
  dispatch_float(dt, "x", [&](auto tag) {
    auto by_mode = [&](auto inter) {
      if (s.clamp_mode == 0) {
        f(tag, inter, std::integral_constant<int, 0>{});
      } else {
        f(tag, inter, std::integral_constant<int, 1>{});
      }
    };
    if (s.interleaved) {
      by_mode(std::true_type{});
    } else {
      by_mode(std::false_type{});
    }
  });
}

}  // namespace

void ClippedSwigluForward(const ClippedSwigluPlan& p, int64_t units) {
  const int64_t active = swiglu_active_rows(&p.s.group_index, p.s.has_group_index, p.s.pre);
  WithVariant(p.s, p.x.dtype, [&](auto tag, auto inter, auto mode) {
    using T = typename decltype(tag)::type;
    ForwardAll<T, decltype(inter)::value, decltype(mode)::value>(p, active, units);
  });
}

void ClippedSwigluBackward(const ClippedSwigluGradPlan& p, int64_t units) {
  const int64_t active = swiglu_active_rows(&p.s.group_index, p.s.has_group_index, p.s.pre);
  WithVariant(p.s, p.x.dtype, [&](auto tag, auto inter, auto mode) {
    using T = typename decltype(tag)::type;
    BackwardAll<T, decltype(inter)::value, decltype(mode)::value>(p, active, units);
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moegrad {
HWY_EXPORT(ClippedSwigluForward);
HWY_EXPORT(ClippedSwigluBackward);

namespace {
// Work units (row, block of kClippedBlock output columns) and threads: at least ~16K output
// elements per thread.
int64_t units_of(const ClippedSwigluShape& s) {
  if (s.pre == 0 || s.h == 0) return 0;
  return s.pre * ((s.h + kClippedBlock - 1) / kClippedBlock);
}
int64_t grain_units(const ClippedSwigluShape& s) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, std::min(s.h, kClippedBlock)));
}
}  // namespace

void clipped_swiglu_cpu_size(ClippedSwigluPlan& p, WorkspaceLayout&) {
  p.threads = plan_threads(units_of(p.s), grain_units(p.s));
}

void clipped_swiglu_cpu(const ClippedSwigluPlan& plan, const Workspace&, void*) {
  advise_output(plan.y);
  HWY_DYNAMIC_DISPATCH(ClippedSwigluForward)(plan, units_of(plan.s));
}

void clipped_swiglu_grad_cpu_size(ClippedSwigluGradPlan& p, WorkspaceLayout&) {
  p.threads = plan_threads(units_of(p.s), grain_units(p.s));
}

void clipped_swiglu_grad_cpu(const ClippedSwigluGradPlan& plan, const Workspace&, void*) {
  advise_output(plan.grad_x);
  HWY_DYNAMIC_DISPATCH(ClippedSwigluBackward)(plan, units_of(plan.s));
}
}  // namespace moegrad
#endif  // HWY_ONCE
