// Skinny GEMM for decode: out[n, r] = sum_k x[n, k] * w[r, k] for m <= 8 rows of x, with
// x [m, cols], w [rows, cols] (one output feature per row), out [m, rows], all row-major;
// x and w bf16, out bf16 or f32, f32 accumulation. At such m the op only streams w once
// from HBM, so everything here serves that stream: 16-byte copies, several stages of them
// in flight per warp, w kept out of L1 and marked evict-first in L2, and the arithmetic on
// tensor cores so that m = 8 costs what m = 1 does.
//
// Work: a tile is 16 consecutive rows of w (the mma's M) times all columns; the CTA's warps
// split its columns in 64-column chunks (with `flags` bit 1, the launcher's default, warp
// w of nw takes the w-th contiguous run of them, which keeps each warp's reads of a row
// sequential in memory, ~3% faster end to end on H200; without it chunks w, w + nw, ...)
// and sum their partial results in shared memory at the end of the tile (fixed order:
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
// x or writing out. With `early_w` (`flags` bit 0) it first queues the ring's first copies of w, which is
// only correct when the kernel launched just before did not write w (weights are static).
// Without the launch attribute both griddepcontrol instructions are no-ops.
//
// Fused decode modes (one kernel where a layer had two or three; gemv.rs launches them):
// - NORM: out = rms_norm(x; gamma, eps) · Wᵀ, computed as s · ((x ⊙ gamma) · Wᵀ) with row
//   n's scalar s = rsqrt(mean(x[n]²) + eps): each warp writes bf16(x * gamma) of only the
//   columns it reads into shared memory (x is the residual stream, a few KB, read from L2)
//   and sums their squares, with no CTA barrier before its first mma; the epilogue adds the
//   warps' sums and scales the f32 sum before rounding it (gemv_norm_own). The fragments'
//   x values come from shared memory instead of the ring. Replaces the rms_norm before qkv.
// - NORM_SWIGLU: act = silu(g) * u where g | u = rms_norm(x) · [Wg; Wu]ᵀ, W the packed
//   gate|up weight [2 ffn, cols]: a tile is 8 gate rows and the same 8 up rows (fragment
//   rows g and g + 8), so both halves of an output meet in the tile's epilogue, scaled by
//   the norm and rounded to bf16 first as the NORM GEMV + silu_mul pair rounds them.
//   Replaces norm and SwiGLU.
// - RESIDUAL: out += x · Wᵀ in place on the bf16 residual stream, out = bf16(out +
//   bf16(sum)) as the unfused GEMM + add_rms_norm pair rounds it, the residual's values
//   read a tile ahead. Replaces that add.
// - NORM_ROPE: NORM for the packed q|k|v weight, with qkv.cu's work in the epilogue for
//   models without a q/k norm and with interleaved RoPE (pairs 2i, 2i + 1: both in one
//   16-row tile, which never straddles a head as head_dim % 16 == 0): bf16(s sum) + bias,
//   rotated (q and k dims below 2 half_rot) at the token's position (NaN past max_pos),
//   rounded to bf16 into q_out, or into the paged K / V cache at the token's slot (skipped
//   for a slot >= n_slots). `out` is unused. Replaces qkv_rope_write.
//
// Requirements (checked by the launcher): cols % 8 == 0 (16-byte aligned rows), 1 <= m <= 8,
// rows and cols < 2^31, blockDim.x = 32 nw with nw <= GEMV_MAX_WARPS and nw <= the chunk
// count, gridDim.x <= the tile count, dynamic shared memory nw * (P * GEMV_STAGE_BYTES(slots) +
// 2 * GEMV_RED_BYTES), plus m * gemv_xn_pitch(cols) * 2 + GEMV_NORM_SUMS_BYTES in the NORM modes;
// NORM_SWIGLU: rows (2 ffn) even; NORM_ROPE: rows = (n_heads + 2 n_kv) head_dim, head_dim % 16
// == 0, 2 half_rot <= head_dim, the GemvRope buffers sized as qkv_rope_write's.

// NVIDIA only (mma.sync, cp.async, griddepcontrol in PTX): an AMD build of this module is empty
// and the HIP backend sends every GEMM, small m included, to rocBLAS.
#ifndef TESSERA_HIP

#define GEMV_ROWS 16
#define GEMV_MAX_WARPS 16
#define GEMV_MAX_M 8
#define GEMV_CHUNK 64
// Per lane and stage: 16-byte slots for rows g, g + 8 and x row g at columns t * 8 and
// 32 + t * 8 of the chunk, slot s of all 32 lanes contiguous (512 bytes). The modes that
// read x from shared memory (NORM, NORM_SWIGLU) use the first 4 slots only.
#define GEMV_STAGE_BYTES(slots) ((slots) * 32 * 16)
// One warp's parked accumulators: 16 rows x 8 n f32 (two buffers, alternate tiles).
#define GEMV_RED_BYTES (GEMV_ROWS * GEMV_MAX_M * 4)

// NORM modes: the warps' sums of squares, one per (warp, row of x), after the normalised rows.
#define GEMV_NORM_SUMS_BYTES (GEMV_MAX_WARPS * GEMV_MAX_M * 4)

#define GEMV_PLAIN 0
#define GEMV_NORM 1
#define GEMV_NORM_SWIGLU 2
#define GEMV_RESIDUAL 3
#define GEMV_NORM_ROPE 4

// NORM_ROPE's epilogue operands (gemv_fused.rs's `GemvRope`, the same layout); unused by the
// other modes. Caches are [slots, n_kv, head_dim]; cos_sin [max_pos, half_rot].
struct GemvRope {
    bf16* q_out;
    bf16* k_cache;
    bf16* v_cache;
    const bf16* bias;
    const u32* positions;
    const u32* slots;
    const float2* cos_sin;
    u64 n_slots;
    u32 n_heads, n_kv, head_dim, half_rot, max_pos, pad;
};

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

// bf16 rounding of an f32 value, kept as f32 (what a bf16 store and reload gives).
__device__ __forceinline__ float gemv_round(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// Row pitch (values) of the normalised x in shared memory: the smallest >= cols that is 32
// mod 64, so consecutive rows start 64 bytes apart in the banks and each 8-lane phase of a
// 16-byte read (fragment rows g, g + 1 x 4 lanes) touches all 32 banks once. gemv.rs sizes
// the shared memory with the same formula.
__device__ __forceinline__ int gemv_xn_pitch(int cols) { return cols + (96 - cols % 64) % 64; }

// Column vector (8 values) e of this warp's columns: its chunks c0 + j c_step, j < per_tile.
__device__ __forceinline__ int gemv_warp_vec(int e, int c0, int c_step) { return (c0 + (e >> 3) * c_step) * 8 + (e & 7); }

// gamma's lines of the columns this warp reads (one 128-byte line per 64-column chunk),
// prefetched into L1 before the wait for the previous kernel (gamma is a weight: never
// written by it), so the scaling after the norm finds them there. Not into registers: held
// across the norm they made the fused kernels spill.
__device__ __forceinline__ void gemv_gamma_prefetch(const bf16* __restrict__ gamma, int cols, int c0, int c_step,
                                                    int per_tile) {
    for (int j = threadIdx.x % 32; j < per_tile; j += 32) {
        const int k = (c0 + j * c_step) * GEMV_CHUNK;
        if (k < cols) asm volatile("prefetch.global.L1 [%0];\n" ::"l"(gamma + k));
    }
}

// NORM modes' prologue (see the header: rms_norm(x) · Wᵀ = s · ((x ⊙ gamma) · Wᵀ)): the warp
// writes xn[n] = bf16(x[n] * gamma) for the m rows at the columns it reads itself (its
// chunks, the same in every tile), from 16-byte coherent loads of x (four in flight;
// cp.async would also wait for the ring's copies of w queued before) and gamma (its lines
// prefetched into L1 before the wait, gemv_gamma_prefetch), and sums the squares of the
// same x values, lanes in a fixed order, then warp_sum: sums[n] for this warp. The epilogue
// adds the warps' sums in warp order after the tile's barrier (gemv_norm_scale_of). No CTA
// barrier here: this runs after the wait for the kernel that wrote x, on the critical path
// of every layer at batch 1. __syncwarp orders the lanes' writes before the warp's reads.
__device__ __forceinline__ void gemv_norm_own(bf16* xn, const bf16* __restrict__ x, const bf16* __restrict__ gamma,
                                              int m, int cols, int c0, int c_step, int per_tile, float* sums) {
    const int nv = cols >> 3, pitch = gemv_xn_pitch(cols), lane = threadIdx.x % 32;
    // Item q: row q / per_lane, this lane's (q % per_lane)-th vector of the warp's columns.
    const int per_lane = (per_tile * 8 + 31) / 32, total = m * per_lane;
    float ss[GEMV_MAX_M];
#pragma unroll
    for (int n = 0; n < GEMV_MAX_M; ++n) ss[n] = 0.f;
    // Item q's row n and column vector i; false past the items or the row's end.
    auto item = [&](int q, int& n, int& i) {
        const int e = lane + (q % per_lane) * 32;
        n = q / per_lane;
        i = gemv_warp_vec(e, c0, c_step);
        return q < total && e < per_tile * 8 && i < nv;
    };
    for (int q0 = 0; q0 < total; q0 += 4) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            int n, i;
            if (item(q0 + u, n, i)) v[u] = __ldcg(reinterpret_cast<const uint4*>(x + (u64)n * cols + i * 8));
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            int n, i;
            if (item(q0 + u, n, i)) {
                float f[8], g[8];
                unpack8(v[u], f);
                unpack8(__ldg(reinterpret_cast<const uint4*>(gamma) + i), g);
                float part = 0.f;
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    part += f[k] * f[k];
                    f[k] *= g[k];
                }
#pragma unroll
                for (int r = 0; r < GEMV_MAX_M; ++r)  // registers, not a local array indexed by n
                    if (r == n) ss[r] += part;
                *reinterpret_cast<uint4*>(xn + n * pitch + i * 8) = pack8(f);
            }
        }
    }
#pragma unroll
    for (int n = 0; n < GEMV_MAX_M; ++n) {
        if (n < m) {
            const float t = warp_sum(ss[n]);
            if (lane == 0) sums[n] = t;
        }
    }
    __syncwarp();
}

// Row n's scale from the warps' sums of squares (gemv_norm_own: sums[w * GEMV_MAX_M + n]),
// added in warp order; after the barrier that follows every warp's prologue.
__device__ __forceinline__ float gemv_norm_scale_of(const float* sums, int n, int nw, int cols, float eps) {
    float ss = 0.f;
    for (int w = 0; w < nw; ++w) ss += sums[w * GEMV_MAX_M + n];
    return rsqrtf(ss / (float)cols + eps);
}

// A warp's position in its item sequence: the j-th of its chunks of tile `tile`.
struct GemvCursor {
    int tile, j;
};

template <bool OUT_F32, int P, int MODE>
__device__ __forceinline__ void gemv_body(void* __restrict__ out, const bf16* __restrict__ x,
                                          const bf16* __restrict__ w, int m, int rows, int cols, int flags,
                                          const bf16* __restrict__ gamma, float eps, const GemvRope& rope) {
    constexpr bool XS = MODE == GEMV_NORM || MODE == GEMV_NORM_SWIGLU || MODE == GEMV_NORM_ROPE;  // x from smem
    constexpr int STAGE = GEMV_STAGE_BYTES(XS ? 4 : 6);
    extern __shared__ uint4 gemv_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    // NORM_SWIGLU: `rows` is 2 ffn; a tile takes ffn features j0..j0+8 (gate row j, up row
    // ffn + j). Else a tile is 16 consecutive rows.
    const int half = rows >> 1;
    const int tile_rows = MODE == GEMV_NORM_SWIGLU ? 8 : GEMV_ROWS;
    const int tiles = ((MODE == GEMV_NORM_SWIGLU ? half : rows) + tile_rows - 1) / tile_rows;
    const int chunks = (cols + GEMV_CHUNK - 1) / GEMV_CHUNK;
    // A warp's chunks of a tile: every nw-th (strided), or a contiguous run of them
    // (`flags` bit 1); at least one either way (nw <= chunks).
    const bool contiguous = (flags & 2) != 0;
    const int c0 = contiguous ? chunks * warp / nw : warp, c_step = contiguous ? 1 : nw;
    const int per_tile = contiguous ? chunks * (warp + 1) / nw - c0 : (chunks - warp + nw - 1) / nw;
    const int my_tiles = ((int)blockIdx.x < tiles) ? (tiles - (int)blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    const int items = per_tile * my_tiles;
    const bool has_x = g < m;
    const bf16* xr = x + (u64)(has_x ? g : 0) * cols + t * 8;
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    // This lane's slot 0 of stage 0; slot s of stage p is 512 s + STAGE p further.
    const u32 smem = (u32)__cvta_generic_to_shared(gemv_smem);
    const u32 ring = smem + (u32)(warp * P * STAGE + lane * 16);
    char* after_ring = reinterpret_cast<char*>(gemv_smem) + nw * P * STAGE;
    float* red = reinterpret_cast<float*>(after_ring);
    // NORM modes: x * gamma's rows, then the warps' sums of squares.
    bf16* xn = reinterpret_cast<bf16*>(after_ring + 2 * nw * GEMV_RED_BYTES);
    float* norm_sums = reinterpret_cast<float*>(xn + m * gemv_xn_pitch(cols));
    const u32 xn_lane = (u32)__cvta_generic_to_shared(xn) + (u32)(((has_x ? g : 0) * gemv_xn_pitch(cols) + t * 8) * 2);

    // W rows of fragment rows g and g + 8 in tile `tile`. Rows past the end re-read the
    // last valid one (their sums are never stored).
    auto w_rows = [&](int tile, const bf16*& lo, const bf16*& hi) {
        if (MODE == GEMV_NORM_SWIGLU) {
            const int j = min(tile * 8 + g, half - 1);
            lo = w + (u64)j * cols + t * 8;
            hi = w + (u64)(half + j) * cols + t * 8;
        } else {
            const int r0 = tile * GEMV_ROWS;
            lo = w + (u64)min(r0 + g, rows - 1) * cols + t * 8;
            hi = w + (u64)min(r0 + g + 8, rows - 1) * cols + t * 8;
        }
    };
    // Columns past the end (cols % 64 != 0) are copied as zeros from a valid address.
    auto issue_w = [&](GemvCursor q, int p) {
        const int k0 = (c0 + q.j * c_step) * GEMV_CHUNK;
        const bf16 *lo, *hi;
        w_rows(q.tile, lo, hi);
        const u32 st = ring + (u32)(p * STAGE);
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
        if (XS) return;
        const int k0 = (c0 + q.j * c_step) * GEMV_CHUNK;
        const u32 st = ring + (u32)(p * STAGE);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int k = k0 + 32 * h;
            const bool in = k + t * 8 < cols;
            gemv_cp_x(st + (4 + h) * 512, xr + (in ? k : 0), in && has_x ? 16 : 0);
        }
    };
    // XS: x values of the item's two 32-column halves from the normalised rows; zero for
    // rows past m and columns past the end (W is zero there, but x's padding is not).
    auto read_xs = [&](GemvCursor q, int h) -> uint4 {
        const int k = (c0 + q.j * c_step) * GEMV_CHUNK + 32 * h;
        if (!has_x || k + t * 8 >= cols) return make_uint4(0u, 0u, 0u, 0u);
        return gemv_lds(xn_lane + (u32)(k * 2));
    };
    // RESIDUAL: the residual values of the tile this CTA finishes next, read a whole tile
    // ahead (for the first, right after the wait), so the epilogue's read-modify-write does
    // not wait on L2 (~0.8 us per kernel, most of it in the last tile's epilogue). Thread
    // slot r holds output i = threadIdx.x + r * blockDim.x of the tile (16 m <= 128 outputs,
    // blockDim.x >= 32). No other CTA writes these rows, and the kernel that last wrote
    // them finished before the wait, so the values stay current.
    bf16 res_pre[GEMV_ROWS * GEMV_MAX_M / 32];
    auto load_res = [&](int tile) {
        if (MODE != GEMV_RESIDUAL || tile >= tiles) return;
        const bf16* res = static_cast<const bf16*>(out);
#pragma unroll
        for (int r = 0; r < GEMV_ROWS * GEMV_MAX_M / 32; ++r) {
            const int i = threadIdx.x + r * blockDim.x, n = i / GEMV_ROWS, row = tile * GEMV_ROWS + i % GEMV_ROWS;
            if (i < GEMV_ROWS * m && row < rows) res_pre[r] = __ldcg(res + (u64)n * rows + row);
        }
    };
    auto advance = [&](GemvCursor& q) {
        if (++q.j == per_tile) {
            q.j = 0;
            q.tile += gridDim.x;
        }
    };

    PDL_TRIGGER();
    if (XS) gemv_gamma_prefetch(gamma, cols, c0, c_step, per_tile);
    const bool early_w = (flags & 1) != 0;
    if (!early_w) PDL_WAIT();
    // Prologue: w of the first P items (one group each), then x of the same items (one
    // group, after the wait when w went first), all landed before the first use. The NORM
    // modes normalise x into shared memory instead, while w's copies fly.
    GemvCursor iq = {(int)blockIdx.x, 0};
#pragma unroll
    for (int p = 0; p < P; ++p) {
        if (p < items) {
            issue_w(iq, p);
            advance(iq);
        }
        gemv_commit();
    }
    if (early_w) PDL_WAIT();
    if (XS) {
        // No group of its own: the loop's wait for item q (P - 1 groups may stay pending)
        // is then exactly the wait for w's stage q, and the first items are used as soon
        // as they land.
        gemv_norm_own(xn, x, gamma, m, cols, c0, c_step, per_tile, norm_sums + warp * GEMV_MAX_M);
    } else {
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
        load_res((int)blockIdx.x);
    }

    float c[4] = {0.f, 0.f, 0.f, 0.f};
    GemvCursor cq = {(int)blockIdx.x, 0};
    int p = 0, parity = 0;
    for (int q = 0; q < items; ++q) {
        // Item q has landed: it was issued P items ago with P - 1 groups committed since
        // (or in the prologue, already waited for).
        gemv_wait<P - 1>();
        const u32 st = ring + (u32)(p * STAGE);
        const uint4 lo0 = gemv_lds(st), hi0 = gemv_lds(st + 512), lo1 = gemv_lds(st + 1024);
        const uint4 hi1 = gemv_lds(st + 1536);
        const uint4 x0 = XS ? read_xs(cq, 0) : gemv_lds(st + 2048);
        const uint4 x1 = XS ? read_xs(cq, 1) : gemv_lds(st + 2560);
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
            auto tile_sum = [&](int rr, int n) {
                float sum = 0.f;
                for (int v = 0; v < nw; ++v) sum += rb[v * (GEMV_ROWS * GEMV_MAX_M) + rr * GEMV_MAX_M + n];
                return sum;
            };
            if (MODE == GEMV_NORM_SWIGLU) {
                const int j0 = cq.tile * 8;
                for (int i = threadIdx.x; i < 8 * m; i += blockDim.x) {
                    const int n = i / 8, rr = i % 8, j = j0 + rr;
                    if (j < half) {
                        const float sn = gemv_norm_scale_of(norm_sums, n, nw, cols, eps);
                        const float gv = gemv_round(tile_sum(rr, n) * sn), uv = gemv_round(tile_sum(rr + 8, n) * sn);
                        static_cast<bf16*>(out)[(u64)n * half + j] = f32_to_bf16(silu_f(gv) * uv);
                    }
                }
            } else if (MODE == GEMV_NORM_ROPE) {
                // A thread per (token, row pair) of the tile: rows rr, rr + 1 are dims d, d + 1
                // of head hh (qkv.cu's arithmetic, from the bf16-rounded sums).
                const int row0 = cq.tile * GEMV_ROWS;
                const u32 hd = rope.head_dim, nq = rope.n_heads, nkv = rope.n_kv;
                for (int i = threadIdx.x; i < (GEMV_ROWS / 2) * m; i += blockDim.x) {
                    const int n = i / (GEMV_ROWS / 2), rr = 2 * (i % (GEMV_ROWS / 2)), row = row0 + rr;
                    if (row >= rows) continue;
                    const u32 hh = (u32)row / hd, d = (u32)row % hd;
                    const float sn = gemv_norm_scale_of(norm_sums, n, nw, cols, eps);
                    float a = gemv_round(tile_sum(rr, n) * sn), b = gemv_round(tile_sum(rr + 1, n) * sn);
                    if (rope.bias) {
                        a += bf16_to_f32(rope.bias[row]);
                        b += bf16_to_f32(rope.bias[row + 1]);
                    }
                    bf16* dst;
                    if (hh < nq) {
                        dst = rope.q_out + ((u64)n * nq + hh) * hd;
                    } else {
                        const u32 slot = rope.slots[n];
                        if ((u64)slot >= rope.n_slots) continue;
                        const bool is_v = hh >= nq + nkv;
                        dst = (is_v ? rope.v_cache : rope.k_cache) + ((u64)slot * nkv + hh - nq - (is_v ? nkv : 0)) * hd;
                    }
                    if (hh < nq + nkv && d / 2 < rope.half_rot) {
                        const u32 pos = rope.positions[n];
                        float ra = __int_as_float(0x7fc00000), rb = ra;
                        if (pos < rope.max_pos) rope_rotate(a, b, rope.cos_sin[(u64)pos * rope.half_rot + d / 2], ra, rb);
                        a = ra;
                        b = rb;
                    }
                    *reinterpret_cast<u32*>(dst + d) = (u32)f32_to_bf16(a) | ((u32)f32_to_bf16(b) << 16);
                }
            } else if (MODE == GEMV_RESIDUAL) {
                // As below, from the values read a tile ahead; then the next tile's.
                const int row0 = cq.tile * GEMV_ROWS;
#pragma unroll
                for (int r = 0; r < GEMV_ROWS * GEMV_MAX_M / 32; ++r) {
                    const int i = threadIdx.x + r * blockDim.x, n = i / GEMV_ROWS, rr = i % GEMV_ROWS, row = row0 + rr;
                    if (i < GEMV_ROWS * m && row < rows) {
                        const float sum = gemv_round(tile_sum(rr, n));
                        static_cast<bf16*>(out)[(u64)n * rows + row] = f32_to_bf16(bf16_to_f32(res_pre[r]) + sum);
                    }
                }
                load_res(cq.tile + (int)gridDim.x);
            } else {
                // Consecutive threads take consecutive rows of one output row: coalesced.
                // NORM: the sum scaled by the row's norm before the output's rounding.
                const int row0 = cq.tile * GEMV_ROWS;
                for (int i = threadIdx.x; i < GEMV_ROWS * m; i += blockDim.x) {
                    const int n = i / GEMV_ROWS, rr = i % GEMV_ROWS, row = row0 + rr;
                    if (row >= rows) continue;
                    const float sum = tile_sum(rr, n);
                    gemv_store<OUT_F32>(out, (u64)n * rows + row,
                                        MODE == GEMV_NORM ? sum * gemv_norm_scale_of(norm_sums, n, nw, cols, eps) : sum);
                }
            }
            parity ^= 1;
        }
        advance(cq);
    }
    gemv_wait<0>();
}

#define GEMV_ENTRY(name, F32, P, MODE)                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * 32)                                          \
        name(void* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w, int m, int rows,  \
             int cols, int flags, const bf16* __restrict__ gamma, float eps, const GemvRope rope) {            \
        gemv_body<F32, P, MODE>(out, x, w, m, rows, cols, flags, gamma, eps, rope);                             \
    }

// gemv_<output type or mode>_p<ring stages>; the launcher picks one (gemv.rs).
GEMV_ENTRY(gemv_bf16_p2, false, 2, GEMV_PLAIN)
GEMV_ENTRY(gemv_bf16_p4, false, 4, GEMV_PLAIN)
GEMV_ENTRY(gemv_bf16_p6, false, 6, GEMV_PLAIN)
GEMV_ENTRY(gemv_f32_p2, true, 2, GEMV_PLAIN)
GEMV_ENTRY(gemv_f32_p4, true, 4, GEMV_PLAIN)
GEMV_ENTRY(gemv_f32_p6, true, 6, GEMV_PLAIN)
GEMV_ENTRY(gemv_norm_p2, false, 2, GEMV_NORM)
GEMV_ENTRY(gemv_norm_p4, false, 4, GEMV_NORM)
GEMV_ENTRY(gemv_norm_p6, false, 6, GEMV_NORM)
GEMV_ENTRY(gemv_swiglu_p2, false, 2, GEMV_NORM_SWIGLU)
GEMV_ENTRY(gemv_swiglu_p4, false, 4, GEMV_NORM_SWIGLU)
GEMV_ENTRY(gemv_swiglu_p6, false, 6, GEMV_NORM_SWIGLU)
GEMV_ENTRY(gemv_residual_p2, false, 2, GEMV_RESIDUAL)
GEMV_ENTRY(gemv_residual_p4, false, 4, GEMV_RESIDUAL)
GEMV_ENTRY(gemv_residual_p6, false, 6, GEMV_RESIDUAL)
GEMV_ENTRY(gemv_rope_p2, false, 2, GEMV_NORM_ROPE)
GEMV_ENTRY(gemv_rope_p4, false, 4, GEMV_NORM_ROPE)
GEMV_ENTRY(gemv_rope_p6, false, 6, GEMV_NORM_ROPE)

#endif  // TESSERA_HIP
