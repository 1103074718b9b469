// Shared by the sampling modules (sampling.cu: one CTA per row; sampling_split.cu: rows split
// over CTAs): the parameter struct, the order and rank keys, the counter-based Gumbel noise, the
// row statistics and which rows the split path takes. sources.rs prepends it to both.

#define SAMPLE_MAX_TOP 20
#define SAMPLE_ID_BITS 20
#define SAMPLE_ID_MASK ((1u << SAMPLE_ID_BITS) - 1u)
#define GREEDY_TEMPERATURE 1e-5f

#define FLAG_BAD_LOGIT 1u
#define FLAG_ALL_BANNED 2u
#define FLAG_BAD_ENTRY 4u

#define F32_INF __int_as_float(0x7f800000)
#define F64_INF __longlong_as_double(0x7ff0000000000000ll)
#define NO_TOKEN 0xffffffffu

// Must match kernels/src/cuda/sample_params.rs.
struct SampleParams {
    u64 seed;
    u64 draw;
    float temperature;
    u32 top_k;
    float top_p;
    float min_p;
    float repetition_penalty;
    float presence_penalty;
    float frequency_penalty;
    u32 n_logprobs;
};
static_assert(sizeof(SampleParams) == 48, "SampleParams layout differs from the Rust struct");

__device__ __forceinline__ u32 order_key(float x) {
    const u32 u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Unique per token: logit order first, then the lower id ranks higher.
__device__ __forceinline__ u64 rank_key(u32 i, float l) {
    return ((u64)order_key(l) << SAMPLE_ID_BITS) | (u64)(SAMPLE_ID_MASK - i);
}

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, u32 k0, u32 k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const u32 hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const u32 hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c;
}

__device__ __forceinline__ double gumbel_noise(u64 seed, u64 draw, u32 i) {
    const uint4 r = philox4x32_10(make_uint4(i, 0u, (u32)draw, (u32)(draw >> 32)), (u32)seed, (u32)(seed >> 32));
    const u64 bits = (((u64)r.x << 32) | (u64)r.y) >> 12;
    const double u = ((double)bits + 0.5) * 0x1p-52;  // in (0, 1), exact
    return -log(-log(u));
}

// Row statistics: running max, sum of exp(l - max) relative to it, first index of the max,
// count of logits > -inf. Combining is symmetric (a butterfly gives every lane equal bits).
struct RowStats {
    float m, s;
    u32 arg, n_finite;
};

__device__ __forceinline__ RowStats combine_stats(RowStats a, RowStats b) {
    RowStats r;
    r.m = fmaxf(a.m, b.m);
    const float ta = a.m == -F32_INF ? 0.f : a.s * expf(a.m - r.m);
    const float tb = b.m == -F32_INF ? 0.f : b.s * expf(b.m - r.m);
    r.s = ta + tb;
    r.arg = (b.m > a.m || (b.m == a.m && b.arg < a.arg)) ? b.arg : a.arg;
    r.n_finite = a.n_finite + b.n_finite;
    return r;
}

// Rows the split path (sampling_split.cu) samples, when the host launches it, and sample_rows
// then skips: no top-N logprobs, no bias or penalty entries, and greedy or untruncated (top-k
// off or >= vocab, top-p >= 1, min-p <= 0; NaN parameters fail these tests and stay with
// sample_rows). Must match sample_params.rs `SampleParams::splits`.
__device__ __forceinline__ bool split_row(const SampleParams& p, u32 vocab, const u32* pen_offsets,
                                          const u32* bias_offsets, u32 bias_len, u32 row) {
    if (p.n_logprobs != 0) return false;
    const u32 b0 = bias_offsets[row], b1 = bias_offsets[row + 1];
    if (b0 != b1 || b1 > bias_len) return false;
    const bool penalise = p.repetition_penalty != 1.f || p.presence_penalty != 0.f || p.frequency_penalty != 0.f;
    if (penalise && pen_offsets[row] != pen_offsets[row + 1]) return false;
    if (p.temperature < GREEDY_TEMPERATURE) return true;
    return (p.top_k == 0 || p.top_k >= vocab) && p.top_p >= 1.f && p.min_p <= 0.f;
}
