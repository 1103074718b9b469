//! CPU matmul benchmark: weight-streaming GB/s at n=1 (decode) and GFLOP/s at n=64
//! (prefill) for Q4_1 576x1536 and 1536x576 (SmolLM2-135M's FFN shapes), on 1 and 2
//! threads, plus one whole SmolLM2-135M-Q4_1 decode step worth of matmuls (about 96 MB of
//! weights, more than the caches hold) to bound tokens/s from the matmuls alone.
//!
//! Run: `cargo run -p tessera-kernels --release --example matmul_bench [-- --types --scalar]`
//! (`--types`: the other quantised types too; `--scalar`: the portable kernels too;
//! `--vnni`: only AVX2 against AVX512-VNNI at n = 1, 4, 16, 64 on 1 and 2 threads;
//! `--packed`: row-major against packed kernels at n = 1, 16, 64, 128, `THREADS` threads)
//! (threads come from local rayon pools of 1 and 2 threads, the same as RAYON_NUM_THREADS).

use std::time::{Duration, Instant};

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tessera_kernels::cpu::matmul::{matmul_with, Isa};
use tessera_kernels::cpu::packed::PackedWeight;
use tessera_kernels::quant::{GgmlType, Weight};

/// Random blocks with small f16 scales (the values do not matter for speed, only that
/// they are not degenerate).
fn random_blocks(ty: GgmlType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let mut data = vec![0u8; rows * ty.bytes_for(cols).expect("whole blocks")];
    rng.fill_bytes(&mut data);
    let scale = half::f16::from_f32(0.01).to_bits().to_le_bytes();
    let at: &[usize] = match ty {
        GgmlType::Q4_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[0],
    };
    for b in data.chunks_exact_mut(ty.block_bytes()) {
        for &i in at {
            b[i..i + 2].copy_from_slice(&scale);
        }
    }
    data
}

fn random_x(len: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..len).map(|_| (rng.next_u32() >> 8) as f32 / (1 << 23) as f32 - 1.0).collect()
}

/// Fastest seconds per call of `f` over at least 0.3 s (the machine is shared: the
/// minimum is the least disturbed run).
fn time(mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(300) || samples.len() < 5 {
        let t = Instant::now();
        f();
        samples.push(t.elapsed().as_secs_f64());
    }
    samples.into_iter().fold(f64::INFINITY, f64::min)
}

fn bench_shape(isa: Isa, ty: GgmlType, rows: usize, cols: usize, threads: usize, ns: &[usize], rng: &mut ChaCha8Rng) {
    let data = random_blocks(ty, rows, cols, rng);
    let w = Weight::new(ty, rows, cols, &data).expect("consistent weight");
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
    for &n in ns {
        let x = random_x(n * cols, rng);
        let mut out = vec![0.0f32; n * rows];
        let s = pool.install(|| time(|| matmul_with(isa, &mut out, &x, n, &w).expect("valid shapes")));
        let gbs = data.len() as f64 / s / 1e9;
        let gflops = 2.0 * (rows * cols * n) as f64 / s / 1e9;
        println!(
            "{:6} {:5} {rows:4}x{cols:4} n={n:2} threads={threads}: {:8.1} us  {gbs:6.2} GB/s weights  {gflops:7.2} GFLOP/s",
            isa.name(),
            ty.name(),
            s * 1e6
        );
    }
}

/// All matmuls of one SmolLM2-135M Q4_1 decode step (30 layers + Q8_0 lm_head), n = 1.
fn bench_model_step(isa: Isa, threads: usize, rng: &mut ChaCha8Rng) {
    let (h, kv, ffn, vocab, layers) = (576, 192, 1536, 49152, 30);
    let layer_shapes = [(h, h), (kv, h), (kv, h), (h, h), (ffn, h), (ffn, h), (h, ffn)];
    let mut mats: Vec<(GgmlType, usize, usize, Vec<u8>)> = Vec::new();
    for _ in 0..layers {
        for &(r, c) in &layer_shapes {
            mats.push((GgmlType::Q4_1, r, c, random_blocks(GgmlType::Q4_1, r, c, rng)));
        }
    }
    mats.push((GgmlType::Q8_0, vocab, h, random_blocks(GgmlType::Q8_0, vocab, h, rng)));
    let bytes: usize = mats.iter().map(|m| m.3.len()).sum();
    let x = random_x(ffn, rng);
    let mut out = vec![0.0f32; vocab];
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
    let run = |mats: &[(GgmlType, usize, usize, Vec<u8>)], out: &mut [f32]| {
        for (ty, r, c, data) in mats {
            let w = Weight::new(*ty, *r, *c, data).expect("consistent weight");
            matmul_with(isa, &mut out[..*r], &x[..*c], 1, &w).expect("valid shapes");
        }
    };
    let (layers_part, head_part) = mats.split_at(mats.len() - 1);
    let s = pool.install(|| time(|| run(&mats, &mut out)));
    let s_layers = pool.install(|| time(|| run(layers_part, &mut out)));
    let s_head = pool.install(|| time(|| run(head_part, &mut out)));
    println!(
        "{:6} SmolLM2-135M decode step (211 matmuls, {:.1} MB) threads={threads}: {:6.2} ms  {:5.1} GB/s  => {:5.1} tok/s from matmuls alone \
         (30 layers Q4_1 {:.2} ms, lm_head Q8_0 {:.2} ms)",
        isa.name(),
        bytes as f64 / 1e6,
        s * 1e3,
        bytes as f64 / s / 1e9,
        1.0 / s,
        s_layers * 1e3,
        s_head * 1e3
    );
}

/// Row-major kernels against the packed ones (`cpu::packed`) on the same weight, the
/// fastest instruction set of this CPU, for decode and prefill token counts.
fn bench_packed(ty: GgmlType, rows: usize, cols: usize, threads: usize, rng: &mut ChaCha8Rng) {
    let isa = Isa::best();
    let data = random_blocks(ty, rows, cols, rng);
    let w = Weight::new(ty, rows, cols, &data).expect("consistent weight");
    let Some(packed) = PackedWeight::pack(&w, isa).expect("consistent weight") else {
        println!("{} has no packed {} kernel", isa.name(), ty.name());
        return;
    };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
    for n in [1, 16, 64, 128] {
        let x = random_x(n * cols, rng);
        let mut out = vec![0.0f32; n * rows];
        let s_row = pool.install(|| time(|| matmul_with(isa, &mut out, &x, n, &w).expect("valid shapes")));
        let s_packed = pool.install(|| time(|| packed.matmul(&mut out, &x, n).expect("valid shapes")));
        let gflops = |s: f64| 2.0 * (rows * cols * n) as f64 / s / 1e9;
        println!(
            "{:10} {:5} {rows:5}x{cols:4} n={n:3} threads={threads:2}: row-major {:9.1} us {:7.1} GFLOP/s | packed {:9.1} us {:7.1} GFLOP/s | {:.2}x",
            isa.name(),
            ty.name(),
            s_row * 1e6,
            gflops(s_row),
            s_packed * 1e6,
            gflops(s_packed),
            s_row / s_packed
        );
    }
}

fn main() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    if std::env::args().any(|a| a == "--packed") {
        // THREADS="1 2 16" picks the thread counts (default 1 and 2).
        let threads: Vec<usize> = std::env::var("THREADS")
            .ok()
            .map(|v| v.split_whitespace().filter_map(|t| t.parse().ok()).collect())
            .unwrap_or_else(|| vec![1, 2]);
        for &t in &threads {
            bench_packed(GgmlType::Q4_1, 576, 1536, t, &mut rng);
            bench_packed(GgmlType::Q4_1, 1536, 576, t, &mut rng);
            bench_packed(GgmlType::Q8_0, 49152, 576, t, &mut rng);
        }
        return;
    }
    if std::env::args().any(|a| a == "--vnni") {
        let Some(vnni) = Isa::vnni() else {
            println!("this CPU lacks AVX512-VNNI");
            return;
        };
        for threads in [1, 2] {
            for isa in Isa::avx2().into_iter().chain([vnni]) {
                let q41 = [1, 4, 16, 64];
                bench_shape(isa, GgmlType::Q4_1, 576, 1536, threads, &q41, &mut rng);
                bench_shape(isa, GgmlType::Q4_1, 1536, 576, threads, &q41, &mut rng);
                bench_shape(isa, GgmlType::Q8_0, 49152, 576, threads, &[1, 16], &mut rng);
            }
        }
        return;
    }
    let mut isas = vec![Isa::best()];
    if std::env::args().any(|a| a == "--scalar") {
        isas.push(Isa::scalar());
    }
    for isa in isas {
        for threads in [1, 2] {
            bench_shape(isa, GgmlType::Q4_1, 576, 1536, threads, &[1, 64], &mut rng);
            bench_shape(isa, GgmlType::Q4_1, 1536, 576, threads, &[1, 64], &mut rng);
        }
        if std::env::args().any(|a| a == "--types") {
            for ty in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
                bench_shape(isa, ty, 576, 1536, 1, &[1, 64], &mut rng);
            }
        }
        for threads in [1, 2] {
            bench_model_step(isa, threads, &mut rng);
        }
    }
}
