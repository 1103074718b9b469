// SwiGLU: out[r, c] = silu(gate[r, c]) * up[r, c], silu(g) = g / (1 + e^-g).
// out is [n_rows, cols] contiguous; gate and up are read with row stride `in_stride`, so
// one launch serves separate buffers (stride = cols) and a packed gate|up GEMM output
// (gate = base, up = base + cols, stride = 2 * cols). Grid-stride over the elements;
// the _vec8 kernel needs cols and in_stride multiples of 8 (16-byte accesses).

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
