// The aclIntArray handle of the C API (a copied list of int64 values).
#ifndef MOEGRAD_CORE_ACL_INT_ARRAY_H_
#define MOEGRAD_CORE_ACL_INT_ARRAY_H_

#include <cstdint>
#include <vector>

#include "moegrad/aclnn.h"

struct aclIntArray {
  std::vector<int64_t> values;
};

#endif  // MOEGRAD_CORE_ACL_INT_ARRAY_H_
