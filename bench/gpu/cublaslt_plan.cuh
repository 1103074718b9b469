// cuBLASLt as the engine plans a decode GEMM (kernels/src/cuda/gemm.rs: bf16 in and out, f32
// compute, the heuristic's first choice with a 32 MiB workspace), for the standalone programs
// of bench/gpu that time against it (pdl_small.cu, skinny_gemm.cu). Include after <cstdio>,
// <cstdlib> and <cublasLt.h>.
#pragma once

#ifndef LT
#define LT(x) do { cublasStatus_t st_ = (x); if (st_ != CUBLAS_STATUS_SUCCESS) { printf("cuBLASLt %d at %d\n", (int)st_, __LINE__); exit(1); } } while (0)
#endif

struct Gemm {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
};

static void* g_ws;  // the workspace: the program allocates WS bytes
static const size_t WS = 32u << 20;

// out [m, rows] = x [m, cols] . W [rows, cols]^T, all row-major (column-major D = A^T B).
static Gemm plan(cublasLtHandle_t h, int m, int rows, int cols) {
    Gemm g;
    LT(cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    LT(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    LT(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)));
    LT(cublasLtMatrixLayoutCreate(&g.a, CUDA_R_16BF, cols, rows, cols));
    LT(cublasLtMatrixLayoutCreate(&g.b, CUDA_R_16BF, cols, m, cols));
    LT(cublasLtMatrixLayoutCreate(&g.d, CUDA_R_16BF, rows, m, rows));
    cublasLtMatmulPreference_t pref;
    LT(cublasLtMatmulPreferenceCreate(&pref));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &WS, sizeof(WS)));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    LT(cublasLtMatmulAlgoGetHeuristic(h, g.desc, g.a, g.b, g.d, g.d, pref, 1, &res, &found));
    if (!found) { printf("no algorithm for %d x %d x %d\n", m, rows, cols); exit(1); }
    g.algo = res.algo;
    return g;
}
