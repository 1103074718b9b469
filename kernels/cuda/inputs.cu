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
