// SwiGLU: out[r, c] = silu(gate[r, c]) * up[r, c], silu(g) = g / (1 + e^-g).
// out is [n_rows, cols] contiguous; gate and up are read with row stride `in_stride`, so
// one launch serves separate buffers (stride = cols) and a packed gate|up GEMM output
// (gate = base, up = base + cols, stride = 2 * cols). Grid-stride over the elements;
// the _vec8 kernel needs cols and in_stride multiples of 8 (16-byte accesses).
//
// silu_mul_rowscale_vec8 is the weight-folded path's SwiGLU (worker forward.rs): gate|up came
// from x · W'ᵀ with the FFN norm's weight folded into W', so row r is first scaled by that
// norm's s = rsqrt(mean(xs[r]^2) + eps) of the residual row xs[r] (`xs_dim` values):
// out = silu(s g) * (s u), one rounding. Grid (column blocks, n_rows), 8 columns a thread.

extern "C" __global__ void silu_mul(bf16* __restrict__ out, const bf16* __restrict__ gate, const bf16* __restrict__ up,
                                    u64 n_rows, u32 cols, u64 in_stride) {
    const u64 n = n_rows * cols;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / cols, c = i - r * cols;
        const u64 src = r * in_stride + c;
        out[i] = f32_to_bf16(silu_f(bf16_to_f32(gate[src])) * bf16_to_f32(up[src]));
    }
}

extern "C" __global__ void silu_mul_vec8(bf16* __restrict__ out, const bf16* __restrict__ gate,
                                         const bf16* __restrict__ up, u64 n_rows, u32 cols, u64 in_stride) {
    const u32 cv = cols >> 3;
    const u64 n = n_rows * cv;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / cv, c = i - r * cv;
        const u64 src = (r * in_stride >> 3) + c;
        float g[8], u[8];
        unpack8(reinterpret_cast<const uint4*>(gate)[src], g);
        unpack8(reinterpret_cast<const uint4*>(up)[src], u);
#pragma unroll
        for (int j = 0; j < 8; ++j) g[j] = silu_f(g[j]) * u[j];
        reinterpret_cast<uint4*>(out)[i] = pack8(g);
    }
}

extern "C" __global__ void silu_mul_rowscale_vec8(bf16* __restrict__ out, const bf16* __restrict__ gate,
                                                  const bf16* __restrict__ up, u32 cols, u64 in_stride,
                                                  const bf16* __restrict__ xs, u32 xs_dim, float eps) {
    __shared__ float scratch[32];
    const u64 r = blockIdx.y;
    const u32 cv = cols >> 3, c = blockIdx.x * blockDim.x + threadIdx.x;
    const bool on = c < cv;
    // The row's gate and up first, so their loads fly during the norm's sum.
    uint4 gv = make_uint4(0, 0, 0, 0), uv = gv;
    if (on) {
        const u64 src = (r * in_stride >> 3) + c;
        gv = reinterpret_cast<const uint4*>(gate)[src];
        uv = reinterpret_cast<const uint4*>(up)[src];
    }
    const float s = block_rms_scale(xs + r * xs_dim, xs_dim, eps, scratch);
    if (!on) return;
    float g[8], u[8];
    unpack8(gv, g);
    unpack8(uv, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] = silu_f(s * g[j]) * (s * u[j]);
    reinterpret_cast<uint4*>(out)[r * cv + c] = pack8(g);
}
