// Host-side helpers: index value checks (decisions.md D6; device tensors are not read on the host,
// kernels skip invalid indices instead), the CPU-device rule, and output memory advice.
#ifndef MOEGRAD_CORE_HOST_H_
#define MOEGRAD_CORE_HOST_H_

#include <cstdint>

#include "core/check.h"
#include "core/workspace.h"

namespace moegrad {

// Every value of a host int32/int64 tensor lies in [lo, hi); else `code`, naming the first bad
// position and value (so int64 values outside int32 are rejected too).
void check_index_range(const Validator& v, int32_t code, const TensorView& idx, const char* arg,
                       int64_t lo, int64_t hi);

// Every value of a host int32/int64 tensor that is >= 0 appears at most once (values are already
// known to be < hi).
void check_index_unique(const Validator& v, int32_t code, const TensorView& idx, const char* arg,
                        int64_t hi);

// Stage one: workspace for index32 (int64 tensors only; an empty slot for int32).
Slot index_scratch(WorkspaceLayout& layout, const TensorView& t);
// Stage two (CPU): the int32 values of an index tensor: its own data when int32, else its int64
// values narrowed into `scratch` (stage one checked that they fit).
const int32_t* index32(const TensorView& t, int32_t* scratch);

// Advises the kernel to back a large host output with transparent huge pages before it is first
// written: one fault per 2 MiB instead of per 4 KiB. By default only outputs of at least 32 MiB,
// and none on a VM whose balloon reports free pages (free_page_reporting). MOEGRAD_HUGE_PAGES=0
// never, =1 every output of at least two huge pages, =2 outputs of at least 32 MiB even there
// (docs/decisions.md L223, L225). Advice only; a no-op where unsupported.
void advise_output(const TensorView& t);
// The smallest output advise_output advises for MOEGRAD_HUGE_PAGES = setting (nullptr: unset)
// on a machine that does (reporting) or does not report free pages; ~0 for never.
uint64_t huge_page_min_bytes(const char* setting, bool reporting);
// Whether a virtio balloon of this Linux guest reports free pages to its host
// (VIRTIO_BALLOON_F_REPORTING, bit 5 of the features files matching features_glob; nullptr: the
// balloon driver's devices in sysfs); false elsewhere.
bool free_page_reporting(const char* features_glob = nullptr);
// The advice itself, for `bytes` of host memory at `data`, whatever its size and the variable:
// only whole 2 MiB pages inside it, and only when there are at least two.
void advise_huge_pages(void* data, uint64_t bytes);

}  // namespace moegrad

#endif  // MOEGRAD_CORE_HOST_H_
