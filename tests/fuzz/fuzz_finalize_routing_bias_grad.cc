// libFuzzer harness: aclnnMoeFinalizeRoutingBiasGradGetWorkspaceSize + aclnnMoeFinalizeRoutingBiasGrad.
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mgfuzz::Fuzz f(data, size);
  const int64_t R = f.dim(0, 10), K = f.dim(0, 4), H = f.dim(0, 12), E = f.dim(0, 6);
  const int64_t expert_num = f.attr(E);
  const aclDataType dt = f.coin(3) ? ACL_FLOAT : (f.coin() ? ACL_FLOAT16 : ACL_BF16);
  const aclDataType sdt = f.coin(4) ? (f.coin() ? ACL_FLOAT : ACL_BF16) : dt;
  mgfuzz::Tensor* gy = f.tensor({R, H}, dt, false);
  mgfuzz::Tensor* eidx = f.tensor({R, K}, ACL_INT32, false, {mgfuzz::IndexFill::kRange, 0, E});
  mgfuzz::Tensor* scales = f.tensor({R, K}, sdt, true);
  mgfuzz::Tensor* gb = f.output({E, H}, dt);
  using F = mgfuzz::Fuzz;
  f.call("moe_finalize_routing_bias_grad",
         [&](uint64_t* ws, aclOpExecutor** e) {
           return aclnnMoeFinalizeRoutingBiasGradGetWorkspaceSize(F::h(gy), F::h(eidx),
                                                                  F::h(scales), expert_num,
                                                                  F::h(gb), ws, e);
         },
         aclnnMoeFinalizeRoutingBiasGrad);
  return 0;
}
