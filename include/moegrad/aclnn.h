/* moegrad C API: the aclnn two-stage interface of the CANN MoE operators.
 *
 * Code written against aclnn compiles against this header by changing the include and the link
 * line. Every operator has two calls:
 *   aclnnXxxGetWorkspaceSize(inputs..., attributes..., outputs..., &workspaceSize, &executor)
 *     validates every argument (shapes, dtypes, attributes, host index values), plans the
 *     kernel and creates the executor. On failure it returns a status code, writes nothing to
 *     any output tensor and creates no executor; aclGetRecentErrMsg() names the argument, the
 *     rule and the value seen.
 *   aclnnXxx(workspace, workspaceSize, executor, stream)
 *     only runs the plan. `stream` is a cudaStream_t for device tensors, ignored on the CPU.
 *
 * Executor lifetime (as in aclnn): stage two consumes the executor and frees it, unless
 * aclSetAclOpExecutorRepeatable() was called, in which case it may run any number of times
 * and must be freed with aclDestroyAclOpExecutor(). Calling stage two with an executor that was
 * consumed or destroyed returns ACLNN_ERR_PARAM_INVALID (executors are tracked, so this is
 * detected, not undefined; a handle is an opaque serial number, never reused, so a stale one
 * stays invalid even after later executors were created). An executor used from several threads
 * at once gets ACLNN_ERR_PARAM_INVALID for an overlapping run or destroy.
 * An executor never run leaks until aclDestroyAclOpExecutor().
 * Executors hold the tensors' data pointers, not the aclTensor handles: handles may be
 * destroyed after stage one; the memory they describe must live until stage two returns.
 *
 * Status codes (docs/decisions.md D18): 161001 null required tensor, 161002 dtype / format /
 * value invalid, 561002 gating-forward and SwiGLU shape or attribute error, 561103 finalize
 * routing shape or value error, 561000 internal error (e.g. out of memory).
 * Tensors must be contiguous (D19), and an output must not overlap an input or another output
 * (161002 naming it; the one in-place form is swiglu grad's gradXOut exactly over x on the CPU,
 * docs/decisions.md L232). All calls are thread-safe; the error message is per thread.
 * An executor shared across threads gives a status, never undefined behaviour: a one-shot
 * executor runs (or is destroyed) exactly once, and a second stage-two run of a repeatable
 * executor, or its destruction, while another thread is running it returns
 * ACLNN_ERR_PARAM_INVALID (docs/decisions.md L54). An executor passed to another operator's
 * stage two is refused with ACLNN_ERR_PARAM_INVALID and left as it was (the V2/V3 forms of
 * MoeInitRouting and of ClippedSwiglu share their operator's executors).
 */
#ifndef MOEGRAD_ACLNN_H_
#define MOEGRAD_ACLNN_H_

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define MOEGRAD_C_API __declspec(dllexport)
#else
#define MOEGRAD_C_API __attribute__((visibility("default")))
#endif

typedef int32_t aclnnStatus;
typedef void* aclrtStream;

#define ACLNN_SUCCESS 0
#define ACLNN_ERR_PARAM_NULLPTR 161001
#define ACLNN_ERR_PARAM_INVALID 161002
#define ACLNN_ERR_INNER 561000
#define ACLNN_ERR_INNER_TILING_ERROR 561002
#define ACLNN_ERR_INNER_NULLPTR 561103

typedef enum {
  ACL_DT_UNDEFINED = -1,
  ACL_FLOAT = 0,
  ACL_FLOAT16 = 1,
  ACL_INT8 = 2,
  ACL_INT32 = 3,
  ACL_UINT8 = 4,
  ACL_INT16 = 6,
  ACL_UINT16 = 7,
  ACL_UINT32 = 8,
  ACL_INT64 = 9,
  ACL_UINT64 = 10,
  ACL_DOUBLE = 11,
  ACL_BOOL = 12,
  ACL_STRING = 13,
  ACL_COMPLEX64 = 16,
  ACL_COMPLEX128 = 17,
  ACL_BF16 = 27,
  ACL_INT4 = 29,
  ACL_UINT1 = 30,
  ACL_COMPLEX32 = 33,
  ACL_HIFLOAT8 = 34,
  ACL_FLOAT8_E5M2 = 35,
  ACL_FLOAT8_E4M3FN = 36,
  ACL_FLOAT8_E8M0 = 37,
  ACL_FLOAT6_E3M2 = 38,
  ACL_FLOAT6_E2M3 = 39,
  ACL_FLOAT4_E2M1 = 40,
  ACL_FLOAT4_E1M2 = 41
} aclDataType;

typedef enum {
  ACL_FORMAT_UNDEFINED = -1,
  ACL_FORMAT_NCHW = 0,
  ACL_FORMAT_NHWC = 1,
  ACL_FORMAT_ND = 2,
  ACL_FORMAT_NC1HWC0 = 3,
  ACL_FORMAT_FRACTAL_Z = 4,
  ACL_FORMAT_FRACTAL_NZ = 29,
  ACL_FORMAT_NCDHW = 30,
  ACL_FORMAT_NDHWC = 27
} aclFormat;

typedef struct aclTensor aclTensor;
typedef struct aclOpExecutor aclOpExecutor;
typedef struct aclIntArray aclIntArray;

/* A tensor handle over caller memory (host memory; device memory in CUDA builds, detected from
 * the pointer). viewDims/stride describe the view in elements; offset is in elements from
 * tensorData. format must be ND (NCHW/NHWC/NCDHW/NDHWC are read as ND): stage one refuses a
 * tensor in any other format (FRACTAL_NZ, ...) with ACLNN_ERR_PARAM_INVALID naming it.
 * storageDims are accepted and not used: the view describes the data. Returns NULL on invalid
 * arguments (reason in aclGetRecentErrMsg()). Up to 16 dims here; each operator checks its own
 * rank rule. */
MOEGRAD_C_API aclTensor* aclCreateTensor(const int64_t* viewDims, uint64_t viewDimsNum,
                                         aclDataType dataType, const int64_t* stride,
                                         int64_t offset, aclFormat format,
                                         const int64_t* storageDims, uint64_t storageDimsNum,
                                         void* tensorData);
MOEGRAD_C_API aclnnStatus aclDestroyTensor(const aclTensor* tensor);

/* A list of int64 values (copied); NULL on invalid arguments. */
MOEGRAD_C_API aclIntArray* aclCreateIntArray(const int64_t* value, uint64_t size);
MOEGRAD_C_API aclnnStatus aclDestroyIntArray(const aclIntArray* array);

MOEGRAD_C_API aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor* executor);
MOEGRAD_C_API aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor* executor);

/* The message of the last failed call on this thread ("" after a successful call). The
 * pointer stays valid until the next moegrad call on the same thread. */
MOEGRAD_C_API const char* aclGetRecentErrMsg(void);

/* CPU threads used by the kernels; n <= 0 restores the default. Results never depend on it. */
MOEGRAD_C_API void moegradSetNumThreads(int n);
MOEGRAD_C_API int moegradGetNumThreads(void);
MOEGRAD_C_API const char* moegradVersion(void);

/* ---- MoeGatingTopK (§2). x [M,N] fp32/fp16/bf16, biasOptional [N] (selection only),
 * yOut [M,k] x dtype, expertIdxOut [M,k] int32, outOut [M,N] fp32 (zeros unless outFlag). */
MOEGRAD_C_API aclnnStatus aclnnMoeGatingTopKGetWorkspaceSize(
    const aclTensor* x, const aclTensor* biasOptional, int64_t k, int64_t kGroup,
    int64_t groupCount, int64_t groupSelectMode, int64_t renorm, int64_t normType, bool outFlag,
    double routedScalingFactor, double eps, const aclTensor* yOut, const aclTensor* expertIdxOut,
    const aclTensor* outOut, uint64_t* workspaceSize, aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnMoeGatingTopK(void* workspace, uint64_t workspaceSize,
                                             aclOpExecutor* executor, aclrtStream stream);

/* ---- MoeGatingTopKBackward (§1). xNorm [M,N] fp32, gradY [M,K] fp32/fp16/bf16,
 * expertIdx [M,K] int32, out [M,N] gradY dtype. normType 1 (sigmoid), and beyond the vendor
 * 0 (softmax, renorm 0 or 1; xNorm = softmax output) and 2 (sqrt-softplus, always renormalised;
 * xNorm = sqrt(softplus(x))). Errors: 161001 / 161002. */
MOEGRAD_C_API aclnnStatus aclnnMoeGatingTopKBackwardGetWorkspaceSize(
    const aclTensor* xNorm, const aclTensor* gradY, const aclTensor* expertIdx, int64_t renorm,
    int64_t normType, double routedScalingFactor, double eps, const aclTensor* out,
    uint64_t* workspaceSize, aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnMoeGatingTopKBackward(void* workspace, uint64_t workspaceSize,
                                                     aclOpExecutor* executor, aclrtStream stream);

/* ---- moegrad extensions of the gating pair (docs/operators.md §2.8, docs/decisions.md D33,
 * D34). The Ex forms take the vendor's arguments plus noRenorm: true never renormalises the k
 * weights, for every normType (the vendor's calls always renormalise sigmoid and sqrt-softplus);
 * y = routedScalingFactor * score[ids]. The backward's noRenorm must match the forward's. */
MOEGRAD_C_API aclnnStatus aclnnMoeGatingTopKExGetWorkspaceSize(
    const aclTensor* x, const aclTensor* biasOptional, int64_t k, int64_t kGroup,
    int64_t groupCount, int64_t groupSelectMode, int64_t renorm, int64_t normType, bool outFlag,
    double routedScalingFactor, double eps, bool noRenorm, const aclTensor* yOut,
    const aclTensor* expertIdxOut, const aclTensor* outOut, uint64_t* workspaceSize,
    aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnMoeGatingTopKEx(void* workspace, uint64_t workspaceSize,
                                               aclOpExecutor* executor, aclrtStream stream);
MOEGRAD_C_API aclnnStatus aclnnMoeGatingTopKBackwardExGetWorkspaceSize(
    const aclTensor* xNorm, const aclTensor* gradY, const aclTensor* expertIdx, int64_t renorm,
    int64_t normType, double routedScalingFactor, double eps, bool noRenorm, const aclTensor* out,
    uint64_t* workspaceSize, aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnMoeGatingTopKBackwardEx(void* workspace, uint64_t workspaceSize,
                                                       aclOpExecutor* executor,
                                                       aclrtStream stream);
/* MoeGatingReplay: the gating forward at given expert ids (no selection). x [M,N] float,
 * expertIdx [M,K] int32 (1 <= K <= N; host ids in [0,N), none twice in a row: 161002 naming row
 * and value; device ids out of range are skipped, weight 0), biasOptional [N] x dtype (checked,
 * not used: the bias only ranks), yOut [M,K] x dtype, normOut [M,N] fp32 (always written: the
 * backward's xNorm). Shape/attribute errors 561002. Gradient: MoeGatingTopKBackward(Ex). */
MOEGRAD_C_API aclnnStatus aclnnMoeGatingReplayGetWorkspaceSize(
    const aclTensor* x, const aclTensor* expertIdx, const aclTensor* biasOptional, int64_t renorm,
    int64_t normType, double routedScalingFactor, double eps, bool noRenorm, const aclTensor* yOut,
    const aclTensor* normOut, uint64_t* workspaceSize, aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnMoeGatingReplay(void* workspace, uint64_t workspaceSize,
                                               aclOpExecutor* executor, aclrtStream stream);

/* ---- MoeFinalizeRoutingV2 (§4). expandedX (R*K,H) modes 0/2 or (E,C,H) modes 1/3,
 * expandedRowIdx (R*K) int32, x1/x2 (R,H), bias (E,H), scales (R,K), expertIdx (R,K) int32,
 * out (R,H). dropPadMode 0/1 column layout (k*R + r), 2/3 row layout (r*K + k). */
MOEGRAD_C_API aclnnStatus aclnnMoeFinalizeRoutingV2GetWorkspaceSize(
    const aclTensor* expandedX, const aclTensor* expandedRowIdx, const aclTensor* x1Optional,
    const aclTensor* x2Optional, const aclTensor* biasOptional, const aclTensor* scalesOptional,
    const aclTensor* expertIdxOptional, int64_t dropPadMode, const aclTensor* out,
    uint64_t* workspaceSize, aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnMoeFinalizeRoutingV2(void* workspace, uint64_t workspaceSize,
                                                    aclOpExecutor* executor, aclrtStream stream);

/* ---- MoeFinalizeRoutingV2Grad (§3). Row layout (r*K + k). gradExpandedXOut (rows,H) in
 * mode 0 (rows = activeNum if 0 < activeNum < R*K else R*K) or (E,C,H) in mode 1;
 * gradScalesOut (R,K) scales dtype, or (R,1) gradY dtype and zeros without scales. */
MOEGRAD_C_API aclnnStatus aclnnMoeFinalizeRoutingV2GradGetWorkspaceSize(
    const aclTensor* gradY, const aclTensor* expandedRowIdx, const aclTensor* expandedXOptional,
    const aclTensor* scalesOptional, const aclTensor* expertIdxOptional,
    const aclTensor* biasOptional, int64_t dropPadMode, int64_t activeNum, int64_t expertNum,
    int64_t expertCapacity, const aclTensor* gradExpandedXOut, const aclTensor* gradScalesOut,
    uint64_t* workspaceSize, aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnMoeFinalizeRoutingV2Grad(void* workspace, uint64_t workspaceSize,
                                                        aclOpExecutor* executor,
                                                        aclrtStream stream);

/* ---- MoeFinalizeRoutingBiasGrad (moegrad extension, docs/decisions.md L22): the gradient of
 * MoeFinalizeRoutingV2's biasOptional. gradBiasOut[e,:] = sum over slots (r,k) with
 * expertIdx[r,k] = e of scales[r,k] * gradY[r,:] (scale 1 without scales), dropped slots
 * included. gradY (R,H) fp32/fp16/bf16, expertIdx (R,K) int32 in [0, expertNum), scalesOptional
 * (R,K), gradBiasOut (expertNum,H) gradY dtype. Deterministic (fixed order, no atomics); needs
 * a workspace (its size is returned by stage one). Shape/value errors: 561103. */
MOEGRAD_C_API aclnnStatus aclnnMoeFinalizeRoutingBiasGradGetWorkspaceSize(
    const aclTensor* gradY, const aclTensor* expertIdx, const aclTensor* scalesOptional,
    int64_t expertNum, const aclTensor* gradBiasOut, uint64_t* workspaceSize,
    aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnMoeFinalizeRoutingBiasGrad(void* workspace, uint64_t workspaceSize,
                                                          aclOpExecutor* executor,
                                                          aclrtStream stream);

/* ---- SwigluGroupQuantGrad (§5). gradY [...,H], x [...,2H] (fp32/fp16/bf16, same dtype),
 * weightOptional fp32 numel T (requires yOriginOptional, the UNWEIGHTED activation), groupIndex
 * [G] int64, clampLimit -1 or > 0, gradXOut like x, gradWeightOutOptional like weight (NULL:
 * not computed). */
MOEGRAD_C_API aclnnStatus aclnnSwigluGroupQuantGradGetWorkspaceSize(
    const aclTensor* gradY, const aclTensor* x, const aclTensor* weightOptional,
    const aclTensor* yOriginOptional, const aclTensor* groupIndexOptional, double clampLimit,
    const aclTensor* gradXOut, const aclTensor* gradWeightOutOptional, uint64_t* workspaceSize,
    aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnSwigluGroupQuantGrad(void* workspace, uint64_t workspaceSize,
                                                    aclOpExecutor* executor, aclrtStream stream);

/* ---- SwigluGroup forward (moegrad extension, docs/decisions.md L9): y = silu(x0')·x1'·weight,
 * rows at or past sum(groupIndex) zero. x [...,2H], yOut [...,H] x dtype. */
MOEGRAD_C_API aclnnStatus aclnnSwigluGroupGetWorkspaceSize(
    const aclTensor* x, const aclTensor* weightOptional, const aclTensor* groupIndexOptional,
    double clampLimit, const aclTensor* yOut, uint64_t* workspaceSize, aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnSwigluGroup(void* workspace, uint64_t workspaceSize,
                                           aclOpExecutor* executor, aclrtStream stream);

/* ---- SwigluGroupQuant (§6, D24). x [...,2H] fp32/fp16/bf16 (rank 2..8), weightOptional fp32
 * numel T, groupIndexOptional [G] int64, scaleOptional must be NULL (HiFloat8 only).
 * dstType ACL_FLOAT8_E4M3FN (36) or ACL_FLOAT8_E5M2 (35); quantMode 0 (FP8, blocks of 128 along
 * H, fp32 scales [...,ceil(H/128)], roundScale optional) or 1 (MX, blocks of 32, roundScale true,
 * ACL_FLOAT8_E8M0 scales [...,ceil(ceil(H/32)/2),2]); blockSize 0 or the mode's size;
 * dstTypeMax ignored. yOut [...,H] in dstType; yOriginOut [...,H] x dtype when outputOrigin
 * (the weighted SwiGLU before quantisation), ignored (may be NULL) otherwise. ACL_UINT8 tensors
 * are accepted as storage for yOut and the e8m0 scales. HiFloat8 (quantMode 2/3, dstType 34)
 * and FP4 (40/41): 161002 "not supported". */
MOEGRAD_C_API aclnnStatus aclnnSwigluGroupQuantGetWorkspaceSize(
    const aclTensor* x, const aclTensor* weightOptional, const aclTensor* groupIndexOptional,
    const aclTensor* scaleOptional, int64_t dstType, int64_t quantMode, int64_t blockSize,
    bool roundScale, double clampLimit, double dstTypeMax, bool outputOrigin,
    const aclTensor* yOut, const aclTensor* yScaleOut, const aclTensor* yOriginOut,
    uint64_t* workspaceSize, aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnSwigluGroupQuant(void* workspace, uint64_t workspaceSize,
                                                aclOpExecutor* executor, aclrtStream stream);

/* ---- ClippedSwiglu / ClippedSwigluV2 / ClippedSwigluGrad (docs/operators.md §9): the GPT-OSS
 * SwiGLU. x fp32/fp16/bf16 (rank 1..8, x.shape[dim] even), groupIndexOptional [G] int64;
 * out / gradY: x's shape with shape[dim] halved; gradXOut: x's shape; all x's dtype. limit > 0,
 * alpha and bias finite. clampMode (V2) 0 clamps the inputs, 1 clamps silu(gate) (alpha and bias
 * must then keep their defaults 1.702 and 1.0). ClippedSwigluGrad is the clampMode 0 backward.
 * Rows past sum(groupIndex) are zero. Errors: 161001 null, 161002 dtype/rank/dim/clampMode,
 * 561002 shapes and limit/alpha/bias. */
MOEGRAD_C_API aclnnStatus aclnnClippedSwigluGetWorkspaceSize(
    const aclTensor* x, const aclTensor* groupIndexOptional, int64_t dim, double alpha,
    double limit, double bias, bool interleaved, const aclTensor* out, uint64_t* workspaceSize,
    aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnClippedSwiglu(void* workspace, uint64_t workspaceSize,
                                             aclOpExecutor* executor, aclrtStream stream);
MOEGRAD_C_API aclnnStatus aclnnClippedSwigluV2GetWorkspaceSize(
    const aclTensor* x, const aclTensor* groupIndexOptional, int64_t dim, double alpha,
    double limit, double bias, bool interleaved, int64_t clampMode, const aclTensor* out,
    uint64_t* workspaceSize, aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnClippedSwigluV2(void* workspace, uint64_t workspaceSize,
                                               aclOpExecutor* executor, aclrtStream stream);
MOEGRAD_C_API aclnnStatus aclnnClippedSwigluGradGetWorkspaceSize(
    const aclTensor* gradY, const aclTensor* x, const aclTensor* groupIndexOptional, int64_t dim,
    double alpha, double limit, double bias, bool interleaved, const aclTensor* gradXOut,
    uint64_t* workspaceSize, aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnClippedSwigluGrad(void* workspace, uint64_t workspaceSize,
                                                 aclOpExecutor* executor, aclrtStream stream);
/* moegrad extension: the backward of either clamp mode (clampMode 1 has no vendor backward). */
MOEGRAD_C_API aclnnStatus aclnnClippedSwigluGradV2GetWorkspaceSize(
    const aclTensor* gradY, const aclTensor* x, const aclTensor* groupIndexOptional, int64_t dim,
    double alpha, double limit, double bias, bool interleaved, int64_t clampMode,
    const aclTensor* gradXOut, uint64_t* workspaceSize, aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnClippedSwigluGradV2(void* workspace, uint64_t workspaceSize,
                                                   aclOpExecutor* executor, aclrtStream stream);

/* ---- MoeInitRoutingV2 (docs/operators.md §8.1-§8.7; decisions D25-D31). Token permutation:
 * x [R,H] fp32/fp16/bf16, expertIdx [R,K] int32; dropPadMode 0: expandedXOut [R*K,H] (or
 * [min(activeNum, R*K),H] when activeNum > 0), 1: [expertNum, expertCapacity, H];
 * expandedRowIdxOut [R*K] int32, src->dst (slot r*K+k -> expanded row, -1 = dropped).
 * expertTokensCountOrCumsumFlag (mode 0): 0 none, 1 cumsum, 2 count -> [expertNum] int32;
 * expertTokensBeforeCapacityFlag (mode 1): per-expert counts before dropping -> [expertNum]
 * int32. An output whose flag is off may be NULL. Shape/attribute/value errors: 561103. */
MOEGRAD_C_API aclnnStatus aclnnMoeInitRoutingV2GetWorkspaceSize(
    const aclTensor* x, const aclTensor* expertIdx, int64_t activeNum, int64_t expertCapacity,
    int64_t expertNum, int64_t dropPadMode, int64_t expertTokensCountOrCumsumFlag,
    bool expertTokensBeforeCapacityFlag, const aclTensor* expandedXOut,
    const aclTensor* expandedRowIdxOut, const aclTensor* expertTokensCountOrCumsumOut,
    const aclTensor* expertTokensBeforeCapacityOut, uint64_t* workspaceSize,
    aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnMoeInitRoutingV2(void* workspace, uint64_t workspaceSize,
                                                aclOpExecutor* executor, aclrtStream stream);

/* ---- MoeInitRoutingV3 (docs/operators.md §8.8). As V2 plus: activeExpertRangeOptional
 * [start, end) (NULL or empty: [0, expertNum)), slots of other experts get -1 (rowIdxType 0);
 * rowIdxType 1 returns the dst->src order instead; expertTokensNumType 0 cumsum, 1 count
 * ([end-start] int64), 2 key-value ([expertNum, 2] int64), written when expertTokensNumFlag.
 * expertNum >= 1. No quantisation: scaleOptional and offsetOptional must be NULL and quantMode
 * -1 (161002 otherwise); expandedScaleOut is not written and may be NULL. */
MOEGRAD_C_API aclnnStatus aclnnMoeInitRoutingV3GetWorkspaceSize(
    const aclTensor* x, const aclTensor* expertIdx, const aclTensor* scaleOptional,
    const aclTensor* offsetOptional, int64_t activeNum, int64_t expertCapacity, int64_t expertNum,
    int64_t dropPadMode, int64_t expertTokensNumType, bool expertTokensNumFlag, int64_t quantMode,
    const aclIntArray* activeExpertRangeOptional, int64_t rowIdxType, const aclTensor* expandedXOut,
    const aclTensor* expandedRowIdxOut, const aclTensor* expertTokensCountOrCumsumOut,
    const aclTensor* expandedScaleOut, uint64_t* workspaceSize, aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnMoeInitRoutingV3(void* workspace, uint64_t workspaceSize,
                                                aclOpExecutor* executor, aclrtStream stream);

/* ---- MoeInitRoutingV2Grad (docs/operators.md §8.9; D29). gradExpandedX [rows,H] (mode 0; rows
 * = R*K, or min(activeNum, R*K) when activeNum > 0) or [E,C,H] (mode 1); expandedRowIdx [R*K]
 * int32 src->dst; out [R,H]: per token the fp32 sum of its K rows, skipping -1 and rows past the
 * end. */
MOEGRAD_C_API aclnnStatus aclnnMoeInitRoutingV2GradGetWorkspaceSize(
    const aclTensor* gradExpandedX, const aclTensor* expandedRowIdx, int64_t topK,
    int64_t dropPadMode, int64_t activeNum, const aclTensor* out, uint64_t* workspaceSize,
    aclOpExecutor** executor);
MOEGRAD_C_API aclnnStatus aclnnMoeInitRoutingV2Grad(void* workspace, uint64_t workspaceSize,
                                                    aclOpExecutor* executor, aclrtStream stream);

#ifdef __cplusplus
}
#endif

#endif /* MOEGRAD_ACLNN_H_ */
