// The decode GEMV's copy scheme for the microbenchmarks in this folder (stream_read.cu,
// chain_read.cu): a warp's ring of P stages in shared memory, each stage 16 rows x 128 bytes
// of W (2 KB, lane-interleaved 16-byte slots as in kernels/cuda/gemv.cu), filled by per-lane
// cp.async.cg and read back by the same lanes. Only the copies, no arithmetic.
#pragma once
typedef unsigned int u32;
typedef unsigned long long u64;

// One 16-byte copy of W, L2-only, evict-first, 256-byte L2 prefetch.
__device__ __forceinline__ void ring_cp_w(u32 dst, const void* src, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, 16, %2;\n" ::"r"(dst), "l"(src),
                 "l"(policy)
                 : "memory");
}

// Stage of item q at slot p: rows g and g + 8 (lo, hi) at columns t * 8 and 32 + t * 8.
__device__ __forceinline__ void ring_issue_rows(u32 st, const unsigned short* lo, const unsigned short* hi, u64 policy) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        ring_cp_w(st + 2 * h * 512, lo + 32 * h, policy);
        ring_cp_w(st + (2 * h + 1) * 512, hi + 32 * h, policy);
    }
}

// Runs a warp's `items` through the ring whose lane slot 0 is `ring`: issue(q, p) queues item
// q into stage p, before(q) runs before item q is consumed (a barrier, say). Returns the xor
// of every word read, which the caller must use so the reads are not optimised away.
template <int P, typename Issue, typename Before>
__device__ __forceinline__ u32 ring_drive(int items, u32 ring, Issue issue, Before before) {
    for (int p = 0; p < P; ++p) {
        if (p < items) issue(p, p);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    u32 acc = 0;
    int p = 0;
    for (int q = 0; q < items; ++q) {
        before(q);
        asm volatile("cp.async.wait_group %0;\n" ::"n"(P - 1) : "memory");
        const u32 st = ring + p * 2048;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            u32 a, b, c, d;
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(st + s * 512));
            acc ^= a ^ b ^ c ^ d;
        }
        if (q + P < items) issue(q + P, p);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        p = p + 1 == P ? 0 : p + 1;
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    return acc;
}
