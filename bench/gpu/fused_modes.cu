// Where do the decode GEMV's fused modes (kernels/cuda/gemv.cu: NORM_ROPE, RESIDUAL,
// NORM_SWIGLU) lose their time against the plain mode at batch 1? The 2026-12-02 traces put a
// Llama-8B layer's fused chain at 112.2 us against 105.9 for plain GEMVs of the same shapes.
// This program times, on one H200, m = 1:
//   - each shape's kernel alone, 64 back-to-back programmatic launches over rotating weight
//     copies, plain vs its fused mode;
//   - the layer chain (qkv, o, gate_up, down; 32 layers over 16 weight sets in one CUDA
//     graph) with every GEMV plain, every GEMV fused (as the model runs them), and fused
//     with one position plain, which attributes the difference to the modes;
//   - the same chain with the model's decode attention (kernels/cuda/attention.cu) between
//     qkv and o, as the worker launches it at batch 1: the lean kernel, launched
//     programmatically beside qkv (early start), 33 splits planned for a long context of
//     which a sequence of FM_CTX positions (default 544: the benchmark's 512-token prompt
//     plus 32 generated) uses ceil(ctx / 64); each layer has its own paged K/V cache. Its
//     variants (plain launch, the default kernel, a grid of only the splits in use, attention
//     alone) say what the model adds to the chain around attention.
//   - attention.cu's cluster-merge prototype (DEC_CLUSTER_PROTO): FM_CLUSTER splits merged
//     through distributed shared memory, first checked bit for bit against the global
//     merge on the same splits, then timed in the chain and alone.
// The kernels come from the gemv.cu named by GEMV_SRC (default: the repository's), so a
// modified copy can be timed the same way (bench/gpu/fused_modes.sh builds the variants);
// the decode attention likewise from ATTN_SRC.
// Launch settings as the worker's: P = 6, 8 warps, one wave of persistent CTAs (as many per
// SM as fit), flags 3 (W queued before the wait, contiguous chunk runs).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/fused_modes bench/gpu/fused_modes.cu
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <cuda_runtime.h>

#include "../../kernels/cuda/common.cuh"
#ifndef GEMV_SRC
#define GEMV_SRC "../../kernels/cuda/gemv.cu"
#endif
#include GEMV_SRC
#ifndef ATTN_SRC
#define ATTN_SRC "../../kernels/cuda/attention.cu"
#endif
#define DEC_CLUSTER_PROTO  // attention.cu's cluster-merge prototype kernel
#include ATTN_SRC

#include "gemv_bench.cuh"

static int g_sms = 0;
static const int H = 4096, QKV = 6144, FFN = 14336, HEADS = 32, KV = 8, HD = 128, MAX_POS = 4096;
static const int P = 6, NW = 8;
// Decode attention as the worker plans it at batch 1 (attention.rs, paged.rs): 16-slot
// blocks, 2 decode CTAs per SM x 132 SMs / 8 kv heads = 33 splits, at least 64 positions each.
// FM_MIN_SPLIT (default 64, the worker's MIN_SPLIT_TOKENS) sets the fewest positions per split.
static const int MIN_SPLIT = getenv("FM_MIN_SPLIT") ? std::max(16, atoi(getenv("FM_MIN_SPLIT"))) : 64;
static const int BLOCK = 16, SPLITS = 33, LEAN_SMEM = 4 * 2 * 2 * 16 * HD * 2, DEF_SMEM = 4 * 3 * 2 * 16 * HD * 2;

static size_t smem_for(bool xs, int cols) {
    const size_t ring = (size_t)NW * (P * GEMV_STAGE_BYTES(xs ? 4 : 6) + 2 * GEMV_RED_BYTES);
    const int pitch = cols + (96 - cols % 64) % 64;
    return ring + (xs ? (size_t)pitch * 2 + GEMV_NORM_SUMS_BYTES : 0);
}

static void launch(const void* fn, bool xs, void* out, const bf16* x, const bf16* w, int rows, int cols,
                   const bf16* gamma, GemvRope rope, int tiles, cudaStream_t s) {
    int m = 1, flags = 3;
    float eps = 1e-5f;
    void* args[] = {&out, &x, &w, &m, &rows, &cols, &flags, &gamma, &eps, &rope};
    // One wave of persistent CTAs, as many per SM as fit (gemv.rs: two for the normalising
    // modes at m = 1, whose ring is a third smaller).
    const size_t smem = smem_for(xs, cols);
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, 32 * NW, smem));
    static const int cap = getenv("FM_PER_SM") ? atoi(getenv("FM_PER_SM")) : 0;  // experiment: fewer per SM
    if (cap > 0) per_sm = std::min(per_sm, cap);
    // FM_BALANCED=1: as few CTAs as give the same number of rounds, so every CTA takes the
    // same number of tiles (qkv at m = 1: 192 CTAs x 2 tiles instead of 264 CTAs with 1 or 2).
    static const bool balanced = getenv("FM_BALANCED") && atoi(getenv("FM_BALANCED")) == 1;
    const int wave = g_sms * std::max(per_sm, 1), rounds = (tiles + wave - 1) / wave;
    const int grid = balanced ? (tiles + rounds - 1) / rounds : std::min(wave, tiles);
    launch_pdl(fn, dim3(grid), dim3(32 * NW), smem, args, s);
}

// The four positions of a layer and their buffers; kc / vc: one paged cache per weight set.
enum Pos { QKV_POS, O_POS, GATE_UP_POS, DOWN_POS };
struct Bufs {
    bf16 *x, *gamma, *attn, *act, *q, *o_plain, *gu_plain, *d_plain, *qkv_plain, *bias;
    std::vector<bf16*> kc, vc;
    u32 *positions, *slots, *ctx_lens, *table, *counters;
    u32 ctx, n_blocks;
    float *part_o, *part_lse;
    float2* cos_sin;
};

// How a chain runs attention between qkv and o.
// LEAN_TIGHT: the lean kernel on a grid of only the splits the context uses (the worker's
// graphs are planned for the longest context, so most of their 33 splits exit at once).
// LEAN_CLUSTER: the prototype whose splits merge through distributed shared memory, a
// cluster of FM_CLUSTER (default 8) CTAs along z; LEAN_CL_GRID: the lean kernel on the same
// grid (FM_CLUSTER splits) merging through global memory, the same bits.
enum Attn { NO_ATTN, LEAN_EARLY, LEAN_PLAIN, DEFAULT_EARLY, LEAN_TIGHT, LEAN_CLUSTER, LEAN_CL_GRID };
static const int CLUSTER = getenv("FM_CLUSTER") ? std::max(2, std::min(16, atoi(getenv("FM_CLUSTER")))) : 8;

// Decode attention of one sequence over set `set`'s cache: q -> attn.
static void attention(Attn how, const Bufs& b, int set, cudaStream_t s) {
    const bool lean = how != DEFAULT_EARLY;
    const void* fn = how == LEAN_CLUSTER ? (const void*)paged_decode_lean_cluster_hd128
                     : lean              ? (const void*)paged_decode_lean_hd128
                                         : (const void*)paged_decode_hd128;
    bf16* out = b.attn;
    const bf16 *q = b.q, *kc = b.kc[set], *vc = b.vc[set];
    float *po = b.part_o, *pl = b.part_lse;
    u32* counters = b.counters;
    const u32* table = b.table;
    const u32* ctx_lens = b.ctx_lens;
    u32 max_blocks = b.n_blocks, num_blocks = b.n_blocks, block = BLOCK, nh = HEADS, nkv = KV, group = HEADS / KV,
        gt = HEADS / KV, split_len = 0, n_splits = how == LEAN_TIGHT ? (b.ctx + MIN_SPLIT - 1) / MIN_SPLIT : SPLITS,
        min_split = MIN_SPLIT;
    if (how == LEAN_CLUSTER || how == LEAN_CL_GRID) n_splits = CLUSTER;
    n_splits = std::min(n_splits, (u32)SPLITS);
    float scale_log2 = 1.4426950408889634f / sqrtf((float)HD);
    void* args[] = {&out, &po, &pl, &counters, &q, &kc, &vc, &table, &max_blocks, &ctx_lens,
                    &num_blocks, &block, &nh, &nkv, &group, &gt, &split_len, &n_splits, &min_split, &scale_log2};
    const dim3 grid(1, KV, n_splits), threads(128);
    const int smem = lean ? LEAN_SMEM : DEF_SMEM;
    if (how == LEAN_PLAIN) {
        CK(cudaLaunchKernel(fn, grid, threads, args, smem, s));
    } else if (how == LEAN_CLUSTER) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = grid;
        cfg.blockDim = threads;
        cfg.dynamicSmemBytes = smem + DEC_CL_SMEM_EXTRA;
        cfg.stream = s;
        cudaLaunchAttribute attr[2];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        attr[1].id = cudaLaunchAttributeClusterDimension;
        attr[1].val.clusterDim.x = 1;
        attr[1].val.clusterDim.y = 1;
        attr[1].val.clusterDim.z = n_splits;
        cfg.attrs = attr;
        cfg.numAttrs = 2;
        CK(cudaLaunchKernelExC(&cfg, fn, args));
    } else {
        launch_pdl(fn, grid, threads, smem, args, s);
    }
}

static void run(Pos pos, bool fused, const Bufs& b, const bf16* w, int set, cudaStream_t s) {
    GemvRope none = {};
    switch (pos) {
        case QKV_POS:
            if (fused) {
                GemvRope r = {b.q, b.kc[set], b.vc[set], nullptr, b.positions, b.slots, b.cos_sin,
                              (u64)b.n_blocks * BLOCK, HEADS, KV, HD, HD / 2, MAX_POS, 0};
                launch((const void*)gemv_rope_p6, true, b.q, b.x, w, QKV, H, b.gamma, r, QKV / 16, s);
            } else {
                launch((const void*)gemv_bf16_p6, false, b.qkv_plain, b.x, w, QKV, H, nullptr, none, QKV / 16, s);
            }
            break;
        case O_POS:
            if (fused) launch((const void*)gemv_residual_p6, false, b.x, b.attn, w, H, H, nullptr, none, H / 16, s);
            else launch((const void*)gemv_bf16_p6, false, b.o_plain, b.attn, w, H, H, nullptr, none, H / 16, s);
            break;
        case GATE_UP_POS:
            if (fused) launch((const void*)gemv_swiglu_p6, true, b.act, b.x, w, 2 * FFN, H, b.gamma, none, FFN / 8, s);
            else launch((const void*)gemv_bf16_p6, false, b.gu_plain, b.x, w, 2 * FFN, H, nullptr, none, 2 * FFN / 16, s);
            break;
        case DOWN_POS:
            if (fused) launch((const void*)gemv_residual_p6, false, b.x, b.act, w, H, FFN, nullptr, none, H / 16, s);
            else launch((const void*)gemv_bf16_p6, false, b.d_plain, b.act, w, H, FFN, nullptr, none, H / 16, s);
            break;
    }
}

// FM_ALLOC=async (or model, below): from the stream-ordered pool (cudaMallocAsync), as
// cudarc allocates the worker's buffers (cuMemAllocAsync), instead of cudaMalloc. The values
// start `skip` bytes into the allocation (FM_W_OFFSET, below).
static bf16* alloc_fill(u64 n, u32 seed, float scale, float offset, u64 skip = 0) {
    char* p;
    static const char* how = getenv("FM_ALLOC");
    static const bool pool = how && (strcmp(how, "async") == 0 || strcmp(how, "model") == 0);
    if (pool) {
        CK(cudaMallocAsync((void**)&p, n * 2 + skip, 0));
        CK(cudaStreamSynchronize(0));
    } else {
        CK(cudaMalloc(&p, n * 2 + skip));
    }
    bf16* v = (bf16*)(p + skip);
    fill_random<<<1024, 256>>>(v, n, seed, scale, offset);
    return v;
}

int main() {
    CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
    const void* fns[] = {(const void*)gemv_bf16_p6, (const void*)gemv_rope_p6, (const void*)gemv_residual_p6,
                         (const void*)gemv_swiglu_p6};
    for (const void* fn : fns) CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    CK(cudaFuncSetAttribute((const void*)paged_decode_lean_hd128, cudaFuncAttributeMaxDynamicSharedMemorySize, LEAN_SMEM));
    CK(cudaFuncSetAttribute((const void*)paged_decode_hd128, cudaFuncAttributeMaxDynamicSharedMemorySize, DEF_SMEM));
    CK(cudaFuncSetAttribute((const void*)paged_decode_lean_cluster_hd128, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            LEAN_SMEM + DEC_CL_SMEM_EXTRA));
    if (CLUSTER > 8)
        CK(cudaFuncSetAttribute((const void*)paged_decode_lean_cluster_hd128,
                                cudaFuncAttributeNonPortableClusterSizeAllowed, 1));

    const int rows[4] = {QKV, H, 2 * FFN, H}, cols[4] = {H, H, H, FFN};
    const char* names[4] = {"qkv 6144x4096 (norm+rope)", "o 4096x4096 (residual)", "gate_up 28672x4096 (norm+swiglu)",
                            "down 4096x14336 (residual)"};
    // Weight sets the calls rotate over (FM_SETS, default 16: 7 GB, never in L2; the model
    // streams 32 layers, 14 GB, as FM_SETS=32 does).
    const int SETS = getenv("FM_SETS") ? std::max(1, std::min(32, atoi(getenv("FM_SETS")))) : 16;
    printf("%d weight sets (%.1f GB)\n", SETS, SETS * 2.0 * (6144.0 * 4096 + 4096.0 * 4096 + 28672.0 * 4096 + 4096.0 * 14336) / 1e9);
    std::vector<bf16*> W[4];
    for (int k = 0; k < 4; ++k) W[k].resize(SETS);
    // FM_W_SCALE: the weights' range (uniform in +-scale / 2; default 0.04). The model's
    // synthetic weights are uniform in +-0.0346 (std 0.02) for qkv and gate_up, smaller for o
    // and down: FM_W_SCALE=0.0692 draws gate_up's range for every matrix.
    const float w_scale = getenv("FM_W_SCALE") && atof(getenv("FM_W_SCALE")) > 0 ? (float)atof(getenv("FM_W_SCALE")) : 0.04f;
    if (getenv("FM_W_SCALE")) printf("weights uniform in +-%.4f\n", w_scale / 2);
    // FM_ALLOC=model: from the stream-ordered pool in the worker's order (per layer: the
    // attention norm, qkv, o, the FFN norm, gate_up, down), so the 8 KB norms sit between the
    // weights as in the model (the step's buffers come from the pool too); FM_W_OFFSET=bytes
    // (a multiple of 16): each weight starts that far into its own allocation. Both print
    // where each matrix starts within its 2 MiB.
    const bool model_order = getenv("FM_ALLOC") && strcmp(getenv("FM_ALLOC"), "model") == 0;
    const u64 w_off = getenv("FM_W_OFFSET") ? (u64)atoll(getenv("FM_W_OFFSET")) / 16 * 16 : 0;
    if (model_order) {
        for (int s = 0; s < SETS; ++s)
            for (const int k : {-1, 0, 1, -1, 2, 3}) {  // -1: a norm weight
                bf16* p = alloc_fill(k < 0 ? (u64)H : (u64)rows[k] * cols[k], 1000u * (k < 0 ? 9 : k) + s + 1,
                                     k < 0 ? 0.2f : w_scale, 0.f);
                if (k >= 0) W[k][s] = p;
            }
    } else {
        for (int k = 0; k < 4; ++k)
            for (int s = 0; s < SETS; ++s)
                W[k][s] = alloc_fill((u64)rows[k] * cols[k], 1000u * k + s + 1, w_scale, 0.f, w_off);
    }
    for (int k = 0; k < 4; ++k)
        printf("matrix %d starts at offsets mod 2 MiB: %llu, %llu, %llu KB\n", k,
               (unsigned long long)(((uintptr_t)W[k][0] % (2u << 20)) >> 10),
               (unsigned long long)(((uintptr_t)W[k][1 % SETS] % (2u << 20)) >> 10),
               (unsigned long long)(((uintptr_t)W[k][2 % SETS] % (2u << 20)) >> 10));
    // FM_PAD_GB=n: n GB more allocated (and zeroed) after the weights, as the model's KV
    // cache, sized from the free memory, maps ~100 GB beside its 15 GB of weights.
    if (getenv("FM_PAD_GB")) {
        const size_t pad = (size_t)(std::max(0.0, atof(getenv("FM_PAD_GB"))) * 1e9);
        void* p = nullptr;
        CK(cudaMalloc(&p, pad));
        CK(cudaMemset(p, 0, pad));
        printf("pad: %.1f GB allocated after the weights\n", pad / 1e9);
    }
    Bufs b = {};
    b.x = alloc_fill(H, 7, 2.f, 0.f);
    b.gamma = alloc_fill(H, 8, 0.2f, 1.f);
    b.attn = alloc_fill(H, 9, 2.f, 0.f);
    b.act = alloc_fill(FFN, 10, 2.f, 0.f);
    b.q = alloc_fill(HEADS * HD, 11, 1.f, 0.f);
    b.o_plain = alloc_fill(H, 12, 1.f, 0.f);
    b.gu_plain = alloc_fill(2 * FFN, 13, 1.f, 0.f);
    b.d_plain = alloc_fill(H, 14, 1.f, 0.f);
    b.qkv_plain = alloc_fill(QKV, 15, 1.f, 0.f);
    // The sequence: ctx positions, its newest (ctx - 1, written by qkv) in slot ctx - 1 of
    // an identity block table.
    b.ctx = getenv("FM_CTX") ? std::max(1, std::min(MAX_POS, atoi(getenv("FM_CTX")))) : 544;
    b.n_blocks = (b.ctx + BLOCK - 1) / BLOCK;
    printf("attention: context %u, %u blocks of %d, %d splits of at least %d positions\n", b.ctx, b.n_blocks, BLOCK, SPLITS, MIN_SPLIT);
    for (int s = 0; s < SETS; ++s) {
        b.kc.push_back(alloc_fill((u64)b.n_blocks * BLOCK * KV * HD, 2000u + s, 1.f, 0.f));
        b.vc.push_back(alloc_fill((u64)b.n_blocks * BLOCK * KV * HD, 3000u + s, 1.f, 0.f));
    }
    std::vector<u32> table(b.n_blocks);
    for (u32 i = 0; i < b.n_blocks; ++i) table[i] = i;
    CK(cudaMalloc(&b.table, b.n_blocks * 4));
    CK(cudaMemcpy(b.table, table.data(), b.n_blocks * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&b.positions, 4));
    CK(cudaMalloc(&b.slots, 4));
    CK(cudaMalloc(&b.ctx_lens, 4));
    const u32 pos = b.ctx - 1;
    CK(cudaMemcpy(b.positions, &pos, 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b.slots, &pos, 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b.ctx_lens, &b.ctx, 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&b.part_o, (size_t)HEADS * SPLITS * HD * 4));
    CK(cudaMalloc(&b.part_lse, (size_t)HEADS * SPLITS * 4));
    CK(cudaMalloc(&b.counters, KV * 4));
    CK(cudaMemset(b.counters, 0, KV * 4));  // the merging CTA leaves its counter at 0
    std::vector<float2> cs((size_t)MAX_POS * HD / 2);
    for (size_t i = 0; i < cs.size(); ++i) cs[i] = make_float2(0.6f, 0.8f);
    CK(cudaMalloc(&b.cos_sin, cs.size() * sizeof(float2)));
    CK(cudaMemcpy(b.cos_sin, cs.data(), cs.size() * sizeof(float2), cudaMemcpyHostToDevice));
    CK(cudaDeviceSynchronize());

    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    auto reset_x = [&] {
        fill_random<<<64, 256, 0, st>>>(b.x, H, 7, 2.f, 0.f);
        CK(cudaStreamSynchronize(st));
    };

    {
        // The cluster merge against the global one on the same splits: the same bits (the
        // global path is checked against the CPU reference in kernels/tests/cuda_attention.rs).
        reset_x();
        run(QKV_POS, true, b, W[0][0], 0, st);  // q and the newest K/V
        std::vector<unsigned short> got[2];
        for (int v = 0; v < 2; ++v) {
            CK(cudaMemsetAsync(b.attn, 0xff, H * 2, st));  // poisoned: NaN
            attention(v == 0 ? LEAN_CL_GRID : LEAN_CLUSTER, b, 0, st);
            got[v].resize(H);
            CK(cudaMemcpyAsync(got[v].data(), b.attn, H * 2, cudaMemcpyDeviceToHost, st));
            CK(cudaStreamSynchronize(st));
        }
        int diff = 0, nan = 0;
        for (int i = 0; i < H; ++i) {
            diff += got[0][i] != got[1][i];
            nan += (got[1][i] & 0x7fff) > 0x7f80;
        }
        printf("cluster merge (%d CTAs) vs global merge, %d splits: %d of %d outputs differ, %d NaN\n", CLUSTER,
               CLUSTER, diff, H, nan);
        if (diff + nan > 0) return 1;  // no timings for a prototype that is wrong
    }

    printf("%-34s | %-16s | %-16s | %s\n", "us per call (TB/s), 64 in a row", "plain", "fused", "fused - plain");
    for (int k = 0; k < 4; ++k) {
        const double bytes = 2.0 * rows[k] * cols[k];
        float us[2];
        for (int f = 0; f < 2; ++f) {
            std::vector<float> times;
            for (int rep = 0; rep < 7; ++rep) {
                reset_x();
                times.push_back(elapsed_us(st, 64, [&] {
                    for (int c = 0; c < 64; ++c) run((Pos)k, f == 1, b, W[k][c % SETS], c % SETS, st);
                }));
            }
            std::sort(times.begin(), times.end());
            us[f] = times[3];
        }
        printf("%-34s | %6.2f (%4.2f)    | %6.2f (%4.2f)    | %+5.2f\n", names[k], us[0], bytes / us[0] / 1e6, us[1],
               bytes / us[1] / 1e6, us[1] - us[0]);
    }

    struct Plan {
        const char* name;
        bool fused[4];
        Attn attn;
        bool gemvs;  // false: attention alone
    };
    const bool F = false, T = true;
    const Plan plans[] = {
        {"all plain", {F, F, F, F}, NO_ATTN, T},
        {"all fused (the model's chain)", {T, T, T, T}, NO_ATTN, T},
        {"fused, qkv plain", {F, T, T, T}, NO_ATTN, T},
        {"fused, o plain", {T, F, T, T}, NO_ATTN, T},
        {"fused, gate_up plain", {T, T, F, T}, NO_ATTN, T},
        {"fused, down plain", {T, T, T, F}, NO_ATTN, T},
        {"all plain (again)", {F, F, F, F}, NO_ATTN, T},
        {"all fused (again)", {T, T, T, T}, NO_ATTN, T},
        {"fused + attention (the model)", {T, T, T, T}, LEAN_EARLY, T},
        {"fused + attention, plain launch", {T, T, T, T}, LEAN_PLAIN, T},
        {"fused + default attention kernel", {T, T, T, T}, DEFAULT_EARLY, T},
        {"fused + attention, tight grid", {T, T, T, T}, LEAN_TIGHT, T},
        {"plain + attention", {F, F, F, F}, LEAN_EARLY, T},
        {"attention alone", {F, F, F, F}, LEAN_EARLY, F},
        {"fused + attention (again)", {T, T, T, T}, LEAN_EARLY, T},
        {"fused + attn, FM_CLUSTER splits", {T, T, T, T}, LEAN_CL_GRID, T},
        {"fused + attn, cluster merge", {T, T, T, T}, LEAN_CLUSTER, T},
        {"attn alone, FM_CLUSTER splits", {F, F, F, F}, LEAN_CL_GRID, F},
        {"attn alone, cluster merge", {F, F, F, F}, LEAN_CLUSTER, F},
        {"fused + attention (3rd)", {T, T, T, T}, LEAN_EARLY, T},
        {"fused + attn, cluster merge (again)", {T, T, T, T}, LEAN_CLUSTER, T},
    };
    const double layer_bytes = 2.0 * ((double)QKV * H + (double)H * H + 2.0 * FFN * H + (double)H * FFN);
    const double kv_bytes = 2.0 * 2.0 * b.ctx * KV * HD;
    printf("\nlayer chain, 32 layers in one graph, us per layer, median of 9 (min, max):\n");
    // FM_ONLY: only the plans whose name contains one of its '|'-separated parts (e.g. one
    // chain under a kernel tracer).
    const char* only = getenv("FM_ONLY");
    auto wanted = [&](const char* name) {
        if (!only) return true;
        for (const char* p = only; *p;) {
            const char* bar = strchr(p, '|');
            const size_t len = bar ? (size_t)(bar - p) : strlen(p);
            if (len > 0 && std::string(name).find(std::string(p, len)) != std::string::npos) return true;
            p += len + (bar ? 1 : 0);
        }
        return false;
    };
    for (const Plan& plan : plans) {
        if (!wanted(plan.name)) continue;
        cudaGraph_t graph;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int layer = 0; layer < 32; ++layer)
            for (int k = 0; k < 4; ++k) {
                if (plan.gemvs) run((Pos)k, plan.fused[k], b, W[k][layer % SETS], layer % SETS, st);
                if (k == QKV_POS && plan.attn != NO_ATTN) attention(plan.attn, b, layer % SETS, st);
            }
        CK(cudaStreamEndCapture(st, &graph));
        cudaGraphExec_t exec;
        CK(cudaGraphInstantiate(&exec, graph, 0));
        std::vector<float> times;
        // FM_REPS (default 10) replays, the first a warm-up; FM_REPS > 10 also prints the
        // mean of each tenth of them in order (does a long run slow down, e.g. at the power cap?).
        static const int reps = getenv("FM_REPS") ? std::max(10, atoi(getenv("FM_REPS"))) : 10;
        std::vector<float> in_order;
        for (int rep = 0; rep < reps; ++rep) {
            reset_x();  // the residual grows with every replay
            const float us = elapsed_us(st, 32, [&] { CK(cudaGraphLaunch(exec, st)); });
            if (rep > 0) times.push_back(us);
        }
        in_order = times;
        std::sort(times.begin(), times.end());
        // Bytes per layer: the GEMVs' weights and the K/V attention reads.
        const double bytes = (plan.gemvs ? layer_bytes : 0.0) + (plan.attn != NO_ATTN ? kv_bytes : 0.0);
        const float med = times[times.size() / 2];
        printf("  %-32s %6.1f us per layer (%4.2f TB/s), %6.1f, %6.1f\n", plan.name, med, bytes / med / 1e6, times[0],
               times.back());
        if (reps > 10) {
            printf("    by tenths of the run:");
            const size_t n = in_order.size();
            for (int t = 0; t < 10; ++t) {
                double sum = 0;
                const size_t a = n * t / 10, e = n * (t + 1) / 10;
                for (size_t i = a; i < e; ++i) sum += in_order[i];
                printf(" %.1f", sum / std::max<size_t>(1, e - a));
            }
            printf("\n");
        }
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
    }
    return 0;
}
