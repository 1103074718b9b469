//! CPU attention benchmark: the tiled f32-softmax kernel (`attention_tiled`, all
//! sequences in one call) against the llama.cpp-rounding f16 kernel over the same batch
//! (`attention_f16_batch`: a call per sequence, the decodes as one task each), on SmolLM2's
//! shape (9 query heads, 3 kv heads, head_dim 64) and Llama 3 8B's (32, 8, 128):
//! 16 decodes at contexts spread over 128..256 (with one layer's cache, and with thirty
//! layers' caches called in turn, which do not stay in the CPU's caches), one decode at
//! 1,024, one 128-token prefill. Prints microseconds per call (per layer) and the tiled
//! kernel's thread-nanoseconds per (position, head).
//!
//! Run: `cargo run -p tessera-kernels --release --example attention_bench`
//! (`THREADS="1 16"` picks the pool sizes; default: 1 and all cores).

use std::time::{Duration, Instant};

use half::f16;
use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tessera_kernels::cpu::attention::{PagedKv, SeqSlice};
use tessera_kernels::cpu::attention_f16::attention_f16_batch;
use tessera_kernels::cpu::attention_tiled::attention_tiled;

/// A load: its name, the sequences' (first_pos, n_tokens), and how many layers' caches.
type Load = (&'static str, Vec<(usize, usize)>, usize);

/// Fastest seconds per call of `f` over at least 0.3 s.
fn time(mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let mut best = f64::INFINITY;
    let start = Instant::now();
    let mut runs = 0;
    while start.elapsed() < Duration::from_millis(300) || runs < 5 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        runs += 1;
    }
    best
}

fn main() {
    let threads: Vec<usize> = match std::env::var("THREADS") {
        Ok(s) => s.split_whitespace().filter_map(|t| t.parse().ok()).collect(),
        Err(_) => vec![1, std::thread::available_parallelism().map_or(1, |n| n.get())],
    };
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    println!(
        "| shape | load | threads | f16 (llama.cpp rounding) µs | tiled µs | speed-up | tiled ns per position x head |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|");
    for (name, n_heads, n_kv, hd) in [("SmolLM2 9/3x64", 9, 3, 64), ("Llama-3-8B 32/8x128", 32, 8, 128)] {
        // (load, sequences' (first_pos, n_tokens), layers): a call per layer, each layer's
        // cache its own, as in a model step (30 layers' caches do not fit in the caches).
        let loads: [Load; 4] = [
            ("16 decodes, ctx 128-256", (0..16).map(|i| (128 + i * 8, 1)).collect(), 1),
            ("16 decodes, ctx 128-256, 30 layers", (0..16).map(|i| (128 + i * 8, 1)).collect(), 30),
            ("1 decode, ctx 1024", vec![(1023, 1)], 1),
            ("prefill 128", vec![(0, 128)], 1),
        ];
        for (load, shape, layers) in loads {
            let bs = 16;
            let needed: Vec<usize> = shape.iter().map(|(f, n)| (f + n).div_ceil(bs)).collect();
            let num_blocks: usize = needed.iter().sum();
            let cache = PagedKv { block_size: bs, n_kv_heads: n_kv, head_dim: hd };
            let len = layers * num_blocks * bs * n_kv * hd;
            let kc: Vec<f16> =
                (0..len).map(|_| f16::from_f32((rng.next_u32() >> 8) as f32 / (1 << 23) as f32 - 1.0)).collect();
            let vc = kc.iter().rev().copied().collect::<Vec<_>>();
            let mut tables = Vec::new();
            let mut next = 0u32;
            let cache_len = len / layers;
            for n in &needed {
                tables.push((next..next + *n as u32).collect::<Vec<u32>>());
                next += *n as u32;
            }
            let seqs: Vec<SeqSlice> = shape
                .iter()
                .zip(&tables)
                .map(|(&(first_pos, n_tokens), t)| SeqSlice { block_table: t, first_pos, n_tokens })
                .collect();
            let rows: usize = shape.iter().map(|s| s.1).sum();
            let row = n_heads * hd;
            let q: Vec<f32> = (0..rows * row).map(|_| (rng.next_u32() >> 8) as f32 / (1 << 24) as f32 - 0.5).collect();
            let pairs: usize =
                shape.iter().map(|&(f, n)| (0..n).map(|t| f + t + 1).sum::<usize>()).sum::<usize>() * n_heads;
            let scale = 1.0 / (hd as f32).sqrt();
            for &t in &threads {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build().expect("pool");
                let mut out = vec![0.0f32; rows * row];
                let f16_s = pool.install(|| {
                    time(|| {
                        for (kc, vc) in kc.chunks(cache_len).zip(vc.chunks(cache_len)) {
                            attention_f16_batch(&cache, kc, vc, &mut out, &q, &seqs, n_heads, scale).expect("f16");
                        }
                    })
                });
                let tiled_s = pool.install(|| {
                    time(|| {
                        for (kc, vc) in kc.chunks(cache_len).zip(vc.chunks(cache_len)) {
                            attention_tiled(&cache, kc, vc, &mut out, &q, &seqs, n_heads, scale).expect("tiled");
                        }
                    })
                });
                println!(
                    "| {name} | {load} | {t} | {:.1} | {:.1} | {:.2}x | {:.2} |",
                    f16_s * 1e6 / layers as f64,
                    tiled_s * 1e6 / layers as f64,
                    f16_s / tiled_s,
                    tiled_s * 1e9 * t as f64 / (pairs * layers) as f64
                );
            }
        }
    }
}
