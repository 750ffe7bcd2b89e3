// Error type, tensor views, validation helpers and threads shared by all operators.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "core/backend.h"
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
  // A rank outside [0, kMaxDims] (refused by stage one) reads no memory past shape[].
  const int nd = ndim < 0 ? 0 : ndim > kMaxDims ? kMaxDims : ndim;
  int64_t n = 1;
  for (int i = 0; i < nd; ++i) {
    if (shape[i] == 0) return 0;
  }
  for (int i = 0; i < nd; ++i) n = mul_sat(n, shape[i]);
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expect = 1;
  for (int i = (ndim > kMaxDims ? kMaxDims : ndim) - 1; i >= 0; --i) {
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
  return Claim{arg, t.shape[i], &t, i, Claim::kDim};
}

Claim rank_claim(const TensorView& t, const char* arg) {
  return Claim{arg, t.ndim, &t, 0, Claim::kRank};
}

Claim half_dim_claim(const TensorView& t, const char* arg, int d) {
  const int i = d < 0 ? t.ndim + d : d;
  return Claim{arg, t.shape[i] / 2, &t, i, Claim::kHalfDim};
}

std::optional<Claim> witness_claim(const TensorView& t, const char* arg, int d, int64_t div) {
  const int i = d < 0 ? t.ndim + d : d;
  if (div < 1 || t.shape[i] % div != 0) return std::nullopt;
  return Claim{arg, t.shape[i] / div, &t, i, Claim::kQuotient, div, false};
}

std::string Claim::where() const {
  switch (kind) {
    case kRank: return cat("rank of ", shape_str(*t));
    case kHalfDim: return cat("half of dim ", dim, " of ", shape_str(*t));
    case kQuotient: return cat("dim ", dim, " of ", shape_str(*t), " over ", div);
    default: return cat("dim ", dim, " of ", shape_str(*t));
  }
}

int64_t Validator::agree(const char* what, const std::vector<Claim>& claims) const {
  size_t best = 0, best_count = 0;
  for (size_t i = 0; i < claims.size(); ++i) {
    if (!claims[i].blame) continue;
    size_t count = 0;
    for (const Claim& c : claims) count += c.value == claims[i].value;
    if (count > best_count) best = i, best_count = count;
  }
  const int64_t want = claims[best].value;
  for (const Claim& c : claims) {
    if (c.value == want || !c.blame) continue;
    std::string from;
    for (const Claim& o : claims) {
      if (o.value == want) from += from.empty() ? cat(o.arg, "'s ", o.where()) : cat(", ", o.arg, "'s ", o.where());
    }
    fail_shape(c.arg, cat(what, " must equal ", want, " (", from, "); got ", c.value, " (",
                          c.where(), ")"));
  }
  return want;
}

void Validator::fail(int32_t code, const char* arg, const std::string& rule) const {
  throw Error(code, cat(op_, ": ", arg, ": ", rule));
}

void Validator::present(const TensorView* t, const char* arg) const {
  if (t == nullptr) fail(kErrNullptr, arg, "required tensor must not be null; got null");
  geometry(*t, arg);  // before numel(): a rank above kMaxDims has no meaningful element count
  if (t->data == nullptr && t->numel() > 0) {
    fail(kErrNullptr, arg, "required tensor must not be null; got null");
  }
}

void Validator::geometry(const TensorView& t, const char* arg) const {
  if (t.ndim < 0 || t.ndim > kMaxDims) {
    fail(kErrParamInvalid, arg, cat("rank must be in [0, ", kMaxDims, "]; got ", t.ndim));
  }
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) fail(kErrParamInvalid, arg, cat("dims must be >= 0; got ", t.shape[i],
                                                        " at ", i, " of ", shape_str(t)));
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

void Validator::index_dtype(const TensorView& t, const char* arg) const {
  if (t.dtype != DType::kInt32 && t.dtype != DType::kInt64) {
    fail(kErrParamInvalid, arg,
         cat("dtype must be int32; got ", dtype_name(t.dtype), " (int64 is accepted too)"));
  }
}

void Validator::contiguous(const TensorView& t, const char* arg) const {
  // Optional tensors reach here without present(): a non-empty one needs its data (161001, L55).
  if (t.data == nullptr && t.numel() > 0) {
    fail(kErrNullptr, arg, cat("a non-empty tensor must not have a null data pointer; got null "
                               "data for shape ", shape_str(t)));
  }
  if (!t.is_contiguous()) {
    fail(kErrParamInvalid, arg, "tensor must be contiguous (row-major); got a strided view");
  }
  // aclFormat codes: NCHW 0, NHWC 1, ND 2, NDHWC 27, NCDHW 30 are plain row-major data; the
  // blocked ones (NC1HWC0 3, FRACTAL_Z 4, FRACTAL_NZ 29, ...) would be read wrongly.
  switch (t.format) {
    case 0: case 1: case 2: case 27: case 30: break;
    default: {
      const char* name = t.format == 3 ? " (NC1HWC0)" : t.format == 4 ? " (FRACTAL_Z)"
                       : t.format == 29 ? " (FRACTAL_NZ)" : t.format == -1 ? " (UNDEFINED)" : "";
      fail(kErrParamInvalid, arg, cat("format must be ND (NCHW, NHWC, NCDHW and NDHWC are read "
                                      "as ND); got ", t.format, name));
    }
  }
}

void require_index32(const char* op, const TensorView* t, const char* arg) {
  if (t != nullptr && t->dtype != DType::kInt32) {
    throw Error(kErrParamInvalid,
                cat(op, ": ", arg, ": dtype must be int32; got ", dtype_name(t->dtype)));
  }
}

namespace {
std::atomic<uint64_t> g_validations{0};

bool same_shape(const TensorView& t, const Shape& s) {
  if (t.ndim != static_cast<int>(s.size())) return false;
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] != s[i]) return false;
  }
  return true;
}

std::string shape_of(const Shape& s) {
  std::string w = "[";
  for (size_t i = 0; i < s.size(); ++i) w += (i ? ", " : "") + std::to_string(s[i]);
  return w + "]";
}
}  // namespace

void note_validation() { g_validations.fetch_add(1, std::memory_order_relaxed); }
uint64_t validation_count() { return g_validations.load(std::memory_order_relaxed); }

const char* backend_name(Backend b) { return b == Backend::kCUDA ? "cuda" : "cpu"; }

std::string device_str(Device d, int32_t id) {
  switch (d) {
    case Device::kCPU: return "cpu";
    case Device::kCUDA: return cat("cuda:", id);
    default: return cat("device type ", static_cast<int32_t>(d));
  }
}

namespace {

// The bytes [lo, hi) a view can touch (a bound for strided views); {0, 0} without elements.
std::pair<uintptr_t, uintptr_t> byte_span(const TensorView& t) {
  if (t.data == nullptr || t.numel() == 0) return {0, 0};
  int64_t lo = 0, hi = 0;
  for (int i = 0; i < t.ndim; ++i) {
    const int64_t reach = mul_sat(t.shape[i] - 1, t.strides[i] < 0 ? -t.strides[i] : t.strides[i]);
    if (t.strides[i] < 0) lo = add_sat(lo, -reach); else hi = add_sat(hi, reach);
  }
  const int64_t es = std::max<int64_t>(dtype_size(t.dtype), 1);
  const auto base = reinterpret_cast<uintptr_t>(t.data);
  return {base + static_cast<uintptr_t>(lo * es), base + static_cast<uintptr_t>((hi + 1) * es)};
}

bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.ndim != b.ndim || a.dtype != b.dtype) return false;
  for (int i = 0; i < a.ndim; ++i) {
    if (a.shape[i] != b.shape[i] || a.strides[i] != b.strides[i]) return false;
  }
  return true;
}

}  // namespace

Backend select_backend(const Validator& v, std::initializer_list<NamedView> tensors,
                       size_t n_inputs, const char* in_place_out, const char* in_place_in) {
  const NamedView& first = *tensors.begin();
  const Device dev = first.view->device;
  const int32_t id = first.view->device_id;
  Backend backend = Backend::kCPU;
  switch (dev) {
    case Device::kCPU: break;
    case Device::kCUDA:
#if defined(MOEGRAD_WITH_CUDA)
      backend = Backend::kCUDA;
      break;
#else
      v.fail(kErrParamInvalid, first.name,
             cat("tensor is on ", device_str(dev, id),
                 " but moegrad was built without CUDA (MOEGRAD_WITH_CUDA=OFF); got a cuda "
                 "tensor"));
#endif
    default:
      v.fail(kErrParamInvalid, first.name,
             cat("tensor must be on cpu or cuda; got ", device_str(dev, id)));
  }
  for (const NamedView& t : tensors) {
    if (t.view != nullptr) v.geometry(*t.view, t.name);  // optional ones: first look here
    if (t.view == nullptr || t.view == first.view) continue;
    if (t.view->device != dev || (dev == Device::kCUDA && t.view->device_id != id)) {
      v.fail(kErrParamInvalid, t.name,
             cat("tensor must be on the device of ", first.name, " (", device_str(dev, id),
                 "); got ", device_str(t.view->device, t.view->device_id)));
    }
  }
  const NamedView* list = tensors.begin();
  const size_t n = tensors.size();
  for (size_t o = n_inputs; o < n; ++o) {
    if (list[o].view == nullptr) continue;
    const auto [olo, ohi] = byte_span(*list[o].view);
    const bool may_be_in_place = in_place_out && std::strcmp(list[o].name, in_place_out) == 0;
    for (size_t j = 0; j < o; ++j) {
      if (list[j].view == nullptr) continue;
      const auto [jlo, jhi] = byte_span(*list[j].view);
      if (olo >= jhi || jlo >= ohi) continue;
      if (may_be_in_place && backend == Backend::kCPU &&
          std::strcmp(list[j].name, in_place_in) == 0 && same_view(*list[o].view, *list[j].view)) {
        continue;
      }
      v.fail(kErrParamInvalid, list[o].name,
             cat("output memory must not overlap ", list[j].name, "'s",
                 may_be_in_place
                     ? cat(" (in place only as exactly ", in_place_in, "'s view, on the CPU)")
                     : std::string(" (not computed in place)"),
                 "; got overlapping memory"));
    }
  }
  return backend;
}

void require_kernel(const char* op, Backend b, bool available) {
  if (!available) {
    throw Error(kErrParamInvalid, cat(op, ": device: this build has no ", backend_name(b),
                                      " kernel for this operator; got ", backend_name(b),
                                      " tensors"));
  }
}

void bind_output(const PlanBase& p, size_t i, const TensorView* t, TensorView& slot) {
  const OutputSpec& spec = p.outputs[i];
  const char* name = p.out_names[i];
  if (t == nullptr || (t->data == nullptr && t->numel() > 0)) {
    if (spec.optional && t == nullptr) {
      slot = TensorView{};
      return;
    }
    throw Error(kErrNullptr, cat(p.op, ": ", name, ": required tensor must not be null; got null"));
  }
  // uint8 is the storage of a planned 8-bit float output (frameworks without float8, L26).
  const bool fp8_storage = t->dtype == DType::kUInt8 &&
                           (spec.dtype == DType::kFloat8E4M3FN || spec.dtype == DType::kFloat8E5M2 ||
                            spec.dtype == DType::kFloat8E8M0);
  if (t->dtype != spec.dtype && !fp8_storage) {
    throw Error(kErrParamInvalid, cat(p.op, ": ", name, ": dtype must be ",
                                      dtype_name(spec.dtype), " as planned; got ",
                                      dtype_name(t->dtype)));
  }
  if (!t->is_contiguous()) {
    throw Error(kErrParamInvalid, cat(p.op, ": ", name,
                                      ": tensor must be contiguous (row-major); got a strided "
                                      "view"));
  }
  if (t->device != p.device || (p.device == Device::kCUDA && t->device_id != p.device_id)) {
    throw Error(kErrParamInvalid, cat(p.op, ": ", name, ": tensor must be on the planned device (",
                                      device_str(p.device, p.device_id), "); got ",
                                      device_str(t->device, t->device_id)));
  }
  if (!same_shape(*t, spec.shape)) {
    throw Error(p.shape_code, cat(p.op, ": ", name, ": shape must be ", shape_of(spec.shape),
                                  " as planned; got ", shape_str(*t)));
  }
  slot = *t;
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
