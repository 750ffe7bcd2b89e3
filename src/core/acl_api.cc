// Tensor handles, executor registry and error slot of the C API.
#include "core/acl_api.h"

#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "core/check.h"

#if defined(MOEGRAD_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace moegrad {

namespace {

thread_local std::string t_last_error;

// What an aclOpExecutor* handle stands for. The handle itself is never dereferenced: it is a
// serial number (docs/decisions.md L83) looked up in the registry, so a consumed or destroyed
// handle stays unknown for the life of the process, even after its memory was reused by a
// later executor (a freed address would be handed out again, a serial never is).
struct ExecutorEntry {
  ExecutorPtr impl;
  const char* op = "";      // the operator whose stage one made it (a string literal)
  bool repeatable = false;  // both flags are guarded by the registry mutex
  bool running = false;     // a repeatable executor's stage two is in progress
};

std::mutex g_registry_mutex;
std::unordered_map<uint64_t, std::unique_ptr<ExecutorEntry>>& registry() {
  // never destroyed: no exit races with threads still calling in
  static auto* r = new std::unordered_map<uint64_t, std::unique_ptr<ExecutorEntry>>();
  return *r;
}
uint64_t g_next_serial = 1;  // guarded by the registry mutex; never reused

// Handles are 8-aligned values with the top byte 0x4D ('M'): a non-canonical address on x86-64
// and AArch64, so no real pointer equals one, and a stray pointer passed as an executor is an
// unknown key rather than a match. The serial sits in bits 3..55.
constexpr uint64_t kHandleTag = uint64_t{0x4D} << 56;
constexpr uint64_t kSerialMask = (uint64_t{1} << 53) - 1;
static_assert(sizeof(uintptr_t) == 8, "executor handles are 64-bit values");

aclOpExecutor* handle_of(uint64_t serial) {
  return reinterpret_cast<aclOpExecutor*>(static_cast<uintptr_t>(kHandleTag | (serial << 3)));
}
// The registry key of a handle; 0 (never a serial) for anything that is not one.
uint64_t serial_of(const aclOpExecutor* h) {
  const uint64_t v = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(h));
  if ((v & ~(kSerialMask << 3)) != kHandleTag) return 0;
  return v >> 3 & kSerialMask;
}

// Every check-then-act on an executor happens under the registry lock, so executors shared
// across threads give a status, never a use-after-free or a double free: a one-shot executor is
// taken out of the registry by exactly one caller; a repeatable one is marked running, and a
// second concurrent run or a destroy during a run are refused.
enum class Use { kUnknown, kOtherOp, kBusy, kOneShot, kRepeatable };

// On kOneShot `owned` receives the entry (out of the registry); on kRepeatable `entry` points to
// it (it stays registered, marked running, until end_run).
// An executor made by another operator's stage one is refused before it is consumed: its
// `other_op` is set and it stays as it was.
Use begin_run(const char* op, const aclOpExecutor* h, std::unique_ptr<ExecutorEntry>& owned,
              ExecutorEntry*& entry, const char*& other_op) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  auto it = registry().find(serial_of(h));
  if (it == registry().end()) return Use::kUnknown;
  if (std::strcmp(it->second->op, op) != 0) {
    other_op = it->second->op;
    return Use::kOtherOp;
  }
  if (it->second->running) return Use::kBusy;
  if (!it->second->repeatable) {
    owned = std::move(it->second);
    registry().erase(it);
    return Use::kOneShot;
  }
  entry = it->second.get();
  entry->running = true;
  return Use::kRepeatable;
}

void end_run(ExecutorEntry* e) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  e->running = false;
}

[[noreturn]] void busy(const char* op) {
  throw Error(kErrParamInvalid, cat(op, ": executor: must not be in use by another thread; got "
                                        "an executor whose stage two is running"));
}

DType dtype_from_acl(const aclDataType& dt) {
  // A C caller may pass any int: read the bits, not the enum (a C++ load of an out-of-range
  // enum value is undefined).
  int32_t code;
  static_assert(sizeof code == sizeof dt, "aclDataType is an int");
  std::memcpy(&code, &dt, sizeof code);
  switch (code) {
    case ACL_FLOAT: return DType::kFloat32;
    case ACL_FLOAT16: return DType::kFloat16;
    case ACL_BF16: return DType::kBFloat16;
    case ACL_INT32: return DType::kInt32;
    case ACL_INT64: return DType::kInt64;
    // Other codes are kept as they are (DType's values are aclDataType's), so a dtype error can
    // name the dtype seen; no operator accepts them.
    default: return code >= 0 && code < 64 ? static_cast<DType>(code) : DType::kOther;
  }
}

// Where a tensor's memory lives. A CUDA build asks the runtime, so ported aclnn code can pass
// device pointers: device and managed memory give a CUDA view on the owning device (managed
// memory runs on the GPU, where the caller's stream orders it). Host memory, pinned or not, and
// every pointer of a CPU-only build give a CPU view.
void locate(moegrad::TensorView& v, const void* data) {
  v.device = moegrad::Device::kCPU;
  v.device_id = 0;
#if defined(MOEGRAD_WITH_CUDA)
  if (data == nullptr) return;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, data) != cudaSuccess) {
    (void)cudaGetLastError();  // an unregistered host pointer is not an error here
    return;
  }
  if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) {
    v.device = moegrad::Device::kCUDA;
    v.device_id = attr.device;
  }
#else
  (void)data;
#endif
}

int64_t element_size(const aclDataType& dt) {
  int32_t t;  // the bits, not the enum (see dtype_from_acl)
  std::memcpy(&t, &dt, sizeof t);
  switch (t) {
    case ACL_INT8: case ACL_UINT8: case ACL_BOOL: case ACL_HIFLOAT8: case ACL_FLOAT8_E5M2:
    case ACL_FLOAT8_E4M3FN: case ACL_FLOAT8_E8M0: return 1;
    case ACL_FLOAT16: case ACL_BF16: case ACL_INT16: case ACL_UINT16: return 2;
    case ACL_FLOAT: case ACL_INT32: case ACL_UINT32: return 4;
    case ACL_INT64: case ACL_UINT64: case ACL_DOUBLE: case ACL_COMPLEX64: return 8;
    case ACL_COMPLEX128: return 16;
    default: return 0;
  }
}

}  // namespace

void set_last_error(const char* message) { t_last_error = message; }

aclOpExecutor* publish_executor(const char* op, ExecutorPtr executor) {
  auto e = std::make_unique<ExecutorEntry>();
  e->impl = std::move(executor);
  e->op = op;
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  if (g_next_serial > kSerialMask) {
    // 2^53 - 1 executors per process: far beyond any real run, but never wrap onto a serial
    throw std::runtime_error("executor: at most 2^53 - 1 executors per process; got one more");
  }
  const uint64_t serial = g_next_serial++;
  registry().emplace(serial, std::move(e));
  return handle_of(serial);
}

aclnnStatus stage_two(const char* op, void* workspace, uint64_t workspace_size,
                      aclOpExecutor* executor, void* stream) noexcept {
  return api_guard([&] {
    if (executor == nullptr) {
      throw Error(kErrNullptr, cat(op, ": executor: must not be null; got null"));
    }
    std::unique_ptr<ExecutorEntry> owned;
    ExecutorEntry* entry = nullptr;
    const char* other_op = nullptr;
    const Use use = begin_run(op, executor, owned, entry, other_op);
    if (use == Use::kUnknown) {
      throw Error(kErrParamInvalid, cat(op, ": executor: must come from a GetWorkspaceSize call "
                                            "and not be consumed or destroyed; got an unknown "
                                            "executor"));
    }
    if (use == Use::kOtherOp) {
      throw Error(kErrParamInvalid, cat(op, ": executor: must come from this operator's "
                                            "GetWorkspaceSize; got one of ", other_op,
                                            " (left as it was)"));
    }
    if (use == Use::kBusy) busy(op);
    if (use == Use::kRepeatable) {
      struct EndRun {
        ExecutorEntry* e;
        ~EndRun() { end_run(e); }
      } end{entry};
      entry->impl->run(workspace, workspace_size, stream);
      return;
    }
    // One-shot: consumed whether or not the run succeeds, as in aclnn.
    owned->impl->run(workspace, workspace_size, stream);
  });
}

}  // namespace moegrad

using moegrad::api_guard;
using moegrad::cat;
using moegrad::Error;

extern "C" {

aclTensor* aclCreateTensor(const int64_t* viewDims, uint64_t viewDimsNum, aclDataType dataType,
                           const int64_t* stride, int64_t offset, aclFormat format,
                           const int64_t* storageDims, uint64_t storageDimsNum,
                           void* tensorData) {
  aclTensor* out = nullptr;
  aclnnStatus st = api_guard([&] {
    if (viewDimsNum > static_cast<uint64_t>(moegrad::kMaxDims)) {
      throw Error(moegrad::kErrParamInvalid,
                  cat("aclCreateTensor: viewDimsNum: must be <= ", moegrad::kMaxDims, "; got ", viewDimsNum));
    }
    if (viewDimsNum > 0 && viewDims == nullptr) {
      throw Error(moegrad::kErrNullptr, "aclCreateTensor: viewDims: must not be null; got null");
    }
    if (offset < 0) {
      throw Error(moegrad::kErrParamInvalid, cat("aclCreateTensor: offset: must be >= 0; got ", offset));
    }
    auto t = std::make_unique<aclTensor>();
    moegrad::TensorView& v = t->view;
    std::memcpy(&v.format, &format, sizeof v.format);  // the bits: a C caller may pass any int
    static_assert(sizeof v.format == sizeof format, "aclFormat is an int");
    v.dtype = moegrad::dtype_from_acl(dataType);
    v.ndim = static_cast<int32_t>(viewDimsNum);
    int64_t expect = 1;
    for (int i = v.ndim - 1; i >= 0; --i) {
      if (viewDims[i] < 0) {
        throw Error(moegrad::kErrParamInvalid,
                    cat("aclCreateTensor: viewDims: must be >= 0; got ", viewDims[i], " at ", i));
      }
      v.shape[i] = viewDims[i];
      v.strides[i] = stride ? stride[i] : expect;
      expect = moegrad::mul_sat(expect, viewDims[i]);
    }
    const int64_t esize = moegrad::element_size(dataType);
    // Sizes are computed in int64 everywhere: a tensor whose byte size (or offset) does not fit
    // is refused here rather than overflowing later.
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    if (moegrad::mul_sat(v.numel(), esize > 0 ? esize : 1) == kMax) {
      throw Error(moegrad::kErrParamInvalid,
                  cat("aclCreateTensor: viewDims: the byte size must fit in int64; got shape ",
                      moegrad::shape_str(v)));
    }
    if (moegrad::mul_sat(offset, esize > 0 ? esize : 1) == kMax) {
      throw Error(moegrad::kErrParamInvalid,
                  cat("aclCreateTensor: offset: offset * element size must fit in int64; got ",
                      offset));
    }
    (void)storageDims;  // the view alone describes the data (ND only)
    (void)storageDimsNum;
    v.data = tensorData ? static_cast<char*>(tensorData) + offset * esize : nullptr;
    moegrad::locate(v, tensorData);
    out = t.release();
  });
  return st == ACLNN_SUCCESS ? out : nullptr;
}

aclnnStatus aclDestroyTensor(const aclTensor* tensor) {
  delete tensor;
  return ACLNN_SUCCESS;
}

aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor* executor) {
  return api_guard([&] {
    std::lock_guard<std::mutex> lock(moegrad::g_registry_mutex);
    auto it = moegrad::registry().find(moegrad::serial_of(executor));
    if (it == moegrad::registry().end()) {
      throw Error(moegrad::kErrParamInvalid,
                  "aclSetAclOpExecutorRepeatable: executor: must be a live executor; got an "
                  "unknown one");
    }
    it->second->repeatable = true;
  });
}

aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor* executor) {
  return api_guard([&] {
    if (executor == nullptr) return;
    std::unique_ptr<moegrad::ExecutorEntry> owned;  // freed after the lock is released
    {
      std::lock_guard<std::mutex> lock(moegrad::g_registry_mutex);
      auto it = moegrad::registry().find(moegrad::serial_of(executor));
      if (it == moegrad::registry().end()) {
        throw Error(moegrad::kErrParamInvalid,
                    "aclDestroyAclOpExecutor: executor: must be a live executor; got an unknown "
                    "one (already consumed or destroyed)");
      }
      if (it->second->running) {
        throw Error(moegrad::kErrParamInvalid,
                    "aclDestroyAclOpExecutor: executor: must not be in use by another thread; "
                    "got an executor whose stage two is running");
      }
      owned = std::move(it->second);
      moegrad::registry().erase(it);
    }
  });
}

const char* aclGetRecentErrMsg(void) { return moegrad::t_last_error.c_str(); }

void moegradSetNumThreads(int n) { moegrad::set_num_threads(n); }

int moegradGetNumThreads(void) { return moegrad::get_num_threads(); }

const char* moegradVersion(void) { return MOEGRAD_VERSION_STRING; }

}  // extern "C"
