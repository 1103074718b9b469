//! The batch-1 decode GEMV that reads W in address order (`kernels/cuda/gemv_sweep.cu`):
//! every mode of the ring GEMV (`gemv.rs`) for one row of x and rows of `2048 L` values
//! (L = 1..=8; the normalising modes up to 8192 values, norm.cu's register path).
//!
//! [`Device::gemv_launch`] sends a call here when it has one row of x, the sweep is on
//! and the shape fits; everything else takes the ring. The sweep streams each of a Llama-8B
//! layer's four weights faster than the ring, but a chain that mixes the two kernels is
//! slower than either alone (bench/gpu/sweep_gemv.cu), so the switch is per device
//! ([`Device::set_gemv_sweep`]) and the model turns it off unless every batch-1 GEMV of
//! its layers fits ([`Device::gemv_sweep_fits`]). `TESSERA_GEMV_SWEEP=0` at load turns it
//! off for A/B runs.

use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::{CudaFunction, LaunchConfig};

use super::device::Device;
use super::gemv::Mode;
use crate::KernelError;

/// Threads per CTA (the kernel's `SWEEP_THREADS`).
const THREADS: u32 = 256;
/// Columns per L: each thread reads one 16-byte vector of a row per L.
const COLS_PER_L: usize = THREADS as usize * 8;
/// Kernels compiled: L up to this for every mode, up to [`NORM_MAX_L`] for the normalising
/// ones (rows of at most 8192 values, as norm.cu's register path).
const MAX_L: usize = 8;
const NORM_MAX_L: usize = 4;
/// Grid: this many CTAs per SM (the kernel keeps about 100 registers a thread at most, so
/// 2-4 are resident; the rest run as a second wave), measured best of 2-8 on H200.
const CTAS_PER_SM: usize = 4;

/// Rows a CTA takes per round at `l` (gemv_sweep.cu's `sweep_rows`).
fn rows_per_round(l: usize) -> usize {
    match l {
        1 => 8,
        2 => 4,
        3 | 4 => 2,
        _ => 1,
    }
}

/// L for rows of `cols` values in `mode`, if the sweep has a kernel for it.
fn sweep_l(mode: Mode, cols: usize) -> Option<usize> {
    let l = cols / COLS_PER_L;
    let max = if mode.normalises() { NORM_MAX_L } else { MAX_L };
    (cols.is_multiple_of(COLS_PER_L) && (1..=max).contains(&l)).then_some(l)
}

/// The sweep kernels of module `gemv_sweep` and whether they are in use.
pub(crate) struct SweepKernels {
    /// Indexed by mode (as `Mode::ALL`), then L - 1 (fewer for the normalising modes).
    kernels: Vec<Vec<CudaFunction>>,
    enabled: AtomicBool,
}

impl SweepKernels {
    pub(crate) fn load(f: &dyn Fn(&str, &str) -> Result<CudaFunction, KernelError>) -> Result<Self, KernelError> {
        let kernels = Mode::ALL
            .iter()
            .map(|&mode| {
                let max = if mode.normalises() { NORM_MAX_L } else { MAX_L };
                (1..=max).map(|l| f("gemv_sweep", &format!("gemv_sweep_{}_l{l}", mode.kernel_name()))).collect()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let enabled = AtomicBool::new(std::env::var("TESSERA_GEMV_SWEEP").as_deref() != Ok("0"));
        Ok(SweepKernels { kernels, enabled })
    }

    /// The kernel and launch shape for `m` rows of x against W `[rows, cols]` in `mode`, if
    /// the sweep is on and takes it.
    pub(crate) fn pick(
        &self,
        mode: Mode,
        m: usize,
        rows: usize,
        cols: usize,
        sm_count: usize,
    ) -> Option<SweepLaunch<'_>> {
        if m != 1 || !self.enabled.load(Ordering::Relaxed) {
            return None;
        }
        let l = sweep_l(mode, cols)?;
        let per_round = rows_per_round(l);
        let groups = match mode {
            Mode::NormSwiglu => (rows / 2).div_ceil(per_round / 2),
            _ => rows.div_ceil(per_round),
        };
        let grid = u32::try_from(groups.min(sm_count * CTAS_PER_SM)).ok()?;
        let func = &self.kernels[mode as usize][l - 1];
        Some(SweepLaunch {
            func,
            cfg: LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 },
        })
    }
}

/// A sweep kernel and its launch configuration.
pub(crate) struct SweepLaunch<'a> {
    pub func: &'a CudaFunction,
    pub cfg: LaunchConfig,
}

impl Device {
    /// Turns the batch-1 sweep GEMV on or off for every later launch on this device (the
    /// model calls it at load; tests use it to run both kernels).
    pub fn set_gemv_sweep(&self, on: bool) {
        self.kernels.gemv.sweep.enabled.store(on, Ordering::Relaxed);
    }

    /// Whether the sweep GEMV takes rows of `cols` values: `norm` for the normalising modes
    /// (qkv, gate_up), else the plain and residual ones (o, down).
    pub fn gemv_sweep_fits(&self, cols: usize, norm: bool) -> bool {
        sweep_l(if norm { Mode::Norm } else { Mode::Residual }, cols).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_takes_whole_multiples_of_2048_columns() {
        assert_eq!(sweep_l(Mode::Residual, 4096), Some(2));
        assert_eq!(sweep_l(Mode::Residual, 14336), Some(7));
        assert_eq!(sweep_l(Mode::Residual, 16384), Some(8));
        assert_eq!(sweep_l(Mode::Residual, 18432), None);
        assert_eq!(sweep_l(Mode::Bf16, 576), None);
        assert_eq!(sweep_l(Mode::Bf16, 5120), None);
        assert_eq!(sweep_l(Mode::Bf16, 0), None);
        // The normalising modes stop at norm.cu's register path (8192 values).
        assert_eq!(sweep_l(Mode::NormSwiglu, 8192), Some(4));
        assert_eq!(sweep_l(Mode::Norm, 10240), None);
    }

    #[test]
    fn rounds_take_pairs_where_the_norm_modes_run() {
        // NORM_SWIGLU pairs gate and up rows, NORM_ROPE rotates row pairs: even R there.
        for l in 1..=NORM_MAX_L {
            assert!(rows_per_round(l).is_multiple_of(2), "L={l}");
        }
        for l in 1..=MAX_L {
            assert!(rows_per_round(l) * l <= 8, "L={l}: about 8 loads in flight per thread");
        }
    }
}
