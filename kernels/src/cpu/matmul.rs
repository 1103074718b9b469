//! `out = x · Wᵀ` against a weight matrix in any [`GgmlType`], and row dequantisation
//! for embedding lookups. This is the hot loop of CPU inference.
//!
//! Shapes: `x` is `[n, cols]` f32, `W` is `[rows, cols]` (row-major blocks), `out` is
//! `[n, rows]`: `out[t][r] = Σ_c W[r][c] · x[t][c]`.
//!
//! How (following llama.cpp's CPU path): quantised weights are never widened to f32.
//! The activations are quantised once per call to 8 bits ([`ActsQ8`] for Q4_0/Q4_1/Q8_0,
//! [`ActsQ8K`] for the K types) and each weight block meets them in an integer dot
//! product (exact in i32), scaled by the two block scales. F32/F16/BF16 weights take an
//! f32 FMA dot instead. Work is split over the threads (`par.rs`) in chunks of output rows, all `n`
//! tokens per chunk (tiled by [`TOKEN_TILE`]), so each weight row is read from memory
//! once per call. Kernels: `matmul_scalar.rs` (portable), `simd_avx2*.rs` and
//! `simd_vnni.rs` (AVX512-VNNI dots for Q4_0/Q4_1/Q8_0), picked by runtime CPU
//! detection ([`Isa`]).
//!
//! Accuracy: the 8-bit activations add an error of at most `Σ_c |W[r][c]| · d(c) / 2`
//! (`d` = the activation block's scale, `max|x_block| / 127`) to each output compared with
//! an exact dot of the dequantised weights (plus the f16 rounding of the scales if
//! `quant::q8::Q8_SCALES_F16`); on random data that is about 1e-3 of
//! `‖W_r‖·‖x_t‖` (see `tests/matmul.rs`).

use super::par::{self, SharedMut};
use crate::error::check;
use crate::quant::q8::{ActsQ8, ActsQ8K};
use crate::quant::{dequantize_unchecked, GgmlType, Weight};
use crate::KernelError;

/// Defines a [`Kernel`] named `$name` from a one-row function
/// `$row(w_row, acts, t0, out[..tn])` (for kernels with nothing to share between rows).
macro_rules! per_row {
    ($name:ident, $row:path, $acts:ty) => {
        pub(crate) unsafe fn $name(
            w: &[u8],
            row_bytes: usize,
            a: &$acts,
            t0: usize,
            tn: usize,
            out: &mut [f32],
            stride: usize,
        ) {
            for (r, wrow) in w.chunks_exact(row_bytes).enumerate() {
                #[allow(unused_unsafe)]
                unsafe {
                    $row(wrow, a, t0, &mut out[r * stride..r * stride + tn])
                };
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
#[path = "simd_avx2.rs"]
mod avx2;
#[cfg(target_arch = "x86_64")]
#[path = "simd_avx2_k.rs"]
mod avx2_k;
#[cfg(target_arch = "x86_64")]
#[path = "simd_q8_tile.rs"]
mod q8_tile;
#[path = "matmul_scalar.rs"]
mod scalar;
#[cfg(target_arch = "x86_64")]
#[path = "simd_vnni.rs"]
mod vnni;

/// Tokens processed together per weight row: their 8-bit activations
/// (`TOKEN_TILE * cols` bytes) stay in L2 while a chunk of weight rows passes over them.
pub const TOKEN_TILE: usize = 64;

/// Below this many weight bytes × tokens a call stays on the calling thread, when that
/// thread is one of rayon's (the CPU engine runs an unsharded model's step there, see
/// `LlamaModel::forward_sharded`): splitting a call then costs a job push and at most a
/// wake-up of the other threads, and every layer matrix of SmolLM2 (69–553 KB) is worth
/// splitting even at decode (n = 1). Measured on a 2-core AVX2 machine, 2 threads, `tessera
/// bench --prompt-tokens 128 --gen-tokens 64`, tg64 in two alternating rounds: 1 MB (only
/// the LM head split) 100 / 111 tok/s, 256 KB 131 / 135, 64 KB 144 / 160, 16 KB 152 / 158.
const PAR_MIN_WORK_IN_POOL: usize = 64 * 1024;

/// The same from a thread outside the pool, where each split queues its work and puts the
/// calling thread to sleep until the pool is done: at decode only the LM head (30 MB for
/// SmolLM2) is worth it (2-core dev machine, tg128: 64 KB 86 tok/s, 256 KB 111, 1 MB 122).
const PAR_MIN_WORK_OUTSIDE: usize = 1024 * 1024;

/// Which instruction set the kernels use. Constructed only when the CPU supports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Isa(IsaKind);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IsaKind {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX2 plus AVX512-VNNI (256-bit `vpdpbusd`) for the Q4_0/Q4_1/Q8_0 dots; every
    /// other type takes the AVX2 kernels.
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl Isa {
    /// The portable kernels; always available.
    pub fn scalar() -> Self {
        Isa(IsaKind::Scalar)
    }

    /// The AVX2 (+FMA, F16C) kernels, if this CPU has them.
    pub fn avx2() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            return Some(Isa(IsaKind::Avx2));
        }
        None
    }

    /// The AVX2 kernels with AVX512-VNNI integer dots, if this CPU has both. Results
    /// are bit-identical to [`Isa::avx2`].
    pub fn vnni() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if Self::avx2().is_some()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
        {
            return Some(Isa(IsaKind::Vnni));
        }
        None
    }

    /// The fastest kernels this CPU runs. VNNI over AVX2: 5-10% faster at n = 1 and
    /// 8-20% at n >= 4 on Zen 4 (2 threads, `examples/matmul_bench.rs --vnni`), same bits.
    pub fn best() -> Self {
        Self::vnni().or_else(Self::avx2).unwrap_or_else(Self::scalar)
    }

    /// Whether this is an x86 set with AVX2, FMA and F16C (every kind but scalar).
    pub(crate) fn has_avx2(self) -> bool {
        self.0 != IsaKind::Scalar
    }

    /// Whether this set includes AVX-512F/BW/VL and VNNI (the VNNI kind checked for them).
    pub(crate) fn has_avx512vnni(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self.0 == IsaKind::Vnni {
            return true;
        }
        false
    }

    /// Whether this set includes AVX-512F/VL (the VNNI kind checked for them).
    pub(crate) fn has_avx512vl(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self.0 == IsaKind::Vnni {
            return true;
        }
        false
    }

    pub fn name(self) -> &'static str {
        match self.0 {
            IsaKind::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            IsaKind::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            IsaKind::Vnni => "avx512vnni",
        }
    }
}

/// f32 activations as the float-weight kernels see them.
pub(crate) struct ActsF32<'a> {
    pub cols: usize,
    /// (n, cols)
    pub x: &'a [f32],
}

/// Computes, for every whole row `r` of `w` (`row_bytes` each) and token `t0 + i`
/// (`i < tn`), `out[r * stride + i]`. Unsafe because SIMD kernels need their CPU
/// features: only kernels picked for a constructed [`Isa`] are ever called. Kernels check
/// the slice lengths they rely on.
pub(crate) type Kernel<A> =
    unsafe fn(w: &[u8], row_bytes: usize, acts: &A, t0: usize, tn: usize, out: &mut [f32], stride: usize);

/// `out = x · Wᵀ` with the fastest kernels for this CPU. `out`: `[n, w.rows]`,
/// `x`: `[n, w.cols]`.
pub fn matmul(out: &mut [f32], x: &[f32], n: usize, w: &Weight) -> Result<(), KernelError> {
    matmul_with(Isa::best(), out, x, n, w)
}

/// [`matmul`] with a chosen instruction set (tests compare paths; benchmarks time them).
pub fn matmul_with(isa: Isa, out: &mut [f32], x: &[f32], n: usize, w: &Weight) -> Result<(), KernelError> {
    const OP: &str = "matmul";
    let row_bytes = w.check(OP)?;
    if !check_io(OP, out, x, n, w.rows, w.cols)? {
        return Ok(());
    }
    match w.ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            let acts = ActsF32 { cols: w.cols, x };
            run(out, n, w, row_bytes, &acts, float_kernel(isa, w.ty));
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => {
            let acts = ActsQ8::quantize(x, w.cols);
            run(out, n, w, row_bytes, &acts, q8_kernel(isa, w.ty));
        }
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => {
            let acts = ActsQ8K::quantize(x, w.cols);
            run(out, n, w, row_bytes, &acts, q8k_kernel(isa, w.ty));
        }
    }
    Ok(())
}

/// Checks `x` (`[n, cols]`) and `out` (`[n, rows]`) of a matmul named `op`; `Ok(false)`
/// when nothing is left to compute (no tokens, no rows, or no columns: `out` zeroed).
pub(crate) fn check_io(
    op: &'static str,
    out: &mut [f32],
    x: &[f32],
    n: usize,
    rows: usize,
    cols: usize,
) -> Result<bool, KernelError> {
    let (x_len, out_len) = (n.checked_mul(cols), n.checked_mul(rows));
    check(x_len == Some(x.len()), op, || {
        format!("x has {} values, expected n={n} x cols={cols} for a {rows}x{cols} weight", x.len())
    })?;
    check(out_len == Some(out.len()), op, || {
        format!("out has {} values, expected n={n} x rows={rows} for a {rows}x{cols} weight", out.len())
    })?;
    if cols == 0 {
        out.fill(0.0);
    }
    Ok(n > 0 && rows > 0 && cols > 0)
}

fn float_kernel<'a>(isa: Isa, ty: GgmlType) -> Kernel<ActsF32<'a>> {
    match isa.0 {
        #[cfg(target_arch = "x86_64")]
        IsaKind::Avx2 | IsaKind::Vnni => match ty {
            GgmlType::F16 => avx2::row_f16 as Kernel<ActsF32<'a>>,
            GgmlType::BF16 => avx2::row_bf16 as Kernel<ActsF32<'a>>,
            _ => avx2::row_f32 as Kernel<ActsF32<'a>>,
        },
        IsaKind::Scalar => match ty {
            GgmlType::F16 => scalar::row_f16 as Kernel<ActsF32<'a>>,
            GgmlType::BF16 => scalar::row_bf16 as Kernel<ActsF32<'a>>,
            _ => scalar::row_f32 as Kernel<ActsF32<'a>>,
        },
    }
}

fn q8_kernel(isa: Isa, ty: GgmlType) -> Kernel<ActsQ8> {
    match isa.0 {
        #[cfg(target_arch = "x86_64")]
        IsaKind::Avx2 => match ty {
            GgmlType::Q4_0 => avx2::row_q4_0,
            GgmlType::Q4_1 => avx2::row_q4_1,
            _ => avx2::row_q8_0,
        },
        #[cfg(target_arch = "x86_64")]
        IsaKind::Vnni => match ty {
            GgmlType::Q4_0 => vnni::row_q4_0,
            GgmlType::Q4_1 => vnni::row_q4_1,
            _ => vnni::row_q8_0,
        },
        IsaKind::Scalar => match ty {
            GgmlType::Q4_0 => scalar::row_q4_0,
            GgmlType::Q4_1 => scalar::row_q4_1,
            _ => scalar::row_q8_0,
        },
    }
}

fn q8k_kernel(isa: Isa, ty: GgmlType) -> Kernel<ActsQ8K> {
    match isa.0 {
        #[cfg(target_arch = "x86_64")]
        IsaKind::Avx2 | IsaKind::Vnni => match ty {
            GgmlType::Q4K => avx2_k::row_q4_k,
            GgmlType::Q5K => avx2_k::row_q5_k,
            _ => avx2_k::row_q6_k,
        },
        IsaKind::Scalar => match ty {
            GgmlType::Q4K => scalar::row_q4_k,
            GgmlType::Q5K => scalar::row_q5_k,
            _ => scalar::row_q6_k,
        },
    }
}

/// Rows per parallel task: about four tasks per thread so a slow thread does not hold
/// up the call, but none so small that scheduling costs more than the rows.
fn chunk_rows(rows: usize, row_bytes: usize, n: usize, threads: usize) -> usize {
    let by_balance = rows.div_ceil(threads * 4);
    let by_size = (task_bytes() / (row_bytes * n).max(1)).max(1);
    by_balance.max(by_size).min(rows)
}

/// Smallest task, in weight bytes × tokens: `TESSERA_CPU_TASK_KB` KiB (tuning), else 32 KiB.
fn task_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        std::env::var("TESSERA_CPU_TASK_KB").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&k| k > 0).unwrap_or(32)
            * 1024
    })
}

/// How a call over `units` units of work (weight rows, or packed groups of rows) of
/// `unit_bytes` weight bytes each, for `n` tokens, is split: (whether it stays on this
/// thread, units per task).
pub(crate) fn split_plan(units: usize, unit_bytes: usize, n: usize) -> (bool, usize) {
    let threads = rayon::current_num_threads();
    let work = units.saturating_mul(unit_bytes).saturating_mul(n);
    let min_work = if rayon::current_thread_index().is_some() { PAR_MIN_WORK_IN_POOL } else { PAR_MIN_WORK_OUTSIDE };
    if threads <= 1 || work < min_work {
        (true, units.max(1))
    } else {
        (false, chunk_rows(units, unit_bytes, n, threads))
    }
}

/// Drives `kernel` over all (row, token) pairs. `out`: `[n, rows]`; lengths checked.
fn run<A: Sync>(out: &mut [f32], n: usize, w: &Weight, row_bytes: usize, acts: &A, kernel: Kernel<A>) {
    let rows = w.rows;
    let (serial, rows_per) = split_plan(rows, row_bytes, n);
    let tasks = rows.div_ceil(rows_per);
    if n == 1 {
        // `[1, rows]` and `[rows, 1]` are the same layout: each task writes its rows in place.
        let task = |i: usize, dst: &mut [f32]| {
            let r0 = i * rows_per;
            let wrows = &w.data[r0 * row_bytes..(r0 + dst.len()) * row_bytes];
            // SAFETY: `kernel` came from a constructed `Isa`, so its CPU features exist.
            unsafe { kernel(wrows, row_bytes, acts, 0, 1, dst, 1) };
        };
        if serial {
            task(0, out);
        } else {
            par::for_each_chunk_mut(out, rows_per, task);
        }
        return;
    }
    let base = SharedMut::new(out);
    // Task `i` owns output columns (weight rows) `i * rows_per ..`: for each tile of
    // tokens the kernel fills `tile` (`[nrows, tile_w]`, the kernels' row-major layout,
    // `tile_w` = the widest token tile of this call: a batch of 16 decodes does not zero
    // and stride over 64 columns), which is then transposed into those columns of the
    // tile's `out` rows while it is still in cache.
    let tile_w = TOKEN_TILE.min(n);
    let task = |i: usize| {
        let r0 = i * rows_per;
        let nrows = rows_per.min(rows - r0);
        let wrows = &w.data[r0 * row_bytes..(r0 + nrows) * row_bytes];
        let mut tile = vec![0.0f32; nrows * tile_w];
        for t0 in (0..n).step_by(TOKEN_TILE) {
            let tn = TOKEN_TILE.min(n - t0);
            // SAFETY: `kernel` came from a constructed `Isa`, so its CPU features exist.
            unsafe { kernel(wrows, row_bytes, acts, t0, tn, &mut tile, tile_w) };
            // Token by token: each token's columns are one contiguous run of `out`
            // (sequential stores); the strided reads of `tile` stay in L1/L2.
            for j in 0..tn {
                // SAFETY: `out` is `[n, rows]` (checked by `matmul_with`), `t0 + j < n` and
                // `r0 + nrows <= rows`; columns `r0 .. r0 + nrows` belong to this task only.
                let at = (t0 + j) * rows + r0;
                let dst = unsafe { base.slice(at, at + nrows) };
                for (d, vals) in dst.iter_mut().zip(tile.chunks_exact(tile_w)) {
                    *d = vals[j];
                }
            }
        }
    };
    if serial {
        (0..tasks).for_each(task);
    } else {
        par::for_each_task(tasks, task);
    }
}

/// Dequantises rows `first_row ..` of `w` into `out` (`[k, w.cols]` for some `k >= 0`),
/// e.g. token embeddings.
pub fn dequantize_rows(w: &Weight, first_row: usize, out: &mut [f32]) -> Result<(), KernelError> {
    const OP: &str = "dequantize_rows";
    let row_bytes = w.check(OP)?;
    if out.is_empty() {
        return Ok(());
    }
    check(w.cols > 0 && out.len().is_multiple_of(w.cols), OP, || {
        format!("out has {} values, not a whole number of rows of {}", out.len(), w.cols)
    })?;
    let k = out.len() / w.cols;
    check(first_row < w.rows && k <= w.rows - first_row, OP, || {
        format!("rows {first_row}..{} asked of a matrix with {} rows", first_row.saturating_add(k), w.rows)
    })?;
    let src = &w.data[first_row * row_bytes..(first_row + k) * row_bytes];
    for (o, s) in out.chunks_exact_mut(w.cols).zip(src.chunks_exact(row_bytes)) {
        dequantize_unchecked(w.ty, s, o);
    }
    Ok(())
}
