// A decode graph's per-step inputs reach the device in one host-to-device copy, packed as
// [4, n] u32 (token ids, positions, KV cache slots, context lengths); this kernel, the
// graph's first node, splits them into the four buffers the layers read. One copy instead
// of four saves the host three driver calls per step; the split costs the GPU one tiny
// kernel. Grid-stride over n.

extern "C" __global__ void unpack4_u32(const u32* __restrict__ packed, u32 n, u32* __restrict__ a,
                                       u32* __restrict__ b, u32* __restrict__ c, u32* __restrict__ d) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        a[i] = packed[i];
        b[i] = packed[(u64)n + i];
        c[i] = packed[2 * (u64)n + i];
        d[i] = packed[3 * (u64)n + i];
    }
}

// A decode step queued before the previous step's sampled tokens reached the host (the
// engine's overlapped decode loop) names each such token by its row in the previous step's
// sampled-token array: ids[i] = FROM_SAMPLED | row. This kernel, queued after the ids'
// upload and before the step's layers, replaces every flagged entry with sampled[row]
// (row >= rows: token 0; the host checks rows, this only keeps a bad one in bounds).
// Unflagged entries are token ids (< vocab < 2^31) and stay. Grid-stride over n.

#define FROM_SAMPLED 0x80000000u

extern "C" __global__ void take_sampled_ids(u32* __restrict__ ids, u32 n, const u32* __restrict__ sampled,
                                            u32 rows) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const u32 v = ids[i];
        if (v & FROM_SAMPLED) {
            const u32 r = v & ~FROM_SAMPLED;
            ids[i] = r < rows ? sampled[r] : 0u;
        }
    }
}
