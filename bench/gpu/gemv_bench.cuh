// What the standalone GEMV benchmarks (sweep_gemv.cu, fused_modes.cu) share: the error check,
// a random bf16 fill, and a launch with programmatic dependent launch allowed (as gemv.rs
// launches the GEMV). Include after kernels/cuda/common.cuh (bf16, u32, u64, f32_to_bf16).
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x)                                                           \
    do {                                                                \
        cudaError_t e = (x);                                            \
        if (e != cudaSuccess) {                                         \
            printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); \
            exit(1);                                                    \
        }                                                               \
    } while (0)

// p[i] = uniform in [offset - scale / 2, offset + scale / 2), from a hash of (i, seed).
__global__ void fill_random(bf16* p, u64 n, u32 seed, float scale, float offset) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u32 h = (u32)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        p[i] = f32_to_bf16(((float)(h & 0xffffu) / 65535.f - 0.5f) * scale + offset);
    }
}

static void launch_pdl(const void* fn, dim3 grid, dim3 block, size_t smem, void** args, cudaStream_t s) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelExC(&cfg, fn, args));
}

// Microseconds per call of the `calls` calls `enqueue` puts on stream s, timed by events
// around them.
template <class F>
static float elapsed_us(cudaStream_t s, int calls, F&& enqueue) {
    static cudaEvent_t e0 = nullptr, e1 = nullptr;
    if (!e0) {
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
    }
    CK(cudaEventRecord(e0, s));
    enqueue();
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms * 1000.f / calls;
}
