// How fast can a decode GEMV stream its weight matrix on this GPU? Reads W [rows, cols] bf16
// once with three copy schemes and reports TB/s, on the Llama-8B decode shapes, rotating
// over enough copies that L2 (60 MB) never holds the next one:
//   ldg     - plain 16-byte loads, 8 in flight per thread, grid-stride (a bound for simple code);
//   cpasync - the GEMV's scheme (kernels/cuda/gemv.cu): per-warp rings of P stages of
//             16 rows x 128 bytes, per-lane 16-byte cp.async.cg, one CTA of 8 warps per SM,
//             a tile of 16 rows split in contiguous column runs over the warps; also with
//             W pre-tiled (each 16 x 64 block contiguous) to see what the layout costs;
//   bulk    - the same tiles and runs, but each stage is 16 rows x SB bytes fetched by
//             cp.async.bulk (one copy per row segment, issued by 16 lanes) completing on an
//             mbarrier: the copy engine instead of 32 lanes' requests.
// Consumers only read the staged bytes (xor into a register), so the numbers are the copy
// schemes' ceilings, not the GEMV's. Build and run on the device:
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/stream_read bench/gpu/stream_read.cu && /tmp/stream_read
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

#include "copy_ring.cuh"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); return 1; } } while (0)

__global__ void ldg_kernel(const uint4* __restrict__ w, u64 n_vec, u32* out) {
    u32 acc = 0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n_vec; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = __ldcs(w + i + k * stride);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    for (; i < n_vec; i += stride) { uint4 v = __ldcs(w + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (acc == 0x12345678u) out[0] = acc;
}

// ----- cp.async ring (gemv.cu's scheme, W only; copy_ring.cuh). LAYOUT 0: W row-major, as
// the model stores it (a stage is 16 rows x 128 bytes, rows `cols` apart); 1: W pre-tiled,
// each (16-row tile, 64-column chunk) block 2 KB contiguous, blocks in (tile, chunk) order,
// so a warp's run of chunks is one contiguous stream; 2: pre-tiled, warp w taking chunks
// w, w + nw, ... (the CTA's 8 warps read 16 KB contiguous per stage).
template <int P, int LAYOUT>
__global__ void __launch_bounds__(256) cpasync_kernel(const unsigned short* __restrict__ w, int rows, int cols, u32* out) {
    extern __shared__ uint4 smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tiles = rows / 16, chunks = cols / 64;
    const int c0 = chunks * warp / nw, per_tile = chunks * (warp + 1) / nw - c0;
    const int my_tiles = (int)blockIdx.x < tiles ? (tiles - (int)blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    const u32 ring = (u32)__cvta_generic_to_shared(smem) + warp * P * 2048 + lane * 16;
    auto issue = [&](int q, int p) {
        const int tile = blockIdx.x + (q / per_tile) * gridDim.x, j = q % per_tile;
        if (LAYOUT == 0) {
            const unsigned short* lo = w + (u64)(tile * 16 + g) * cols + t * 8 + (c0 + j) * 64;
            ring_issue_rows(ring + p * 2048, lo, lo + (u64)8 * cols, policy);
        } else {
            const int chunk = LAYOUT == 1 ? c0 + j : warp + j * nw;
            const unsigned short* lo = w + ((u64)tile * chunks + chunk) * 1024 + g * 64 + t * 8;
            ring_issue_rows(ring + p * 2048, lo, lo + 8 * 64, policy);
        }
    };
    const u32 acc = ring_drive<P>(per_tile * my_tiles, ring, issue, [](int) {});
    if (acc == 0x12345678u) out[0] = acc;
}

// ----- bulk copies on mbarriers: stage = 16 rows x SB bytes, row pitch SB + 16 in shared memory
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar, u64 policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar), "l"(policy)
        : "memory");
}

template <int P, int SB>
__global__ void __launch_bounds__(256) bulk_kernel(const unsigned short* __restrict__ w, int rows, int cols, u32* out) {
    extern __shared__ uint4 smem[];
    constexpr int PITCH = SB + 16, STAGE = 16 * PITCH;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int tiles = rows / 16, segs = cols * 2 / SB;  // SB-byte segments per row
    const int c0 = segs * warp / nw, per_tile = segs * (warp + 1) / nw - c0;
    const int my_tiles = (int)blockIdx.x < tiles ? (tiles - (int)blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    const int items = per_tile * my_tiles;
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    const u32 base = (u32)__cvta_generic_to_shared(smem);
    const u32 ring = base + warp * P * STAGE;
    const u32 bars = base + nw * P * STAGE + warp * P * 8;
    if (lane < P) mbar_init(bars + lane * 8, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncwarp();
    auto issue = [&](int q, int p) {
        const int tile = blockIdx.x + (q / per_tile) * gridDim.x, j = q % per_tile;
        const char* src = (const char*)(w + (u64)tile * 16 * cols) + (u64)(c0 + j) * SB;
        if (lane == 0) mbar_expect(bars + p * 8, 16 * SB);
        __syncwarp();
        if (lane < 16) bulk_copy(ring + p * STAGE + lane * PITCH, src + (u64)lane * cols * 2, SB, bars + p * 8, policy);
    };
    for (int p = 0; p < P && p < items; ++p) issue(p, p);
    u32 acc = 0;
    int p = 0;
    u32 phase = 0;
    for (int q = 0; q < items; ++q) {
        mbar_wait(bars + p * 8, phase);
        const u32 st = ring + p * STAGE;
        for (int o = lane * 16; o < 16 * SB; o += 512) {
            const int r = o / SB, c = o % SB;
            u32 a, b, cc, d;
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(a), "=r"(b), "=r"(cc), "=r"(d) : "r"(st + r * PITCH + c));
            acc ^= a ^ b ^ cc ^ d;
        }
        __syncwarp();
        if (q + P < items) issue(q + P, p);
        if (++p == P) { p = 0; phase ^= 1; }
    }
    if (acc == 0x12345678u) out[0] = acc;
}

template <typename F>
float time_it(F launch, int reps) {
    cudaEvent_t a, b;
    cudaEventCreate(&a); cudaEventCreate(&b);
    for (int i = 0; i < 3; ++i) launch(i);
    cudaEventRecord(a);
    for (int i = 0; i < reps; ++i) launch(i);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b);
    return ms * 1000.f / reps;
}

int main() {
    int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    const u64 total = 4ull << 30;  // rotate over 4 GB
    char* mem; CK(cudaMalloc(&mem, total));
    CK(cudaMemset(mem, 1, total));
    u32* out; CK(cudaMalloc(&out, 4));
    struct Shape { const char* name; int rows, cols; } shapes[] = {
        {"qkv 6144x4096", 6144, 4096}, {"o 4096x4096", 4096, 4096}, {"gate_up 28672x4096", 28672, 4096},
        {"down 4096x14336", 4096, 14336}, {"lm_head 128256x4096", 128256, 4096}};
    printf("| shape | scheme | us | TB/s |\n|---|---|---:|---:|\n");
    for (auto& s : shapes) {
        const u64 bytes = (u64)s.rows * s.cols * 2;
        const int copies = (int)(total / bytes);
        auto W = [&](int i) { return (const unsigned short*)(mem + (u64)(i % copies) * bytes); };
        auto report = [&](const char* scheme, float us) { printf("| %s | %s | %.1f | %.2f |\n", s.name, scheme, us, bytes / us / 1e6); };
        report("ldg x8, 4 CTAs/SM x 256", time_it([&](int i) { ldg_kernel<<<sms * 4, 256>>>((const uint4*)W(i), bytes / 16, out); }, 20));
#define CPA(P, L, NAME)                                                                                      \
        {                                                                                                    \
            auto k = cpasync_kernel<P, L>;                                                                   \
            const int sm = 8 * P * 2048;                                                                     \
            cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, sm);                        \
            report(NAME, time_it([&](int i) { k<<<sms, 256, sm>>>(W(i), s.rows, s.cols, out); }, 20));      \
        }
        CPA(6, 0, "cp.async P=6, 1 CTA/SM")
        CPA(6, 1, "cp.async P=6, pre-tiled W, contiguous runs")
        CPA(6, 2, "cp.async P=6, pre-tiled W, strided chunks")
        CPA(12, 0, "cp.async P=12, 1 CTA/SM")
        CPA(12, 1, "cp.async P=12, pre-tiled W, contiguous runs")
#define BULK(P, SB)                                                                                          \
        {                                                                                                    \
            auto k = bulk_kernel<P, SB>;                                                                     \
            const int sm = 8 * P * 16 * (SB + 16) + 8 * P * 8;                                               \
            cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, sm);                        \
            report("bulk P=" #P " SB=" #SB ", 1 CTA/SM",                                                     \
                   time_it([&](int i) { k<<<sms, 256, sm>>>(W(i), s.rows, s.cols, out); }, 20));             \
        }
        BULK(4, 256)
        BULK(6, 128)
        BULK(3, 512)
        BULK(6, 256)
    }
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    return 0;
}
