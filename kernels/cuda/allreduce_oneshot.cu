// One-shot sum all-reduce of a bf16 buffer over the GPUs of a tensor-parallel group,
// through peer memory (CUDA IPC or same-process peer access over NVLink), for the small
// messages of decode where NCCL's ~12 us floor dominates (ANCHORS.md). No NVLink multicast.
//
// Every rank owns one "region" of device memory that its peers have mapped
// (kernels/src/cuda/ipc_allreduce.rs sets it up; the byte layout below must match
// kernels/src/cuda/ipc_record.rs):
//
//   [0, 2048)      u32 flags[ONESHOT_MAX_BLOCKS][ONESHOT_MAX_WORLD]: flags[b][src] is written
//                  only by rank `src` (its block b), read only by the owner (its block b)
//   [2048, 2304)   u32 epochs[ONESHOT_MAX_BLOCKS]: how many calls block b has completed;
//                  local to the owner, advanced by the kernel itself (graph-safe: a
//                  recorded launch needs no host-side per-call state)
//   [2304, 2312)   u32 error word (set before a timeout trap), u32 spare
//   [4096, ...)    data[2][ONESHOT_MAX_WORLD][cap_bytes]: data[parity][src] holds rank
//                  `src`'s input of odd and even calls (parity = epoch & 1), written by
//                  rank `src` only (remote stores over NVLink), read by the owner only
//
// One call (every rank launches the same grid for the same n; block b of every rank handles
// the same element indices, so blocks synchronise pairwise and never across the grid):
//   1. block b pushes its indices of `buf` into data[parity][rank] of every peer's region
//      (stores to peer memory are posted: nothing waits for a round trip);
//   2. __syncthreads, then thread `p` (one per peer) publishes "epoch e done" in flags[b][rank]
//      of peer p's region with a system-scope release store;
//   3. thread `p` spins on flags[b][p] of its own region until peer p's block b reached e
//      (acquire), then __syncthreads: the peers' inputs are now in local memory;
//   4. every thread sums its indices over the ranks in rank order 0..world (its own value
//      from `buf`, the peers' from data[parity][src] of its own region; f32 accumulation,
//      one bf16 rounding), so every rank gets bit-identical results, and writes them into
//      `buf`, or, given a `residual` stream, adds them to it instead (residual =
//      bf16(residual + bf16(sum)), the rounding of an all-reduce followed by a separate add);
//   5. thread 0 stores epochs[b] = e.
//
// Memory ordering. Release: the block's plain stores to peer memory in step 1 happen before
// the flag store of step 2 through bar.sync (CTA scope), and the flag is stored with
// st.release.sys; PTX release operations are cumulative, so every store the releasing thread
// has observed through the barrier is visible system-wide before the flag is. Acquire: the
// spinning thread's ld.acquire.sys on its own flag, then bar.sync, orders the block's later
// reads of the pushed data after the peer's release; that data is loaded with ld.volatile
// (no L1 caching, so a line cached by an earlier call over the same addresses can never be
// served stale).
//
// Reuse races. A flag slot has a single writer and only grows (wrap-safe signed compare
// `flag - e >= 0`, not equality: a fast peer may already have published e + 1 when a slow
// rank looks for e). Data slots alternate by parity: a rank pushes into data[e & 1][rank] of
// peer p in call e only after its call e - 1 completed, which needed p's e - 1 flag, which p
// publishes only after its whole call e - 2 (the last reader of that slot) finished (stream
// order: this kernel is never launched programmatically, and a kernel after it that starts
// early waits for its completion before finishing, so call e - 1 has ended before call e
// starts). So no second barrier is needed.
//
// Pushing means a rank writes into its peers' memory before it knows they are alive: into
// a crashed peer's mapping (the writes fault, which loses this rank's context: the worker
// then restarts, see kernels/src/error.rs context_lost) or, in principle, into memory a
// restarted process reuses; a replica is re-formed with new regions, never the old ones.
//
// A peer that never arrives (crashed process) would spin the GPU forever: after
// `timeout_ns` (0: never) the kernel records the waiting block and peer in the error word
// and traps, which fails the rank's stream with a launch error instead of hanging it.

// NVIDIA only (PTX release/acquire at system scope, CUDA IPC): on HIP the module is empty and
// RCCL would carry every all-reduce.
#ifndef TESSERA_HIP

#define ONESHOT_MAX_WORLD 8
#define ONESHOT_MAX_BLOCKS 64
#define ONESHOT_EPOCHS_OFFSET 2048
#define ONESHOT_ERROR_OFFSET 2304
#define ONESHOT_DATA_OFFSET 4096

__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint4 ld_volatile_v4(const uint4* p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

__device__ __forceinline__ bf16 ld_volatile_bf16(const bf16* p) {
    unsigned short v;
    asm volatile("ld.volatile.global.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return (bf16)v;
}

// Every rank's region as mapped in this process, passed by value (kernel parameter space).
struct OneshotRegions {
    u64 p[ONESHOT_MAX_WORLD];
};


__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// `buf`: [n] bf16, this rank's partial sums in, the group's sums out (in place).
// `regions.p[r]`: rank r's region as mapped in this process (r < world; the rest unused);
// `self` = regions.p[rank]. The array is only ever indexed by unrolled constants: a run-time
// index would copy it to local memory.
// `residual`: null (the sums go to `buf`) or [n] bf16 the sums are added to (buf unchanged).
// `early_dependents`: let the next kernel launch at once (a programmatically launched GEMV
// queues its weight copies beside this one; it waits for this grid before reading results).
// Grid: the same number of blocks (<= ONESHOT_MAX_BLOCKS) on every rank, every call.
extern "C" __global__ void __launch_bounds__(512) allreduce_oneshot(bf16* buf, u64 n, u32 rank, u32 world,
                                                                    u64 cap_bytes, u64 timeout_ns, char* self,
                                                                    const OneshotRegions regions, bf16* residual,
                                                                    u32 early_dependents) {
    const u32 b = blockIdx.x, tid = threadIdx.x;
    // Launched programmatically (the host's choice), wait for the kernel before this one
    // first: its partial sums, and the previous call's epochs, must be complete. A no-op for
    // a plain launch.
    PDL_WAIT();
    if (early_dependents) PDL_TRIGGER();
    u32* epochs = (u32*)(self + ONESHOT_EPOCHS_OFFSET);

    __shared__ u32 s_epoch;
    // Only thread 0 of block b ever touches epochs[b]; stream order separates the calls.
    if (tid == 0) s_epoch = epochs[b] + 1u;
    __syncthreads();
    const u32 epoch = s_epoch;
    const u64 data_off = ONESHOT_DATA_OFFSET + (u64)(epoch & 1u) * ONESHOT_MAX_WORLD * cap_bytes;

    const u64 n_vec = n / 8, tail = n % 8;
    const u64 gtid = (u64)b * blockDim.x + tid, stride = (u64)gridDim.x * blockDim.x;
    uint4* buf_v = (uint4*)buf;

    // 1. Push this block's indices of the input into every peer's slot for this rank.
    {
        const u64 slot_off = data_off + (u64)rank * cap_bytes;
#pragma unroll
        for (u32 r = 0; r < ONESHOT_MAX_WORLD; ++r) {
            if (r < world && r != rank) {
                uint4* dst = (uint4*)((char*)regions.p[r] + slot_off);
                for (u64 v = gtid; v < n_vec; v += stride) dst[v] = buf_v[v];
                if (gtid < tail) ((bf16*)dst)[n_vec * 8 + gtid] = buf[n_vec * 8 + gtid];
            }
        }
    }
    __syncthreads();

    // 2. Release: tell every peer this block's share of call `epoch` is in place.
#pragma unroll
    for (u32 r = 0; r < ONESHOT_MAX_WORLD; ++r) {
        if (r == tid && r < world && r != rank) {
            st_release_sys((u32*)regions.p[r] + b * ONESHOT_MAX_WORLD + rank, epoch);
        }
    }
    // 3. Acquire: wait until every peer's block b has published call `epoch` (or later).
    if (tid < world && tid != rank) {
        const u32* flag = (const u32*)self + b * ONESHOT_MAX_WORLD + tid;
        const u64 t0 = timeout_ns ? global_timer_ns() : 0;
        while ((int)(ld_acquire_sys(flag) - epoch) < 0) {
            if (timeout_ns && global_timer_ns() - t0 > timeout_ns) {
                // 0x80000000 | block << 8 | peer: which wait gave up, for the host to report.
                atomicExch((u32*)(self + ONESHOT_ERROR_OFFSET), 0x80000000u | (b << 8) | tid);
                __threadfence_system();
                __trap();
            }
        }
    }
    __syncthreads();

    // 4. Sum over the ranks in rank order (the same order on every rank: identical bits).
    for (u64 v = gtid; v < n_vec; v += stride) {
        uint4 x[ONESHOT_MAX_WORLD];
#pragma unroll
        for (u32 r = 0; r < ONESHOT_MAX_WORLD; ++r) {
            if (r < world) {
                x[r] = r == rank ? buf_v[v] : ld_volatile_v4((const uint4*)(self + data_off + (u64)r * cap_bytes) + v);
            }
        }
        float acc[8], t[8];
        unpack8(x[0], acc);
#pragma unroll
        for (u32 r = 1; r < ONESHOT_MAX_WORLD; ++r) {
            if (r < world) {
                unpack8(x[r], t);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[i] += t[i];
            }
        }
        if (residual) {
            float r[8];
            unpack8(((const uint4*)residual)[v], r);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] = bf16_to_f32(f32_to_bf16(acc[i])) + r[i];
            ((uint4*)residual)[v] = pack8(acc);
        } else {
            buf_v[v] = pack8(acc);
        }
    }
    if (gtid < tail) {
        const u64 i = n_vec * 8 + gtid;
        float acc = 0.f;
#pragma unroll
        for (u32 r = 0; r < ONESHOT_MAX_WORLD; ++r) {
            if (r < world) {
                const bf16 x =
                    r == rank ? buf[i] : ld_volatile_bf16((const bf16*)(self + data_off + (u64)r * cap_bytes) + i);
                acc = r == 0 ? bf16_to_f32(x) : acc + bf16_to_f32(x);
            }
        }
        if (residual) {
            residual[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(acc)) + bf16_to_f32(residual[i]));
        } else {
            buf[i] = f32_to_bf16(acc);
        }
    }

    // 5. This block finished call `epoch`.
    if (tid == 0) epochs[b] = epoch;
}

#endif  // TESSERA_HIP
