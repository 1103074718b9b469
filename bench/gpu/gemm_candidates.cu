// Is there a faster cuBLASLt kernel for the decode GEMMs at 64-128 tokens than the one the
// engine took? Until 012be10 the engine ran the heuristic's first candidate for every unsplit
// GEMM (it timed the first 8 only for split plans, kernels/src/cuda/gemm.rs). Here every
// candidate the heuristic returns (128 asked for; on the H200 with CUDA 13 it returns 8) is
// timed for the plain bf16 GEMM out [m, n] = x [m, k] . W [n, k]^T, and the first's and the
// fastest's algorithm id, tile, stages, split-K, CTA swizzle and cluster shape are printed.
// With `all` as the third argument it also builds configurations of the first candidate's
// algorithm by hand: every tile id its capabilities list, split-K 1-4 and cluster shapes
// auto, 1, 2, 3, 4 and 8 x 1 and 2 x 2 (stages, inner shape and the rest as the heuristic
// set them), keeps those cublasLtMatmulAlgoCheck accepts and prints the five fastest (on the
// H200 none of them ran: RESULTS 2026-12-04).
//
// Each candidate is checked against the first one on random inputs (relative L2 error of the
// whole output, outputs poisoned with NaN first). Timing: each call rotates over 8 copies of
// the weights (L2 never holds them), 40 calls captured in a CUDA graph, mean per call,
// median of 5 replays. Build and run on the device:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/gemm_candidates \
//     bench/gpu/gemm_candidates.cu -lcublasLt && /tmp/gemm_candidates [shape|any] [m|0] [all]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <cublasLt.h>
#include <cuda_runtime.h>

#include "cublaslt_plan.cuh"
#include "gemm_bench.cuh"

// One attribute of an algorithm's configuration (0 when it has none).
static u32 cfg(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t attr) {
    size_t size = 0, written = 0;
    u64 buf = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&a, attr, nullptr, 0, &size) != CUBLAS_STATUS_SUCCESS || size == 0 ||
        size > sizeof(buf))
        return 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&a, attr, &buf, size, &written) != CUBLAS_STATUS_SUCCESS) return 0;
    return (u32)buf;
}

int main(int argc, char** argv) {
    const int SETS = 8, CALLS = 40, ASK = 128;
    cublasLtHandle_t h;
    LT(cublasLtCreate(&h));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaMalloc(&g_ws, WS));
    const int MAX_M = 128;
    printf("| shape | m | MB of W | candidates | first µs (TB/s) | fastest µs (TB/s) | its index | algo id, tile, stages, split-K, swizzle: first / fastest | rel err |\n"
           "|---|---:|---:|---:|---:|---:|---:|---|---:|\n");
    for (const DecodeGemm& sh : DECODE_GEMMS) {
        if (argc > 1 && strcmp(argv[1], "any") != 0 && strcmp(argv[1], sh.name) != 0) continue;
        const size_t wn = (size_t)sh.n * sh.k;
        bf16 *w, *x, *got;
        CK(cudaMalloc(&w, wn * 2 * SETS));
        fill_random<<<1024, 256, 0, s>>>(w, wn * SETS, 7, 0.05f);
        CK(cudaMalloc(&x, (size_t)MAX_M * sh.k * 2));
        CK(cudaMalloc(&got, (size_t)MAX_M * sh.n * 2));
        fill_random<<<256, 256, 0, s>>>(x, (size_t)MAX_M * sh.k, 11, 1.f);
        for (int m : {64, 128}) {
            if (argc > 2 && atoi(argv[2]) != 0 && atoi(argv[2]) != m) continue;
            const float one = 1.f, zero = 0.f;
            const size_t len = (size_t)m * sh.n;
            auto time = [&](const std::function<void(int)>& f) { return graph_time_us(s, CALLS, SETS, f); };
            // The engine's plan (descriptors as gemm.rs makes them), then all candidates.
            Gemm g = plan(h, m, sh.n, sh.k);
            cublasLtMatmulPreference_t pref;
            LT(cublasLtMatmulPreferenceCreate(&pref));
            LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &WS, sizeof(WS)));
            std::vector<cublasLtMatmulHeuristicResult_t> res(ASK);
            int found = 0;
            LT(cublasLtMatmulAlgoGetHeuristic(h, g.desc, g.a, g.b, g.d, g.d, pref, ASK, res.data(), &found));
            const double mb = wn * 2 / 1e6;
            std::vector<bf16> a(len), b(len);
            float first = 0.f, best = 1e30f;
            int best_i = -1;
            double best_err = 0;
            for (int i = 0; i < found; ++i) {
                const cublasLtMatmulAlgo_t algo = res[i].algo;
                CK(cudaMemsetAsync(got, 0xff, len * 2, s));
                if (cublasLtMatmul(h, g.desc, &one, w, g.a, x, g.b, &zero, got, g.d, got, g.d, &algo, g_ws, WS, s) !=
                    CUBLAS_STATUS_SUCCESS)
                    continue;
                CK(cudaStreamSynchronize(s));
                CK(cudaMemcpy(i == 0 ? a.data() : b.data(), got, len * 2, cudaMemcpyDeviceToHost));
                const double err = i > 0 ? rel_l2(a, b) : 0.0;
                const float t = time([&](int set) {
                    LT(cublasLtMatmul(h, g.desc, &one, w + wn * set, g.a, x, g.b, &zero, got, g.d, got, g.d, &algo, g_ws,
                                      WS, s));
                });
                if (i == 0) first = t;
                if (t < best && err < 1e-2) { best = t; best_i = i; best_err = err; }
            }
            if (best_i < 0) { printf("| %s | %d | | %d | no candidate ran | | | | |\n", sh.name, m, found); continue; }
            auto desc = [&](const cublasLtMatmulAlgo_t& al) {
                static char buf[5][96];
                static int k = 0;
                k = (k + 1) % 5;
                snprintf(buf[k], sizeof(buf[k]), "%u, %u, %u, %u, %u, cluster %u", cfg(al, CUBLASLT_ALGO_CONFIG_ID),
                         cfg(al, CUBLASLT_ALGO_CONFIG_TILE_ID), cfg(al, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                         cfg(al, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), cfg(al, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                         cfg(al, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
                return buf[k];
            };
            printf("| %s | %d | %.0f | %d | %.1f (%.2f) | %.1f (%.2f) | %d | %s / %s | %.1e |\n", sh.name, m, mb, found, first,
                   mb / first, best, mb / best, best_i, desc(res[0].algo), desc(res[best_i].algo), best_err);
            fflush(stdout);
            if (argc > 3 && strcmp(argv[3], "all") == 0) {
                // Configurations of the first candidate's algorithm beyond the heuristic's list.
                const cublasLtMatmulAlgo_t base = res[0].algo;
                std::vector<u32> tiles;
                size_t size = 0;
                if (cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_TILE_IDS, nullptr, 0, &size) ==
                        CUBLAS_STATUS_SUCCESS && size >= 4) {
                    tiles.resize(size / 4);
                    LT(cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_TILE_IDS, tiles.data(), size, &size));
                }
                const u32 clusters[] = {0, 2, 3, 4, 11, 17, 6};  // auto, 1x1, 2x1, 4x1, 8x1, 3x1, 2x2
                std::vector<std::pair<float, cublasLtMatmulAlgo_t>> timed;
                int valid = 0;
                for (u32 tile : tiles)
                    for (int32_t splitk = 1; splitk <= 4; ++splitk)
                        for (u32 cl : clusters) {
                            cublasLtMatmulAlgo_t al = base;
                            if (cublasLtMatmulAlgoConfigSetAttribute(&al, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile)) !=
                                    CUBLAS_STATUS_SUCCESS ||
                                cublasLtMatmulAlgoConfigSetAttribute(&al, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk,
                                                                     sizeof(splitk)) != CUBLAS_STATUS_SUCCESS ||
                                cublasLtMatmulAlgoConfigSetAttribute(&al, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cl,
                                                                     sizeof(cl)) != CUBLAS_STATUS_SUCCESS)
                                continue;
                            cublasLtMatmulHeuristicResult_t chk;
                            if (cublasLtMatmulAlgoCheck(h, g.desc, g.a, g.b, g.d, g.d, &al, &chk) != CUBLAS_STATUS_SUCCESS ||
                                chk.workspaceSize > WS)
                                continue;
                            CK(cudaMemsetAsync(got, 0xff, len * 2, s));
                            if (cublasLtMatmul(h, g.desc, &one, w, g.a, x, g.b, &zero, got, g.d, got, g.d, &al, g_ws, WS, s) !=
                                CUBLAS_STATUS_SUCCESS)
                                continue;
                            CK(cudaStreamSynchronize(s));
                            CK(cudaMemcpy(b.data(), got, len * 2, cudaMemcpyDeviceToHost));
                            if (rel_l2(a, b) > 1e-2) continue;
                            ++valid;
                            const float t = time([&](int set) {
                                LT(cublasLtMatmul(h, g.desc, &one, w + wn * set, g.a, x, g.b, &zero, got, g.d, got, g.d, &al,
                                                  g_ws, WS, s));
                            });
                            timed.push_back({t, al});
                        }
                std::sort(timed.begin(), timed.end(), [](const auto& p, const auto& q) { return p.first < q.first; });
                printf("  %s m=%d: %zu tile ids, %d configurations ran correctly; fastest:", sh.name, m, tiles.size(), valid);
                for (size_t i = 0; i < timed.size() && i < 5; ++i)
                    printf(" %.1f µs (%.2f TB/s) [%s];", timed[i].first, mb / timed[i].first, desc(timed[i].second));
                printf("\n");
                fflush(stdout);
            }
        }
        CK(cudaFree(w)); CK(cudaFree(x)); CK(cudaFree(got));
    }
    return 0;
}
