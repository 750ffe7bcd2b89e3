// libFuzzer harness: aclnnSwigluGroupQuantGetWorkspaceSize + aclnnSwigluGroupQuant.
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mgfuzz::Fuzz f(data, size);
  mgfuzz::Shape lead;
  const int nlead = static_cast<int>(f.dim(1, 3));
  for (int i = 0; i < nlead; ++i) lead.push_back(f.dim(0, 4));
  int64_t T = 1;
  for (int64_t d : lead) T *= d;
  const int64_t H = f.dim(0, 300), G = f.dim(0, 4);
  const int64_t quant_mode = f.attr(f.dim(0, 1));
  const int64_t dst_type = f.attr(f.coin() ? int64_t{36} : int64_t{35});
  const int64_t block = f.attr(f.coin() ? int64_t{0} : (quant_mode == 1 ? 32 : 128));
  const bool round_scale = quant_mode == 1 ? !f.coin(8) : f.coin();
  const double clamp = f.attr(f.coin() ? -1.0 : 3.0), dst_max = f.attr(15.0);
  const bool output_origin = f.coin();
  const aclDataType dt = f.coin(3) ? ACL_FLOAT : (f.coin() ? ACL_FLOAT16 : ACL_BF16);
  const aclDataType ydt = f.coin() ? ACL_UINT8 : static_cast<aclDataType>(dst_type == 35 ? 35 : 36);
  mgfuzz::Shape sx = lead, sy = lead, ss = lead;
  sx.push_back(2 * H);
  sy.push_back(H);
  if (quant_mode == 1) {
    ss.push_back(((H + 31) / 32 + 1) / 2);
    ss.push_back(2);
  } else {
    ss.push_back((H + 127) / 128);
  }
  const aclDataType sdt = quant_mode == 1 ? (f.coin() ? ACL_UINT8 : ACL_FLOAT8_E8M0) : ACL_FLOAT;
  mgfuzz::Tensor* x = f.tensor(sx, dt, false);
  mgfuzz::Tensor* w = f.tensor(f.coin() ? mgfuzz::Shape{T} : lead, ACL_FLOAT, true);
  mgfuzz::Tensor* gi = f.tensor({G}, ACL_INT64, true, {mgfuzz::IndexFill::kCounts, 0, 0});
  mgfuzz::Tensor* scale = f.coin(16) ? f.tensor({1}, ACL_FLOAT, true) : nullptr;
  mgfuzz::Tensor* y = f.output(sy, ydt);
  mgfuzz::Tensor* ys = f.output(ss, sdt);
  mgfuzz::Tensor* yo = f.output(sy, dt, true);
  using F = mgfuzz::Fuzz;
  f.call("swiglu_group_quant",
         [&](uint64_t* ws, aclOpExecutor** e) {
           return aclnnSwigluGroupQuantGetWorkspaceSize(
               F::h(x), F::h(w), F::h(gi), F::h(scale), dst_type, quant_mode, block, round_scale,
               clamp, dst_max, output_origin, F::h(y), F::h(ys), F::h(yo), ws, e);
         },
         aclnnSwigluGroupQuant);
  return 0;
}
