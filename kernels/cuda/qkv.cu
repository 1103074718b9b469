// Q/K/V preparation after the fused QKV GEMM, in one pass over its output: per head, the
// bias add (Qwen2), RMSNorm with a [head_dim] weight (Qwen3's q/k norm), RoPE from the
// (cos, sin) table, and one rounding to bf16; q goes to q_out, k and v into the paged caches.
// This replaces separate bias, norm, rope and write_kv launches (and their round trips
// through memory) with the same semantics as the CPU path of a llama block: f32 bias add,
// norm as kernels/src/cpu/norm.rs ((x * s) * w, s = 1 / sqrt(mean(x^2) + eps)), rope as
// rope.cu.
//
// qkv: [n_tokens, (n_heads + 2 * n_kv) * head_dim], a row being the heads q_0.., k_0.., v_0..
// bias: [(n_heads + 2 * n_kv) * head_dim] laid out like a row, or null.
// q_norm, k_norm: [head_dim] each, or both null.
// q_out: [n_tokens, n_heads * head_dim]; k_cache, v_cache: [n_slots, n_kv, head_dim] (that is
// [num_blocks, block_size, n_kv, head_dim]); slots: [n_tokens]. A slot >= n_slots (u32 max
// marks padding tokens) skips that token's k and v; its q is still written.
// cos_sin: [max_pos, half_rot] (cos, sin) pairs as in rope.cu; pair i of a head is
// (2i, 2i+1) interleaved or (i, i + half_rot) neox; dims >= 2 * half_rot pass through. A
// position >= max_pos turns the rotated dims of q and k into NaN, as rope.cu does.
//
// Two launch shapes, both with grid (n_tokens, head blocks) and the head staged in f32 in
// dynamic shared memory (head_dim floats per head, sized by the host) so one thread can read
// both dims of a neox pair:
//   qkv_rope_write_vec8: head_dim / 8 lanes per head, a power of two up to 32 (head_dim 64
//     and 128, also 8..256), each lane owning 8 consecutive dims: one 16-byte load of qkv,
//     bias and norm weight and one 16-byte store; a warp serves 32 / lanes heads, so twice or
//     four times the bytes in flight of a warp per head.
//   qkv_rope_write: any even head_dim, QKV_WARPS warps per block, a warp per head, moving
//     bf16 pairs (4 bytes; every head starts 4-byte aligned).

#define QKV_WARPS 4

extern "C" __global__ void qkv_rope_write(bf16* __restrict__ q_out, bf16* __restrict__ k_cache,
                                          bf16* __restrict__ v_cache, const bf16* __restrict__ qkv,
                                          const bf16* __restrict__ bias, const bf16* __restrict__ q_norm,
                                          const bf16* __restrict__ k_norm, const u32* __restrict__ positions,
                                          const u32* __restrict__ slots, const float2* __restrict__ cos_sin,
                                          u32 n_tokens, u32 n_heads, u32 n_kv, u32 head_dim, u32 half_rot,
                                          u32 max_pos, u64 n_slots, float eps, int neox) {
    extern __shared__ float qkv_smem[];
    PDL_TRIGGER();  // the decode attention after it copies older K/V meanwhile
    const u32 t = blockIdx.x;
    const u32 lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const u32 h = blockIdx.y * QKV_WARPS + warp;
    const u32 heads = n_heads + 2 * n_kv;
    // Whole warps leave together: below, only __syncwarp and shuffles synchronise.
    if (t >= n_tokens || h >= heads) return;

    const bool is_q = h < n_heads, is_v = h >= n_heads + n_kv;
    bf16* dst;
    if (is_q) {
        dst = q_out + ((u64)t * n_heads + h) * head_dim;
    } else {
        const u32 slot = slots[t];
        if ((u64)slot >= n_slots) return;
        const u32 kvh = is_v ? h - n_heads - n_kv : h - n_heads;
        dst = (is_v ? v_cache : k_cache) + ((u64)slot * n_kv + kvh) * head_dim;
    }

    const u32 pairs = head_dim >> 1;
    const u32* src = reinterpret_cast<const u32*>(qkv + ((u64)t * heads + h) * head_dim);
    const u32* b = bias ? reinterpret_cast<const u32*>(bias + (u64)h * head_dim) : nullptr;
    float* sh = qkv_smem + (u64)warp * head_dim;
    float2* sh2 = reinterpret_cast<float2*>(sh);

    // Bias add; each lane keeps its own pairs j = lane, lane + WARP_SIZE, ...
    float ss = 0.f;
    for (u32 j = lane; j < pairs; j += WARP_SIZE) {
        const u32 w = src[j];
        float x0 = __uint_as_float(w << 16), x1 = __uint_as_float(w & 0xffff0000u);
        if (b) {
            const u32 bw = b[j];
            x0 += __uint_as_float(bw << 16);
            x1 += __uint_as_float(bw & 0xffff0000u);
        }
        sh2[j] = make_float2(x0, x1);
        ss += x0 * x0;
        ss += x1 * x1;
    }

    // Per-head RMSNorm of q and k (the warp's sum reaches every lane; each lane rescales the
    // pairs it wrote, so no sync is needed before).
    const bf16* nw = is_v ? nullptr : (is_q ? q_norm : k_norm);
    if (nw) {
        ss = warp_sum(ss);
        const float s = rsqrtf(ss / (float)head_dim + eps);
        const u32* w2 = reinterpret_cast<const u32*>(nw);
        for (u32 j = lane; j < pairs; j += WARP_SIZE) {
            const u32 ww = w2[j];
            float2 v = sh2[j];
            v.x = (v.x * s) * __uint_as_float(ww << 16);
            v.y = (v.y * s) * __uint_as_float(ww & 0xffff0000u);
            sh2[j] = v;
        }
    }

    // RoPE of q and k: a rotated pair may span two lanes' values, hence the syncs. Each pair
    // is read and written by one lane only.
    if (!is_v) {
        __syncwarp();
        const u32 pos = positions[t];
        const bool ok = pos < max_pos;
        const float2* cs = cos_sin + (u64)(ok ? pos : 0) * half_rot;
        for (u32 i = lane; i < half_rot; i += WARP_SIZE) {
            const u32 ia = neox ? i : 2 * i, ib = neox ? i + half_rot : 2 * i + 1;
            float ra = __int_as_float(0x7fc00000), rb = ra;
            if (ok) {
                const float2 c = cs[i];
                const float a = sh[ia], bb = sh[ib];
                rope_rotate(a, bb, c, ra, rb);
            }
            sh[ia] = ra;
            sh[ib] = rb;
        }
    }
    __syncwarp();

    u32* d = reinterpret_cast<u32*>(dst);
    for (u32 j = lane; j < pairs; j += WARP_SIZE) {
        const float2 v = sh2[j];
        d[j] = (u32)f32_to_bf16(v.x) | ((u32)f32_to_bf16(v.y) << 16);
    }
}

// ---------------------------------------------------------------- head_dim / 8 lanes per head
// Block: blockDim.x threads = blockDim.x >> lanes_log2 head slots; head h of token t is slot
// h - blockIdx.y * slots. Lanes of absent heads and of skipped K/V still take part in the
// group reduction and the __syncwarp calls (full-warp masks), with their memory accesses off.

// RoPE pairs a lane of the vec8 kernel rotates at most: half_rot <= head_dim / 2 = 4 x
// (head_dim / 8) lanes.
#define QKV_VEC8_PAIRS 4

__device__ __forceinline__ void load8(const bf16* p, float f[8]) { unpack8(*reinterpret_cast<const uint4*>(p), f); }

extern "C" __global__ void qkv_rope_write_vec8(bf16* __restrict__ q_out, bf16* __restrict__ k_cache,
                                               bf16* __restrict__ v_cache, const bf16* __restrict__ qkv,
                                               const bf16* __restrict__ bias, const bf16* __restrict__ q_norm,
                                               const bf16* __restrict__ k_norm, const u32* __restrict__ positions,
                                               const u32* __restrict__ slots, const float2* __restrict__ cos_sin,
                                               u32 n_tokens, u32 n_heads, u32 n_kv, u32 head_dim, u32 half_rot,
                                               u32 max_pos, u64 n_slots, float eps, int neox, u32 lanes_log2) {
    extern __shared__ float qkv_smem[];
    PDL_TRIGGER();  // the decode attention after it copies older K/V meanwhile
    const u32 t = blockIdx.x;
    const u32 lanes = 1u << lanes_log2;
    const u32 gi = threadIdx.x >> lanes_log2, li = threadIdx.x & (lanes - 1);
    const u32 h = blockIdx.y * (blockDim.x >> lanes_log2) + gi;
    const u32 heads = n_heads + 2 * n_kv;
    const bool is_q = h < n_heads, is_v = h >= n_heads + n_kv;

    bool active = t < n_tokens && h < heads;
    bf16* dst = nullptr;
    if (active) {
        if (is_q) {
            dst = q_out + ((u64)t * n_heads + h) * head_dim;
        } else {
            const u32 slot = slots[t];
            const u32 kvh = is_v ? h - n_heads - n_kv : h - n_heads;
            if ((u64)slot < n_slots) dst = (is_v ? v_cache : k_cache) + ((u64)slot * n_kv + kvh) * head_dim;
            else active = false;
        }
    }

    // Every load is issued up front, before the first use of any: the norm weight, the
    // position and then its (cos, sin) pairs (a lane rotates at most QKV_VEC8_PAIRS of them:
    // qkv_shape on the host checks half_rot <= head_dim / 2 = 4 lanes), so the kernel waits
    // for memory twice (the slot, position and row, then the pairs), not five times in a row.
    const bf16* nw = is_v ? nullptr : (is_q ? q_norm : k_norm);
    const bool rot = active && !is_v;
    float w[8];
    if (active && nw) load8(nw + 8 * li, w);
    u32 pos = 0;
    if (rot) pos = positions[t];
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (active) {
        load8(qkv + ((u64)t * heads + h) * head_dim + 8 * li, v);
        if (bias) {
            float b[8];
            load8(bias + (u64)h * head_dim + 8 * li, b);
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] += b[k];
        }
    }
    const bool ok = pos < max_pos;
    float2 c[QKV_VEC8_PAIRS];
    if (rot && ok) {
        const float2* cs = cos_sin + (u64)pos * half_rot;
#pragma unroll
        for (u32 k = 0; k < QKV_VEC8_PAIRS; ++k)
            if (li + k * lanes < half_rot) c[k] = cs[li + k * lanes];
    }

    // Per-head RMSNorm of q and k: the sum over the head's lanes (xor offsets below `lanes`
    // stay inside the group, which is lanes-aligned).
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) ss += v[k] * v[k];
    for (u32 o = lanes >> 1; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (active && nw) {
        const float s = rsqrtf(ss / (float)head_dim + eps);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = (v[k] * s) * w[k];
    }

    // RoPE of q and k through shared memory: pair i is handled by lane i % lanes of the group.
    float* sh = qkv_smem + (u64)gi * head_dim;
    float4* sh4 = reinterpret_cast<float4*>(sh + 8 * li);
    if (rot) {
        sh4[0] = make_float4(v[0], v[1], v[2], v[3]);
        sh4[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
    __syncwarp();
    if (rot) {
#pragma unroll
        for (u32 k = 0; k < QKV_VEC8_PAIRS; ++k) {
            const u32 i = li + k * lanes;
            if (i < half_rot) {
                const u32 ia = neox ? i : 2 * i, ib = neox ? i + half_rot : 2 * i + 1;
                float ra = __int_as_float(0x7fc00000), rb = ra;
                if (ok) {
                    const float a = sh[ia], bb = sh[ib];
                    rope_rotate(a, bb, c[k], ra, rb);
                }
                sh[ia] = ra;
                sh[ib] = rb;
            }
        }
    }
    __syncwarp();
    if (rot) {
        const float4 lo = sh4[0], hi = sh4[1];
        v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
        v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
    }
    if (active) reinterpret_cast<uint4*>(dst)[li] = pack8(v);
}
