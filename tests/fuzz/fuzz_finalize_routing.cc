// libFuzzer harness: aclnnMoeFinalizeRoutingV2GetWorkspaceSize + aclnnMoeFinalizeRoutingV2.
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mgfuzz::Fuzz f(data, size);
  const int64_t R = f.dim(0, 10), K = f.dim(0, 4), H = f.dim(0, 12), E = f.dim(0, 5),
                C = f.dim(0, 6);
  const int64_t mode = f.attr(f.dim(0, 3));
  const bool drop_pad = mode == 1 || mode == 3;
  const aclDataType dt = f.coin(3) ? ACL_FLOAT : (f.coin() ? ACL_FLOAT16 : ACL_BF16);
  const aclDataType sdt = f.coin(4) ? (f.coin() ? ACL_FLOAT : ACL_BF16) : dt;
  const int64_t rows = drop_pad ? E * C : R * K;
  mgfuzz::Tensor* ex = drop_pad ? f.tensor({E, C, H}, dt, false) : f.tensor({R * K, H}, dt, false);
  mgfuzz::Tensor* idx = f.tensor(
      {R * K}, ACL_INT32, false,
      {mgfuzz::IndexFill::kPermutation, drop_pad ? -1 : 0, std::min(rows, R * K)});
  mgfuzz::Tensor* x1 = f.tensor({R, H}, dt, true);
  mgfuzz::Tensor* x2 = f.tensor({R, H}, dt, true);
  mgfuzz::Tensor* bias = f.tensor({E, H}, dt, true);
  mgfuzz::Tensor* scales = f.tensor({R, K}, sdt, true);
  mgfuzz::Tensor* eidx = f.tensor({R, K}, ACL_INT32, true, {mgfuzz::IndexFill::kRange, 0, E});
  mgfuzz::Tensor* out = f.output({R, H}, dt);
  using F = mgfuzz::Fuzz;
  f.call("moe_finalize_routing",
         [&](uint64_t* ws, aclOpExecutor** e) {
           return aclnnMoeFinalizeRoutingV2GetWorkspaceSize(F::h(ex), F::h(idx), F::h(x1), F::h(x2),
                                                            F::h(bias), F::h(scales), F::h(eidx),
                                                            mode, F::h(out), ws, e);
         },
         aclnnMoeFinalizeRoutingV2);
  return 0;
}
