// Decode GEMV for one token (m = 1) that reads W in address order: out[r] = sum_k x[k] w[r, k],
// the same modes as gemv.cu (plain bf16 / f32 out, NORM, NORM_SWIGLU, RESIDUAL, NORM_ROPE;
// gemv_shared.cuh), for rows of cols = 2048 L values (L = 1..8; the NORM modes L <= 4).
//
// Why a second kernel: gemv.cu's per-warp cp.async rings read 16-row tiles, each warp its own
// column run, and a launch spends ~3 µs beyond its bytes. Here every CTA of 256 threads takes
// R whole consecutive rows per round (round s of CTA c: rows (s * grid + c) * R ..), so at any
// moment the GPU reads one contiguous window of W; thread i reads the rows' 16-byte vectors i,
// i + 256, ... (L per row) with plain streaming loads, all R * L of a round in flight at once,
// and holds x's matching L vectors in registers for the whole kernel. H200, Llama-8B shapes,
// bench/gpu/sweep_gemv.cu: qkv 12.6 vs the ring's 13.7 µs, o 8.9 vs 9.8, gate_up 53.5 vs 56.4,
// down 29.0 vs 29.4; a layer's four in one graph 102.2 vs 106.0 µs, but only when all four
// take the same kernel (mixing the two was slower than either), so gemv.rs offers it per
// device, and the model turns it off unless every batch-1 GEMV it runs fits.
//
// A row's sum: f32 FMAs over the thread's 8 L columns in order, warp shuffles (warp_sum), then
// the 8 warps' sums in warp order through shared memory: deterministic, but not the ring's
// order (the two kernels agree to rounding, not bit for bit). The NORM modes normalise x in
// registers, summing the squares in exactly norm.cu's block-kernel order (256 threads, thread i
// takes vectors i, i + 256, ..., then block_sum), so fused and unfused batch-1 steps give the
// same bits. The fused epilogues round as gemv.cu's do (bf16 sums before SwiGLU, the residual
// add and RoPE).
//
// Programmatic dependent launch as gemv.cu: dependents may launch at once; with `flags` bit 0
// the first round's W loads (and gamma's, NORM modes) are issued before griddepcontrol.wait;
// x is read and out written only after it.
//
// Requirements (checked by the launcher, gemv_sweep.rs): blockDim.x = 256, cols = 2048 L;
// NORM_SWIGLU rows (2 ffn) even; NORM_ROPE as gemv.cu (rows a multiple of 16).

#ifndef TESSERA_HIP

#define SWEEP_THREADS 256

// Rows a CTA takes per round: about 8 loads in flight per thread (two of them per row at
// L = 2: 4 rows), at least one row; even where the NORM modes need pairs (L <= 4).
__host__ __device__ constexpr int sweep_rows(int l) { return l == 1 ? 8 : l == 2 ? 4 : l <= 4 ? 2 : 1; }

// A 16-byte streaming load (ld.global.cs: evict-first, W is read once per step).
__device__ __forceinline__ uint4 sweep_ld(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ float sweep_dot8(uint4 w, uint4 x, float acc) {
    const u32 ww[4] = {w.x, w.y, w.z, w.w}, xx[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc = fmaf(__uint_as_float(ww[i] << 16), __uint_as_float(xx[i] << 16), acc);
        acc = fmaf(__uint_as_float(ww[i] & 0xffff0000u), __uint_as_float(xx[i] & 0xffff0000u), acc);
    }
    return acc;
}

template <int L, int MODE, bool OUT_F32>
__device__ __forceinline__ void sweep_body(void* __restrict__ out, const bf16* __restrict__ x,
                                           const bf16* __restrict__ w, int rows, int cols, int flags,
                                           const bf16* __restrict__ gamma, float eps, const GemvRope& rope) {
    constexpr int R = sweep_rows(L);
    constexpr bool NORM = MODE == GEMV_NORM || MODE == GEMV_NORM_SWIGLU || MODE == GEMV_NORM_ROPE;
    constexpr bool SWIGLU = MODE == GEMV_NORM_SWIGLU;
    __shared__ float red[2][SWEEP_THREADS / 32][R];
    __shared__ float scratch[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u64 vpr = (u64)(cols >> 3);
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    // NORM_SWIGLU: a group is R / 2 features j (gate row j, up row half + j); else R rows.
    const int half = rows >> 1;
    const int groups = SWIGLU ? (half + R / 2 - 1) / (R / 2) : (rows + R - 1) / R;
    // W row of the group's r-th row; rows past the end re-read the last valid one (their
    // sums are never stored).
    auto w_row = [&](int gi, int r) -> int {
        if (SWIGLU) {
            const int j = min(gi * (R / 2) + (r % (R / 2)), half - 1);
            return r < R / 2 ? j : half + j;
        }
        return min(gi * R + r, rows - 1);
    };
    auto load = [&](uint4(&buf)[R * L], int gi) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const uint4* p = wv + (u64)w_row(gi, r) * vpr + tid;
#pragma unroll
            for (int l = 0; l < L; ++l) buf[r * L + l] = sweep_ld(p + l * SWEEP_THREADS);
        }
    };

    int grp = blockIdx.x;
    uint4 a[R * L];
    uint4 gv[L];
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    const bool early_w = (flags & 1) != 0;
    if (early_w) {
        load(a, grp);
        if (NORM) {
#pragma unroll
            for (int l = 0; l < L; ++l) gv[l] = reinterpret_cast<const uint4*>(gamma)[tid + l * SWEEP_THREADS];
        }
    }
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    if (!early_w) {
        load(a, grp);
        if (NORM) {
#pragma unroll
            for (int l = 0; l < L; ++l) gv[l] = reinterpret_cast<const uint4*>(gamma)[tid + l * SWEEP_THREADS];
        }
    }
    uint4 xv[L];
#pragma unroll
    for (int l = 0; l < L; ++l) xv[l] = reinterpret_cast<const uint4*>(x)[tid + l * SWEEP_THREADS];
    if (NORM) {
        // norm.cu's register path on its 256-thread block: the same vectors per thread, the
        // squares summed in the same order, block_sum, then (v * s) * gamma rounded.
        float ss = 0.f;
#pragma unroll
        for (int l = 0; l < L; ++l) {
            float v[8];
            unpack8(xv[l], v);
#pragma unroll
            for (int k = 0; k < 8; ++k) ss += v[k] * v[k];
        }
        ss = block_sum(ss, scratch);
        const float s = rsqrtf(ss / (float)cols + eps);
#pragma unroll
        for (int l = 0; l < L; ++l) {
            float v[8], g[8];
            unpack8(xv[l], v);
            unpack8(gv[l], g);
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = (v[k] * s) * g[k];
            xv[l] = pack8(v);
        }
    }

    int parity = 0;
    for (; grp < groups; grp += gridDim.x) {
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            acc[r] = 0.f;
#pragma unroll
            for (int l = 0; l < L; ++l) acc[r] = sweep_dot8(a[r * L + l], xv[l], acc[r]);
            acc[r] = warp_sum(acc[r]);
        }
        // The next round's loads fly while this one is reduced and stored.
        const int nxt = grp + gridDim.x;
        if (nxt < groups) load(a, nxt);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r) red[parity][warp][r] = acc[r];
        }
        // One barrier per round: the buffers alternate, and a buffer is written again only
        // two rounds later, after every reader of it passed the next round's barrier.
        __syncthreads();
        auto total = [&](int r) {
            float s = 0.f;
#pragma unroll
            for (int v = 0; v < SWEEP_THREADS / 32; ++v) s += red[parity][v][r];
            return s;
        };
        if (SWIGLU) {
            const int j = grp * (R / 2) + tid;
            if (tid < R / 2 && j < half) {
                const float g = gemv_round(total(tid)), u = gemv_round(total(R / 2 + tid));
                static_cast<bf16*>(out)[j] = f32_to_bf16(silu_f(g) * u);
            }
        } else if (MODE == GEMV_NORM_ROPE) {
            const int row = grp * R + 2 * tid;
            if (tid < R / 2 && row < rows) gemv_rope_write(rope, 0, row, gemv_round(total(2 * tid)), gemv_round(total(2 * tid + 1)));
        } else {
            const int row = grp * R + tid;
            if (tid < R && row < rows) {
                const float sum = total(tid);
                if (MODE == GEMV_RESIDUAL) {
                    bf16* res = static_cast<bf16*>(out);
                    res[row] = f32_to_bf16(bf16_to_f32(res[row]) + gemv_round(sum));
                } else if (OUT_F32) {
                    static_cast<float*>(out)[row] = sum;
                } else {
                    static_cast<bf16*>(out)[row] = f32_to_bf16(sum);
                }
            }
        }
        parity ^= 1;
    }
}

// The same parameters as gemv.cu's kernels (m must be 1), so one launcher fills both.
#define SWEEP_ENTRY(name, L, MODE, F32)                                                                        \
    extern "C" __global__ void __launch_bounds__(SWEEP_THREADS)                                                \
        name(void* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w, int m, int rows,  \
             int cols, int flags, const bf16* __restrict__ gamma, float eps, const GemvRope rope) {            \
        sweep_body<L, MODE, F32>(out, x, w, rows, cols, flags, gamma, eps, rope);                               \
    }

#define SWEEP_ALL_MODES(L)                                                  \
    SWEEP_ENTRY(gemv_sweep_bf16_l##L, L, GEMV_PLAIN, false)                 \
    SWEEP_ENTRY(gemv_sweep_f32_l##L, L, GEMV_PLAIN, true)                   \
    SWEEP_ENTRY(gemv_sweep_residual_l##L, L, GEMV_RESIDUAL, false)
#define SWEEP_NORM_MODES(L)                                                 \
    SWEEP_ENTRY(gemv_sweep_norm_l##L, L, GEMV_NORM, false)                  \
    SWEEP_ENTRY(gemv_sweep_swiglu_l##L, L, GEMV_NORM_SWIGLU, false)         \
    SWEEP_ENTRY(gemv_sweep_rope_l##L, L, GEMV_NORM_ROPE, false)

// gemv_sweep_<output type or mode>_l<cols / 2048>; gemv_sweep.rs picks one.
SWEEP_ALL_MODES(1)
SWEEP_ALL_MODES(2)
SWEEP_ALL_MODES(3)
SWEEP_ALL_MODES(4)
SWEEP_ALL_MODES(5)
SWEEP_ALL_MODES(6)
SWEEP_ALL_MODES(7)
SWEEP_ALL_MODES(8)
SWEEP_NORM_MODES(1)
SWEEP_NORM_MODES(2)
SWEEP_NORM_MODES(3)
SWEEP_NORM_MODES(4)

#endif  // TESSERA_HIP
