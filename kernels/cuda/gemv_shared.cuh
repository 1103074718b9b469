// What the two decode GEMV modules share (the loader puts this file between common.cuh and
// gemv.cu, and gemv_sweep.cu): the fused modes' numbering, the NORM_ROPE epilogue's operands
// and the epilogue itself, so that the ring kernel (gemv.cu, m <= 8) and the sweep kernel
// (gemv_sweep.cu, m = 1) write q and the paged K / V caches with the same arithmetic.
// NVIDIA only, as both modules are.
#ifndef TESSERA_HIP

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

// bf16 rounding of an f32 value, kept as f32 (what a bf16 store and reload gives).
__device__ __forceinline__ float gemv_round(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// NORM_ROPE's work for rows `row`, `row + 1` (dims d, d + 1 of head hh; row even) of token
// n, from their bf16-rounded sums a, b: qkv.cu's arithmetic. Adds the bias, rotates q and k
// dims below 2 half_rot at the token's position (NaN past max_pos), and stores the rounded
// pair into q_out, or into the paged K / V cache at the token's slot (skipped for a slot >=
// n_slots).
__device__ __forceinline__ void gemv_rope_write(const GemvRope& rope, int n, int row, float a, float b) {
    const u32 hd = rope.head_dim, nq = rope.n_heads, nkv = rope.n_kv;
    const u32 hh = (u32)row / hd, d = (u32)row % hd;
    if (rope.bias) {
        a += bf16_to_f32(rope.bias[row]);
        b += bf16_to_f32(rope.bias[row + 1]);
    }
    bf16* dst;
    if (hh < nq) {
        dst = rope.q_out + ((u64)n * nq + hh) * hd;
    } else {
        const u32 slot = rope.slots[n];
        if ((u64)slot >= rope.n_slots) return;
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

#endif  // TESSERA_HIP
