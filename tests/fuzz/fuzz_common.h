// Shared machinery of the libFuzzer harnesses (one per C API entry point; docs/testing.md).
//
// A harness turns the fuzzer's bytes into one operator call: a few sizes (0 included), then each
// tensor either absent (null), or with the shape the operator expects, or a mutated one (a dim
// off by one, another rank, a zero or a huge dim on an empty tensor), a dtype that is usually
// the expected one, random contents, and index tensors whose values are valid, nearly valid or
// arbitrary. Buffers always match the shapes they claim (each its own allocation, so ASan sees
// any access past its end). Attributes are drawn from edge values and random ones.
//
// Invariants checked on every input (a violation aborts, which libFuzzer reports as a crash):
//   * stage one returns 0 or one of the documented codes, and on failure a message that starts
//     with the operator's name, no executor, and every output buffer byte-for-byte untouched;
//   * after a successful stage one, stage two succeeds; a repeatable executor run twice gives
//     the same bits (D16);
//   * ASan/UBSan find no memory error, leak or undefined behaviour.
#ifndef MOEGRAD_TESTS_FUZZ_FUZZ_COMMON_H_
#define MOEGRAD_TESTS_FUZZ_FUZZ_COMMON_H_

#include <fuzzer/FuzzedDataProvider.h>
#include <moegrad/aclnn.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace mgfuzz {

using Shape = std::vector<int64_t>;

// Keeps the harness fast and its memory small; larger sizes add no new code paths.
constexpr int64_t kMaxElems = 1 << 14;

[[noreturn]] inline void finding(const char* what, const std::string& detail) {
  std::fprintf(stderr, "moegrad fuzz finding: %s: %s\n", what, detail.c_str());
  std::abort();
}

inline size_t elem_size(aclDataType t) {
  switch (t) {
    case ACL_INT8: case ACL_UINT8: case ACL_BOOL: case ACL_HIFLOAT8: case ACL_FLOAT8_E5M2:
    case ACL_FLOAT8_E4M3FN: case ACL_FLOAT8_E8M0: return 1;
    case ACL_FLOAT16: case ACL_BF16: case ACL_INT16: case ACL_UINT16: return 2;
    case ACL_FLOAT: case ACL_INT32: case ACL_UINT32: return 4;
    case ACL_INT64: case ACL_UINT64: case ACL_DOUBLE: case ACL_COMPLEX64: return 8;
    case ACL_COMPLEX128: return 16;
    default: return 4;
  }
}

inline int64_t numel(const Shape& s) {
  for (int64_t d : s) {
    if (d == 0) return 0;
  }
  int64_t n = 1;
  for (int64_t d : s) {
    if (d > kMaxElems || n > kMaxElems / d) return std::numeric_limits<int64_t>::max();
    n *= d;
  }
  return n;
}

// How an index tensor is filled when its values are generated rather than raw bytes.
struct IndexFill {
  enum Kind { kRaw, kRange, kPermutation, kCounts } kind = kRaw;
  int64_t lo = 0, hi = 0;  // kRange: [lo, hi); kPermutation: values 0..hi-1 then lo (= -1 pads)
};

class Tensor {
 public:
  Tensor(const Shape& shape, aclDataType dt, bool null_data, bool transposed)
      : shape_(shape), dt_(dt) {
    const int64_t n = mgfuzz::numel(shape);
    bytes_ = static_cast<size_t>(n) * elem_size(dt);
    // One allocation per tensor (at least one byte, so a read of an empty tensor is caught too).
    buf_.reset(new unsigned char[bytes_ > 0 ? bytes_ : 1]);
    std::vector<int64_t> strides(shape.size(), 1);
    for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) {
      strides[i] = strides[i + 1] * std::max<int64_t>(shape[i + 1], 1);
    }
    if (transposed && shape.size() >= 2) {
      // Same extent, other order: a non-contiguous view that stays inside the buffer.
      const size_t a = shape.size() - 2, b = shape.size() - 1;
      strides[b] = std::max<int64_t>(shape[a], 1);
      strides[a] = 1;
    }
    const int64_t storage = n;
    handle_ = aclCreateTensor(shape.data(), shape.size(), dt, strides.data(), 0, ACL_FORMAT_ND,
                              &storage, 1, null_data ? nullptr : buf_.get());
    if (handle_ == nullptr) finding("aclCreateTensor", aclGetRecentErrMsg());
  }
  ~Tensor() { aclDestroyTensor(handle_); }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  aclTensor* handle() const { return handle_; }
  unsigned char* data() { return buf_.get(); }
  size_t bytes() const { return bytes_; }
  aclDataType dtype() const { return dt_; }
  int64_t numel() const { return mgfuzz::numel(shape_); }
  std::vector<unsigned char> snapshot() const {
    return std::vector<unsigned char>(buf_.get(), buf_.get() + bytes_);
  }

 private:
  Shape shape_;
  aclDataType dt_;
  size_t bytes_ = 0;
  std::unique_ptr<unsigned char[]> buf_;
  aclTensor* handle_ = nullptr;
};

class Fuzz {
 public:
  Fuzz(const uint8_t* data, size_t size) : p_(data, size) {}

  FuzzedDataProvider& p() { return p_; }
  bool coin(int one_in = 2) { return p_.ConsumeIntegralInRange<int>(1, one_in) == 1; }

  // A size: mostly small, 0 included.
  int64_t dim(int64_t lo, int64_t hi) { return p_.ConsumeIntegralInRange<int64_t>(lo, hi); }

  // An int64 attribute: usually `usual` or a small value, sometimes an edge value.
  int64_t attr(int64_t usual) {
    switch (p_.ConsumeIntegralInRange<int>(0, 9)) {
      case 0: return p_.ConsumeIntegralInRange<int64_t>(-3, 8);
      case 1: return pick<int64_t>({0, -1, 1, 2, 3, 2048, 2049, int64_t{1} << 31,
                                    int64_t{1} << 40, std::numeric_limits<int64_t>::max(),
                                    std::numeric_limits<int64_t>::min()});
      case 2: return p_.ConsumeIntegral<int64_t>();
      default: return usual;
    }
  }
  // A double attribute: usually `usual`, sometimes NaN, inf, 0, -1, a random value.
  double attr(double usual) {
    switch (p_.ConsumeIntegralInRange<int>(0, 9)) {
      case 0: return pick<double>({0.0, -1.0, 1.0, -0.0, 1e-20, 1e30, -1e30, 88.0, 0.5,
                                   std::numeric_limits<double>::quiet_NaN(),
                                   std::numeric_limits<double>::infinity(),
                                   -std::numeric_limits<double>::infinity(),
                                   std::numeric_limits<double>::denorm_min(), 3.4e38, 1e300});
      case 1: return p_.ConsumeFloatingPoint<double>();
      case 2: return p_.ConsumeFloatingPointInRange<double>(-4.0, 4.0);
      default: return usual;
    }
  }

  aclDataType dtype(aclDataType want) {
    if (!coin(8)) return want;
    return pick<aclDataType>({ACL_FLOAT, ACL_FLOAT16, ACL_BF16, ACL_INT32, ACL_INT64, ACL_DOUBLE,
                              ACL_INT8, ACL_UINT8, ACL_BOOL, ACL_INT16, ACL_COMPLEX64,
                              static_cast<aclDataType>(p_.ConsumeIntegralInRange<int>(-64, 63))});
  }

  // The expected shape, or a mutation of it.
  Shape shape(Shape want) {
    switch (p_.ConsumeIntegralInRange<int>(0, 15)) {
      case 0:  // one dim off by one (or zero)
        if (!want.empty()) {
          int64_t& d = want[p_.ConsumeIntegralInRange<size_t>(0, want.size() - 1)];
          d = pick<int64_t>({d + 1, d > 0 ? d - 1 : 0, 0, 1});
        }
        return want;
      case 1: {  // another rank
        const size_t r = p_.ConsumeIntegralInRange<size_t>(0, 9);
        Shape s;
        for (size_t i = 0; i < r; ++i) s.push_back(p_.ConsumeIntegralInRange<int64_t>(0, 4));
        return s;
      }
      case 2:  // an empty tensor with a huge dim (its element count is still 0)
        want.push_back(0);
        want.insert(want.begin(), int64_t{1} << p_.ConsumeIntegralInRange<int>(20, 62));
        return want;
      case 3:  // drop or add a dim of 1
        if (!want.empty() && coin()) want.pop_back();
        else want.push_back(1);
        return want;
      default:
        return want;
    }
  }

  // A tensor argument. `optional` ones are absent (null) now and then; required ones are null
  // rarely (the null-pointer rule). Returns nullptr for an absent tensor.
  Tensor* tensor(const Shape& want, aclDataType want_dt, bool optional,
                 IndexFill fill = IndexFill{}) {
    if (optional ? coin(4) : coin(64)) return nullptr;
    Shape s = shape(want);
    if (numel(s) > kMaxElems) s = want;
    if (numel(s) > kMaxElems) s.assign(1, 0);
    const aclDataType dt = dtype(want_dt);
    const bool null_data = numel(s) > 0 && coin(128);
    const bool transposed = coin(64);
    tensors_.push_back(std::make_unique<Tensor>(s, dt, null_data, transposed));
    Tensor* t = tensors_.back().get();
    fill_tensor(*t, fill);
    return t;
  }
  Tensor* output(const Shape& want, aclDataType want_dt, bool optional = false) {
    Tensor* t = tensor(want, want_dt, optional);
    if (t) outputs_.push_back(t);
    return t;
  }

  static aclTensor* h(const Tensor* t) { return t ? t->handle() : nullptr; }

  // Checks a stage-one result, runs stage two when it succeeded. `run` is the second stage.
  template <typename Run>
  void finish(const char* op, aclnnStatus st, uint64_t ws, aclOpExecutor* ex,
              aclOpExecutor* sentinel, const std::vector<std::vector<unsigned char>>& before,
              Run run) {
    const std::string msg = aclGetRecentErrMsg();
    if (st != ACLNN_SUCCESS) {
      if (st != ACLNN_ERR_PARAM_NULLPTR && st != ACLNN_ERR_PARAM_INVALID &&
          st != ACLNN_ERR_INNER_TILING_ERROR && st != ACLNN_ERR_INNER_NULLPTR) {
        finding("unexpected status", std::to_string(st) + ": " + msg);
      }
      if (msg.rfind(op, 0) != 0 || msg.find(": ") == std::string::npos) {
        finding("message does not start with the operator name", msg);
      }
      if (ex != sentinel) finding("a failing call created an executor", msg);
      for (size_t i = 0; i < outputs_.size(); ++i) {
        if (outputs_[i]->snapshot() != before[i]) finding("a failing call wrote an output", msg);
      }
      return;
    }
    if (!msg.empty()) finding("a successful call left a message", msg);
    if (ex == nullptr || ex == sentinel) finding("success without an executor", op);
    // Sizes are bounded below 2^61 bytes (docs/decisions.md L52); a legitimately large
    // workspace (a huge expert_num) is planned but not run here.
    if (ws >= (uint64_t{1} << 61)) finding("absurd workspace size", std::to_string(ws));
    if (ws > (uint64_t{1} << 28)) {
      if (aclDestroyAclOpExecutor(ex) != ACLNN_SUCCESS) finding("destroy", aclGetRecentErrMsg());
      return;
    }
    std::vector<unsigned char> mem(ws);
    void* wsp = mem.empty() ? nullptr : mem.data();
    const bool repeat = coin(8);
    if (repeat && aclSetAclOpExecutorRepeatable(ex) != ACLNN_SUCCESS) {
      finding("aclSetAclOpExecutorRepeatable", aclGetRecentErrMsg());
    }
    st = run(wsp, ws, ex, nullptr);
    if (st != ACLNN_SUCCESS) finding("stage two failed after stage one succeeded", aclGetRecentErrMsg());
    if (repeat) {
      std::vector<std::vector<unsigned char>> first;
      for (Tensor* t : outputs_) first.push_back(t->snapshot());
      st = run(wsp, ws, ex, nullptr);
      if (st != ACLNN_SUCCESS) finding("second run of a repeatable executor", aclGetRecentErrMsg());
      for (size_t i = 0; i < outputs_.size(); ++i) {
        if (outputs_[i]->snapshot() != first[i]) finding("a rerun gave other bits", op);
      }
      if (aclDestroyAclOpExecutor(ex) != ACLNN_SUCCESS) finding("destroy", aclGetRecentErrMsg());
    }
  }

  // Runs stage one with poisoned outputs (and now and then null out-parameters), then finish().
  template <typename Plan, typename Run>
  void call(const char* op, Plan plan, Run run) {
    for (Tensor* t : outputs_) std::memset(t->data(), 0xA5, t->bytes());
    std::vector<std::vector<unsigned char>> before;
    for (Tensor* t : outputs_) before.push_back(t->snapshot());
    aclOpExecutor* const sentinel = reinterpret_cast<aclOpExecutor*>(uintptr_t{0x5a5a5a50});
    uint64_t ws = 12345;
    aclOpExecutor* ex = sentinel;
    const int nulls = p_.ConsumeIntegralInRange<int>(0, 31);
    const aclnnStatus st = plan(nulls == 0 ? nullptr : &ws, nulls == 1 ? nullptr : &ex);
    if (nulls <= 1) {
      if (st != ACLNN_ERR_PARAM_NULLPTR) finding("null out-parameter accepted", op);
      return;
    }
    finish(op, st, ws, ex, sentinel, before, run);
  }

 private:
  template <typename T>
  T pick(std::initializer_list<T> values) {
    const size_t i = p_.ConsumeIntegralInRange<size_t>(0, values.size() - 1);
    return *(values.begin() + i);
  }

  void fill_tensor(Tensor& t, IndexFill fill) {
    unsigned char* d = t.data();
    const size_t bytes = t.bytes();
    const int64_t n = t.numel();
    const bool i32 = t.dtype() == ACL_INT32, i64 = t.dtype() == ACL_INT64;
    if ((i32 || i64) && fill.kind != IndexFill::kRaw && !coin(16)) {
      std::vector<int64_t> v(static_cast<size_t>(n));
      if (fill.kind == IndexFill::kPermutation) {
        // Values 0..hi-1 in random order, the rest `lo` (e.g. -1 for a dropped slot).
        for (int64_t i = 0; i < n; ++i) v[i] = i < fill.hi ? i : fill.lo;
        for (int64_t i = n - 1; i > 0; --i) std::swap(v[i], v[p_.ConsumeIntegralInRange<int64_t>(0, i)]);
        if (coin(8) && n > 0) v[p_.ConsumeIntegralInRange<int64_t>(0, n - 1)] = attr(int64_t{0});
      } else if (fill.kind == IndexFill::kRange) {
        for (auto& e : v) e = fill.hi > fill.lo ? p_.ConsumeIntegralInRange<int64_t>(fill.lo, fill.hi - 1) : fill.lo;
        if (coin(8) && n > 0) v[p_.ConsumeIntegralInRange<int64_t>(0, n - 1)] = attr(fill.hi);
      } else {  // counts
        for (auto& e : v) e = coin(8) ? attr(int64_t{0}) : p_.ConsumeIntegralInRange<int64_t>(0, 8);
      }
      for (int64_t i = 0; i < n; ++i) {
        if (i32) {
          const int32_t x = static_cast<int32_t>(v[i]);
          std::memcpy(d + 4 * i, &x, 4);
        } else {
          std::memcpy(d + 8 * i, &v[i], 8);
        }
      }
      return;
    }
    if (coin(4)) {
      // Raw bytes: any bit pattern (NaN, inf, denormals, huge indices).
      const std::vector<uint8_t> raw = p_.ConsumeBytes<uint8_t>(bytes);
      if (!raw.empty()) std::memcpy(d, raw.data(), raw.size());
      if (bytes > raw.size()) std::memset(d + raw.size(), 0, bytes - raw.size());
      return;
    }
    // Ordinary values: small floats of the tensor's dtype (zeros for other dtypes).
    const float scale = p_.ConsumeFloatingPointInRange<float>(0.0f, 8.0f);
    const uint32_t seed = p_.ConsumeIntegral<uint32_t>();
    uint32_t x = seed | 1u;
    std::memset(d, 0, bytes);
    for (int64_t i = 0; i < n; ++i) {
      x ^= x << 13, x ^= x >> 17, x ^= x << 5;
      const float f = (static_cast<float>(x % 20001u) / 10000.0f - 1.0f) * scale;
      if (t.dtype() == ACL_FLOAT) {
        std::memcpy(d + 4 * i, &f, 4);
      } else if (t.dtype() == ACL_FLOAT16) {
        const _Float16 hv = static_cast<_Float16>(f);
        std::memcpy(d + 2 * i, &hv, 2);
      } else if (t.dtype() == ACL_BF16) {
        uint32_t u;
        std::memcpy(&u, &f, 4);
        const uint16_t b = static_cast<uint16_t>(u >> 16);
        std::memcpy(d + 2 * i, &b, 2);
      }
    }
  }

  FuzzedDataProvider p_;
  std::vector<std::unique_ptr<Tensor>> tensors_;
  std::vector<Tensor*> outputs_;
};

}  // namespace mgfuzz

#endif  // MOEGRAD_TESTS_FUZZ_FUZZ_COMMON_H_
