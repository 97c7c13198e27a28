/*
 * moe_grouped core: the C ABI.
 *
 * This header is the whole contract between the CUDA core and its callers
 * (the Python package loads the shared library with ctypes). It knows nothing
 * of Python or torch: tensors are raw device pointers, streams are
 * cudaStream_t passed as void*.
 *
 * Conventions
 *  - Every function returns mg_status. On failure, mg_last_error() returns a
 *    sentence describing what went wrong, with the offending values; the
 *    message is thread-local and valid until the next call on that thread.
 *  - Nothing here synchronises with the host. Tokens per expert (m_splits)
 *    are read only by kernels; the host never sees them.
 *  - Nothing here allocates while `stream` is being captured into a CUDA
 *    graph. Scratch memory comes from the workspace manager, which grows only
 *    outside capture; a capture that would need more returns
 *    MG_ERROR_CAPTURE with the number of bytes to reserve beforehand.
 *  - Matrices are row-major and contiguous unless a stride says otherwise.
 *
 * Grouped GEMM shapes, per expert e with m_e tokens (sum of m_e = M):
 *    fprop: Y_e[m_e, N]  = X_e[m_e, K] . W_e[N, K]^T   (+ bias_e[N])
 *    dgrad: dX_e[m_e, K] = dY_e[m_e, N] . W_e[N, K]
 *    wgrad: dW_e[N, K]  (+)= dY_e[m_e, N]^T . X_e[m_e, K]
 */
#ifndef MOE_GROUPED_H_
#define MOE_GROUPED_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define MG_API __declspec(dllexport)
#else
#define MG_API __attribute__((visibility("default")))
#endif

/* Bumped whenever a declaration below changes meaning. */
#define MG_ABI_VERSION 3

typedef enum mg_status {
  MG_OK = 0,
  MG_ERROR_INVALID_ARGUMENT = 1, /* a bad pointer, shape, dtype or slot */
  MG_ERROR_CAPTURE = 2,          /* would allocate or grow during capture */
  MG_ERROR_CUDA = 3,             /* the CUDA runtime reported an error */
  MG_ERROR_UNSUPPORTED = 4,      /* not built in, or not on this device */
  MG_ERROR_OUT_OF_MEMORY = 5,
  MG_ERROR_INTERNAL = 6
} mg_status;

typedef enum mg_dtype {
  MG_FLOAT32 = 0,
  MG_FLOAT16 = 1,
  MG_BFLOAT16 = 2,
  MG_INT32 = 3,
  MG_INT64 = 4,
  MG_FLOAT8_E4M3 = 5,
  MG_FLOAT8_E5M2 = 6
} mg_dtype;

typedef enum mg_gemm_kind {
  MG_GEMM_FPROP = 0,
  MG_GEMM_DGRAD = 1,
  MG_GEMM_WGRAD = 2
} mg_gemm_kind;

/* Workspace slots: two GEMMs that can sit in one graph never share one. */
#define MG_SLOT_FPROP_DGRAD 0
#define MG_SLOT_WGRAD 1
#define MG_MAX_SLOTS 8

/* ---- library ----------------------------------------------------------- */

MG_API const char* mg_last_error(void);
MG_API int mg_abi_version(void);
/* One line: version, CUDA runtime it was built with, target architectures,
 * kernel families compiled in. */
MG_API const char* mg_build_info(void);
/* Bitmask of MG_CAP_* for what this build contains. */
#define MG_CAP_SETUP 1u
#define MG_CAP_GROUPED_GEMM_16BIT 2u
#define MG_CAP_GROUPED_GEMM_FP8_BLOCKWISE 4u
#define MG_CAP_PERMUTE 8u
#define MG_CAP_FP8_QUANTIZE 16u
#define MG_CAP_SWIGLU 32u
#define MG_CAP_GATHERED_GEMM 64u
#define MG_CAP_DGRAD_SWIGLU 128u
#define MG_CAP_FPROP_SWIGLU 256u
#define MG_CAP_EP_TRANSPORT 512u
#define MG_CAP_EXPERTS_SEQUENCE 1024u
#define MG_CAP_EXPERTS_SEQUENCE_FP8 2048u
MG_API uint32_t mg_capabilities(void);

/* ---- workspace manager, keyed by (device, slot) -------------------------
 * One persistent allocation per key. It grows only outside capture. A grown
 * entry keeps its old blocks alive until mg_workspace_release, because a
 * graph captured earlier still reads them. Thread-safe.                     */

/* Ensure at least `bytes` on (device, slot). Never call while capturing. */
MG_API mg_status mg_workspace_reserve(int device, int slot, size_t bytes);
/* The slot's buffer, at least `bytes` long. Grows outside capture; while
 * `stream` is capturing and the buffer is too small, fails with
 * MG_ERROR_CAPTURE naming the bytes to reserve. */
MG_API mg_status mg_workspace_get(int device, int slot, size_t bytes,
                                  void* stream, void** out_ptr);
typedef struct mg_workspace_stats {
  size_t capacity;       /* bytes of the live buffer */
  size_t high_water;     /* largest request seen */
  size_t retired_bytes;  /* older buffers kept alive for earlier graphs */
  uint64_t grow_count;   /* allocations made for this key */
} mg_workspace_stats;
MG_API mg_status mg_workspace_stats_get(int device, int slot,
                                        mg_workspace_stats* out);
/* Free the key's buffers (slot -1: every slot of the device; device -1:
 * every device). Graphs that used them must not be replayed afterwards. */
MG_API mg_status mg_workspace_release(int device, int slot);

/* ---- setup kernel ---------------------------------------------------------
 * m_splits (int32 or int64, num_groups entries, on the device) ->
 *   offsets[num_groups + 1]: exclusive prefix sum, offsets[0] = 0, as int64;
 *   problem_shapes[num_groups][3] (int32, may be NULL): the GEMM problem of
 *   each group for `kind` in CUTLASS (M, N, K) order:
 *     fprop (m_e, n, k), dgrad (m_e, k, n), wgrad (n, k, m_e).
 * Counts are clamped to [0, total_rows - offset] so that no kernel reads past
 * the static buffer even when m_splits is wrong; validating the counts is the
 * caller's business (it would need a host sync).                           */
MG_API mg_status mg_grouped_setup(const void* m_splits, mg_dtype splits_dtype,
                                  int num_groups, int64_t total_rows,
                                  int64_t n, int64_t k, mg_gemm_kind kind,
                                  int64_t* offsets, int32_t* problem_shapes,
                                  void* stream);

/* Zeros rows [end, total_rows) of out (row_bytes each, on `device`), end
 * being the sum of the counts clamped as above (mg_grouped_setup's
 * offsets[num_groups]): the rows past a short m_splits belong to no expert,
 * and the grouped ops give zeros there. Rows before `end` are not touched;
 * with no such rows the kernel only reads m_splits.                       */
MG_API mg_status mg_zero_rows_past_splits(const void* m_splits, mg_dtype splits_dtype,
                                          int num_groups, int64_t total_rows, void* out,
                                          int64_t row_bytes, int device, void* stream);

/* ---- grouped GEMMs (bf16 / fp16 operands, fp32 accumulation) ------------
 * A grouped operand is either one contiguous [E, rows, cols] tensor (base,
 * group_stride in elements) or a device array of E pointers, each to a
 * contiguous [rows, cols] matrix (ptrs, base NULL).                        */
typedef struct mg_group_operand {
  const void* base;
  int64_t group_stride;
  const void* const* ptrs; /* device memory; used when base is NULL */
} mg_group_operand;

typedef struct mg_grouped_problem {
  int num_groups;         /* E */
  int64_t total_rows;     /* M = sum of m_splits, the static token count */
  int64_t n;              /* out_features */
  int64_t k;              /* in_features */
  const void* m_splits;   /* device, num_groups entries */
  mg_dtype splits_dtype;  /* MG_INT32 or MG_INT64 */
  mg_dtype dtype;         /* MG_BFLOAT16 or MG_FLOAT16: tokens and weights */
  int device;
  int workspace_slot;     /* MG_SLOT_FPROP_DGRAD or MG_SLOT_WGRAD */
} mg_grouped_problem;

/* The grouped GEMMs launched afterwards on `device` from this process use at
 * most `sms` SMs (0: all), so that a kernel on another stream (e.g. an
 * expert-parallel combine) can run beside them on the others. Read when a
 * GEMM is launched: a captured graph keeps the value of its capture.       */
MG_API mg_status mg_set_gemm_sm_limit(int device, int sms);

/* Bytes of workspace `kind` needs for this problem (reserve before capture). */
MG_API mg_status mg_grouped_gemm_workspace_size(const mg_grouped_problem* p,
                                                mg_gemm_kind kind,
                                                size_t* out_bytes);

/* y[M, N] (y_dtype: bf16, fp16 or fp32) = x[M, K] . W^T (+ bias[E, N]).
 * bias has the operand dtype, or is NULL. */
MG_API mg_status mg_grouped_fprop(const mg_grouped_problem* p, const void* x,
                                  mg_group_operand weight, const void* bias,
                                  void* y, mg_dtype y_dtype, void* stream);
/* dx[M, K] (dx_dtype: bf16, fp16 or fp32) = dy[M, N] . W */
MG_API mg_status mg_grouped_dgrad(const mg_grouped_problem* p, const void* dy,
                                  mg_group_operand weight, void* dx,
                                  mg_dtype dx_dtype, void* stream);
/* dW_e[N, K] = dy_e^T . x_e, or += when accumulate != 0 (then dw_dtype is
 * usually fp32, Megatron's main_grad). A group with m_e = 0 gets zeros, or
 * is left untouched when accumulating. */
MG_API mg_status mg_grouped_wgrad(const mg_grouped_problem* p, const void* dy,
                                  const void* x, mg_group_operand dw,
                                  mg_dtype dw_dtype, int accumulate,
                                  void* stream);
/* dbias[E, N] (dbias_dtype: fp32 or the operand dtype) = per-group column
 * sums of dy[M, N]; zero for empty groups. */
MG_API mg_status mg_grouped_dbias(const mg_grouped_problem* p, const void* dy,
                                  void* dbias, mg_dtype dbias_dtype,
                                  void* stream);

/* ---- gathered grouped GEMMs (bf16 operands) ------------------------------
 * The MoE layer's token-side operands read through the routing index instead
 * of from a permuted copy: row r (0 <= r < total_rows) of the operand is row
 * index[r] of `source`, a row-major [source_rows, cols] bf16 matrix whose cols
 * is the operand's width (K for fprop's x, N for dgrad's dy, N and K for
 * wgrad's dy and x). An index outside [0, source_rows) reads a row of zeros
 * (rows no copy maps to). index: int32 on the device, total_rows entries
 * (unread, and may be NULL, when total_rows is 0); source_rows in [1, 2^31). MG_CAP_GATHERED_GEMM; other operand dtypes fail
 * with MG_ERROR_UNSUPPORTED. Workspace as mg_grouped_gemm_workspace_size.  */
typedef struct mg_row_gather {
  const int32_t* index;
  int64_t source_rows;
} mg_row_gather;

/* y[M, N] = x_source[index] . W^T (no bias). */
MG_API mg_status mg_grouped_fprop_gathered(const mg_grouped_problem* p, const void* x_source,
                                           mg_row_gather x_rows, mg_group_operand weight,
                                           void* y, mg_dtype y_dtype, void* stream);
/* dx[M, K] = dy_source[index] . W */
MG_API mg_status mg_grouped_dgrad_gathered(const mg_grouped_problem* p, const void* dy_source,
                                           mg_row_gather dy_rows, mg_group_operand weight,
                                           void* dx, mg_dtype dx_dtype, void* stream);
/* dW_e (+)= dy_e^T . x_e as mg_grouped_wgrad, where dy (x) is read through
 * *dy_rows (*x_rows) when that pointer is non-NULL, else as stored. */
MG_API mg_status mg_grouped_wgrad_gathered(const mg_grouped_problem* p, const void* dy,
                                           const mg_row_gather* dy_rows, const void* x,
                                           const mg_row_gather* x_rows, mg_group_operand dw,
                                           mg_dtype dw_dtype, int accumulate, void* stream);

/* ---- fc1 with SwiGLU (bf16) -------------------------------------------------
 * The fused MoE experts path's fc1 and activation (MG_CAP_FPROP_SWIGLU):
 * g[M, N] = x . W^T as mg_grouped_fprop (x_rows NULL) or as
 * mg_grouped_fprop_gathered (x read through *x_rows), and h[M, N / 2] =
 * silu(gate) * up of each row [gate | up] of g, rounded as
 * mg_swiglu_forward rounds: bitwise the GEMM followed by mg_swiglu_forward.
 * N = 2 * ffn, a multiple of 16. Rows at or past the clamped sum of m_splits
 * are not written by the GEMM (as mg_grouped_fprop); h's there are not
 * specified. One kernel (SwiGLU in the epilogue) where the ping-pong fprop
 * takes the problem and the heuristic picks it, else the two passes.
 * bf16 only; workspace as mg_grouped_gemm_workspace_size(MG_GEMM_FPROP). */
MG_API mg_status mg_grouped_fprop_swiglu(const mg_grouped_problem* p, const void* x,
                                         const mg_row_gather* x_rows, mg_group_operand weight,
                                         void* g, void* h, void* stream);

/* ---- fc2's dgrad with the weighted SwiGLU backward (bf16) -----------------
 * The fused MoE experts path's backward through fc2 and SwiGLU in one kernel
 * (MG_CAP_DGRAD_SWIGLU): dh_u = dy . W (dgrad, [M, K], K = the experts' ffn)
 * is not stored; per row r < sum(m_splits) and column c < K, with
 * [gate | up] = g[r] ([M, 2K], fc1's output) and h = silu(gate) * up:
 *   g[r]  <- dg[r], the SwiGLU backward of weights[r] * dh_u[r] (in place);
 *   wh[r] <- weights[r] * h  ([M, K]);
 *   dprob_partials[r, t] <- sum of dh_u[r, c] * h[c] over the columns c of
 *     tile t (fp32; dprob_r = <dh_u[r], h> is the sum over t, in t order).
 * Elementwise results are bitwise those of mg_grouped_dgrad (dx_dtype bf16)
 * followed by mg_swiglu_weighted_backward. weights: [M] fp32 or NULL (1);
 * dprob_partials: [M, partial_cols] fp32 or NULL, partial_cols from
 * mg_grouped_dgrad_swiglu_partial_cols. Rows at or past sum(m_splits) are
 * not written. Workspace as mg_grouped_gemm_workspace_size(MG_GEMM_DGRAD).
 * Measured at about half the speed of the two separate kernels on the H100
 * (gemm/sm90_swiglu_backward_epilogue.cuh says why); the package runs it
 * only when asked (MOE_GROUPED_DGRAD_SWIGLU=fused). */
MG_API mg_status mg_grouped_dgrad_swiglu(const mg_grouped_problem* p, const void* dy,
                                         mg_group_operand weight, void* g, const float* weights,
                                         void* wh, float* dprob_partials, int64_t partial_cols,
                                         void* stream);
/* The column tiles over k (the dgrad's K, the experts' ffn) of the partials. */
MG_API mg_status mg_grouped_dgrad_swiglu_partial_cols(int64_t k, int64_t* out_cols);

/* ---- FP8 block quantization (1x128 and 128x128) ----------------------------
 * Scales follow TransformerEngine's block-scaling rules: per block
 * amax' = max(amax, amax_epsilon); scale = fp8_max / amax' (1 when amax' is 0,
 * inf or NaN; FLT_MAX when the quotient overflows); with pow2_scales the
 * scale is rounded down to a power of two. Stored: fp8(x * scale) (round to
 * nearest, saturating) and scale_inv = 1 / scale. A block that overhangs the
 * matrix takes its amax over the part inside. MG_CAP_FP8_QUANTIZE covers
 * every function of this section.                                          */
typedef struct mg_quantize_config {
  mg_dtype fp8_dtype;  /* MG_FLOAT8_E4M3 or MG_FLOAT8_E5M2 */
  int pow2_scales;     /* non-zero: power-of-two scales */
  float amax_epsilon;
} mg_quantize_config;

/* Row-wise: x[rows, cols] (bf16, fp16 or fp32) -> q[rows, cols] fp8 and
 * scale_inv[rows, ceil(cols / 128)] fp32, one scale per row per 128 columns. */
MG_API mg_status mg_quantize_rowwise_1x128(const void* x, mg_dtype x_dtype, int64_t rows,
                                           int64_t cols, mg_quantize_config config, void* q,
                                           float* scale_inv, void* stream);

/* Column-wise per group: the operand layout of the FP8 wgrad GEMM, which
 * reduces over each group's tokens. Group e is rows [o_e, o_e + m_e) of
 * x[rows, cols] (m_splits on the device, clamped like mg_grouped_setup); its
 * transpose X_e^T [cols, m_e] is quantized in 1x128 blocks along the tokens,
 * blocks restarting at the group's first token. With
 *   p_e = sum_{j<e} round_up(m_j, 128)   (128-byte aligned group starts)
 *   b_e = sum_{j<e} ceil(m_j / 128):
 *   qt[cols, padded_rows] fp8, padded_rows = round_up(rows, 128) + 128 * E:
 *     qt[c, p_e + t] = token t of group e, column c, for t < m_e, and 0
 *     for m_e <= t < round_up(m_e, 128) (whole 128-byte runs are stored:
 *     the wgrad's TMA boxes read aligned lines, and a partial run costs the
 *     memory a read-modify-write);
 *   scale_inv_t[scale_rows, cols] fp32, scale_rows = ceil(rows / 128) + E:
 *     scale_inv_t[b_e + j, c] = block j (tokens [128 j, 128 j + 128)) of
 *     group e, column c: per group a packed [ceil(m_e / 128), cols] matrix.
 * Columns of qt past p_E and rows of scale_inv_t that no group owns are not
 * written.                                                                 */
/* dbias[E, cols] fp32 (may be NULL): the column sums of each group in fp32,
 * zero for an empty group. Deterministic: per 128-token block, each 16-token
 * segment is summed in token order, the eight segment sums pairwise
 * ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)); block sums j = w, w + 8,
 * ... are added in order into eight running sums w = 0..7, which are then
 * added in order w = 0..7. Only dbias needs scratch memory: the block starts
 * ((E + 1) int64) and per-block column sums ((ceil(rows / 128) + E) * cols
 * fp32) live in the (device, workspace_slot) workspace; size it with one
 * eager call before capture. Without dbias the workspace is not touched.   */
MG_API mg_status mg_quantize_columnwise_grouped_1x128(
    const void* x, mg_dtype x_dtype, int64_t rows, int64_t cols, const void* m_splits,
    mg_dtype splits_dtype, int num_groups, mg_quantize_config config, void* qt,
    float* scale_inv_t, float* dbias, int device, int workspace_slot, void* stream);

/* Row-wise and column-wise from one read of x (the backward's dY, the
 * forward's X): q and scale_inv as mg_quantize_rowwise_1x128 (every row,
 * also rows past the groups when m_splits sums to less than rows), qt,
 * scale_inv_t and the optional dbias as mg_quantize_columnwise_grouped_1x128,
 * bit for bit.                                                              */
MG_API mg_status mg_quantize_rowwise_columnwise_grouped_1x128(
    const void* x, mg_dtype x_dtype, int64_t rows, int64_t cols, const void* m_splits,
    mg_dtype splits_dtype, int num_groups, mg_quantize_config config, void* q,
    float* scale_inv, void* qt, float* scale_inv_t, float* dbias, int device,
    int workspace_slot, void* stream);

/* Gathered: the matrix quantized has rows rows, row r being x[index[r]]
 * (x [source_rows, cols]; index int32 on the device; an entry outside
 * [0, source_rows) reads as a row of zeros), bit for bit what gathering the
 * rows and then quantizing gives. m_splits NULL: row-wise only
 * (mg_quantize_rowwise_1x128; qt and scale_inv_t NULL). Else the grouped
 * copies of mg_quantize_rowwise_columnwise_grouped_1x128 over the gathered
 * rows, q and scale_inv NULL for the column-wise copy alone; no dbias, so
 * the workspace is not touched (device and workspace_slot are unused).   */
MG_API mg_status mg_quantize_gathered_1x128(
    const void* x, mg_dtype x_dtype, int64_t source_rows, int64_t cols, const int32_t* index,
    int64_t rows, const void* m_splits, mg_dtype splits_dtype, int num_groups,
    mg_quantize_config config, void* q, float* scale_inv, void* qt, float* scale_inv_t,
    int device, int workspace_slot, void* stream);

/* h = swiglu(g) for g [rows, 2 * ffn] (bf16, fp16 or fp32; gate then up, as
 * mg_swiglu_forward), quantized row-wise like mg_quantize_rowwise_1x128:
 * q [rows, ffn] fp8, scale_inv [rows, ceil(ffn / 128)]; bitwise those two
 * passes, without storing h. Needs ffn % 16 == 0 and 16-byte aligned g and q.
 * MG_CAP_FP8_QUANTIZE.                                                     */
MG_API mg_status mg_swiglu_quantize_rowwise_1x128(const void* g, mg_dtype dtype, int64_t rows,
                                                  int64_t ffn, mg_quantize_config config, void* q,
                                                  float* scale_inv, void* stream);

/* Weights in 128x128 blocks: w [E][n, k] (bf16, fp16 or fp32; see
 * mg_group_operand) -> q[E, n, k] fp8 and scale_inv[E, ceil(n / 128),
 * ceil(k / 128)] fp32, one scale per 128x128 block. When qt is not NULL, also
 * the transposed copy the dgrad GEMM reads: qt[E, k, n] with
 * qt[e, c, r] = q[e, r, c] and scale_inv_t[E, ceil(k / 128), ceil(n / 128)],
 * the transposed scale matrix.                                             */
MG_API mg_status mg_quantize_weight_128x128(mg_group_operand w, mg_dtype w_dtype,
                                            int num_groups, int64_t n, int64_t k,
                                            mg_quantize_config config, void* q,
                                            float* scale_inv, void* qt, float* scale_inv_t,
                                            void* stream);

/* ---- FP8 block-scaled grouped GEMMs (sm_90a) ------------------------------
 * DeepSeek-V3 / TransformerEngine Float8BlockScaling: activations and
 * gradients quantized in 1x128 blocks, weights in 128x128 blocks; products
 * accumulate in fp32 and are promoted (scaled and added to an fp32 sum) at
 * every 128-deep block of the reduction. The operands come from the
 * quantizers above; p->dtype is the high-precision dtype of y, dx and bias
 * (MG_BFLOAT16). n and k must be multiples of 16 (16-byte fp8 rows for TMA).
 * Per-group pointers, shapes and scale pointers are written by a setup
 * kernel into the (device, p->workspace_slot) workspace, as for the 16-bit
 * GEMMs.                                                                   */
typedef struct mg_fp8_operand {
  const void* data;        /* fp8 values */
  const float* scale_inv;  /* their block scales (dequantize: multiply) */
  mg_dtype dtype;          /* MG_FLOAT8_E4M3 or MG_FLOAT8_E5M2 */
} mg_fp8_operand;

/* Bytes of workspace an FP8 GEMM of `kind` needs (reserve before capture). */
MG_API mg_status mg_grouped_fp8_workspace_size(const mg_grouped_problem* p,
                                               mg_gemm_kind kind,
                                               size_t* out_bytes);
/* y[M, N] (p->dtype) = x . W^T (+ bias[E, N] in p->dtype, or NULL)
 *   x: E4M3 [M, K], scale_inv [M, ceil(K / 128)]  (row-wise 1x128)
 *   w: E4M3 [E, N, K], scale_inv [E, ceil(N / 128), ceil(K / 128)]      */
MG_API mg_status mg_grouped_fp8_fprop(const mg_grouped_problem* p,
                                      mg_fp8_operand x, mg_fp8_operand w,
                                      const void* bias, void* y, void* stream);
/* dx[M, K] (p->dtype) = dy . W
 *   dy: E4M3 or E5M2 [M, N], scale_inv [M, ceil(N / 128)]  (row-wise)
 *   wt: W transposed, E4M3 [E, K, N], scale_inv [E, ceil(K / 128),
 *       ceil(N / 128)]  (the qt output of the 128x128 weight quantizer)  */
MG_API mg_status mg_grouped_fp8_dgrad(const mg_grouped_problem* p,
                                      mg_fp8_operand dy, mg_fp8_operand wt,
                                      void* dx, void* stream);
/* dW_e[N, K] (dw_dtype: fp32 or p->dtype) = dy_e^T . x_e, or += when
 * accumulate != 0. Both operands in the grouped column-wise layout of
 * mg_quantize_columnwise_grouped_1x128 over the same m_splits:
 *   dyt: E4M3 or E5M2 [N, padded_rows], scale_inv [scale_rows, N]
 *   xt:  E4M3 [K, padded_rows], scale_inv [scale_rows, K]
 * A group with m_e = 0 gets zeros, or is left untouched when accumulating. */
MG_API mg_status mg_grouped_fp8_wgrad(const mg_grouped_problem* p,
                                      mg_fp8_operand dyt, mg_fp8_operand xt,
                                      mg_group_operand dw, mg_dtype dw_dtype,
                                      int accumulate, void* stream);

/* ---- token permutation (MoE dispatch and combine) ------------------------
 * Token copy i = t * top_k + j is token t's j-th routing choice; there are
 * n = num_tokens * top_k copies. row_id_map[n] (int64) gives each copy's row
 * in the permuted buffer, -1 for a copy that has none (an expert index
 * outside [0, num_experts), or dropped past an expert's capacity). Rows are
 * ordered by (expert, copy index): a stable sort, deterministic.           */
#define MG_SLOT_PERMUTE 2 /* the workspace slot Python uses for permutation */

/* experts[num_tokens, top_k] (int32 or int64) -> row_id_map[n] and
 * m_splits[num_experts] (int64 token copies per expert); the permuted
 * buffer has n rows. Scratch (about 4 * num_experts * ceil(n / 256) bytes)
 * comes from the (device, workspace_slot) workspace. num_experts <= 4096.  */
MG_API mg_status mg_permute_index(const void* experts, mg_dtype experts_dtype,
                                  int64_t num_tokens, int top_k, int num_experts,
                                  int64_t* row_id_map, int64_t* m_splits,
                                  int device, int workspace_slot, void* stream);
/* mg_permute_index with an expert capacity (token dropping, static shapes):
 * each expert keeps at most `capacity` (0 <= capacity < 2^31 - 1) of its
 * copies; the others get row -1. Which ones it keeps:
 *   probs == NULL: the first `capacity` in copy (token) order;
 *   probs [num_tokens, top_k] fp32 (the routing probabilities): the
 *     `capacity` with the highest probability, ties to the lower copy index
 *     (-0.0 counts as +0.0; NaN order is unspecified).
 * Kept copies keep the (expert, copy index) row order. Packed
 * (pad_to_capacity = 0): expert e's rows follow expert e - 1's, the buffer
 * needs min(n, num_experts * capacity) rows and m_splits[e] = kept copies.
 * Padded (pad_to_capacity != 0): expert e's rows start at e * capacity, the
 * buffer has num_experts * capacity rows (< 2^31) and m_splits[e] = capacity.
 * Dropping by probability adds 25 * n bytes plus a radix sort's scratch to
 * the workspace.                                                           */
MG_API mg_status mg_permute_index_capacity(const void* experts, mg_dtype experts_dtype,
                                           int64_t num_tokens, int top_k, int num_experts,
                                           const float* probs, int64_t capacity,
                                           int pad_to_capacity, int64_t* row_id_map,
                                           int64_t* m_splits, int device, int workspace_slot,
                                           void* stream);
/* The router's choice: experts[t, :] = the top_k experts of scores[t, :]
 * (fp32 [num_tokens, num_experts], row-major), best first; equal scores
 * rank the lower expert first (-0 and +0 are equal), NaN ranks above
 * +inf (as torch.topk).
 * counts[e] = copies routed to expert e (int64 [num_experts], overwritten).
 * 1 <= num_experts <= 1024, 1 <= top_k <= min(num_experts, 32).          */
MG_API mg_status mg_route_topk(const float* scores, int64_t num_tokens, int num_experts, int top_k,
                               int64_t* experts, int64_t* counts, void* stream);
/* The softmax router after its gate GEMM (route_softmax.cu), for logits
 * fp32 [num_tokens, num_experts]: experts and counts as mg_route_topk (the
 * logits ranked), and
 *   lse[t] = logsumexp(logits[t, :]);
 *   weights[t, j] (fp32 [num_tokens, top_k]) = scaling * (CHOSEN: the
 *     softmax over the token's top_k logits, i.e. topk-then-softmax or
 *     softmax + renormalised top-k; ALL: the softmax over all experts);
 *   losses[0] = E * sum_e counts[e] / (T * top_k) * mean_t p[t, e] (the
 *     load-balancing loss), losses[1] = mean_t lse[t]^2 (the z loss).
 * partials: fp32 [mg_route_softmax_partial_rows(T), num_experts + 1]
 * scratch. Deterministic. num_tokens 0: counts and losses are zeros.      */
#define MG_ROUTE_SOFTMAX_CHOSEN 0
#define MG_ROUTE_SOFTMAX_ALL 1
MG_API mg_status mg_route_softmax_partial_rows(int64_t num_tokens, int64_t* out_rows);
MG_API mg_status mg_route_softmax(const float* logits, int64_t num_tokens, int num_experts,
                                  int top_k, int weights_mode, float scaling, int64_t* experts,
                                  int64_t* counts, float* weights, float* lse, float* partials,
                                  float* losses, void* stream);
/* Its backward: out = d loss / d logits from grad_weights [T, top_k], the
 * losses' grad_losses [2] and grad_logits [T, E] (each NULL when it has
 * no gradient), written as fp32 [T, E] or, out_dtype MG_BFLOAT16, as the
 * bf16 halves [T, 2E] = [hi | lo] with hi + lo the fp32 value to 16 bits
 * (what the gate GEMM's backward takes). Same experts, counts and lse as
 * the forward returned.                                                    */
MG_API mg_status mg_route_softmax_backward(const float* logits, const float* lse,
                                           const int64_t* experts, const int64_t* counts,
                                           int64_t num_tokens, int num_experts, int top_k,
                                           int weights_mode, float scaling,
                                           const float* grad_weights, const float* grad_losses,
                                           const float* grad_logits, mg_dtype out_dtype,
                                           void* out, void* stream);
/* permuted[row_id_map[t * top_k + j], :] = x[t, :] for the copies with a
 * row. x and permuted have `dtype` (fp32, fp16 or bf16), hidden columns;
 * rows no copy maps to are left untouched.                                 */
MG_API mg_status mg_permute_rows(const void* x, mg_dtype dtype, int64_t num_tokens,
                                 int64_t hidden, int top_k, const int64_t* row_id_map,
                                 void* permuted, void* stream);
/* out[t, :] = sum_j weights[t, j] * y[row_id_map[t * top_k + j], :] summed in
 * fp32 in j order; weights [num_tokens, top_k] are fp32 or `dtype`, or NULL
 * for a plain sum (the backward of mg_permute_rows). Unmapped copies add 0. */
MG_API mg_status mg_unpermute_rows(const void* y, mg_dtype dtype, int64_t num_tokens,
                                   int64_t hidden, int top_k, const int64_t* row_id_map,
                                   const void* weights, mg_dtype weights_dtype, void* out,
                                   void* stream);
/* Backward of mg_unpermute_rows for copy (t, j) with row r:
 *   dy[r, :] = weights[t, j] * dout[t, :]   (rows no copy maps to: untouched)
 *   dweights[t, j] = <dout[t, :], y[r, :]>  (0 for unmapped copies; dweights
 *   has weights_dtype and may be NULL).                                    */
MG_API mg_status mg_unpermute_rows_backward(const void* dout, const void* y, mg_dtype dtype,
                                            int64_t num_tokens, int64_t hidden, int top_k,
                                            const int64_t* row_id_map, const void* weights,
                                            mg_dtype weights_dtype, void* dy, void* dweights,
                                            void* stream);

/* ---- SwiGLU on the fused fc1 output ------------------------------------
 * h [rows, 2 * ffn] = [gate | up] row-major, `dtype` fp32, fp16 or bf16.
 * Forward: y [rows, ffn] = silu(gate) * up. Backward: dh [rows, 2 * ffn] =
 * [d_gate | d_up] from dy [rows, ffn]. Computed in fp32 and rounded to
 * `dtype` where torch's composed silu(gate) * up stores a tensor (silu's
 * output, the product, dy * up), so both equal torch's results.           */
MG_API mg_status mg_swiglu_forward(const void* h, mg_dtype dtype, int64_t rows, int64_t ffn,
                                   void* y, void* stream);
MG_API mg_status mg_swiglu_backward(const void* dy, const void* h, mg_dtype dtype, int64_t rows,
                                    int64_t ffn, void* dh, void* stream);
/* The weighted SwiGLU backward of the fused MoE experts path, one pass over
 * the permuted rows. Per row r (weights[r] = w, fp32; NULL: w = 1) from
 * dh_u [rows, ffn] (fc2's dgrad of the unweighted output gradient) and
 * g [rows, 2 * ffn] (fc1's output [gate | up]), with h = silu(gate) * up:
 *   dg [rows, 2 * ffn] = SwiGLU backward of dh = w * dh_u
 *   wh [rows, ffn]     = w * h                      (fc2's wgrad operand)
 *   dprob [rows] fp32  = sum of dh_u * h, fp32       (the weight's gradient;
 *                        may be NULL)
 * rounded like mg_swiglu_backward with dy = dtype(w * dh_u). dg may equal g
 * and wh may equal dh_u (in place). m_splits (int32 or int64, num_groups
 * entries, on the device; may be NULL for all rows): rows at or past their
 * clamped sum get dprob = 0 and, with zero_tail, dg = 0 and wh = 0 (without,
 * they are not written: callers whose readers stop at the sum save the pass
 * over a capacity's tail). Deterministic.                                  */
MG_API mg_status mg_swiglu_weighted_backward(const void* dh_u, const void* g, const float* weights,
                                             const void* m_splits, mg_dtype splits_dtype,
                                             int num_groups, mg_dtype dtype, int64_t rows,
                                             int64_t ffn, void* dg, void* wh, float* dprob,
                                             int zero_tail,
                                             void* stream);

/* ---- expert parallelism within a node (MG_CAP_EP_TRANSPORT) -------------
 * Dispatch and combine between the ranks of an expert-parallel group whose
 * GPUs reach each other's memory (NVLink or PCIe peer access). Each rank owns
 * one buffer of the same size and layout (e.g. torch symmetric memory) and
 * passes where every rank's buffer is mapped in its own address space
 * (base[r]); regions are byte offsets, the same on every rank. A rank
 * publishes what it sends into its own buffer, stream-ordered before the
 * call; each call starts with a barrier of the whole group through flags in
 * the buffers (no host sync: capturable) and then reads from the peers.
 * Every rank must make the same calls in the same order, and two calls in a
 * row must read different regions (dispatch and combine alternate): a rank
 * republishes a region only after the next call's barrier. A rank that waits
 * 100 s at a barrier stops its kernel with a device trap. Deterministic.
 *
 * Layout of a dispatch to rank d with S rows per source: rank d's output row
 * s * S + p is source s's p-th row for d, zeros past counts_s[d].           */
#define MG_EP_MAX_RANKS 16
typedef struct mg_ep_group {
  int rank;
  int world_size;         /* 1..MG_EP_MAX_RANKS */
  int num_blocks;         /* CTAs of each call, one per SM */
  const void* base[MG_EP_MAX_RANKS];
  int64_t flags_offset;   /* [world_size] uint64, zero before the first call */
  int64_t state_offset;   /* 16 bytes this rank alone uses, zero before the first call */
} mg_ep_group;

typedef struct mg_ep_dispatch_args {
  int64_t segment_rows;   /* S */
  int64_t counts_offset;  /* [world_size] int32: rows the publisher sends each rank (<= S) */
  int64_t index_offset;   /* [world_size, S] int32: the published row of each, by destination */
  int64_t rows_offset;    /* [*, row_bytes] published rows, 16-byte aligned */
  int64_t row_bytes;      /* a positive multiple of 16 */
  int64_t extra_offset;   /* [*, extra_bytes] published per-row extras (same index) */
  int64_t extra_bytes;    /* a multiple of 4; 0: none */
  void* out_rows;         /* [world_size * S, row_bytes] */
  void* out_extra;        /* [world_size * S, extra_bytes], NULL when extra_bytes is 0 */
} mg_ep_dispatch_args;
MG_API mg_status mg_ep_dispatch(const mg_ep_group* group, const mg_ep_dispatch_args* args, void* stream);

/* out[t] = sum over ranks d = 0..world_size-1, in that order, with
 * pos[t, d] >= 0 of rank d's partial row rank * S + pos[t, d], in fp32,
 * rounded to dtype; out_extra likewise from float32 extra columns.         */
typedef struct mg_ep_combine_args {
  int64_t segment_rows;   /* S */
  int64_t num_tokens;
  const int32_t* pos;     /* [num_tokens, world_size], -1: nothing from that rank */
  int64_t partial_offset; /* [world_size * S, hidden] of dtype, 16-byte aligned */
  int64_t hidden;         /* hidden * element size: a multiple of 16 */
  mg_dtype dtype;         /* float32, float16 or bfloat16 */
  void* out;              /* [num_tokens, hidden] */
  int64_t extra_offset;   /* [world_size * S, extra_cols] float32 */
  int64_t extra_cols;     /* 0..64; 0: none */
  float* out_extra;       /* [num_tokens, extra_cols], NULL when extra_cols is 0 */
} mg_ep_combine_args;
MG_API mg_status mg_ep_combine(const mg_ep_group* group, const mg_ep_combine_args* args, void* stream);

/* Where this rank's tokens go: experts [num_tokens, top_k] global indices
 * (outside [0, experts_per_rank * world_size): no copy), rank r owning
 * experts r * experts_per_rank onwards. A token goes once to every rank that
 * owns one of its experts, in token order: pos[t, r] its row in the
 * segment for r (-1: none), index[r, p] the token of row p (-1 past the
 * count), counts[r] the rows (at most segment_rows; the caller keeps every
 * destination within it). scratch: mg_ep_plan_scratch_bytes, device memory
 * the call uses in between its two kernels only.                          */
MG_API size_t mg_ep_plan_scratch_bytes(int64_t num_tokens, int world_size);
MG_API mg_status mg_ep_plan(const int64_t* experts, int64_t num_tokens, int top_k, int experts_per_rank,
                            int world_size, int64_t segment_rows, int32_t* pos, int32_t* index,
                            int32_t* counts, int32_t* scratch, void* stream);

/* ---- the fused experts path's host-side sequences (MG_CAP_EXPERTS_SEQUENCE)
 * What moe_grouped.experts runs from Python as one call per stage, so that
 * an eager step pays one host crossing, not one per kernel. Each runs the
 * same kernels with the same arguments in the same order as the separate
 * calls named below, so its results are theirs, bit for bit.              */

/* source[r] = row_id_map copy's token (copy / top_k) for the copy at row r,
 * -1 for rows no copy maps to: the index the gathered GEMMs read token rows
 * through. row_id_map [num_copies] int64 (-1: dropped); source [num_rows]
 * int32. A memset and one kernel.                                          */
MG_API mg_status mg_permute_source_rows(const int64_t* row_id_map, int64_t num_copies, int top_k,
                                        int64_t num_rows, int32_t* source, void* stream);

/* The forward of the fused experts op up to fc2, bf16 (MG_CAP_FPROP_SWIGLU
 * and MG_CAP_GATHERED_GEMM too): index = mg_permute_source_rows; (g, h) =
 * mg_grouped_fprop_swiglu of the tokens read through index; y =
 * mg_grouped_fprop(h, w2). R = num_rows > 0, T = num_tokens > 0. The combine
 * (mg_unpermute_rows of y) is the caller's, so that y's buffer can go before
 * the output's is taken. Scratch (index and h):
 * mg_experts_forward_scratch_bytes.                                        */
typedef struct mg_experts_forward_args {
  mg_grouped_problem problem; /* num_groups E, total_rows R, m_splits, dtype,
                                 device (n, k and the slot are set per GEMM) */
  int64_t num_tokens;         /* T */
  int top_k;
  int64_t hidden;             /* H */
  int64_t ffn;                /* I */
  const int64_t* row_id_map;  /* [T * top_k] */
  const void* tokens;         /* [T, H] */
  mg_group_operand w1;        /* E x [2I, H] */
  mg_group_operand w2;        /* E x [H, I] */
  void* scratch;              /* 256-byte aligned */
  void* g;                    /* [R, 2I] out: fc1's output */
  void* y;                    /* [R, H] out: fc2's output */
} mg_experts_forward_args;
MG_API mg_status mg_experts_forward_scratch_bytes(int64_t rows, int64_t ffn, mg_dtype dtype, size_t* out_bytes);
MG_API mg_status mg_experts_forward_fc(const mg_experts_forward_args* args, void* stream);

/* The backward of the fused experts op (moe_grouped.experts.FusedExpertsFunction)
 * for routed tokens, fc1 [E, 2I, H] and fc2 [E, H, I] without bias, in the
 * 16-bit dtype on the cooperative GEMMs, in two phases whose scratch the
 * caller allocates in turn (so the buffers live as long as the separate
 * calls' would). R = num_rows > 0 permuted rows, T = num_tokens > 0.
 *   phase fc2 (mg_experts_backward_fc2):
 *     row_weights = permute of probs (mg_permute_rows, zeroed first);
 *     rows = dy_u = permute of dout (zeroed first when zero_unmapped);
 *     wh = mg_grouped_dgrad(dy_u, w2); mg_swiglu_weighted_backward in place
 *     (g becomes dg, wh becomes w * h, dprob written, tail not zeroed);
 *     dw2 = mg_grouped_wgrad(dy_u, wh) (not accumulating), when dw2;
 *     dprobs = mg_unpermute_rows of dprob (one column), when dprobs.
 *   phase fc1 (mg_experts_backward_fc1), after phase fc2 on the same g:
 *     rows = mg_grouped_dgrad(dg, w1) and dx = its plain unpermute, when
 *     dx; rows = permute of tokens (zeroed first when zero_unmapped) and
 *     dw1 = mg_grouped_wgrad(dg, rows), when dw1.
 * Scratch: mg_experts_backward_scratch_bytes(phase 2: fc2, 1: fc1, ...).   */
typedef struct mg_experts_backward_args {
  mg_grouped_problem problem; /* num_groups E, total_rows R, m_splits, dtype,
                                 device (n, k and the slot are set per GEMM) */
  int64_t num_tokens;         /* T */
  int top_k;
  int64_t hidden;             /* H */
  int64_t ffn;                /* I */
  const int64_t* row_id_map;  /* [T * top_k] */
  int zero_unmapped;          /* rows no copy maps to exist (a capacity) */
  const void* dout;           /* [T, H] */
  const void* tokens;         /* [T, H] */
  const float* probs;         /* [T * top_k] */
  void* g;                    /* [R, 2I]: fc1's output, then dg */
  mg_group_operand w1;        /* E x [2I, H] */
  mg_group_operand w2;        /* E x [H, I] */
  void* scratch;              /* the phase's scratch, 256-byte aligned */
  void* dw2;                  /* [E, H, I], or NULL */
  float* dprobs;              /* [T * top_k], or NULL */
  void* dx;                   /* [T, H], or NULL */
  void* dw1;                  /* [E, 2I, H], or NULL */
} mg_experts_backward_args;
MG_API mg_status mg_experts_backward_scratch_bytes(int phase, int64_t rows, int64_t hidden, int64_t ffn,
                                                   mg_dtype dtype, size_t* out_bytes);
MG_API mg_status mg_experts_backward_fc2(const mg_experts_backward_args* args, void* stream);
MG_API mg_status mg_experts_backward_fc1(const mg_experts_backward_args* args, void* stream);

/* The FP8 fused experts op's stages (moe_grouped.fp8.experts.Fp8Stages) for
 * routed bf16 tokens, fc1 [E, 2I, H] and fc2 [E, H, I] without bias, their
 * weights quantized by mg_quantize_weight_128x128 with the transposed copies
 * (MG_CAP_EXPERTS_SEQUENCE_FP8). mg_experts_fp8_stage(args, stage) runs the
 * kernels the Python stages run between two of their allocations, in their
 * order and with their arguments, so the results are theirs bit for bit;
 * every buffer is the caller's (scratch: mg_experts_fp8_scratch_bytes), so
 * the caller takes each where the Python stages take theirs. "x (forward)"
 * is the forward config, "(backward)" the backward one. Stages, in order:
 *   FORWARD_FC1: index = mg_permute_source_rows; the tokens through index
 *     row-wise (forward) into scratch; g = mg_grouped_fp8_fprop(that, w1).
 *   FORWARD_FC2: mg_swiglu_quantize_rowwise_1x128(g) (forward) into
 *     scratch; y = mg_grouped_fp8_fprop(that, w2).
 *   BACKWARD_FC2_DGRAD: row_weights = the permute of probs (zeroed first);
 *     dout through index (backward), row-wise into scratch and column-wise
 *     into dout_t; dh = mg_grouped_fp8_dgrad(the row-wise copy, w2_t).
 *   BACKWARD_SWIGLU: mg_swiglu_weighted_backward(dh, g, row_weights) in
 *     place (g becomes dg, dh becomes wh; dprob; tail not zeroed); when
 *     wh_t: wh column-wise (forward) into wh_t.
 *   BACKWARD_FC2_WGRAD: dw2 = mg_grouped_fp8_wgrad(dout_t, wh_t).
 *   BACKWARD_DPROBS: dprobs = mg_unpermute_rows of dprob.
 *   BACKWARD_FC1_DGRAD: dg row-wise (backward) into scratch; dxp =
 *     mg_grouped_fp8_dgrad(that, w1_t).
 *   BACKWARD_DX: dx = the plain mg_unpermute_rows of dxp.
 *   BACKWARD_DG_COLUMNWISE: dg column-wise (backward) into dg_t.
 *   BACKWARD_FC1_WGRAD: the tokens through index column-wise (forward) into
 *     scratch; dw1 = mg_grouped_fp8_wgrad(dg_t, that).
 * padded rows: round_up(R, 128) + 128 E, as mg_quantize_columnwise_grouped_1x128
 * lays out. R = total_rows > 0, T = num_tokens > 0; dw1 and dw2 bf16, not
 * accumulated. Quantizers and GEMMs use the workspace slots the Python
 * stages give them (reserve before capture as for those).                  */
enum {
  MG_FP8_FORWARD_FC1 = 0,
  MG_FP8_FORWARD_FC2 = 1,
  MG_FP8_BACKWARD_FC2_DGRAD = 2,
  MG_FP8_BACKWARD_SWIGLU = 3,
  MG_FP8_BACKWARD_FC2_WGRAD = 4,
  MG_FP8_BACKWARD_DPROBS = 5,
  MG_FP8_BACKWARD_FC1_DGRAD = 6,
  MG_FP8_BACKWARD_DX = 7,
  MG_FP8_BACKWARD_DG_COLUMNWISE = 8,
  MG_FP8_BACKWARD_FC1_WGRAD = 9
};
typedef struct mg_experts_fp8_args {
  mg_grouped_problem problem;  /* num_groups E, total_rows R, m_splits, dtype
                                  MG_BFLOAT16, device (n, k, slot per GEMM) */
  int64_t num_tokens;          /* T */
  int top_k;
  int64_t hidden;              /* H */
  int64_t ffn;                 /* I */
  const int64_t* row_id_map;   /* [T * top_k] */
  mg_quantize_config forward;  /* tokens, h, wh */
  mg_quantize_config backward; /* dout, dg */
  mg_fp8_operand w1, w1_t;     /* [E, 2I, H] and [E, H, 2I], 128x128 scales */
  mg_fp8_operand w2, w2_t;     /* [E, H, I] and [E, I, H] */
  const void* tokens;          /* [T, H] */
  int32_t* index;              /* [R]: written by FORWARD_FC1, read after */
  void* g;                     /* [R, 2I]: fc1's output, then dg */
  void* scratch;               /* the stage's, 256-byte aligned */
  void* y;                     /* [R, H] */
  const void* dout;            /* [T, H] */
  const float* probs;          /* [T * top_k] */
  float* row_weights;          /* [R] */
  void* dh;                    /* [R, I]: dh_u, then wh */
  void* dout_t;                /* column-wise dout: [H, padded rows] */
  float* dout_t_scale_inv;
  void* wh_t;                  /* column-wise wh: [I, padded rows] */
  float* wh_t_scale_inv;
  float* dprob;                /* [R] */
  float* dprobs;               /* [T * top_k] */
  void* dw2;                   /* [E, H, I] */
  void* dxp;                   /* [R, H]: fc1's dgrad */
  void* dx;                    /* [T, H] */
  void* dg_t;                  /* column-wise dg: [2I, padded rows] */
  float* dg_t_scale_inv;
  void* dw1;                   /* [E, 2I, H] */
} mg_experts_fp8_args;
MG_API mg_status mg_experts_fp8_scratch_bytes(int stage, int64_t rows, int64_t hidden, int64_t ffn,
                                              int num_groups, size_t* out_bytes);
MG_API mg_status mg_experts_fp8_stage(const mg_experts_fp8_args* args, int stage, void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOE_GROUPED_H_ */
