// Can a GEMM of our own stream a decode step's weights faster than cuBLASLt at 16-64 tokens?
// At 64 sequences a Llama-8B layer's four GEMMs take ~124 µs on cuBLASLt (3.5 TB/s, RESULTS
// 17f78e7) against ~108 µs for the GEMV chain's copy scheme at one token (4.0 TB/s); issue 4's
// 2x-llama.cpp target at 64 sequences needs that difference and the small kernels fused into
// such a GEMM. This program answers the first half before any of it goes into the model.
//
// out [m, n] = x [m, k] . W [n, k]^T, bf16 in and out, f32 sums (the engine's layout).
// The kernel: a tile is 32 rows of W per warp (two m16 tiles, W as the mma's A) against all m
// tokens (x as B, m / 8 n8 tiles). W and x come in CH-column chunks through a ring of P
// stages in shared memory (cp.async, 16 bytes per copy, W kept out of L1 and marked
// evict-first, x through L1), rows XOR-swizzled in 16-byte units so ldmatrix reads are
// conflict-free. Work is balanced stream-K style: one CTA per SM, each takes an equal run of
// the flattened (tile, chunk) iterations, so the ring never drains at a tile boundary and no
// wave is left half empty; a tile split between CTAs is summed by the last of them to finish,
// in CTA order (deterministic), from f32 partials in a workspace. Variants: per-thread cp.async
// with a CTA-wide barrier per stage (4 warps, CH = 64, P = 6), and a producer thread issuing
// bulk tensor copies (TMA) with per-stage mbarriers (skinny_gemm_tma, P = 6 and 8); each also
// with the mma work and output stores skipped ("copies only": the copy scheme's own ceiling;
// the output then keeps the poison). The TMA kernel's stages can be as many as fit (P = 0),
// its weight maps with or without L2 promotion, its output leaves through shared memory in
// 16-byte stores. The first run's
// other cp.async shapes (64 x 8 stages, 8 warps, 128-column stages) were no faster.
//
// Checked against cuBLASLt on random inputs (relative error of the whole output; each variant
// twice, the same bits both times; outputs poisoned with NaN first), timed against it: each
// call rotates over 8 copies of the weights (L2 never holds them), mean of 40 back-to-back
// calls, median of 5 such runs. Build and run on the device:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/skinny_gemm bench/gpu/skinny_gemm.cu -lcublasLt -lcuda && /tmp/skinny_gemm
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include "gemm_bench.cuh"

constexpr int MAX_M = 64;
constexpr int MAX_TILE = 256;
// A tile is 32 W rows per warp; a stage holds CH columns (CH / 8 16-byte pieces) of the
// tile's W rows and of x's rows.
template <int CH, int NW>
struct Stage {
    static constexpr int TILE = NW * 32, W = TILE * CH * 2, X = MAX_M * CH * 2, BYTES = W + X;
};

// Row `row`'s piece `piece` in a stage of CH-column rows: pieces XOR-swizzled by the row's low
// three bits, so the 8 rows an ldmatrix phase reads at one piece hit 8 different bank groups.
template <int CH>
__device__ __forceinline__ u32 swz(u32 row, u32 piece) { return row * (CH * 2) + ((piece ^ (row & 7)) << 4); }

__device__ __forceinline__ void cp_w(u32 dst, const void* src, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "l"(policy) : "memory");
}
__device__ __forceinline__ void cp_x(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// First iteration of CTA c: floor(c * iters / ctas).
__device__ __forceinline__ u64 run_start(u64 c, u64 iters, u64 ctas) { return c * iters / ctas; }
// The CTA whose run holds iteration `it`.
__device__ __forceinline__ u32 owner(u64 it, u64 iters, u64 ctas) {
    u64 c = it * ctas / iters;
    while (c + 1 < ctas && run_start(c + 1, iters, ctas) <= it) ++c;
    while (c > 0 && run_start(c, iters, ctas) > it) --c;
    return (u32)c;
}

template <int NT>
__device__ __forceinline__ void zero_acc(float (&c)[2][NT][4]) {
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b) c[a][b][0] = c[a][b][1] = c[a][b][2] = c[a][b][3] = 0.f;
}

// One stage's products (its CH columns): this warp's 32 W rows (two m16 tiles, A from
// ldmatrix) against every x row (B, two n8 tiles per ldmatrix), into c.
template <int NT, int CH>
__device__ __forceinline__ void chunk_mma(float (&c)[2][NT][4], u32 wd, u32 xd) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int kk = 0; kk < CH / 16; ++kk) {
        u32 a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
            ldsm_x4(wd + swz<CH>(warp * 32 + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)), a[mt][0], a[mt][1], a[mt][2],
                    a[mt][3]);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
            u32 b0, b1, b2, b3;
            ldsm_x4(xd + swz<CH>(nt * 8 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)), b0, b1, b2, b3);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                mma(c[mt][nt], a[mt], b0, b1);
                mma(c[mt][nt + 1], a[mt], b2, b3);
            }
        }
    }
}

// End of a CTA's part of `tile` (stream-K): returns whether this CTA writes the tile, with
// `c` then holding its whole sum. A tile one CTA covered whole is its own; otherwise each
// contributor parks its partial in the workspace (slot 0: its first tile's, slot 1: its last's),
// and the last to arrive sums every contributor's in CTA order (the same sum every run).
// `sync` is a barrier of all threads holding accumulators; `is_last` a shared word.
template <int NT, class Sync>
__device__ bool finish_tile(float (&c)[2][NT][4], u32 tile, u64 begin, u32 kc, u64 iters, u64 ctas, float* ws,
                            u32* counters, u32* is_last, Sync sync) {
    const u32 first = owner((u64)tile * kc, iters, ctas), last = owner((u64)tile * kc + kc - 1, iters, ctas);
    if (first == last) return true;
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    auto slot = [&](u32 cta, u64 cta_begin) {
        const u32 s = cta * 2 + (tile == (u32)(cta_begin / kc) ? 0 : 1);
        return reinterpret_cast<float4*>(ws + (u64)s * MAX_TILE * MAX_M) + warp * 2 * NT * 32 + lane;
    };
    float4* mine = slot(blockIdx.x, begin);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            __stcg(mine + (mt * NT + nt) * 32, make_float4(c[mt][nt][0], c[mt][nt][1], c[mt][nt][2], c[mt][nt][3]));
    __threadfence();
    sync();
    if (tid == 0) {
        const u32 done = atomicAdd(counters + tile, 1u) + 1;
        *is_last = done == last - first + 1;
        if (*is_last) counters[tile] = 0;
    }
    sync();
    if (!*is_last) return false;
    __threadfence();
    zero_acc(c);
    for (u32 cta = first; cta <= last; ++cta) {
        const float4* p = slot(cta, run_start(cta, iters, ctas));
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float4 v = __ldcg(p + (mt * NT + nt) * 32);
                c[mt][nt][0] += v.x;
                c[mt][nt][1] += v.y;
                c[mt][nt][2] += v.z;
                c[mt][nt][3] += v.w;
            }
    }
    return true;
}

// NT = m / 8 (x rows as n8 tiles); m = 8 NT exactly, n % TILE == 0, k % CH == 0. MATH false
// skips the mma work and the output stores (the copy scheme's own ceiling).
template <int NT, int P, int CH, int NW, bool MATH>
__global__ void __launch_bounds__(NW * 32, 1)
skinny_gemm(bf16* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w, u32 n, u32 k,
            float* __restrict__ ws, u32* __restrict__ counters) {
    constexpr int M = NT * 8;
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 base = (u32)__cvta_generic_to_shared(smem);
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    constexpr int CHUNK = CH, PIECES = CH / 8, W_STAGE = Stage<CH, NW>::W, STAGE = Stage<CH, NW>::BYTES;
    constexpr int TILE = NW * 32, WARPS = NW;
    const u32 kc = k / CHUNK;
    const u64 iters = (u64)(n / TILE) * kc, ctas = gridDim.x;
    const u64 begin = run_start(blockIdx.x, iters, ctas), end = run_start(blockIdx.x + 1, iters, ctas);
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));

    // Copies of iteration `it` (tile `pt`, chunk `pc`, advanced here) into stage `s`:
    // TILE * PIECES W pieces and M * PIECES x pieces over the CTA's threads.
    u32 pt = (u32)(begin / kc), pc = (u32)(begin % kc);
    auto issue = [&](u64 it, u32 s) {
        if (it < end) {
            const u32 wd = base + s * STAGE, xd = wd + W_STAGE;
            const bf16* wsrc = w + (u64)pt * TILE * k + (u64)pc * CHUNK;
#pragma unroll
            for (int i = 0; i < TILE * PIECES / (WARPS * 32); ++i) {
                const u32 p = tid + i * WARPS * 32, row = p / PIECES, piece = p % PIECES;
                cp_w(wd + swz<CH>(row, piece), wsrc + (u64)row * k + piece * 8, policy);
            }
            const bf16* xsrc = x + (u64)pc * CHUNK;
#pragma unroll
            for (int i = 0; i < (M * PIECES + WARPS * 32 - 1) / (WARPS * 32); ++i) {
                const u32 p = tid + i * WARPS * 32;
                if (p < M * PIECES) cp_x(xd + swz<CH>(p / PIECES, p % PIECES), xsrc + (u64)(p / PIECES) * k + (p % PIECES) * 8);
            }
            if (++pc == kc) pc = 0, ++pt;
        }
        commit();
    };

    float c[2][NT][4];
    zero_acc(c);

#pragma unroll
    for (int s = 0; s < P - 1; ++s) issue(begin + s, s);

    u32 stage = 0, tile = (u32)(begin / kc), ch = (u32)(begin % kc);
    for (u64 it = begin; it < end; ++it) {
        wait_group<P - 2>();
        __syncthreads();  // stage `stage` is visible; the stage of it - 1 is free
        issue(it + P - 1, stage == 0 ? P - 1 : stage - 1);
        const u32 wd = base + stage * STAGE, xd = wd + W_STAGE;
        if (MATH) chunk_mma<NT, CH>(c, wd, xd);
        stage = stage + 1 == P ? 0 : stage + 1;

        if (++ch != kc && it + 1 != end) continue;  // the tile goes on in this run
        const u32 g = lane >> 2, t4 = lane & 3;
        __shared__ u32 is_last;
        const bool write = finish_tile<NT>(c, tile, begin, kc, iters, ctas, ws, counters, &is_last, [] { __syncthreads(); });
        if (write) {
            // c[mt][nt]: W rows r0 + g (e = 0, 1) and r0 + g + 8 (e = 2, 3), tokens nt * 8 + 2 t4 + (e & 1).
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const u32 r0 = tile * TILE + warp * 32 + mt * 16 + g;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u32 tok = nt * 8 + 2 * t4 + (e & 1), row = r0 + (e >> 1) * 8;
                        if (MATH) out[(u64)tok * n + row] = to_bf16(c[mt][nt][e]);
                    }
            }
        }
        zero_acc(c);
        if (ch == kc) ch = 0, ++tile;
    }
    wait_group<0>();
}

#include "cublaslt_plan.cuh"

template <int NT, int P, int CH, int NW, bool MATH>
static void ours(bf16* out, const bf16* x, const bf16* w, int n, int k, float* ws, u32* ctr, int ctas, cudaStream_t s) {
    const int smem = P * Stage<CH, NW>::BYTES;
    static bool set = false;
    if (!set) {
        CK(cudaFuncSetAttribute(skinny_gemm<NT, P, CH, NW, MATH>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        set = true;
    }
    skinny_gemm<NT, P, CH, NW, MATH><<<ctas, NW * 32, smem, s>>>(out, x, w, n, k, ws, ctr);
    CK(cudaGetLastError());
}

template <int P, int CH, int NW, bool MATH>
static void ours_m(int m, bf16* out, const bf16* x, const bf16* w, int n, int k, float* ws, u32* ctr, int ctas, cudaStream_t s) {
    if (m == 16) ours<2, P, CH, NW, MATH>(out, x, w, n, k, ws, ctr, ctas, s);
    else if (m == 32) ours<4, P, CH, NW, MATH>(out, x, w, n, k, ws, ctr, ctas, s);
    else ours<8, P, CH, NW, MATH>(out, x, w, n, k, ws, ctr, ctas, s);
}


// ------------------------------------------------------------------ the same with bulk tensor copies
// What cuBLASLt's Hopper kernels do for their operands: one producer thread copies each stage
// with two 2-D tensor copies (TMA: W's tile rows x CH columns, x's m rows x CH columns, 128-byte
// swizzle, the same layout as swz<64>), completion counted in bytes on the stage's "full"
// mbarrier; the NW consumer warps wait on it, compute as above, and arrive on the stage's
// "empty" mbarrier, which the producer waits on before reusing the stage. No CTA-wide barrier
// per stage: a warp waits only for its stage's bytes. CH is 64 (the swizzle's 128-byte rows).

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tma_2d(u32 dst, const CUtensorMap* map, int c0, int c1, u32 bar, u64 policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3}], "
        "[%4], %5;\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
        : "memory");
}
__device__ __forceinline__ void tma_2d(u32 dst, const CUtensorMap* map, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
// Barrier of the consumer warps only (the producer warp does not take part).
template <int NW>
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(NW * 32) : "memory"); }

template <int NT, int P, int NW, bool MATH>
__global__ void __launch_bounds__((NW + 1) * 32, 1)
skinny_gemm_tma(const __grid_constant__ CUtensorMap wmap, const __grid_constant__ CUtensorMap xmap, bf16* __restrict__ out,
                u32 n, u32 k, float* __restrict__ ws, u32* __restrict__ counters) {
    constexpr int M = NT * 8, CHUNK = 64, TILE = NW * 32;
    constexpr u32 W_BYTES = TILE * 128, X_BYTES = M * 128, STAGE = W_BYTES + X_BYTES;  // 1024-aligned (M % 8 == 0)
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) u64 bars[2 * P];
    __shared__ u32 is_last;
    const u32 base = ((u32)__cvta_generic_to_shared(smem) + 1023) & ~1023u;
    const u32 full0 = (u32)__cvta_generic_to_shared(bars), empty0 = full0 + 8 * P;
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 kc = k / CHUNK;
    const u64 iters = (u64)(n / TILE) * kc, ctas = gridDim.x;
    const u64 begin = run_start(blockIdx.x, iters, ctas), end = run_start(blockIdx.x + 1, iters, ctas);
    if (tid == 0) {
        for (int s = 0; s < P; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, NW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warp == NW) {  // the producer
        if (lane == 0) {
            u64 policy;
            asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
            u32 pt = (u32)(begin / kc), pc = (u32)(begin % kc);
            for (u64 it = begin; it < end; ++it) {
                const u32 j = (u32)(it - begin), s = j % P;
                if (j >= P) mbar_wait(empty0 + 8 * s, ((j / P) - 1) & 1);
                const u32 full = full0 + 8 * s, dst = base + s * STAGE;
                mbar_expect(full, W_BYTES + X_BYTES);
                tma_2d(dst, &wmap, pc * CHUNK, pt * TILE, full, policy);
                tma_2d(dst + W_BYTES, &xmap, pc * CHUNK, 0, full);
                if (++pc == kc) pc = 0, ++pt;
            }
        }
        return;
    }

    float c[2][NT][4];
    zero_acc(c);
    u32 tile = (u32)(begin / kc), ch = (u32)(begin % kc);
    for (u64 it = begin; it < end; ++it) {
        const u32 j = (u32)(it - begin), s = j % P;
        mbar_wait(full0 + 8 * s, (j / P) & 1);
        const u32 wd = base + s * STAGE, xd = wd + W_BYTES;
        if (MATH) chunk_mma<NT, 64>(c, wd, xd);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * s);

        if (++ch != kc && it + 1 != end) continue;
        const u32 g = lane >> 2, t4 = lane & 3;
        const bool write =
            finish_tile<NT>(c, tile, begin, kc, iters, ctas, ws, counters, &is_last, [] { consumers_sync<NW>(); });
        if (write && MATH) {
            // Through this warp's corner of shared memory, so each token's 32 outputs leave in
            // four 16-byte stores instead of 32 scattered 2-byte ones.
            const u32 e0 = base + P * STAGE + warp * (32 * M * 2);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u32 tok = nt * 8 + 2 * t4 + (e & 1), r = mt * 16 + g + (e >> 1) * 8;
                        asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(e0 + (tok * 32 + r) * 2), "h"(to_bf16(c[mt][nt][e])) : "memory");
                    }
            __syncwarp();
            for (u32 q = lane; q < M * 4; q += 32) {
                uint4 v;
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                             : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                             : "r"(e0 + q * 16)
                             : "memory");
                *reinterpret_cast<uint4*>(out + (u64)(q / 4) * n + tile * TILE + warp * 32 + (q % 4) * 8) = v;
            }
            __syncwarp();
        }
        zero_acc(c);
        if (ch == kc) ch = 0, ++tile;
        // consumers_sync above is only reached by all consumer warps together (tile ends are
        // CTA-uniform), so the named barrier's count always matches.
    }
}

// A 2-D bf16 tensor map: `rows` rows of `cols` values (row pitch `cols`), boxes of 64 columns
// x `box_rows` rows, 128-byte swizzle.
static CUtensorMap tensor_map(const bf16* base, int rows, int cols, int box_rows,
                              CUtensorMapL2promotion promo = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
    CUtensorMap map;
    cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)cols * 2};
    cuuint32_t box[2] = {64, (cuuint32_t)box_rows}, elem[2] = {1, 1};
    CUresult r = cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void*)base, dims, strides, box, elem,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                        promo, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) { printf("cuTensorMapEncodeTiled: %d\n", (int)r); exit(1); }
    return map;
}

template <int NT, int P, bool MATH>
static void ours_tma(const CUtensorMap& wm, const CUtensorMap& xm, bf16* out, int n, int k, float* ws, u32* ctr, int ctas,
                     cudaStream_t s) {
    constexpr int NW = 4;
    const int smem = P * (NW * 32 * 128 + NT * 8 * 128) + NW * 32 * NT * 8 * 2 + 1024;  // + the epilogue's corners
    static bool set = false;
    if (!set) {
        CK(cudaFuncSetAttribute(skinny_gemm_tma<NT, P, NW, MATH>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        set = true;
    }
    skinny_gemm_tma<NT, P, NW, MATH><<<ctas, (NW + 1) * 32, smem, s>>>(wm, xm, out, n, k, ws, ctr);
    CK(cudaGetLastError());
}

// As many stages as fit in ~200 KB at m = 8 nt tokens (11 at 16, 10 at 32, 8 at 64).
constexpr int max_stages(int nt) { return 200 * 1024 / (128 * 128 + nt * 8 * 128); }

// P = 0: max_stages.
template <int P, bool MATH>
static void ours_tma_m(int m, const CUtensorMap& wm, const CUtensorMap& xm, bf16* out, int n, int k, float* ws, u32* ctr,
                       int ctas, cudaStream_t s) {
    if (m == 16) ours_tma<2, P ? P : max_stages(2), MATH>(wm, xm, out, n, k, ws, ctr, ctas, s);
    else if (m == 32) ours_tma<4, P ? P : max_stages(4), MATH>(wm, xm, out, n, k, ws, ctr, ctas, s);
    else ours_tma<8, P ? P : max_stages(8), MATH>(wm, xm, out, n, k, ws, ctr, ctas, s);
}

// Optional arguments: a shape name and a token count, to run only that row (e.g. under ncu).
int main(int argc, char** argv) {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int SETS = 8;
    cublasLtHandle_t h;
    LT(cublasLtCreate(&h));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaMalloc(&g_ws, WS));
    float* ws;
    u32* ctr;
    CK(cudaMalloc(&ws, (size_t)2 * sms * MAX_TILE * MAX_M * 4));
    CK(cudaMalloc(&ctr, 65536 * 4));
    CK(cudaMemset(ctr, 0, 65536 * 4));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    printf("| shape | m | MB of W | cuBLASLt µs (TB/s) | ours / copies only: TMA, 6 stages sized to m | TMA, max stages (11 / 10 / 8) | the same, no L2 promotion | worst rel err vs cuBLASLt |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const DecodeGemm& sh : DECODE_GEMMS) {
        if (argc > 1 && strcmp(argv[1], sh.name) != 0) continue;
        const size_t wn = (size_t)sh.n * sh.k;
        bf16* w;
        CK(cudaMalloc(&w, wn * 2 * SETS));
        fill_random<<<1024, 256, 0, s>>>(w, wn * SETS, 7, 0.05f);
        bf16 *x, *ref, *got;
        CK(cudaMalloc(&x, (size_t)MAX_M * sh.k * 2));
        CK(cudaMalloc(&ref, (size_t)MAX_M * sh.n * 2));
        CK(cudaMalloc(&got, (size_t)MAX_M * sh.n * 2));
        fill_random<<<256, 256, 0, s>>>(x, (size_t)MAX_M * sh.k, 11, 1.f);
        std::vector<CUtensorMap> wmaps, wmaps_np;  // L2 promotion 256 B / none
        for (int set = 0; set < SETS; ++set) {
            wmaps.push_back(tensor_map(w + wn * set, sh.n, sh.k, 128));
            wmaps_np.push_back(tensor_map(w + wn * set, sh.n, sh.k, 128, CU_TENSOR_MAP_L2_PROMOTION_NONE));
        }
        for (int m : {16, 32, 64}) {
            if (argc > 2 && atoi(argv[2]) != m) continue;
            const Gemm g = plan(h, m, sh.n, sh.k);
            const float one = 1.f, zero = 0.f;
            auto cublas = [&](int set) {
                LT(cublasLtMatmul(h, g.desc, &one, w + wn * set, g.a, x, g.b, &zero, ref, g.d, ref, g.d, &g.algo, g_ws, WS, s));
            };
            // Mean of 40 back-to-back calls (as in a graph: launches overlap the previous call's
            // tail), median of 5 such runs.
            auto time = [&](auto&& f) {
                for (int i = 0; i < 5; ++i) f(i % SETS);
                std::vector<float> t;
                for (int r = 0; r < 5; ++r) {
                    CK(cudaEventRecord(e0, s));
                    for (int i = 0; i < 40; ++i) f(i % SETS);
                    CK(cudaEventRecord(e1, s));
                    CK(cudaEventSynchronize(e1));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                    t.push_back(ms * 1000.f / 40);
                }
                std::sort(t.begin(), t.end());
                return t[2];
            };
            const float t_ref = time(cublas);
#define OURS(P, CH, NW, MATH) [&](int set) { ours_m<P, CH, NW, MATH>(m, got, x, w + wn * set, sh.n, sh.k, ws, ctr, sms, s); }
#define TMA(P, MATH, MAPS) [&](int set) { ours_tma_m<P, MATH>(m, MAPS[set], xmap, got, sh.n, sh.k, ws, ctr, sms, s); }
            const CUtensorMap xmap = tensor_map(x, m, sh.k, m);
            const float ta = time(TMA(6, true, wmaps)), ca = time(TMA(6, false, wmaps));
            const float tb = time(TMA(0, true, wmaps)), cb = time(TMA(0, false, wmaps));
            const float tc = time(TMA(0, true, wmaps_np)), cc = time(TMA(0, false, wmaps_np));
            // Error: both on weight set 0; each of ours twice (the second call must give the same bits).
            const size_t len = (size_t)m * sh.n;
            std::vector<bf16> a(len), b(len), b2(len);
            cublas(0);
            CK(cudaStreamSynchronize(s));  // s does not block with the default stream's copies
            CK(cudaMemcpy(a.data(), ref, len * 2, cudaMemcpyDeviceToHost));
            double err[3];
            bool same = true;
            for (int v = 0; v < 3; ++v) {
                for (int rep = 0; rep < 2; ++rep) {
                    CK(cudaMemsetAsync(got, 0xff, len * 2, s));  // NaN: an output never written shows
                    if (v == 0) TMA(6, true, wmaps)(0);
                    else if (v == 1) TMA(0, true, wmaps)(0);
                    else TMA(0, true, wmaps_np)(0);
                    CK(cudaStreamSynchronize(s));
                    CK(cudaMemcpy((rep ? b2 : b).data(), got, len * 2, cudaMemcpyDeviceToHost));
                }
                double num = 0, den = 0;
                size_t unwritten = 0, first_bad = len;
                for (size_t i = 0; i < len; ++i) {
                    unwritten += b[i] == 0xffff;
                    if (first_bad == len && std::fabs(bf(a[i]) - bf(b[i])) > 1e-2 * std::fabs(bf(a[i])) + 1e-2) first_bad = i;
                    const double d = bf(a[i]) - bf(b[i]);
                    num += d * d;
                    den += (double)bf(a[i]) * bf(a[i]);
                    same &= b[i] == b2[i];
                }
                err[v] = std::sqrt(num / den);
                if (first_bad < len)
                    printf("   %s m %d variant %d: %zu unwritten; first bad at token %zu row %zu: %g vs %g\n", sh.name, m, v,
                           unwritten, first_bad / sh.n, first_bad % sh.n, bf(b[first_bad]), bf(a[first_bad]));
            }
            const double mb = wn * 2 / 1e6;
            printf("| %s | %d | %.0f | %.1f (%.2f) | %.1f (%.2f) / %.1f (%.2f) | %.1f (%.2f) / %.1f (%.2f) | %.1f (%.2f) / %.1f (%.2f) | %.1e%s |\n",
                   sh.name, m, mb, t_ref, mb / t_ref, ta, mb / ta, ca, mb / ca, tb, mb / tb, cb, mb / cb, tc, mb / tc, cc, mb / cc,
                   std::max(std::max(err[0], err[1]), err[2]), same ? "" : " (a repeat differs!)");
        }
        CK(cudaFree(w)); CK(cudaFree(x)); CK(cudaFree(ref)); CK(cudaFree(got));
    }
    return 0;
}
