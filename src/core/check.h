// Validation helpers shared by every operator: each failure throws moegrad::Error with a
// message "<op>: <argument>: <rule>; got <value>" (decisions.md D18).
#ifndef MOEGRAD_CORE_CHECK_H_
#define MOEGRAD_CORE_CHECK_H_

#include <initializer_list>
#include <sstream>
#include <string>

#include "moegrad/moegrad.h"

namespace moegrad {

const char* dtype_name(DType dtype);
// Bytes per element (0 for kOther).
int64_t dtype_size(DType dtype);
std::string shape_str(const TensorView& t);

// Concatenates its arguments with operator<<.
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
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

  // 161001 when a required tensor is null.
  void present(const TensorView* t, const char* arg) const;
  // 161002 unless the dtype is one of `allowed`.
  void dtype_in(const TensorView& t, const char* arg, std::initializer_list<DType> allowed) const;
  // 161002 unless t.dtype == other.dtype.
  void same_dtype(const TensorView& t, const char* arg, DType want, const char* want_from) const;
  // 161002 unless an index tensor: int32, or int64 (values checked to fit in int32 later).
  void index_dtype(const TensorView& t, const char* arg) const;
  // 161002 for non-contiguous views.
  void contiguous(const TensorView& t, const char* arg) const;
  // contiguous() plus "device type equals `device`" (select_backend checks devices fully).
  void layout(const TensorView& t, const char* arg, Device device) const;
  // Shape code unless rank == r.
  void rank(const TensorView& t, const char* arg, int r) const;
  void rank_in(const TensorView& t, const char* arg, int lo, int hi) const;
  // Shape code unless t.shape[d] == want.
  void dim(const TensorView& t, const char* arg, int d, int64_t want, const std::string& what) const;
  // Shape code unless t has exactly `want` as shape.
  void shape(const TensorView& t, const char* arg, const Shape& want) const;

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
