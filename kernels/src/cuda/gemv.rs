//! Launcher of the decode GEMM (`kernels/cuda/gemv.cu`): `out = x · Wᵀ` for at most
//! [`MAX_M`] rows of `x`, W `[rows, cols]` streamed once from HBM through a cp.async ring,
//! the products on tensor cores. At these batch sizes the op is a pure weight stream and
//! cuBLASLt leaves bandwidth unused; [`Device::matmul`] / [`Device::matmul_f32`] route here
//! when [`applies`] (see `gemm.rs`), so callers change nothing.
//!
//! A tile is 16 output features (rows of W) for all `m` rows of x; a CTA's warps split its
//! columns. The grid is one wave of persistent CTAs looping over tiles (sized from the
//! kernel's occupancy, computed once at load), launched with programmatic dependent launch
//! so a GEMV's start overlaps the end of the kernel before it. The launch allocates nothing
//! and never synchronises, so it can be captured in a CUDA graph.
//!
//! H200, m = 1, back-to-back calls on rotating weight copies (µs, GEMV vs cuBLASLt):
//! qkv 6144×4096 15.2 vs 16.9, o 4096×4096 10.7 vs 13.3, down 4096×14336 31.8 vs 32.8,
//! SmolLM2's 576-wide shapes 3.1-3.4 vs ~7 (3.1-4.5 for cuBLASLt inside a CUDA graph).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

use cudarc::driver::sys::{self, CUfunction_attribute_enum};
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DevicePtrMut};

use super::device::{dev_err, Buf, Device};
use crate::error::check;
use crate::KernelError;
use half::bf16;

/// Most rows of `x` the kernel takes (the mma's N).
pub(crate) const MAX_M: usize = 8;
/// Output features per tile (the mma's M).
const TILE_ROWS: usize = 16;
/// Columns one warp takes per ring stage.
const CHUNK_COLS: usize = 64;
/// Shared memory per warp: `stages` ring stages of 6 × 32 16-byte slots, plus two buffers
/// of parked accumulators (16 × 8 f32).
const STAGE_BYTES: usize = 6 * 32 * 16;
const RED_BYTES: usize = 2 * 16 * 8 * 4;
/// The kernels' `__launch_bounds__` in warps.
const MAX_WARPS: usize = 16;
/// Ring depths compiled in gemv.cu (`gemv_{bf16,f32}_p{2,4,6}`).
const STAGES: [usize; 3] = [2, 4, 6];

/// Launch settings: the best geometric mean, among the settings that keep the default
/// launch semantics (PDL mode <= 1), of the H200 sweep (`bench_gemv_tuning` in
/// tests/cuda_gemv.rs) over the shapes the GEMV takes (Llama-8B qkv / o / down at m = 1
/// and 8, SmolLM2's five).
const DEFAULT_STAGES: usize = 6;
const DEFAULT_WARPS: usize = 8;
const DEFAULT_PERSISTENT: bool = true;
/// 0: plain launch; 1: programmatic dependent launch, the kernel waits for its prerequisite
/// before touching memory (same semantics as a plain launch, ~1 µs less per call after
/// another kernel); 2: as 1 but the first copies of W are queued before the wait (another
/// ~1-1.5 µs when the kernel before triggers early, and only correct when it did not write W).
const DEFAULT_PDL: u8 = 1;
/// Largest W (values) the GEMV takes. Past it (Llama-8B gate_up 28672×4096, the LM heads)
/// cuBLASLt streams as fast or faster (H200: gate_up 57.9 µs vs 59-62 µs; LM heads within
/// ±3%), so `gemm_into` keeps cuBLASLt there.
const MAX_WEIGHTS: usize = 64 << 20;

/// Whether `gemm_into` takes the GEMV for `m` rows of x against W `[rows, cols]`: small
/// batches, W up to [`MAX_WEIGHTS`] values in rows of whole 16-byte vectors, and sizes the
/// kernel's i32 indices hold.
pub(crate) fn applies(m: usize, rows: usize, cols: usize) -> bool {
    (1..=MAX_M).contains(&m)
        && cols.is_multiple_of(8)
        && rows.checked_mul(cols).is_some_and(|n| n <= MAX_WEIGHTS)
        && i32::try_from(rows).is_ok()
        && i32::try_from(cols).is_ok()
}

/// One compiled kernel (output type, ring depth) and what it needs per CTA.
struct Kernel {
    func: CudaFunction,
    smem_per_warp: usize,
    /// Warps per CTA its shared memory allows on this device (<= MAX_WARPS).
    max_warps: usize,
    /// CTAs one SM holds at `w` warps per CTA (index w), 0 where none fits.
    blocks_per_sm: [u32; MAX_WARPS + 1],
}

impl Kernel {
    fn new(func: CudaFunction, stages: usize, smem_optin: usize) -> Result<Self, KernelError> {
        const OP: &str = "cuda_gemv_load";
        let smem_per_warp = stages * STAGE_BYTES + RED_BYTES;
        let max_warps = (smem_optin / smem_per_warp).min(MAX_WARPS);
        check(max_warps >= 1, OP, || {
            format!("the device allows {smem_optin} bytes of shared memory per block, a warp needs {smem_per_warp}")
        })?;
        let bytes = i32::try_from(max_warps * smem_per_warp).unwrap_or(i32::MAX);
        func.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes)
            .map_err(dev_err(OP))?;
        let mut blocks_per_sm = [0u32; MAX_WARPS + 1];
        for (warps, b) in blocks_per_sm.iter_mut().enumerate().take(max_warps + 1).skip(1) {
            // 0 (no persistent grid, one CTA per tile) if the driver cannot say.
            *b = func
                .occupancy_max_active_blocks_per_multiprocessor(32 * warps as u32, warps * smem_per_warp, None)
                .unwrap_or(0);
        }
        Ok(Kernel { func, smem_per_warp, max_warps, blocks_per_sm })
    }
}

/// The GEMV kernels of module `gemv` and the launch settings in force.
pub(crate) struct GemvKernels {
    /// Indexed like [`STAGES`].
    bf16: Vec<Kernel>,
    f32: Vec<Kernel>,
    stages: AtomicUsize,
    warps: AtomicUsize,
    persistent: AtomicBool,
    pdl: AtomicU8,
}

impl GemvKernels {
    /// Resolves the kernels through `f(module, function)`, raises their dynamic shared
    /// memory limit to what `smem_optin` (the device's per-block opt-in maximum) allows and
    /// records their occupancy.
    pub(crate) fn load(
        f: &dyn Fn(&str, &str) -> Result<CudaFunction, KernelError>,
        smem_optin: usize,
    ) -> Result<Self, KernelError> {
        let load = |ty: &str| -> Result<Vec<Kernel>, KernelError> {
            STAGES.iter().map(|&s| Kernel::new(f("gemv", &format!("gemv_{ty}_p{s}"))?, s, smem_optin)).collect()
        };
        Ok(GemvKernels {
            bf16: load("bf16")?,
            f32: load("f32")?,
            stages: AtomicUsize::new(DEFAULT_STAGES),
            warps: AtomicUsize::new(DEFAULT_WARPS),
            persistent: AtomicBool::new(DEFAULT_PERSISTENT),
            pdl: AtomicU8::new(DEFAULT_PDL),
        })
    }
}

impl Device {
    /// `out = x · Wᵀ` through the GEMV; `out_f32` says whether `T` is f32 (else bf16).
    /// The caller ([`Device::matmul`]) checked the buffers' lengths against the shape and
    /// that [`applies`] holds.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemv_into<T>(
        &self,
        out: &mut CudaSlice<T>,
        out_f32: bool,
        x: &Buf<bf16>,
        m: usize,
        w: &Buf<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_gemv";
        let g = &self.kernels.gemv;
        let si = STAGES.iter().position(|&s| s == g.stages.load(Ordering::Relaxed)).unwrap_or(0);
        let k = if out_f32 { &g.f32[si] } else { &g.bf16[si] };
        // Warps: the setting, within the kernel's limits and the chunk count, then evened
        // out so no warp has a chunk more per tile than needed (9 chunks: 5 warps of 2, not
        // 8 with one warp doing two).
        let chunks = cols.div_ceil(CHUNK_COLS);
        let warps = g.warps.load(Ordering::Relaxed).clamp(1, k.max_warps).min(chunks);
        let warps = chunks.div_ceil(chunks.div_ceil(warps));
        let tiles = rows.div_ceil(TILE_ROWS);
        let wave = self.sm_count * k.blocks_per_sm[warps] as usize;
        let grid = if g.persistent.load(Ordering::Relaxed) && wave > 0 { tiles.min(wave) } else { tiles };
        let pdl = g.pdl.load(Ordering::Relaxed);

        let shape_err = || KernelError::Shape { op: OP, detail: format!("m={m} {rows}x{cols} exceeds i32") };
        let mut mi = i32::try_from(m).map_err(|_| shape_err())?;
        let mut ri = i32::try_from(rows).map_err(|_| shape_err())?;
        let mut ci = i32::try_from(cols).map_err(|_| shape_err())?;
        let mut early = i32::from(pdl == 2);
        let grid = u32::try_from(grid).map_err(|_| shape_err())?;

        let s = &self.stream;
        let (op, _g1) = out.device_ptr_mut(s);
        let (xp, _g2) = x.inner.device_ptr(s);
        let (wp, _g3) = w.inner.device_ptr(s);
        let (mut op, mut xp, mut wp) = (op, xp, wp);
        let mut params: [*mut c_void; 7] = [
            (&mut op as *mut sys::CUdeviceptr).cast(),
            (&mut xp as *mut sys::CUdeviceptr).cast(),
            (&mut wp as *mut sys::CUdeviceptr).cast(),
            (&mut mi as *mut i32).cast(),
            (&mut ri as *mut i32).cast(),
            (&mut ci as *mut i32).cast(),
            (&mut early as *mut i32).cast(),
        ];
        // SAFETY: a zeroed attribute is valid plain data; id and value are set together.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: 32 * warps as u32,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: (warps * k.smem_per_warp) as u32,
            hStream: s.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(pdl > 0),
        };
        s.context().bind_to_thread().map_err(dev_err(OP))?;
        // SAFETY: `params` points at live locals whose types match the kernel's parameters
        // (void*, const bf16*, const bf16*, int, int, int, int); the caller checked out / x /
        // w hold m x rows, m x cols and rows x cols elements, and cols % 8 == 0 keeps every
        // 16-byte copy aligned and in bounds; warps <= max_warps keeps the shared memory
        // within the limit set at load; grid <= tiles as the kernel requires.
        unsafe { sys::cuLaunchKernelEx(&cfg, k.func.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(dev_err(OP))
    }

    /// Overrides the GEMV's launch settings (tuning and benchmarks): ring `stages` (2, 4 or
    /// 6), `warps` per CTA (1..=16), a `persistent` one-wave grid or one CTA per tile, and
    /// `pdl` (0: plain launch, 1: programmatic dependent launch, 2: as 1 with W's first
    /// copies queued before waiting for the previous kernel, which must then not write W).
    #[doc(hidden)]
    pub fn set_gemv_tuning(&self, stages: usize, warps: usize, persistent: bool, pdl: u8) -> Result<(), KernelError> {
        const OP: &str = "cuda_gemv_tuning";
        check(STAGES.contains(&stages), OP, || format!("stages {stages} not compiled (have {STAGES:?})"))?;
        check((1..=MAX_WARPS).contains(&warps), OP, || format!("warps {warps} outside 1..={MAX_WARPS}"))?;
        check(pdl <= 2, OP, || format!("pdl mode {pdl} is not 0, 1 or 2"))?;
        let g = &self.kernels.gemv;
        g.stages.store(stages, Ordering::Relaxed);
        g.warps.store(warps, Ordering::Relaxed);
        g.persistent.store(persistent, Ordering::Relaxed);
        g.pdl.store(pdl, Ordering::Relaxed);
        Ok(())
    }
}
