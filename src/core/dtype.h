// Element types of the kernels and the one dtype dispatch helper (CPU and CUDA alike).
// fp16/bf16 widen to fp32 on load and narrow with round-to-nearest-even on store (D12).
#ifndef MOEGRAD_CORE_DTYPE_H_
#define MOEGRAD_CORE_DTYPE_H_

#include <cstdint>
#include <cstring>

#include "core/check.h"
#include "core/dtype_scalar.h"
#include "moegrad/moegrad.h"

namespace moegrad {

using half_t = _Float16;  // IEEE binary16; GCC/Clang convert with round-to-nearest-even.

struct bf16_t {
  uint16_t bits;
};

inline uint32_t f32_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

inline float to_f32(float v) { return v; }
inline float to_f32(half_t v) { return static_cast<float>(v); }
inline float to_f32(bf16_t v) { return f32_from_bits(f32_bits_from_bf16_bits(v.bits)); }

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
  return bf16_t{bf16_bits_from_f32_bits(f32_bits(v))};  // shared with the CUDA kernels
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
