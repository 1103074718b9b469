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
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

use super::device::{dev_err, Buf, Device};
use super::launch_ex::launch_ex;
use crate::error::check;
use crate::KernelError;
use half::bf16;

/// Most rows of `x` the kernel takes (the mma's N).
pub(crate) const MAX_M: usize = 8;
/// Output features per tile (the mma's M).
const TILE_ROWS: usize = 16;
/// Columns one warp takes per ring stage.
const CHUNK_COLS: usize = 64;
/// A ring stage's 16-byte slots per lane (two W rows and x at two column halves; the
/// modes reading a normalised x from shared memory use the four W slots only).
const SLOT_BYTES: usize = 32 * 16;
/// Two buffers of parked accumulators per warp (16 × 8 f32).
const RED_BYTES: usize = 2 * 16 * 8 * 4;
/// The kernels' `__launch_bounds__` in warps.
const MAX_WARPS: usize = 16;
/// The normalising modes' warps' sums of squares, after the rows of x (GEMV_NORM_SUMS_BYTES).
const NORM_SUMS_BYTES: usize = MAX_WARPS * MAX_M * 4;
/// Ring depths compiled in gemv.cu (`gemv_{mode}_p{2,4,6}`).
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
    shape_fits(m, rows, cols) && rows.checked_mul(cols).is_some_and(|n| n <= MAX_WEIGHTS)
}

/// What every mode of the kernel needs of the shape.
fn shape_fits(m: usize, rows: usize, cols: usize) -> bool {
    (1..=MAX_M).contains(&m) && cols.is_multiple_of(8) && i32::try_from(rows).is_ok() && i32::try_from(cols).is_ok()
}

/// What the kernel does with x and its sums (gemv.cu's modes).
/// The discriminants index [`Mode::ALL`] and [`GemvKernels`]'s kernel sets.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Mode {
    /// `out = x · Wᵀ`, bf16.
    Bf16 = 0,
    /// `out = x · Wᵀ`, f32.
    F32 = 1,
    /// `out = rms_norm(x) · Wᵀ`, the norm computed by every CTA into shared memory.
    Norm = 2,
    /// `out = silu(g) * u`, `g | u = rms_norm(x) · Wᵀ` for W the packed gate|up weight.
    NormSwiglu = 3,
    /// `out += x · Wᵀ` on the bf16 residual stream.
    Residual = 4,
    /// `Norm` for the packed q|k|v weight, with the bias, RoPE and the q / paged K/V writes
    /// of `qkv_rope_write` in the epilogue ([`GemvRope`]; `out` unused).
    NormRope = 5,
}

/// The `NormRope` epilogue's operands, laid out as gemv.cu's `GemvRope` (passed by value);
/// zeros for the other modes.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct GemvRope {
    pub q_out: sys::CUdeviceptr,
    pub k_cache: sys::CUdeviceptr,
    pub v_cache: sys::CUdeviceptr,
    pub bias: sys::CUdeviceptr,
    pub positions: sys::CUdeviceptr,
    pub slots: sys::CUdeviceptr,
    pub cos_sin: sys::CUdeviceptr,
    pub n_slots: u64,
    pub n_heads: u32,
    pub n_kv: u32,
    pub head_dim: u32,
    pub half_rot: u32,
    pub max_pos: u32,
    pub pad: u32,
}

impl Mode {
    const ALL: [Mode; 6] = [Mode::Bf16, Mode::F32, Mode::Norm, Mode::NormSwiglu, Mode::Residual, Mode::NormRope];

    fn kernel_name(self) -> &'static str {
        match self {
            Mode::Bf16 => "bf16",
            Mode::F32 => "f32",
            Mode::Norm => "norm",
            Mode::NormSwiglu => "swiglu",
            Mode::Residual => "residual",
            Mode::NormRope => "rope",
        }
    }

    /// Whether x is normalised into shared memory (the ring then carries W only).
    fn normalises(self) -> bool {
        matches!(self, Mode::Norm | Mode::NormSwiglu | Mode::NormRope)
    }

    fn slots(self) -> usize {
        if self.normalises() {
            4
        } else {
            6
        }
    }
}

/// Row pitch (values) of the normalised x in shared memory, as gemv.cu's `gemv_xn_pitch`:
/// the smallest `>= cols` that is 32 mod 64 (bank-conflict-free fragment reads).
fn xn_pitch(cols: usize) -> usize {
    cols + (96 - cols % 64) % 64
}

/// Shared memory a CTA of a normalising mode needs beyond its warps' rings: the rows of
/// x * gamma and the warps' sums of squares.
fn xn_bytes(m: usize, cols: usize) -> usize {
    m * xn_pitch(cols) * 2 + NORM_SUMS_BYTES
}

/// One compiled kernel (mode, ring depth) and what it needs per CTA.
struct Kernel {
    func: CudaFunction,
    smem_per_warp: usize,
    /// Warps per CTA its shared memory allows on this device (<= MAX_WARPS), without the
    /// normalised rows.
    max_warps: usize,
    /// CTAs one SM holds at `w` warps per CTA (index w), 0 where none fits (plain modes;
    /// the normalising ones ask the driver at launch, their memory depends on m and cols).
    blocks_per_sm: [u32; MAX_WARPS + 1],
}

impl Kernel {
    fn new(func: CudaFunction, mode: Mode, stages: usize, smem_optin: usize) -> Result<Self, KernelError> {
        const OP: &str = "cuda_gemv_load";
        let smem_per_warp = stages * mode.slots() * SLOT_BYTES + RED_BYTES;
        let max_warps = (smem_optin / smem_per_warp).min(MAX_WARPS);
        check(max_warps >= 1, OP, || {
            format!("the device allows {smem_optin} bytes of shared memory per block, a warp needs {smem_per_warp}")
        })?;
        let limit = if mode.normalises() { smem_optin } else { max_warps * smem_per_warp };
        let bytes = i32::try_from(limit).unwrap_or(i32::MAX);
        func.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes)
            .map_err(dev_err(OP))?;
        let mut blocks_per_sm = [0u32; MAX_WARPS + 1];
        if !mode.normalises() {
            for (warps, b) in blocks_per_sm.iter_mut().enumerate().take(max_warps + 1).skip(1) {
                // 0 (no persistent grid, one CTA per tile) if the driver cannot say.
                *b = func
                    .occupancy_max_active_blocks_per_multiprocessor(32 * warps as u32, warps * smem_per_warp, None)
                    .unwrap_or(0);
            }
        }
        Ok(Kernel { func, smem_per_warp, max_warps, blocks_per_sm })
    }
}

/// The GEMV kernels of module `gemv` and the launch settings in force.
pub(crate) struct GemvKernels {
    /// Indexed by mode (as [`Mode::ALL`]), then like [`STAGES`].
    kernels: Vec<Vec<Kernel>>,
    smem_optin: usize,
    stages: AtomicUsize,
    warps: AtomicUsize,
    persistent: AtomicBool,
    pdl: AtomicU8,
    /// Whether a warp takes a contiguous run of a tile's 64-column chunks instead of every
    /// nw-th one: on by default (H200, Llama-3-8B decode: batch 1 233 -> 240 tok/s, batch 4
    /// 873 -> 902; bench/RESULTS.md); `TESSERA_GEMV_CONTIGUOUS=0` at load turns it off.
    contiguous: bool,
}

impl GemvKernels {
    /// Resolves the kernels through `f(module, function)`, raises their dynamic shared
    /// memory limit to what `smem_optin` (the device's per-block opt-in maximum) allows and
    /// records their occupancy.
    pub(crate) fn load(
        f: &dyn Fn(&str, &str) -> Result<CudaFunction, KernelError>,
        smem_optin: usize,
    ) -> Result<Self, KernelError> {
        let kernels = Mode::ALL
            .iter()
            .map(|&mode| {
                STAGES
                    .iter()
                    .map(|&s| {
                        let func = f("gemv", &format!("gemv_{}_p{s}", mode.kernel_name()))?;
                        Kernel::new(func, mode, s, smem_optin)
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(GemvKernels {
            kernels,
            smem_optin,
            stages: AtomicUsize::new(DEFAULT_STAGES),
            warps: AtomicUsize::new(DEFAULT_WARPS),
            persistent: AtomicBool::new(DEFAULT_PERSISTENT),
            pdl: AtomicU8::new(DEFAULT_PDL),
            contiguous: std::env::var("TESSERA_GEMV_CONTIGUOUS").as_deref() != Ok("0"),
        })
    }

    /// Whether a normalising mode takes `m` rows of `cols` values: the rows next to the
    /// smallest ring of one warp in a CTA's shared memory.
    pub(crate) fn normalised_fits(&self, m: usize, cols: usize) -> bool {
        let ring = STAGES[0] * Mode::Norm.slots() * SLOT_BYTES + RED_BYTES;
        xn_bytes(m, cols) + ring <= self.smem_optin
    }
}

/// One GEMV launch: the mode and its operands. `gamma` / `eps` are the norm's (normalising
/// modes; ignored otherwise), `rope` the `NormRope` epilogue's (zeros otherwise).
pub(crate) struct GemvCall<'a> {
    pub mode: Mode,
    pub x: &'a Buf<bf16>,
    pub m: usize,
    pub w: &'a Buf<bf16>,
    pub rows: usize,
    pub cols: usize,
    pub gamma: Option<&'a Buf<bf16>>,
    pub eps: f32,
    pub rope: GemvRope,
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
        let mode = if out_f32 { Mode::F32 } else { Mode::Bf16 };
        let (op, _g) = out.device_ptr_mut(&self.stream);
        let call = GemvCall { mode, x, m, w, rows, cols, gamma: None, eps: 0.0, rope: GemvRope::default() };
        self.gemv_launch(op, &call)
    }

    /// Launches `call` writing to `out` (a device pointer the caller holds the buffer of,
    /// checked against the mode's output shape). Checks what the kernel requires of the
    /// shape; the caller checked the buffers' lengths.
    pub(crate) fn gemv_launch(&self, out: sys::CUdeviceptr, call: &GemvCall<'_>) -> Result<(), KernelError> {
        const OP: &str = "cuda_gemv";
        let GemvCall { mode, x, m, w, rows, cols, gamma, eps, rope } = *call;
        let shape_err = || KernelError::Shape { op: OP, detail: format!("m={m} {rows}x{cols} ({mode:?})") };
        if !shape_fits(m, rows, cols) || (mode == Mode::NormSwiglu && !rows.is_multiple_of(2)) {
            return Err(shape_err());
        }
        let g = &self.kernels.gemv;
        let set = STAGES.iter().position(|&s| s == g.stages.load(Ordering::Relaxed)).unwrap_or(0);
        let by_mode = &g.kernels[mode as usize];
        // Warps: the setting, within the kernel's limits and the chunk count, then evened
        // out so no warp has a chunk more per tile than needed (9 chunks: 5 warps of 2, not
        // 8 with one warp doing two).
        let chunks = cols.div_ceil(CHUNK_COLS);
        let want = g.warps.load(Ordering::Relaxed).clamp(1, MAX_WARPS).min(chunks);
        let extra = if mode.normalises() { xn_bytes(m, cols) } else { 0 };
        // The ring depth in force, or the deepest shallower one whose CTA fits next to the
        // normalised rows; warps as the setting asks, as far as the memory allows.
        let (k, warps) = (0..=set)
            .rev()
            .find_map(|i| {
                let k = &by_mode[i];
                let room = g.smem_optin.saturating_sub(extra) / k.smem_per_warp;
                let warps = want.min(k.max_warps).min(room);
                (warps >= 1).then_some((k, warps))
            })
            .ok_or_else(|| KernelError::Shape {
                op: OP,
                detail: format!("m={m} x {cols} normalised rows leave no shared memory for the ring"),
            })?;
        let warps = chunks.div_ceil(chunks.div_ceil(warps));
        let smem = warps * k.smem_per_warp + extra;
        let tile_rows = if mode == Mode::NormSwiglu { TILE_ROWS / 2 } else { TILE_ROWS };
        let tiles = if mode == Mode::NormSwiglu { rows / 2 } else { rows }.div_ceil(tile_rows);
        let per_sm = if mode.normalises() {
            k.func.occupancy_max_active_blocks_per_multiprocessor(32 * warps as u32, smem, None).unwrap_or(0)
        } else {
            k.blocks_per_sm[warps]
        };
        let wave = self.sm_count * per_sm as usize;
        let grid = if g.persistent.load(Ordering::Relaxed) && wave > 0 { tiles.min(wave) } else { tiles };
        let pdl = g.pdl.load(Ordering::Relaxed);

        let mut mi = i32::try_from(m).map_err(|_| shape_err())?;
        let mut ri = i32::try_from(rows).map_err(|_| shape_err())?;
        let mut ci = i32::try_from(cols).map_err(|_| shape_err())?;
        let mut early = i32::from(pdl == 2) | (i32::from(g.contiguous) << 1);
        let mut eps = eps;
        let mut rope = rope;
        let grid = u32::try_from(grid).map_err(|_| shape_err())?;

        let s = &self.stream;
        let (xp, _g2) = x.inner.device_ptr(s);
        let (wp, _g3) = w.inner.device_ptr(s);
        // The normalising modes read gamma; the others get x's pointer, never read.
        let (gp, _g4) = gamma.unwrap_or(x).inner.device_ptr(s);
        let (mut op, mut xp, mut wp, mut gp) = (out, xp, wp, gp);
        let mut params: [*mut c_void; 10] = [
            (&mut op as *mut sys::CUdeviceptr).cast(),
            (&mut xp as *mut sys::CUdeviceptr).cast(),
            (&mut wp as *mut sys::CUdeviceptr).cast(),
            (&mut mi as *mut i32).cast(),
            (&mut ri as *mut i32).cast(),
            (&mut ci as *mut i32).cast(),
            (&mut early as *mut i32).cast(),
            (&mut gp as *mut sys::CUdeviceptr).cast(),
            (&mut eps as *mut f32).cast(),
            (&mut rope as *mut GemvRope).cast(),
        ];
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: `params` points at live locals whose types match the kernel's parameters
        // (void*, const bf16*, const bf16*, int, int, int, int, const bf16*, float, GemvRope
        // by value, repr(C) as in the .cu; its pointers checked by matmul_rms_norm_rope); the
        // caller checked out / x / w (and gamma) against the shape, and cols % 8 == 0 keeps
        // every 16-byte copy aligned and in bounds; the shared memory is within the limit
        // set at load (max_warps, or the opt-in maximum for the normalising modes, whose
        // extra rows were counted); grid <= tiles as the kernel requires; the kernel waits
        // for its prerequisite before reading x or writing out (and reads only W, which no
        // kernel writes, before that with early_w).
        unsafe { launch_ex(OP, s, &k.func, cfg, pdl > 0, &mut params) }
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
