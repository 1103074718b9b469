//! Harness shared by the GPU test files: the device (or a skip message when GPU tests
//! are not enabled), seeded random bf16 data, NaN-poisoned outputs, and timing.
#![allow(dead_code)]

use half::bf16;
use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tessera_kernels::cuda::{Buf, Device};
use tessera_kernels::KernelError;

/// The device, or `None` (with a message) when GPU tests are not enabled.
pub fn gpu(test: &str) -> Option<Device> {
    if std::env::var("TESSERA_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped {test}: set TESSERA_GPU_TESTS=1 on a machine with a CUDA GPU");
        return None;
    }
    match Device::new(0) {
        Ok(d) => Some(d),
        Err(e) => panic!("TESSERA_GPU_TESTS=1 but no CUDA device: {e}"),
    }
}

/// Whether `present` GPUs are too few for a test that needs `need`: says so and returns
/// true (the test then skips), except under `TESSERA_NEED_TWO_GPUS=1` (bench/gpu/run.sh's
/// two-GPU stage), where a missing GPU is a failure, not a silent pass.
pub fn too_few_gpus(test: &str, present: usize, need: usize) -> bool {
    if present >= need {
        return false;
    }
    if std::env::var("TESSERA_NEED_TWO_GPUS").as_deref() == Ok("1") {
        panic!("{test}: TESSERA_NEED_TWO_GPUS=1 but {present} GPU(s) present, {need} needed");
    }
    eprintln!("skipped {test}: {present} GPU(s) present, {need} needed");
    true
}

/// The device for a benchmark, or `None` (with a message) unless `TESSERA_GPU_BENCH=1`.
pub fn bench_enabled(name: &str) -> Option<Device> {
    if std::env::var("TESSERA_GPU_BENCH").as_deref() != Ok("1") {
        eprintln!("skipped {name}: set TESSERA_GPU_BENCH=1 on a machine with a CUDA GPU");
        return None;
    }
    Some(Device::new(0).expect("TESSERA_GPU_BENCH=1 but no CUDA device"))
}

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

pub fn unif(r: &mut ChaCha8Rng, lo: f32, hi: f32) -> f32 {
    lo + (hi - lo) * ((r.next_u32() >> 8) as f32 / (1u32 << 24) as f32)
}

/// Random bf16 values in `[lo, hi)`, never all zero.
pub fn rand_bf16(r: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<bf16> {
    (0..n).map(|_| bf16::from_f32(unif(r, lo, hi))).collect()
}

pub fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|b| b.to_f32()).collect()
}

/// A device buffer of `n` NaNs: any element a kernel fails to write stays NaN.
pub fn poisoned(dev: &Device, n: usize) -> Buf<bf16> {
    dev.upload(&vec![bf16::NAN; n]).unwrap()
}

/// Median over `trials` of the mean time per call over `reps` calls, after a warm-up.
pub fn median_ms(dev: &Device, trials: usize, reps: usize, mut f: impl FnMut(usize) -> Result<(), KernelError>) -> f64 {
    for i in 0..3 {
        f(i).unwrap();
    }
    dev.synchronize().unwrap();
    let mut call = 0usize;
    let mut t: Vec<f64> = (0..trials)
        .map(|_| {
            dev.time_ms(reps, || {
                call += 1;
                f(call)
            })
            .unwrap()
        })
        .collect();
    t.sort_by(|a, b| a.total_cmp(b));
    t[t.len() / 2]
}
