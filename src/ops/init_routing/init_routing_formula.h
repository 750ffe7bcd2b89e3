// The scalar init-routing math that the CPU and CUDA kernels share, one definition compiled for
// both (MOEGRAD_HD: __host__ __device__ under nvcc, inline otherwise): the destination row of a
// sorted slot (dropless, drop-pad capacity, D25-D27), the three encodings of the expert token
// counts (D26), the aligned-block layout (D36) and the grad's row test (D29). docs/operators.md
// §8.5, §8.8, §8.9, §8.13.
#ifndef MOEGRAD_OPS_INIT_ROUTING_INIT_ROUTING_FORMULA_H_
#define MOEGRAD_OPS_INIT_ROUTING_INIT_ROUTING_FORMULA_H_

#include <cstdint>

#include "core/convert.h"

namespace moegrad {
namespace init_routing_formula {

// The expanded row of the slot at sorted position d, the q = d - start-th slot of its expert's
// bin b: d itself (dropless), else row b * cap + q while q < cap (the lowest tokens are kept),
// -1 past the capacity (dropped).
MOEGRAD_HD int32_t dest_row(int64_t d, int64_t b, int64_t start, bool drop_pad, int64_t cap) {
  if (!drop_pad) return static_cast<int32_t>(d);
  const int64_t q = d - start;
  return q < cap ? static_cast<int32_t>(b * cap + q) : -1;
}

// The source slot of expanded row j in drop-pad mode: bin b = j / cap, rank q = j % cap, the
// bin's q-th sorted position when it holds more than q slots, else -1 (a zero row).
MOEGRAD_HD int64_t drop_pad_source(int64_t j, int64_t cap, const int32_t* starts) {
  const int64_t b = j / cap, q = j % cap;
  return q < starts[b + 1] - starts[b] ? starts[b] + q : -1;
}

// expert_tokens_count_or_cumsum of bin b whose sorted slots are [start, end): type 0 the running
// total (cumsum, the bin's end), type 1 the count. Type 2 (key-value) writes (id, count) pairs
// of the non-empty bins only.
MOEGRAD_HD int64_t token_value(int64_t type, int64_t start, int64_t end) {
  return type == 0 ? end : end - start;
}

// D36 aligned blocks: the rows an expert block of `count` slots takes, rounded up to a multiple
// of align.
MOEGRAD_HD int64_t padded_block_rows(int64_t count, int64_t align) {
  return (count + align - 1) / align * align;
}

// D36 aligned blocks: the sorted position whose row is expanded row j, or -1 (a padding row,
// +0.0). poff[0..bins] are the padded block starts (poff[bins]: the end of the last block),
// starts[0..bins] the experts' first sorted positions; j in block b = the last b with
// poff[b] <= j (binary search).
MOEGRAD_HD int64_t aligned_source(int64_t j, int64_t bins, const int32_t* poff,
                                  const int32_t* starts) {
  if (j >= poff[bins]) return -1;
  int64_t lo = 0, hi = bins;  // poff[lo] <= j < poff[hi]
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (poff[mid] <= j) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const int64_t q = j - poff[lo];
  return q < starts[lo + 1] - starts[lo] ? starts[lo] + q : -1;
}

// The grad reads the expanded row d of a slot when it lies in [0, rows): -1 (dropped, outside
// the window) and rows truncated by active_num are skipped (D29).
MOEGRAD_HD bool grad_row_valid(int64_t d, int64_t rows) { return d >= 0 && d < rows; }

}  // namespace init_routing_formula
}  // namespace moegrad

#endif  // MOEGRAD_OPS_INIT_ROUTING_INIT_ROUTING_FORMULA_H_
