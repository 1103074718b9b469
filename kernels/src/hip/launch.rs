//! Launch shapes of the shared kernels for a given wavefront width. The .cu sources index
//! lanes and warps through WARP_SIZE (kernels/hip/compat.h sets it to the target's width), so
//! the host must size blocks, grids and shared memory with the same width: a 64-lane
//! wavefront takes a warp-per-row kernel's rows two warps' worth of threads at a time. CUDA's
//! launchers use 32 throughout; these are the HIP backend's. Pure Rust: tested without a GPU.

use crate::KernelError;

/// Warps (one head each) per block of `qkv_rope_write`; QKV_WARPS in kernels/cuda/qkv.cu.
pub const QKV_WARPS: u32 = 4;
/// Threads of `sample_rows`; SAMPLE_THREADS in kernels/cuda/sampling.cu.
pub const SAMPLE_THREADS: u32 = 1024;
/// Threads of `paged_attention_portable_hd*`; ATT_PORT_THREADS in kernels/cuda/attention.cu.
pub const ATT_PORT_THREADS: u32 = 256;
/// Largest block the kernels are written for (and AMD's limit).
pub const MAX_BLOCK: u32 = 1024;
/// Grid cap of the grid-stride kernels (CUDA's launchers use the same).
pub const MAX_GRID: u64 = 1 << 16;
/// `block_sum`'s scratch holds one float per warp: 32 of them (common.cuh).
pub const BLOCK_SUM_SCRATCH: u32 = 32;

/// Grid, block and dynamic shared memory of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchShape {
    pub grid: [u32; 3],
    pub block: u32,
    pub shared_bytes: u32,
}

fn bad(op: &'static str, detail: String) -> KernelError {
    KernelError::Shape { op, detail }
}

fn check_wave(op: &'static str, wave: u32) -> Result<(), KernelError> {
    if wave == 32 || wave == 64 {
        Ok(())
    } else {
        Err(bad(op, format!("wavefront width {wave}: expected 32 or 64")))
    }
}

fn grid_dim(op: &'static str, n: u64) -> Result<u32, KernelError> {
    u32::try_from(n).ok().filter(|&g| g >= 1 && g <= i32::MAX as u32).ok_or_else(|| bad(op, format!("grid of {n}")))
}

/// A block-per-row kernel whose rows reduce through `block_sum` (`rms_norm_block`): `threads`
/// must be whole warps, and at most 32 of them (the scratch).
pub fn block_per_row(n_rows: usize, threads: u32, wave: u32) -> Result<LaunchShape, KernelError> {
    const OP: &str = "block_per_row";
    check_wave(OP, wave)?;
    if threads == 0 || !threads.is_multiple_of(wave) || threads > MAX_BLOCK || threads / wave > BLOCK_SUM_SCRATCH {
        return Err(bad(OP, format!("{threads} threads for {wave}-lane warps")));
    }
    Ok(LaunchShape { grid: [grid_dim(OP, n_rows as u64)?, 1, 1], block: threads, shared_bytes: 0 })
}

/// A warp-per-row kernel (`rms_norm_warp`: row = blockIdx.x * (blockDim.x / WARP_SIZE) +
/// threadIdx.x / WARP_SIZE) with `warps` warps per block.
pub fn warp_per_row(n_rows: usize, warps: u32, wave: u32) -> Result<LaunchShape, KernelError> {
    const OP: &str = "warp_per_row";
    check_wave(OP, wave)?;
    if warps == 0 || warps * wave > MAX_BLOCK {
        return Err(bad(OP, format!("{warps} warps of {wave} lanes")));
    }
    let grid = grid_dim(OP, (n_rows as u64).div_ceil(u64::from(warps)))?;
    Ok(LaunchShape { grid: [grid, 1, 1], block: warps * wave, shared_bytes: 0 })
}

/// `qkv_rope_write`: grid (tokens, head groups of QKV_WARPS), a warp per head, and each warp's
/// head in f32 shared memory.
pub fn qkv_rope(n_tokens: usize, heads: usize, head_dim: usize, wave: u32) -> Result<LaunchShape, KernelError> {
    const OP: &str = "qkv_rope";
    check_wave(OP, wave)?;
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(bad(OP, format!("head_dim {head_dim}: expected even")));
    }
    let shared = u64::from(QKV_WARPS) * head_dim as u64 * 4;
    let shared_bytes = u32::try_from(shared)
        .ok()
        .filter(|&b| b <= 64 << 10)
        .ok_or_else(|| bad(OP, format!("{shared} bytes of shared memory for head_dim {head_dim}")))?;
    Ok(LaunchShape {
        grid: [grid_dim(OP, n_tokens as u64)?, grid_dim(OP, (heads as u64).div_ceil(u64::from(QKV_WARPS)))?, 1],
        block: QKV_WARPS * wave,
        shared_bytes,
    })
}

/// Blocks of a grid-stride elementwise kernel (`silu_mul*`): enough blocks of `threads` for
/// `units` work items, at most `MAX_GRID` (each thread then loops).
pub fn grid_stride(units: usize, threads: u32, wave: u32) -> Result<LaunchShape, KernelError> {
    const OP: &str = "grid_stride";
    check_wave(OP, wave)?;
    if threads == 0 || !threads.is_multiple_of(wave) || threads > MAX_BLOCK {
        return Err(bad(OP, format!("{threads} threads for {wave}-lane warps")));
    }
    let blocks = (units as u64).div_ceil(u64::from(threads)).min(MAX_GRID);
    Ok(LaunchShape { grid: [grid_dim(OP, blocks)?, 1, 1], block: threads, shared_bytes: 0 })
}

/// `split_finish`: one warp per row.
pub fn split_finish(n_rows: usize, wave: u32) -> Result<LaunchShape, KernelError> {
    const OP: &str = "split_finish";
    check_wave(OP, wave)?;
    Ok(LaunchShape { grid: [grid_dim(OP, n_rows as u64)?, 1, 1], block: wave, shared_bytes: 0 })
}

/// Warps of a `sample_rows` block: the length of its per-warp shared arrays.
pub fn sample_warps(wave: u32) -> Result<u32, KernelError> {
    check_wave("sample_warps", wave)?;
    Ok(SAMPLE_THREADS / wave)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rows the threads of `shape` handle, by the kernel's own indexing, each counted.
    fn rows_hit(shape: &LaunchShape, wave: u32, n_rows: usize) -> Vec<u32> {
        let mut hits = vec![0u32; n_rows];
        for b in 0..shape.grid[0] {
            for t in 0..shape.block {
                let row = b as usize * (shape.block / wave) as usize + (t / wave) as usize;
                if row < n_rows && t % wave == 0 {
                    hits[row] += 1;
                }
            }
        }
        hits
    }

    #[test]
    fn warp_per_row_covers_every_row_once_for_both_widths() {
        let mut seed = 0x9e3779b97f4a7c15u64;
        for wave in [32, 64] {
            for _ in 0..50 {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let n_rows = 1 + (seed >> 33) as usize % 1000;
                let warps = 1 + (seed >> 20) as u32 % (MAX_BLOCK / wave);
                let shape = warp_per_row(n_rows, warps, wave).unwrap();
                assert_eq!(shape.block, warps * wave);
                assert!(shape.block <= MAX_BLOCK);
                assert!(rows_hit(&shape, wave, n_rows).iter().all(|&h| h == 1), "{n_rows} rows, {warps} warps, {wave}");
                // No block past the last row's.
                assert!((shape.grid[0] as usize - 1) * (warps as usize) < n_rows);
            }
        }
    }

    #[test]
    fn sixty_four_lane_shapes() {
        // 8 warps per block of 64 lanes: 512 threads, 100 rows in 13 blocks.
        assert_eq!(warp_per_row(100, 8, 64).unwrap(), LaunchShape { grid: [13, 1, 1], block: 512, shared_bytes: 0 });
        assert_eq!(warp_per_row(100, 8, 32).unwrap().block, 256);
        assert!(warp_per_row(10, 17, 64).is_err(), "1088 threads exceed a block");
        // block_sum: 1024 threads are 16 warps of 64 (fits the 32-float scratch) or 32 of 32.
        assert!(block_per_row(4, 1024, 64).is_ok());
        assert!(block_per_row(4, 1024, 32).is_ok());
        assert!(block_per_row(4, 96, 64).is_err(), "not whole wavefronts");
        assert!(block_per_row(4, 96, 32).is_ok());
        assert!(block_per_row(0, 256, 64).is_err(), "empty grid");
        // qkv: 4 heads of 128 per block, 4 * 64 threads, 2 KiB of f32.
        let q = qkv_rope(7, 48, 128, 64).unwrap();
        assert_eq!(q, LaunchShape { grid: [7, 12, 1], block: 256, shared_bytes: 2048 });
        assert_eq!(qkv_rope(7, 49, 128, 32).unwrap().grid, [7, 13, 1]);
        assert!(qkv_rope(7, 48, 127, 64).is_err());
        assert_eq!(split_finish(5, 64).unwrap().block, 64);
        assert_eq!(sample_warps(64).unwrap(), 16);
        assert_eq!(sample_warps(32).unwrap(), 32);
        // The portable attention block is whole wavefronts of either width and fits block_sum.
        assert!(block_per_row(1, ATT_PORT_THREADS, 64).is_ok() && block_per_row(1, ATT_PORT_THREADS, 32).is_ok());
        assert!(sample_warps(48).is_err());
    }

    #[test]
    fn grid_stride_covers_every_unit_within_the_cap() {
        let mut seed = 0x2545f4914f6cdd1du64;
        for wave in [32, 64] {
            for _ in 0..100 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let units = 1 + (seed % 50_000_000) as usize;
                let threads = wave * (1 + (seed >> 40) as u32 % (MAX_BLOCK / wave));
                let s = grid_stride(units, threads, wave).unwrap();
                let per_pass = u64::from(s.grid[0]) * u64::from(s.block);
                assert!(s.grid[0] as u64 <= MAX_GRID && s.block == threads);
                // Every unit is reached by some thread's stride loop, and no block is idle
                // unless the cap bound the grid.
                assert!(per_pass >= units as u64 || s.grid[0] as u64 == MAX_GRID, "{units} {threads}");
                assert!((u64::from(s.grid[0]) - 1) * u64::from(s.block) < units as u64);
            }
        }
        assert!(grid_stride(0, 256, 64).is_err(), "empty grid");
        assert!(grid_stride(10, 96, 64).is_err(), "not whole wavefronts");
    }
}
