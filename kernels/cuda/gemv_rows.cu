// The LM head of a one-token step: out[r] = sum_k x[k] w[r, k] for one row of x, f32 out,
// x and w bf16, over a weight too large for gemv.cu's rings to pay off (a vocabulary of rows).
//
// Why not gemv.cu: its per-warp cp.async rings read 16-row tiles, each warp its own column run,
// and reach ~4.3 TB/s on a 128,256 x 4096 weight on an H200, where plain 16-byte loads sweeping
// the matrix in address order reach ~4.5 (bench/gpu/stream_read.cu, RESULTS 70bdc55); cuBLASLt,
// which the LM head used, ~4.0-4.2. Here every CTA of ROWS_THREADS threads takes R whole
// consecutive rows per round (round s of CTA c: rows (s * grid + c) * R ..), so at any moment
// the GPU reads one contiguous window of W; thread i reads each row's 16-byte vectors i,
// i + ROWS_THREADS, ... (XV of them) with streaming loads, all R * XV of a round issued before
// the first is used, and holds x's matching XV vectors in registers for the whole kernel.
//
// A row's sum: f32 FMAs over the thread's columns in order, warp_sum, then the warps' sums in
// warp order through shared memory: deterministic, not cuBLASLt's order (the two agree to
// rounding, not bit for bit).
//
// Requirements (checked by the launcher, gemm.rs): blockDim.x = ROWS_THREADS, cols % 8 == 0,
// cols <= 8 * ROWS_THREADS * XV. NVIDIA only (streaming loads in PTX); the HIP build of this
// module is empty.

#ifndef TESSERA_HIP

#define ROWS_THREADS 256
#define ROWS_WARPS (ROWS_THREADS / WARP_SIZE)

// A 16-byte streaming load (ld.global.cs: evict-first, W is read once per step).
__device__ __forceinline__ uint4 rows_ld(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ float rows_dot8(uint4 w, uint4 x, float acc) {
    const u32 ww[4] = {w.x, w.y, w.z, w.w}, xx[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc = fmaf(__uint_as_float(ww[i] << 16), __uint_as_float(xx[i] << 16), acc);
        acc = fmaf(__uint_as_float(ww[i] & 0xffff0000u), __uint_as_float(xx[i] & 0xffff0000u), acc);
    }
    return acc;
}

// XV: x vectors per thread; R rows per round, so R * XV (about 8) loads are in flight per thread.
template <int XV>
__device__ __forceinline__ void gemv_rows_body(float* __restrict__ out, const bf16* __restrict__ x,
                                               const bf16* __restrict__ w, int rows, int cols) {
    constexpr int R = XV == 1 ? 8 : XV == 2 ? 4 : 2;
    __shared__ float red[2][ROWS_WARPS][R];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nv = cols >> 3;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    uint4 xr[XV];
#pragma unroll
    for (int j = 0; j < XV; ++j) {
        const int i = tid + j * ROWS_THREADS;
        xr[j] = i < nv ? xv[i] : make_uint4(0u, 0u, 0u, 0u);
    }
    int parity = 0;
    for (long long base = (long long)blockIdx.x * R; base < rows; base += (long long)gridDim.x * R) {
        uint4 wr[R][XV];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            // Rows past the end re-read the last one (their sums are not stored).
            const long long row = min(base + r, (long long)rows - 1);
#pragma unroll
            for (int j = 0; j < XV; ++j) {
                const int i = tid + j * ROWS_THREADS;
                wr[r][j] = i < nv ? rows_ld(wv + row * nv + i) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < XV; ++j) acc = rows_dot8(wr[r][j], xr[j], acc);
            acc = warp_sum(acc);
            if (lane == 0) red[parity][warp][r] = acc;
        }
        __syncthreads();
        // Alternate buffers: the next round's writes cannot meet this round's reads.
        if (tid < R && base + tid < rows) {
            float s = 0.f;
#pragma unroll
            for (int v = 0; v < ROWS_WARPS; ++v) s += red[parity][v][tid];
            out[base + tid] = s;
        }
        parity ^= 1;
    }
}

#define GEMV_ROWS_ENTRY(XV)                                                                                   \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS)                                                \
        gemv_rows_x##XV(float* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w,      \
                        int rows, int cols) {                                                                 \
        gemv_rows_body<XV>(out, x, w, rows, cols);                                                            \
    }

// gemv_rows_x<XV>: cols up to 2048 XV.
GEMV_ROWS_ENTRY(1)
GEMV_ROWS_ENTRY(2)
GEMV_ROWS_ENTRY(3)
GEMV_ROWS_ENTRY(4)

#endif  // TESSERA_HIP
