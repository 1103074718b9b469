// Sampling of the next token from f32 logits [n_rows, vocab]: one CTA of SAMPLE_THREADS per row.
// When the host launches the split path too (skip_split), rows that need no truncation, no
// logprobs and no entries (`split_row`, sampling_shared.cuh) are left to sampling_split.cu,
// which spreads each row over many CTAs.
// Semantics are the CPU sampler's (worker/src/sampling.rs), in its order:
//   1. logit bias added (the row's bias entries; tokens distinct);
//   2. repetition, then presence and frequency penalties on the row's (token, count) entries:
//      one per distinct token of the sequence (prompt and output), count = 1 + its occurrences
//      in the output; repetition applies to every entry, presence and frequency to the output
//      occurrences (vLLM's rule); the CPU's exact f32 operations (no fused multiply-add), only
//      when a penalty is on;
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
// Candidate path. The kept set and the top-N are nearly always among the row's few hundred
// largest logits, so after the statistics pass (which also builds a 4096-bin histogram of the
// keys' top 12 bits) the kernel looks for a key t with need <= count(finite, key >= t) <=
// CAND_CAP, need = max(top_k, N) (or CAND_SOFT when only top-p / min-p truncate): the
// histogram's crossing bin, refined by at most two more histogram passes (12 then 8 bits) inside
// that bin. Those candidates (every token with key >= t, ties included) are compacted into
// shared memory as rank keys, bitonic-sorted, and top-k / top-p / min-p / Gumbel / top-N run
// over them with the same rules. The result is the full path's whenever the candidates provably
// hold the kept set: always with top-k on; otherwise when they are all the finite logits, or hold
// at least top_p of the row's weight, or the weight at t is below min_p. Else (top_k > CAND_CAP,
// more than CAND_CAP ties, NaN / +inf logits, or a proof that fails) the full-row path runs.
// Masses summed in another order differ from the full path's in the last f32 bits only.
//
// All block reductions have a fixed shape and order, so every thread sees identical values
// (the branches around __syncthreads are uniform) and results do not vary between runs.

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / WARP_SIZE)
#define SEARCH_BINS 16
#define CAND_CAP 2048
#define CAND_SOFT 1024
#define HIST_BINS (4 * SAMPLE_THREADS)

// Sums each of the 16 per-thread bins over the block into `out` (shared [16]); `red` is shared
// [SAMPLE_WARPS * 16]. Ends with a barrier, so every thread can read `out`; the next call
// writes `red`/`out` only after its first barrier, by which time all reads of this one are done.
template <typename A>
__device__ __forceinline__ void block_bins(A (&acc)[SEARCH_BINS], A* red, A* out) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
#pragma unroll
    for (int j = 0; j < SEARCH_BINS; ++j) {
        A v = acc[j];
#pragma unroll
        for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
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

// The float whose order_key is `key` (order_key is a bijection).
__device__ __forceinline__ float key_float(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Calls f(i, x[i]) for every i < vocab this thread owns, in increasing i: 16-byte loads, two
// in flight per thread, when x is 4-byte aligned (a scalar head reaches 16-byte alignment).
template <typename F>
__device__ __forceinline__ void for_row(const float* x, u32 vocab, F f) {
    const u32 tid = threadIdx.x;
    const size_t addr = (size_t)x;
    if (addr & 3u) {
        for (u32 i = tid; i < vocab; i += SAMPLE_THREADS) f(i, x[i]);
        return;
    }
    u32 head = (u32)(((16u - (addr & 15u)) & 15u) >> 2);
    if (head > vocab) head = vocab;
    if (tid < head) f(tid, x[tid]);
    const u32 n4 = (vocab - head) >> 2;
    const float4* x4 = reinterpret_cast<const float4*>(x + head);
    u32 c = tid;
    for (; c + SAMPLE_THREADS < n4; c += 2 * SAMPLE_THREADS) {
        const float4 a = x4[c], b = x4[c + SAMPLE_THREADS];
        const u32 i = head + 4 * c, k = head + 4 * (c + SAMPLE_THREADS);
        f(i, a.x);
        f(i + 1, a.y);
        f(i + 2, a.z);
        f(i + 3, a.w);
        f(k, b.x);
        f(k + 1, b.y);
        f(k + 2, b.z);
        f(k + 3, b.w);
    }
    if (c < n4) {
        const float4 a = x4[c];
        const u32 i = head + 4 * c;
        f(i, a.x);
        f(i + 1, a.y);
        f(i + 2, a.z);
        f(i + 3, a.w);
    }
    const u32 tail = head + 4 * n4 + tid;  // fewer than 4 elements remain
    if (tail < vocab) f(tail, x[tail]);
}

// Exclusive prefix sum of v over threads in id order; `total` gets the block's sum (equal bits
// in every thread). s_warp: shared [SAMPLE_WARPS]. Begins and ends with a barrier's worth of
// ordering: callable back to back.
template <typename A>
__device__ __forceinline__ A block_scan_excl(A v, A* s_warp, A& total) {
    const u32 lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    A x = v;
#pragma unroll
    for (int o = 1; o < WARP_SIZE; o <<= 1) {
        const A y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= (u32)o) x += y;
    }
    A ex = __shfl_up_sync(0xffffffffu, x, 1);
    if (lane == 0) ex = 0;
    if (lane == WARP_SIZE - 1) s_warp[warp] = x;
    __syncthreads();
    A off = 0, tot = 0;
    for (u32 w = 0; w < SAMPLE_WARPS; ++w) {
        if (w == warp) off = tot;
        tot += s_warp[w];
    }
    total = tot;
    __syncthreads();
    return off + ex;
}

// hist [HIST_BINS] counts, bins ordered like keys. Finds the bin b with (count in bins > b) <
// need <= (count in bins >= b) and writes res = {b, count above b, count through b}; needs
// 1 <= need <= the total. Ends with a barrier.
__device__ void find_bin(const u32* hist, u32 need, u32* s_warp, u32* res) {
    const int top = HIST_BINS - 1 - 4 * (int)threadIdx.x;  // this thread's bins: top .. top - 3
    u32 c[4], sum = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        c[j] = hist[top - j];
        sum += c[j];
    }
    u32 total;
    u32 above = block_scan_excl<u32>(sum, s_warp, total);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (above < need && above + c[j] >= need) {
            res[0] = (u32)(top - j);
            res[1] = above;
            res[2] = above + c[j];
        }
        above += c[j];
    }
    __syncthreads();
}

// Histogram of (key >> bin_shift) & bin_mask over the finite logits with key >> match_shift
// == match (match_shift < 32). hist must be zeroed.
__device__ void hist_pass(const float* x, u32 vocab, u32 match_shift, u32 match, u32 bin_shift, u32 bin_mask,
                          u32* hist) {
    for_row(x, vocab, [&](u32, float l) {
        const u32 key = order_key(l);
        if (l > -F32_INF && (key >> match_shift) == match) atomicAdd(&hist[(key >> bin_shift) & bin_mask], 1u);
    });
}

// Sorts s[0..n2) descending (n2 a power of two, <= 2 * SAMPLE_THREADS): bitonic network.
__device__ void sort_desc(u64* s, u32 n2) {
    for (u32 k = 2; k <= n2; k <<= 1) {
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            for (u32 i = threadIdx.x; i < n2; i += SAMPLE_THREADS) {
                const u32 ixj = i ^ j;
                if (ixj > i) {
                    const u64 a = s[i], b = s[ixj];
                    if ((i & k) == 0 ? a < b : a > b) {
                        s[i] = b;
                        s[ixj] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// Sum over the row's finite logits of exp((l - max) * inv_t), equal bits in every thread.
__device__ float row_weight(const float* x, u32 vocab, float max, float inv_t, float* s_warp) {
    float s = 0.f;
    for_row(x, vocab, [&](u32, float l) {
        if (l > -F32_INF) s += expf(__fmul_rn(l - max, inv_t));
    });
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x % WARP_SIZE == 0) s_warp[threadIdx.x / WARP_SIZE] = s;
    __syncthreads();
    float t = 0.f;
    for (int w = 0; w < SAMPLE_WARPS; ++w) t += s_warp[w];
    __syncthreads();
    return t;
}

// The block's best (score, id): higher score, then lower id. Ends with a barrier.
__device__ u32 block_argmax(double best, u32 pick, double* s_score, u32* s_pick) {
    const u32 lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
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
    __syncthreads();
    return pick;
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
                u32 max_top, u32 skip_split) {
    __shared__ u32 s_cnt_red[SAMPLE_WARPS * SEARCH_BINS], s_cnt_bins[SEARCH_BINS];
    __shared__ float s_mass_red[SAMPLE_WARPS * SEARCH_BINS], s_mass_bins[SEARCH_BINS];
    __shared__ RowStats s_stats[SAMPLE_WARPS];
    __shared__ double s_score[SAMPLE_WARPS];
    __shared__ u32 s_pick[SAMPLE_WARPS];
    __shared__ u64 s_top[SAMPLE_MAX_TOP];
    __shared__ u32 s_n_top, s_flags;
    // Candidate path: the key histogram (later the candidates' cumulative weights), the
    // candidates' rank keys, scan scratch, find_bin results, counters.
    __shared__ __align__(16) u32 s_hist[HIST_BINS];
    __shared__ u64 s_cand[CAND_CAP];
    __shared__ u32 s_scan_u[SAMPLE_WARPS];
    __shared__ float s_scan_f[SAMPLE_WARPS];
    __shared__ u32 s_res[3], s_nc, s_ek, s_jp;

    const u32 row = blockIdx.x, tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const SampleParams p = params[row];
    // With skip_split, untruncated rows without logprobs or entries are sampling_split.cu's
    // (uniform per CTA).
    if (skip_split && split_row(p, vocab, pen_offsets, bias_offsets, bias_len, row)) return;
    float* x = logits + (u64)row * vocab;

    u32 n_top = p.n_logprobs < max_top ? p.n_logprobs : max_top;
    if (n_top > SAMPLE_MAX_TOP) n_top = SAMPLE_MAX_TOP;
    if (n_top > vocab) n_top = vocab;
    const bool greedy = p.temperature < GREEDY_TEMPERATURE;
    // Whether the candidate path may run (then the statistics pass builds its histogram).
    const bool hist_on =
        (!greedy && ((p.top_k > 0 && p.top_k <= CAND_CAP) || p.top_p < 1.f || p.min_p > 0.f)) || n_top > 0;

    if (tid == 0) {
        s_flags = 0;
        s_n_top = 0;
        s_nc = 0;
        s_jp = NO_TOKEN;
    }
    if (hist_on)
        for (u32 j = tid; j < HIST_BINS; j += SAMPLE_THREADS) s_hist[j] = 0;
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

    // 2. Penalties, one entry per distinct token (count = 1 + its output occurrences; 0: no
    // entry), as the CPU computes them.
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
                const u32 g = c - 1;  // occurrences in the output
                float l = x[t];
                // Past f32's range (a tiny penalty) held at the largest finite value, as the CPU.
                l = l > 0.f ? fminf(__fdiv_rn(l, p.repetition_penalty), __int_as_float(0x7f7fffff)) : __fmul_rn(l, p.repetition_penalty);
                l = __fsub_rn(l, __fadd_rn(__fmul_rn((float)g, p.frequency_penalty), g > 0 ? p.presence_penalty : 0.f));
                x[t] = l;
            }
        } else if (tid == 0) {
            atomicOr(&s_flags, FLAG_BAD_ENTRY);
        }
    }
    __syncthreads();

    // 3. Max, its first index, sum of exp(l - max), finite count; NaN / +inf flagged; the
    // histogram of the finite keys' top 12 bits. Each thread visits its indices in order.
    RowStats st = {-F32_INF, 0.f, NO_TOKEN, 0u};
    bool bad = false;
    for_row(x, vocab, [&](u32 i, float l) {
        if (l > st.m) {
            st.s = st.s * expf(st.m - l) + 1.f;
            st.m = l;
            st.arg = i;
        } else if (l > -F32_INF) {
            st.s += expf(l - st.m);
        }
        st.n_finite += l > -F32_INF ? 1u : 0u;
        bad |= !(l < F32_INF);
        if (hist_on && l > -F32_INF) atomicAdd(&s_hist[order_key(l) >> 20], 1u);
    });
    if (bad) atomicOr(&s_flags, FLAG_BAD_LOGIT);
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
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
    const u32 n_finite = st.n_finite;
    const bool usable = max > -F32_INF && max < F32_INF;
    const bool clean = usable && !(s_flags & FLAG_BAD_LOGIT);
    // The CPU argmax of an all -inf row is 0.
    u32 token = st.arg == NO_TOKEN ? 0u : st.arg;
    const bool sampling = !greedy && usable;
    const bool topk_on = p.top_k > 0 && p.top_k < n_finite;
    const float inv_t = 1.f / p.temperature;

    // 3b. Candidates: need of them at least, at most CAND_CAP, all with key >= cand_t.
    u32 need = 0;
    bool samp_cand = false, top_cand = false;
    if (hist_on && clean) {
        if (sampling) {
            if (topk_on) {
                if (p.top_k <= CAND_CAP) need = p.top_k;
            } else if (p.top_p < 1.f || p.min_p > 0.f) {
                need = n_finite < CAND_SOFT ? n_finite : CAND_SOFT;
            }
            samp_cand = need > 0;
        }
        top_cand = n_top > 0 && n_top <= n_finite;
        if (top_cand && n_top > need) need = n_top;
    }
    bool cand = false;
    u32 nc = 0, cand_t = 0;
    if (need > 0) {
        find_bin(s_hist, need, s_scan_u, s_res);
        const u32 b1 = s_res[0], a1 = s_res[1], c1 = s_res[2];
        cand = true;
        if (c1 <= CAND_CAP) {
            cand_t = b1 << 20;
        } else {
            for (u32 j = tid; j < HIST_BINS; j += SAMPLE_THREADS) s_hist[j] = 0;
            __syncthreads();
            hist_pass(x, vocab, 20, b1, 8, 0xfffu, s_hist);
            __syncthreads();
            find_bin(s_hist, need - a1, s_scan_u, s_res);
            const u32 b2 = s_res[0], a2 = s_res[1], c2 = s_res[2];
            if (a1 + c2 <= CAND_CAP) {
                cand_t = (b1 << 20) | (b2 << 8);
            } else {
                for (u32 j = tid; j < HIST_BINS; j += SAMPLE_THREADS) s_hist[j] = 0;
                __syncthreads();
                hist_pass(x, vocab, 8, (b1 << 12) | b2, 0, 0xffu, s_hist);
                __syncthreads();
                find_bin(s_hist, need - a1 - a2, s_scan_u, s_res);
                const u32 b3 = s_res[0], c3 = s_res[2];
                cand_t = (b1 << 20) | (b2 << 8) | b3;
                cand = a1 + a2 + c3 <= CAND_CAP;  // else more than CAND_CAP ties
            }
        }
    }
    if (cand) {
        for_row(x, vocab, [&](u32 i, float l) {
            if (l > -F32_INF && order_key(l) >= cand_t) {
                const u32 slot = atomicAdd(&s_nc, 1u);
                if (slot < CAND_CAP) s_cand[slot] = rank_key(i, l);
            }
        });
        __syncthreads();
        nc = s_nc < CAND_CAP ? s_nc : CAND_CAP;  // exact counts: never capped
        u32 n2 = 1;
        while (n2 < nc) n2 <<= 1;
        for (u32 j = nc + tid; j < n2; j += SAMPLE_THREADS) s_cand[j] = 0;  // below every real key
        __syncthreads();
        sort_desc(s_cand, n2);
    }

    // 4. Temperature, truncation, draw.
    bool done = false;
    if (sampling && samp_cand && cand) {
        // 4a. Over the sorted candidates. Top-k: the first e_k (the k-th key and its ties).
        u32 key_k = 0, e_k = nc;
        if (topk_on) {
            key_k = (u32)(s_cand[p.top_k - 1] >> SAMPLE_ID_BITS);
            for (u32 j = tid; j < nc; j += SAMPLE_THREADS) {
                if ((u32)(s_cand[j] >> SAMPLE_ID_BITS) >= key_k &&
                    (j + 1 == nc || (u32)(s_cand[j + 1] >> SAMPLE_ID_BITS) < key_k))
                    s_ek = j + 1;
            }
            __syncthreads();
            e_k = s_ek;
        }
        const bool complete = nc == n_finite;
        bool valid = topk_on || complete;
        u32 key_p = 0;
        if (p.top_p < 1.f) {
            // Cumulative weights in rank order (thread t: candidates 2t, 2t + 1); the cut is
            // the first candidate reaching top_p of the total (top-k set, or the whole row).
            float total = 0.f;
            if (!valid) total = row_weight(x, vocab, max, inv_t, s_scan_f);
            const u32 j0 = 2 * tid, j1 = j0 + 1;
            const float w0 = j0 < e_k ? expf(__fmul_rn(key_float((u32)(s_cand[j0] >> SAMPLE_ID_BITS)) - max, inv_t)) : 0.f;
            const float w1 = j1 < e_k ? expf(__fmul_rn(key_float((u32)(s_cand[j1] >> SAMPLE_ID_BITS)) - max, inv_t)) : 0.f;
            float tot_c;
            const float ex = block_scan_excl<float>(w0 + w1, s_scan_f, tot_c);
            const float p0 = ex + w0, p1 = p0 + w1;
            float* s_cum = reinterpret_cast<float*>(s_hist);
            s_cum[j0] = p0;
            s_cum[j1] = p1;
            __syncthreads();
            if (valid) total = s_cum[e_k - 1];
            const float target = p.top_p * total;
            if (j0 < e_k && p0 >= target && p0 > 0.f) atomicMin(&s_jp, j0);
            if (j1 < e_k && p1 >= target && p1 > 0.f) atomicMin(&s_jp, j1);
            __syncthreads();
            const u32 jp = s_jp;
            // Not reached inside the candidates: top-p keeps all of them (and more).
            if (jp != NO_TOKEN) {
                key_p = (u32)(s_cand[jp] >> SAMPLE_ID_BITS);
                valid = true;
            }
        }
        // Min-p alone proves it when every token outside (key < cand_t) weighs less than min_p.
        if (!valid && p.min_p > 0.f) valid = expf(__fmul_rn(key_float(cand_t) - max, inv_t)) < p.min_p;
        if (valid) {
            const u32 key_min = key_k > key_p ? key_k : key_p;
            double best = -F64_INF;
            u32 pick = NO_TOKEN;
            for (u32 j = tid; j < nc; j += SAMPLE_THREADS) {
                const u64 c = s_cand[j];
                const u32 key = (u32)(c >> SAMPLE_ID_BITS);
                if (key < key_min) continue;
                const u32 id = SAMPLE_ID_MASK - (u32)(c & SAMPLE_ID_MASK);
                const float z = __fmul_rn(key_float(key) - max, inv_t);
                if (p.min_p > 0.f && !(expf(z) >= p.min_p)) continue;
                const double score = (double)z + gumbel_noise(p.seed, p.draw, id);
                if (score > best || (score == best && id < pick)) {
                    best = score;
                    pick = id;
                }
            }
            pick = block_argmax(best, pick, s_score, s_pick);
            // Nothing kept only for out-of-range parameters (min_p > 1, NaN temperature): greedy.
            if (pick != NO_TOKEN) token = pick;
            done = true;
        }
    }
    if (sampling && !done) {
        // 4b. Over the whole row.
        u32 key_k = 0;
        if (topk_on) {
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
        pick = block_argmax(best, pick, s_score, s_pick);
        // Nothing kept only for out-of-range parameters (min_p > 1, NaN temperature): greedy.
        if (pick != NO_TOKEN) token = pick;
    }

    // 5. Top-N logprobs: the first N sorted candidates, or a rank-key search over the row.
    if (n_top > 0 && cand && top_cand) {
        if (tid < n_top) {
            const u64 key = s_cand[tid];
            const u32 id = SAMPLE_ID_MASK - (u32)(key & SAMPLE_ID_MASK);
            const u64 o = (u64)row * max_top + tid;
            out_top_ids[o] = id;
            out_top_logprobs[o] = (x[id] - max) - log_sum;
        }
    } else if (n_top > 0) {
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

// The sampled rows' results in one array, so the host reads them back at once (six small
// copies cost ~3 us each on an H200, one after another); `out` is page-locked host memory
// mapped for the device where the driver allows (no copy at all), else a device buffer
// copied back in one copy: out = [token | logprob bits | n_top
// | flags] of n_rows each, then, with `with_top`, the rows' top ids and top logprob bits of
// n_rows x max_top each (without it, n_top is written as 0). Any grid of 1-D blocks.
extern "C" __global__ void pack_sampled(const u32* __restrict__ token, const float* __restrict__ logprob,
                                        const u32* __restrict__ n_top, const u32* __restrict__ flags,
                                        const u32* __restrict__ top_ids, const float* __restrict__ top_logprobs,
                                        u32 n_rows, u32 max_top, u32 with_top, u32* __restrict__ out) {
    const u64 n = n_rows, top = with_top ? n * max_top : 0, total = 4 * n + 2 * top;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u32 v;
        if (i < n) {
            v = token[i];
        } else if (i < 2 * n) {
            v = __float_as_uint(logprob[i - n]);
        } else if (i < 3 * n) {
            v = with_top ? n_top[i - 2 * n] : 0u;
        } else if (i < 4 * n) {
            v = flags[i - 3 * n];
        } else if (i < 4 * n + top) {
            v = top_ids[i - 4 * n];
        } else {
            v = __float_as_uint(top_logprobs[i - 4 * n - top]);
        }
        out[i] = v;
    }
}
