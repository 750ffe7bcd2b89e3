// libFuzzer harness: the handle calls of the C API. aclCreateTensor with arbitrary dims, strides,
// offsets, dtypes and formats must return a handle or NULL with a message; the executor calls
// with arbitrary pointer values (never dereferenced: executors are looked up in a registry)
// must return a status.
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider p(data, size);
  const uint64_t rank = p.ConsumeIntegralInRange<uint64_t>(0, 20);
  std::vector<int64_t> dims, strides;
  for (uint64_t i = 0; i < rank; ++i) {
    dims.push_back(p.ConsumeBool() ? p.ConsumeIntegralInRange<int64_t>(-2, 6) : p.ConsumeIntegral<int64_t>());
    strides.push_back(p.ConsumeIntegral<int64_t>());
  }
  // Codes inside the enum's value range (-64..63 for these enumerators); a C caller may pass any
  // int, which the library reads as bits, but C++ code cannot even hold one outside the range.
  const auto dt = static_cast<aclDataType>(p.ConsumeIntegralInRange<int>(-64, 63));
  const int64_t offset = p.ConsumeBool() ? 0 : p.ConsumeIntegral<int64_t>();
  const bool with_strides = p.ConsumeBool();
  const bool null_dims = p.ConsumeIntegralInRange<int>(0, 15) == 0;
  aclTensor* t = aclCreateTensor(null_dims ? nullptr : dims.data(), rank, dt,
                                 with_strides ? strides.data() : nullptr, offset, ACL_FORMAT_ND,
                                 dims.data(), rank, nullptr);
  if (t == nullptr && std::string(aclGetRecentErrMsg()).rfind("aclCreateTensor: ", 0) != 0) {
    mgfuzz::finding("aclCreateTensor failed without a message", aclGetRecentErrMsg());
  }
  if (t != nullptr && aclDestroyTensor(t) != ACLNN_SUCCESS) mgfuzz::finding("aclDestroyTensor", "");
  // Executor calls on pointers that were never executors.
  auto* bogus = reinterpret_cast<aclOpExecutor*>(p.ConsumeIntegral<uintptr_t>() | 1u);
  if (aclSetAclOpExecutorRepeatable(bogus) != ACLNN_ERR_PARAM_INVALID ||
      aclDestroyAclOpExecutor(bogus) != ACLNN_ERR_PARAM_INVALID ||
      aclnnMoeGatingTopKBackward(nullptr, 0, bogus, nullptr) != ACLNN_ERR_PARAM_INVALID ||
      aclnnSwigluGroup(nullptr, 0, bogus, nullptr) != ACLNN_ERR_PARAM_INVALID) {
    mgfuzz::finding("a bogus executor was accepted", aclGetRecentErrMsg());
  }
  return 0;
}
