// libFuzzer harness: aclnnClippedSwigluV2 and aclnnClippedSwigluGradV2 (any rank, dim, layout,
// clamp mode and attribute, with group_index).
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mgfuzz::Fuzz f(data, size);
  mgfuzz::Shape sx;
  const int rank = static_cast<int>(f.dim(1, 4));
  for (int i = 0; i < rank; ++i) sx.push_back(f.dim(0, 6));
  const int64_t dim = f.attr(int64_t{-1});
  const int64_t mode = f.attr(int64_t{f.coin() ? 0 : 1});
  const double alpha = f.coin() ? 1.702 : f.attr(1.702);
  const double limit = f.attr(7.0), bias = f.coin() ? 1.0 : f.attr(1.0);
  const bool interleaved = f.coin();
  const bool grad = f.coin();
  const int64_t G = f.dim(0, 4);
  const aclDataType dt = f.coin(3) ? ACL_FLOAT : (f.coin() ? ACL_FLOAT16 : ACL_BF16);
  mgfuzz::Shape sy = sx;
  const int64_t d = dim < 0 ? dim + rank : dim;
  if (d >= 0 && d < rank) sy[static_cast<size_t>(d)] /= 2;
  mgfuzz::Tensor* x = f.tensor(sx, dt, false);
  mgfuzz::Tensor* gi = f.tensor({G}, ACL_INT64, true, {mgfuzz::IndexFill::kCounts, 0, 0});
  using F = mgfuzz::Fuzz;
  if (!grad) {
    mgfuzz::Tensor* y = f.output(sy, dt);
    f.call("clipped_swiglu",
           [&](uint64_t* ws, aclOpExecutor** e) {
             return aclnnClippedSwigluV2GetWorkspaceSize(F::h(x), F::h(gi), dim, alpha, limit,
                                                         bias, interleaved, mode, F::h(y), ws, e);
           },
           aclnnClippedSwigluV2);
    return 0;
  }
  mgfuzz::Tensor* gy = f.tensor(sy, dt, false);
  mgfuzz::Tensor* gx = f.output(sx, dt);
  f.call("clipped_swiglu_grad",
         [&](uint64_t* ws, aclOpExecutor** e) {
           return aclnnClippedSwigluGradV2GetWorkspaceSize(F::h(gy), F::h(x), F::h(gi), dim,
                                                           alpha, limit, bias, interleaved, mode,
                                                           F::h(gx), ws, e);
         },
         aclnnClippedSwigluGradV2);
  return 0;
}
