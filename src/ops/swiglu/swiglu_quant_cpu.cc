// CPU kernel of the quantised SwiGLU forward (§6.4, D24), compiled once per SIMD target
// (Highway) and dispatched at run time. Rows split across threads; each row in chunks of fp32
// SwiGLU values (L1 scratch), then per block along H: amax over the finite values, the scale, and
// the FP8 codes (round to nearest even, the same bits as PyTorch's float -> float8 casts).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/swiglu/swiglu_quant_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/parallel.h"
#include "core/simd-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "ops/swiglu/swiglu-inl.h"
#include "ops/swiglu/swiglu.h"

#ifndef MOEGRAD_SWIGLU_QUANT_CPU_ONCE_
#define MOEGRAD_SWIGLU_QUANT_CPU_ONCE_
namespace moegrad {
namespace quant_detail {

// fp32 -> float8_e4m3fn code: 4 exponent bits (bias 7), 3 mantissa bits, no infinity; NaN and
// every |v| >= 480 (inf included) give the NaN code 0x7f (PyTorch's rule). Round to nearest even.
inline uint8_t to_e4m3fn(float v) {
  uint32_t u = f32_bits(v);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  uint8_t r;
  if (u >= 0x43f00000u) {  // 480 (NaN and inf too)
    r = 0x7f;
  } else if (u < 0x3c800000u) {  // below 2^-6: subnormal codes, steps of 2^-9
    // Adding 2^14 rounds to a multiple of 2^-9 (fp32 round to nearest even).
    const float t = f32_from_bits(u) + 16384.0f;
    r = static_cast<uint8_t>(f32_bits(t) - 0x46800000u);
  } else {
    const uint32_t odd = (u >> 20) & 1u;
    u += (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + odd;
    r = static_cast<uint8_t>(u >> 20);
  }
  return r | sign;
}

// fp32 -> float8_e5m2 code: 5 exponent bits (bias 15), 2 mantissa bits; |v| >= 65536 gives inf
// (0x7c), NaN gives 0x7f (PyTorch's rule). Round to nearest even.
inline uint8_t to_e5m2(float v) {
  uint32_t u = f32_bits(v);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  uint8_t r;
  if (u >= 0x47800000u) {  // 65536
    r = u > 0x7f800000u ? 0x7f : 0x7c;
  } else if (u < 0x38800000u) {  // below 2^-14: subnormal codes, steps of 2^-16
    const float t = f32_from_bits(u) + 128.0f;
    r = static_cast<uint8_t>(f32_bits(t) - 0x43000000u);
  } else {
    const uint32_t odd = (u >> 21) & 1u;
    u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffffu + odd;
    r = static_cast<uint8_t>(u >> 21);
  }
  return r | sign;
}

// The smallest power of two >= s for a positive normal s: the exponent from the fp32 bits,
// plus one when the mantissa is not zero (§6.4).
inline float pow2_ceil(float s) {
  uint32_t u = f32_bits(s);
  const uint32_t e = (u >> 23) + ((u & 0x7fffffu) != 0 ? 1u : 0u);
  return f32_from_bits(e << 23);
}

}  // namespace quant_detail
}  // namespace moegrad
#endif  // MOEGRAD_SWIGLU_QUANT_CPU_ONCE_

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {
namespace {

using quant_detail::pow2_ceil;
using quant_detail::to_e4m3fn;
using quant_detail::to_e5m2;

constexpr float kAmaxFloor = 1e-4f;  // §6.4: the block amax is at least 1e-4

// Vector FP8 encoder: the same integer steps as to_e4m3fn / to_e5m2 on whole lanes.
template <bool kE5M2>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> EncodeFp8(DF d, VF q) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto u = hn::BitCast(du, q);
  const auto sign = hn::And(hn::ShiftRight<24>(u), hn::Set(du, 0x80u));
  const auto a = hn::And(u, hn::Set(du, 0x7fffffffu));
  const auto ai = hn::BitCast(di, a);  // < 2^31: signed compares are exact
  constexpr uint32_t kBig = kE5M2 ? 0x47800000u : 0x43f00000u;
  constexpr uint32_t kMinNormal = kE5M2 ? 0x38800000u : 0x3c800000u;
  constexpr uint32_t kRebias = kE5M2 ? 0xc8000000u : 0xc4000000u;  // (bias - 127) << 23
  constexpr uint32_t kHalf = kE5M2 ? 0xfffffu : 0x7ffffu;
  constexpr int kShift = kE5M2 ? 21 : 20;
  const auto odd = hn::And(hn::ShiftRight<kShift>(a), hn::Set(du, 1u));
  auto normal =
      hn::ShiftRight<kShift>(hn::Add(hn::Add(a, hn::Set(du, kRebias + kHalf)), odd));
  if (!kE5M2) {
    // e4m3fn: for |q| >= 480 (inf and NaN included) the sum above wraps to a code >= 0x7f and
    // below it gives at most 0x7f, so an unsigned min is the NaN-code rule. Below the normal
    // range (no wrap: a huge value) the subnormal blend replaces it.
    normal = hn::Min(normal, hn::Set(du, 0x7fu));
  }
  const float magic = kE5M2 ? 128.0f : 16384.0f;
  const auto sub = hn::Sub(hn::BitCast(du, hn::Add(hn::BitCast(d, a), hn::Set(d, magic))),
                           hn::Set(du, f32_bits(magic)));
  auto r = hn::IfThenElse(hn::RebindMask(du, hn::Lt(ai, hn::Set(di, static_cast<int32_t>(kMinNormal)))), sub, normal);
  if (kE5M2) {
    // NaN (above the infinity's bits) keeps a NaN code; |q| >= 65536 and inf give inf.
    const auto big_code =
        hn::IfThenElse(hn::RebindMask(du, hn::Gt(ai, hn::Set(di, 0x7f800000))),
                       hn::Set(du, 0x7fu), hn::Set(du, 0x7cu));
    r = hn::IfThenElse(
        hn::RebindMask(du, hn::Gt(ai, hn::Set(di, static_cast<int32_t>(kBig - 1)))), big_code, r);
  }
  return hn::Or(r, sign);
}

// The scale of a block from its amax over the finite values (§6.4); *inv is what the values
// are multiplied by before encoding.
HWY_INLINE float BlockScale(float amax, float fmax, bool round_scale, float* inv) {
  const float ah = std::max(amax, kAmaxFloor);
  float scale = ah / fmax;
  if (round_scale) {
    scale = pow2_ceil(scale);
    *inv = 1.0f / scale;  // exact: a power of two
  } else {
    *inv = fmax / ah;
  }
  return scale;
}

// Encodes n (<= block) values times inv into n codes; with `stream`, whole aligned vectors of
// codes go out with non-temporal stores (AVX-512: 16 codes, one 16-byte store).
template <bool kE5M2>
HWY_INLINE void EncodeBlock(const float* HWY_RESTRICT v, int64_t n, float inv, bool stream,
                            uint8_t* HWY_RESTRICT out) {
  const DF d;
  const hn::Rebind<uint8_t, DF> d8;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const VF vinv = hn::Set(d, inv);
  int64_t i = 0;
#if MOEGRAD_SIMD_AVX512
  if (stream && reinterpret_cast<uintptr_t>(out) % 16 == 0) {
    for (; i + N <= n; i += N) {
      const auto codes = hn::TruncateTo(d8, EncodeFp8<kE5M2>(d, hn::Mul(hn::LoadU(d, v + i), vinv)));
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + i), codes.raw);
    }
  }
#else
  (void)stream;
#endif
  for (; i + N <= n; i += N) {
    const auto codes = EncodeFp8<kE5M2>(d, hn::Mul(hn::LoadU(d, v + i), vinv));
    hn::StoreU(hn::TruncateTo(d8, codes), d8, out + i);
  }
  for (; i < n; ++i) {
    const float q = v[i] * inv;
    out[i] = kE5M2 ? to_e5m2(q) : to_e4m3fn(q);
  }
}

template <typename T, bool kE5M2, bool kClamp>
void QuantRows(const SwigluQuantPlan& p, int64_t active, float* buf, int64_t begin,
               int64_t end) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const int64_t H = p.H, B = p.block, S = p.scale_stride;
  const float fmax = kE5M2 ? 57344.0f : 448.0f;
  const T* x = typed<T>(p.x);
  const float* w = p.has_weight ? typed<float>(p.weight) : nullptr;
  uint8_t* y = static_cast<uint8_t*>(p.y.data);
  T* yo = p.write_origin ? typed<T>(p.y_origin) : nullptr;
  float* sc32 = p.quant_mode == 0 ? typed<float>(p.y_scale) : nullptr;
  uint8_t* sc8 = p.quant_mode == 1 ? static_cast<uint8_t*>(p.y_scale.data) : nullptr;
  const SwigluClamp<kClamp> clamp(d, p.clamp);
  const VF fin = hn::Set(d, 3.4028235e38f);
  // Non-temporal stores once the codes (and y_origin) are too big to stay cached (L72).
  const bool stream = stream_output(p.T * H * static_cast<int64_t>(yo ? 1 + sizeof(T) : 1));
  std::fill(buf, buf + 4 * kChunk, 0.0f);
  float* a = buf;
  float* b = a + kChunk;
  float* o = b + kChunk;
  T* stage = reinterpret_cast<T*>(o + kChunk);
  float amax[kChunk / 32];  // per block of the current chunk (blocks of 32 or 128)
  for (int64_t t = begin; t < end; ++t) {
    uint8_t* yr = y + t * H;
    if (t >= active) {
      // Rows past the group_index total: zero codes, zero scales (e8m0 code 0), zero y_origin.
      std::memset(yr, 0, static_cast<size_t>(H));
      if (sc32) std::fill(sc32 + t * S, sc32 + (t + 1) * S, 0.0f);
      if (sc8) std::memset(sc8 + t * S, 0, static_cast<size_t>(S));
      if (yo) std::memset(static_cast<void*>(yo + t * H), 0, sizeof(T) * H);
      continue;
    }
    const VF vw = hn::Set(d, w ? w[t] : 1.0f);
    const T* x0 = x + t * 2 * H;
    const T* x1 = x0 + H;
    for (int64_t h0 = 0; h0 < H; h0 += kChunk) {
      // kChunk is a multiple of both block sizes, so blocks never straddle chunks; a block is a
      // whole number of vectors. One pass computes the SwiGLU values into `o` and each block's
      // amax over the finite values (masked for the lanes past n), block by block (no division
      // per vector); a second one encodes.
      const size_t n = static_cast<size_t>(std::min<int64_t>(kChunk, H - h0));
      // bf16/fp16 outputs: the shorter sigmoid (docs/decisions.md L96).
      constexpr bool kSixteen = !std::is_same_v<T, float>;
      auto f = [&](VF va, VF vb) {
        va = clamp.gate(va);
        vb = clamp.up(vb);
        return hn::Mul(hn::Mul(hn::Mul(va, SigmoidT<kSixteen>(d, va)), vb), vw);
      };
      const size_t Bs = static_cast<size_t>(B);
      // Stores one vector of values and returns the running amax of its block's finite values
      // (lanes past n masked).
      auto step = [&](VF vmax, VF v, size_t i) {
        hn::Store(v, d, o + i);
        VF av = hn::Abs(v);
        if (i + N > n) av = hn::IfThenElseZero(hn::FirstN(d, n - i), av);
        return hn::IfThenElse(hn::Le(av, fin), hn::Max(vmax, av), vmax);  // finite values only
      };
      // Whole vectors come straight from memory; the rest (the tail, or every element of a
      // type without an in-register conversion) from the widened chunk.
      size_t nv = 0;
      if constexpr (InRegister<T>::value) nv = n / N * N;
      if (nv < n) {
        load_chunk(x0 + h0 + nv, a + nv, n - nv);
        load_chunk(x1 + h0 + nv, b + nv, n - nv);
      }
      for (size_t j = 0; j < n; j += Bs) {
        const size_t jend = std::min(j + Bs, n);
        [[maybe_unused]] const size_t jv = std::min(jend, nv);
        VF vmax = hn::Zero(d);
        size_t i = j;
        if constexpr (InRegister<T>::value) {
          for (; i < jv; i += N) {
            vmax = step(vmax, f(LoadF(d, x0 + h0 + i), LoadF(d, x1 + h0 + i)), i);
          }
        }
        for (; i < jend; i += N) vmax = step(vmax, f(hn::Load(d, a + i), hn::Load(d, b + i)), i);
        amax[j / Bs] = hn::GetLane(hn::MaxOfLanes(d, vmax));
      }
      if (yo) {
        if (stream) {
          stream_chunk(o, yo + t * H + h0, n, stage);
        } else {
          store_chunk(o, yo + t * H + h0, n);
        }
      }
      for (size_t j = 0; j < n; j += static_cast<size_t>(B)) {
        const int64_t blk = (h0 + static_cast<int64_t>(j)) / B;
        float inv;
        const float s = BlockScale(amax[j / static_cast<size_t>(B)], fmax, p.round_scale, &inv);
        EncodeBlock<kE5M2>(o + j, std::min<int64_t>(B, static_cast<int64_t>(n - j)), inv, stream,
                           yr + h0 + static_cast<int64_t>(j));
        if (sc32) {
          sc32[t * S + blk] = s;
        } else {
          sc8[t * S + blk] = static_cast<uint8_t>(f32_bits(s) >> 23);  // e8m0: biased exponent
        }
      }
    }
    if (sc8 && S > p.blocks) sc8[t * S + p.blocks] = 0;  // the pad of an odd block count
  }
  hwy::FlushStream();
}

}  // namespace

void SwigluQuantForward(const SwigluQuantPlan& p) {
  const int64_t active = swiglu_active_rows(&p.group_index, p.has_group_index, p.T);
  dispatch_float(p.x.dtype, "x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    parallel_rows(p.T, p.threads, [&](int, int64_t b, int64_t e) {
      HWY_ALIGN float buf[4 * kChunk];  // bounded scratch on the stack (L14)
      WithClamp(p.clamp, [&](auto on) {
        constexpr bool kClamp = decltype(on)::value;
        if (p.e5m2) {
          QuantRows<T, true, kClamp>(p, active, buf, b, e);
        } else {
          QuantRows<T, false, kClamp>(p, active, buf, b, e);
        }
      });
    });
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moegrad {
HWY_EXPORT(SwigluQuantForward);

void swiglu_quant_cpu_size(SwigluQuantPlan& p, WorkspaceLayout&) {
  p.threads = plan_threads(p.T, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, p.H)));
}

void swiglu_quant_cpu(const SwigluQuantPlan& plan, const Workspace&, void*) {
  HWY_DYNAMIC_DISPATCH(SwigluQuantForward)(plan);
}
}  // namespace moegrad
#endif  // HWY_ONCE
