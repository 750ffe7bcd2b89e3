// libFuzzer harness: aclnnMoeInitRoutingV2GetWorkspaceSize + aclnnMoeInitRoutingV2.
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mgfuzz::Fuzz f(data, size);
  const int64_t R = f.dim(0, 10), K = f.dim(0, 4), H = f.dim(0, 12), E = f.dim(0, 6),
                C = f.dim(0, 5);
  const int64_t mode = f.attr(f.dim(0, 1));
  const int64_t active = f.attr(f.coin() ? int64_t{0} : f.dim(0, R * K + 1));
  const int64_t capacity = f.attr(C), expert_num = f.attr(E);
  const int64_t count_flag = f.attr(f.dim(0, 2));
  const bool before_flag = f.coin();
  const aclDataType dt = f.coin(3) ? ACL_FLOAT : (f.coin() ? ACL_FLOAT16 : ACL_BF16);
  const int64_t N = R * K;
  const int64_t rows = active > 0 && active < N ? active : N;
  mgfuzz::Tensor* x = f.tensor({R, H}, dt, false);
  mgfuzz::Tensor* eidx = f.tensor({R, K}, ACL_INT32, false, {mgfuzz::IndexFill::kRange, 0, E});
  mgfuzz::Tensor* ex = mode == 1 ? f.output({E, C, H}, dt) : f.output({rows, H}, dt);
  mgfuzz::Tensor* idx = f.output({N}, ACL_INT32);
  mgfuzz::Tensor* counts = f.output({E}, ACL_INT32, true);
  mgfuzz::Tensor* before = f.output({E}, ACL_INT32, true);
  using F = mgfuzz::Fuzz;
  f.call("moe_init_routing",
         [&](uint64_t* ws, aclOpExecutor** e) {
           return aclnnMoeInitRoutingV2GetWorkspaceSize(
               F::h(x), F::h(eidx), active, capacity, expert_num, mode, count_flag, before_flag,
               F::h(ex), F::h(idx), F::h(counts), F::h(before), ws, e);
         },
         aclnnMoeInitRoutingV2);
  return 0;
}
