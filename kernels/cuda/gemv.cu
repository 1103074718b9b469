// Skinny GEMM for decode: out[n, r] = sum_k x[n, k] * w[r, k] for m <= 8 rows of x, with
// x [m, cols], w [rows, cols] (one output feature per row), out [m, rows], all row-major;
// x and w bf16, out bf16 or f32, f32 accumulation. At such m the op only streams w once
// from HBM, so everything here serves that stream: 16-byte copies, several stages of them
// in flight per warp, w kept out of L1 and marked evict-first in L2, and the arithmetic on
// tensor cores so that m = 8 costs what m = 1 does.
//
// Work: a tile is 16 consecutive rows of w (the mma's M) times all columns; the CTA's warps
// split its columns in 64-column chunks (warp w of nw takes chunks w, w + nw, ...) and sum
// their partial results in shared memory at the end of the tile (fixed order:
// deterministic). A CTA takes tiles blockIdx.x, blockIdx.x + gridDim.x, ...: with a grid
// of one wave (persistent CTAs) a warp's copies run ahead across tile boundaries, so the
// pipeline fills once per kernel instead of once per tile.
//
// Fragments: lane (g = lane / 4, t = lane % 4) handles 8 columns of rows g and g + 8 and
// the same 8 columns of x row g (zero for g >= m: x rows are the mma's N = 8); 32 columns
// make one m16n8k16 pair. The sum over k tolerates any permutation of k applied to A and B
// alike, so a lane's 8 contiguous columns are fed as the fragment's k pairs (2t, 2t + 1),
// (2t + 8, 2t + 9) of one mma and the same of the next: no shuffles, no ldmatrix.
//
// Copies: registers loaded with ld.global get reordered by ptxas next to their use (it
// trades them for occupancy), leaving about one step in flight per warp. So w and x are
// copied with cp.async into a per-warp ring of P stages in shared memory; a stage is one
// chunk (128 bytes of each of the 16 rows and of each x row). Each lane reads back only the
// slots it filled, so cp.async.wait_group is the only synchronisation inside a tile.
//
// Programmatic dependent launch (the launcher may set it): the kernel lets its dependents
// launch at once and waits for its prerequisite grid (griddepcontrol.wait) before reading
// x or writing out. With `early_w` it first queues the ring's first copies of w, which is
// only correct when the kernel launched just before did not write w (weights are static).
// Without the launch attribute both griddepcontrol instructions are no-ops.
//
// Requirements (checked by the launcher): cols % 8 == 0 (16-byte aligned rows), 1 <= m <= 8,
// rows and cols < 2^31, blockDim.x = 32 nw with nw <= GEMV_MAX_WARPS and nw <= the chunk
// count, gridDim.x <= the tile count, dynamic shared memory nw * (P * GEMV_STAGE_BYTES +
// 2 * GEMV_RED_BYTES).

// NVIDIA only (mma.sync, cp.async, griddepcontrol in PTX): an AMD build of this module is empty
// and the HIP backend sends every GEMM, small m included, to rocBLAS.
#ifndef TESSERA_HIP

#define GEMV_ROWS 16
#define GEMV_MAX_WARPS 16
#define GEMV_MAX_M 8
#define GEMV_CHUNK 64
// Per lane and stage: 16-byte slots for rows g, g + 8 and x row g at columns t * 8 and
// 32 + t * 8 of the chunk, slot s of all 32 lanes contiguous (512 bytes).
#define GEMV_SLOTS 6
#define GEMV_STAGE_BYTES (GEMV_SLOTS * 32 * 16)
// One warp's parked accumulators: 16 rows x 8 n f32 (two buffers, alternate tiles).
#define GEMV_RED_BYTES (GEMV_ROWS * GEMV_MAX_M * 4)

// w: L2-only (.cg), 256-byte L2 prefetch, evict-first policy. bytes = 0 writes zeros.
__device__ __forceinline__ void gemv_cp_w(u32 dst, const bf16* src, int bytes, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
                 "r"(bytes), "l"(policy)
                 : "memory");
}

// x is small and read by every warp of the CTA: through L1 (.ca). bytes = 0 writes zeros.
__device__ __forceinline__ void gemv_cp_x(u32 dst, const bf16* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void gemv_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void gemv_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint4 gemv_lds(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

__device__ __forceinline__ void gemv_mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 32 columns: lo = 8 columns of row g, hi = the same of row g + 8, xv = the same of x row g.
// A fragment: {row g pair 0, row g+8 pair 0, row g pair 1, row g+8 pair 1}; B: {pair 0, 1}.
__device__ __forceinline__ void gemv_step(float (&c)[4], uint4 lo, uint4 hi, uint4 xv) {
    gemv_mma(c, lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
    gemv_mma(c, lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
}

template <bool OUT_F32>
__device__ __forceinline__ void gemv_store(void* out, u64 i, float v) {
    if (OUT_F32) {
        static_cast<float*>(out)[i] = v;
    } else {
        static_cast<bf16*>(out)[i] = f32_to_bf16(v);
    }
}

// A warp's position in its item sequence: the j-th of its chunks of tile `tile`.
struct GemvCursor {
    int tile, j;
};

template <bool OUT_F32, int P>
__device__ __forceinline__ void gemv_body(void* __restrict__ out, const bf16* __restrict__ x,
                                          const bf16* __restrict__ w, int m, int rows, int cols, int early_w) {
    extern __shared__ uint4 gemv_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tiles = (rows + GEMV_ROWS - 1) / GEMV_ROWS;
    const int chunks = (cols + GEMV_CHUNK - 1) / GEMV_CHUNK;
    const int per_tile = (chunks - warp + nw - 1) / nw;  // >= 1: nw <= chunks
    const int my_tiles = ((int)blockIdx.x < tiles) ? (tiles - (int)blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    const int items = per_tile * my_tiles;
    const bool has_x = g < m;
    const bf16* xr = x + (u64)(has_x ? g : 0) * cols + t * 8;
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    // This lane's slot 0 of stage 0; slot s of stage p is 512 s + GEMV_STAGE_BYTES p further.
    const u32 smem = (u32)__cvta_generic_to_shared(gemv_smem);
    const u32 ring = smem + (u32)(warp * P * GEMV_STAGE_BYTES + lane * 16);
    float* red = reinterpret_cast<float*>(reinterpret_cast<char*>(gemv_smem) + nw * P * GEMV_STAGE_BYTES);

    // Columns past the end (cols % 64 != 0) are copied as zeros from a valid address; rows
    // past the end re-read the last row (their sums are never stored).
    auto issue_w = [&](GemvCursor q, int p) {
        const int r0 = q.tile * GEMV_ROWS, k0 = (warp + q.j * nw) * GEMV_CHUNK;
        const bf16* lo = w + (u64)min(r0 + g, rows - 1) * cols + t * 8;
        const bf16* hi = w + (u64)min(r0 + g + 8, rows - 1) * cols + t * 8;
        const u32 st = ring + (u32)(p * GEMV_STAGE_BYTES);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int k = k0 + 32 * h;
            const bool in = k + t * 8 < cols;
            const int kk = in ? k : 0, bytes = in ? 16 : 0;
            gemv_cp_w(st + (2 * h) * 512, lo + kk, bytes, policy);
            gemv_cp_w(st + (2 * h + 1) * 512, hi + kk, bytes, policy);
        }
    };
    auto issue_x = [&](GemvCursor q, int p) {
        const int k0 = (warp + q.j * nw) * GEMV_CHUNK;
        const u32 st = ring + (u32)(p * GEMV_STAGE_BYTES);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int k = k0 + 32 * h;
            const bool in = k + t * 8 < cols;
            gemv_cp_x(st + (4 + h) * 512, xr + (in ? k : 0), in && has_x ? 16 : 0);
        }
    };
    auto advance = [&](GemvCursor& q) {
        if (++q.j == per_tile) {
            q.j = 0;
            q.tile += gridDim.x;
        }
    };

    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    if (!early_w) asm volatile("griddepcontrol.wait;\n" ::: "memory");
    // Prologue: w of the first P items (one group each), then x of the same items (one
    // group, after the wait when w went first), all landed before the first use.
    GemvCursor iq = {(int)blockIdx.x, 0};
#pragma unroll
    for (int p = 0; p < P; ++p) {
        if (p < items) {
            issue_w(iq, p);
            advance(iq);
        }
        gemv_commit();
    }
    if (early_w) asm volatile("griddepcontrol.wait;\n" ::: "memory");
    GemvCursor xq = {(int)blockIdx.x, 0};
#pragma unroll
    for (int p = 0; p < P; ++p) {
        if (p < items) {
            issue_x(xq, p);
            advance(xq);
        }
    }
    gemv_commit();
    gemv_wait<0>();

    float c[4] = {0.f, 0.f, 0.f, 0.f};
    GemvCursor cq = {(int)blockIdx.x, 0};
    int p = 0, parity = 0;
    for (int q = 0; q < items; ++q) {
        // Item q has landed: it was issued P items ago with P - 1 groups committed since
        // (or in the prologue, already waited for).
        gemv_wait<P - 1>();
        const u32 st = ring + (u32)(p * GEMV_STAGE_BYTES);
        const uint4 lo0 = gemv_lds(st), hi0 = gemv_lds(st + 512), lo1 = gemv_lds(st + 1024);
        const uint4 hi1 = gemv_lds(st + 1536), x0 = gemv_lds(st + 2048), x1 = gemv_lds(st + 2560);
        gemv_step(c, lo0, hi0, x0);
        gemv_step(c, lo1, hi1, x1);
        // Refill the slots just read (the mmas consumed the registers read from them).
        if (q + P < items) {
            issue_w(iq, p);
            issue_x(iq, p);
            advance(iq);
        }
        gemv_commit();
        p = p + 1 == P ? 0 : p + 1;
        if (cq.j == per_tile - 1) {
            // Tile done for this warp: park the fragment (c0, c1 = row g, n = 2t, 2t + 1;
            // c2, c3 = row g + 8), then the CTA sums the warps' parts. Buffers alternate per
            // tile, so the next tile's parking cannot overwrite sums still being read.
            float* r = red + (parity * nw + warp) * (GEMV_ROWS * GEMV_MAX_M);
            r[g * GEMV_MAX_M + 2 * t] = c[0];
            r[g * GEMV_MAX_M + 2 * t + 1] = c[1];
            r[(g + 8) * GEMV_MAX_M + 2 * t] = c[2];
            r[(g + 8) * GEMV_MAX_M + 2 * t + 1] = c[3];
            c[0] = c[1] = c[2] = c[3] = 0.f;
            __syncthreads();
            const float* rb = red + parity * nw * (GEMV_ROWS * GEMV_MAX_M);
            const int row0 = cq.tile * GEMV_ROWS;
            // Consecutive threads take consecutive rows of one output row: coalesced stores.
            for (int i = threadIdx.x; i < GEMV_ROWS * m; i += blockDim.x) {
                const int n = i / GEMV_ROWS, rr = i % GEMV_ROWS, row = row0 + rr;
                if (row < rows) {
                    float sum = 0.f;
                    for (int v = 0; v < nw; ++v) sum += rb[v * (GEMV_ROWS * GEMV_MAX_M) + rr * GEMV_MAX_M + n];
                    gemv_store<OUT_F32>(out, (u64)n * rows + row, sum);
                }
            }
            parity ^= 1;
        }
        advance(cq);
    }
    gemv_wait<0>();
}

#define GEMV_ENTRY(name, F32, P)                                                                              \
    extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * 32)                                         \
        name(void* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w, int m, int rows, \
             int cols, int early_w) {                                                                          \
        gemv_body<F32, P>(out, x, w, m, rows, cols, early_w);                                                  \
    }

// gemv_<output type>_p<ring stages>; the launcher picks one (gemv.rs).
GEMV_ENTRY(gemv_bf16_p2, false, 2)
GEMV_ENTRY(gemv_bf16_p4, false, 4)
GEMV_ENTRY(gemv_bf16_p6, false, 6)
GEMV_ENTRY(gemv_f32_p2, true, 2)
GEMV_ENTRY(gemv_f32_p4, true, 4)
GEMV_ENTRY(gemv_f32_p6, true, 6)

#endif  // TESSERA_HIP
