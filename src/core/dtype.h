// Element types of the kernels and the one dtype dispatch helper (CPU and CUDA alike).
// fp16/bf16 widen to fp32 on load and narrow with round-to-nearest-even on store (D12).
#ifndef MOEGRAD_CORE_DTYPE_H_
#define MOEGRAD_CORE_DTYPE_H_

#include <cstdint>
#include <cstring>

#include "core/check.h"
#include "core/convert.h"
#include "moegrad/moegrad.h"

namespace moegrad {

// IEEE binary16; GCC/Clang convert with round-to-nearest-even, bit-identical to convert.h (tested).
using half_t = _Float16;

struct bf16_t {
  uint16_t bits;
};

inline uint32_t f32_bits(float v) { return bits_of(v); }
inline float f32_from_bits(uint32_t u) { return float_of(u); }

inline float to_f32(float v) { return v; }
inline float to_f32(half_t v) { return static_cast<float>(v); }
inline float to_f32(bf16_t v) { return bf16_bits_to_f32(v.bits); }

template <typename T>
inline T from_f32(float v);
template <>
inline float from_f32<float>(float v) {
  return v;
}
template <>
inline half_t from_f32<half_t>(float v) {
  return static_cast<half_t>(v);
}
template <>
inline bf16_t from_f32<bf16_t>(float v) {
  return bf16_t{f32_to_bf16_bits(v)};
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with T the element type of a float dtype; other dtypes are a caller bug
// (validation has rejected them) and raise 161002 naming `arg`.
template <typename F>
inline void dispatch_float(DType dtype, const char* arg, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      f(TypeTag<float>{});
      return;
    case DType::kFloat16:
      f(TypeTag<half_t>{});
      return;
    case DType::kBFloat16:
      f(TypeTag<bf16_t>{});
      return;
    default:
      throw Error(kErrParamInvalid, cat("dispatch: ", arg,
                                        ": dtype must be float32, float16 or bfloat16; got ",
                                        dtype_name(dtype)));
  }
}

template <typename T>
inline T* typed(const TensorView& t) {
  return static_cast<T*>(t.data);
}

}  // namespace moegrad

#endif  // MOEGRAD_CORE_DTYPE_H_
