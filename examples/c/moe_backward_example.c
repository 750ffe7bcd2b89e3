/*
 * moe_backward_example.c: the three MoE backward operators of moegrad through the aclnn C API,
 * in the style of the vendor's aclnn examples: create the tensors with aclCreateTensor, ask
 * aclnnXxxGetWorkspaceSize for the workspace size and the executor, allocate the workspace,
 * run aclnnXxx, print the results and free everything.
 *
 *   1. aclnnMoeGatingTopKBackward   worked example of operators.md §1.9
 *   2. aclnnMoeFinalizeRoutingV2Grad worked example of operators.md §3.9 (with bias)
 *   3. aclnnSwigluGroupQuantGrad    a small hand case with weight, y_origin and clamp_limit
 *
 * Plain C99. Returns 0 when every result matches the expected values, 1 otherwise.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <moegrad/aclnn.h>

#define CHECK_RET(cond, stmt) \
  do {                        \
    if (!(cond)) {            \
      stmt;                   \
    }                         \
  } while (0)

#define LOG_PRINT(...) printf(__VA_ARGS__)

/* A contiguous ND tensor over host memory (strides computed from the shape). */
static aclTensor* CreateTensor(void* data, const int64_t* shape, int64_t rank,
                               aclDataType dataType) {
  int64_t strides[8];
  int64_t i;
  strides[rank - 1] = 1;
  for (i = rank - 2; i >= 0; --i) strides[i] = shape[i + 1] * strides[i + 1];
  return aclCreateTensor(shape, (uint64_t)rank, dataType, strides, 0, ACL_FORMAT_ND, shape,
                         (uint64_t)rank, data);
}

static int CompareFloats(const char* name, const float* got, const double* want, int64_t n,
                         double tol) {
  int bad = 0;
  int64_t i;
  for (i = 0; i < n; ++i) {
    if (!(fabs((double)got[i] - want[i]) <= tol)) {
      LOG_PRINT("  MISMATCH %s[%lld]: got %.6f, expected %.6f\n", name, (long long)i,
                (double)got[i], want[i]);
      bad = 1;
    }
  }
  return bad;
}

static void PrintMatrix(const char* name, const float* v, int64_t rows, int64_t cols) {
  int64_t r, c;
  LOG_PRINT("  %s =\n", name);
  for (r = 0; r < rows; ++r) {
    LOG_PRINT("    [");
    for (c = 0; c < cols; ++c) LOG_PRINT("%s% .6f", c ? ", " : "", (double)v[r * cols + c]);
    LOG_PRINT("]\n");
  }
}

/* Stage two with a workspace of the size stage one asked for. */
typedef aclnnStatus (*RunFn)(void*, uint64_t, aclOpExecutor*, aclrtStream);
static aclnnStatus RunWithWorkspace(RunFn run, uint64_t workspaceSize, aclOpExecutor* executor) {
  void* workspace = NULL;
  aclnnStatus ret;
  if (workspaceSize > 0) {
    workspace = malloc((size_t)workspaceSize);
    if (workspace == NULL) return ACLNN_ERR_INNER;
  }
  ret = run(workspace, workspaceSize, executor, NULL);
  free(workspace);
  return ret;
}

/* ---- 1. MoeGatingTopKBackward (operators.md §1.9) ------------------------------------------ */
static int RunGatingTopKBackward(void) {
  int64_t xNormShape[2] = {4, 8};
  int64_t gradYShape[2] = {4, 2};
  float xNorm[32] = {0.5f, 0.7f, 0.3f, 0.8f, 0.2f, 0.6f, 0.9f, 0.4f,
                     0.6f, 0.4f, 0.8f, 0.1f, 0.7f, 0.5f, 0.3f, 0.9f,
                     0.2f, 0.9f, 0.5f, 0.6f, 0.8f, 0.3f, 0.7f, 0.4f,
                     0.8f, 0.3f, 0.6f, 0.5f, 0.4f, 0.7f, 0.2f, 0.9f};
  float gradY[8] = {1.0f, 0.5f, 0.8f, 0.3f, 0.6f, 0.9f, 0.4f, 0.7f};
  int32_t expertIdx[8] = {3, 6, 2, 7, 1, 4, 0, 7};
  float gradX[32];
  double expected[32] = {0};
  uint64_t workspaceSize = 0;
  aclOpExecutor* executor = NULL;
  aclTensor *xNormT, *gradYT, *expertIdxT, *gradXT;
  aclnnStatus ret;
  int bad = 1;

  expected[0 * 8 + 3] = 0.062284;
  expected[0 * 8 + 6] = -0.031142;
  expected[1 * 8 + 2] = 0.062284;
  expected[1 * 8 + 7] = -0.031142;
  expected[2 * 8 + 1] = -0.018685;
  expected[2 * 8 + 4] = 0.037370;
  expected[3 * 8 + 0] = -0.037370;
  expected[3 * 8 + 7] = 0.018685;

  LOG_PRINT("aclnnMoeGatingTopKBackward (M=4, N=8, K=2, routedScalingFactor=2.5)\n");
  xNormT = CreateTensor(xNorm, xNormShape, 2, ACL_FLOAT);
  gradYT = CreateTensor(gradY, gradYShape, 2, ACL_FLOAT);
  expertIdxT = CreateTensor(expertIdx, gradYShape, 2, ACL_INT32);
  gradXT = CreateTensor(gradX, xNormShape, 2, ACL_FLOAT);
  CHECK_RET(xNormT && gradYT && expertIdxT && gradXT,
            LOG_PRINT("  aclCreateTensor failed: %s\n", aclGetRecentErrMsg()); goto cleanup);

  ret = aclnnMoeGatingTopKBackwardGetWorkspaceSize(xNormT, gradYT, expertIdxT, /*renorm=*/0,
                                                   /*normType=*/1, /*routedScalingFactor=*/2.5,
                                                   /*eps=*/1e-20, gradXT, &workspaceSize,
                                                   &executor);
  CHECK_RET(ret == ACLNN_SUCCESS,
            LOG_PRINT("  GetWorkspaceSize failed (%d): %s\n", ret, aclGetRecentErrMsg());
            goto cleanup);
  ret = RunWithWorkspace(aclnnMoeGatingTopKBackward, workspaceSize, executor);
  CHECK_RET(ret == ACLNN_SUCCESS,
            LOG_PRINT("  aclnnMoeGatingTopKBackward failed (%d): %s\n", ret, aclGetRecentErrMsg());
            goto cleanup);

  PrintMatrix("gradX", gradX, 4, 8);
  bad = CompareFloats("gradX", gradX, expected, 32, 1e-6);

cleanup:
  aclDestroyTensor(xNormT);
  aclDestroyTensor(gradYT);
  aclDestroyTensor(expertIdxT);
  aclDestroyTensor(gradXT);
  return bad;
}

/* ---- 2. MoeFinalizeRoutingV2Grad (operators.md §3.9) --------------------------------------- */
static int RunFinalizeRoutingV2Grad(void) {
  int64_t gradYShape[2] = {2, 2};            /* R x H */
  int64_t rowIdxShape[1] = {4};              /* R*K, row layout r*K + k */
  int64_t expandedXShape[2] = {4, 2};        /* R*K x H */
  int64_t scalesShape[2] = {2, 2};           /* R x K */
  int64_t biasShape[2] = {2, 2};             /* E x H */
  float gradY[4] = {0.3816f, 0.3939f, 0.8474f, 0.1652f};
  int32_t expandedRowIdx[4] = {1, 3, 0, 2};
  float expandedX[8] = {0.6049f, 0.3315f, 0.4954f, 0.3284f, 0.7060f, 0.4359f, 0.6514f, 0.9476f};
  float scales[4] = {0.4708f, 0.0656f, 0.9652f, 0.9512f};
  int32_t expertIdx[4] = {0, 1, 0, 1};
  float bias[4] = {0.6452f, 0.1981f, 0.4159f, 0.9575f};
  float gradExpandedX[8];
  float gradScales[4];
  const double expectedGradExpandedX[8] = {0.817910, 0.159451, 0.179657, 0.185448,
                                           0.806047, 0.157138, 0.025033, 0.025840};
  const double expectedGradScales[4] = {0.642641, 1.157701, 1.146825, 1.180888};
  uint64_t workspaceSize = 0;
  aclOpExecutor* executor = NULL;
  aclTensor *gradYT, *rowIdxT, *expandedXT, *scalesT, *expertIdxT, *biasT, *gradExT, *gradScT;
  aclnnStatus ret;
  int bad = 1;

  LOG_PRINT("aclnnMoeFinalizeRoutingV2Grad (R=2, K=2, H=2, E=2, dropPadMode=0)\n");
  gradYT = CreateTensor(gradY, gradYShape, 2, ACL_FLOAT);
  rowIdxT = CreateTensor(expandedRowIdx, rowIdxShape, 1, ACL_INT32);
  expandedXT = CreateTensor(expandedX, expandedXShape, 2, ACL_FLOAT);
  scalesT = CreateTensor(scales, scalesShape, 2, ACL_FLOAT);
  expertIdxT = CreateTensor(expertIdx, scalesShape, 2, ACL_INT32);
  biasT = CreateTensor(bias, biasShape, 2, ACL_FLOAT);
  gradExT = CreateTensor(gradExpandedX, expandedXShape, 2, ACL_FLOAT);
  gradScT = CreateTensor(gradScales, scalesShape, 2, ACL_FLOAT);
  CHECK_RET(gradYT && rowIdxT && expandedXT && scalesT && expertIdxT && biasT && gradExT && gradScT,
            LOG_PRINT("  aclCreateTensor failed: %s\n", aclGetRecentErrMsg()); goto cleanup);

  ret = aclnnMoeFinalizeRoutingV2GradGetWorkspaceSize(
      gradYT, rowIdxT, expandedXT, scalesT, expertIdxT, biasT, /*dropPadMode=*/0,
      /*activeNum=*/0, /*expertNum=*/0, /*expertCapacity=*/0, gradExT, gradScT, &workspaceSize,
      &executor);
  CHECK_RET(ret == ACLNN_SUCCESS,
            LOG_PRINT("  GetWorkspaceSize failed (%d): %s\n", ret, aclGetRecentErrMsg());
            goto cleanup);
  ret = RunWithWorkspace(aclnnMoeFinalizeRoutingV2Grad, workspaceSize, executor);
  CHECK_RET(ret == ACLNN_SUCCESS,
            LOG_PRINT("  aclnnMoeFinalizeRoutingV2Grad failed (%d): %s\n", ret,
                      aclGetRecentErrMsg());
            goto cleanup);

  PrintMatrix("gradExpandedX", gradExpandedX, 4, 2);
  PrintMatrix("gradScales", gradScales, 2, 2);
  bad = CompareFloats("gradExpandedX", gradExpandedX, expectedGradExpandedX, 8, 2e-6);
  bad |= CompareFloats("gradScales", gradScales, expectedGradScales, 4, 2e-6);

cleanup:
  aclDestroyTensor(gradYT);
  aclDestroyTensor(rowIdxT);
  aclDestroyTensor(expandedXT);
  aclDestroyTensor(scalesT);
  aclDestroyTensor(expertIdxT);
  aclDestroyTensor(biasT);
  aclDestroyTensor(gradExT);
  aclDestroyTensor(gradScT);
  return bad;
}

/* ---- 3. SwigluGroupQuantGrad ----------------------------------------------------------------
 * T=2 tokens, H=2, clampLimit=2: token 1 has x0 = 2.5 > 2 and x1 = -3 < -2, so those two
 * gradients are masked to 0. yOrigin is the unweighted activation silu(x0')*x1' (D10).
 * Expected values computed in double from operators.md §5.5. */
static int RunSwigluGroupQuantGrad(void) {
  int64_t xShape[2] = {2, 4};
  int64_t gradYShape[2] = {2, 2};
  int64_t weightShape[1] = {2};
  float x[8] = {0.5f, -1.0f, 1.5f, -0.5f, 2.5f, 0.25f, -3.0f, 1.0f};
  float gradY[4] = {1.0f, -0.5f, 0.25f, 2.0f};
  float weight[2] = {0.8f, 1.2f};
  float yOrigin[4] = {0.4668445f, 0.1344707f, -3.5231884f, 0.1405441f};
  float gradX[8];
  float gradWeight[2];
  const double expectedGradX[8] = {0.8879534, 0.0144659, 0.2489837, 0.1075766,
                                   0.0,       1.4969041, 0.0,       0.3373059};
  const double expectedGradWeight[2] = {0.3996091, -0.5997088};
  uint64_t workspaceSize = 0;
  aclOpExecutor* executor = NULL;
  aclTensor *gradYT, *xT, *weightT, *yOriginT, *gradXT, *gradWeightT;
  aclnnStatus ret;
  int bad = 1;

  LOG_PRINT("aclnnSwigluGroupQuantGrad (T=2, H=2, clampLimit=2.0, with weight)\n");
  gradYT = CreateTensor(gradY, gradYShape, 2, ACL_FLOAT);
  xT = CreateTensor(x, xShape, 2, ACL_FLOAT);
  weightT = CreateTensor(weight, weightShape, 1, ACL_FLOAT);
  yOriginT = CreateTensor(yOrigin, gradYShape, 2, ACL_FLOAT);
  gradXT = CreateTensor(gradX, xShape, 2, ACL_FLOAT);
  gradWeightT = CreateTensor(gradWeight, weightShape, 1, ACL_FLOAT);
  CHECK_RET(gradYT && xT && weightT && yOriginT && gradXT && gradWeightT,
            LOG_PRINT("  aclCreateTensor failed: %s\n", aclGetRecentErrMsg()); goto cleanup);

  ret = aclnnSwigluGroupQuantGradGetWorkspaceSize(gradYT, xT, weightT, yOriginT,
                                                  /*groupIndexOptional=*/NULL,
                                                  /*clampLimit=*/2.0, gradXT, gradWeightT,
                                                  &workspaceSize, &executor);
  CHECK_RET(ret == ACLNN_SUCCESS,
            LOG_PRINT("  GetWorkspaceSize failed (%d): %s\n", ret, aclGetRecentErrMsg());
            goto cleanup);
  ret = RunWithWorkspace(aclnnSwigluGroupQuantGrad, workspaceSize, executor);
  CHECK_RET(ret == ACLNN_SUCCESS,
            LOG_PRINT("  aclnnSwigluGroupQuantGrad failed (%d): %s\n", ret, aclGetRecentErrMsg());
            goto cleanup);

  PrintMatrix("gradX", gradX, 2, 4);
  PrintMatrix("gradWeight", gradWeight, 1, 2);
  bad = CompareFloats("gradX", gradX, expectedGradX, 8, 2e-6);
  bad |= CompareFloats("gradWeight", gradWeight, expectedGradWeight, 2, 2e-6);

cleanup:
  aclDestroyTensor(gradYT);
  aclDestroyTensor(xT);
  aclDestroyTensor(weightT);
  aclDestroyTensor(yOriginT);
  aclDestroyTensor(gradXT);
  aclDestroyTensor(gradWeightT);
  return bad;
}

int main(void) {
  int bad = 0;
  LOG_PRINT("moegrad %s\n", moegradVersion());
  bad |= RunGatingTopKBackward();
  bad |= RunFinalizeRoutingV2Grad();
  bad |= RunSwigluGroupQuantGrad();
  LOG_PRINT(bad ? "FAILED: results differ from the expected values\n" : "all results match\n");
  return bad ? 1 : 0;
}
