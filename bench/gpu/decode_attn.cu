// Where does many-sequence decode attention lose its bandwidth? In the 64-sequence decode
// step of an 8B model (RESULTS 2026-12-03) paged_decode_hd128 reads 64 x ~530 positions of
// K/V at ~3.0 TB/s, against 3.6-3.9 TB/s for the same step's cuBLASLt weight GEMMs. This program
// times the repository's decode kernel (kernels/cuda/attention.cu, or the copy named by
// ATTN_SRC: bench/gpu/decode_attn.sh builds variants) alone on one H200:
//   - Llama-3.1-8B heads (32 q, 8 kv, head dim 128), 16-slot blocks, each sequence's blocks
//     taken from the pool in order (a fresh server) or shuffled (a server after churn);
//   - DA_LAYERS separate caches (default 8) rotated call by call, so every call reads its
//     K/V from DRAM, not from L2 (except for tiny cases: 5 x 33 positions fit in L2);
//   - the worker's plan (paged.rs plan_splits: splits only where the CTAs do not fill two
//     per SM), mean of 50 back-to-back launches, median of 5 rounds; GB/s counts K and V of
//     every position once.
//   - a stream-K decode kernel (below, a prototype not in the worker; one wave of CTAs whose
//     warps take chunks of SK_CHUNK tiles from a counter as they go), timed the same way and
//     compared once with the CTA-per-item kernel's output (max |difference|; they split the
//     sums differently, so not the same bits). -DSK_TIMING adds percentiles of its warps'
//     start, last-tile and end times (%globaltimer) in the last launch.
// The variants' outputs are not checked (some compute wrong results on purpose): the kernel
// tests check attention.cu.
// DA_STREAMK=1 adds a stream-K copy kernel's ceiling (streamk_copies below) to each case,
// its warps taking contiguous runs of tiles, then interleaved as decode_body's warps are.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/decode_attn bench/gpu/decode_attn.cu
//   /tmp/decode_attn [batch:ctx ...]      (default 64:600 256:600 64:4096 16:600)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>
#include <cuda_runtime.h>

#include "../../kernels/cuda/common.cuh"
#ifndef ATTN_SRC
#define ATTN_SRC "../../kernels/cuda/attention.cu"
#endif
#include ATTN_SRC

#include "gemv_bench.cuh"

// ------------------------------------------------------------------ stream-K decode (prototype)
// Not in the worker: slower than the CTA-per-item kernel (RESULTS 2026-12-03). Decode of many
// sequences in one wave of resident CTAs: the batch's K/V tiles, items in order (sequence,
// then kv head chunk) and DEC_TILE positions each, cut into chunks of SK_CHUNK tiles that the
// warps take from a counter as they go. A warp walks its tiles through its cp.async ring
// across item and chunk boundaries, each tile through dec_tile as in decode_body, and ends
// each run of one item's tiles inside one chunk (a segment) with its (m, l, O): into `out`
// when the segment is the whole item; otherwise as a partial (o / l, log2 of the mass) in
// slot 2 c (chunk c's first segment) or 2 c + 1 (its last), so where partials go is fixed by
// the chunking, not by which warp took the chunk. The segment that brings an item's count to
// its number of chunks merges it (dec_merge_splits) and resets the count. The first version,
// each warp an even fixed share of the tiles (slots 2 w and 2 w + 1 of warp w), is in git at
// 67d40c9 (with -DSK_NOMERGE, a build that skips the merges).
//
// Shared memory: the warps' rings, then the sequences' tile offsets (num_seqs + 1 u32).
// part_o / part_lse hold 2 x chunks x gt rows; counters: one per item, then the chunk counter
// and the count of warps done (the last warp out sets both back to 0), zero between launches.
// Padding rows (context 0) get zeros.

// With -DSK_TIMING: each warp's lane 0 records %globaltimer at its start, after its last
// tile and at its end into sk_times (4 u64 per warp), for the harness's percentiles.
// (At 64 x 600 the fixed-share version's warps, each with the same 18-19 tiles, finished
// their tiles 32-47 µs after the first start.)
#ifdef SK_TIMING
__device__ unsigned long long sk_times[4 * 2048];
__device__ __forceinline__ unsigned long long sk_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
#define SK_MARK(i) \
    if (lane == 0 && gw < 2048) sk_times[4 * gw + (i)] = sk_now()
#else
#define SK_MARK(i)
#endif

// A warp's place in the tile order: sequence s, item y (kv head chunk) of it, tile k of the
// item's ts = tiles of s.
struct DecCursor {
    u32 s, y, k, ts;
};


#ifndef SK_CHUNK
#define SK_CHUNK 8
#endif
// Partial segments a warp keeps to count after its last tile (-DSK_PARTS=0: each is counted
// as it ends, behind a fence; that was faster in RESULTS 2026-12-03).
#ifndef SK_PARTS
#define SK_PARTS 8
#endif
// The copy side runs DEC_STAGES - 1 tiles ahead and so can enter at most two chunks the
// compute side has not: the chunk queue below holds two.
static_assert(SK_CHUNK >= 2, "the chunk queue needs chunks of at least 2 tiles");
struct PartialItem {
    u32 s, y, ts, head0, gcount;
};
template <int HD, u32 ST>
__device__ __forceinline__ void decode_sk2_body(bf16* __restrict__ out, float* __restrict__ part_o,
                                                float* __restrict__ part_lse, u32* __restrict__ counters,
                                                const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                                                const bf16* __restrict__ v_cache, const u32* __restrict__ block_tables,
                                                u32 max_blocks, const u32* __restrict__ ctx_lens, u32 num_seqs,
                                                u32 num_blocks, u32 block_size, u32 n_heads, u32 n_kv, u32 group, u32 gt,
                                                float scale_log2) {
    constexpr u32 ROW_B = HD * 2, TILE_B = DEC_TILE * ROW_B, STAGE_B = 2 * TILE_B, WARP_B = ST * STAGE_B;
    constexpr int NKS = HD / 16, NDT = HD / 8;
    constexpr u32 C = SK_CHUNK;
    extern __shared__ uint4 dec_smem[];
    u32* prefix = reinterpret_cast<u32*>(reinterpret_cast<char*>(dec_smem) + DEC_WARPS * WARP_B);
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 g = lane >> 2, t4 = lane & 3, lc = lane % (HD / 8);
    const u32 hchunks = (group + gt - 1) / gt, ykv = n_kv * hchunks;
    const u32 wbase = (u32)__cvta_generic_to_shared(dec_smem) + warp * WARP_B;
    const u64 slot_stride = (u64)n_kv * HD;
    const u64 gw = (u64)blockIdx.x * DEC_WARPS + warp;
    (void)gw;  // SK_TIMING's
    SK_MARK(0);
    if (warp == 0) {
        u32 carry = 0;
        if (lane == 0) prefix[0] = 0;
        for (u32 b = 0; b < num_seqs; b += 32) {
            const u32 sq = b + lane;
            const u32 c = sq < num_seqs ? ctx_lens[sq] : 0;
            u32 v = c == 0 ? 0 : (c - 1) / DEC_TILE + 1;
            for (u32 d = 1; d < 32; d <<= 1) {
                const u32 n = __shfl_up_sync(0xffffffffu, v, d);
                if (lane >= d) v += n;
            }
            if (sq < num_seqs) prefix[sq + 1] = carry + v;
            carry += __shfl_sync(0xffffffffu, v, 31);
        }
    }
    __syncthreads();
    PDL_WAIT();
    for (u32 sq = blockIdx.x; sq < num_seqs; sq += gridDim.x)
        if (prefix[sq + 1] == prefix[sq])
            for (u32 i = tid; i < n_heads * HD; i += DEC_THREADS) out[(u64)sq * n_heads * HD + i] = 0;
    const u64 total = (u64)ykv * prefix[num_seqs];
    const u32 n_chunks = (u32)((total + C - 1) / C), items = num_seqs * ykv;
    u32* work = counters + items;
    u32* done = work + 1;
    auto locate = [&](u64 t) {
        u32 lo = 0, hi = num_seqs - 1;
        while (lo < hi) {
            const u32 mid = (lo + hi) / 2;
            if ((u64)ykv * prefix[mid + 1] > t) hi = mid;
            else lo = mid + 1;
        }
        const u32 ts = prefix[lo + 1] - prefix[lo];
        const u64 local = t - (u64)ykv * prefix[lo];
        return DecCursor{lo, (u32)(local / ts), (u32)(local % ts), ts};
    };
    auto advance = [&](DecCursor& c) {
        if (++c.k < c.ts) return;
        c.k = 0;
        if (++c.y < ykv) return;
        c.y = 0;
        do {
            ++c.s;
        } while (c.s < num_seqs && prefix[c.s + 1] == prefix[c.s]);
        c.ts = c.s < num_seqs ? prefix[c.s + 1] - prefix[c.s] : 1;
    };
    auto slot_of = [&](const DecCursor& c, u32& kvh) {
        kvh = c.y / hchunks;
        return dec_slot(block_tables + (u64)c.s * max_blocks, max_blocks, c.k * DEC_TILE + (lane & 15),
                        ctx_lens[c.s], block_size, num_blocks);
    };
    auto issue = [&](u32 slot, u32 kvh, u32 stage) {
        dec_issue_tile<HD>(wbase + stage * STAGE_B, slot, k_cache + (u64)kvh * HD + lc * 8,
                           v_cache + (u64)kvh * HD + lc * 8, slot_stride, lane);
    };
    // Chunk numbers: lane 0 takes the next one; the value is read (shuffled) only when needed.
    u32 taken = 0;
    auto take = [&]() {
        if (lane == 0) taken = atomicAdd(work, 1u);
    };
    auto taken_chunk = [&]() { return __shfl_sync(0xffffffffu, taken, 0); };
    auto chunk_end = [&](u32 c) { return min((u64)(c + 1) * C, total); };
    // Chunks the issue side has entered and the compute side not yet (at most 2).
    u32 q0 = 0, q1 = 0, qn = 0;
    auto push = [&](u32 c) {
        if (qn == 0) q0 = c;
        else q1 = c;
        ++qn;
    };
    auto pop = [&]() {
        const u32 c = q0;
        q0 = q1;
        --qn;
        return c;
    };

    // Issue side: chunk ichunk, global tile it, cursor ci; the chunk after it is `taken`.
    take();
    u32 ichunk = taken_chunk();
    bool issuing = ichunk < n_chunks;
    u64 it = (u64)ichunk * C;
    DecCursor ci = issuing ? locate(it) : DecCursor{0, 0, 0, 1};
    if (issuing) {
        push(ichunk);
        take();
    }
    // Moves the issue side one tile on; false once there are no tiles left.
    auto issue_step = [&]() {
        if (!issuing) return false;
        if (++it < chunk_end(ichunk)) {
            advance(ci);
            return true;
        }
        ichunk = taken_chunk();
        if (ichunk >= n_chunks) {
            issuing = false;
            return false;
        }
        take();
        push(ichunk);
        it = (u64)ichunk * C;
        ci = locate(it);
        return true;
    };
    u32 next = SLOT_PAST, next_kvh = 0;
    bool have_next = issuing;
    if (have_next) next = slot_of(ci, next_kvh);
#pragma unroll
    for (u32 j = 0; j < ST - 1; ++j) {
        if (have_next) {
            issue(next, next_kvh, j);
            have_next = issue_step();
            if (have_next) next = slot_of(ci, next_kvh);
        }
        cp_async_commit();
    }

    // Compute side: the same tiles in the same order.
    float o[NDT][4];
    float m = ATT_NEG_INF, l = 0.f;
    u32 qa[NKS][2];
    DecCursor cc{0, 0, 0, 1};
    u32 head0 = 0, gcount = 0, ctx = 0, k0 = 0;
    auto begin_segment = [&]() {
        const u32 kvh = cc.y / hchunks, g0 = (cc.y % hchunks) * gt;
        head0 = kvh * group + g0;
        gcount = min(gt, group - g0);
        ctx = ctx_lens[cc.s];
        k0 = cc.k;
        const bool ok = g < gcount;
        const u32* qrow = reinterpret_cast<const u32*>(q + ((u64)cc.s * n_heads + head0 + (ok ? g : 0)) * HD);
#pragma unroll
        for (int kk = 0; kk < NKS; ++kk) {
            qa[kk][0] = ok ? __ldcg(qrow + 8 * kk + t4) : 0u;
            qa[kk][1] = ok ? __ldcg(qrow + 8 * kk + 4 + t4) : 0u;
        }
#pragma unroll
        for (int d = 0; d < NDT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
        m = ATT_NEG_INF;
        l = 0.f;
    };
    // Counts a partial segment of an item (its sequence, item and tile count, heads) and,
    // when it is the item's last to count, merges the item's segments. The item's chunks are
    // c_lo..c_hi; in c_lo its segment is the chunk's last unless the item starts the chunk.
    auto count_and_merge = [&](const PartialItem& p, bool fence) {
        const u64 a = (u64)ykv * prefix[p.s] + (u64)p.y * p.ts, b = a + p.ts - 1;
        const u32 c_lo = (u32)(a / C), segs = (u32)(b / C) - c_lo + 1;
        const u32 lo_last = (u64)c_lo * C == a ? 0 : 1;
        const u32 item = p.s * ykv + p.y;
        if (fence) {
            __threadfence();
            __syncwarp();
        }
        u32 cnt = 0;
        if (lane == 0) cnt = atomicAdd(counters + item, 1u) + 1;
        cnt = __shfl_sync(0xffffffffu, cnt, 0);
        if (cnt != segs) return;
        if (lane == 0) atomicExch(counters + item, 0u);  // every segment has counted
        __threadfence();
        auto row_of = [&](u32 sg, u32 hg) { return (2 * (c_lo + sg) + (sg == 0 ? lo_last : 0)) * gt + hg; };
        for (u32 e = lane; e < p.gcount * (HD / 4); e += 32) {
            const u32 hg = e / (HD / 4), d4 = e % (HD / 4);
            dec_merge_splits(
                out + ((u64)p.s * n_heads + p.head0 + hg) * HD + 4 * d4, segs,
                [&](u32 sg) { return __ldcg(part_lse + row_of(sg, hg)); },
                [&](u32 sg) { return __ldcg(reinterpret_cast<const float4*>(part_o) + row_of(sg, hg) * (HD / 4) + d4); });
        }
    };
    PartialItem parts[SK_PARTS > 0 ? SK_PARTS : 1];
    u32 n_parts = 0;
    u32 cchunk = 0;
    u64 ct = 0, cend = 0;
    bool first_in_chunk = true;
    auto enter_chunk = [&]() {
        cchunk = pop();
        ct = (u64)cchunk * C;
        cend = chunk_end(cchunk);
        cc = locate(ct);
        first_in_chunk = true;
        begin_segment();
    };
    bool computing = qn > 0;
    if (computing) enter_chunk();
    u32 stage = 0;
    while (computing) {
        cp_async_wait<ST - 2>();
        __syncwarp();  // this tile is visible to the warp; the previous one's stage is free
        if (have_next) {
            issue(next, next_kvh, stage == 0 ? ST - 1 : stage - 1);
            have_next = issue_step();
            if (have_next) next = slot_of(ci, next_kvh);
        }
        cp_async_commit();
        const u32 kb = wbase + stage * STAGE_B, vb = kb + TILE_B;
        stage = stage + 1 == ST ? 0 : stage + 1;
        dec_tile<HD>(kb, vb, qa, o, m, l, cc.k * DEC_TILE, ctx, scale_log2, lane);

        const bool item_end = cc.k + 1 == cc.ts, chunk_done = ct + 1 == cend;
        if (item_end || chunk_done) {  // the segment ends
            float lt = l;
            lt += __shfl_xor_sync(0xffffffffu, lt, 1);
            lt += __shfl_xor_sync(0xffffffffu, lt, 2);
            const float wt = m == ATT_NEG_INF ? 0.f : 1.f;  // 0 x NaN keeps an unmapped row NaN
            const float lsum = wt * lt;
            if (k0 == 0 && item_end) {  // the whole item
                if (g < gcount) {
                    u32* dst = reinterpret_cast<u32*>(out + ((u64)cc.s * n_heads + head0 + g) * HD);
#pragma unroll
                    for (int d = 0; d < NDT; ++d)
                        dst[4 * d + t4] = (u32)f32_to_bf16(wt * (o[d][0] + o[d][2]) / lsum) |
                                          ((u32)f32_to_bf16(wt * (o[d][1] + o[d][3]) / lsum) << 16);
                }
            } else {
                const u64 slot = 2 * (u64)cchunk + (first_in_chunk ? 0 : 1);
                if (g < gcount) {
                    const u64 row = slot * gt + g;
#pragma unroll
                    for (int d = 0; d < NDT; ++d)
                        *reinterpret_cast<float2*>(part_o + row * HD + 8 * d + 2 * t4) =
                            make_float2(wt * (o[d][0] + o[d][2]) / lsum, wt * (o[d][1] + o[d][3]) / lsum);
                    if (t4 == 0) part_lse[row] = m + log2f(lsum);
                }
                // Counted after the warp's last tile (a fence here also waits for the ring's
                // copies in flight), or now when the list is full.
                const PartialItem p{cc.s, cc.y, cc.ts, head0, gcount};
                // (Not `n_parts < SK_PARTS`: with -DSK_PARTS=0 nvcc warns that it is never true.)
                if (n_parts + 1 <= SK_PARTS) parts[n_parts++] = p;
                else count_and_merge(p, true);
            }
        }
        if (chunk_done) {
            computing = qn > 0;  // the issue side has entered every chunk this warp will take
            if (computing) enter_chunk();
        } else {
            ++ct;
            advance(cc);
            if (item_end) {
                first_in_chunk = false;
                begin_segment();
            }
        }
    }
    cp_async_wait<0>();
    SK_MARK(1);
    if (n_parts > 0) {
        __threadfence();  // this warp's partials are visible before they are counted
        __syncwarp();
        for (u32 i = 0; i < n_parts; ++i) count_and_merge(parts[i], false);
    }
    // The last warp out leaves the chunk counter and itself at 0 for the next launch.
    __threadfence();
    if (lane == 0 && atomicAdd(done, 1u) + 1 == gridDim.x * DEC_WARPS) {
        atomicExch(work, 0u);
        atomicExch(done, 0u);
    }
    SK_MARK(2);
}

extern "C" __global__ void __launch_bounds__(DEC_THREADS, 2) paged_decode_sk2_hd128(
    bf16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_lse, u32* __restrict__ counters,
    const bf16* __restrict__ q, const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
    const u32* __restrict__ block_tables, u32 max_blocks, const u32* __restrict__ ctx_lens, u32 num_seqs, u32 num_blocks,
    u32 block_size, u32 n_heads, u32 n_kv, u32 group, u32 gt, float scale_log2) {
    decode_sk2_body<128, DEC_STAGES>(out, part_o, part_lse, counters, q, k_cache, v_cache, block_tables, max_blocks,
                                     ctx_lens, num_seqs, num_blocks, block_size, n_heads, n_kv, group, gt, scale_log2);
}

static const int HEADS = 32, KV = 8, HD = 128, BLOCK = 16, MIN_SPLIT = 64;
static const size_t SMEM = (size_t)DEC_WARPS * DEC_STAGES * 2 * DEC_TILE * HD * 2;

// With DA_STREAMK=1, also the copies alone as a stream-K kernel would make them: one wave of
// CTAs (as many per SM as the decode kernel), each warp copying an even share of all the
// batch's K/V tiles (items (sequence, kv head) in order, DEC_TILE positions each) through
// the same 3-stage ring, across item boundaries, with no per-CTA start and no merge: the
// ceiling of a decode kernel without the per-wave fixed cost. Same copies (dec_issue_tile)
// and shared-memory layout as decode_body. Every sequence has `ctx` positions here. (The
// numbers in RESULTS 2026-12-03 came from an inline copy loop that skipped rows past the
// end instead of zero-filling them: one partial tile per item.)
__global__ void __launch_bounds__(DEC_THREADS, 2)
    streamk_copies(const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                   const u32* __restrict__ block_tables, u32 max_blocks, u32 n_seqs, u32 ctx, u32 n_kv,
                   u32 interleave) {
    constexpr u32 ROW_B = HD * 2, TILE_B = DEC_TILE * ROW_B, STAGE_B = 2 * TILE_B, ST = DEC_STAGES;
    extern __shared__ uint4 dec_smem[];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 wbase = (u32)__cvta_generic_to_shared(dec_smem) + warp * ST * STAGE_B;
    const u32 lc = lane % (HD / 8);
    const u32 per_item = (ctx + DEC_TILE - 1) / DEC_TILE;
    const u64 total = (u64)n_seqs * n_kv * per_item, warps = (u64)gridDim.x * DEC_WARPS;
    // A warp's tiles t0, t0 + step, ... below t1: its own contiguous share, or with
    // `interleave` every DEC_WARPS-th tile of its CTA's share (decode_body's order).
    const u64 gw = (u64)blockIdx.x * DEC_WARPS + warp;
    u64 t0 = gw * total / warps, t1 = (gw + 1) * total / warps, step = 1;
    if (interleave) {
        t0 = (u64)blockIdx.x * total / gridDim.x + warp;
        t1 = ((u64)blockIdx.x + 1) * total / gridDim.x;
        step = DEC_WARPS;
    }
    const u64 slot_stride = (u64)n_kv * HD;
    // Lane l's slot of row l % 16 of global tile t, or SLOT_PAST.
    auto slot_of = [&](u64 t, u32& kvh) {
        const u64 item = t / per_item;
        const u32 seq = (u32)(item / n_kv), tile = (u32)(t % per_item);
        kvh = (u32)(item % n_kv);
        const u32 p = tile * DEC_TILE + (lane & 15);
        return p < ctx ? block_tables[(u64)seq * max_blocks + p / BLOCK] * BLOCK + p % BLOCK : SLOT_PAST;
    };
    // Warp-uniform: `slot`, `kvh` are this lane's slot_of the tile going into `stage`.
    auto issue = [&](u32 slot, u32 kvh, u32 stage) {
        dec_issue_tile<HD>(wbase + stage * STAGE_B, slot, k_cache + (u64)kvh * HD + lc * 8,
                           v_cache + (u64)kvh * HD + lc * 8, slot_stride, lane);
    };
    u32 kvh = 0;
    for (u32 j = 0; j < ST - 1; ++j) {
        if (t0 + j * step < t1) {
            const u32 slot = slot_of(t0 + j * step, kvh);
            issue(slot, kvh, j);
        }
        cp_async_commit();
    }
    // The table lookup runs a tile ahead of the copies that need it, as in decode_body.
    u32 next = t0 + (ST - 1) * step < t1 ? slot_of(t0 + (ST - 1) * step, kvh) : SLOT_PAST, next_kvh = kvh;
    u32 stage = 0;
    for (u64 t = t0; t < t1; t += step) {
        cp_async_wait<ST - 2>();
        __syncwarp();
        if (t + (ST - 1) * step < t1) issue(next, next_kvh, stage == 0 ? ST - 1 : stage - 1);
        cp_async_commit();
        if (t + ST * step < t1) next = slot_of(t + ST * step, next_kvh);
        stage = stage + 1 == ST ? 0 : stage + 1;
    }
    cp_async_wait<0>();
}

// Largest |a - b| over two kernels' bf16 outputs, with the largest |a| and the count of
// non-finite differences.
static void report_agreement(const std::vector<bf16>& a, const std::vector<bf16>& b, const char* what) {
    auto f = [](bf16 v) {
        u32 w = (u32)v << 16;
        float r;
        memcpy(&r, &w, 4);
        return r;
    };
    double worst = 0, top = 0;
    size_t bad = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        const double d = fabs((double)f(a[i]) - f(b[i]));
        if (!(d <= 1e30)) ++bad;
        else worst = std::max(worst, d);
        top = std::max(top, (double)fabs(f(a[i])));
    }
    printf("|   | %s vs CTA-per-item: max |diff| %.3g (max |out| %.3g), %zu NaN or inf |\n", what, worst, top, bad);
}

#ifdef SK_TIMING
// Percentiles of the last launch's per-warp marks (sk_times), from the first warp's start.
static void report_timing(int nw) {
    std::vector<unsigned long long> tm(4 * 2048);
    CK(cudaMemcpyFromSymbol(tm.data(), sk_times, tm.size() * 8));
    unsigned long long t0 = ~0ull;
    for (int w = 0; w < nw; ++w) t0 = std::min(t0, tm[4 * w]);
    for (int k = 0; k < 3; ++k) {
        std::vector<double> v;
        for (int w = 0; w < nw; ++w) v.push_back((tm[4 * w + k] - t0) * 1e-3);
        std::sort(v.begin(), v.end());
        printf("|   | warps' %s (us from the first start): min %.1f, p10 %.1f, median %.1f, p90 %.1f, max %.1f |\n",
               k == 0 ? "start" : k == 1 ? "last tile done" : "end", v[0], v[nw / 10], v[nw / 2], v[nw * 9 / 10],
               v[nw - 1]);
    }
}
#endif

struct Case {
    int batch, ctx;
};

// One timing of `batch` sequences of `ctx` positions; `shuffle` scatters the blocks.
static void run_case(Case c, bool shuffle, int layers, int sms, int ctas_per_sm) {
    const int per_seq = (c.ctx + BLOCK - 1) / BLOCK, blocks = c.batch * per_seq;
    const size_t cache_elems = (size_t)blocks * BLOCK * KV * HD;
    std::vector<bf16*> kc(layers), vc(layers);
    for (int l = 0; l < layers; ++l) {
        CK(cudaMalloc(&kc[l], cache_elems * 2));
        CK(cudaMalloc(&vc[l], cache_elems * 2));
        fill_random<<<1024, 256>>>(kc[l], cache_elems, 11 + l, 2.f, 0.f);
        fill_random<<<1024, 256>>>(vc[l], cache_elems, 97 + l, 2.f, 0.f);
    }
    std::vector<u32> table(blocks);
    for (int i = 0; i < blocks; ++i) table[i] = i;
    if (shuffle) std::shuffle(table.begin(), table.end(), std::mt19937(7));
    std::vector<u32> ctx(c.batch, c.ctx);
    u32 *d_table, *d_ctx, *counters;
    bf16 *q, *out;
    float *part_o, *part_lse;
    // The worker's plan: as many splits as keep two CTAs per SM busy, at least MIN_SPLIT
    // positions each, capped by a workspace of 512 sequence-splits per head.
    const int ctas = c.batch * KV, slots = sms * ctas_per_sm;
    const int cap = std::max(1, 512 / c.batch);
    const int n_splits = std::clamp(std::min(slots / ctas, (c.ctx + MIN_SPLIT - 1) / MIN_SPLIT), 1, cap);
    CK(cudaMalloc(&d_table, blocks * 4));
    CK(cudaMalloc(&d_ctx, c.batch * 4));
    CK(cudaMalloc(&counters, (size_t)c.batch * KV * 4));
    CK(cudaMemset(counters, 0, (size_t)c.batch * KV * 4));
    CK(cudaMalloc(&q, (size_t)c.batch * HEADS * HD * 2));
    CK(cudaMalloc(&out, (size_t)c.batch * HEADS * HD * 2));
    CK(cudaMalloc(&part_o, (size_t)c.batch * HEADS * n_splits * HD * 4));
    CK(cudaMalloc(&part_lse, (size_t)c.batch * HEADS * n_splits * 4));
    CK(cudaMemcpy(d_table, table.data(), blocks * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_ctx, ctx.data(), c.batch * 4, cudaMemcpyHostToDevice));
    fill_random<<<256, 256>>>(q, (size_t)c.batch * HEADS * HD, 5, 2.f, 0.f);
    CK(cudaDeviceSynchronize());

    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    u32 max_blocks = per_seq, num_blocks = blocks, bs = BLOCK, nh = HEADS, nkv = KV, group = HEADS / KV, gt = group,
        split_len = 0, ns = n_splits, min_split = MIN_SPLIT;
    float scale_log2 = 0.0884f * 1.4427f;
    bf16 *k_p, *v_p;
    float *po = n_splits > 1 ? part_o : nullptr, *pl = n_splits > 1 ? part_lse : nullptr;
    u32* cnt = n_splits > 1 ? counters : nullptr;
    void* args[] = {&out, &po, &pl, &cnt, &q, &k_p, &v_p, &d_table, &max_blocks, &d_ctx, &num_blocks,
                    &bs, &nh, &nkv, &group, &gt, &split_len, &ns, &min_split, &scale_log2};
    int layer = 0;
    const int calls = 50;
    // Median of 5 rounds of `calls` launches of `fn`, each on the next cache.
    auto median_us = [&](const void* fn, dim3 grid, void** a, size_t smem) {
        std::vector<float> t;
        for (int r = 0; r < 5; ++r) t.push_back(elapsed_us(s, calls, [&] {
            for (int i = 0; i < calls; ++i) {
                k_p = kc[layer];
                v_p = vc[layer];
                layer = (layer + 1) % layers;
                CK(cudaLaunchKernel(fn, grid, dim3(DEC_THREADS), a, smem, s));
            }
        }));
        CK(cudaGetLastError());
        std::sort(t.begin(), t.end());
        return t[2];
    };
    auto launch = [&]() {
        k_p = kc[layer];
        v_p = vc[layer];
        layer = (layer + 1) % layers;
        CK(cudaLaunchKernel((const void*)paged_decode_hd128, dim3(c.batch, KV, n_splits), dim3(DEC_THREADS), args, SMEM, s));
    };
    for (int i = 0; i < 10; ++i) launch();
    const dim3 dec_grid(c.batch, KV, n_splits);
    const float us = median_us((const void*)paged_decode_hd128, dec_grid, args, SMEM);
    const double bytes = 2.0 * c.batch * (double)c.ctx * KV * HD * 2;
    printf("| %d | %d | %s | %d | %.1f | %.0f |\n", c.batch, c.ctx, shuffle ? "shuffled" : "in order", n_splits, us,
           bytes / (us * 1e-6) / 1e9);
    {
        // The chunked stream-K kernel: partial slots 2 per chunk, counters per item + 2.
        const int grid = sms * ctas_per_sm;
        const size_t tiles = (size_t)c.batch * KV * ((c.ctx + DEC_TILE - 1) / DEC_TILE);
        const size_t chunks = (tiles + SK_CHUNK - 1) / SK_CHUNK;
        float *sk_o, *sk_lse;
        u32* sk_cnt;
        CK(cudaMalloc(&sk_o, 2 * chunks * group * HD * 4));
        CK(cudaMalloc(&sk_lse, 2 * chunks * group * 4));
        CK(cudaMalloc(&sk_cnt, ((size_t)c.batch * KV + 2) * 4));
        CK(cudaMemset(sk_cnt, 0, ((size_t)c.batch * KV + 2) * 4));
        u32 n_seqs = c.batch;
        const size_t sk_smem = SMEM + 4 * (c.batch + 1);
        CK(cudaFuncSetAttribute((const void*)paged_decode_sk2_hd128, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)sk_smem));
        void* kargs[] = {&out, &sk_o, &sk_lse, &sk_cnt, &q, &k_p, &v_p, &d_table, &max_blocks, &d_ctx, &n_seqs,
                         &num_blocks, &bs, &nh, &nkv, &group, &gt, &scale_log2};
        const float sk = median_us((const void*)paged_decode_sk2_hd128, dim3(grid), kargs, sk_smem);
        printf("| %d | %d | %s | chunked stream-K kernel (%d-tile chunks) | %.1f | %.0f |\n", c.batch, c.ctx,
               shuffle ? "shuffled" : "in order", SK_CHUNK, sk, bytes / (sk * 1e-6) / 1e9);
        const size_t n_out = (size_t)c.batch * HEADS * HD;
        std::vector<bf16> a(n_out), b(n_out);
        k_p = kc[0];
        v_p = vc[0];
        CK(cudaLaunchKernel((const void*)paged_decode_hd128, dec_grid, dim3(DEC_THREADS), args, SMEM, s));
        CK(cudaMemcpyAsync(a.data(), out, n_out * 2, cudaMemcpyDeviceToHost, s));
        CK(cudaMemsetAsync(out, 0xff, n_out * 2, s));
        CK(cudaLaunchKernel((const void*)paged_decode_sk2_hd128, dim3(grid), dim3(DEC_THREADS), kargs, sk_smem, s));
        CK(cudaMemcpyAsync(b.data(), out, n_out * 2, cudaMemcpyDeviceToHost, s));
        CK(cudaStreamSynchronize(s));
        report_agreement(a, b, "chunked stream-K");
#ifdef SK_TIMING
        report_timing(std::min(grid * DEC_WARPS, 2048));
#endif
        CK(cudaFree(sk_o));
        CK(cudaFree(sk_lse));
        CK(cudaFree(sk_cnt));
    }
    for (u32 inter = 0; inter < 2 && getenv("DA_STREAMK") && atoi(getenv("DA_STREAMK")) == 1; ++inter) {
        u32 n_seqs = c.batch, ctx_u = c.ctx;
        void* sargs[] = {&k_p, &v_p, &d_table, &max_blocks, &n_seqs, &ctx_u, &nkv, &inter};
        const float cu = median_us((const void*)streamk_copies, dim3(sms * ctas_per_sm), sargs, SMEM);
        printf("| %d | %d | %s | stream-K copies%s | %.1f | %.0f |\n", c.batch, c.ctx, shuffle ? "shuffled" : "in order",
               inter ? ", warps interleaved" : "", cu, bytes / (cu * 1e-6) / 1e9);
    }
    CK(cudaStreamDestroy(s));
    for (int l = 0; l < layers; ++l) {
        CK(cudaFree(kc[l]));
        CK(cudaFree(vc[l]));
    }
    for (void* p : {(void*)d_table, (void*)d_ctx, (void*)counters, (void*)q, (void*)out, (void*)part_o, (void*)part_lse})
        CK(cudaFree(p));
}

int main(int argc, char** argv) {
    int sms = 0, per_sm = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaFuncSetAttribute((const void*)paged_decode_hd128, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM));
    CK(cudaFuncSetAttribute((const void*)streamk_copies, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, (const void*)paged_decode_hd128, DEC_THREADS, SMEM));
    const int layers = getenv("DA_LAYERS") ? std::max(1, atoi(getenv("DA_LAYERS"))) : 8;
    std::vector<Case> cases;
    for (int i = 1; i < argc; ++i) {
        Case c{};
        if (sscanf(argv[i], "%d:%d", &c.batch, &c.ctx) == 2 && c.batch > 0 && c.ctx > 0) cases.push_back(c);
    }
    if (cases.empty()) cases = {{64, 600}, {256, 600}, {64, 4096}, {16, 600}};
    printf("# %s: %d CTAs per SM (%zu B of shared memory), %d SMs, %d caches\n", ATTN_SRC, per_sm, SMEM, sms, layers);
    printf("| batch | context | blocks | splits | us | GB/s |\n|---:|---:|---|---:|---:|---:|\n");
    for (const Case& c : cases)
        for (bool shuffle : {false, true}) run_case(c, shuffle, layers, sms, per_sm);
    return 0;
}
