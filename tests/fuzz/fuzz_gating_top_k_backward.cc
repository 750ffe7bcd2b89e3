// libFuzzer harness: aclnnMoeGatingTopKBackwardGetWorkspaceSize + aclnnMoeGatingTopKBackward.
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mgfuzz::Fuzz f(data, size);
  const int64_t M = f.dim(0, 12), N = f.dim(0, 40), K = f.dim(0, 8);
  const int64_t renorm = f.attr(int64_t{0}), norm_type = f.attr(int64_t{1});
  const double rsf = f.attr(1.0), eps = f.attr(1e-20);
  const aclDataType dt = f.coin(3) ? ACL_FLOAT : (f.coin() ? ACL_FLOAT16 : ACL_BF16);
  mgfuzz::Tensor* x_norm = f.tensor({M, N}, ACL_FLOAT, false);
  mgfuzz::Tensor* grad_y = f.tensor({M, K}, dt, false);
  mgfuzz::Tensor* idx =
      f.tensor({M, K}, ACL_INT32, false, {mgfuzz::IndexFill::kRange, 0, N});
  mgfuzz::Tensor* out = f.output({M, N}, dt);
  using F = mgfuzz::Fuzz;
  f.call("moe_gating_top_k_backward",
         [&](uint64_t* ws, aclOpExecutor** ex) {
           return aclnnMoeGatingTopKBackwardGetWorkspaceSize(F::h(x_norm), F::h(grad_y), F::h(idx),
                                                             renorm, norm_type, rsf, eps, F::h(out),
                                                             ws, ex);
         },
         aclnnMoeGatingTopKBackward);
  return 0;
}
