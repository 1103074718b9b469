// Paged attention on bf16 KV caches: the write of new K/V into the cache, decode attention
// (one query token per sequence, split-KV "flash-decoding", the splits merged by the last
// CTA of each sequence) and prefill attention (a causal chunk of queries per sequence,
// flash-attention 2), both on tensor cores. Same semantics as the CPU reference,
// kernels/src/cpu/attention.rs. The HIP build (TESSERA_HIP, kernels/hip/compat.h) replaces the
// tensor-core kernels with one portable kernel at the end of the file.
//
// Cache, per layer: k_cache, v_cache [num_blocks, block_size, n_kv, HD] bf16. Position p of a
// sequence lives in block block_table[p / block_size], slot p % block_size; a slot id is
// block * block_size + slot. Query head h reads kv head h / group (GQA). Scores are
// scale * q.k, computed in the log2 domain (exp2 of scores times scale * log2(e)) with f32
// softmax and accumulation. Both multiply bf16 q and k exactly into f32; prefill rounds the
// softmax weights to bf16 for the P V product, decode applies each weight as two bf16 terms
// (about 16 significant bits: the bf16 output is that of f32 weights).
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

// The prefill and decode kernels below run on NVIDIA tensor cores (mma.sync, ldmatrix, cp.async
// in PTX). The AMD build compiles the portable kernel at the end of the file instead.
#ifndef TESSERA_HIP

// ------------------------------------------------------------------------- prefill
// q, out: [total_tokens, n_heads, HD]; cu_q [num_seqs + 1]: sequence s owns query tokens
// cu_q[s]..cu_q[s+1] (a range past total_q is skipped), at positions first_pos.. with
// first_pos = ctx_lens[s] - n_q (its K/V already written); query i attends to positions
// 0..=first_pos + i. A chunk longer than its context gives NaN rows.
//
// Flash-attention 2 on tensor cores: mma.sync m16n8k16 with bf16 inputs and f32
// accumulators, softmax in f32 registers.
// Grid: (q tiles, n_kv * hchunks, num_seqs), PF_THREADS = 4 warps. Blocks stride over the
// sequence's q tiles (the grid's x is only a hint), the tiles with the longest causal
// range first, so the short ones fill the tail of the launch. A CTA holds PF_R = 64 rows =
// (query token, head) pairs: bq = PF_R / gt tokens x the gt heads of one kv head chunk, so
// each K/V tile serves all of them (and the diagonal tile masks only bq positions); warp w
// owns rows 16w..16w+15, lane (g, t4) = (lane / 4, lane % 4) rows g and g + 8 of those.
// Per KV tile of PF_BK = 64 positions, gathered from the paged cache into shared memory
// with cp.async, two stages (tile j+1 loads while tile j computes):
//   S = Q K^T   Q's A fragments stay in registers for the whole q tile (ldmatrix once), K's
//               B fragments come from ldmatrix (K rows are B's columns);
//   softmax     S scaled by scale * log2(e), masked, online max / rescale / exp2 in f32;
//               a row's max is shared by its 4 lanes through shuffles, its sum stays per
//               lane until the end;
//   O += P V    P rounded to bf16 straight from the S registers (the accumulators of two
//               n8 tiles are the A fragment of one k16 step), V's B fragments from
//               ldmatrix.trans.
// Only tiles up to the CTA's last query position are visited; tiles that reach past its
// first query position are masked per element.
//
// Shared memory (dynamic): [2 stages][K, V][PF_BK rows][HD] bf16, with the 16-byte chunks
// of each row permuted (pf_chunk) so that ldmatrix's 8 row addresses and each 8-lane phase
// of the cp.async stores hit 8 distinct bank groups. Q is staged once per q tile through
// stage 1's K buffer.
//
// A position the table does not map loads K = NaN, V = 0: NaN scores, hence NaN rows, for
// the rows that see it, weight 0 x 0 for the rows that do not. Positions past the CTA's
// last query load zeros (masked for every row).

#define PF_R 64
#define PF_BK 64
#define PF_THREADS 128

// Physical 16-byte chunk of logical chunk c in row r: c ^ f(r), f(r) = 2 (r % 4) + (r / 4) % 2.
// f is a bijection on r % 8 (8 consecutive rows read by one ldmatrix land in 8 bank
// groups); on 4 consecutive rows (r % 4 = 0..3) it takes 4 values of one parity, so the
// chunk pairs (2i, 2i + 1) two lanes copy per row also land in 8 bank groups.
__device__ __forceinline__ u32 pf_chunk(u32 r, u32 c) { return c ^ (((r & 3u) << 1) | ((r >> 2) & 1u)); }

__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void st_shared16(u32 dst, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
// Four 8x8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8 and gets
// element pairs (row l / 4, columns 2 (l % 4) ..+1) of each, transposed with `.trans`.
__device__ __forceinline__ void ldsm_x4(u32 addr, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// c += a b: a 16x16 (row-major fragment), b 16x8 (column-major fragment), c 16x8 f32.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// bf16 pair, round to nearest even, `lo` in the low half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// 2^x on the SFU: 2^-inf = 0, NaN stays NaN.
__device__ __forceinline__ float pf_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

template <int HD>
__device__ __forceinline__ void prefill_body(bf16* __restrict__ out, const bf16* __restrict__ q,
                                             const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                                             const u32* __restrict__ block_tables, u32 max_blocks,
                                             const u32* __restrict__ ctx_lens, const u32* __restrict__ cu_q,
                                             u32 total_q, u32 num_blocks, u32 block_size, u32 n_heads, u32 n_kv,
                                             u32 group, u32 gt, float scale_log2) {
    constexpr u32 ROW_B = HD * 2;            // bytes of a shared-memory row
    constexpr u32 TILE_B = PF_BK * ROW_B;    // bytes of one K or V tile
    constexpr int NKS = HD / 16;             // k16 steps of Q K^T
    constexpr int NDT = HD / 8;              // n8 tiles of O
    constexpr int NST = PF_BK / 8;           // n8 tiles of S
    extern __shared__ uint4 pf_smem[];
    const u32 sbase = (u32)__cvta_generic_to_shared(pf_smem);

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
    const bool bad_seq = nq > ctx;  // the chunk cannot start before position 0
    const u32 first_pos = bad_seq ? 0 : ctx - nq;
    const u32 n_qt = (nq + bq - 1) / bq;

    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 g = lane >> 2, t4 = lane & 3;
    // Loader role: shared-memory row lr, even (lh = 0) or odd chunks; its Q row as (token, head).
    const u32 lr = tid >> 1, lh = tid & 1;
    const u32 ltok = lr / gt, lhead = lr % gt;
    // This lane's two S / O rows (warp rows g and g + 8) as (token, head).
    const u32 tok[2] = {(warp * 16 + g) / gt, (warp * 16 + g + 8) / gt};
    const u32 hd_of[2] = {(warp * 16 + g) % gt, (warp * 16 + g + 8) % gt};
    const u32* table = block_tables + (u64)seq * max_blocks;
    const u64 slot_stride = (u64)n_kv * HD;
    const bf16* kbase = k_cache + (u64)kvh * HD;
    const bf16* vbase = v_cache + (u64)kvh * HD;

    for (u32 t = blockIdx.x; t < n_qt; t += gridDim.x) {
        const u32 i0 = (n_qt - 1 - t) * bq;  // longest causal range first
        const u32 i_end = min(nq, i0 + bq);
        const u32 kv_end = bad_seq ? 0 : first_pos + i_end;  // the tile's last query sees kv_end - 1
        const u32 n_kt = (kv_end + PF_BK - 1) / PF_BK;

        // K/V positions kv0.. into `stage`: this thread copies its row's even or odd chunks.
        auto load_kv = [&](u32 kv0, u32 stage) {
            const u32 p = kv0 + lr;
            const u32 kd = sbase + stage * (2 * TILE_B) + lr * ROW_B, vd = kd + TILE_B;
            const u64 off = p < kv_end ? kv_slot_offset(table, max_blocks, p, block_size, num_blocks, slot_stride)
                                       : ~0ull;
            if (off != ~0ull) {
                const bf16* ks = kbase + off;
                const bf16* vs = vbase + off;
#pragma unroll
                for (u32 i = 0; i < HD / 16; ++i) {
                    const u32 c = 2 * i + lh, at = pf_chunk(lr, c) * 16;
                    cp_async16(kd + at, ks + c * 8);
                    cp_async16(vd + at, vs + c * 8);
                }
            } else {
                // Past the last query: zeros (masked). Unmapped: K NaN, V 0.
                const u32 kw = p < kv_end ? 0x7fc07fc0u : 0u;
#pragma unroll
                for (u32 i = 0; i < HD / 16; ++i) {
                    const u32 at = pf_chunk(lr, 2 * i + lh) * 16;
                    st_shared16(kd + at, make_uint4(kw, kw, kw, kw));
                    st_shared16(vd + at, make_uint4(0, 0, 0, 0));
                }
            }
        };

        __syncthreads();  // the previous q tile is done with both stages
        {
            const bool ok = ltok < bq && i0 + ltok < i_end && lhead < gcount;
            const bf16* src = ok ? q + ((u64)(q0 + i0 + ltok) * n_heads + head0 + lhead) * HD : q;
            const u32 dst = sbase + 2 * TILE_B + lr * ROW_B;
#pragma unroll
            for (u32 i = 0; i < HD / 16; ++i) {
                const u32 c = 2 * i + lh, at = dst + pf_chunk(lr, c) * 16;
                if (ok)
                    cp_async16(at, src + c * 8);
                else
                    st_shared16(at, make_uint4(0, 0, 0, 0));
            }
            cp_async_commit();
        }
        if (n_kt > 0) load_kv(0, 0);
        cp_async_commit();
        cp_async_wait<1>();  // Q has landed (tile 0 may still be in flight)
        __syncthreads();
        u32 qf[NKS][4];
        {
            const u32 row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            const u32 at = sbase + 2 * TILE_B + row * ROW_B;
#pragma unroll
            for (int kk = 0; kk < NKS; ++kk) ldsm_x4(at + pf_chunk(row, 2 * kk + (lane >> 4)) * 16, qf[kk]);
        }

        // Query position of each row, clamped so padding rows see no position past kv_end.
        u32 qpos[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) qpos[h] = min(first_pos + i0 + tok[h], kv_end - 1);
        const u32 qmin = first_pos + i0;
        float o[NDT][4];
#pragma unroll
        for (int d = 0; d < NDT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
        float m[2] = {ATT_NEG_INF, ATT_NEG_INF}, l[2] = {0.f, 0.f};

        for (u32 j = 0; j < n_kt; ++j) {
            const u32 kv0 = j * PF_BK;
            cp_async_wait<0>();
            __syncthreads();  // tile j is visible; everyone is done with tile j-1's stage
            if (j + 1 < n_kt) load_kv(kv0 + PF_BK, (j + 1) & 1);
            cp_async_commit();
            const u32 kb = sbase + (j & 1) * (2 * TILE_B), vb = kb + TILE_B;

            float s[NST][4];
#pragma unroll
            for (int n = 0; n < NST; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < NKS; ++kk) {
#pragma unroll
                for (int np = 0; np < NST / 2; ++np) {
                    // Keys 16 np ..+16, dims 16 kk ..+16: B fragments of n tiles 2 np, 2 np + 1.
                    const u32 key = 16 * np + (lane & 7) + (lane >> 4) * 8;
                    u32 b[4];
                    ldsm_x4(kb + key * ROW_B + pf_chunk(key, 2 * kk + ((lane >> 3) & 1)) * 16, b);
                    mma_bf16(s[2 * np], qf[kk], b[0], b[1]);
                    mma_bf16(s[2 * np + 1], qf[kk], b[2], b[3]);
                }
            }

            const bool diag = kv0 + PF_BK - 1 > qmin;
#pragma unroll
            for (int n = 0; n < NST; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float v = s[n][e] * scale_log2;
                    s[n][e] = diag && kv0 + 8 * n + 2 * t4 + (e & 1) > qpos[e >> 1] ? ATT_NEG_INF : v;
                }

#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = ATT_NEG_INF;
#pragma unroll
                for (int n = 0; n < NST; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                // fmaxf drops NaN scores: they reach the row through exp2 below.
                const float m_new = fmaxf(m[h], mx);
                const float m_use = m_new == ATT_NEG_INF ? 0.f : m_new;  // no -inf - -inf
                const float alpha = pf_exp2(m[h] - m_use);
                m[h] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < NST; ++n) {
                    s[n][2 * h] = pf_exp2(s[n][2 * h] - m_use);
                    s[n][2 * h + 1] = pf_exp2(s[n][2 * h + 1] - m_use);
                    sum += s[n][2 * h] + s[n][2 * h + 1];
                }
                l[h] = l[h] * alpha + sum;
#pragma unroll
                for (int d = 0; d < NDT; ++d) {
                    o[d][2 * h] *= alpha;
                    o[d][2 * h + 1] *= alpha;
                }
            }

#pragma unroll
            for (int kk = 0; kk < PF_BK / 16; ++kk) {
                const u32 a[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                                  pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                  pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                for (int dp = 0; dp < NDT / 2; ++dp) {
                    // Keys 16 kk ..+16, dims 16 dp ..+16: B fragments of n tiles 2 dp, 2 dp + 1.
                    const u32 key = 16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8;
                    u32 b[4];
                    ldsm_x4_t(vb + key * ROW_B + pf_chunk(key, 2 * dp + (lane >> 4)) * 16, b);
                    mma_bf16(o[2 * dp], a, b[0], b[1]);
                    mma_bf16(o[2 * dp + 1], a, b[2], b[3]);
                }
            }
        }

#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float lsum = l[h];
            lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
            lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
            if (tok[h] >= bq || i0 + tok[h] >= i_end || hd_of[h] >= gcount) continue;
            const float inv = bad_seq ? ATT_NAN : 1.f / lsum;
            bf16* dst = out + ((u64)(q0 + i0 + tok[h]) * n_heads + head0 + hd_of[h]) * HD + 2 * t4;
#pragma unroll
            for (int d = 0; d < NDT; ++d)
                *reinterpret_cast<u32*>(dst + 8 * d) = pack_bf16x2(o[d][2 * h] * inv, o[d][2 * h + 1] * inv);
        }
    }
}

#define PREFILL_KERNEL(HD, MINB)                                                                           \
    extern "C" __global__ void __launch_bounds__(PF_THREADS, MINB) paged_prefill_hd##HD(                   \
        bf16* __restrict__ out, const bf16* __restrict__ q, const bf16* __restrict__ k_cache,              \
        const bf16* __restrict__ v_cache, const u32* __restrict__ block_tables, u32 max_blocks,            \
        const u32* __restrict__ ctx_lens, const u32* __restrict__ cu_q, u32 total_q, u32 num_blocks,       \
        u32 block_size, u32 n_heads, u32 n_kv, u32 group, u32 gt, float scale_log2) {                      \
        prefill_body<HD>(out, q, k_cache, v_cache, block_tables, max_blocks, ctx_lens, cu_q, total_q,      \
                         num_blocks, block_size, n_heads, n_kv, group, gt, scale_log2);                    \
    }

// CTAs per SM the register budget allows: head dim 128 takes about 228 registers (O, Q and
// S fragments are 128 of them) for 2 CTAs; capped at 168 for 3 CTAs it spilled and ran 12%
// slower on an H200 (188 vs 215 TFLOP/s at 4096 tokens). Head dim 64 fits 3 without spills.
PREFILL_KERNEL(64, 3)
PREFILL_KERNEL(128, 2)

// ------------------------------------------------------------------------- decode
// q, out: [num_seqs, n_heads, HD]; block_tables [num_seqs, max_blocks]; ctx_lens [num_seqs]
// (the query is the last position, ctx - 1, and attends to 0..ctx).
//
// Grid (num_seqs, n_kv * hchunks, n_splits), DEC_WARPS warps. A CTA serves the gcount <= 8
// query heads of one chunk of one kv head over one split of the positions, so each K/V row
// is read once for all of them. With split_len > 0, split s covers [s len, (s + 1) len) and
// the last split runs to ctx. With split_len = 0 every sequence divides its own context:
// len = ceil(ctx / n_splits), at least min_split, rounded up to whole tiles; so a grid
// sized for a long max_context (a captured graph) splits a short sequence as if planned
// for it. Splits that start at or past ctx exit at once.
//
// Tensor cores (mma.sync m16n8k16, bf16 inputs, f32 accumulators), one warp per tile of
// DEC_TILE = 16 positions; MMA row g (lane / 4) is head g of the CTA:
//   S = Q K^T   Q's A fragments stay in registers (rows 8..15 zero), K's B fragments
//               come from ldmatrix: bf16 products, exact in f32, summed in f32;
//   softmax     online, f32, log2 domain (exp2), per warp; a rescale of O only when some
//               row's max moved;
//   O += P V    each weight p is applied as two bf16 terms, hi = bf16(p) in row g and
//               lo = bf16(p - hi) in row g + 8 of the same A fragment, so one mma carries
//               about 16 significant bits of p (f32 weights would give the same bf16
//               output); V's B fragments from ldmatrix.trans; O = rows g + rows g + 8.
// Warps take the split's tiles round robin, each through its own DEC_STAGES-deep cp.async
// ring in shared memory (no CTA barrier in the loop: DEC_STAGES - 1 tiles are in flight
// while one is computed); block-table reads run one tile ahead of the copies that need
// them. Shared-memory rows permute their 16-byte chunks as the prefill tiles do (pf_chunk).
// At the end the CTA merges its warps' (m, l, O) through shared memory.
//
// Where one split covers the context (n_valid = 1) the CTA writes `out`. Otherwise it
// writes (o / l, log2 of the softmax mass) to part_o / part_lse, and the last of the
// n_valid CTAs of its (sequence, head chunk) to finish (counted in `counters`, which that
// CTA resets to 0 for the next launch) merges the partials into `out`: one launch, no
// separate reduction kernel. Both merges are dec_merge_splits.
//
// A position the table does not map loads K = NaN, V = 0 (NaN scores, so NaN rows);
// positions past the split's end load zeros and are masked.
//
// Launched programmatically (Device::set_decode_early_start), a CTA starts while the kernel
// that writes q and the newest K/V (at ctx - 1) still runs: before griddepcontrol.wait it
// reads only the context length and block table and copies the ring's first tiles that lie
// wholly below ctx - 1; q and any tile holding ctx - 1 come after the wait. Nothing is
// written before it.

#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * 32)
#define DEC_TILE 16
#define DEC_STAGES 3
// Slot markers for positions past the split's end and for positions the table does not
// map (the host keeps num_blocks * block_size below both).
#define SLOT_UNMAPPED 0xffffffffu
#define SLOT_PAST 0xfffffffeu

// Cache slot (block * block_size + offset) of position p, or a marker.
__device__ __forceinline__ u32 dec_slot(const u32* __restrict__ table, u32 max_blocks, u32 p, u32 end,
                                        u32 block_size, u32 num_blocks) {
    if (p >= end) return SLOT_PAST;
    const u32 bi = p / block_size;
    const u32 blk = bi < max_blocks ? table[bi] : SLOT_UNMAPPED;
    return blk < num_blocks ? blk * block_size + (p - bi * block_size) : SLOT_UNMAPPED;
}

// Positions per split of a sequence with context ctx > 0 (see above).
__device__ __forceinline__ u32 dec_split_len(u32 ctx, u32 split_len, u32 n_splits, u32 min_split) {
    if (split_len > 0) return split_len;
    const u32 len = max((ctx - 1) / n_splits + 1, min_split);
    return (len - 1) / DEC_TILE * DEC_TILE + DEC_TILE;
}

// Splits merged per group of loads (dec_merge_splits; groups of 16 or 32 measured no faster).
#define DEC_MERGE 8

// The merge of one head's splits, 4 dims of it (`dst`), from each split's log2 softmax mass
// (lse_of(s)) and normalised output (o_of(s), those 4 dims): out = sum_s w_s o_s / sum_s w_s,
// w_s = 2^(lse_s - max lse). The splits in groups of DEC_MERGE, each group's loads issued
// together and merged online: one round trip to L2 (or to the other CTAs' shared memory)
// per group rather than one per split. The global merge and the cluster-merge prototype
// below (bench-only) both call it, so a split's partials give the same bits either way.
template <class Lse, class O>
__device__ __forceinline__ void dec_merge_splits(bf16* dst, u32 n_valid, Lse lse_of, O o_of) {
    float mx = ATT_NEG_INF, wsum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (u32 s0 = 0; s0 < n_valid; s0 += DEC_MERGE) {
        float lse[DEC_MERGE];
        float4 ov[DEC_MERGE];
#pragma unroll
        for (u32 k = 0; k < DEC_MERGE; ++k) {
            const bool in = s0 + k < n_valid;
            lse[k] = in ? lse_of(s0 + k) : ATT_NEG_INF;
            ov[k] = in ? o_of(s0 + k) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        float mg = mx;
#pragma unroll
        for (u32 k = 0; k < DEC_MERGE; ++k) mg = fmaxf(mg, lse[k]);  // drops NaN: it arrives through w
        const float m_use = mg == ATT_NEG_INF ? 0.f : mg;             // every lse so far NaN
        const float alpha = pf_exp2(mx - m_use);
        wsum *= alpha;
        acc.x *= alpha;
        acc.y *= alpha;
        acc.z *= alpha;
        acc.w *= alpha;
        mx = mg;
#pragma unroll
        for (u32 k = 0; k < DEC_MERGE; ++k) {
            const float w = pf_exp2(lse[k] - m_use);  // 0 for the splits past n_valid
            wsum += w;
            acc.x = fmaf(w, ov[k].x, acc.x);
            acc.y = fmaf(w, ov[k].y, acc.y);
            acc.z = fmaf(w, ov[k].z, acc.z);
            acc.w = fmaf(w, ov[k].w, acc.w);
        }
    }
    const float inv = 1.f / wsum;
    *reinterpret_cast<uint2*>(dst) = make_uint2((u32)f32_to_bf16(acc.x * inv) | ((u32)f32_to_bf16(acc.y * inv) << 16),
                                                (u32)f32_to_bf16(acc.z * inv) | ((u32)f32_to_bf16(acc.w * inv) << 16));
}

#ifdef DEC_CLUSTER_PROTO
// Prototype (bench/gpu/fused_modes.cu only; not built by NVRTC): the splits of one (sequence,
// head chunk) form a thread-block cluster of CL CTAs along z and merge through distributed
// shared memory instead of part_o / part_lse, the fence and the counter. Every CTA of a
// cluster passes both cluster barriers, the idle ones included: rank 0 reads the others'
// shared memory between them.
__device__ __forceinline__ void dec_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ u32 dec_map_rank(u32 addr, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
__device__ __forceinline__ float dec_ld_cluster(u32 addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ float4 dec_ld_cluster4(u32 addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}
#define DEC_CL_PROTO 1
#else
#define DEC_CL_PROTO 0
#endif

// A warp's copies of one K/V tile into a ring stage (K at kd, V at kd + the tile's bytes):
// lane l has looked up `slot`, the cache slot of tile row l % 16 (or a marker: positions past
// the end load zeros, unmapped ones K = NaN, V = 0); kbase / vbase point at this lane's
// 16-byte chunk (l % CPR) of the kv head's row in slot 0. Each warp-wide copy moves RPI
// whole rows (lane l: row l / CPR, chunk l % CPR), so every 256- (128-) byte K or V row is
// asked of memory by one instruction, whole lines rather than scattered sectors (with each
// row copied as two lanes' alternate chunks, a warp instruction touched 16 rows a sector
// each, and decode at batch 256 read 2.3 TB/s on an H200 instead of 3.9). Warp-uniform.
template <int HD>
__device__ __forceinline__ void dec_issue_tile(u32 kd, u32 slot, const bf16* kbase, const bf16* vbase, u64 slot_stride,
                                               u32 lane) {
    constexpr u32 ROW_B = HD * 2, TILE_B = DEC_TILE * ROW_B;
    constexpr u32 CPR = HD / 8;    // 16-byte chunks per row
    constexpr u32 RPI = 32 / CPR;  // rows per warp-wide copy
    const u32 lc = lane % CPR, lrow = lane / CPR, vd = kd + TILE_B;
#pragma unroll
    for (u32 i = 0; i < DEC_TILE / RPI; ++i) {
        const u32 r = i * RPI + lrow;
        const u32 rs = __shfl_sync(0xffffffffu, slot, r);
        const u32 at = r * ROW_B + pf_chunk(r, lc) * 16;
        if (rs < SLOT_PAST) {
            cp_async16(kd + at, kbase + (u64)rs * slot_stride);
            cp_async16(vd + at, vbase + (u64)rs * slot_stride);
        } else {
            const u32 kw = rs == SLOT_UNMAPPED ? 0x7fc07fc0u : 0u;
            st_shared16(kd + at, make_uint4(kw, kw, kw, kw));
            st_shared16(vd + at, make_uint4(0, 0, 0, 0));
        }
    }
}

// One tile of DEC_TILE positions from p0 into a warp's online softmax state: K and V rows
// at kb / vb in shared memory (pf_chunk order), query fragments qa (row g = head g), the
// running max m (log2 domain), this lane's part of the sum l and the O accumulators o (rows
// g: the bf16 weights, rows g + 8: their low halves). Positions >= end are masked.
template <int HD>
__device__ __forceinline__ void dec_tile(u32 kb, u32 vb, const u32 (&qa)[HD / 16][2], float (&o)[HD / 8][4], float& m,
                                         float& l, u32 p0, u32 end, float scale_log2, u32 lane) {
    constexpr u32 ROW_B = HD * 2;
    constexpr int NKS = HD / 16, NDT = HD / 8;
    const u32 t4 = lane & 3;
    float s[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < NKS; ++kk) {
        // Keys 0..15, dims 16 kk ..+16: B fragments of n tiles 0 and 1.
        const u32 key = (lane & 7) + (lane >> 4) * 8;
        u32 b[4];
        ldsm_x4(kb + key * ROW_B + pf_chunk(key, 2 * kk + ((lane >> 3) & 1)) * 16, b);
        const u32 a[4] = {qa[kk][0], 0u, qa[kk][1], 0u};
        mma_bf16(s[0], a, b[0], b[1]);
        mma_bf16(s[1], a, b[2], b[3]);
    }

    // Row g's scores at positions p0 + 8 n + 2 t4 + e (e = 0, 1); [2], [3] are rows g + 8.
    float mx = ATT_NEG_INF;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float v = s[n][e] * scale_log2;
            s[n][e] = p0 + 8 * n + 2 * t4 + e < end ? v : ATT_NEG_INF;
            mx = fmaxf(mx, s[n][e]);  // fmaxf drops NaN scores: they reach the row through exp2
        }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);
    if (__any_sync(0xffffffffu, m_new != m)) {
        const float alpha = pf_exp2(m - (m_new == ATT_NEG_INF ? 0.f : m_new));
        l *= alpha;
#pragma unroll
        for (int d = 0; d < NDT; ++d) {
            o[d][0] *= alpha;
            o[d][1] *= alpha;
            o[d][2] *= alpha;
            o[d][3] *= alpha;
        }
    }
    m = m_new;
    const float m_use = m == ATT_NEG_INF ? 0.f : m;  // no -inf - -inf

    // P as the A fragment: rows g = hi, rows g + 8 = lo, keys 2 t4 ..+1 (n tile 0) and +8 (1).
    u32 a[4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        const float p0f = pf_exp2(s[n][0] - m_use), p1f = pf_exp2(s[n][1] - m_use);
        l += p0f + p1f;
        const u32 hi = pack_bf16x2(p0f, p1f);
        a[2 * n] = hi;
        a[2 * n + 1] = pack_bf16x2(p0f - __uint_as_float(hi << 16), p1f - __uint_as_float(hi & 0xffff0000u));
    }
#pragma unroll
    for (int dp = 0; dp < NDT / 2; ++dp) {
        // Keys 0..15, dims 16 dp ..+16: B fragments of n tiles 2 dp, 2 dp + 1.
        const u32 key = (lane & 7) + ((lane >> 3) & 1) * 8;
        u32 b[4];
        ldsm_x4_t(vb + key * ROW_B + pf_chunk(key, 2 * dp + (lane >> 4)) * 16, b);
        mma_bf16(o[2 * dp], a, b[0], b[1]);
        mma_bf16(o[2 * dp + 1], a, b[2], b[3]);
    }
}

template <int HD, u32 ST, u32 CL = 0>
__device__ __forceinline__ void decode_body(bf16* __restrict__ out, float* __restrict__ part_o,
                                            float* __restrict__ part_lse, u32* __restrict__ counters,
                                            const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                                            const bf16* __restrict__ v_cache, const u32* __restrict__ block_tables,
                                            u32 max_blocks, const u32* __restrict__ ctx_lens, u32 num_blocks,
                                            u32 block_size, u32 n_heads, u32 n_kv, u32 group, u32 gt, u32 split_len,
                                            u32 n_splits, u32 min_split, float scale_log2) {
    constexpr u32 ROW_B = HD * 2;             // bytes of a shared-memory row
    constexpr u32 TILE_B = DEC_TILE * ROW_B;  // one K or V tile
    constexpr u32 STAGE_B = 2 * TILE_B;
    constexpr u32 WARP_B = ST * STAGE_B;  // one warp's ring
    constexpr int NKS = HD / 16;              // k16 steps of Q K^T
    constexpr int NDT = HD / 8;               // n8 tiles of O
    constexpr u32 O_STRIDE = HD + 8;          // floats per row of the merge area (fewer bank conflicts)
    extern __shared__ uint4 dec_smem[];
    __shared__ u32 dec_last;
    const u32 sbase = (u32)__cvta_generic_to_shared(dec_smem);

    const u32 seq = blockIdx.x, split = blockIdx.z;
    const u32 hchunks = (group + gt - 1) / gt;
    const u32 kvh = blockIdx.y / hchunks, chunk = blockIdx.y % hchunks;
    const u32 g0 = chunk * gt;
    const u32 gcount = min(gt, group - g0);
    const u32 head0 = kvh * group + g0;
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 g = lane >> 2, t4 = lane & 3;

    // Before PDL_WAIT only the inputs and older K/V are read (see the section's header).
    const u32 ctx = ctx_lens[seq];
    if (ctx == 0) {  // a padding row: zeros, written once
        PDL_WAIT();
        if (split == 0)
            for (u32 i = tid; i < gcount * HD; i += DEC_THREADS)
                out[((u64)seq * n_heads + head0 + i / HD) * HD + i % HD] = 0;
        return;
    }
    const u32 len = dec_split_len(ctx, split_len, n_splits, min_split);
    const u32 n_valid = min(n_splits, (ctx - 1) / len + 1);
    if (split >= n_valid) {
#if DEC_CL_PROTO
        if constexpr (CL > 0) {
            dec_cluster_sync();
            dec_cluster_sync();
        }
#endif
        return;
    }
    const u32 start = split * len;  // < ctx
    const u32 end = split + 1 == n_splits || ctx - start <= len ? ctx : start + len;

    // This warp's tiles: j = 0.. at positions start + (warp + j DEC_WARPS) DEC_TILE.
    const u32 n_tiles = (end - start - 1) / DEC_TILE + 1;
    const u32 my_tiles = n_tiles > warp ? (n_tiles - warp - 1) / DEC_WARPS + 1 : 0;
    const u32 wbase = sbase + warp * WARP_B;
    const u32 lc = lane % (HD / 8);
    const u32* table = block_tables + (u64)seq * max_blocks;
    const u64 slot_stride = (u64)n_kv * HD;
    const bf16* kbase = k_cache + (u64)kvh * HD + lc * 8;
    const bf16* vbase = v_cache + (u64)kvh * HD + lc * 8;
    auto tile_pos = [&](u32 j) { return start + (warp + j * DEC_WARPS) * DEC_TILE; };
    auto row_slot = [&](u32 j) {
        return j < my_tiles ? dec_slot(table, max_blocks, tile_pos(j) + (lane & 15), end, block_size, num_blocks)
                            : SLOT_PAST;
    };
    // Warp-uniform call: `slot` is this lane's row_slot of the tile going into `stage`.
    auto issue = [&](u32 slot, u32 stage) {
        dec_issue_tile<HD>(wbase + stage * STAGE_B, slot, kbase, vbase, slot_stride, lane);
    };

    float o[NDT][4];
#pragma unroll
    for (int d = 0; d < NDT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m = ATT_NEG_INF, l = 0.f;  // row g's running max (log2 domain) and this lane's sum

    // The ring's first tiles: those wholly below ctx - 1 before the wait, the rest (and q)
    // after it, committed in tile order either way.
    u32 qa[NKS][2];
    {
        u32 first[ST - 1];
#pragma unroll
        for (u32 j = 0; j < ST - 1; ++j) first[j] = row_slot(j);
        u32 early = 0;
#pragma unroll
        for (u32 j = 0; j < ST - 1; ++j)
            if (early == j && j < my_tiles && tile_pos(j) + DEC_TILE < ctx) early = j + 1;
#pragma unroll
        for (u32 j = 0; j < ST - 1; ++j)
            if (j < early) {
                issue(first[j], j);
                cp_async_commit();
            }
        PDL_WAIT();
        // Q's A fragments: row g = head g (zero past gcount), dims 16 kk + 2 t4 ..+1 and +8.
        // Coherent loads (__ldcg): q is written by the kernel ahead while this one runs, and
        // the read-only path its __restrict__ would otherwise give them (ld.global.nc) lets
        // the compiler move them above the wait.
        const bool ok = g < gcount;
        const u32* qrow = reinterpret_cast<const u32*>(q + ((u64)seq * n_heads + head0 + (ok ? g : 0)) * HD);
#pragma unroll
        for (int kk = 0; kk < NKS; ++kk) {
            qa[kk][0] = ok ? __ldcg(qrow + 8 * kk + t4) : 0u;
            qa[kk][1] = ok ? __ldcg(qrow + 8 * kk + 4 + t4) : 0u;
        }
#pragma unroll
        for (u32 j = 0; j < ST - 1; ++j)
            if (j >= early) {
                if (j < my_tiles) issue(first[j], j);
                cp_async_commit();
            }
    }
    u32 next = row_slot(ST - 1);
    u32 stage = 0;
    for (u32 j = 0; j < my_tiles; ++j) {
        cp_async_wait<ST - 2>();
        __syncwarp();  // tile j is visible to the warp; tile j - 1's stage is free
        const u32 jn = j + ST - 1;
        if (jn < my_tiles) issue(next, stage == 0 ? ST - 1 : stage - 1);
        cp_async_commit();
        next = row_slot(jn + 1);
        const u32 kb = wbase + stage * STAGE_B, vb = kb + TILE_B;
        stage = stage + 1 == ST ? 0 : stage + 1;

        dec_tile<HD>(kb, vb, qa, o, m, l, tile_pos(j), end, scale_log2, lane);
    }
    cp_async_wait<0>();  // only empty groups can be left, but the ring is reused below
    __syncwarp();

    // Merge the warps: each writes m[8], l[8] and O[8][O_STRIDE] of its rows over its own
    // ring, then the CTA combines them per (head, dim).
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    {
        float* wf = reinterpret_cast<float*>(reinterpret_cast<char*>(dec_smem) + warp * WARP_B);
        if (t4 == 0) {
            wf[g] = m;
            wf[8 + g] = l;
        }
#pragma unroll
        for (int d = 0; d < NDT; ++d)
            *reinterpret_cast<float2*>(wf + 16 + g * O_STRIDE + 8 * d + 2 * t4) =
                make_float2(o[d][0] + o[d][2], o[d][1] + o[d][3]);
    }
    __syncthreads();
    const bool direct = n_valid == 1;
    for (u32 i = tid; i < gcount * HD; i += DEC_THREADS) {
        const u32 hg = i / HD, d = i % HD;
        float mx = ATT_NEG_INF;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w)
            mx = fmaxf(mx, reinterpret_cast<const float*>(reinterpret_cast<const char*>(dec_smem) + w * WARP_B)[hg]);
        float lsum = 0.f, ov = 0.f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) {
            const float* wf = reinterpret_cast<const float*>(reinterpret_cast<const char*>(dec_smem) + w * WARP_B);
            // A warp that saw no position has m = -inf, l = O = 0: weight 0. One that saw only
            // unmapped positions has m = -inf and NaN l, O: 0 x NaN keeps the row NaN.
            const float wt = wf[hg] == ATT_NEG_INF ? 0.f : pf_exp2(wf[hg] - mx);
            lsum = fmaf(wt, wf[8 + hg], lsum);
            ov = fmaf(wt, wf[16 + hg * O_STRIDE + d], ov);
        }
        const u32 head = head0 + hg;
        if (direct) {
            out[((u64)seq * n_heads + head) * HD + d] = f32_to_bf16(ov / lsum);
        } else if (CL > 0) {  // this split's (o, lse) past the rings, for rank 0 to read
            float* cl = reinterpret_cast<float*>(reinterpret_cast<char*>(dec_smem) + DEC_WARPS * WARP_B);
            cl[8 + hg * HD + d] = ov / lsum;
            if (d == 0) cl[hg] = mx + log2f(lsum);
        } else {
            const u64 row = ((u64)seq * n_heads + head) * n_splits + split;
            part_o[row * HD + d] = ov / lsum;
            if (d == 0) part_lse[row] = mx + log2f(lsum);
        }
    }
#if DEC_CL_PROTO
    if constexpr (CL > 0) {
        dec_cluster_sync();  // every split's (o, lse) written
        if (!direct && split == 0) {
            const u32 cl = sbase + DEC_WARPS * WARP_B;
            for (u32 i = tid; i < gcount * (HD / 4); i += DEC_THREADS) {
                const u32 hg = i / (HD / 4), d4 = i % (HD / 4);
                dec_merge_splits(
                    out + ((u64)seq * n_heads + head0 + hg) * HD + 4 * d4, n_valid,
                    [&](u32 s) { return dec_ld_cluster(dec_map_rank(cl + hg * 4, s)); },
                    [&](u32 s) { return dec_ld_cluster4(dec_map_rank(cl + (8 + hg * HD + 4 * d4) * 4, s)); });
            }
        }
        dec_cluster_sync();  // rank 0 has read every split's shared memory
        return;
    }
#endif
    if (direct) return;

    // The last CTA of this (sequence, head chunk) combines the splits.
    __threadfence();  // this CTA's partials are visible before it is counted
    __syncthreads();
    if (tid == 0) {
        u32* c = counters + (u64)seq * gridDim.y + blockIdx.y;
        const u32 done = atomicAdd(c, 1u) + 1;
        dec_last = done == n_valid;
        if (done == n_valid) atomicExch(c, 0u);  // every CTA of this launch has counted
    }
    __syncthreads();
    if (!dec_last) return;
    __threadfence();
    // A thread per 4 dims of a head; coherent loads (__ldcg): the other CTAs wrote them.
    for (u32 i = tid; i < gcount * (HD / 4); i += DEC_THREADS) {
        const u32 head = head0 + i / (HD / 4), d4 = i % (HD / 4);
        const u64 row0 = ((u64)seq * n_heads + head) * n_splits;
        const float4* po = reinterpret_cast<const float4*>(part_o) + row0 * (HD / 4) + d4;
        dec_merge_splits(
            out + ((u64)seq * n_heads + head) * HD + 4 * d4, n_valid,
            [&](u32 s) { return __ldcg(part_lse + row0 + s); },
            [&](u32 s) { return __ldcg(po + (u64)s * (HD / 4)); });
    }
}

// Head dim 128: a 96 KiB ring (4 warps x 3 stages x 8 KiB of K and V) allows 2 CTAs per SM;
// head dim 64: 48 KiB, 4 CTAs.
//
// The lean kernels (small decode batches, where a warp has a tile or two per split) keep a
// ring of DEC_LEAN_STAGES = 2 (64 KiB at head dim 128), so that a persistent GEMV CTA (up to
// ~152 KiB) fits on the same SM, and let their dependents launch at once: the o projection,
// launched programmatically, becomes resident beside the running attention and queues its
// first weight copies during it (it waits for the whole grid before reading the output).
// Same plan, same tile order per warp: the same bits as the default kernels.
#define DECODE_KERNEL(NAME, HD, ST, MINB, TRIGGER)                                                                  \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS, MINB) NAME(                                           \
        bf16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_lse, u32* __restrict__ counters, \
        const bf16* __restrict__ q, const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,             \
        const u32* __restrict__ block_tables, u32 max_blocks, const u32* __restrict__ ctx_lens, u32 num_blocks,     \
        u32 block_size, u32 n_heads, u32 n_kv, u32 group, u32 gt, u32 split_len, u32 n_splits, u32 min_split,       \
        float scale_log2) {                                                                                         \
        if (TRIGGER) PDL_TRIGGER();                              \
        decode_body<HD, ST>(out, part_o, part_lse, counters, q, k_cache, v_cache, block_tables, max_blocks,         \
                            ctx_lens, num_blocks, block_size, n_heads, n_kv, group, gt, split_len, n_splits,        \
                            min_split, scale_log2);                                                                 \
    }

#define DEC_LEAN_STAGES 2
DECODE_KERNEL(paged_decode_hd64, 64, DEC_STAGES, 4, false)
DECODE_KERNEL(paged_decode_hd128, 128, DEC_STAGES, 2, false)
DECODE_KERNEL(paged_decode_lean_hd64, 64, DEC_LEAN_STAGES, 4, true)
DECODE_KERNEL(paged_decode_lean_hd128, 128, DEC_LEAN_STAGES, 2, true)
#if DEC_CL_PROTO
// The cluster-merge prototype: launched with a cluster of n_splits CTAs along z (grid z =
// n_splits; fused_modes.cu's FM_CLUSTER) and DEC_CL_SMEM_EXTRA more bytes of shared memory:
// lse and o (head dim 128) of up to 8 heads.
#define DEC_CL_SMEM_EXTRA ((8 + 8 * 128) * 4)
extern "C" __global__ void __launch_bounds__(DEC_THREADS, 2) paged_decode_lean_cluster_hd128(
    bf16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_lse, u32* __restrict__ counters,
    const bf16* __restrict__ q, const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
    const u32* __restrict__ block_tables, u32 max_blocks, const u32* __restrict__ ctx_lens, u32 num_blocks,
    u32 block_size, u32 n_heads, u32 n_kv, u32 group, u32 gt, u32 split_len, u32 n_splits, u32 min_split,
    float scale_log2) {
    PDL_TRIGGER();
    decode_body<128, DEC_LEAN_STAGES, 1>(out, part_o, part_lse, counters, q, k_cache, v_cache, block_tables,
                                         max_blocks, ctx_lens, num_blocks, block_size, n_heads, n_kv, group, gt,
                                         split_len, n_splits, min_split, scale_log2);
}
#endif

#else  // TESSERA_HIP

// ------------------------------------------------------------------------- portable (AMD)
// Prefill and decode in one kernel without matrix instructions, for the HIP build: a block of
// ATT_PORT_THREADS per (query token, head), grid (total_q, n_heads); decode is the case of one
// query per sequence. Inputs as paged_prefill's (q, out [total_q, n_heads, HD]; cu_q [num_seqs
// + 1]; query i of sequence s attends to positions 0..=ctx_lens[s] - n_q + i), with the same
// rules: tokens past cu_q[num_seqs] are skipped, a chunk longer than its context and a position
// the block table does not map give NaN rows, a context of 0 gives zeros.
//
// Keys come in tiles of ATT_PORT_THREADS positions: each thread scores one position (f32 dot
// product of the bf16 q and k, times scale * log2(e)), the block takes the tile's max and
// rescales the running sum and output (online softmax, exp2); then thread d < HD adds p_j *
// v_j[d] over the tile in f32. Softmax weights stay f32 (the tensor-core kernels round them
// for the P V product), so results match the CPU reference at least as closely.
#define ATT_PORT_THREADS 256

__device__ __forceinline__ float port_block_max(float v, float* scratch) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, n_warps = blockDim.x / WARP_SIZE;
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : ATT_NEG_INF;
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

template <int HD>
__device__ __forceinline__ void portable_body(bf16* __restrict__ out, const bf16* __restrict__ q,
                                              const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                                              const u32* __restrict__ block_tables, u32 max_blocks,
                                              const u32* __restrict__ ctx_lens, const u32* __restrict__ cu_q,
                                              u32 num_seqs, u32 num_blocks, u32 block_size, u32 n_heads, u32 n_kv,
                                              float scale_log2) {
    __shared__ float s_q[HD];
    __shared__ float s_p[ATT_PORT_THREADS];
    __shared__ u64 s_off[ATT_PORT_THREADS];
    __shared__ float s_red[32];
    __shared__ u32 s_bad;
    const u32 t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    if (num_seqs == 0 || t >= cu_q[num_seqs]) return;
    // The sequence owning token t: the last s with cu_q[s] <= t (cu_q is non-decreasing).
    u32 lo = 0, hi = num_seqs;
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (cu_q[mid] <= t) lo = mid;
        else hi = mid;
    }
    const u32 seq = lo, nq = cu_q[seq + 1] - cu_q[seq], ctx = ctx_lens[seq];
    bf16* o = out + ((u64)t * n_heads + h) * HD;
    if (ctx == 0 || nq > ctx) {
        for (u32 d = tid; d < HD; d += blockDim.x) o[d] = ctx == 0 ? (bf16)0 : BF16_NAN;
        return;
    }
    const u32 kv_end = ctx - nq + (t - cu_q[seq]) + 1;
    const u32 kvh = h / (n_heads / n_kv);
    const u64 slot_stride = (u64)n_kv * HD, head_off = (u64)kvh * HD;
    const u32* table = block_tables + (u64)seq * max_blocks;
    for (u32 d = tid; d < HD; d += blockDim.x) s_q[d] = bf16_to_f32(q[((u64)t * n_heads + h) * HD + d]);
    if (tid == 0) s_bad = 0;
    __syncthreads();

    float m = ATT_NEG_INF, l = 0.f, acc = 0.f;  // acc: output dim tid, for tid < HD
    for (u32 p0 = 0; p0 < kv_end; p0 += blockDim.x) {
        const u32 p = p0 + tid;
        float s = ATT_NEG_INF;
        u64 off = ~0ull;
        if (p < kv_end) {
            off = kv_slot_offset(table, max_blocks, p, block_size, num_blocks, slot_stride);
            if (off == ~0ull) {
                atomicOr(&s_bad, 1u);
            } else {
                const bf16* k = k_cache + off + head_off;
                float dot = 0.f;
                for (int d = 0; d < HD; ++d) dot += s_q[d] * bf16_to_f32(k[d]);
                s = dot * scale_log2;
            }
        }
        s_off[tid] = off;
        const float m_new = fmaxf(m, port_block_max(s, s_red));
        // A tile of unmapped positions only: the row is NaN anyway; keep the sums finite.
        const float base = m_new == ATT_NEG_INF ? 0.f : m_new;
        const float e = s == ATT_NEG_INF ? 0.f : exp2f(s - base);
        s_p[tid] = e;
        const float tile_sum = block_sum(e, s_red);  // its barriers publish s_p and s_off
        const float r = m == ATT_NEG_INF ? 0.f : exp2f(m - base);
        l = l * r + tile_sum;
        if (tid < HD) {
            float a = acc * r;
            const u32 n = min((u32)blockDim.x, kv_end - p0);
            for (u32 j = 0; j < n; ++j) {
                const float pj = s_p[j];
                if (pj != 0.f) a += pj * bf16_to_f32(v_cache[s_off[j] + head_off + tid]);
            }
            acc = a;
        }
        m = m_new;
        __syncthreads();  // s_p and s_off are rewritten by the next tile
    }
    if (tid < HD) o[tid] = s_bad ? BF16_NAN : f32_to_bf16(acc / l);
}

#define PORTABLE_KERNEL(HD)                                                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_PORT_THREADS) paged_attention_portable_hd##HD(                \
        bf16* __restrict__ out, const bf16* __restrict__ q, const bf16* __restrict__ k_cache,                     \
        const bf16* __restrict__ v_cache, const u32* __restrict__ block_tables, u32 max_blocks,                   \
        const u32* __restrict__ ctx_lens, const u32* __restrict__ cu_q, u32 num_seqs, u32 num_blocks,             \
        u32 block_size, u32 n_heads, u32 n_kv, float scale_log2) {                                                \
        portable_body<HD>(out, q, k_cache, v_cache, block_tables, max_blocks, ctx_lens, cu_q, num_seqs,          \
                          num_blocks, block_size, n_heads, n_kv, scale_log2);                                     \
    }

PORTABLE_KERNEL(64)
PORTABLE_KERNEL(128)

#endif  // TESSERA_HIP
