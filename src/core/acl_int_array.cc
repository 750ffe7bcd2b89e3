// aclCreateIntArray / aclDestroyIntArray.
#include "core/acl_int_array.h"

#include <new>

#include "core/acl_api.h"

extern "C" {

aclIntArray* aclCreateIntArray(const int64_t* value, uint64_t size) {
  aclIntArray* out = nullptr;
  const aclnnStatus st = moegrad::api_guard([&] {
    if (value == nullptr && size > 0) {
      throw moegrad::Error(moegrad::kErrNullptr,
                           "aclCreateIntArray: value: must not be null when size > 0; got null");
    }
    out = new aclIntArray{std::vector<int64_t>(value, value + size)};
  });
  return st == ACLNN_SUCCESS ? out : nullptr;
}

aclnnStatus aclDestroyIntArray(const aclIntArray* array) {
  delete array;
  return ACLNN_SUCCESS;
}

}  // extern "C"
