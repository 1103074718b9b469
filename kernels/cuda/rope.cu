// Rotary position embedding, in place on bf16 q or k rows.
// x: [n_tokens, row_stride]; head h of token t starts at x[t * row_stride + h * head_dim].
// cos_sin: [max_pos, rope_dim / 2] of (cos, sin) pairs in f32, built on the host from the
// exact f64 angle (pos * inv_freq), so precision does not fall with the position.
// Pair i of a head is (2i, 2i+1) when interleaved (llama.cpp GGUF llama), (i, i + rope_dim/2)
// for neox (HF rotate_half). Dims >= rope_dim pass through. A position >= max_pos cannot
// index the table: the head's rotated dims become NaN instead.
// One block per token; threads stride over (head, pair).

extern "C" __global__ void rope(bf16* x, const u32* __restrict__ positions, const float2* __restrict__ cos_sin,
                                u32 n_tokens, u32 n_heads, u32 head_dim, u32 half_rot, u64 row_stride, u32 max_pos,
                                int neox) {
    const u32 t = blockIdx.x;
    if (t >= n_tokens) return;
    const u32 pos = positions[t];
    const bool ok = pos < max_pos;
    const float2* cs = cos_sin + (u64)(ok ? pos : 0) * half_rot;
    bf16* row = x + (u64)t * row_stride;
    for (u32 k = threadIdx.x; k < n_heads * half_rot; k += blockDim.x) {
        const u32 h = k / half_rot, i = k - h * half_rot;
        bf16* head = row + (u64)h * head_dim;
        const u32 ia = neox ? i : 2 * i, ib = neox ? i + half_rot : 2 * i + 1;
        if (!ok) {
            head[ia] = BF16_NAN;
            head[ib] = BF16_NAN;
            continue;
        }
        const float2 c = cs[i];
        const float a = bf16_to_f32(head[ia]), b = bf16_to_f32(head[ib]);
        head[ia] = f32_to_bf16(a * c.x - b * c.y);
        head[ib] = f32_to_bf16(a * c.y + b * c.x);
    }
}
