// Sampling of the rows `split_row` selects (greedy, or temperature without truncation, no
// logprobs, no bias or penalty entries) with each row spread over many CTAs. One CTA per row
// (sampling.cu) leaves a single-row step with one SM busy: the default OpenAI request
// (temperature 1, no top-k / top-p) then draws Gumbel noise for the whole vocabulary on one SM.
//
// Three launches, each over (rows, slices) or rows, with results identical to sample_rows':
//   1. split_stats: per slice of SPLIT_CHUNK logits, the RowStats (max, sum of exp(l - max),
//      first index of the max, finite count) and whether a NaN / +inf appeared;
//   2. split_draw (sampling rows only): every CTA takes the row's max over all slices (fmaxf:
//      exact in any order), then the slice's best Gumbel-max score (double)z + g_i with
//      z = (l - max) * (1 / T) over the finite logits, higher score then lower id;
//   3. split_finish: one warp per row combines the slices in a fixed order and writes the row's
//      token, logprob and flags as sample_rows does.
// The token equals sample_rows' (the max and every score are the same bits; ties go to the lower
// id in both). The logprob's sum of exp is added in another order, so it can differ from
// sample_rows' in the last f32 bits. The host launches this path for small batches only (where
// one CTA per row leaves the GPU idle), so a row's logprob may differ in those bits between a
// small and a large batch; its token never does.

#define SPLIT_THREADS 256
#define SPLIT_WARPS (SPLIT_THREADS / WARP_SIZE)
// Logits per thread of a slice, all loaded before the first is used (each load coalesced
// across the CTA): a CTA of SPLIT_THREADS covers SPLIT_CHUNK logits. With 1024 logits per CTA
// (4 per thread, each loaded as the loop reached it) split_stats took 48 us for 64 rows of
// 128,256 logits on an H200, 8,064 CTAs mostly waiting on memory; this needs a quarter of
// the CTAs, each with 16 loads in flight per thread.
#define SPLIT_PER_THREAD 16
#define SPLIT_CHUNK (SPLIT_THREADS * SPLIT_PER_THREAD)

// The vocabulary index of this thread's k-th logit of `slice` (increasing with k).
__device__ __forceinline__ u32 split_index(u32 slice, u32 tid, int k) {
    return slice * SPLIT_CHUNK + tid + (u32)k * SPLIT_THREADS;
}

// This thread's logits of `slice` (v[k] at split_index), -inf past the row's end (a -inf
// logit changes no statistic and is never drawn).
__device__ __forceinline__ void split_load(const float* __restrict__ x, u32 vocab, u32 slice, u32 tid,
                                           float (&v)[SPLIT_PER_THREAD]) {
#pragma unroll
    for (int k = 0; k < SPLIT_PER_THREAD; ++k) {
        const u32 i = split_index(slice, tid, k);
        v[k] = i < vocab ? x[i] : -F32_INF;
    }
}

// One slice's results; must match SPLIT_PART_WORDS in sampling.rs (8 words).
struct SplitPart {
    float m, s;
    u32 arg, n_finite;
    double score;
    u32 pick, bad;
};
static_assert(sizeof(SplitPart) == 32, "SplitPart layout differs from the host's 8 words");

__device__ __forceinline__ RowStats shfl_stats(RowStats st, int o) {
    RowStats other;
    other.m = __shfl_xor_sync(0xffffffffu, st.m, o);
    other.s = __shfl_xor_sync(0xffffffffu, st.s, o);
    other.arg = __shfl_xor_sync(0xffffffffu, st.arg, o);
    other.n_finite = __shfl_xor_sync(0xffffffffu, st.n_finite, o);
    return other;
}

// 1. Grid (rows, slices) of SPLIT_THREADS (rows in x: up to 2^31 - 1 of them).
extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
    split_stats(const float* __restrict__ logits, u32 vocab, const SampleParams* __restrict__ params,
                const u32* __restrict__ pen_offsets, const u32* __restrict__ bias_offsets, u32 bias_len,
                SplitPart* __restrict__ parts) {
    __shared__ RowStats s_stats[SPLIT_WARPS];
    __shared__ u32 s_bad;
    const u32 row = blockIdx.x, slice = blockIdx.y, slices = gridDim.y, tid = threadIdx.x;
    const SampleParams p = params[row];
    if (!split_row(p, vocab, pen_offsets, bias_offsets, bias_len, row)) return;
    if (tid == 0) s_bad = 0;
    __syncthreads();
    float v[SPLIT_PER_THREAD];
    split_load(logits + (u64)row * vocab, vocab, slice, tid, v);
    RowStats st = {-F32_INF, 0.f, NO_TOKEN, 0u};
    bool bad = false;
#pragma unroll
    for (int k = 0; k < SPLIT_PER_THREAD; ++k) {
        const u32 i = split_index(slice, tid, k);
        const float l = v[k];
        if (l > st.m) {
            st.s = st.s * expf(st.m - l) + 1.f;
            st.m = l;
            st.arg = i;
        } else if (l > -F32_INF) {
            st.s += expf(l - st.m);
        }
        st.n_finite += l > -F32_INF ? 1u : 0u;
        bad |= !(l < F32_INF);
    }
    if (bad) atomicOr(&s_bad, 1u);
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) st = combine_stats(st, shfl_stats(st, o));
    if (tid % WARP_SIZE == 0) s_stats[tid / WARP_SIZE] = st;
    __syncthreads();
    if (tid == 0) {
        st = s_stats[0];
        for (int w = 1; w < SPLIT_WARPS; ++w) st = combine_stats(st, s_stats[w]);
        SplitPart& out = parts[(u64)row * slices + slice];
        out.m = st.m;
        out.s = st.s;
        out.arg = st.arg;
        out.n_finite = st.n_finite;
        out.score = -F64_INF;
        out.pick = NO_TOKEN;
        out.bad = s_bad;
    }
}

// The row's max over its slices' parts (every lane gets the same value).
__device__ __forceinline__ float parts_max(const SplitPart* row_parts, u32 slices) {
    float m = -F32_INF;
    for (u32 j = threadIdx.x % WARP_SIZE; j < slices; j += WARP_SIZE) m = fmaxf(m, row_parts[j].m);
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

// 2. Grid (rows, slices) of SPLIT_THREADS; greedy and unusable rows (max +-inf) return at once.
extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
    split_draw(const float* __restrict__ logits, u32 vocab, const SampleParams* __restrict__ params,
               const u32* __restrict__ pen_offsets, const u32* __restrict__ bias_offsets, u32 bias_len,
               SplitPart* __restrict__ parts) {
    __shared__ float s_max;
    __shared__ double s_score[SPLIT_WARPS];
    __shared__ u32 s_pick[SPLIT_WARPS];
    const u32 row = blockIdx.x, slice = blockIdx.y, slices = gridDim.y, tid = threadIdx.x;
    const SampleParams p = params[row];
    if (!split_row(p, vocab, pen_offsets, bias_offsets, bias_len, row) || p.temperature < GREEDY_TEMPERATURE) return;
    SplitPart* row_parts = parts + (u64)row * slices;
    if (tid < WARP_SIZE) {
        const float m = parts_max(row_parts, slices);
        if (tid == 0) s_max = m;
    }
    __syncthreads();
    const float max = s_max;
    if (!(max > -F32_INF && max < F32_INF)) return;
    const float inv_t = 1.f / p.temperature;
    float v[SPLIT_PER_THREAD];
    split_load(logits + (u64)row * vocab, vocab, slice, tid, v);
    double best = -F64_INF;
    u32 pick = NO_TOKEN;
#pragma unroll
    for (int k = 0; k < SPLIT_PER_THREAD; ++k) {
        const u32 i = split_index(slice, tid, k);
        const float l = v[k];
        if (!(l > -F32_INF)) continue;
        const double score = (double)__fmul_rn(l - max, inv_t) + gumbel_noise(p.seed, p.draw, i);
        if (score > best) {  // strict: the lower index wins a tie within the thread
            best = score;
            pick = i;
        }
    }
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
        const double ob = __shfl_xor_sync(0xffffffffu, best, o);
        const u32 oi = __shfl_xor_sync(0xffffffffu, pick, o);
        if (ob > best || (ob == best && oi < pick)) {
            best = ob;
            pick = oi;
        }
    }
    if (tid % WARP_SIZE == 0) {
        s_score[tid / WARP_SIZE] = best;
        s_pick[tid / WARP_SIZE] = pick;
    }
    __syncthreads();
    if (tid == 0) {
        best = s_score[0];
        pick = s_pick[0];
        for (int w = 1; w < SPLIT_WARPS; ++w) {
            if (s_score[w] > best || (s_score[w] == best && s_pick[w] < pick)) {
                best = s_score[w];
                pick = s_pick[w];
            }
        }
        row_parts[slice].score = best;
        row_parts[slice].pick = pick;
    }
}

// 3. Grid rows, one warp (WARP_SIZE threads) each. Lane j combines slices j, j + WARP_SIZE, ...
// in order, then a fixed butterfly; the same shape every time, so the sum's bits never vary
// between runs.
extern "C" __global__ void __launch_bounds__(WARP_SIZE)
    split_finish(const float* __restrict__ logits, u32 vocab, const SampleParams* __restrict__ params,
                 const u32* __restrict__ pen_offsets, const u32* __restrict__ bias_offsets, u32 bias_len,
                 const SplitPart* __restrict__ parts, u32 slices, u32* __restrict__ out_token,
                 float* __restrict__ out_logprob, u32* __restrict__ out_n_top, u32* __restrict__ out_flags) {
    const u32 row = blockIdx.x, lane = threadIdx.x;
    const SampleParams p = params[row];
    if (!split_row(p, vocab, pen_offsets, bias_offsets, bias_len, row)) return;
    const SplitPart* row_parts = parts + (u64)row * slices;
    RowStats st = {-F32_INF, 0.f, NO_TOKEN, 0u};
    double best = -F64_INF;
    u32 pick = NO_TOKEN, bad = 0;
    for (u32 j = lane; j < slices; j += WARP_SIZE) {
        const SplitPart q = row_parts[j];
        const RowStats o = {q.m, q.s, q.arg, q.n_finite};
        st = combine_stats(st, o);
        if (q.score > best || (q.score == best && q.pick < pick)) {
            best = q.score;
            pick = q.pick;
        }
        bad |= q.bad;
    }
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
        st = combine_stats(st, shfl_stats(st, o));
        const double ob = __shfl_xor_sync(0xffffffffu, best, o);
        const u32 oi = __shfl_xor_sync(0xffffffffu, pick, o);
        if (ob > best || (ob == best && oi < pick)) {
            best = ob;
            pick = oi;
        }
        bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    }
    if (lane != 0) return;
    const float max = st.m, log_sum = logf(st.s);
    const bool usable = max > -F32_INF && max < F32_INF;
    // The CPU argmax of an all -inf row is 0.
    u32 token = st.arg == NO_TOKEN ? 0u : st.arg;
    // A draw that kept nothing (NaN temperature) stays greedy, as in sample_rows.
    if (p.temperature >= GREEDY_TEMPERATURE && usable && pick != NO_TOKEN) token = pick;
    const float* x = logits + (u64)row * vocab;
    out_token[row] = token;
    out_logprob[row] = (x[token] - max) - log_sum;
    out_n_top[row] = 0;
    out_flags[row] = (bad ? FLAG_BAD_LOGIT : 0u) | (max > -F32_INF ? 0u : FLAG_ALL_BANNED);
}
