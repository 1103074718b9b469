// Does splitting a decode GEMM's inner dimension across a cuBLASLt strided batch stream the
// weights faster at 16-128 tokens than cuBLASLt's own choice?
//
// At 64 sequences the engine's GEMMs read W at 2.6-3.7 TB/s (RESULTS, skinny_gemm.cu's entry):
// o (4096 x 4096) and qkv (6144 x 4096) have too few output tiles to fill 132 SMs, and down
// (4096 x 14336) runs cuBLASLt's split-K and its separate reduction kernel. Here the k columns
// are cut into S chunks, each chunk one batch entry of one cuBLASLt call (A and x strided by
// k / S columns, D by one f32 [m, n] partial per chunk), and a small kernel sums the S partials
// to bf16. In the engine that sum would be folded into the kernel that already reads the
// GEMM's output (add_rms_norm for o and down, qkv_rope_write for qkv), so both times are shown:
// the batched GEMM alone and with the separate sum.
//
// Every variant is checked against the heuristic's bf16 GEMM on random inputs (relative L2
// error of the whole output, outputs poisoned with NaN first). Timing: each call rotates over
// 8 copies of the weights (L2 never holds them), 40 calls captured in a CUDA graph, mean per
// call, median of 5 replays. For each split the heuristic's first 8 candidates are timed and
// the fastest kept (the engine
// takes the first, also shown). Build and run on the device:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/split_gemm bench/gpu/split_gemm.cu -lcublasLt && /tmp/split_gemm [shape] [m]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <cublasLt.h>
#include <cuda_runtime.h>

#include "cublaslt_plan.cuh"
#include "gemm_bench.cuh"

// out[i] = bf16(sum over s of part[s * len + i]), four elements per thread.
__global__ void sum_partials(bf16* out, const float* part, int splits, u64 len) {
    for (u64 i = (blockIdx.x * (u64)blockDim.x + threadIdx.x) * 4; i < len; i += (u64)gridDim.x * blockDim.x * 4) {
        float4 a = *(const float4*)(part + i);
        for (int s = 1; s < splits; ++s) {
            const float4 b = *(const float4*)(part + s * len + i);
            a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
        }
        ushort4 o = {to_bf16(a.x), to_bf16(a.y), to_bf16(a.z), to_bf16(a.w)};
        *(ushort4*)(out + i) = o;
    }
}

// out_s [m, rows] (f32) = x[:, s*kc : (s+1)*kc] . W[:, s*kc : (s+1)*kc]^T for s < splits.
struct Split {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
    std::vector<cublasLtMatmulAlgo_t> algos;
};

static void batch(cublasLtMatrixLayout_t l, int count, long long stride) {
    LT(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    LT(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
}

static Split plan_split(cublasLtHandle_t h, int m, int rows, int cols, int splits) {
    Split g;
    const int kc = cols / splits;
    LT(cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    LT(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    LT(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)));
    LT(cublasLtMatrixLayoutCreate(&g.a, CUDA_R_16BF, kc, rows, cols));
    LT(cublasLtMatrixLayoutCreate(&g.b, CUDA_R_16BF, kc, m, cols));
    LT(cublasLtMatrixLayoutCreate(&g.d, CUDA_R_32F, rows, m, rows));
    batch(g.a, splits, kc);
    batch(g.b, splits, kc);
    batch(g.d, splits, (long long)rows * m);
    cublasLtMatmulPreference_t pref;
    LT(cublasLtMatmulPreferenceCreate(&pref));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &WS, sizeof(WS)));
    cublasLtMatmulHeuristicResult_t res[8];
    int found = 0;
    LT(cublasLtMatmulAlgoGetHeuristic(h, g.desc, g.a, g.b, g.d, g.d, pref, 8, res, &found));
    for (int i = 0; i < found; ++i) g.algos.push_back(res[i].algo);
    return g;
}

int main(int argc, char** argv) {
    const int SETS = 8, CALLS = 40;
    struct Shape { const char* name; int n, k; std::vector<int> splits; } shapes[] = {
        {"qkv", 6144, 4096, {2, 4, 8}},
        {"o", 4096, 4096, {2, 4, 8}},
        {"gate_up", 28672, 4096, {2}},
        {"down", 4096, 14336, {2, 4, 7, 8}}};
    cublasLtHandle_t h;
    LT(cublasLtCreate(&h));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaMalloc(&g_ws, WS));
    const int MAX_M = 256, MAX_S = 8;
    float* part;
    CK(cudaMalloc(&part, (size_t)MAX_S * MAX_M * 28672 * 4));
    printf("| shape | m | MB of W | cuBLASLt bf16 µs (TB/s) | split | batched GEMM µs (TB/s) | + sum kernel µs | fastest candidate | heuristic's first µs | rel err |\n"
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const Shape& sh : shapes) {
        if (argc > 1 && strcmp(argv[1], sh.name) != 0) continue;
        const size_t wn = (size_t)sh.n * sh.k;
        bf16 *w, *x, *ref, *got;
        CK(cudaMalloc(&w, wn * 2 * SETS));
        fill_random<<<1024, 256, 0, s>>>(w, wn * SETS, 7, 0.05f);
        CK(cudaMalloc(&x, (size_t)MAX_M * sh.k * 2));
        CK(cudaMalloc(&ref, (size_t)MAX_M * sh.n * 2));
        CK(cudaMalloc(&got, (size_t)MAX_M * sh.n * 2));
        fill_random<<<256, 256, 0, s>>>(x, (size_t)MAX_M * sh.k, 11, 1.f);
        for (int m : {16, 32, 64, 128, 256}) {
            if (argc > 2 && atoi(argv[2]) != m) continue;
            const float one = 1.f, zero = 0.f;
            const size_t len = (size_t)m * sh.n;
            auto time = [&](const std::function<void(int)>& f) { return graph_time_us(s, CALLS, SETS, f); };
            const Gemm g = plan(h, m, sh.n, sh.k);
            auto cublas = [&](int set) {
                LT(cublasLtMatmul(h, g.desc, &one, w + wn * set, g.a, x, g.b, &zero, ref, g.d, ref, g.d, &g.algo, g_ws, WS, s));
            };
            const float t_ref = time(cublas);
            cublas(0);
            std::vector<bf16> a(len), b(len);
            CK(cudaStreamSynchronize(s));
            CK(cudaMemcpy(a.data(), ref, len * 2, cudaMemcpyDeviceToHost));
            const double mb = wn * 2 / 1e6;
            for (int splits : sh.splits) {
                const Split sp = plan_split(h, m, sh.n, sh.k, splits);
                const int kc = sh.k / splits;
                float best = 1e30f, first = 0.f;
                int best_i = -1;
                for (int i = 0; i < (int)sp.algos.size(); ++i) {
                    const float t = time([&](int set) {
                        LT(cublasLtMatmul(h, sp.desc, &one, w + wn * set, sp.a, x, sp.b, &zero, part, sp.d, part, sp.d,
                                          &sp.algos[i], g_ws, WS, s));
                    });
                    if (i == 0) first = t;
                    if (t < best) { best = t; best_i = i; }
                }
                if (best_i < 0) { printf("| %s | %d | | | %d | no algorithm | | | |\n", sh.name, m, splits); continue; }
                auto whole = [&](int set) {
                    LT(cublasLtMatmul(h, sp.desc, &one, w + wn * set, sp.a, x, sp.b, &zero, part, sp.d, part, sp.d,
                                      &sp.algos[best_i], g_ws, WS, s));
                    sum_partials<<<264, 256, 0, s>>>(got, part, splits, len);
                };
                const float t_whole = time(whole);
                CK(cudaMemsetAsync(got, 0xff, len * 2, s));
                whole(0);
                CK(cudaStreamSynchronize(s));
                CK(cudaMemcpy(b.data(), got, len * 2, cudaMemcpyDeviceToHost));
                printf("| %s | %d | %.0f | %.1f (%.2f) | %d (%d cols) | %.1f (%.2f) | %.1f | %d of %zu | %.1f | %.1e |\n", sh.name, m, mb,
                       t_ref, mb / t_ref, splits, kc, best, mb / best, t_whole, best_i, sp.algos.size(), first, rel_l2(a, b));
                fflush(stdout);
            }
        }
        CK(cudaFree(w)); CK(cudaFree(x)); CK(cudaFree(ref)); CK(cudaFree(got));
    }
    return 0;
}
