// libFuzzer harness: aclnnMoeInitRoutingV3GetWorkspaceSize + aclnnMoeInitRoutingV3 (with
// aclCreateIntArray for the active expert range).
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mgfuzz::Fuzz f(data, size);
  const int64_t R = f.dim(0, 10), K = f.dim(0, 4), H = f.dim(0, 12), E = f.dim(1, 6),
                C = f.dim(0, 5);
  const int64_t mode = f.attr(f.dim(0, 1));
  const int64_t active = f.attr(f.coin() ? int64_t{0} : f.dim(0, R * K + 1));
  const int64_t capacity = f.attr(C), expert_num = f.attr(E);
  const int64_t tokens_type = f.attr(f.dim(0, 2));
  const bool tokens_flag = f.coin();
  const int64_t quant_mode = f.coin(16) ? f.attr(int64_t{0}) : -1;
  const int64_t row_idx_type = f.attr(f.dim(0, 1));
  // The range: absent, empty, [start, end) inside [0, E), or anything.
  std::vector<int64_t> range;
  const int range_kind = static_cast<int>(f.dim(0, 3));
  if (range_kind == 1) {
    const int64_t a = f.dim(0, E - 1);
    range = {a, f.dim(a + 1, E)};
  } else if (range_kind == 2) {
    const int64_t n = f.dim(0, 3);
    for (int64_t i = 0; i < n; ++i) range.push_back(f.attr(f.dim(0, E)));
  }
  aclIntArray* arr = range_kind == 0 ? nullptr : aclCreateIntArray(range.data(), range.size());
  const int64_t lo = range.size() == 2 ? range[0] : 0, hi = range.size() == 2 ? range[1] : E;
  const int64_t span = hi > lo && lo >= 0 && hi <= 64 ? hi - lo : E;
  const aclDataType dt = f.coin(3) ? ACL_FLOAT : (f.coin() ? ACL_FLOAT16 : ACL_BF16);
  const int64_t N = R * K;
  const int64_t rows = active > 0 && active < N ? active : N;
  mgfuzz::Tensor* x = f.tensor({R, H}, dt, false);
  mgfuzz::Tensor* eidx = f.tensor({R, K}, ACL_INT32, false, {mgfuzz::IndexFill::kRange, 0, E});
  mgfuzz::Tensor* scale = f.coin(16) ? f.tensor({R}, ACL_FLOAT, true) : nullptr;
  mgfuzz::Tensor* ex = mode == 1 ? f.output({E, C, H}, dt) : f.output({rows, H}, dt);
  mgfuzz::Tensor* idx = f.output({N}, ACL_INT32);
  mgfuzz::Tensor* counts =
      f.output(tokens_type == 2 ? mgfuzz::Shape{E, 2} : mgfuzz::Shape{span}, ACL_INT64, true);
  using F = mgfuzz::Fuzz;
  f.call("moe_init_routing",
         [&](uint64_t* ws, aclOpExecutor** e) {
           return aclnnMoeInitRoutingV3GetWorkspaceSize(
               F::h(x), F::h(eidx), F::h(scale), nullptr, active, capacity, expert_num, mode,
               tokens_type, tokens_flag, quant_mode, arr, row_idx_type, F::h(ex), F::h(idx),
               F::h(counts), nullptr, ws, e);
         },
         aclnnMoeInitRoutingV3);
  if (arr) aclDestroyIntArray(arr);
  return 0;
}
