// What do the small kernels between a decode layer's cuBLASLt GEMMs cost at 16-128 tokens,
// and does programmatic dependent launch (PDL) of those small kernels win any of it back?
// The unfused decode layer (worker/src/cuda/forward.rs, steps of more than 4 tokens) is
// qkv GEMM, qkv_rope_write, attention, o GEMM, add_rms_norm, gate_up GEMM, silu_mul, down
// GEMM, add_rms_norm; this program keeps its four GEMMs (Llama-8B shapes, bf16, cuBLASLt's
// first heuristic choice as gemm.rs takes it) and stands in for the four small kernels with
// one row kernel of the same size and launch shape as add_rms_norm's block path (a block per
// token row, 256 threads, reads the GEMM's output row, writes the next GEMM's input row).
// Attention is left out: it is the same in every variant. Variants, per layer:
//   gemms  - the four GEMMs alone (the bound fusing the small kernels away would give);
//   plain  - GEMMs and small kernels, ordinary launches;
//   pdl    - the small kernels launched with programmatic stream serialisation, waiting
//            (griddepcontrol.wait) before their first read; so they may be scheduled while
//            the GEMM ahead drains, if cuBLASLt's kernel lets them (it triggers its
//            dependents early, or at its exit).
// 32 layers over 8 distinct weight sets (3.5 GB, so L2 never holds the next weights),
// captured in one CUDA graph, replayed; median of 20 replays. Build and run on the device:
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/pdl_small bench/gpu/pdl_small.cu -lcublasLt && /tmp/pdl_small
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <cublasLt.h>
#include <cuda_runtime.h>

#include "gemm_bench.cuh"

// One row per block: out[r, :out_cols] = in[r, :out_cols] * rsqrt(mean(in[r]^2) + eps),
// in's row `in_cols` long (the sum runs over out_cols), 8 values per 16-byte load.
__global__ void __launch_bounds__(256) row_kernel(bf16* out, const bf16* in, int in_cols, int out_cols, int wait) {
    if (wait) asm volatile("griddepcontrol.wait;\n" ::: "memory");
    __shared__ float part[8];
    const int r = blockIdx.x;
    const uint4* src = reinterpret_cast<const uint4*>(in + (size_t)r * in_cols);
    uint4* dst = reinterpret_cast<uint4*>(out + (size_t)r * out_cols);
    float ss = 0.f;
    for (int i = threadIdx.x; i < out_cols / 8; i += blockDim.x) {
        const uint4 v = src[i];
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
        for (int k = 0; k < 4; ++k) {
            const float a = __uint_as_float(w[k] << 16), b = __uint_as_float(w[k] & 0xffff0000u);
            ss += a * a + b * b;
        }
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
    __syncthreads();
    float tot = 0.f;
    for (int k = 0; k < 8; ++k) tot += part[k];
    const float s = rsqrtf(tot / out_cols + 1e-5f);
    for (int i = threadIdx.x; i < out_cols / 8; i += blockDim.x) {
        uint4 v = src[i];
        unsigned w[4] = {v.x, v.y, v.z, v.w};
        for (int k = 0; k < 4; ++k) {
            const float a = __uint_as_float(w[k] << 16) * s, b = __uint_as_float(w[k] & 0xffff0000u) * s;
            w[k] = (__float_as_uint(a) >> 16) | (__float_as_uint(b) & 0xffff0000u);
        }
        dst[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

#include "cublaslt_plan.cuh"

static void gemm(cublasLtHandle_t h, const Gemm& g, bf16* out, const bf16* x, const bf16* w, cudaStream_t s) {
    const float one = 1.f, zero = 0.f;
    LT(cublasLtMatmul(h, g.desc, &one, w, g.a, x, g.b, &zero, out, g.d, out, g.d, &g.algo, g_ws, WS, s));
}

static void small(bf16* out, const bf16* in, int m, int in_cols, int out_cols, bool pdl, cudaStream_t s) {
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(m);
    cfg.blockDim = dim3(256);
    cfg.stream = s;
    cfg.attrs = &attr;
    cfg.numAttrs = pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, row_kernel, out, in, in_cols, out_cols, (int)pdl));
}

int main() {
    const int H = 4096, QKV = 6144, FFN = 14336, SETS = 8, LAYERS = 32;
    const size_t per_set = (size_t)QKV * H + (size_t)H * H + (size_t)2 * FFN * H + (size_t)H * FFN;
    bf16* wts;
    CK(cudaMalloc(&wts, per_set * SETS * sizeof(bf16)));
    CK(cudaMemset(wts, 0x3c, per_set * SETS * sizeof(bf16)));  // ~0.01 in every value
    CK(cudaMalloc(&g_ws, WS));
    bf16 *x, *qkv, *q, *o, *gu, *act;
    CK(cudaMalloc(&x, 256 * H * 2)); CK(cudaMalloc(&qkv, 256 * QKV * 2)); CK(cudaMalloc(&q, 256 * H * 2));
    CK(cudaMalloc(&o, 256 * H * 2)); CK(cudaMalloc(&gu, 256 * 2 * FFN * 2)); CK(cudaMalloc(&act, 256 * FFN * 2));
    CK(cudaMemset(x, 0x3c, 256 * H * 2)); CK(cudaMemset(o, 0x3c, 256 * H * 2));
    cublasLtHandle_t h;
    LT(cublasLtCreate(&h));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    printf("| tokens | variant | us per layer (median of 20 graph replays / 32 layers), rounds 1 / 2 |\n|---:|---|---|\n");
    for (int m : {16, 64, 128}) {
        const Gemm gq = plan(h, m, QKV, H), go = plan(h, m, H, H), gg = plan(h, m, 2 * FFN, H), gd = plan(h, m, H, FFN);
        const char* names[3] = {"gemms", "plain", "pdl"};
        double res[3][2];
        for (int round = 0; round < 2; ++round) {
            for (int v = 0; v < 3; ++v) {
                cudaGraph_t graph;
                cudaGraphExec_t exec;
                CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
                for (int l = 0; l < LAYERS; ++l) {
                    const bf16* w = wts + per_set * (l % SETS);
                    const bf16 *wq = w, *wo = wq + (size_t)QKV * H, *wg = wo + (size_t)H * H, *wd = wg + (size_t)2 * FFN * H;
                    const bool smalls = v > 0, pdl = v == 2;
                    if (smalls) small(x, o, m, H, H, pdl, s);  // add_rms_norm after down
                    gemm(h, gq, qkv, x, wq, s);
                    if (smalls) small(q, qkv, m, QKV, H, pdl, s);  // qkv_rope_write
                    gemm(h, go, o, q, wo, s);
                    if (smalls) small(x, o, m, H, H, pdl, s);  // add_rms_norm after o
                    gemm(h, gg, gu, x, wg, s);
                    if (smalls) small(act, gu, m, 2 * FFN, FFN, pdl, s);  // silu_mul
                    gemm(h, gd, o, act, wd, s);
                }
                CK(cudaStreamEndCapture(s, &graph));
                CK(cudaGraphInstantiate(&exec, graph, 0));
                res[v][round] = replay_median_ms(exec, s, 3, 20) * 1000.0 / LAYERS;
                CK(cudaGraphExecDestroy(exec)); CK(cudaGraphDestroy(graph));
            }
        }
        for (int v = 0; v < 3; ++v) printf("| %d | %s | %.1f / %.1f |\n", m, names[v], res[v][0], res[v][1]);
    }
    return 0;
}
