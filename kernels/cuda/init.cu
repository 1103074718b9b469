// Uniform random fill of a bf16 buffer, so synthetic models (`--synthetic`) get their weights
// generated where they live instead of uploaded from the host.
//
// Element i of a buffer filled with `seed` is a pure function of (seed, i), the same as
// kernels/src/cpu/random.rs computes: h = splitmix64(seed ^ i * golden), u = (h >> 40) / 2^24,
// value = lo + u * (hi - lo) in f32 with no fused multiply-add (__fmul_rn, __fadd_rn), then
// rounded to bf16 nearest-even (common.cuh's f32_to_bf16, which matches half::bf16::from_f32).
// So the GPU fill equals the CPU reference bit for bit.
//
// Indices are u64 (a Llama-8B buffer holds ~1e9 values; the layout allows more than 2^32).
// Grid-stride over 8-value vectors (16-byte stores), then the n % 8 tail by the first threads.

#define SPLITMIX_GOLDEN 0x9e3779b97f4a7c15ull

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += SPLITMIX_GOLDEN;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ float uniform_at(u64 seed, u64 i, float lo, float span) {
    const u64 h = splitmix64(seed ^ (i * SPLITMIX_GOLDEN));
    const float u = __fmul_rn((float)(u32)(h >> 40), 5.9604644775390625e-8f);  // exact: / 2^24
    return __fadd_rn(lo, __fmul_rn(u, span));
}

extern "C" __global__ void fill_uniform(bf16* __restrict__ out, u64 n, u64 seed, float lo, float hi) {
    const float span = __fsub_rn(hi, lo);
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 n_vec = n >> 3;
    for (u64 v = tid; v < n_vec; v += stride) {
        float f[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) f[k] = uniform_at(seed, v * 8 + k, lo, span);
        reinterpret_cast<uint4*>(out)[v] = pack8(f);
    }
    const u64 tail = n_vec * 8 + tid;  // below n only for tid < n % 8
    if (tail < n) out[tail] = f32_to_bf16(uniform_at(seed, tail, lo, span));
}
