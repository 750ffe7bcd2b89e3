// libFuzzer harness: aclnnMoeInitRoutingV2GradGetWorkspaceSize + aclnnMoeInitRoutingV2Grad.
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mgfuzz::Fuzz f(data, size);
  const int64_t R = f.dim(0, 10), K = f.dim(0, 4), H = f.dim(0, 12), E = f.dim(0, 5),
                C = f.dim(0, 5);
  const int64_t mode = f.attr(f.dim(0, 1));
  const int64_t top_k = f.attr(K);
  const int64_t active = f.attr(f.coin() ? int64_t{0} : f.dim(0, R * K + 1));
  const aclDataType dt = f.coin(3) ? ACL_FLOAT : (f.coin() ? ACL_FLOAT16 : ACL_BF16);
  const int64_t N = R * K;
  const int64_t rows = active > 0 && active < N ? active : N;
  mgfuzz::Tensor* gex = mode == 1 ? f.tensor({E, C, H}, dt, false) : f.tensor({rows, H}, dt, false);
  mgfuzz::Tensor* idx = f.tensor(
      {N}, ACL_INT32, false,
      {mgfuzz::IndexFill::kPermutation, -1, std::min(mode == 1 ? E * C : rows, N)});
  mgfuzz::Tensor* gx = f.output({R, H}, dt);
  using F = mgfuzz::Fuzz;
  f.call("moe_init_routing_grad",
         [&](uint64_t* ws, aclOpExecutor** e) {
           return aclnnMoeInitRoutingV2GradGetWorkspaceSize(F::h(gex), F::h(idx), top_k, mode,
                                                            active, F::h(gx), ws, e);
         },
         aclnnMoeInitRoutingV2Grad);
  return 0;
}
