// Shared helpers for every Tessera CUDA module. The loader (kernels/src/cuda/sources.rs)
// prepends this file to each .cu source, so no include paths or toolkit headers are needed
// at run time: bf16 is handled as raw 16-bit storage and converted by hand.
//
// Conventions: tensors are row-major; storage is bf16, arithmetic and accumulation f32;
// bf16 rounding is round-to-nearest-even with NaN kept quiet (the same as the `half`
// crate, so the CPU reference can reproduce GPU roundings bit for bit).

// Lanes per warp: 32 on NVIDIA. The HIP build defines it first (kernels/hip/compat.h) as the
// wavefront size of the target (64 on CDNA, 32 on RDNA); every warp-level loop, lane index and
// per-warp array below is written in terms of it, so one source serves both widths.
#ifndef WARP_SIZE
#define WARP_SIZE 32
#endif

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float bf16_to_f32(bf16 v) { return __uint_as_float(((u32)v) << 16); }

__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

#define BF16_NAN ((bf16)0x7fc0u)

// Programmatic dependent launch: lets the next kernel in the stream, if launched with the
// PDL attribute, start while this one runs (it waits with griddepcontrol.wait before reading
// what this one writes). Without that attribute, and on AMD GPUs, nothing happens.
// PDL_WAIT: waits until the kernel ahead has finished and its writes are visible.
#ifdef TESSERA_HIP
#define PDL_TRIGGER()
#define PDL_WAIT()
#else
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory")
#define PDL_WAIT() asm volatile("griddepcontrol.wait;\n" ::: "memory")
#endif

// SwiGLU's gate: silu(g) = g / (1 + e^-g) (activation.cu, and the fused decode GEMV's epilogue).
__device__ __forceinline__ float silu_f(float g) { return g / (1.f + expf(-g)); }

// 8 bf16 values in one 16-byte word: the unit of every vectorised load and store.
__device__ __forceinline__ void unpack8(uint4 v, float f[8]) {
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ uint4 pack8(const float f[8]) {
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = (u32)f32_to_bf16(f[2 * i]) | ((u32)f32_to_bf16(f[2 * i + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the whole block (blockDim.x a multiple of WARP_SIZE, at most 1024); every thread
// gets the total. `scratch` is 32 floats of shared memory (1024 / 32 warps at most).
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, n_warps = blockDim.x / WARP_SIZE;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read from a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : 0.f;
    return warp_sum(v);
}

// RoPE of one pair (a, b) by the angle whose (cos, sin) is c: the one expression every
// kernel that rotates q or k uses (qkv.cu, gemv.cu's NORM_ROPE epilogue), so they round
// alike (the compiler contracts the same expression the same way).
__device__ __forceinline__ void rope_rotate(float a, float b, float2 c, float& ra, float& rb) {
    ra = a * c.x - b * c.y;
    rb = a * c.y + b * c.x;
}
