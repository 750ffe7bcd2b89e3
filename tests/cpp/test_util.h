// Helpers shared by the GoogleTest suite of the moegrad C API (aclnn.h).
//
// * Tensor: an owning host buffer plus its aclTensor handle (contiguous, or strided for the
//   layout rules), with conversion from/to double in the tensor's dtype. fp16 uses the compiler's
//   _Float16, bf16 a round-to-nearest-even written here: nothing comes from the library.
// * OpCase: one operator call (stage one and stage two) with its inputs, attributes and
//   caller-allocated outputs; a validation test mutates one thing of a valid case and calls
//   expect_rejected(), which checks the status, the message, that no executor was created and
//   that every output buffer (poisoned with 0xFF bytes) is byte-for-byte untouched.
// * Seeds: random data comes from test_seed(), drawn from std::random_device unless
//   MOEGRAD_TEST_SEED is set; it is printed, and shown in every failure of a test that uses it.
// * Tolerances: the same model as the Python suite (tests/python/conftest.py): an element passes
//   when |out - ref| <= atol + rtol*|ref| + ctol*(1 + sqrt(n_reduce))*scale.
#ifndef MOEGRAD_TESTS_CPP_TEST_UTIL_H_
#define MOEGRAD_TESTS_CPP_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <moegrad/aclnn.h>

namespace mgt {

// ---------------------------------------------------------------------------------------------
// dtypes
// ---------------------------------------------------------------------------------------------
inline size_t elem_size(aclDataType t) {
  switch (t) {
    case ACL_INT8: case ACL_UINT8: case ACL_BOOL: case ACL_FLOAT8_E5M2: case ACL_FLOAT8_E4M3FN:
    case ACL_FLOAT8_E8M0: case ACL_HIFLOAT8: return 1;
    case ACL_FLOAT16: case ACL_BF16: case ACL_INT16: case ACL_UINT16: return 2;
    case ACL_FLOAT: case ACL_INT32: case ACL_UINT32: return 4;
    case ACL_INT64: case ACL_UINT64: case ACL_DOUBLE: case ACL_COMPLEX64: return 8;
    case ACL_COMPLEX128: return 16;
    default: return 4;
  }
}

inline const char* dt_name(aclDataType t) {
  switch (t) {
    case ACL_FLOAT: return "fp32";
    case ACL_FLOAT16: return "fp16";
    case ACL_BF16: return "bf16";
    case ACL_INT32: return "int32";
    case ACL_INT64: return "int64";
    case ACL_DOUBLE: return "double";
    case ACL_INT8: return "int8";
    default: return "other";
  }
}

inline uint16_t bf16_from_float(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<uint16_t>(u >> 16);
}
inline float float_from_bf16(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Rounds a double to what a tensor of dtype `t` stores, and back.
inline double round_to(aclDataType t, double v) {
  switch (t) {
    case ACL_FLOAT: return static_cast<double>(static_cast<float>(v));
    case ACL_FLOAT16: return static_cast<double>(static_cast<_Float16>(static_cast<float>(v)));
    case ACL_BF16: return float_from_bf16(bf16_from_float(static_cast<float>(v)));
    default: return v;
  }
}

// ---------------------------------------------------------------------------------------------
// seeds and random data
// ---------------------------------------------------------------------------------------------
inline uint32_t test_seed() {
  static const uint32_t seed = [] {
    const char* env = std::getenv("MOEGRAD_TEST_SEED");
    uint32_t s = env ? static_cast<uint32_t>(std::strtoul(env, nullptr, 0))
                     : static_cast<uint32_t>(std::random_device{}());
    std::cerr << "[moegrad C API tests] MOEGRAD_TEST_SEED=" << s << std::endl;
    return s;
  }();
  return seed;
}

inline std::string seed_trace() { return "MOEGRAD_TEST_SEED=" + std::to_string(test_seed()); }

class Rng {
 public:
  explicit Rng(uint32_t salt = 0) : gen_(test_seed() ^ (salt * 0x9e3779b9u)) {}
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(gen_); }
  // A value bounded away from 0 with a random sign (upstream gradients are never all ones).
  double signed_uniform(double lo, double hi) {
    double v = uniform(lo, hi);
    return (gen_() & 1u) ? v : -v;
  }
  int64_t integer(int64_t lo, int64_t hi_inclusive) {
    return std::uniform_int_distribution<int64_t>(lo, hi_inclusive)(gen_);
  }
  std::vector<double> uniform_vec(size_t n, double lo, double hi) {
    std::vector<double> v(n);
    for (auto& e : v) e = uniform(lo, hi);
    return v;
  }
  std::vector<int32_t> permutation(int32_t n) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) p[static_cast<size_t>(i)] = i;
    std::shuffle(p.begin(), p.end(), gen_);
    return p;
  }
  std::mt19937& gen() { return gen_; }

 private:
  std::mt19937 gen_;
};

// ---------------------------------------------------------------------------------------------
// Tensor
// ---------------------------------------------------------------------------------------------
inline int64_t numel_of(const std::vector<int64_t>& shape) {
  for (int64_t d : shape) {
    if (d == 0) return 0;  // zero-sized shapes may have huge other dims
  }
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

class Tensor {
 public:
  Tensor() = default;  // the null tensor: handle() is nullptr

  // Contiguous, zero-filled.
  Tensor(std::vector<int64_t> shape, aclDataType dt, aclFormat format = ACL_FORMAT_ND)
      : shape_(std::move(shape)), dt_(dt), format_(format) {
    storage_elems_ = numel_of(shape_);
    strides_.assign(shape_.size(), 1);
    for (int i = static_cast<int>(shape_.size()) - 2; i >= 0; --i) {
      strides_[i] = strides_[i + 1] * shape_[i + 1];
    }
    alloc_and_create();
  }

  // A non-contiguous view of `shape`: the last dim has stride 2 (every other element of a
  // buffer twice as long), the outer dims are packed over that. Requires shape.back() > 1.
  static Tensor strided(std::vector<int64_t> shape, aclDataType dt) {
    Tensor t;
    t.shape_ = std::move(shape);
    t.dt_ = dt;
    t.strides_.assign(t.shape_.size(), 2);
    for (int i = static_cast<int>(t.shape_.size()) - 2; i >= 0; --i) {
      t.strides_[i] = t.strides_[i + 1] * t.shape_[i + 1];
    }
    t.storage_elems_ = 2 * numel_of(t.shape_);
    t.alloc_and_create();
    return t;
  }

  // A contiguous, zero-filled tensor created with aclFormat `format` (stage one refuses any
  // format it does not read as ND).
  static Tensor formatted(aclFormat format, std::vector<int64_t> shape, aclDataType dt) {
    return Tensor(std::move(shape), dt, format);
  }

  // A 2-D view [rows, cols] over a column-major buffer (strides {1, rows}): non-contiguous.
  static Tensor transposed(int64_t rows, int64_t cols, aclDataType dt) {
    Tensor t;
    t.shape_ = {rows, cols};
    t.dt_ = dt;
    t.strides_ = {1, rows};
    t.storage_elems_ = rows * cols;
    t.alloc_and_create();
    return t;
  }

  // A tensor handle with a null data pointer but the given (non-empty) shape.
  static Tensor null_data(std::vector<int64_t> shape, aclDataType dt) {
    Tensor t;
    t.shape_ = std::move(shape);
    t.dt_ = dt;
    t.storage_elems_ = 0;
    t.strides_.assign(t.shape_.size(), 1);
    for (int i = static_cast<int>(t.shape_.size()) - 2; i >= 0; --i) {
      t.strides_[i] = t.strides_[i + 1] * t.shape_[i + 1];
    }
    t.create(nullptr);
    return t;
  }

  static Tensor from(std::vector<int64_t> shape, aclDataType dt, const std::vector<double>& v) {
    Tensor t(std::move(shape), dt);
    t.set(v);
    return t;
  }
  static Tensor from_i32(std::vector<int64_t> shape, const std::vector<int32_t>& v) {
    Tensor t(std::move(shape), ACL_INT32);
    EXPECT_EQ(static_cast<int64_t>(v.size()), t.numel());
    if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * 4);  // no null memcpy (UBSan)
    return t;
  }
  static Tensor from_i64(std::vector<int64_t> shape, const std::vector<int64_t>& v) {
    Tensor t(std::move(shape), ACL_INT64);
    EXPECT_EQ(static_cast<int64_t>(v.size()), t.numel());
    if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * 8);
    return t;
  }

  Tensor(Tensor&&) = default;
  Tensor& operator=(Tensor&&) = default;

  aclTensor* handle() const { return handle_.get(); }
  bool is_null() const { return handle_ == nullptr; }
  aclDataType dtype() const { return dt_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const { return numel_of(shape_); }
  void* data() { return buf_.empty() ? nullptr : buf_.data(); }
  const void* data() const { return buf_.empty() ? nullptr : buf_.data(); }
  size_t nbytes() const { return buf_.size(); }
  const std::vector<unsigned char>& bytes() const { return buf_; }

  // Element access for contiguous tensors, in double.
  double get(int64_t i) const {
    const unsigned char* p = buf_.data() + static_cast<size_t>(i) * elem_size(dt_);
    switch (dt_) {
      case ACL_FLOAT: { float f; std::memcpy(&f, p, 4); return f; }
      case ACL_FLOAT16: { _Float16 h; std::memcpy(&h, p, 2); return static_cast<double>(h); }
      case ACL_BF16: { uint16_t b; std::memcpy(&b, p, 2); return float_from_bf16(b); }
      case ACL_INT32: { int32_t v; std::memcpy(&v, p, 4); return v; }
      case ACL_INT64: { int64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
      case ACL_DOUBLE: { double v; std::memcpy(&v, p, 8); return v; }
      default: return 0.0;
    }
  }
  void put(int64_t i, double v) {
    unsigned char* p = buf_.data() + static_cast<size_t>(i) * elem_size(dt_);
    switch (dt_) {
      case ACL_FLOAT: { float f = static_cast<float>(v); std::memcpy(p, &f, 4); break; }
      case ACL_FLOAT16: { _Float16 h = static_cast<_Float16>(static_cast<float>(v)); std::memcpy(p, &h, 2); break; }
      case ACL_BF16: { uint16_t b = bf16_from_float(static_cast<float>(v)); std::memcpy(p, &b, 2); break; }
      case ACL_INT32: { int32_t x = static_cast<int32_t>(v); std::memcpy(p, &x, 4); break; }
      case ACL_INT64: { int64_t x = static_cast<int64_t>(v); std::memcpy(p, &x, 8); break; }
      case ACL_DOUBLE: std::memcpy(p, &v, 8); break;
      default: break;
    }
  }
  void set(const std::vector<double>& v) {
    EXPECT_EQ(static_cast<int64_t>(v.size()), numel());
    for (size_t i = 0; i < v.size(); ++i) put(static_cast<int64_t>(i), v[i]);
  }
  // Contents in double (contiguous tensors), i.e. what the kernel reads.
  std::vector<double> values() const {
    std::vector<double> v(static_cast<size_t>(numel()));
    for (size_t i = 0; i < v.size(); ++i) v[i] = get(static_cast<int64_t>(i));
    return v;
  }
  int32_t i32(int64_t i) const {
    int32_t v;
    std::memcpy(&v, buf_.data() + 4 * i, 4);
    return v;
  }
  void set_i32(int64_t i, int32_t v) { std::memcpy(buf_.data() + 4 * i, &v, 4); }

  void poison() {
    if (!buf_.empty()) std::memset(buf_.data(), 0xFF, buf_.size());
  }
  bool all_poison() const {
    for (unsigned char b : buf_) {
      if (b != 0xFF) return false;
    }
    return true;
  }

 private:
  struct Destroy {
    void operator()(aclTensor* t) const { aclDestroyTensor(t); }
  };
  void alloc_and_create() {
    buf_.assign(static_cast<size_t>(storage_elems_) * elem_size(dt_), 0);
    create(buf_.empty() ? nullptr : buf_.data());
  }
  void create(void* data) {
    std::vector<int64_t> storage{storage_elems_};
    aclTensor* h = aclCreateTensor(shape_.data(), shape_.size(), dt_, strides_.data(), 0,
                                   format_, storage.data(), 1, data);
    if (h == nullptr) ADD_FAILURE() << "aclCreateTensor failed: " << aclGetRecentErrMsg();
    handle_.reset(h);
  }

  std::vector<int64_t> shape_;
  std::vector<int64_t> strides_;
  int64_t storage_elems_ = 0;
  aclDataType dt_ = ACL_FLOAT;
  aclFormat format_ = ACL_FORMAT_ND;
  std::vector<unsigned char> buf_;
  std::unique_ptr<aclTensor, Destroy> handle_;
};

// ---------------------------------------------------------------------------------------------
// messages
// ---------------------------------------------------------------------------------------------
inline bool is_ident(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// `word` occurs in `msg` delimited by non-identifier characters (so "x" does not match inside
// "expanded_x", and "3" does not match inside "13").
inline bool has_word(const std::string& msg, const std::string& word) {
  for (size_t pos = msg.find(word); pos != std::string::npos; pos = msg.find(word, pos + 1)) {
    const bool left = pos == 0 || !is_ident(msg[pos - 1]);
    const size_t end = pos + word.size();
    const bool right = end >= msg.size() || !is_ident(msg[end]);
    if (left && right) return true;
  }
  return false;
}

// `alternatives` is "name" or "name1|name2" (e.g. the snake_case name and the aclnn name).
inline bool names_any(const std::string& msg, const std::string& alternatives) {
  size_t start = 0;
  while (true) {
    const size_t bar = alternatives.find('|', start);
    const std::string w = alternatives.substr(start, bar == std::string::npos ? std::string::npos : bar - start);
    if (!w.empty() && has_word(msg, w)) return true;
    if (bar == std::string::npos) return false;
    start = bar + 1;
  }
}

// ---------------------------------------------------------------------------------------------
// operator calls
// ---------------------------------------------------------------------------------------------
inline aclOpExecutor* const kSentinelExecutor = reinterpret_cast<aclOpExecutor*>(uintptr_t{0x5a5a5a50});

struct OpCase {
  bool null_workspace_size = false;
  bool null_executor = false;
  virtual ~OpCase() = default;
  virtual aclnnStatus stage1(uint64_t* ws, aclOpExecutor** ex) = 0;
  virtual aclnnStatus stage2(void* ws, uint64_t size, aclOpExecutor* ex) = 0;
  virtual std::vector<Tensor*> outputs() = 0;

  aclnnStatus call_stage1(uint64_t* ws, aclOpExecutor** ex) {
    return stage1(null_workspace_size ? nullptr : ws, null_executor ? nullptr : ex);
  }
  void poison_outputs() {
    for (Tensor* t : outputs()) {
      if (t && !t->is_null()) t->poison();
    }
  }
};

// The checks every rejected call must pass (decisions.md D18, aclnn.h).
inline void expect_rejected(OpCase& c, aclnnStatus code, const std::string& arg,
                            const std::vector<std::string>& words = {}) {
  c.poison_outputs();
  uint64_t ws = 0xABCDEF;
  aclOpExecutor* ex = kSentinelExecutor;
  const aclnnStatus st = c.call_stage1(&ws, &ex);
  const std::string msg = aclGetRecentErrMsg();
  EXPECT_EQ(st, code) << "message: " << msg;
  EXPECT_TRUE(names_any(msg, arg)) << "the message must name '" << arg << "'; got: " << msg;
  for (const std::string& w : words) {
    EXPECT_TRUE(names_any(msg, w)) << "the message must contain '" << w << "'; got: " << msg;
  }
  EXPECT_EQ(ex, kSentinelExecutor) << "a failing call must not create an executor";
  for (Tensor* t : c.outputs()) {
    if (t && !t->is_null()) {
      EXPECT_TRUE(t->all_poison()) << "a failing call wrote to an output buffer";
    }
  }
  if (ex != kSentinelExecutor && ex != nullptr) aclDestroyAclOpExecutor(ex);
}

// As expect_rejected, and the message blames `arg` itself: it starts "op: arg:" (a size several
// arguments carry names the odd one out, not the one it was compared with; L50).
inline void expect_blamed(OpCase& c, aclnnStatus code, const std::string& op,
                          const std::string& arg) {
  expect_rejected(c, code, arg);
  const std::string msg = aclGetRecentErrMsg();
  EXPECT_EQ(msg.rfind(op + ": " + arg + ":", 0), 0u) << "must blame " << arg << "; got: " << msg;
}

// Runs both stages with a malloc'ed workspace; outputs are poisoned first (so every element
// must be written). Returns false (with a test failure) if a stage fails.
inline bool run_ok(OpCase& c) {
  c.poison_outputs();
  uint64_t ws = 0;
  aclOpExecutor* ex = nullptr;
  aclnnStatus st = c.call_stage1(&ws, &ex);
  EXPECT_EQ(st, ACLNN_SUCCESS) << aclGetRecentErrMsg();
  if (st != ACLNN_SUCCESS) return false;
  EXPECT_STREQ(aclGetRecentErrMsg(), "");
  EXPECT_NE(ex, nullptr);
  void* mem = ws > 0 ? std::malloc(ws) : nullptr;
  st = c.stage2(mem, ws, ex);
  std::free(mem);
  EXPECT_EQ(st, ACLNN_SUCCESS) << aclGetRecentErrMsg();
  if (st != ACLNN_SUCCESS) return false;
  EXPECT_STREQ(aclGetRecentErrMsg(), "");
  return true;
}

// ---------------------------------------------------------------------------------------------
// comparison with a float64 reference
// ---------------------------------------------------------------------------------------------
struct Tol {
  double rtol, atol, ctol;
};
inline Tol tol_for(aclDataType dt) {
  switch (dt) {
    case ACL_FLOAT16: return {std::ldexp(1.0, -10), std::ldexp(1.0, -24), 2e-6};
    case ACL_BF16: return {std::ldexp(1.0, -7), 1e-30, 2e-6};
    default: return {std::ldexp(1.0, -22), 1e-30, 2e-6};
  }
}

// |out - ref| <= atol + rtol*|ref| + ctol*(1 + sqrt(n_reduce))*scale, elementwise; `scale`
// defaults to |ref| (pass the magnitude of the summed / cancelling terms where there is one).
inline void expect_close(const Tensor& out, const std::vector<double>& ref, const std::string& what,
                         const std::vector<double>& scale = {}, double n_reduce = 1) {
  ASSERT_EQ(static_cast<int64_t>(ref.size()), out.numel()) << what;
  const Tol t = tol_for(out.dtype());
  int bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double o = out.get(static_cast<int64_t>(i));
    const double s = scale.empty() ? std::fabs(ref[i]) : scale[i];
    const double tol = t.atol + t.rtol * std::fabs(ref[i]) + t.ctol * (1.0 + std::sqrt(n_reduce)) * s;
    const bool ok = std::isnan(ref[i]) ? std::isnan(o) : std::fabs(o - ref[i]) <= tol;
    if (!ok && bad++ < 8) {
      ADD_FAILURE() << what << " (" << dt_name(out.dtype()) << ") element " << i << ": got " << o
                    << ", reference " << ref[i] << ", tolerance " << tol << "; " << seed_trace();
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " elements out of tolerance";
}

// Listed values of a worked example (given to `decimals` places).
inline void expect_listed(const Tensor& out, const std::vector<double>& listed, int decimals,
                          const std::string& what) {
  ASSERT_EQ(static_cast<int64_t>(listed.size()), out.numel()) << what;
  const Tol t = tol_for(out.dtype());
  for (size_t i = 0; i < listed.size(); ++i) {
    const double o = out.get(static_cast<int64_t>(i));
    const double tol = 0.5 * std::pow(10.0, -decimals) + t.rtol * std::fabs(listed[i]) +
                       2.0 * t.ctol * std::fabs(listed[i]);
    EXPECT_NEAR(o, listed[i], tol) << what << " element " << i;
  }
}

inline void expect_bitwise_equal(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.nbytes(), b.nbytes()) << what;
  EXPECT_TRUE(a.bytes() == b.bytes())
      << what << ": results differ bitwise";
}

// Restores the default thread count when a test ends.
struct ThreadsGuard {
  ~ThreadsGuard() { moegradSetNumThreads(0); }
};

// D16: two cases built alike (same inputs) run with 1 and with 2 threads give the same bits.
inline void expect_deterministic_across_threads(OpCase& one, OpCase& two) {
  ThreadsGuard guard;
  moegradSetNumThreads(1);
  ASSERT_TRUE(run_ok(one));
  moegradSetNumThreads(2);
  ASSERT_EQ(moegradGetNumThreads(), 2);
  ASSERT_TRUE(run_ok(two));
  std::vector<Tensor*> a = one.outputs(), b = two.outputs();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i]->is_null()) continue;
    ASSERT_GT(a[i]->nbytes(), 0u);
    expect_bitwise_equal(*a[i], *b[i], "output " + std::to_string(i) + " with 1 vs 2 threads");
  }
}

// The workspace size query is idempotent: the same size twice, two live executors, both
// destroyable.
inline void expect_workspace_idempotent(OpCase& c) {
  uint64_t ws1 = 12345, ws2 = 54321;
  aclOpExecutor *e1 = nullptr, *e2 = nullptr;
  ASSERT_EQ(c.stage1(&ws1, &e1), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  ASSERT_EQ(c.stage1(&ws2, &e2), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  EXPECT_EQ(ws1, ws2);
  EXPECT_NE(e1, nullptr);
  EXPECT_NE(e2, nullptr);
  EXPECT_NE(e1, e2);
  EXPECT_EQ(aclDestroyAclOpExecutor(e1), ACLNN_SUCCESS) << aclGetRecentErrMsg();
  EXPECT_EQ(aclDestroyAclOpExecutor(e2), ACLNN_SUCCESS) << aclGetRecentErrMsg();
}

}  // namespace mgt

// A validation rule of a parameterised rule table: mutate a valid case, expect `code` and a
// message that names `arg` (plus `words`).
template <typename Case>
struct Rule {
  std::string name;
  std::function<void(Case&)> mutate;
  aclnnStatus code;
  std::string arg;
  std::vector<std::string> words;  // optional in the rule tables (tests/cpp/CMakeLists.txt)
};

template <typename Case>
std::string rule_name(const testing::TestParamInfo<Rule<Case>>& info) {
  return info.param.name;
}

#endif  // MOEGRAD_TESTS_CPP_TEST_UTIL_H_
