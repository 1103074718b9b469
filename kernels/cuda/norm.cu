// RMSNorm over rows: out = x / sqrt(mean(x^2) + eps) * w, and the fused pre-norm residual
// add of a llama block: residual = bf16(residual + x); out = rms_norm(residual) * w.
// The fused variant normalises the *rounded* sum, so fused and unfused paths agree bit for
// bit and the stored residual is what the next layer reads.
//
// The _parts variant adds a GEMM's output that arrives as `splits` f32 partial sums (the
// GEMM's inner dimension split across a cuBLASLt batch, see gemm.rs): the partials are summed
// in f32, in split order, and rounded to bf16 first, as a GEMM with bf16 output would, so
// residual = bf16(residual + bf16(sum of parts)) and the rest is add_rms_norm's.
//
// Layout: x, out, residual [n_rows, dim]; w [dim]; all bf16; parts [splits, n_rows, dim] f32.
// Two launch shapes:
//   *_block: one block (256 threads) per row, for hidden-size rows;
//   *_warp:  one warp per row, 8 rows per block, for short rows (dim <= 1024, e.g. q/k norm).
// Rows whose dim is a multiple of 8 (up to 8192) use 16-byte accesses and one read of the row.

// Up to this many 16-byte vectors per thread are kept in registers between the two passes,
// so a row is read from memory once (rows up to 8192 wide on a 256-thread block, and every
// row on the warp path, whose rows are at most 1024 wide).
#define NORM_MAX_VEC 4

// The added value's source in the _parts kernels: this row's `splits` partials, `stride`
// values apart.
struct Parts {
    const float* row;
    int splits;
    u64 stride;
};

// bf16(sum of the partials) at the row's 8 values from 8 * vec.
__device__ __forceinline__ uint4 parts_sum8(const Parts& p, int vec) {
    float v[8];
    const float4* first = reinterpret_cast<const float4*>(p.row) + 2 * vec;
    float4 a = first[0], b = first[1];
    for (int s = 1; s < p.splits; ++s) {
        const float4* q = reinterpret_cast<const float4*>(p.row + s * p.stride) + 2 * vec;
        const float4 c = q[0], d = q[1];
        a.x += c.x; a.y += c.y; a.z += c.z; a.w += c.w;
        b.x += d.x; b.y += d.y; b.z += d.z; b.w += d.w;
    }
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    return pack8(v);
}

__device__ __forceinline__ float parts_sum(const Parts& p, int i) {
    float a = p.row[i];
    for (int s = 1; s < p.splits; ++s) a += p.row[s * p.stride + i];
    return bf16_to_f32(f32_to_bf16(a));
}

// ADD: residual += the added value (x, or with PARTS the partials' rounded sum), then the norm.
template <bool ADD, bool PARTS = false>
__device__ __forceinline__ void rms_norm_row(bf16* __restrict__ out, bf16* residual, const bf16* __restrict__ x,
                                             const bf16* __restrict__ w, int dim, float eps, int lane, int n_lanes,
                                             bool whole_block, float* scratch, Parts parts = Parts{}) {
    float ss = 0.f;
    const int nv = dim >> 3;
    if ((dim & 7) == 0 && nv <= NORM_MAX_VEC * n_lanes) {
        // Register-resident path: one read of the row, and every load (the residual's and
        // gamma's too) issued before any use, so the kernel waits for memory once, not three
        // times (with the same change in qkv_rope_write: -3.3 µs per layer at 64 tokens of an
        // 8B model on an H200, RESULTS 2026-12-03).
        uint4 reg[NORM_MAX_VEC], res[NORM_MAX_VEC], gam[NORM_MAX_VEC];
#pragma unroll
        for (int j = 0; j < NORM_MAX_VEC; ++j) {
            const int i = lane + j * n_lanes;
            if (i < nv) {
                if (ADD) res[j] = reinterpret_cast<const uint4*>(residual)[i];
                gam[j] = reinterpret_cast<const uint4*>(w)[i];
            }
        }
#pragma unroll
        for (int j = 0; j < NORM_MAX_VEC; ++j) {
            const int i = lane + j * n_lanes;
            if (i < nv) reg[j] = PARTS ? parts_sum8(parts, i) : reinterpret_cast<const uint4*>(x)[i];
        }
#pragma unroll
        for (int j = 0; j < NORM_MAX_VEC; ++j) {
            const int i = lane + j * n_lanes;
            if (i < nv) {
                float v[8];
                unpack8(reg[j], v);
                if (ADD) {
                    float r[8];
                    unpack8(res[j], r);
#pragma unroll
                    for (int k = 0; k < 8; ++k) v[k] = bf16_to_f32(f32_to_bf16(v[k] + r[k]));
                    reg[j] = pack8(v);  // exact: the values are bf16 already
                    reinterpret_cast<uint4*>(residual)[i] = reg[j];
                }
#pragma unroll
                for (int k = 0; k < 8; ++k) ss += v[k] * v[k];
            }
        }
        ss = whole_block ? block_sum(ss, scratch) : warp_sum(ss);
        const float s = rsqrtf(ss / (float)dim + eps);
#pragma unroll
        for (int j = 0; j < NORM_MAX_VEC; ++j) {
            const int i = lane + j * n_lanes;
            if (i < nv) {
                float v[8], g[8];
                unpack8(reg[j], v);
                unpack8(gam[j], g);
#pragma unroll
                for (int k = 0; k < 8; ++k) v[k] = (v[k] * s) * g[k];
                reinterpret_cast<uint4*>(out)[i] = pack8(v);
            }
        }
        return;
    }
    // General path (dims not a multiple of 8, or rows too long for the registers): two
    // passes, the second re-reading the row (hot in L1/L2); with ADD it reads the rounded
    // sum this same thread just stored.
    for (int i = lane; i < dim; i += n_lanes) {
        float v = PARTS ? parts_sum(parts, i) : bf16_to_f32(x[i]);
        if (ADD) {
            bf16 r = f32_to_bf16(v + bf16_to_f32(residual[i]));
            residual[i] = r;
            v = bf16_to_f32(r);
        }
        ss += v * v;
    }
    ss = whole_block ? block_sum(ss, scratch) : warp_sum(ss);
    const float s = rsqrtf(ss / (float)dim + eps);
    const bf16* src = ADD ? residual : x;
    for (int i = lane; i < dim; i += n_lanes) out[i] = f32_to_bf16((bf16_to_f32(src[i]) * s) * bf16_to_f32(w[i]));
}

extern "C" __global__ void rms_norm_block(bf16* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w,
                                          int n_rows, int dim, float eps) {
    __shared__ float scratch[32];
    const u64 row = blockIdx.x;
    if (row >= (u64)n_rows) return;
    rms_norm_row<false>(out + row * dim, nullptr, x + row * dim, w, dim, eps, threadIdx.x, blockDim.x, true, scratch);
}

extern "C" __global__ void rms_norm_warp(bf16* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w,
                                         int n_rows, int dim, float eps) {
    const u64 row = (u64)blockIdx.x * (blockDim.x / WARP_SIZE) + (threadIdx.x / WARP_SIZE);
    if (row >= (u64)n_rows) return;
    rms_norm_row<false>(out + row * dim, nullptr, x + row * dim, w, dim, eps, threadIdx.x % WARP_SIZE, WARP_SIZE, false, nullptr);
}

extern "C" __global__ void add_rms_norm_block(bf16* __restrict__ out, bf16* residual, const bf16* __restrict__ x,
                                              const bf16* __restrict__ w, int n_rows, int dim, float eps) {
    __shared__ float scratch[32];
    const u64 row = blockIdx.x;
    if (row >= (u64)n_rows) return;
    rms_norm_row<true>(out + row * dim, residual + row * dim, x + row * dim, w, dim, eps, threadIdx.x, blockDim.x, true,
                       scratch);
}

extern "C" __global__ void add_rms_norm_warp(bf16* __restrict__ out, bf16* residual, const bf16* __restrict__ x,
                                             const bf16* __restrict__ w, int n_rows, int dim, float eps) {
    const u64 row = (u64)blockIdx.x * (blockDim.x / WARP_SIZE) + (threadIdx.x / WARP_SIZE);
    if (row >= (u64)n_rows) return;
    rms_norm_row<true>(out + row * dim, residual + row * dim, x + row * dim, w, dim, eps, threadIdx.x % WARP_SIZE, WARP_SIZE, false,
                       nullptr);
}

extern "C" __global__ void add_parts_rms_norm_block(bf16* __restrict__ out, bf16* residual, const float* __restrict__ parts,
                                                    int splits, const bf16* __restrict__ w, int n_rows, int dim, float eps) {
    __shared__ float scratch[32];
    const u64 row = blockIdx.x;
    if (row >= (u64)n_rows) return;
    const Parts p{parts + row * dim, splits, (u64)n_rows * dim};
    rms_norm_row<true, true>(out + row * dim, residual + row * dim, nullptr, w, dim, eps, threadIdx.x, blockDim.x, true,
                             scratch, p);
}

extern "C" __global__ void add_parts_rms_norm_warp(bf16* __restrict__ out, bf16* residual, const float* __restrict__ parts,
                                                   int splits, const bf16* __restrict__ w, int n_rows, int dim, float eps) {
    const u64 row = (u64)blockIdx.x * (blockDim.x / WARP_SIZE) + (threadIdx.x / WARP_SIZE);
    if (row >= (u64)n_rows) return;
    const Parts p{parts + row * dim, splits, (u64)n_rows * dim};
    rms_norm_row<true, true>(out + row * dim, residual + row * dim, nullptr, w, dim, eps, threadIdx.x % WARP_SIZE, WARP_SIZE,
                             false, nullptr, p);
}

// The residual add alone (after an all-reduce that could not add it itself):
// residual = bf16(residual + x), [n] bf16 each; the _vec8 kernel needs n % 8 == 0.
extern "C" __global__ void add_residual(bf16* residual, const bf16* __restrict__ x, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        residual[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(residual[i]));
    }
}

extern "C" __global__ void add_residual_vec8(bf16* residual, const bf16* __restrict__ x, u64 n_vec) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n_vec; i += (u64)gridDim.x * blockDim.x) {
        float a[8], r[8];
        unpack8(reinterpret_cast<const uint4*>(x)[i], a);
        unpack8(reinterpret_cast<const uint4*>(residual)[i], r);
#pragma unroll
        for (int k = 0; k < 8; ++k) a[k] += r[k];
        reinterpret_cast<uint4*>(residual)[i] = pack8(a);
    }
}
