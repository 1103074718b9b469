// Paged attention on bf16 KV caches: the write of new K/V into the cache, decode attention
// (one query token per sequence, split-KV "flash-decoding" with a reduction kernel) and
// prefill attention (a causal chunk of queries per sequence, flash-attention tiling with an
// online softmax). Same semantics as the CPU reference, kernels/src/cpu/attention.rs.
//
// Cache, per layer: k_cache, v_cache [num_blocks, block_size, n_kv, HD] bf16. Position p of a
// sequence lives in block block_table[p / block_size], slot p % block_size; a slot id is
// block * block_size + slot. Query head h reads kv head h / group (GQA). Scores are
// scale * q.k, computed in the log2 domain (q pre-multiplied by scale * log2(e), exp2f) with
// f32 softmax and accumulation.
//
// Bad device-side indices never cause wild reads: a block id >= num_blocks, or a position
// past the block table, turns the affected query rows into NaN; a context of 0 (a padding
// row) gives zeros.

#define ATT_NEG_INF __int_as_float(0xff800000u)
#define ATT_NAN __int_as_float(0x7fc00000u)

// Offset (elements) of `pos`'s slot in the cache, or ~0 when the table does not map it to a
// valid block.
__device__ __forceinline__ u64 kv_slot_offset(const u32* __restrict__ table, u32 max_blocks, u32 pos, u32 block_size,
                                              u32 num_blocks, u64 slot_stride) {
    const u32 bi = pos / block_size;
    if (bi >= max_blocks) return ~0ull;
    const u32 blk = table[bi];
    if (blk >= num_blocks) return ~0ull;
    return ((u64)blk * block_size + (pos - bi * block_size)) * slot_stride;
}

// ------------------------------------------------------------------------- write_kv
// k, v: [n_tokens, row_vecs * 8] (all kv heads of a token); slots: [n_tokens]. A slot
// >= n_slots (u32 max marks padding tokens) is skipped. One block per token, 16-byte copies.

extern "C" __global__ void write_kv(bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, const bf16* __restrict__ k,
                                    const bf16* __restrict__ v, const u32* __restrict__ slots, u32 n_tokens,
                                    u32 row_vecs, u64 n_slots) {
    const u32 t = blockIdx.x;
    if (t >= n_tokens) return;
    const u32 slot = slots[t];
    if ((u64)slot >= n_slots) return;
    const uint4* ks = reinterpret_cast<const uint4*>(k) + (u64)t * row_vecs;
    const uint4* vs = reinterpret_cast<const uint4*>(v) + (u64)t * row_vecs;
    uint4* kd = reinterpret_cast<uint4*>(k_cache) + (u64)slot * row_vecs;
    uint4* vd = reinterpret_cast<uint4*>(v_cache) + (u64)slot * row_vecs;
    for (u32 i = threadIdx.x; i < row_vecs; i += blockDim.x) {
        kd[i] = ks[i];
        vd[i] = vs[i];
    }
}

// ------------------------------------------------------------------------- decode
// q, out: [num_seqs, n_heads, HD]; block_tables [num_seqs, max_blocks]; ctx_lens [num_seqs]
// (the query is the last position, ctx - 1, and attends to 0..ctx).
// Grid: (num_seqs, n_kv * hchunks, n_splits); 128 threads. A CTA serves the `gcount <= GM`
// query heads of one chunk of one kv head, so each K/V row is read from memory once for all
// of them, over the positions [split * split_len, ...) of one split (the last split runs to
// ctx). Lanes form groups of HD/8 lanes, one token per group, each lane owning 8 dims (one
// 16-byte load of K and of V); q.k is reduced across the group with shuffles. Every group
// keeps its own online softmax (m, l, acc) in registers; the CTA merges its groups through
// shared memory at the end. With one split the CTA writes `out`; otherwise (o / l, log2 of
// the softmax mass) go to part_o / part_lse for decode_reduce.

#define DEC_THREADS 128
// Slot markers for positions past the split's end and for positions the table does not
// map (the host keeps num_blocks * block_size below both).
#define SLOT_UNMAPPED 0xffffffffu
#define SLOT_PAST 0xfffffffeu

// slot[u] = cache slot (block * block_size + offset) of position p0 + u * NG, or a marker.
// u32, not an element offset: four fewer registers in the decode loop.
template <int U, int NG>
__device__ __forceinline__ void decode_slots(u32 (&slot)[U], u32 p0, u32 end, const u32* __restrict__ table,
                                             u32 max_blocks, u32 block_size, u32 num_blocks) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const u32 p = p0 + u * NG, bi = p / block_size;
        u32 s = SLOT_PAST;
        if (p < end) {
            const u32 blk = bi < max_blocks ? table[bi] : SLOT_UNMAPPED;
            s = blk < num_blocks ? blk * block_size + (p - bi * block_size) : SLOT_UNMAPPED;
        }
        slot[u] = s;
    }
}

template <int HD, int GM, int U>
__device__ __forceinline__ void decode_body(bf16* __restrict__ out, float* __restrict__ part_o,
                                            float* __restrict__ part_lse, const bf16* __restrict__ q,
                                            const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                                            const u32* __restrict__ block_tables, u32 max_blocks,
                                            const u32* __restrict__ ctx_lens, u32 num_blocks, u32 block_size,
                                            u32 n_heads, u32 n_kv, u32 group, u32 gt, u32 split_len, u32 n_splits,
                                            float scale_log2) {
    constexpr int LANES = HD / 8;            // lanes per token group
    constexpr int TPW = 32 / LANES;          // tokens per warp
    constexpr int NG = (DEC_THREADS / 32) * TPW;  // token groups per CTA
    __shared__ float sm_m[NG][GM];
    __shared__ float sm_l[NG][GM];
    __shared__ float sm_acc[NG][GM][HD];

    const u32 seq = blockIdx.x, split = blockIdx.z;
    const u32 hchunks = (group + gt - 1) / gt;
    const u32 kvh = blockIdx.y / hchunks, chunk = blockIdx.y % hchunks;
    const u32 g0 = chunk * gt;
    const u32 gcount = min(gt, group - g0);
    const u32 head0 = kvh * group + g0;
    const u32 ctx = ctx_lens[seq];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int li = lane % LANES, grp = warp * TPW + lane / LANES;

    if (ctx == 0) {  // a padding row: zeros, written once
        if (n_splits == 1 && split == 0)
            for (u32 i = threadIdx.x; i < gcount * HD; i += DEC_THREADS)
                out[((u64)seq * n_heads + head0 + i / HD) * HD + i % HD] = 0;
        return;
    }
    const u32 start = split * split_len;
    if (start >= ctx) return;  // decode_reduce reads only the splits that start before ctx
    const u32 end = split + 1 == n_splits ? ctx : min(ctx, start + split_len);

    float qr[GM][8];
#pragma unroll
    for (int g = 0; g < GM; ++g) {
        if ((u32)g < gcount) {
            const uint4 raw = *reinterpret_cast<const uint4*>(q + ((u64)seq * n_heads + head0 + g) * HD + li * 8);
            unpack8(raw, qr[g]);
#pragma unroll
            for (int e = 0; e < 8; ++e) qr[g][e] *= scale_log2;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) qr[g][e] = 0.f;
        }
    }
    float m[GM], l[GM], acc[GM][8];
#pragma unroll
    for (int g = 0; g < GM; ++g) {
        m[g] = ATT_NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
    }
    float poison = 0.f;  // NaN once a bad block id was met

    const u32* table = block_tables + (u64)seq * max_blocks;
    const u64 slot_stride = (u64)n_kv * HD;
    const bf16* kb = k_cache + (u64)kvh * HD + li * 8;
    const bf16* vb = v_cache + (u64)kvh * HD + li * 8;

    // Slot offsets of this group's positions, read from the block table one iteration
    // ahead: the table reads of step i+1 are in flight with the K/V reads of step i instead
    // of preceding them (a dependent load would double each step's latency).
    u32 slot[U];
    decode_slots<U, NG>(slot, start + grp, end, table, max_blocks, block_size, num_blocks);

    // Uniform trip count for the whole CTA (the shuffles need every lane of a warp).
    for (u32 base = start; base < end; base += NG * U) {
        uint4 kr[U], vr[U];
        bool valid[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            valid[u] = slot[u] < SLOT_PAST;
            if (slot[u] == SLOT_UNMAPPED) poison = ATT_NAN;
            kr[u] = make_uint4(0, 0, 0, 0);
            vr[u] = make_uint4(0, 0, 0, 0);
            if (valid[u]) {
                kr[u] = *reinterpret_cast<const uint4*>(kb + (u64)slot[u] * slot_stride);
                vr[u] = *reinterpret_cast<const uint4*>(vb + (u64)slot[u] * slot_stride);
            }
        }
        decode_slots<U, NG>(slot, base + NG * U + grp, end, table, max_blocks, block_size, num_blocks);
        float s[U][GM];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float kf[8];
            unpack8(kr[u], kf);
#pragma unroll
            for (int g = 0; g < GM; ++g) {
                float d = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) d = fmaf(qr[g][e], kf[e], d);
#pragma unroll
                for (int o = LANES / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                s[u][g] = valid[u] ? d : ATT_NEG_INF;
            }
        }
#pragma unroll
        for (int g = 0; g < GM; ++g) {
            float mn = m[g];
#pragma unroll
            for (int u = 0; u < U; ++u) mn = fmaxf(mn, s[u][g]);
            if (mn == ATT_NEG_INF) continue;  // no valid token for this group in this step
            const float alpha = exp2f(m[g] - mn);
            m[g] = mn;
            l[g] *= alpha;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const float p = exp2f(s[u][g] - mn);
                l[g] += p;
                float vf[8];
                unpack8(vr[u], vf);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
            }
        }
    }

    // Merge the NG groups of the CTA.
#pragma unroll
    for (int g = 0; g < GM; ++g) {
        if (li == 0) {
            sm_m[grp][g] = m[g];
            sm_l[grp][g] = l[g] + poison;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) sm_acc[grp][g][li * 8 + e] = acc[g][e] + poison;
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < gcount * HD; i += DEC_THREADS) {
        const u32 g = i / HD, d = i % HD;
        float mx = ATT_NEG_INF;
#pragma unroll
        for (int j = 0; j < NG; ++j) mx = fmaxf(mx, sm_m[j][g]);
        float lsum = 0.f, o = 0.f;
#pragma unroll
        for (int j = 0; j < NG; ++j) {
            // A group that saw no token has m = -inf, l = acc = 0: weight 0. mx is finite
            // because the split holds at least one position.
            const float w = sm_m[j][g] == ATT_NEG_INF ? 0.f : exp2f(sm_m[j][g] - mx);
            lsum = fmaf(w, sm_l[j][g], lsum);
            o = fmaf(w, sm_acc[j][g][d], o);
        }
        // All positions of the split unmapped: mx = -inf, lsum = 0; poison made sm_l NaN.
        const u32 head = head0 + g;
        if (n_splits == 1) {
            out[((u64)seq * n_heads + head) * HD + d] = f32_to_bf16(o / lsum);
        } else {
            const u64 row = ((u64)seq * n_heads + head) * n_splits + split;
            part_o[row * HD + d] = o / lsum;
            if (d == 0) part_lse[row] = mx + log2f(lsum);
        }
    }
}

// out[seq, head] = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max lse), over the splits
// that start before ctx. Grid (num_seqs, n_heads), HD threads.
extern "C" __global__ void decode_reduce(bf16* __restrict__ out, const float* __restrict__ part_o,
                                         const float* __restrict__ part_lse, const u32* __restrict__ ctx_lens,
                                         u32 n_heads, u32 head_dim, u32 split_len, u32 n_splits) {
    const u32 seq = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    if (d >= head_dim) return;
    const u32 ctx = ctx_lens[seq];
    const u64 row0 = ((u64)seq * n_heads + head) * n_splits;
    const u64 o_idx = ((u64)seq * n_heads + head) * head_dim + d;
    const u32 n_valid = min(n_splits, (ctx + split_len - 1) / split_len);
    if (n_valid == 0) {
        out[o_idx] = 0;
        return;
    }
    float mx = ATT_NEG_INF;
    for (u32 s = 0; s < n_valid; ++s) mx = fmaxf(mx, part_lse[row0 + s]);
    float wsum = 0.f, o = 0.f;
    for (u32 s = 0; s < n_valid; ++s) {
        const float w = exp2f(part_lse[row0 + s] - mx);
        wsum += w;
        o = fmaf(w, part_o[(row0 + s) * head_dim + d], o);
    }
    out[o_idx] = f32_to_bf16(o / wsum);
}

// Groups of up to 4 heads are capped at 128 registers: 4 CTAs (16 warps) per SM.
#define DECODE_KERNEL(HD, GM, U)                                                                                    \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS, GM <= 4 ? 4 : 2) paged_decode_hd##HD##_g##GM(         \
        bf16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_lse, const bf16* __restrict__ q, \
        const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache, const u32* __restrict__ block_tables,   \
        u32 max_blocks, const u32* __restrict__ ctx_lens, u32 num_blocks, u32 block_size, u32 n_heads, u32 n_kv,     \
        u32 group, u32 gt, u32 split_len, u32 n_splits, float scale_log2) {                                          \
        decode_body<HD, GM, U>(out, part_o, part_lse, q, k_cache, v_cache, block_tables, max_blocks, ctx_lens,      \
                               num_blocks, block_size, n_heads, n_kv, group, gt, split_len, n_splits, scale_log2);   \
    }

DECODE_KERNEL(64, 1, 4)
DECODE_KERNEL(64, 2, 4)
DECODE_KERNEL(64, 4, 4)
DECODE_KERNEL(64, 8, 2)
DECODE_KERNEL(128, 1, 4)
DECODE_KERNEL(128, 2, 4)
DECODE_KERNEL(128, 4, 4)
DECODE_KERNEL(128, 8, 2)

// ------------------------------------------------------------------------- prefill
// q, out: [total_tokens, n_heads, HD]; cu_q [num_seqs + 1]: sequence s owns query tokens
// cu_q[s]..cu_q[s+1] (a range past total_q is skipped), at positions first_pos.. with first_pos = ctx_lens[s] - n_q (its K/V
// already written); query i attends to positions 0..=first_pos + i.
// Grid: (q tiles, n_kv * hchunks, num_seqs), PF_THREADS threads; blocks stride over the
// sequence's q tiles, so the grid's x is only a hint. A CTA holds PF_R rows = (query token,
// head) pairs: bq = PF_R / gt tokens x the gt heads of one kv head chunk, so each K/V tile
// serves all of them. Per KV tile of PF_BK positions (f32 in shared memory): S = Q K^T with
// 4x4 register tiles, the online softmax per row (4 threads a row), O += P V with O in
// registers (4 rows x HD/16 dims per thread). CUDA cores, f32 throughout.
// Shared memory (dynamic): Qs[PF_R][HD+4], Ks[PF_BK][HD+4], Vs[PF_BK][HD+4],
// S[PF_R][PF_BK+4], row m, l, alpha [PF_R].

#define PF_R 64
#define PF_BK 64
#define PF_THREADS 256

template <int HD>
__device__ __forceinline__ void prefill_body(bf16* __restrict__ out, const bf16* __restrict__ q,
                                             const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                                             const u32* __restrict__ block_tables, u32 max_blocks,
                                             const u32* __restrict__ ctx_lens, const u32* __restrict__ cu_q,
                                             u32 total_q, u32 num_blocks, u32 block_size, u32 n_heads, u32 n_kv, u32 group, u32 gt,
                                             float scale_log2) {
    constexpr int LD = HD + 4;     // padded row of Qs/Ks/Vs (keeps 16-byte alignment)
    constexpr int LS = PF_BK + 4;  // padded row of S
    constexpr int DCH = HD / 64;   // float4 chunks of O per thread and row
    extern __shared__ float4 pf_smem4[];
    float* smem = reinterpret_cast<float*>(pf_smem4);
    float* Qs = smem;
    float* Ks = Qs + PF_R * LD;
    float* Vs = Ks + PF_BK * LD;
    float* S = Vs + PF_BK * LD;
    float* row_m = S + PF_R * LS;
    float* row_l = row_m + PF_R;
    float* row_a = row_l + PF_R;

    const u32 seq = blockIdx.z;
    const u32 hchunks = (group + gt - 1) / gt;
    const u32 kvh = blockIdx.y / hchunks, chunk = blockIdx.y % hchunks;
    const u32 g0 = chunk * gt;
    const u32 gcount = min(gt, group - g0);
    const u32 head0 = kvh * group + g0;
    const u32 bq = PF_R / gt;
    const u32 q0 = cu_q[seq], q_end = cu_q[seq + 1], ctx = ctx_lens[seq];
    if (q_end < q0 || q_end > total_q) return;  // offsets outside q: nothing to read or write
    const u32 nq = q_end - q0;
    const int tid = threadIdx.x;
    const int tr = tid >> 4, tc = tid & 15;  // row group and key/dim group of the register tiles
    const u32* table = block_tables + (u64)seq * max_blocks;
    const u64 slot_stride = (u64)n_kv * HD;

    for (u32 i0 = blockIdx.x * bq; i0 < nq; i0 += gridDim.x * bq) {
        const bool bad_seq = nq > ctx;  // the chunk cannot start before position 0
        const u32 first_pos = bad_seq ? 0 : ctx - nq;
        const u32 i_end = min(nq, i0 + bq);
        const u32 kv_end = bad_seq ? 0 : first_pos + i_end;  // the tile's last query sees kv_end - 1

        __syncthreads();  // the previous tile's readers of row_l / Qs are done
        for (int idx = tid; idx < PF_R * (HD / 8); idx += PF_THREADS) {
            const int r = idx / (HD / 8), c = idx % (HD / 8);
            const u32 i = i0 + r / gt, g = r % gt;
            float f[8];
            if (r / gt < bq && i < i_end && g < gcount) {
                unpack8(*reinterpret_cast<const uint4*>(q + ((u64)(q0 + i) * n_heads + head0 + g) * HD + c * 8), f);
#pragma unroll
                for (int e = 0; e < 8; ++e) f[e] *= scale_log2;
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) f[e] = 0.f;
            }
            float4* dst = reinterpret_cast<float4*>(Qs + r * LD + c * 8);
            dst[0] = make_float4(f[0], f[1], f[2], f[3]);
            dst[1] = make_float4(f[4], f[5], f[6], f[7]);
        }
        for (int r = tid; r < PF_R; r += PF_THREADS) {
            row_m[r] = ATT_NEG_INF;
            row_l[r] = bad_seq ? ATT_NAN : 0.f;
        }
        // Query position of each row this thread owns in the S tile (rows tr + 16a).
        u32 qpos[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) qpos[a] = first_pos + i0 + (u32)(tr + 16 * a) / gt;
        float o[4][DCH * 4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int e = 0; e < DCH * 4; ++e) o[a][e] = 0.f;

        for (u32 kv0 = 0; kv0 < kv_end; kv0 += PF_BK) {
            __syncthreads();  // Ks/Vs/S of the previous KV tile are no longer read
            for (int idx = tid; idx < PF_BK * (HD / 8); idx += PF_THREADS) {
                const int j = idx / (HD / 8), c = idx % (HD / 8);
                const u32 p = kv0 + j;
                float kf[8], vf[8];
                if (p < kv_end) {
                    const u64 off = kv_slot_offset(table, max_blocks, p, block_size, num_blocks, slot_stride);
                    if (off == ~0ull) {
                        // NaN scores for the rows that see p; V 0 so 0-weighted rows stay finite.
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            kf[e] = ATT_NAN;
                            vf[e] = 0.f;
                        }
                    } else {
                        const u64 at = off + (u64)kvh * HD + c * 8;
                        unpack8(*reinterpret_cast<const uint4*>(k_cache + at), kf);
                        unpack8(*reinterpret_cast<const uint4*>(v_cache + at), vf);
                    }
                } else {
#pragma unroll
                    for (int e = 0; e < 8; ++e) kf[e] = vf[e] = 0.f;
                }
                float4* kd = reinterpret_cast<float4*>(Ks + j * LD + c * 8);
                float4* vd = reinterpret_cast<float4*>(Vs + j * LD + c * 8);
                kd[0] = make_float4(kf[0], kf[1], kf[2], kf[3]);
                kd[1] = make_float4(kf[4], kf[5], kf[6], kf[7]);
                vd[0] = make_float4(vf[0], vf[1], vf[2], vf[3]);
                vd[1] = make_float4(vf[4], vf[5], vf[6], vf[7]);
            }
            __syncthreads();

            // S = Q K^T: rows tr + 16a, keys tc + 16b.
            float s[4][4];
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int b = 0; b < 4; ++b) s[a][b] = 0.f;
#pragma unroll 4
            for (int d = 0; d < HD; d += 4) {
                float4 qa[4], kb[4];
#pragma unroll
                for (int a = 0; a < 4; ++a) qa[a] = *reinterpret_cast<const float4*>(Qs + (tr + 16 * a) * LD + d);
#pragma unroll
                for (int b = 0; b < 4; ++b) kb[b] = *reinterpret_cast<const float4*>(Ks + (tc + 16 * b) * LD + d);
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int b = 0; b < 4; ++b) {
                        s[a][b] = fmaf(qa[a].x, kb[b].x, s[a][b]);
                        s[a][b] = fmaf(qa[a].y, kb[b].y, s[a][b]);
                        s[a][b] = fmaf(qa[a].z, kb[b].z, s[a][b]);
                        s[a][b] = fmaf(qa[a].w, kb[b].w, s[a][b]);
                    }
            }
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const u32 kp = kv0 + tc + 16 * b;
                    S[(tr + 16 * a) * LS + tc + 16 * b] = (kp < kv_end && kp <= qpos[a]) ? s[a][b] : ATT_NEG_INF;
                }
            __syncthreads();

            // Online softmax: row r = tid / 4, keys (tid % 4) * 16 ..+16.
            {
                const int r = tid >> 2, qq = tid & 3;
                float* srow = S + r * LS + qq * 16;
                float mx = ATT_NEG_INF;
#pragma unroll
                for (int k = 0; k < 16; ++k) mx = fmaxf(mx, srow[k]);
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_old = row_m[r];
                const float m_new = fmaxf(m_old, mx);
                const bool none = m_new == ATT_NEG_INF;  // nothing visible yet for this row
                float sum = 0.f;
#pragma unroll
                for (int k = 0; k < 16; ++k) {
                    const float v = srow[k];
                    // NaN scores (unmapped blocks) stay NaN; masked ones become 0.
                    const float p = none ? (v != v ? v : 0.f) : exp2f(v - m_new);
                    srow[k] = p;
                    sum += p;
                }
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                const float alpha = none ? 1.f : exp2f(m_old - m_new);
                __syncwarp();
                if (qq == 0) {
                    row_m[r] = m_new;
                    row_l[r] = row_l[r] * alpha + sum;
                    row_a[r] = alpha;
                }
            }
            __syncthreads();

            // O = O * alpha + P V: rows tr + 16a, dims tc * 4 + 64c.
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const float al = row_a[tr + 16 * a];
#pragma unroll
                for (int e = 0; e < DCH * 4; ++e) o[a][e] *= al;
            }
#pragma unroll 4
            for (int k = 0; k < PF_BK; ++k) {
                float p[4];
#pragma unroll
                for (int a = 0; a < 4; ++a) p[a] = S[(tr + 16 * a) * LS + k];
#pragma unroll
                for (int c = 0; c < DCH; ++c) {
                    const float4 v = *reinterpret_cast<const float4*>(Vs + k * LD + tc * 4 + 64 * c);
#pragma unroll
                    for (int a = 0; a < 4; ++a) {
                        o[a][c * 4 + 0] = fmaf(p[a], v.x, o[a][c * 4 + 0]);
                        o[a][c * 4 + 1] = fmaf(p[a], v.y, o[a][c * 4 + 1]);
                        o[a][c * 4 + 2] = fmaf(p[a], v.z, o[a][c * 4 + 2]);
                        o[a][c * 4 + 3] = fmaf(p[a], v.w, o[a][c * 4 + 3]);
                    }
                }
            }
        }
        __syncthreads();  // row_l of the last KV tile is visible

#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const int r = tr + 16 * a;
            const u32 i = i0 + r / gt, g = r % gt;
            if (r / gt >= bq || i >= i_end || g >= gcount) continue;
            const float inv = 1.f / row_l[r];
            bf16* dst = out + ((u64)(q0 + i) * n_heads + head0 + g) * HD;
#pragma unroll
            for (int c = 0; c < DCH; ++c) {
                const int d = tc * 4 + 64 * c;
                const u32 lo = (u32)f32_to_bf16(o[a][c * 4 + 0] * inv) | ((u32)f32_to_bf16(o[a][c * 4 + 1] * inv) << 16);
                const u32 hi = (u32)f32_to_bf16(o[a][c * 4 + 2] * inv) | ((u32)f32_to_bf16(o[a][c * 4 + 3] * inv) << 16);
                *reinterpret_cast<uint2*>(dst + d) = make_uint2(lo, hi);
            }
        }
    }
}

#define PREFILL_KERNEL(HD)                                                                                 \
    extern "C" __global__ void __launch_bounds__(PF_THREADS) paged_prefill_hd##HD(                         \
        bf16* __restrict__ out, const bf16* __restrict__ q, const bf16* __restrict__ k_cache,              \
        const bf16* __restrict__ v_cache, const u32* __restrict__ block_tables, u32 max_blocks,            \
        const u32* __restrict__ ctx_lens, const u32* __restrict__ cu_q, u32 total_q, u32 num_blocks,       \
        u32 block_size, u32 n_heads, u32 n_kv, u32 group, u32 gt, float scale_log2) {                      \
        prefill_body<HD>(out, q, k_cache, v_cache, block_tables, max_blocks, ctx_lens, cu_q, total_q,      \
                         num_blocks, block_size, n_heads, n_kv, group, gt, scale_log2);                    \
    }

PREFILL_KERNEL(64)
PREFILL_KERNEL(128)
