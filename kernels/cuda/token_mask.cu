// Constrained decoding (structured outputs): bans every token a row's grammar does not allow
// by setting its logit to -inf, before the sampling kernel runs on the same logits.
//
// logits: [n_logit_rows, vocab] f32. Row r of the launch masks logits row rows[r] with
// masks[r * words ..], a packed bitmask: token t is allowed when bit (t % 32) of word t / 32
// is set. words >= ceil(vocab / 32) (checked by the host). Only the constrained rows are in
// the launch (blockIdx.y), so an unconstrained row is never touched; a row index past the
// logits is ignored rather than written.
//
// Grid: (x blocks striding over the vocabulary, one y per constrained row); each thread reads
// one mask word per 32 tokens (the same word for a warp: a broadcast load).

extern "C" __global__ void apply_token_mask(float* __restrict__ logits, u32 vocab, u32 n_logit_rows,
                                            const u32* __restrict__ masks, const u32* __restrict__ rows,
                                            u32 words) {
    const u32 r = blockIdx.y;
    const u32 row = rows[r];
    if (row >= n_logit_rows) return;
    const u32* m = masks + (u64)r * words;
    float* l = logits + (u64)row * vocab;
    const float neg_inf = __uint_as_float(0xff800000u);
    for (u32 t = blockIdx.x * blockDim.x + threadIdx.x; t < vocab; t += gridDim.x * blockDim.x) {
        if (((m[t >> 5] >> (t & 31u)) & 1u) == 0u) l[t] = neg_inf;
    }
}
