#include "core/host.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/convert.h"
#include "core/host_simd.h"

#if defined(__linux__)
#include <glob.h>
#include <sys/mman.h>
#endif

namespace moegrad {

namespace {

template <typename I>
void range_impl(const Validator& v, int32_t code, const I* p, int64_t n, const char* arg,
                int64_t lo, int64_t hi) {
  // Fast pass: min and max of the values (SIMD, the best target of the CPU: L112, L127);
  // only a range that fails it is scanned again for the first offending position. A stage-one
  // check runs on every call, so at T = 4096, K = 4 a scalar loop was several microseconds of
  // a call of a few tens.
  if (n <= 0) return;
  I mn, mx;
  index_min_max(p, n, &mn, &mx);
  if (static_cast<int64_t>(mn) >= lo && static_cast<int64_t>(mx) < hi) return;
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] < lo || p[i] >= hi) {
      v.fail(code, arg, cat("values must lie in [", lo, ", ", hi, "); got ", p[i],
                            " at flat position ", i));
    }
  }
}

// Unique check: a table of first positions when the value range is small (linear time, memory
// bounded by the index length); otherwise sorted (value, position) pairs, so huge
// expert_num * expert_capacity attributes do not allocate a table of `hi` entries.
template <typename I>
void unique_impl(const Validator& v, int32_t code, const I* p, int64_t n, const char* arg,
                 int64_t hi) {
  auto fail = [&](I value, int64_t a, int64_t b) {
    v.fail(code, arg, cat("each valid value must appear at most once; got ", value,
                          " at flat positions ", a, " and ", b));
  };
  if (hi <= 4 * n + 4096) {
    std::vector<int64_t> first(static_cast<size_t>(std::max<int64_t>(hi, 0)), -1);
    for (int64_t i = 0; i < n; ++i) {
      if (p[i] < 0) continue;
      int64_t& seen = first[static_cast<size_t>(p[i])];
      if (seen >= 0) fail(p[i], seen, i);
      seen = i;
    }
    return;
  }
  std::vector<std::pair<I, int64_t>> sorted;
  sorted.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] >= 0) sorted.emplace_back(p[i], i);
  }
  std::sort(sorted.begin(), sorted.end());
  // Report the pair whose second position comes first, as the table scan does.
  int64_t best = -1;
  for (size_t j = 1; j < sorted.size(); ++j) {
    if (sorted[j].first == sorted[j - 1].first &&
        (best < 0 || sorted[j].second < sorted[static_cast<size_t>(best)].second)) {
      best = static_cast<int64_t>(j);
    }
  }
  if (best >= 0) {
    const auto& b = sorted[static_cast<size_t>(best)];
    fail(b.first, sorted[static_cast<size_t>(best) - 1].second, b.second);
  }
}

}  // namespace

void check_index_range(const Validator& v, int32_t code, const TensorView& idx, const char* arg,
                       int64_t lo, int64_t hi) {
  if (idx.device != Device::kCPU) return;
  if (idx.dtype == DType::kInt64) {
    range_impl(v, code, static_cast<const int64_t*>(idx.data), idx.numel(), arg, lo, hi);
  } else {
    range_impl(v, code, static_cast<const int32_t*>(idx.data), idx.numel(), arg, lo, hi);
  }
}

void check_index_unique(const Validator& v, int32_t code, const TensorView& idx, const char* arg,
                        int64_t hi) {
  if (idx.device != Device::kCPU) return;
  if (idx.dtype == DType::kInt64) {
    unique_impl(v, code, static_cast<const int64_t*>(idx.data), idx.numel(), arg, hi);
  } else {
    unique_impl(v, code, static_cast<const int32_t*>(idx.data), idx.numel(), arg, hi);
  }
}

Slot index_scratch(WorkspaceLayout& layout, const TensorView& t) {
  return layout.add<int32_t>(t.dtype == DType::kInt64 ? t.numel() : 0);
}

const int32_t* index32(const TensorView& t, int32_t* scratch) {
  if (t.dtype != DType::kInt64) return static_cast<const int32_t*>(t.data);
  const int64_t* src = static_cast<const int64_t*>(t.data);
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) scratch[i] = narrow_index(src[i]);
  return scratch;
}

void advise_huge_pages(void* data, uint64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (data == nullptr) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t end = begin + static_cast<uintptr_t>(bytes);
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = end & ~(kHuge - 1);
  if (last > first && last - first >= 2 * kHuge) {
    madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#else
  (void)data;
  (void)bytes;
#endif
}

bool free_page_reporting(const char* features_glob) {
#if defined(__linux__)
  // Each virtio device's features file is a string of '0'/'1', bit 0 first; the balloon's bit 5
  // is VIRTIO_BALLOON_F_REPORTING.
  if (features_glob == nullptr) {
    features_glob = "/sys/bus/virtio/drivers/virtio_balloon/*/features";
  }
  glob_t g{};
  bool on = false;
  if (glob(features_glob, 0, nullptr, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc && !on; ++i) {
      std::ifstream f(g.gl_pathv[i]);
      std::string bits;
      on = static_cast<bool>(f >> bits) && bits.size() > 5 && bits[5] == '1';
    }
  }
  globfree(&g);
  return on;
#else
  (void)features_glob;
  return false;
#endif
}

uint64_t huge_page_min_bytes(const char* setting, bool reporting) {
  constexpr uint64_t kNever = ~uint64_t{0};
  const std::string_view v = setting == nullptr ? std::string_view() : std::string_view(setting);
  if (v == "0") return kNever;
  if (v == "1") return 0;
  if (v == "2") return uint64_t{32} << 20;
  return reporting ? kNever : uint64_t{32} << 20;
}

void advise_output(const TensorView& t) {
  if (t.device != Device::kCPU || t.data == nullptr) return;
  // L223: only outputs of at least 32 MiB, glibc's largest mmap threshold: those are always
  // fresh mappings, faulted in page by page. Smaller ones may come back from the heap already
  // faulted, and advising them only made training steps slow at random. L225: none on a VM
  // whose balloon reports free pages, where an advised fault after a pause is filled again by
  // the host. Read once.
  static const uint64_t min_bytes =
      huge_page_min_bytes(std::getenv("MOEGRAD_HUGE_PAGES"), free_page_reporting());
  const uint64_t bytes = static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype);
  if (bytes >= min_bytes && min_bytes != ~uint64_t{0}) advise_huge_pages(t.data, bytes);
}

}  // namespace moegrad
