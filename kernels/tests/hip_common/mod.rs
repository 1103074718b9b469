//! Harness shared by the HIP test files: the opt-in switches (skip with a message unless the
//! variable is 1), the GPU with its modules loaded, seeded random bf16 data and a closeness
//! check against a reference.
#![allow(dead_code)]

use half::bf16;
use rand_chacha::ChaCha8Rng;
use rand_core::Rng;
use tessera_kernels::cuda::ModuleCache;
use tessera_kernels::hip::{DevBuf, Device};

/// Whether `var` is 1; says how to run `test` when it is not.
pub fn enabled(var: &str, test: &str) -> bool {
    let on = std::env::var(var).as_deref() == Ok("1");
    if !on {
        eprintln!("skipped {test}: set {var}=1 (see kernels/tests/hip_ops.rs)");
    }
    on
}

/// Uniform in `(-scale, scale)`, rounded to bf16.
pub fn random_bf16(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<bf16> {
    (0..n)
        .map(|_| {
            let u = (rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32;
            bf16::from_f32((2.0 * u - 1.0) * scale)
        })
        .collect()
}

pub fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|b| b.to_f32()).collect()
}

/// The GPU, its modules loaded into a per-process cache directory.
pub fn gpu() -> Device {
    let mut dev = Device::new(0).unwrap_or_else(|e| panic!("TESSERA_HIP_TESTS=1 but no usable AMD GPU: {e}"));
    let dir = std::env::temp_dir().join(format!("tessera-hip-test-{}", std::process::id()));
    let reports = dev.load_modules(&ModuleCache::new(&dir)).unwrap();
    eprintln!("{} ({}), wave {}: {} modules", dev.name(), dev.arch(), dev.wavefront_size(), reports.len());
    dev
}

/// A device buffer of `n` NaNs: any element a kernel fails to write stays NaN.
pub fn poisoned(dev: &Device, n: usize) -> DevBuf<bf16> {
    dev.upload(&vec![bf16::NAN; n]).unwrap()
}

/// Every element within `atol + rtol |want|` of the reference; NaN where the reference is.
pub fn assert_close(what: &str, got: &[bf16], want: &[f32], rtol: f32, atol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, &w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32();
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: got {g}, want NaN");
        } else {
            assert!((g - w).abs() <= atol + rtol * w.abs(), "{what}[{i}]: got {g}, want {w}");
        }
    }
}

/// `x · wᵀ` in f64 (`x` `[m, k]`, `w` `[n, k]`, row-major out `[m, n]`), each with its sum
/// of |products|, the scale of its rounding error.
pub fn gemm_reference(x: &[bf16], w: &[bf16], (m, n, k): (usize, usize, usize)) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(m * n);
    for i in 0..m {
        for j in 0..n {
            let (mut dot, mut mag) = (0f64, 0f64);
            for t in 0..k {
                let p = x[i * k + t].to_f64() * w[j * k + t].to_f64();
                dot += p;
                mag += p.abs();
            }
            out.push((dot, mag));
        }
    }
    out
}
