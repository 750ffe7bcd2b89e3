// libFuzzer harness: aclnnMoeGatingTopKGetWorkspaceSize + aclnnMoeGatingTopK (fuzz_common.h).
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mgfuzz::Fuzz f(data, size);
  const int64_t M = f.dim(0, 12), N = f.dim(0, 40);
  const int64_t k = f.attr(f.dim(1, 8)), k_group = f.attr(f.dim(1, 4));
  const int64_t group_count = f.attr(f.dim(1, 4)), mode = f.attr(f.dim(0, 1));
  const int64_t renorm = f.attr(f.dim(0, 1)), norm_type = f.attr(f.dim(0, 2));
  const bool out_flag = f.coin();
  const double rsf = f.attr(1.0), eps = f.attr(1e-20);
  const aclDataType dt = f.coin(3) ? ACL_FLOAT : (f.coin() ? ACL_FLOAT16 : ACL_BF16);
  const int64_t kk = k >= 0 && k <= 64 ? k : 1;
  mgfuzz::Tensor* x = f.tensor({M, N}, dt, false);
  mgfuzz::Tensor* bias = f.tensor({N}, dt, true);
  mgfuzz::Tensor* y = f.output({M, kk}, dt);
  mgfuzz::Tensor* idx = f.output({M, kk}, ACL_INT32);
  mgfuzz::Tensor* norm = f.output({M, N}, ACL_FLOAT);
  using F = mgfuzz::Fuzz;
  f.call("moe_gating_top_k",
         [&](uint64_t* ws, aclOpExecutor** ex) {
           return aclnnMoeGatingTopKGetWorkspaceSize(F::h(x), F::h(bias), k, k_group, group_count,
                                                     mode, renorm, norm_type, out_flag, rsf, eps,
                                                     F::h(y), F::h(idx), F::h(norm), ws, ex);
         },
         aclnnMoeGatingTopK);
  return 0;
}
