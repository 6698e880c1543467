/* cblas_sgemm for MLX's CPU matmuls that sends one-row products to sgemv.
 *
 * MLX calls cblas_sgemm for every fp32 matmul, a decode step's one-row
 * products included. OpenBLAS runs those through its GEMM kernels (4-10 GB/s
 * of weight read on the project's 2-core EPYC) while its sgemv streams the
 * same weights at 9-21 GB/s. sgemm_route.py compiles this file, opens it with
 * RTLD_GLOBAL before mlx.core loads (so libmlx binds this cblas_sgemm), and
 * hands it the real library's sgemm and sgemv, which may carry a symbol
 * prefix (scipy-openblas32's do).
 */

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;

void llm_pte_sgemm_route_bind(void *sgemm, void *sgemv) {
  real_sgemm = (sgemm_fn)sgemm;
  real_sgemv = (sgemv_fn)sgemv;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K,
                 float alpha, const float *A, int lda, const float *B, int ldb,
                 float beta, float *C, int ldc) {
  if (order == ROW_MAJOR && K > 0 && M == 1) {
    /* c[1,N] = alpha a[1,K] op(B)[K,N] + beta c. The row a is contiguous
     * unless A is stored as a [K,1] column (then its stride is lda). */
    int inc_a = trans_a == NO_TRANS ? 1 : lda;
    if (trans_b == NO_TRANS) /* B is stored [K,N]: c = B^T a */
      real_sgemv(ROW_MAJOR, TRANS, K, N, alpha, B, ldb, A, inc_a, beta, C, 1);
    else /* B is stored [N,K]: c = B a */
      real_sgemv(ROW_MAJOR, NO_TRANS, N, K, alpha, B, ldb, A, inc_a, beta, C, 1);
    return;
  }
  if (order == ROW_MAJOR && K > 0 && N == 1) {
    /* c[M,1] = alpha op(A)[M,K] b[K,1] + beta c, c strided by ldc. The column
     * b is strided by ldb unless B is stored as a [1,K] row. */
    int inc_b = trans_b == NO_TRANS ? ldb : 1;
    if (trans_a == NO_TRANS) /* A is stored [M,K] */
      real_sgemv(ROW_MAJOR, NO_TRANS, M, K, alpha, A, lda, B, inc_b, beta, C, ldc);
    else /* A is stored [K,M] */
      real_sgemv(ROW_MAJOR, TRANS, K, M, alpha, A, lda, B, inc_b, beta, C, ldc);
    return;
  }
  real_sgemm(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
