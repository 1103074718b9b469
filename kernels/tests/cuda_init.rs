//! The GPU random fill (`Device::fill_uniform`) equals the CPU reference
//! `cpu::random::uniform` rounded by `half::bf16::from_f32`, bit for bit, on NaN-poisoned
//! buffers (so an unwritten element fails): a buffer of a million and seven elements (the
//! vector loop and the tail), short buffers that are all tail, and one past 2^32 elements
//! (u64 indexing) checked at sampled indices. Needs a GPU: runs only with
//! `TESSERA_GPU_TESTS=1`.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::*;

use half::bf16;
use tessera_kernels::cpu::random::uniform;
use tessera_kernels::KernelError;

/// Index of the first element whose bits differ from the reference, if any.
fn first_mismatch(got: &[bf16], seed: u64, lo: f32, hi: f32, indices: impl Iterator<Item = u64>) -> Option<u64> {
    indices.into_iter().find(|&i| got[i as usize].to_bits() != bf16::from_f32(uniform(seed, i, lo, hi)).to_bits())
}

#[test]
fn fill_uniform_matches_cpu_bit_for_bit() {
    let Some(dev) = gpu("fill_uniform_matches_cpu_bit_for_bit") else { return };
    for (n, seed, lo, hi) in [
        (1_000_007usize, 42u64, -0.05f32, 0.05f32),
        (1_000_007, 0xdead_beef_0123_4567, -2.0, 3.5),
        (5, 9, -1.0, 1.0),
        (16, 10, 0.0, 1.0),
        (23, 11, 0.5, 0.75),
    ] {
        let mut buf = poisoned(&dev, n);
        dev.fill_uniform(&mut buf, seed, lo, hi).unwrap();
        let got = dev.download(&buf).unwrap();
        let what = format!("fill_uniform n {n} seed {seed:#x} [{lo}, {hi})");
        assert_eq!(first_mismatch(&got, seed, lo, hi, 0..n as u64), None, "{what}: differs from the CPU reference");
        // Rounding is monotonic: values in [lo, hi] stay within the rounded bounds.
        let (blo, bhi) = (bf16::from_f32(lo), bf16::from_f32(hi));
        assert!(got.iter().all(|v| *v >= blo && *v <= bhi), "{what}: out of range");
        eprintln!("{what}: ok");
    }
    // Another seed gives other values.
    let mut a = poisoned(&dev, 1000);
    dev.fill_uniform(&mut a, 1, -1.0, 1.0).unwrap();
    let mut b = poisoned(&dev, 1000);
    dev.fill_uniform(&mut b, 2, -1.0, 1.0).unwrap();
    let (a, b) = (dev.download(&a).unwrap(), dev.download(&b).unwrap());
    assert!(a.iter().zip(&b).filter(|(x, y)| x == y).count() < 20, "seeds 1 and 2 agree too often");
}

#[test]
fn fill_uniform_rejects_bad_bounds() {
    let Some(dev) = gpu("fill_uniform_rejects_bad_bounds") else { return };
    let mut buf = poisoned(&dev, 64);
    for (lo, hi) in [(1.0f32, -1.0f32), (f32::NAN, 1.0), (0.0, f32::INFINITY), (-f32::MAX, f32::MAX)] {
        let res = dev.fill_uniform(&mut buf, 1, lo, hi);
        assert!(matches!(res, Err(KernelError::Shape { .. })), "[{lo}, {hi}): {:?}", res.err());
    }
    // Nothing was written by the rejected calls; an empty buffer is fine.
    assert!(dev.download(&buf).unwrap().iter().all(|v| v.is_nan()));
    let mut empty = dev.alloc::<bf16>(0).unwrap();
    dev.fill_uniform(&mut empty, 1, 0.0, 1.0).unwrap();
}

/// A buffer of 2^32 + 9 elements (8 GiB): indices past u32 get their own values. Checks the
/// first and last million elements, the ones around 2^32 and a stride through the rest.
#[test]
fn fill_uniform_indexes_past_u32() {
    let Some(dev) = gpu("fill_uniform_indexes_past_u32") else { return };
    let n = (1usize << 32) + 9;
    let (free, _) = dev.memory_info().unwrap();
    if free < 3 * n {
        eprintln!("skipped fill_uniform_indexes_past_u32: {free} bytes free, {} needed", 2 * n);
        return;
    }
    let (seed, lo, hi) = (77u64, -0.02f32, 0.02f32);
    let mut buf = poisoned(&dev, n);
    dev.fill_uniform(&mut buf, seed, lo, hi).unwrap();
    let got = dev.download(&buf).unwrap();
    drop(buf);
    let n64 = n as u64;
    let m = 1u64 << 20;
    let around = (1u64 << 32) - m..n64;
    let sampled = (0..n64).step_by(4093);
    let indices = (0..m).chain(around).chain(sampled);
    assert_eq!(
        first_mismatch(&got, seed, lo, hi, indices),
        None,
        "fill_uniform past 2^32: differs from the CPU reference"
    );
    assert!(got[n - 9..].iter().all(|v| !v.is_nan()), "the tail past 2^32 was not written");
}

/// GB/s of the fill on Llama-3.1-8B's largest buffer (the 128256 x 4096 embedding).
#[test]
fn bench_fill_uniform_llama8b_embedding() {
    let Some(dev) = bench_enabled("bench_fill_uniform_llama8b_embedding") else { return };
    let n = 128_256 * 4096;
    let mut buf = dev.alloc::<bf16>(n).unwrap();
    let ms = median_ms(&dev, 5, 5, |i| dev.fill_uniform(&mut buf, i as u64, -0.02, 0.02));
    println!(
        "BENCH | fill_uniform | {n} bf16 | {:.1} us | - | {:.0} GB/s",
        ms * 1e3,
        (2 * n) as f64 / (ms * 1e-3) / 1e9
    );
}

/// `Device::poll_error` (how a worker asks, after a failed step, whether the context is
/// lost without waiting for queued work): no error while ~10 ms of fills are still queued
/// (CUDA_ERROR_NOT_READY is not an error), none once they finished.
#[test]
fn poll_error_does_not_wait_and_reports_nothing_on_a_healthy_device() {
    let Some(dev) = gpu("poll_error_does_not_wait_and_reports_nothing_on_a_healthy_device") else { return };
    let mut buf = dev.alloc::<bf16>(256 << 20).unwrap();
    for seed in 0..20 {
        dev.fill_uniform(&mut buf, seed, -1.0, 1.0).unwrap();
    }
    let t0 = std::time::Instant::now();
    dev.poll_error().expect("queued work is not an error");
    let polled = t0.elapsed();
    dev.synchronize().unwrap();
    let drained = t0.elapsed();
    dev.poll_error().expect("an idle healthy stream");
    eprintln!("poll_error took {polled:?} with work queued; the queue drained after {drained:?}");
    assert!(polled * 4 < drained, "poll_error waited for the queue: {polled:?} of {drained:?}");
}
