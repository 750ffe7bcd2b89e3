// Error type, tensor views, validation helpers and threads shared by all operators.
#include <atomic>
#include <vector>

#include "core/check.h"
#include "core/executor.h"
#include "core/parallel.h"
#include "moegrad/moegrad.h"

namespace moegrad {

Error::Error(int32_t code, const std::string& message)
    : std::runtime_error(message), code_(code) {}

Executor::~Executor() = default;

int64_t TensorView::numel() const {
  // Saturates (a zero dim anywhere still gives 0): shapes from the C API are not trusted.
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) {
    if (shape[i] == 0) return 0;
  }
  for (int i = 0; i < ndim; ++i) n = mul_sat(n, shape[i]);
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expect = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    // Strides of size-1 dims are irrelevant (PyTorch may report anything there).
    if (shape[i] != 1 && strides[i] != expect) return numel() == 0;
    expect = mul_sat(expect, shape[i]);
  }
  return true;
}

TensorView TensorView::contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                                  Device device, int32_t device_id) {
  if (shape.size() > static_cast<size_t>(kMaxDims)) {
    throw Error(kErrParamInvalid, cat("tensor: rank must be at most ", kMaxDims, "; got ",
                                      shape.size()));
  }
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(shape.size());
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.strides[i] = stride;
    stride = mul_sat(stride, shape[i]);
  }
  t.device = device;
  t.device_id = device_id;
  return t;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kHiFloat8: return "hifloat8";
    case DType::kFloat8E5M2: return "float8_e5m2";
    case DType::kFloat8E4M3FN: return "float8_e4m3fn";
    case DType::kFloat8E8M0: return "float8_e8m0";
    default: break;
  }
  // Dtypes no operator takes keep their aclDataType code, so errors can name them.
  switch (static_cast<int32_t>(dtype)) {
    case 2: return "int8";
    case 4: return "uint8";
    case 6: return "int16";
    case 7: return "uint16";
    case 8: return "uint32";
    case 10: return "uint64";
    case 11: return "float64";
    case 12: return "bool";
    case 13: return "string";
    case 16: return "complex64";
    case 17: return "complex128";
    default: return "an unsupported dtype";
  }
}

int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: case DType::kBFloat16: return 2;
    case DType::kFloat32: case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: case DType::kHiFloat8: case DType::kFloat8E5M2: case DType::kFloat8E4M3FN:
    case DType::kFloat8E8M0: return 1;
    default: return 0;
  }
}

std::string shape_str(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) {
    if (i) s += ", ";
    s += std::to_string(t.shape[i]);
  }
  return s + "]";
}

Claim dim_claim(const TensorView& t, const char* arg, int d) {
  const int i = d < 0 ? t.ndim + d : d;
  return Claim{arg, t.shape[i], cat("dim ", i, " of ", shape_str(t))};
}

int64_t Validator::agree(const std::string& what, const std::vector<Claim>& claims) const {
  size_t best = 0, best_count = 0;
  for (size_t i = 0; i < claims.size(); ++i) {
    size_t count = 0;
    for (const Claim& c : claims) count += c.value == claims[i].value;
    if (count > best_count) best = i, best_count = count;
  }
  const int64_t want = claims[best].value;
  for (const Claim& c : claims) {
    if (c.value == want) continue;
    std::string from;
    for (const Claim& o : claims) {
      if (o.value == want) from += from.empty() ? cat(o.arg, "'s ", o.where) : cat(", ", o.arg, "'s ", o.where);
    }
    fail_shape(c.arg, cat(what, " must equal ", want, " (", from, "); got ", c.value, " (",
                          c.where, ")"));
  }
  return want;
}

void Validator::fail(int32_t code, const char* arg, const std::string& rule) const {
  throw Error(code, cat(op_, ": ", arg, ": ", rule));
}

void Validator::present(const TensorView* t, const char* arg) const {
  if (t == nullptr || (t->data == nullptr && t->numel() > 0)) {
    fail(kErrNullptr, arg, "required tensor must not be null; got null");
  }
}

void Validator::dtype_in(const TensorView& t, const char* arg,
                         std::initializer_list<DType> allowed) const {
  for (DType d : allowed) {
    if (t.dtype == d) return;
  }
  std::string names;
  for (DType d : allowed) names += names.empty() ? dtype_name(d) : cat(", ", dtype_name(d));
  fail(kErrParamInvalid, arg, cat("dtype must be one of {", names, "}; got ", dtype_name(t.dtype)));
}

void Validator::same_dtype(const TensorView& t, const char* arg, DType want,
                           const char* want_from) const {
  if (t.dtype != want) {
    // "must be int32", or "must equal x's dtype (float16)": each dtype named once.
    const std::string rule = std::string(want_from) == dtype_name(want)
                                 ? cat("dtype must be ", dtype_name(want))
                                 : cat("dtype must equal ", want_from, " (", dtype_name(want), ")");
    fail(kErrParamInvalid, arg, cat(rule, "; got ", dtype_name(t.dtype)));
  }
}

void Validator::layout(const TensorView& t, const char* arg, Device device) const {
  if (!t.is_contiguous()) {
    fail(kErrParamInvalid, arg, "tensor must be contiguous (row-major); got a strided view");
  }
  if (t.device != device) {
    fail(kErrParamInvalid, arg,
         cat("tensor must be on the same device as the first input (",
             device == Device::kCPU ? "cpu" : "cuda", "); got ",
             t.device == Device::kCPU ? "cpu" : "cuda"));
  }
}

void Validator::rank(const TensorView& t, const char* arg, int r) const {
  if (t.ndim != r) fail_shape(arg, cat("rank must be ", r, "; got rank ", t.ndim, " ", shape_str(t)));
}

void Validator::rank_in(const TensorView& t, const char* arg, int lo, int hi) const {
  if (t.ndim < lo || t.ndim > hi) {
    fail_shape(arg, cat("rank must be in [", lo, ", ", hi, "]; got rank ", t.ndim, " ", shape_str(t)));
  }
}

void Validator::dim(const TensorView& t, const char* arg, int d, int64_t want,
                    const std::string& what) const {
  if (t.shape[d] != want) {
    fail_shape(arg, cat("dim ", d, " must equal ", what, " (", want, "); got ", t.shape[d], " in ",
                        shape_str(t)));
  }
}

void Validator::shape(const TensorView& t, const char* arg, const Shape& want) const {
  bool ok = t.ndim == static_cast<int>(want.size());
  for (int i = 0; ok && i < t.ndim; ++i) ok = t.shape[i] == want[i];
  if (!ok) {
    std::string w = "[";
    for (size_t i = 0; i < want.size(); ++i) w += (i ? ", " : "") + std::to_string(want[i]);
    fail_shape(arg, cat("shape must be ", w, "]; got ", shape_str(t)));
  }
}

void check_workspace(const char* op, uint64_t need, const void* workspace, uint64_t bytes) {
  if (need == 0) return;
  if (workspace == nullptr || bytes < need) {
    throw Error(kErrParamInvalid, cat(op, ": workspace: must hold at least ", need, " bytes; got ",
                                      workspace == nullptr ? 0 : bytes));
  }
}

void run_now(Executor& executor) {
  std::vector<unsigned char> ws(executor.workspace_size());
  executor.run(ws.empty() ? nullptr : ws.data(), ws.size(), nullptr);
}

namespace {
std::atomic<int> g_num_threads{0};
}

void set_num_threads(int n) { g_num_threads.store(n > 0 ? n : 0); }

int get_num_threads() { return effective_threads(); }

int effective_threads() {
  int n = g_num_threads.load();
  if (n > 0) return n;
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace moegrad
