// Embedding gather: out[t, :] = table[ids[t], :], table [vocab, dim] bf16, ids [n_tokens] u32.
// Ids live on the device, so the host cannot check them: an id >= vocab never reads out of
// bounds, it produces a row of NaN that the first comparison downstream exposes.
// One block per token; 16-byte copies when dim is a multiple of 8.

extern "C" __global__ void embedding(bf16* __restrict__ out, const bf16* __restrict__ table,
                                     const u32* __restrict__ ids, u32 n_tokens, u32 vocab, u32 dim) {
    const u32 t = blockIdx.x;
    if (t >= n_tokens) return;
    const u32 id = ids[t];
    bf16* dst = out + (u64)t * dim;
    const bool ok = id < vocab;
    const bf16* src = table + (u64)(ok ? id : 0) * dim;
    if ((dim & 7) == 0) {
        const uint4 nan8 = make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);
        for (u32 i = threadIdx.x; i < dim >> 3; i += blockDim.x)
            reinterpret_cast<uint4*>(dst)[i] = ok ? reinterpret_cast<const uint4*>(src)[i] : nan8;
    } else {
        for (u32 i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = ok ? src[i] : BF16_NAN;
    }
}
