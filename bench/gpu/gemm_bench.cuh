// What the standalone cuBLASLt benchmarks (split_gemm.cu, gemm_candidates.cu, skinny_gemm.cu,
// pdl_small.cu) share: the error check, bf16 rounding and a random fill, the Llama-3-8B decode
// GEMM shapes, the relative L2 error of one output against another, and timing: the median
// of a CUDA graph's replays, and on it the time of a GEMM as `calls` calls rotating over
// `sets` weight copies (so L2 never holds W), captured in one graph, mean per call, median
// of 5 replays after a warm-up. Include after <algorithm>, <cmath>, <cstdio>, <cstdlib>,
// <cstring>, <functional>, <vector> and <cuda_runtime.h>.
#pragma once

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

__device__ __forceinline__ bf16 to_bf16(float f) {
    u32 u = __float_as_uint(f);
    return (bf16)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// p[i] = uniform in [-scale, scale), from a hash of (i, seed).
__global__ void fill_random(bf16* p, u64 n, u32 seed, float scale) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u32 h = (u32)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
        p[i] = to_bf16(((float)(h & 0xffffff) / 16777216.f * 2.f - 1.f) * scale);
    }
}

static float bf(bf16 v) { u32 u = (u32)v << 16; float f; memcpy(&f, &u, 4); return f; }

// A Llama-3-8B layer's decode GEMMs: out [m, n] = x [m, k] . W [n, k]^T.
struct DecodeGemm {
    const char* name;
    int n, k;
};
static const DecodeGemm DECODE_GEMMS[] = {
    {"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 28672, 4096}, {"down", 4096, 14336}};

// |b - a| / |a| over whole outputs; a NaN in b (an element left unwritten after poisoning)
// makes it huge.
static double rel_l2(const std::vector<bf16>& a, const std::vector<bf16>& b) {
    double num = 0, den = 0;
    for (size_t j = 0; j < a.size() && j < b.size(); ++j) {
        const double d = (double)bf(a[j]) - bf(b[j]);
        num += std::isnan(d) ? 1e30 : d * d;
        den += (double)bf(a[j]) * bf(a[j]);
    }
    return std::sqrt(num / den);
}

// Median of `reps` timed replays of `exec` on `s` after `warm` untimed ones, in ms.
static float replay_median_ms(cudaGraphExec_t exec, cudaStream_t s, int warm, int reps) {
    static cudaEvent_t e0 = nullptr, e1 = nullptr;
    if (!e0) {
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
    }
    for (int i = 0; i < warm; ++i) CK(cudaGraphLaunch(exec, s));
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
        CK(cudaEventRecord(e0, s));
        CK(cudaGraphLaunch(exec, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

// µs per call of f(set), set = call % sets (see above).
static float graph_time_us(cudaStream_t s, int calls, int sets, const std::function<void(int)>& f) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < calls; ++i) f(i % sets);
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    const float ms = replay_median_ms(exec, s, 1, 5);
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    return ms * 1000.f / calls;
}
