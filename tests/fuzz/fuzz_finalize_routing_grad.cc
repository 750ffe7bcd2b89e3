// libFuzzer harness: aclnnMoeFinalizeRoutingV2GradGetWorkspaceSize + aclnnMoeFinalizeRoutingV2Grad.
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mgfuzz::Fuzz f(data, size);
  const int64_t R = f.dim(0, 10), K = f.dim(0, 4), H = f.dim(0, 12), E = f.dim(0, 5),
                C = f.dim(0, 6);
  const int64_t mode = f.attr(f.dim(0, 1));
  const int64_t active = f.attr(f.coin() ? int64_t{0} : f.dim(0, R * K + 1));
  const int64_t expert_num = f.attr(E), capacity = f.attr(C);
  const bool drop_pad = mode == 1;
  const bool with_scales = f.coin(4) != true;
  const int64_t k = with_scales ? K : 1;
  const int64_t rk = R * k;
  const int64_t rows = drop_pad ? E * C : (active > 0 && active < rk ? active : rk);
  const aclDataType dt = f.coin(3) ? ACL_FLOAT : (f.coin() ? ACL_FLOAT16 : ACL_BF16);
  const aclDataType sdt = f.coin(4) ? (f.coin() ? ACL_FLOAT : ACL_BF16) : dt;
  mgfuzz::Tensor* gy = f.tensor({R, H}, dt, false);
  mgfuzz::Tensor* idx = f.tensor(
      {rk}, ACL_INT32, false,
      {mgfuzz::IndexFill::kPermutation, drop_pad ? -1 : 0, std::min(drop_pad ? E * C : rk, rk)});
  mgfuzz::Tensor* ex = drop_pad ? f.tensor({E, C, H}, dt, true) : f.tensor({rows, H}, dt, true);
  mgfuzz::Tensor* scales = with_scales ? f.tensor({R, K}, sdt, true) : nullptr;
  mgfuzz::Tensor* eidx = f.tensor({R, k}, ACL_INT32, true, {mgfuzz::IndexFill::kRange, 0, E});
  mgfuzz::Tensor* bias = f.tensor({E, H}, dt, true);
  mgfuzz::Tensor* gex = drop_pad ? f.output({E, C, H}, dt) : f.output({rows, H}, dt);
  mgfuzz::Tensor* gs = f.output({R, k}, scales ? sdt : dt);
  using F = mgfuzz::Fuzz;
  f.call("moe_finalize_routing_grad",
         [&](uint64_t* ws, aclOpExecutor** e) {
           return aclnnMoeFinalizeRoutingV2GradGetWorkspaceSize(
               F::h(gy), F::h(idx), F::h(ex), F::h(scales), F::h(eidx), F::h(bias), mode, active,
               expert_num, capacity, F::h(gex), F::h(gs), ws, e);
         },
         aclnnMoeFinalizeRoutingV2Grad);
  return 0;
}
