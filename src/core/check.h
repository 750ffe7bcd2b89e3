// Validation helpers shared by every operator: each failure throws moegrad::Error with a
// message "<op>: <argument>: <rule>; got <value>" (decisions.md D18).
#ifndef MOEGRAD_CORE_CHECK_H_
#define MOEGRAD_CORE_CHECK_H_

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "moegrad/moegrad.h"

namespace moegrad {

const char* dtype_name(DType dtype);
// Bytes per element (0 for kOther).
int64_t dtype_size(DType dtype);
std::string shape_str(const TensorView& t);

// Saturating size arithmetic: counts, offsets and sizes never overflow (an overflow would be
// undefined behaviour); a result that does not fit becomes INT64_MAX (INT64_MIN below), which
// no real size equals, so a comparison against it fails with a named error instead.
inline int64_t mul_sat(int64_t a, int64_t b) {
  int64_t r;
  if (!__builtin_mul_overflow(a, b, &r)) return r;
  return (a < 0) != (b < 0) ? std::numeric_limits<int64_t>::min()
                            : std::numeric_limits<int64_t>::max();
}
inline int64_t add_sat(int64_t a, int64_t b) {
  int64_t r;
  if (!__builtin_add_overflow(a, b, &r)) return r;
  return a < 0 ? std::numeric_limits<int64_t>::min() : std::numeric_limits<int64_t>::max();
}

// One argument's claim about a size several arguments must agree on (see Validator::agree).
// The description ("dim 0 of [3, 4]") is only formatted when the claim is blamed.
struct Claim {
  enum Kind : int32_t { kDim, kRank, kHalfDim, kQuotient };
  const char* arg;
  int64_t value;
  const TensorView* t;
  int32_t dim;
  Kind kind;
  int64_t div = 1;     // kQuotient: value = t.shape[dim] / div
  bool blame = true;   // false: a witness that only votes; a later rule of its own names it
  std::string where() const;
};
// The claim of dim d of t (d < 0 counts from the end); of its rank; of half of dim d.
Claim dim_claim(const TensorView& t, const char* arg, int d);
Claim rank_claim(const TensorView& t, const char* arg);
Claim half_dim_claim(const TensorView& t, const char* arg, int d);
// A witness: dim d of t over div (the token count R that expanded_row_idx's R * K rows give).
// It votes but is never blamed by agree (its own rule names it later). nullopt when div < 1 or
// does not divide the dim: such a witness says nothing.
std::optional<Claim> witness_claim(const TensorView& t, const char* arg, int d, int64_t div);

// Messages are built without iostreams: a std::ostream formats numbers through the locale's
// facets, and a process holding two libstdc++ copies (an extension linked against a static one
// beside torch's shared one) crashed there on a GPU machine (docs/decisions.md L219). Every
// argument type cat takes is listed below; another one does not compile.
namespace detail {
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, const char* v) { s += v != nullptr ? v : "(null)"; }
inline void put(std::string& s, char* v) { put(s, static_cast<const char*>(v)); }
inline void put(std::string& s, char v) { s += v; }
// bool only as itself: a pointer or a class converting to bool must not print "1".
template <typename T, std::enable_if_t<std::is_same_v<T, bool>, int> = 0>
void put(std::string& s, T v) {
  s += v ? '1' : '0';
}
template <typename T>
void put(std::string& s, T* v) = delete;  // an address is no message content
template <typename T, std::enable_if_t<(std::is_integral_v<T> && !std::is_same_v<T, bool>) ||
                                           std::is_enum_v<T>,
                                       int> = 0>
void put(std::string& s, T v) {
  static_assert(sizeof(T) <= 8, "cat: integers wider than 64 bits are not formatted");
  char buf[24];
  const auto r = [&] {
    if constexpr (std::is_enum_v<T>) {
      return std::to_chars(buf, buf + sizeof(buf), static_cast<std::underlying_type_t<T>>(v));
    } else {
      return std::to_chars(buf, buf + sizeof(buf), v);
    }
  }();
  s.append(buf, r.ptr);
}
// Floating-point values are written as Python's repr writes them (L154): the shortest digits
// that read back as the same double, fixed notation for decimal exponents -4 <= X < 16 (with
// ".0" when integral), else scientific. A stream's default 6 digits would report
// clamp_limit = -0.9999999 as "-1". Inline: the library exports no internal symbols.
inline void put(std::string& s, double v) {
  if (!std::isfinite(v)) {
    s += std::isnan(v) ? "nan" : (v < 0 ? "-inf" : "inf");
    return;
  }
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  // The exponent is parsed within the written characters: buf has no terminating NUL.
  const char* e = static_cast<const char*>(std::memchr(buf, 'e', r.ptr - buf));
  int exp10 = 0;
  if (e != nullptr) {
    const char* p = e + 1;
    const bool neg = *p == '-';
    if (*p == '+' || *p == '-') ++p;
    std::from_chars(p, r.ptr, exp10);
    if (neg) exp10 = -exp10;
  }
  if (exp10 >= -4 && exp10 < 16) {
    r = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::fixed);
    s.append(buf, r.ptr);
    if (!std::memchr(buf, '.', r.ptr - buf)) s += ".0";
    return;
  }
  s.append(buf, r.ptr);
}
inline void put(std::string& s, float v) { put(s, static_cast<double>(v)); }
}  // namespace detail

// Concatenates its arguments (strings, characters, integers and enums as numbers, floating-point
// values in shortest round-trip form), e.g. a message "<op>: <argument>: <rule>; got <value>".
template <typename... Args>
std::string cat(const Args&... args) {
  std::string s;
  (detail::put(s, args), ...);
  return s;
}

// Counts validations (validation_count(); one Validator per validation).
void note_validation();

class Validator {
 public:
  // `shape_code` is the status an operator documents for shape/attribute errors.
  Validator(const char* op, int32_t shape_code) : op_(op), shape_code_(shape_code) {
    note_validation();
  }

  [[noreturn]] void fail(int32_t code, const char* arg, const std::string& rule) const;
  [[noreturn]] void fail_shape(const char* arg, const std::string& rule) const {
    fail(shape_code_, arg, rule);
  }
  void check(bool ok, int32_t code, const char* arg, const std::string& rule) const {
    if (!ok) fail(code, arg, rule);
  }
  void check_shape(bool ok, const char* arg, const std::string& rule) const {
    if (!ok) fail(shape_code_, arg, rule);
  }
  // Lazy forms: the rule's parts are only formatted when the check fails. Validation runs on
  // every call, and formatting each message up front cost more than the checks themselves.
  template <typename... Parts>
  void check(bool ok, int32_t code, const char* arg, const Parts&... rule) const {
    if (!ok) fail(code, arg, cat(rule...));
  }
  template <typename... Parts>
  void check_shape(bool ok, const char* arg, const Parts&... rule) const {
    if (!ok) fail(shape_code_, arg, cat(rule...));
  }

  // 161001 when a required tensor is null; then geometry().
  void present(const TensorView* t, const char* arg) const;
  // 161002 for a rank outside [0, kMaxDims] or a negative dim (aclCreateTensor refuses both in
  // C): present() runs it on required tensors, select_backend on the optional ones too, before
  // any rule reads a shape.
  void geometry(const TensorView& t, const char* arg) const;
  // 161002 unless the dtype is one of `allowed`.
  void dtype_in(const TensorView& t, const char* arg, std::initializer_list<DType> allowed) const;
  // 161002 unless t.dtype == other.dtype.
  void same_dtype(const TensorView& t, const char* arg, DType want, const char* want_from) const;
  // 161002 unless an index tensor: int32, or int64 (values checked to fit in int32 later).
  void index_dtype(const TensorView& t, const char* arg) const;
  // 161002 for non-contiguous views.
  void contiguous(const TensorView& t, const char* arg) const;
  // Shape code unless rank == r.
  void rank(const TensorView& t, const char* arg, int r) const;
  void rank_in(const TensorView& t, const char* arg, int lo, int hi) const;
  // Shape code unless t.shape[d] == want.
  void dim(const TensorView& t, const char* arg, int d, int64_t want, const std::string& what) const;
  void dim(const TensorView& t, const char* arg, int d, int64_t want, const char* what) const {
    if (t.shape[d] != want) dim(t, arg, d, want, std::string(what));
  }
  // Shape code unless t has exactly `want` as shape.
  void shape(const TensorView& t, const char* arg, const Shape& want) const;

  // Several arguments carry the same size (the token count, the hidden size, ...). Of the
  // values the blameable claims hold, the one most claims (witnesses included) agree on is taken
  // as right (a tie goes to the earliest claim; list inputs before outputs) and the first
  // blameable claim that differs is blamed, so the error names the argument that is actually
  // wrong rather than the one it was compared with. Returns the agreed value.
  int64_t agree(const char* what, const std::vector<Claim>& claims) const;

  int32_t shape_code() const { return shape_code_; }
  const char* op() const { return op_; }

 private:
  const char* op_;
  int32_t shape_code_;
};

// The C API's index rule (int32 only), checked before planning; null passes (planning reports it).
void require_index32(const char* op, const TensorView* t, const char* arg);

constexpr std::initializer_list<DType> kFloatTypes = {DType::kFloat32, DType::kFloat16,
                                                      DType::kBFloat16};

}  // namespace moegrad

#endif  // MOEGRAD_CORE_CHECK_H_
