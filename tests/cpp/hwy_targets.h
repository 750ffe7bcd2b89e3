// Runs a test body once per compiled Highway target the CPU supports (test_simd.cc, test_fp8.cc).
#ifndef MOEGRAD_TESTS_CPP_HWY_TARGETS_H_
#define MOEGRAD_TESTS_CPP_HWY_TARGETS_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "hwy/highway.h"
#include "hwy/targets.h"

namespace moegrad_test {

// Calls f(target) with dispatch pinned to each target in turn, then restores normal dispatch.
template <typename F>
void for_each_target(F&& f) {
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  for (int64_t t : targets) {
    hwy::SetSupportedTargetsForTest(t);
    SCOPED_TRACE(hwy::TargetName(t));
    f(t);
  }
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace moegrad_test

#endif  // MOEGRAD_TESTS_CPP_HWY_TARGETS_H_
