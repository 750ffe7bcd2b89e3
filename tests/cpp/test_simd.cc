// The SIMD helpers of core/simd-inl.h on EVERY compiled Highway target the CPU supports (each
// target in turn, via hwy::SetSupportedTargetsForTest): the bf16/fp16 register and chunk
// conversions against the scalar conversions of core/convert.h (themselves tested against the
// compiler and a double-precision rounding in test_convert.cc), with the AVX512-BF16 instruction
// path both on and off; the row store family (plain, streamed, paired, blocks, tails) writing
// exactly its elements; and the fast exp / sigmoid against a double-precision reference over a
// dense sweep of the whole float range and the special values (docs/decisions.md L71).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "test_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "core/parallel.h"
#include "core/simd-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace moegrad {
namespace HWY_NAMESPACE {

// Bit 0: fp16 converts in registers on this target; bit 1: this target has the AVX-512 bf16
// instruction path compiled in.
int SimdTraits() {
  return (InRegister<half_t>::value ? 1 : 0) | (MOEGRAD_SIMD_AVX512 ? 2 : 0);
}

// kind 0: bf16, 1: fp16. via 0: LoadF on whole vectors (register types only), 1: load_chunk.
// n is a multiple of kChunk. Returns false when the path does not exist on this target.
template <typename T>
bool WidenT(int via, const uint16_t* in, float* out, size_t n) {
  const DF d;
  const T* src = reinterpret_cast<const T*>(in);
  if (via == 0) {
    if constexpr (InRegister<T>::value) {
      for (size_t i = 0; i < n; i += hn::Lanes(d)) hn::StoreU(LoadF(d, src + i), d, out + i);
      return true;
    }
    return false;
  }
  // Odd chunk lengths too, so the scalar tails run.
  for (size_t i = 0; i < n;) {
    const size_t len = std::min<size_t>(n - i, 1 + (i / 7) % (2 * hn::Lanes(d) + 3));
    load_chunk(src + i, out + i, len);
    i += len;
  }
  return true;
}
bool Widen(int kind, int via, const uint16_t* in, float* out, size_t n) {
  return kind == 0 ? WidenT<bf16_t>(via, in, out, n) : WidenT<half_t>(via, in, out, n);
}

// via 0: StoreF on whole vectors, 1: store_chunk (odd lengths), 2: stream_chunk (aligned
// kChunk pieces; out must be vector-aligned), 3: StreamF2 on pairs of vectors.
template <typename T>
bool NarrowT(int via, const float* in, uint16_t* out, size_t n) {
  const DF d;
  T* dst = reinterpret_cast<T*>(out);
  if (via == 0) {
    if constexpr (InRegister<T>::value) {
      for (size_t i = 0; i < n; i += hn::Lanes(d)) StoreF(d, hn::LoadU(d, in + i), dst + i);
      return true;
    }
    return false;
  }
  if (via == 1) {
    for (size_t i = 0; i < n;) {
      const size_t len = std::min<size_t>(n - i, 1 + (i / 5) % (2 * hn::Lanes(d) + 3));
      store_chunk(in + i, dst + i, len);
      i += len;
    }
    return true;
  }
  if (via == 3) {  // StreamF2: pairs of vectors in one non-temporal store (where it exists)
    const size_t L2 = 2 * hn::Lanes(d);
    if (!Stream2Aligned(dst) || n % L2 != 0) return false;
    for (size_t i = 0; i < n; i += L2) {
      StreamF2(d, hn::LoadU(d, in + i), hn::LoadU(d, in + i + L2 / 2), dst + i);
    }
    hwy::FlushStream();
    return true;
  }
  auto stage = hwy::AllocateAligned<T>(kChunk);
  for (size_t i = 0; i < n; i += kChunk) {
    stream_chunk(in + i, dst + i, std::min<size_t>(kChunk, n - i), stage.get());
  }
  hwy::FlushStream();
  return true;
}
bool Narrow(int kind, int via, const float* in, uint16_t* out, size_t n) {
  return kind == 0 ? NarrowT<bf16_t>(via, in, out, n) : NarrowT<half_t>(via, in, out, n);
}

size_t FloatLanes() { return hn::Lanes(DF()); }

// The row store family on up to four vectors in[0 .. 4 * Lanes) narrowed to T at out:
// via 0: StoreF, 1: StreamF, 2: StreamF2, 3: StoreBlock<4> with the streaming its alignment
// allows, 4: StoreBlock<1> likewise, 5: StoreFN of the first `tail` lanes. Sets *n to the
// elements written; false when out is not aligned for the via (1 and 2).
template <typename T>
bool StoreRowT(int via, size_t tail, const float* in, T* out, size_t* n) {
  const DF d;
  const size_t L = hn::Lanes(d);
  VF v[4];
  for (size_t u = 0; u < 4; ++u) v[u] = hn::LoadU(d, in + u * L);
  if ((via == 1 && !StreamAligned(out)) || (via == 2 && !Stream2Aligned(out))) return false;
  switch (via) {
    case 0: StoreF(d, v[0], out); *n = L; break;
    case 1: StreamF(d, v[0], out); *n = L; break;
    case 2: StreamF2(d, v[0], v[1], out); *n = 2 * L; break;
    case 3: StoreBlock<4>(d, v, out, StreamAligned(out), Stream2Aligned(out)); *n = 4 * L; break;
    case 4: StoreBlock<1>(d, v, out, StreamAligned(out), false); *n = L; break;
    default: StoreFN(d, v[0], out, tail); *n = tail; break;
  }
  hwy::FlushStream();
  return true;
}
// kind 0: bf16, 1: fp16, 2: fp32.
bool StoreRow(int kind, int via, size_t tail, const float* in, void* out, size_t* n) {
  if (kind == 0) return StoreRowT(via, tail, in, static_cast<bf16_t*>(out), n);
  if (kind == 1) return StoreRowT(via, tail, in, static_cast<half_t*>(out), n);
  return StoreRowT(via, tail, in, static_cast<float*>(out), n);
}
// LoadFN of the first n < Lanes elements at in into out[0 .. Lanes).
void LoadRowTail(int kind, size_t n, const void* in, float* out) {
  const DF d;
  const VF v = kind == 0   ? LoadFN(d, static_cast<const bf16_t*>(in), n)
               : kind == 1 ? LoadFN(d, static_cast<const half_t*>(in), n)
                           : LoadFN(d, static_cast<const float*>(in), n);
  hn::StoreU(v, d, out);
}

// fn 0: ExpNaN, 1: Sigmoid, 2: Sigmoid16, 3: MulSigmoid16 with p = 1 (the sigmoid itself; p = x
// where x is NaN: in the SwiGLU p = x * up * w brings x's NaN, the sigmoid part stays finite),
// 4: SigmoidGrad16 (x where x is NaN, which its callers' products carry); n a multiple of the
// lane count.
void Eval(int fn, const float* in, float* out, size_t n) {
  const DF d;
  for (size_t i = 0; i < n; i += hn::Lanes(d)) {
    const VF v = hn::LoadU(d, in + i);
    const VF r = fn == 0   ? ExpNaN(d, v)
                 : fn == 1 ? Sigmoid(d, v)
                 : fn == 2 ? Sigmoid16(d, v)
                 : fn == 3 ? MulSigmoid16(d, v, hn::IfThenElse(hn::IsNaN(v), v, hn::Set(d, 1.0f)))
                           : hn::IfThenElse(hn::IsNaN(v), v, SigmoidGrad16(d, v));
    hn::StoreU(r, d, out + i);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace moegrad
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <random>

#include "convert_inputs.h"
#include "hwy_targets.h"
#include "core/convert.h"
#include "core/host_simd.h"

namespace moegrad {
HWY_EXPORT(SimdTraits);
HWY_EXPORT(Widen);
HWY_EXPORT(Narrow);
HWY_EXPORT(Eval);
HWY_EXPORT(FloatLanes);
HWY_EXPORT(StoreRow);
HWY_EXPORT(LoadRowTail);
}  // namespace moegrad

namespace {

using moegrad_test::fbits;
using moegrad_test::ffrom;

using moegrad_test::for_each_target;

// The bf16 instruction switch as the tests leave it: on only where the CPU has the instruction.
struct Bf16Switch {
  explicit Bf16Switch(bool on) {
    moegrad::simd_detail::use_avx512bf16.store(on && moegrad::simd_detail::cpu_has_avx512bf16());
  }
  ~Bf16Switch() {
    moegrad::simd_detail::use_avx512bf16.store(moegrad::simd_detail::cpu_has_avx512bf16());
  }
};

TEST(Simd, TargetsAndPathsExercised) {
  int avx512 = 0, f16 = 0;
  for_each_target([&](int64_t t) {
    const int traits = HWY_DYNAMIC_DISPATCH(moegrad::SimdTraits)();
    std::printf("target %s: fp16 in registers %d, AVX-512 bf16 path compiled %d (CPU has "
                "AVX512-BF16: %d)\n",
                hwy::TargetName(t), traits & 1, (traits >> 1) & 1,
                moegrad::simd_detail::cpu_has_avx512bf16() ? 1 : 0);
    avx512 += (traits >> 1) & 1;
    f16 += traits & 1;
  });
  const int64_t usable = hwy::SupportedTargets() & HWY_TARGETS;
  std::printf("dispatched by default: %s\n", hwy::TargetName(usable & -usable));
#if HWY_ARCH_X86
  // On an AVX-512 machine the AVX-512 paths (and with them the fp16 register path) ran above.
  if (hwy::SupportedTargets() & HWY_AVX3) {
    EXPECT_GT(avx512, 0);
    EXPECT_GT(f16, 0);
  }
#endif
  (void)avx512;
}

void check_widening(int kind) {
  std::vector<uint16_t> in(0x10000);
  for (uint32_t h = 0; h < 0x10000; ++h) in[h] = static_cast<uint16_t>(h);
  std::vector<float> out(in.size());
  for_each_target([&](int64_t) {
    for (int via = 0; via < 2; ++via) {
      std::fill(out.begin(), out.end(), -1.0f);
      if (!HWY_DYNAMIC_DISPATCH(moegrad::Widen)(kind, via, in.data(), out.data(), in.size())) {
        continue;
      }
      for (uint32_t h = 0; h < 0x10000; ++h) {
        const float want = kind == 0 ? moegrad::bf16_bits_to_f32(static_cast<uint16_t>(h))
                                     : moegrad::f16_bits_to_f32(static_cast<uint16_t>(h));
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(out[h])) << "via " << via << " 0x" << std::hex << h;
          ASSERT_EQ(fbits(out[h]) >> 31, fbits(want) >> 31) << "via " << via << std::hex << h;
        } else {
          ASSERT_EQ(fbits(out[h]), fbits(want)) << "via " << via << " 0x" << std::hex << h;
        }
      }
    }
  });
}

TEST(Simd, Bf16WideningAll65536OnEveryTarget) { check_widening(0); }
TEST(Simd, Fp16WideningAll65536OnEveryTarget) { check_widening(1); }

void check_narrowing(int kind, bool bf16_insn) {
  const Bf16Switch sw(bf16_insn);
  std::vector<uint32_t> bitsv = moegrad_test::narrowing_inputs();
  const size_t chunk = static_cast<size_t>(moegrad::kRowChunk);
  bitsv.resize((bitsv.size() + chunk - 1) / chunk * chunk, 0x00000001u);  // pad: a denormal
  // Denormal lanes inside otherwise normal vectors (the instruction path must fall back).
  for (size_t i = 3; i < bitsv.size(); i += 1001) bitsv[i] = 0x00400001u + static_cast<uint32_t>(i);
  std::vector<float> in(bitsv.size());
  for (size_t i = 0; i < in.size(); ++i) in[i] = ffrom(bitsv[i]);
  auto out = hwy::AllocateAligned<uint16_t>(in.size());
  ASSERT_GT(in.size(), 1000000u);
  for_each_target([&](int64_t) {
    for (int via = 0; via < 4; ++via) {
      std::fill(out.get(), out.get() + in.size(), uint16_t{0x5555});
      if (!HWY_DYNAMIC_DISPATCH(moegrad::Narrow)(kind, via, in.data(), out.get(), in.size())) {
        continue;
      }
      for (size_t i = 0; i < in.size(); ++i) {
        const uint16_t want =
            kind == 0 ? moegrad::f32_to_bf16_bits(in[i]) : moegrad::f32_to_f16_bits(in[i]);
        const uint16_t got = out[i];
        if (kind == 1 && std::isnan(in[i])) {  // fp16 NaN: a NaN of the same sign
          ASSERT_EQ(got & 0x7c00u, 0x7c00u) << "via " << via << std::hex << bitsv[i];
          ASSERT_NE(got & 0x3ffu, 0u) << "via " << via << std::hex << bitsv[i];
          ASSERT_EQ(got & 0x8000u, want & 0x8000u) << "via " << via << std::hex << bitsv[i];
          continue;
        }
        ASSERT_EQ(got, want) << "via " << via << " input bits 0x" << std::hex << bitsv[i];
      }
    }
  });
}

TEST(Simd, Bf16NarrowingOnEveryTargetWithTheInstruction) { check_narrowing(0, true); }
TEST(Simd, Bf16NarrowingOnEveryTargetPortable) { check_narrowing(0, false); }
TEST(Simd, Fp16NarrowingOnEveryTarget) { check_narrowing(1, false); }

// The row stores write exactly their elements, with the bits of the scalar conversions, at an
// address aligned for every store and at one that is not (the streaming paths then report
// false or fall back to plain stores), on every target: a store that writes a whole register
// for a narrowed vector of half a register (8 bytes of bf16 on SSE4) would overwrite the
// guard bytes after it. Row tails load only their elements and +0 in the other lanes.
TEST(Simd, RowStoresWriteExactlyTheirElementsOnEveryTarget) {
  float in[64];
  for (int i = 0; i < 64; ++i) in[i] = ffrom(0x3f800000u + 0x00012345u * i) * (i % 3 ? 1 : -1);
  auto buf = hwy::AllocateAligned<unsigned char>(512);
  for_each_target([&](int64_t) {
    const size_t L = HWY_DYNAMIC_DISPATCH(moegrad::FloatLanes)();
    for (int kind = 0; kind < 3; ++kind) {
      const size_t es = kind == 2 ? 4 : 2;
      for (size_t shift : {size_t{0}, es}) {
        for (int via = 0; via <= 5; ++via) {
          for (size_t tail = via == 5 ? 1 : 0; tail < (via == 5 ? L : 1); ++tail) {
            SCOPED_TRACE(testing::Message() << "kind " << kind << " via " << via << " shift "
                                            << shift << " tail " << tail);
            std::memset(buf.get(), 0xa5, 512);
            unsigned char* out = buf.get() + 128 + shift;
            size_t n = 0;
            if (!HWY_DYNAMIC_DISPATCH(moegrad::StoreRow)(kind, via, tail, in, out, &n)) {
              continue;  // not aligned for it, or no non-temporal store of T on this target
            }
            for (size_t i = 0; i < 512; ++i) {
              unsigned char* p = buf.get() + i;
              if (p >= out && p < out + n * es) continue;
              ASSERT_EQ(*p, 0xa5) << "byte " << static_cast<long>(p - out) << " written";
            }
            for (size_t i = 0; i < n; ++i) {
              uint32_t got = 0, want = 0;
              std::memcpy(&got, out + i * es, es);
              want = kind == 0 ? moegrad::f32_to_bf16_bits(in[i])
                     : kind == 1 ? moegrad::f32_to_f16_bits(in[i])
                                 : fbits(in[i]);
              ASSERT_EQ(got, want) << "element " << i;
            }
          }
        }
      }
      for (size_t n = 1; n < L; ++n) {
        uint16_t src16[16];
        float src32[16], got[16];
        for (size_t i = 0; i < 16; ++i) {
          src16[i] = kind == 0 ? moegrad::f32_to_bf16_bits(in[i]) : moegrad::f32_to_f16_bits(in[i]);
          src32[i] = in[i];
        }
        const void* src = kind == 2 ? static_cast<const void*>(src32) : src16;
        HWY_DYNAMIC_DISPATCH(moegrad::LoadRowTail)(kind, n, src, got);
        for (size_t i = 0; i < L; ++i) {
          const float want = i >= n ? 0.0f
                             : kind == 0 ? moegrad::bf16_bits_to_f32(src16[i])
                             : kind == 1 ? moegrad::f16_bits_to_f32(src16[i])
                                         : src32[i];
          ASSERT_EQ(fbits(got[i]), fbits(want)) << "kind " << kind << " n " << n << " lane " << i;
        }
      }
    }
  });
}

// Error of got against the double value want, in ulps of float at want (denormal spacing
// below the normal range); infinite when one side is inf/NaN and the other is not.
double ulp_error(float got, double want) {
  if (std::isnan(want)) return std::isnan(got) ? 0.0 : INFINITY;
  if (std::isnan(got)) return INFINITY;
  const double fmax = std::numeric_limits<float>::max();
  if (std::fabs(want) > fmax) {
    // Past FLT_MAX a correctly rounded result is inf from FLT_MAX + half an ulp on.
    const double edge = std::ldexp(1.0, 128) - std::ldexp(1.0, 103);
    if (std::isinf(got)) return 0.0;
    return std::fabs(want) >= edge ? INFINITY : (std::fabs(want) - got) / std::ldexp(1.0, 104);
  }
  if (std::isinf(got)) {
    return std::fabs(want) >= std::ldexp(1.0, 128) - std::ldexp(1.0, 103) ? 0.0 : INFINITY;
  }
  int e = 0;
  std::frexp(want, &e);                             // want = m * 2^e, 0.5 <= |m| < 1
  const double ulp = std::ldexp(1.0, std::max(e - 24, -149));
  return std::fabs(static_cast<double>(got) - want) / ulp;
}

double sigmoid_ref(double x) { return x >= 0 ? 1.0 / (1.0 + std::exp(-x)) : std::exp(x) / (1.0 + std::exp(x)); }

// Bounds stated in docs/decisions.md L71, L96, L105 and L217 (measured maxima, rounded up).
constexpr double kExpMaxUlp = 1.5;
constexpr double kSigmoidMaxUlp = 3.0;
constexpr double kSigmoid16MaxUlp = 5.0;
constexpr double kMulSigmoid16MaxUlp = 6.0;
constexpr double kSigmoidGrad16MaxUlp = 6.0;  // L217: MulSigmoid16's arithmetic with p = 1

struct Worst {
  double err = 0.0;
  float x = 0.0f, got = 0.0f;
  double want = 0.0;
};

// Evaluates fn on every target over `in` (a multiple of 64 long) and folds the worst error.
void sweep(int fn, const std::vector<float>& in, std::map<int64_t, Worst>& worst) {
  std::vector<double> ref(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    const double x = in[i];
    ref[i] = fn == 0 ? std::exp(x) : sigmoid_ref(x);  // Sigmoid16 too
  }
  std::vector<float> out(in.size());
  for_each_target([&](int64_t t) {
    HWY_DYNAMIC_DISPATCH(moegrad::Eval)(fn, in.data(), out.data(), in.size());
    Worst& w = worst[t];
    for (size_t i = 0; i < in.size(); ++i) {
      const double err = ulp_error(out[i], ref[i]);
      if (err > w.err) w = Worst{err, in[i], out[i], ref[i]};
    }
  });
}

void check_exp_or_sigmoid(int fn) {
  const char* name = fn == 0   ? "exp"
                     : fn == 1 ? "sigmoid"
                     : fn == 2 ? "sigmoid16"
                     : fn == 3 ? "mulsigmoid16"
                               : "sigmoidgrad16";
  std::map<int64_t, Worst> worst;
  // Every 61st bit pattern (70 million floats: both signs, every exponent), in blocks.
  std::vector<float> in;
  for (uint64_t u = 0; u <= 0xffffffffull; u += 61) {
    in.push_back(ffrom(static_cast<uint32_t>(u)));
    if (in.size() == (size_t{1} << 21)) {
      sweep(fn, in, worst);
      in.clear();
    }
  }
  // The neighbourhoods of the overflow / underflow / denormal thresholds and the special values.
  for (float c : {88.72283f, 88.7228394f, 89.0f, -87.33654f, -103.2789f, -103.972f, -104.0f,
                  -88.7228f, 0.34657359f, -0.34657359f, 1e-30f, 1.0f, 7.0f, 16.0f}) {
    const uint32_t b = fbits(c);
    for (int k = -300; k <= 300; ++k) in.push_back(ffrom(b + static_cast<uint32_t>(k)));
  }
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float c : {0.0f, -0.0f, inf, -inf, nan, -nan, std::numeric_limits<float>::denorm_min(),
                  -std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(),
                  std::numeric_limits<float>::max(), -std::numeric_limits<float>::max()}) {
    in.push_back(c);
  }
  in.push_back(ffrom(0x7f800001u));  // signalling NaNs
  in.push_back(ffrom(0xffbfffffu));
  while (in.size() % 64) in.push_back(0.0f);
  sweep(fn, in, worst);
  for (const auto& [t, w] : worst) {
    std::printf("%s on %s: max error %.3f ulp at x = %a (got %a, want %a)\n", name,
                hwy::TargetName(t), w.err, w.x, w.got, w.want);
    const double bound = fn == 0   ? kExpMaxUlp
                         : fn == 1 ? kSigmoidMaxUlp
                         : fn == 2 ? kSigmoid16MaxUlp
                         : fn == 3 ? kMulSigmoid16MaxUlp
                                   : kSigmoidGrad16MaxUlp;
    EXPECT_LE(w.err, bound)
        << name << " on " << hwy::TargetName(t) << " at x = " << w.x;
  }
  // Exact special values.
  for_each_target([&](int64_t) {
    float sp[16] = {0.0f, -0.0f, inf, -inf, nan, -nan, -200.0f, 200.0f,
                    -104.0f, 1e-40f, -1e-40f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    float r[16];
    HWY_DYNAMIC_DISPATCH(moegrad::Eval)(fn, sp, r, 16);
    if (fn == 0) {
      EXPECT_EQ(r[0], 1.0f);
      EXPECT_EQ(r[1], 1.0f);
      EXPECT_EQ(r[2], inf);
      EXPECT_EQ(fbits(r[3]), 0u);
      EXPECT_TRUE(std::isnan(r[4]) && std::isnan(r[5]));
      EXPECT_EQ(fbits(r[6]), 0u);
      EXPECT_EQ(r[7], inf);
      EXPECT_EQ(fbits(r[8]), 0u);
      EXPECT_EQ(r[9], 1.0f);
      EXPECT_EQ(r[10], 1.0f);
    } else {
      EXPECT_EQ(r[0], 0.5f);
      EXPECT_EQ(r[1], 0.5f);
      EXPECT_EQ(r[2], 1.0f);
      EXPECT_EQ(fbits(r[3]), 0u);
      EXPECT_TRUE(std::isnan(r[4]) && std::isnan(r[5]));
      EXPECT_EQ(fbits(r[6]), 0u);
      EXPECT_EQ(r[7], 1.0f);
      EXPECT_EQ(fbits(r[8]), 0u);  // sigmoid(-104) is about 7e-46: rounds to +0
      EXPECT_EQ(r[9], 0.5f);
      EXPECT_EQ(r[10], 0.5f);
    }
  });
}

TEST(Simd, ExpOverTheWholeFloatRange) { check_exp_or_sigmoid(0); }
TEST(Simd, SigmoidOverTheWholeFloatRange) { check_exp_or_sigmoid(1); }
TEST(Simd, Sigmoid16OverTheWholeFloatRange) { check_exp_or_sigmoid(2); }
TEST(Simd, MulSigmoid16OverTheWholeFloatRange) { check_exp_or_sigmoid(3); }
TEST(Simd, SigmoidGrad16OverTheWholeFloatRange) { check_exp_or_sigmoid(4); }

// The min/max pass of the host index checks (core/host_simd.h) against std::minmax_element,
// int32 and int64, every length from 1 to 300 and a long one, the extremes of the type at
// random positions (also in the tails past the last whole vector pair), on every target.
template <typename I>
void check_index_min_max(uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int64_t> val(-1000, 1000);
  for_each_target([&](int64_t) {
    for (int64_t n = 1; n <= 301; ++n) {
      const int64_t len = n == 301 ? 65537 : n;
      std::vector<I> p(static_cast<size_t>(len));
      for (auto& x : p) x = static_cast<I>(val(gen));
      for (int rep = 0; rep < 3; ++rep) {
        if (rep == 1) p[gen() % p.size()] = std::numeric_limits<I>::max();
        if (rep == 2) p[gen() % p.size()] = std::numeric_limits<I>::min();
        I mn = 0, mx = 0;
        moegrad::index_min_max(p.data(), len, &mn, &mx);
        const auto want = std::minmax_element(p.begin(), p.end());
        ASSERT_EQ(mn, *want.first) << "n=" << len << " rep=" << rep << " seed=" << seed;
        ASSERT_EQ(mx, *want.second) << "n=" << len << " rep=" << rep << " seed=" << seed;
      }
    }
  });
}

TEST(Simd, IndexMinMaxOnEveryTarget) {
  const uint64_t seed = std::random_device{}();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  check_index_min_max<int32_t>(seed);
  check_index_min_max<int64_t>(seed + 1);
}

}  // namespace
#endif  // HWY_ONCE
