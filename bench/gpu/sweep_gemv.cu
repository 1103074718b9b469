// Would a batch-1 GEMV that sweeps W in address order stream faster than the GEMV's
// cp.async ring (kernels/cuda/gemv.cu)? stream_read.cu measured the bare copy schemes: plain
// 16-byte loads over a grid-wide linear sweep reach 4.28 TB/s on gate_up where the ring
// reaches 4.10 (down 4.07 vs 3.92). This program puts real arithmetic behind such a sweep
// and races it against the model's own kernel, compiled in from kernels/cuda/gemv.cu:
//
//   sweep - m = 1, 256 threads a CTA, a CTA takes R consecutive rows per round (rows
//           (round * grid + cta) * R ..), so at any moment the whole GPU reads one contiguous
//           window of W; thread i reads the row's 16-byte vectors i, i + 256, ... (L = cols /
//           2048 of them), x's matching vectors held in registers for the whole kernel. Each
//           row's sum: f32 FMAs in the thread, warp shuffles, then the 8 warps' sums in a
//           fixed order through shared memory (deterministic). PIPE: the next round's loads
//           are issued before this round's reduction.
//   ring  - gemv_f32_p6 as gemv.rs launches it by default (8 warps, one persistent CTA per
//           SM, contiguous chunk runs, programmatic launch with W queued before the wait).
//
// Both f32 out, launched with programmatic dependent launch back to back over rotating
// weight copies (L2 never holds W). Then a Llama-8B layer's four GEMVs in a chain (qkv, o,
// gate_up, down; 32 layers over 16 weight sets in one CUDA graph), each matrix on the
// kernel a plan names. Checks the sweep's output against the ring's on random inputs first.
// Commit 9e2a7d7 built the non-pipelined variant into the model with every fused mode
// (kernels/cuda/gemv_sweep.cu there; 100.5 us per layer in this chain): no faster end to end
// (bench/RESULTS.md, 2026-12-02), so it was reverted and only this program stays.
// Build and run on the device:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/sweep_gemv bench/gpu/sweep_gemv.cu && /tmp/sweep_gemv
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#include "../../kernels/cuda/common.cuh"
#include "../../kernels/cuda/gemv.cu"

#include "gemv_bench.cuh"

#define SW_T 256

__device__ __forceinline__ float sw_dot8(uint4 w, uint4 x, float acc) {
    const u32 ww[4] = {w.x, w.y, w.z, w.w}, xx[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc = fmaf(__uint_as_float(ww[i] << 16), __uint_as_float(xx[i] << 16), acc);
        acc = fmaf(__uint_as_float(ww[i] & 0xffff0000u), __uint_as_float(xx[i] & 0xffff0000u), acc);
    }
    return acc;
}

// Requirements: cols == L * SW_T * 8, blockDim.x == SW_T.
template <int L, int R, bool PIPE>
__global__ void __launch_bounds__(SW_T) sweep_gemv(float* __restrict__ out, const bf16* __restrict__ x,
                                                   const bf16* __restrict__ w, int rows, int cols) {
    __shared__ float red[2][SW_T / 32][R];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int vpr = cols >> 3;
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    const int groups = (rows + R - 1) / R;
    auto load = [&](uint4(&buf)[R * L], int gi) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = min(gi * R + r, rows - 1);
            const uint4* p = wv + (u64)row * vpr + tid;
#pragma unroll
            for (int l = 0; l < L; ++l) buf[r * L + l] = __ldcs(p + l * SW_T);
        }
    };
    int grp = blockIdx.x;
    uint4 a[R * L];
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    if (grp < groups) load(a, grp);
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    uint4 xv[L];
#pragma unroll
    for (int l = 0; l < L; ++l) xv[l] = reinterpret_cast<const uint4*>(x)[tid + l * SW_T];
    int parity = 0;
    for (; grp < groups; grp += gridDim.x) {
        const int nxt = grp + gridDim.x;
        uint4 b[R * L];
        if (PIPE && nxt < groups) load(b, nxt);
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            acc[r] = 0.f;
#pragma unroll
            for (int l = 0; l < L; ++l) acc[r] = sw_dot8(a[r * L + l], xv[l], acc[r]);
            acc[r] = warp_sum(acc[r]);
        }
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r) red[parity][warp][r] = acc[r];
        }
        __syncthreads();
        if (tid < R) {
            float s = 0.f;
#pragma unroll
            for (int v = 0; v < SW_T / 32; ++v) s += red[parity][v][tid];
            const int row = grp * R + tid;
            if (row < rows) out[row] = s;
        }
        parity ^= 1;
        if (PIPE) {
#pragma unroll
            for (int i = 0; i < R * L; ++i) a[i] = b[i];
        } else if (nxt < groups) {
            load(a, nxt);
        }
    }
}

static int g_sms = 0;

// The ring GEMV as gemv.rs launches it: 8 warps, P = 6, persistent, flags 3.
static const size_t RING_SMEM = 8 * (6 * GEMV_STAGE_BYTES(6) + 2 * GEMV_RED_BYTES);
static void ring(float* out, const bf16* x, const bf16* w, int rows, int cols, cudaStream_t s) {
    int m = 1, flags = 3;
    const bf16* gamma = nullptr;
    float eps = 0.f;
    GemvRope rope = {};
    void* args[] = {&out, &x, &w, &m, &rows, &cols, &flags, &gamma, &eps, &rope};
    const int tiles = (rows + 15) / 16;
    launch_pdl((const void*)gemv_f32_p6, dim3(std::min(g_sms, tiles)), dim3(256), RING_SMEM, args, s);
}

enum Kind { RING, SWEEP };
struct Variant {
    const char* name;
    Kind kind;
    const void* fn4096;   // for cols 4096
    const void* fn14336;  // for cols 14336
    int ctas_per_sm;
    int rows_per_round4096, rows_per_round14336;
};

static void sweep(const Variant& v, float* out, const bf16* x, const bf16* w, int rows, int cols, cudaStream_t s) {
    const void* fn = cols == 4096 ? v.fn4096 : v.fn14336;
    const int R = cols == 4096 ? v.rows_per_round4096 : v.rows_per_round14336;
    const int groups = (rows + R - 1) / R;
    void* args[] = {&out, &x, &w, &rows, &cols};
    launch_pdl(fn, dim3(std::min(groups, g_sms * v.ctas_per_sm)), dim3(SW_T), 0, args, s);
}

static void run(const Variant& v, float* out, const bf16* x, const bf16* w, int rows, int cols, cudaStream_t s) {
    if (v.kind == RING) ring(out, x, w, rows, cols, s);
    else sweep(v, out, x, w, rows, cols, s);
}

int main() {
    CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaFuncSetAttribute((const void*)gemv_f32_p6, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)RING_SMEM));
    const Variant variants[] = {
        {"ring (gemv_f32_p6)", RING, nullptr, nullptr, 1, 0, 0},
        {"sweep R=4|1, 4 CTA/SM", SWEEP, (const void*)sweep_gemv<2, 4, false>, (const void*)sweep_gemv<7, 1, false>, 4, 4, 1},
        {"sweep R=4|1, 6 CTA/SM", SWEEP, (const void*)sweep_gemv<2, 4, false>, (const void*)sweep_gemv<7, 1, false>, 6, 4, 1},
        {"sweep R=2|1, 8 CTA/SM", SWEEP, (const void*)sweep_gemv<2, 2, false>, (const void*)sweep_gemv<7, 1, false>, 8, 2, 1},
        {"sweep pipe R=4|1, 2 CTA/SM", SWEEP, (const void*)sweep_gemv<2, 4, true>, (const void*)sweep_gemv<7, 1, true>, 2, 4, 1},
        {"sweep pipe R=2|1, 4 CTA/SM", SWEEP, (const void*)sweep_gemv<2, 2, true>, (const void*)sweep_gemv<7, 1, true>, 4, 2, 1},
        {"sweep pipe R=8|-, 2 CTA/SM", SWEEP, (const void*)sweep_gemv<2, 8, true>, (const void*)sweep_gemv<7, 1, false>, 2, 8, 1},
    };
    const int n_var = sizeof(variants) / sizeof(variants[0]);
    for (int i = 1; i < n_var; ++i) {
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, variants[i].fn4096));
        int occ = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, variants[i].fn4096, SW_T, 0));
        cudaFuncAttributes fb;
        CK(cudaFuncGetAttributes(&fb, variants[i].fn14336));
        int occb = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occb, variants[i].fn14336, SW_T, 0));
        printf("%-28s regs %d / %d, resident CTAs/SM %d / %d\n", variants[i].name, fa.numRegs, fb.numRegs, occ, occb);
    }

    struct Shape { const char* name; int rows, cols; };
    const Shape shapes[] = {{"qkv 6144x4096", 6144, 4096}, {"o 4096x4096", 4096, 4096},
                            {"gate_up 28672x4096", 28672, 4096}, {"down 4096x14336", 4096, 14336}};
    // 16 weight sets of a whole layer (7 GB): L2 never holds the next call's W.
    const int SETS = 16;
    bf16* W[4][SETS];
    bf16* X[4];
    float* OUT[4][2];
    for (int k = 0; k < 4; ++k) {
        const u64 n = (u64)shapes[k].rows * shapes[k].cols;
        for (int s = 0; s < SETS; ++s) {
            CK(cudaMalloc(&W[k][s], n * 2));
            fill_random<<<1024, 256>>>(W[k][s], n, 1000u * k + s + 1, 0.25f, 0.f);
        }
        CK(cudaMalloc(&X[k], (u64)shapes[k].cols * 2));
        fill_random<<<64, 256>>>(X[k], shapes[k].cols, 77u + k, 0.25f, 0.f);
        CK(cudaMalloc(&OUT[k][0], (u64)shapes[k].rows * 4));
        CK(cudaMalloc(&OUT[k][1], (u64)shapes[k].rows * 4));
    }
    CK(cudaDeviceSynchronize());
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

    // Correctness: every sweep variant against the ring on every shape.
    for (int k = 0; k < 4; ++k) {
        const int rows = shapes[k].rows;
        ring(OUT[k][0], X[k], W[k][0], rows, shapes[k].cols, st);
        std::vector<float> ref(rows), got(rows);
        CK(cudaMemcpyAsync(ref.data(), OUT[k][0], rows * 4, cudaMemcpyDeviceToHost, st));
        CK(cudaStreamSynchronize(st));
        double ref_max = 0;
        for (float v : ref) ref_max = std::max(ref_max, (double)fabsf(v));
        for (int i = 1; i < n_var; ++i) {
            CK(cudaMemsetAsync(OUT[k][1], 0xff, rows * 4, st));  // poison (NaN)
            run(variants[i], OUT[k][1], X[k], W[k][0], rows, shapes[k].cols, st);
            CK(cudaMemcpyAsync(got.data(), OUT[k][1], rows * 4, cudaMemcpyDeviceToHost, st));
            CK(cudaStreamSynchronize(st));
            double worst = 0;
            for (int r = 0; r < rows; ++r) {
                const double d = fabs((double)got[r] - ref[r]);
                worst = std::isnan(d) ? INFINITY : std::max(worst, d);
            }
            printf("check %-20s %-28s max |diff| / max |ref| = %.2e (max |ref| %.3f)%s\n", shapes[k].name,
                   variants[i].name, worst / ref_max, ref_max, worst / ref_max < 1e-4 ? "" : "  FAIL");
        }
    }

    // Single shapes: 64 back-to-back calls over the rotating sets, median of 7 repeats.
    printf("\n%-20s", "us per call (TB/s)");
    for (int i = 0; i < n_var; ++i) printf(" | %-26s", variants[i].name);
    printf("\n");
    for (int k = 0; k < 4; ++k) {
        const double bytes = 2.0 * shapes[k].rows * shapes[k].cols;
        printf("%-20s", shapes[k].name);
        for (int i = 0; i < n_var; ++i) {
            std::vector<float> times;
            for (int rep = 0; rep < 7; ++rep) {
                times.push_back(elapsed_us(st, 64, [&] {
                    for (int c = 0; c < 64; ++c)
                        run(variants[i], OUT[k][c & 1], X[k], W[k][c % SETS], shapes[k].rows, shapes[k].cols, st);
                }));
            }
            std::sort(times.begin(), times.end());
            const float us = times[3];
            printf(" | %7.1f (%4.2f)             ", us, bytes / us / 1e6);
        }
        printf("\n");
    }

    // The layer chain: each of qkv, o, gate_up, down on the variant the plan names (indices
    // into `variants`). 32 layers in a graph.
    struct Plan { const char* name; int v[4]; };
    const Plan plans[] = {
        {"all ring", {0, 0, 0, 0}},
        {"gate_up, down sweep (pipe 2/SM | 4/SM)", {0, 0, 4, 1}},
        {"gate_up sweep pipe 2/SM", {0, 0, 4, 0}},
        {"qkv, o sweep pipe 2/SM", {4, 4, 0, 0}},
        {"qkv, o sweep 4/SM", {1, 1, 0, 0}},
        {"qkv, o, gate_up sweep pipe 2/SM", {4, 4, 4, 0}},
        {"all sweep (pipe 2/SM; down 4/SM)", {4, 4, 4, 1}},
        {"all sweep 4/SM", {1, 1, 1, 1}},
        {"o, gate_up, down sweep 4/SM", {0, 1, 1, 1}},
        {"gate_up, down sweep 4/SM", {0, 0, 1, 1}},
        {"qkv, gate_up, down sweep 4/SM", {1, 0, 1, 1}},
        {"all sweep 4/SM (again)", {1, 1, 1, 1}},
        {"all ring (again)", {0, 0, 0, 0}},
        {"all sweep R=2 8/SM", {3, 3, 3, 3}},
        {"qkv, o, gate_up sweep pipe R=8 2/SM", {6, 6, 6, 0}},
        {"all sweep pipe R=8 2/SM (down 4/SM)", {6, 6, 6, 6}},
    };
    printf("\nlayer chain, 32 layers in one graph, us per layer, median of 9 (min, max):\n");
    for (const Plan& plan : plans) {
        cudaGraph_t graph;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int layer = 0; layer < 32; ++layer) {
            const int s = layer % SETS;
            for (int k = 0; k < 4; ++k) run(variants[plan.v[k]], OUT[k][0], X[k], W[k][s], shapes[k].rows, shapes[k].cols, st);
        }
        CK(cudaStreamEndCapture(st, &graph));
        cudaGraphExec_t exec;
        CK(cudaGraphInstantiate(&exec, graph, 0));
        CK(cudaGraphLaunch(exec, st));
        std::vector<float> times;
        for (int rep = 0; rep < 9; ++rep) {
            times.push_back(elapsed_us(st, 32, [&] { CK(cudaGraphLaunch(exec, st)); }));
        }
        std::sort(times.begin(), times.end());
        const double bytes = 2.0 * (6144.0 * 4096 + 4096.0 * 4096 + 28672.0 * 4096 + 4096.0 * 14336);
        printf("  %-42s %6.1f us per layer (%4.2f TB/s), %6.1f, %6.1f\n", plan.name, times[4],
               bytes / times[4] / 1e6, times[0], times[8]);
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
    }
    return 0;
}
