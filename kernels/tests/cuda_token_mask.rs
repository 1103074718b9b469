//! The constrained-decoding mask kernel against a CPU reference written here: random logits,
//! random masks for a random subset of rows (the others must stay bit-identical), a
//! vocabulary that is not a multiple of 32, and the padding bits past it ignored.
//!
//! Needs a GPU: runs only with `TESSERA_CUDA_TESTS=1` (or `TESSERA_GPU_TESTS=1`).
#![cfg(feature = "cuda")]

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tessera_kernels::cuda::Device;

fn device() -> Option<Device> {
    let on = ["TESSERA_CUDA_TESTS", "TESSERA_GPU_TESTS"].iter().any(|k| std::env::var(k).as_deref() == Ok("1"));
    if !on {
        eprintln!("skipped: set TESSERA_CUDA_TESTS=1 on a machine with a CUDA GPU");
        return None;
    }
    Some(Device::new(0).expect("TESSERA_CUDA_TESTS=1 but no CUDA device"))
}

#[test]
fn token_mask_matches_cpu_reference() {
    let Some(dev) = device() else { return };
    let mut r = ChaCha8Rng::seed_from_u64(41);
    for (rows, vocab, density) in [(1usize, 49_152usize, 2u32), (7, 151_936, 5), (13, 1_000, 1), (4, 33, 2)] {
        let words = vocab.div_ceil(32);
        let logits: Vec<f32> = (0..rows * vocab).map(|_| (r.next_u32() >> 8) as f32 / 65_536.0 - 128.0).collect();
        // Constrained rows: a random subset, in random order.
        let mut chosen: Vec<u32> = (0..rows as u32).filter(|_| r.next_u32() % 3 != 0).collect();
        if chosen.is_empty() {
            chosen.push(0);
        }
        chosen.reverse();
        // Bits set with probability 1/density, plus the padding bits past the vocabulary
        // (which must not matter).
        let masks: Vec<u32> = (0..chosen.len() * words)
            .map(|_| (0..32).fold(0u32, |w, b| w | (u32::from(r.next_u32() % density == 0) << b)))
            .collect();
        let mut want = logits.clone();
        for (k, &row) in chosen.iter().enumerate() {
            for t in 0..vocab {
                if masks[k * words + t / 32] >> (t % 32) & 1 == 0 {
                    want[row as usize * vocab + t] = f32::NEG_INFINITY;
                }
            }
        }
        let mut d_logits = dev.upload(&logits).unwrap();
        let d_masks = dev.upload(&masks).unwrap();
        let d_rows = dev.upload(&chosen).unwrap();
        dev.apply_token_mask(&mut d_logits, vocab, &d_masks, &d_rows, chosen.len()).unwrap();
        let got = dev.download(&d_logits).unwrap();
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g.to_bits() == w.to_bits(), "rows {rows} vocab {vocab}: [{i}] got {g}, want {w}");
        }
        let banned = want.iter().filter(|v| v.is_infinite()).count();
        eprintln!("{rows} rows x {vocab}: {} constrained, {banned} banned, ok", chosen.len());
    }
    // Bad shapes are errors, not launches.
    let mut l = dev.upload(&[0f32; 64]).unwrap();
    let m = dev.upload(&[0u32; 1]).unwrap();
    let rows = dev.upload(&[0u32; 1]).unwrap();
    assert!(dev.apply_token_mask(&mut l, 64, &m, &rows, 1).is_err(), "too few mask words");
    assert!(dev.apply_token_mask(&mut l, 60, &m, &rows, 1).is_err(), "logits not rows of vocab");
}
