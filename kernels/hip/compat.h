// CUDA -> HIP names for the shared kernel sources in kernels/cuda/. The HIP loader
// (kernels/src/hip/sources.rs) and kernels/hip/check_sources.sh put this file in front of
// common.cuh, so the .cu files serve AMD GPUs too: there is no second copy of the kernels
// (where a file needs what HIP lacks, it carries a TESSERA_HIP branch: attention.cu's portable
// kernel, gemv.cu left empty). Only what the sources use is mapped.
//
// Warps: CUDA's warp is 32 lanes; an AMD wavefront is 64 (CDNA: gfx90a, gfx942) or 32 (RDNA in
// wave32 mode). WARP_SIZE is the target's width, and the kernels' lane loops, butterflies and
// per-warp arrays are written in terms of it. The *_sync shuffles take a lane mask on CUDA;
// every call in the sources passes the full warp, which on AMD is the whole wavefront, so the
// mask is dropped. HIP shuffles default to a width of warpSize (the whole wavefront).

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIP__)

// hipRTC pre-includes the runtime's device declarations; hipcc --genco does not.
#ifndef __HIPCC_RTC__
#include <hip/hip_runtime.h>
#endif

#ifndef TESSERA_HIP
#define TESSERA_HIP 1
#endif

#ifdef __AMDGCN_WAVEFRONT_SIZE
#define WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#define WARP_SIZE 64
#endif

// The host sizes launches for the width it expects of the device's arch (kernels/src/hip/gfx.rs)
// and passes it here; a compiler that picks another width (an RDNA part built for wave64)
// stops the build instead of producing wrong reductions.
#ifdef TESSERA_EXPECT_WARP_SIZE
static_assert(WARP_SIZE == TESSERA_EXPECT_WARP_SIZE, "wavefront width differs from the host's launch shapes");
#endif

#define __shfl_xor_sync(mask, v, lane_mask) __shfl_xor((v), (lane_mask))
#define __shfl_up_sync(mask, v, delta) __shfl_up((v), (delta))
#define __shfl_sync(mask, v, src) __shfl((v), (src))
#define __any_sync(mask, pred) __any(pred)

// A wavefront runs in lock step; what __syncwarp adds is ordering of the wavefront's shared
// memory accesses around the point (LDS writes are visible to the wavefront after a
// workgroup-scope fence). A macro, like the shuffles, so it also wins over the *_sync
// functions newer ROCm releases declare (which want 64-bit masks).
__device__ __forceinline__ void tessera_syncwarp() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
    __builtin_amdgcn_wave_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
#define __syncwarp() tessera_syncwarp()

#endif
