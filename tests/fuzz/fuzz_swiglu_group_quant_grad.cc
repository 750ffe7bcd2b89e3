// libFuzzer harness: aclnnSwigluGroupQuantGradGetWorkspaceSize + aclnnSwigluGroupQuantGrad.
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mgfuzz::Fuzz f(data, size);
  // Leading dims: rank 1..4 in all (the last dim is H or 2H).
  mgfuzz::Shape lead;
  const int nlead = static_cast<int>(f.dim(0, 3));
  for (int i = 0; i < nlead; ++i) lead.push_back(f.dim(0, 5));
  int64_t T = 1;
  for (int64_t d : lead) T *= d;
  const int64_t H = f.dim(0, 12), G = f.dim(0, 4);
  const double clamp = f.attr(f.coin() ? -1.0 : 3.0);
  const aclDataType dt = f.coin(3) ? ACL_FLOAT : (f.coin() ? ACL_FLOAT16 : ACL_BF16);
  mgfuzz::Shape sh = lead, sx = lead;
  sh.push_back(H);
  sx.push_back(2 * H);
  mgfuzz::Shape sw = f.coin() ? mgfuzz::Shape{T} : lead;
  if (sw.empty()) sw.push_back(1);
  mgfuzz::Tensor* gy = f.tensor(sh, dt, false);
  mgfuzz::Tensor* x = f.tensor(sx, dt, false);
  mgfuzz::Tensor* w = f.tensor(sw, ACL_FLOAT, true);
  mgfuzz::Tensor* yo = f.tensor(sh, dt, true);
  mgfuzz::Tensor* gi = f.tensor({G}, ACL_INT64, true, {mgfuzz::IndexFill::kCounts, 0, 0});
  mgfuzz::Tensor* gx = f.output(sx, dt);
  mgfuzz::Tensor* gw = f.output(sw, ACL_FLOAT, true);
  using F = mgfuzz::Fuzz;
  f.call("swiglu_group_quant_backward",
         [&](uint64_t* ws, aclOpExecutor** e) {
           return aclnnSwigluGroupQuantGradGetWorkspaceSize(F::h(gy), F::h(x), F::h(w), F::h(yo),
                                                            F::h(gi), clamp, F::h(gx), F::h(gw),
                                                            ws, e);
         },
         aclnnSwigluGroupQuantGrad);
  return 0;
}
