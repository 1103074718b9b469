// Sampling of the next token from f32 logits [n_rows, vocab]: one CTA of SAMPLE_THREADS per row.
// Semantics are the CPU sampler's (worker/src/sampling.rs), in its order:
//   1. logit bias added (the row's bias entries; tokens distinct);
//   2. repetition, then presence and frequency penalties on the row's (token, count) entries,
//      with the CPU's exact f32 operations (no fused multiply-add), only when a penalty is on;
//   3. logprobs = log_softmax of the adjusted logits: max-subtracted sum in f32;
//   4. temperature < 1e-5: greedy, the first index of the maximum (the CPU `argmax`);
//      otherwise z = (l - max) * (1 / T), top-k, top-p, min-p, and a draw from the rest.
// The adjusted logits are left in `logits`.
//
// Truncation without sorting. Logits are ranked by order_key (f32::total_cmp's order), and
// each threshold is a key found by a radix search (sample_params.rs `radix_search`, the same
// algorithm): 4 bits per pass over the row, each pass counting (or summing the weight of) the
// tokens at or above 15 candidate keys at once; 8 passes fix a 32-bit key. A token is kept iff
//   finite  and  key >= K_k  and  key >= K_p  and  (min_p <= 0 or w >= min_p),   w = exp(z),
// where K_k is the key of the k-th largest finite logit (top-k; with ties at the boundary all
// of them are kept, where the CPU keeps exactly k by lower id) and K_p is the largest key whose
// tokens among the top-k ones hold at least top_p of the top-k weight (top-p: equal logits
// are all kept or all dropped, where the CPU cuts inside them by id). Masses are f32 sums.
//
// The draw is Gumbel-max: the token is the argmax over kept i of z_i + g_i, g_i = -log(-log u_i),
// u_i from Philox4x32-10 of (seed, draw, i) (sample_params.rs `gumbel_noise`; f64). That is an
// exact sample of softmax(z) over the kept set, one pass, deterministic per (seed, draw) and
// independent of the batch the row is in. Top-N logprobs: the N-th largest of the 52-bit keys
// (order_key << 20 | (2^20 - 1 - id)), unique per token, leaves exactly N tokens, ranked by
// logit then lower id.
//
// All block reductions have a fixed shape and order, so every thread sees identical values
// (the branches around __syncthreads are uniform) and results do not vary between runs.

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define SAMPLE_MAX_TOP 20
#define SAMPLE_ID_BITS 20
#define SAMPLE_ID_MASK ((1u << SAMPLE_ID_BITS) - 1u)
#define SEARCH_BINS 16
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

// Sums each of the 16 per-thread bins over the block into `out` (shared [16]); `red` is shared
// [SAMPLE_WARPS * 16]. Ends with a barrier, so every thread can read `out`; the next call
// writes `red`/`out` only after its first barrier, by which time all reads of this one are done.
template <typename A>
__device__ __forceinline__ void block_bins(A (&acc)[SEARCH_BINS], A* red, A* out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int j = 0; j < SEARCH_BINS; ++j) {
        A v = acc[j];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) red[warp * SEARCH_BINS + j] = v;
    }
    __syncthreads();
    if (threadIdx.x < SEARCH_BINS) {
        A t = 0;
        for (int w = 0; w < SAMPLE_WARPS; ++w) t += red[w * SEARCH_BINS + threadIdx.x];
        out[threadIdx.x] = t;
    }
    __syncthreads();
}

// How many of the candidates prefix | j << shift (j = 0..15) `key` reaches, minus one; needs
// key >= prefix and prefix's bits below shift + 4 zero.
template <typename K>
__device__ __forceinline__ int digit_above(K key, K prefix, int shift) {
    const K d = (key >> shift) - (prefix >> shift);
    return d > (K)15 ? 15 : (int)d;
}

// The largest key t < 2^bits with at least `need` row elements whose key_of(i, l, key) is true
// and key >= t (radix_search with a count). Needs need <= the number of such elements.
template <typename K, typename KeyOf>
__device__ K search_count(const float* x, u32 vocab, int bits, u32 need, KeyOf key_of, u32* red, u32* bins) {
    K prefix = 0;
    for (int shift = bits - 4; shift >= 0; shift -= 4) {
        u32 acc[SEARCH_BINS];
#pragma unroll
        for (int j = 0; j < SEARCH_BINS; ++j) acc[j] = 0;
        for (u32 i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
            K key;
            if (!key_of(i, x[i], key) || key < prefix) continue;
            const int d = digit_above(key, prefix, shift);
#pragma unroll
            for (int j = 0; j < SEARCH_BINS; ++j) acc[j] += j <= d ? 1u : 0u;
        }
        block_bins(acc, red, bins);
        int best = 0;
        for (int j = 1; j < SEARCH_BINS; ++j)
            if (bins[j] >= need) best = j;
        prefix |= (K)best << shift;
    }
    return prefix;
}

// The largest 32-bit key t whose elements (key_of true, key >= t) weigh at least top_p of all
// elements' weight (and more than 0). The first pass's bin 0 (t >= 0: every element) is the
// total. Per-thread f32 sums of non-negative weights over nested sets, reduced in one fixed
// tree, keep bins[j] non-increasing in j.
template <typename KeyOf, typename WeightOf>
__device__ u32 search_mass(const float* x, u32 vocab, float top_p, KeyOf key_of, WeightOf weight_of, float* red,
                           float* bins) {
    u32 prefix = 0;
    float target = 0.f;
    for (int shift = 28; shift >= 0; shift -= 4) {
        float acc[SEARCH_BINS];
#pragma unroll
        for (int j = 0; j < SEARCH_BINS; ++j) acc[j] = 0.f;
        for (u32 i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
            const float l = x[i];
            u32 key;
            if (!key_of(l, key) || key < prefix) continue;
            const float w = weight_of(l);
            const int d = digit_above(key, prefix, shift);
#pragma unroll
            for (int j = 0; j < SEARCH_BINS; ++j) acc[j] += j <= d ? w : 0.f;
        }
        block_bins(acc, red, bins);
        if (shift == 28) target = top_p * bins[0];
        int best = 0;
        for (int j = 1; j < SEARCH_BINS; ++j)
            if (bins[j] >= target && bins[j] > 0.f) best = j;
        prefix |= (u32)best << shift;
    }
    return prefix;
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

// logits [n_rows, vocab] (adjusted in place); params [n_rows]; penalty entries (token, count)
// and bias entries (token, value) in CSR form: row r owns entries offsets[r]..offsets[r + 1]
// of arrays pen_len / bias_len long. Outputs per row: token, its logprob, top-N ids and
// logprobs ([n_rows, max_top]), N, flags. Launched with n_rows CTAs of SAMPLE_THREADS.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(float* __restrict__ logits, u32 vocab, const SampleParams* __restrict__ params,
                const u32* __restrict__ pen_offsets, const u32* __restrict__ pen_tokens,
                const u32* __restrict__ pen_counts, u32 pen_len, const u32* __restrict__ bias_offsets,
                const u32* __restrict__ bias_tokens, const float* __restrict__ bias_values, u32 bias_len,
                u32* __restrict__ out_token, float* __restrict__ out_logprob, u32* __restrict__ out_top_ids,
                float* __restrict__ out_top_logprobs, u32* __restrict__ out_n_top, u32* __restrict__ out_flags,
                u32 max_top) {
    __shared__ u32 s_cnt_red[SAMPLE_WARPS * SEARCH_BINS], s_cnt_bins[SEARCH_BINS];
    __shared__ float s_mass_red[SAMPLE_WARPS * SEARCH_BINS], s_mass_bins[SEARCH_BINS];
    __shared__ RowStats s_stats[SAMPLE_WARPS];
    __shared__ double s_score[SAMPLE_WARPS];
    __shared__ u32 s_pick[SAMPLE_WARPS];
    __shared__ u64 s_top[SAMPLE_MAX_TOP];
    __shared__ u32 s_n_top, s_flags;

    const u32 row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const SampleParams p = params[row];
    float* x = logits + (u64)row * vocab;

    if (tid == 0) {
        s_flags = 0;
        s_n_top = 0;
    }
    __syncthreads();

    // 1. Bias: one entry per token, so the adds do not collide (atomic all the same: a
    // duplicate adds twice rather than losing one).
    {
        const u32 b0 = bias_offsets[row], b1 = bias_offsets[row + 1];
        if (b0 <= b1 && b1 <= bias_len) {
            for (u32 e = b0 + tid; e < b1; e += SAMPLE_THREADS) {
                const u32 t = bias_tokens[e];
                if (t < vocab)
                    atomicAdd(&x[t], bias_values[e]);
                else
                    atomicOr(&s_flags, FLAG_BAD_ENTRY);
            }
        } else if (tid == 0) {
            atomicOr(&s_flags, FLAG_BAD_ENTRY);
        }
    }
    __syncthreads();

    // 2. Penalties, one entry per distinct token (its count > 0), as the CPU computes them.
    const bool penalise = p.repetition_penalty != 1.f || p.presence_penalty != 0.f || p.frequency_penalty != 0.f;
    if (penalise) {
        const u32 e0 = pen_offsets[row], e1 = pen_offsets[row + 1];
        if (e0 <= e1 && e1 <= pen_len) {
            for (u32 e = e0 + tid; e < e1; e += SAMPLE_THREADS) {
                const u32 t = pen_tokens[e], c = pen_counts[e];
                if (t >= vocab) {
                    atomicOr(&s_flags, FLAG_BAD_ENTRY);
                    continue;
                }
                if (c == 0) continue;
                float l = x[t];
                l = l > 0.f ? __fdiv_rn(l, p.repetition_penalty) : __fmul_rn(l, p.repetition_penalty);
                l = __fsub_rn(l, __fadd_rn(__fmul_rn((float)c, p.frequency_penalty), p.presence_penalty));
                x[t] = l;
            }
        } else if (tid == 0) {
            atomicOr(&s_flags, FLAG_BAD_ENTRY);
        }
    }
    __syncthreads();

    // 3. Max, its first index, sum of exp(l - max), finite count; NaN / +inf flagged.
    RowStats st = {-F32_INF, 0.f, NO_TOKEN, 0u};
    bool bad = false;
    for (u32 i = tid; i < vocab; i += SAMPLE_THREADS) {
        const float l = x[i];
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
    if (bad) atomicOr(&s_flags, FLAG_BAD_LOGIT);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        RowStats other;
        other.m = __shfl_xor_sync(0xffffffffu, st.m, o);
        other.s = __shfl_xor_sync(0xffffffffu, st.s, o);
        other.arg = __shfl_xor_sync(0xffffffffu, st.arg, o);
        other.n_finite = __shfl_xor_sync(0xffffffffu, st.n_finite, o);
        st = combine_stats(st, other);
    }
    if (lane == 0) s_stats[warp] = st;
    __syncthreads();
    st = s_stats[0];
    for (int w = 1; w < SAMPLE_WARPS; ++w) st = combine_stats(st, s_stats[w]);
    const float max = st.m, log_sum = logf(st.s);
    const bool usable = max > -F32_INF && max < F32_INF;
    // The CPU argmax of an all -inf row is 0.
    u32 token = st.arg == NO_TOKEN ? 0u : st.arg;

    // 4. Temperature, truncation, draw.
    if (!(p.temperature < GREEDY_TEMPERATURE) && usable) {
        const float inv_t = 1.f / p.temperature;
        u32 key_k = 0;
        if (p.top_k > 0 && p.top_k < st.n_finite) {
            key_k = search_count<u32>(
                x, vocab, 32, p.top_k,
                [](u32, float l, u32& key) {
                    key = order_key(l);
                    return l > -F32_INF;
                },
                s_cnt_red, s_cnt_bins);
        }
        u32 key_p = 0;
        if (p.top_p < 1.f) {
            key_p = search_mass(
                x, vocab, p.top_p,
                [key_k](float l, u32& key) {
                    key = order_key(l);
                    return l > -F32_INF && key >= key_k;
                },
                [max, inv_t](float l) { return expf(__fmul_rn(l - max, inv_t)); }, s_mass_red, s_mass_bins);
        }
        const u32 key_min = key_k > key_p ? key_k : key_p;

        double best = -F64_INF;
        u32 pick = NO_TOKEN;
        for (u32 i = tid; i < vocab; i += SAMPLE_THREADS) {
            const float l = x[i];
            if (!(l > -F32_INF) || order_key(l) < key_min) continue;
            const float z = __fmul_rn(l - max, inv_t);
            if (p.min_p > 0.f && !(expf(z) >= p.min_p)) continue;
            const double score = (double)z + gumbel_noise(p.seed, p.draw, i);
            if (score > best) {  // strict: the lower index wins a tie within the thread
                best = score;
                pick = i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const double ob = __shfl_xor_sync(0xffffffffu, best, o);
            const u32 oi = __shfl_xor_sync(0xffffffffu, pick, o);
            if (ob > best || (ob == best && oi < pick)) {
                best = ob;
                pick = oi;
            }
        }
        if (lane == 0) {
            s_score[warp] = best;
            s_pick[warp] = pick;
        }
        __syncthreads();
        best = s_score[0];
        pick = s_pick[0];
        for (int w = 1; w < SAMPLE_WARPS; ++w) {
            const double ob = s_score[w];
            const u32 oi = s_pick[w];
            if (ob > best || (ob == best && oi < pick)) {
                best = ob;
                pick = oi;
            }
        }
        // Nothing kept only for out-of-range parameters (min_p > 1, NaN temperature): greedy.
        if (pick != NO_TOKEN) token = pick;
    }

    // 5. Top-N logprobs.
    u32 n_top = p.n_logprobs < max_top ? p.n_logprobs : max_top;
    if (n_top > SAMPLE_MAX_TOP) n_top = SAMPLE_MAX_TOP;
    if (n_top > vocab) n_top = vocab;
    if (n_top > 0) {
        const u64 cut = search_count<u64>(
            x, vocab, 32 + SAMPLE_ID_BITS, n_top,
            [](u32 i, float l, u64& key) {
                key = rank_key(i, l);
                return true;
            },
            s_cnt_red, s_cnt_bins);
        for (u32 i = tid; i < vocab; i += SAMPLE_THREADS) {
            const u64 key = rank_key(i, x[i]);
            if (key >= cut) {
                const u32 slot = atomicAdd(&s_n_top, 1u);
                if (slot < SAMPLE_MAX_TOP) s_top[slot] = key;
            }
        }
        __syncthreads();
        // Exactly n_top keys reach the cut (they are unique); min() only guards the buffers.
        const u32 got = s_n_top < n_top ? s_n_top : n_top;
        if (tid < got) {
            const u64 key = s_top[tid];
            u32 rank = 0;
            for (u32 j = 0; j < got; ++j) rank += s_top[j] > key ? 1u : 0u;
            const u32 id = SAMPLE_ID_MASK - (u32)(key & SAMPLE_ID_MASK);
            const u64 o = (u64)row * max_top + rank;
            out_top_ids[o] = id;
            out_top_logprobs[o] = (x[id] - max) - log_sum;
        }
        n_top = got;
    }

    if (tid == 0) {
        out_token[row] = token;
        out_logprob[row] = (x[token] - max) - log_sum;
        out_n_top[row] = n_top;
        out_flags[row] = s_flags | (max > -F32_INF ? 0u : FLAG_ALL_BANNED);
    }
}
