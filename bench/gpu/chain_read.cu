// What do the transitions between a decode layer's GEMVs cost? Streams the weights of o,
// gate_up, down and qkv (Llama-8B, bf16, 436 MB) with the GEMV's copy scheme (per-warp
// cp.async rings of 16 rows x 128 bytes, 8 warps, one CTA per SM; see stream_read.cu) as
//   separate - four kernels back to back;
//   pdl      - four kernels with programmatic dependent launch: each queues its first stages
//              of W, then waits for the previous kernel (griddepcontrol.wait);
//   chained  - one persistent kernel whose rings run on from one matrix into the next, with
//              a grid-wide barrier before the consumers start on the next matrix (as a chain
//              of dependent GEMVs would need), and without the barrier (the bound).
// Rotates over copies of the weights so L2 never holds them. Build and run on the device:
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/chain_read bench/gpu/chain_read.cu && /tmp/chain_read
#include <cstdio>
#include <cuda_runtime.h>

#include "copy_ring.cuh"
#define RING_P 6
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); return 1; } } while (0)

struct Mat { const unsigned short* w; int rows, cols; };
struct Chain { Mat m[4]; int n; };

__device__ __forceinline__ void grid_barrier(u32* counter, u32 target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1u);
        while (*(volatile u32*)counter < target) {}
        __threadfence();
    }
    __syncthreads();
}

// Streams the chain's matrices in order; `barrier`: wait for every CTA to finish matrix k
// before consuming matrix k + 1 (the copies keep flowing). `pdl`: queue the first stages, then
// griddepcontrol.wait.
__global__ void __launch_bounds__(256) chain_kernel(Chain c, u32* out, u32* counters, int barrier, int pdl) {
    extern __shared__ uint4 smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    const u32 ring = (u32)__cvta_generic_to_shared(smem) + warp * RING_P * 2048 + lane * 16;
    int first[5];  // first item of each matrix in this warp's sequence
    first[0] = 0;
    for (int k = 0; k < c.n; ++k) {
        const int tiles = c.m[k].rows / 16, chunks = c.m[k].cols / 64;
        const int per_tile = chunks * (warp + 1) / nw - chunks * warp / nw;
        const int my_tiles = (int)blockIdx.x < tiles ? (tiles - (int)blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
        first[k + 1] = first[k] + per_tile * my_tiles;
    }
    const int items = first[c.n];
    auto issue = [&](int q, int p) {
        int k = 0;
        while (q >= first[k + 1]) ++k;
        const Mat m = c.m[k];
        const int chunks = m.cols / 64, c0 = chunks * warp / nw, per_tile = chunks * (warp + 1) / nw - c0;
        const int r = q - first[k];
        const int tile = blockIdx.x + (r / per_tile) * gridDim.x, j = r % per_tile;
        const unsigned short* lo = m.w + (u64)(tile * 16 + g) * m.cols + t * 8 + (c0 + j) * 64;
        ring_issue_rows(ring + p * 2048, lo, lo + (u64)8 * m.cols, policy);
    };
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    if (!pdl) asm volatile("griddepcontrol.wait;\n" ::: "memory");
    // With pdl, ring_drive queues the ring's first items before the first before() call,
    // which then waits for the previous kernel: W's copies start before the wait.
    int k = 0;
    bool waited = !pdl;
    auto before = [&](int q) {
        if (!waited) {  // the prologue's copies are in flight: now wait for the previous kernel
            asm volatile("griddepcontrol.wait;\n" ::: "memory");
            waited = true;
        }
        while (q == first[k + 1]) {  // matrix k done by this warp: wait for the grid
            ++k;
            if (barrier) grid_barrier(counters + k - 1, gridDim.x);
        }
    };
    const u32 acc = ring_drive<RING_P>(items, ring, issue, before);
    if (acc == 0x12345678u) out[0] = acc;
}

__global__ void reset(u32* counters) { if (threadIdx.x < 8) counters[threadIdx.x] = 0; }

int main() {
    int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    const int dims[4][2] = {{4096, 4096}, {28672, 4096}, {4096, 14336}, {6144, 4096}};  // o, gate_up, down, qkv
    u64 layer = 0;
    for (auto& d : dims) layer += (u64)d[0] * d[1] * 2;
    const int copies = 10;  // 4.4 GB
    char* mem; CK(cudaMalloc(&mem, layer * copies));
    CK(cudaMemset(mem, 1, layer * copies));
    u32 *out, *counters; CK(cudaMalloc(&out, 4)); CK(cudaMalloc(&counters, 64));
    const int smem = 8 * RING_P * 2048;
    CK(cudaFuncSetAttribute(chain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    auto mats = [&](int i) {
        Chain c; c.n = 4;
        u64 off = (u64)(i % copies) * layer;
        for (int k = 0; k < 4; ++k) { c.m[k] = {(const unsigned short*)(mem + off), dims[k][0], dims[k][1]}; off += (u64)dims[k][0] * dims[k][1] * 2; }
        return c;
    };
    auto launch = [&](Chain c, int barrier, int pdl) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(sms); cfg.blockDim = dim3(256); cfg.dynamicSmemBytes = smem;
        cudaLaunchAttribute attr; attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = &attr; cfg.numAttrs = pdl ? 1 : 0;
        cudaLaunchKernelEx(&cfg, chain_kernel, c, out, counters, barrier, pdl);
    };
    auto one_layer = [&](int mode, int i) {
        Chain c = mats(i);
        if (mode <= 1) {  // separate kernels
            for (int k = 0; k < 4; ++k) { Chain s; s.n = 1; s.m[0] = c.m[k]; launch(s, 0, mode); }
        } else {
            reset<<<1, 32>>>(counters);
            launch(c, mode == 2, 1);
        }
    };
    const char* names[] = {"separate", "pdl", "chained + grid barriers", "chained, no barriers"};
    printf("| scheme | us per layer (436 MB) | TB/s |\n|---|---:|---:|\n");
    for (int round = 0; round < 2; ++round)
        for (int mode = 0; mode < 4; ++mode) {
            cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
            for (int i = 0; i < 3; ++i) one_layer(mode, i);
            const int reps = 40;
            cudaEventRecord(a);
            for (int i = 0; i < reps; ++i) one_layer(mode, i);
            cudaEventRecord(b); cudaEventSynchronize(b);
            float ms; cudaEventElapsedTime(&ms, a, b);
            const float us = ms * 1000.f / reps;
            printf("| %s | %.1f | %.2f |\n", names[mode], us, layer / us / 1e6);
        }
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    return 0;
}
