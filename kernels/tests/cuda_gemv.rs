//! The decode GEMM (`kernels/cuda/gemv.cu`, taken by `Device::matmul` / `matmul_f32` for
//! at most 8 rows of x and W up to 64M values) against an f64 reference written here, on
//! random bf16 inputs, outputs poisoned with NaN first, under every launch setting and in
//! CUDA graphs; plus benchmarks next to cuBLASLt (eager, in a graph, after an rms_norm) and
//! the sweep the launch defaults come from.
//!
//! Needs a GPU: tests run only with `TESSERA_GPU_TESTS=1`, benchmarks only with
//! `TESSERA_GPU_BENCH=1` (`bench/gpu/run.sh` runs both on the device machine).
//!
//! Tolerances, per element, with `S = sum_k |x_k w_k|` (exact products, f32 sums):
//! - f32 output: `|gpu - ref| <= 2^-14 S`. The products of bf16 values are exact; each of
//!   the <= K/16 sequential f32 accumulations of a warp and the cross-warp sum adds at most
//!   ~2^-23 S, so even K = 14336 stays under 2^-16 S.
//! - bf16 output: the same plus the output's rounding, `|ref| / 256` (at most 2^-9 |ref|,
//!   doubled for the sum's own error); and on the GEMV path it must equal the f32 output
//!   rounded to bf16 bit for bit (both kernels sum in the same order).
#![cfg(feature = "cuda")]

mod common;

use common::gpu::*;

use half::bf16;
use tessera_kernels::cuda::{Buf, Device};

/// `(sum_k x[i, k] w[j, k], sum_k |x[i, k] w[j, k]|)` in f64, `[m, rows]` each.
fn reference(x: &[bf16], w: &[bf16], m: usize, rows: usize, cols: usize) -> (Vec<f64>, Vec<f64>) {
    let (x, w) = (to_f32(x), to_f32(w));
    let (mut out, mut mag) = (vec![0.0; m * rows], vec![0.0; m * rows]);
    for i in 0..m {
        let xr = &x[i * cols..(i + 1) * cols];
        for j in 0..rows {
            let wr = &w[j * cols..(j + 1) * cols];
            let (mut s, mut a) = (0f64, 0f64);
            for (&xv, &wv) in xr.iter().zip(wr) {
                let p = f64::from(xv) * f64::from(wv);
                s += p;
                a += p.abs();
            }
            out[i * rows + j] = s;
            mag[i * rows + j] = a;
        }
    }
    (out, mag)
}

/// The GEMV's dispatch limit on W (values), as in gemv.rs: larger W goes to cuBLASLt.
const GEMV_MAX_WEIGHTS: usize = 64 << 20;

fn poisoned_f32(dev: &Device, n: usize) -> Buf<f32> {
    dev.upload(&vec![f32::NAN; n]).unwrap()
}

/// Checks `got` (f32 or bf16 widened) against the reference; returns the worst error in
/// units of `S`.
fn check(what: &str, got: &[f32], want: &[f64], mag: &[f64], bf16_out: bool) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0f64;
    for (i, ((&g, &w), &a)) in got.iter().zip(want).zip(mag).enumerate() {
        let g = f64::from(g);
        let err = (g - w).abs();
        let bound = a / 16384.0 + if bf16_out { w.abs() / 256.0 } else { 0.0 };
        assert!(err <= bound, "{what}[{i}]: got {g}, want {w} (err {err:e}, sum|xw| {a})");
        worst = worst.max(err / a.max(f64::MIN_POSITIVE));
    }
    worst
}

/// Runs `matmul` and `matmul_f32` on one shape and checks both.
fn run_case(dev: &Device, r: &mut rand_chacha::ChaCha8Rng, m: usize, rows: usize, cols: usize) {
    let x = rand_bf16(r, m * cols, -1.0, 1.0);
    let w = rand_bf16(r, rows * cols, -0.1, 0.1);
    let (want, mag) = reference(&x, &w, m, rows, cols);
    let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
    let mut o16 = poisoned(dev, m * rows);
    let mut o32 = poisoned_f32(dev, m * rows);
    dev.matmul(&mut o16, &xd, m, &wd, rows, cols).unwrap();
    dev.matmul_f32(&mut o32, &xd, m, &wd, rows, cols).unwrap();
    let (g16, g32) = (dev.download(&o16).unwrap(), dev.download(&o32).unwrap());
    let what = format!("m={m} {rows}x{cols}");
    let e32 = check(&format!("{what} f32"), &g32, &want, &mag, false);
    let e16 = check(&format!("{what} bf16"), &to_f32(&g16), &want, &mag, true);
    if m <= 8 && cols.is_multiple_of(8) && rows * cols <= GEMV_MAX_WEIGHTS {
        for (i, (a, b)) in g16.iter().zip(&g32).enumerate() {
            assert_eq!(a.to_bits(), bf16::from_f32(*b).to_bits(), "{what}[{i}]: bf16 output != bf16(f32 output)");
        }
    }
    eprintln!("{what}: ok, worst err f32 {e32:.2e} S, bf16 {e16:.2e} S");
}

#[test]
fn gemv_matches_f64_reference() {
    let Some(dev) = gpu("gemv_matches_f64_reference") else { return };
    let mut r = rng(41);
    // (rows, cols): SmolLM2's o / gate_up / down (576, 1536: not multiples of 256), Llama's
    // hidden (4096) and FFN (14336) widths, rows not a multiple of the 16-row tile, column
    // counts ending in a partial 64-column chunk (1000 = 15 x 64 + 40) and tiny ones.
    let shapes =
        [(576, 576), (1536, 576), (203, 1536), (1000, 4096), (77, 14336), (40, 1000), (19, 8), (33, 24), (1, 4096)];
    for m in [1usize, 2, 3, 5, 8] {
        for (rows, cols) in shapes {
            run_case(&dev, &mut r, m, rows, cols);
        }
    }
}

/// Around the dispatch: m = 9, columns not a multiple of 8 and W over 64M values
/// (16400 x 4096) take cuBLASLt, and the results are as right as the GEMV's.
#[test]
fn matmul_dispatch_boundaries() {
    let Some(dev) = gpu("matmul_dispatch_boundaries") else { return };
    let mut r = rng(42);
    for (m, rows, cols) in
        [(8, 300, 2048), (9, 300, 2048), (3, 45, 20), (1, 64, 1030), (1, 16400, 4096), (2, 16380, 4096)]
    {
        run_case(&dev, &mut r, m, rows, cols);
    }
    // Wrong lengths are shape errors before any dispatch.
    let (x, w) = (dev.alloc::<bf16>(16).unwrap(), dev.alloc::<bf16>(64).unwrap());
    let mut out = dev.alloc::<bf16>(15).unwrap();
    assert!(dev.matmul(&mut out, &x, 2, &w, 8, 8).is_err());
}

/// The GEMV inside a CUDA graph, with and without programmatic dependent launch: replays
/// read the x the buffer holds at replay time.
#[test]
fn gemv_in_cuda_graph() {
    let Some(dev) = gpu("gemv_in_cuda_graph") else { return };
    let mut r = rng(43);
    let (m, rows, cols) = (2usize, 1000usize, 4096usize);
    let w = rand_bf16(&mut r, rows * cols, -0.1, 0.1);
    let wd = dev.upload(&w).unwrap();
    let mut xd = dev.upload(&rand_bf16(&mut r, m * cols, -1.0, 1.0)).unwrap();
    for pdl in [0u8, 1, 2] {
        dev.set_gemv_tuning(6, 8, true, pdl).unwrap();
        let mut out = poisoned_f32(&dev, m * 64);
        // Two GEMVs back to back in one graph: the second reads what the first wrote.
        let mut mid = dev.upload(&vec![bf16::NAN; m * rows]).unwrap();
        let w2 = rand_bf16(&mut r, 64 * rows, -0.1, 0.1);
        let w2d = dev.upload(&w2).unwrap();
        let graph = dev
            .capture(|| {
                dev.matmul(&mut mid, &xd, m, &wd, rows, cols)?;
                dev.matmul_f32(&mut out, &mid, m, &w2d, 64, rows)
            })
            .unwrap();
        for step in 0..2 {
            let x = rand_bf16(&mut r, m * cols, -1.0, 1.0);
            dev.write(&mut xd, &x).unwrap();
            dev.launch_graph(&graph).unwrap();
            let got_mid = dev.download(&mid).unwrap();
            let (want, mag) = reference(&x, &w, m, rows, cols);
            check(&format!("graph pdl={pdl} replay {step} first"), &to_f32(&got_mid), &want, &mag, true);
            // The second GEMV against its actual input (the first's bf16 output).
            let (want2, mag2) = reference(&got_mid, &w2, m, 64, rows);
            check(&format!("graph pdl={pdl} replay {step} second"), &dev.download(&out).unwrap(), &want2, &mag2, false);
        }
    }
    eprintln!("gemv in a CUDA graph: ok");
}

/// Every launch setting the tuning sweep times is correct: ring depths, warps per CTA
/// (1 = one warp does every chunk; 16 = more warps than some shapes have chunks), one CTA
/// per tile or a persistent wave looping over tiles (20000 rows = 1250 tiles, more than a
/// wave of CTAs, so the ring runs across tile boundaries), with and without PDL.
#[test]
fn gemv_tunings_match_reference() {
    let Some(dev) = gpu("gemv_tunings_match_reference") else { return };
    let mut r = rng(44);
    for (m, rows, cols) in [(3usize, 20000usize, 1000usize), (8, 77, 14336), (1, 40, 576)] {
        let x = rand_bf16(&mut r, m * cols, -1.0, 1.0);
        let w = rand_bf16(&mut r, rows * cols, -0.1, 0.1);
        let (want, mag) = reference(&x, &w, m, rows, cols);
        let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
        for stages in [2usize, 4, 6] {
            for warps in [1usize, 8, 16] {
                for persistent in [false, true] {
                    for pdl in [0u8, 2] {
                        dev.set_gemv_tuning(stages, warps, persistent, pdl).unwrap();
                        let what = format!("p{stages} w{warps} persistent={persistent} pdl={pdl} m={m} {rows}x{cols}");
                        let mut o16 = poisoned(&dev, m * rows);
                        let mut o32 = poisoned_f32(&dev, m * rows);
                        dev.matmul(&mut o16, &xd, m, &wd, rows, cols).unwrap();
                        dev.matmul_f32(&mut o32, &xd, m, &wd, rows, cols).unwrap();
                        check(&what, &to_f32(&dev.download(&o16).unwrap()), &want, &mag, true);
                        check(&what, &dev.download(&o32).unwrap(), &want, &mag, false);
                    }
                }
            }
        }
        eprintln!("tunings m={m} {rows}x{cols}: ok");
    }
    assert!(dev.set_gemv_tuning(3, 8, true, 1).is_err());
    assert!(dev.set_gemv_tuning(4, 0, true, 1).is_err());
    assert!(dev.set_gemv_tuning(4, 8, true, 3).is_err());
}

// ---------------------------------------------------------------- benchmarks

/// (name, rows, cols, f32 output): Llama-3-8B's decode GEMMs and LM heads (128256 = Llama 3,
/// 49152 = SmolLM2's vocabulary at width 4096), then SmolLM2-135M's.
const SHAPES: &[(&str, usize, usize, bool)] = &[
    ("qkv", 6144, 4096, false),
    ("o", 4096, 4096, false),
    ("gate_up", 28672, 4096, false),
    ("down", 4096, 14336, false),
    ("lm_head", 128256, 4096, true),
    ("lm_head_49k", 49152, 4096, true),
    ("smol_qkv", 960, 576, false),
    ("smol_o", 576, 576, false),
    ("smol_gate_up", 3072, 576, false),
    ("smol_down", 576, 1536, false),
    ("smol_lm_head", 49152, 576, true),
];

/// Enough copies of W that one timing loop reads well over the 60 MB L2 from HBM.
fn weights(dev: &Device, rows: usize, cols: usize) -> Vec<Buf<bf16>> {
    let copies = 400_000_000usize.div_ceil(rows * cols * 2).clamp(1, 1024);
    (0..copies)
        .map(|c| {
            let mut b = dev.alloc::<bf16>(rows * cols).unwrap();
            dev.fill_uniform(&mut b, 100 + c as u64, -1.0, 1.0).unwrap();
            b
        })
        .collect()
}

fn gbps(bytes: usize, ms: f64) -> f64 {
    bytes as f64 / (ms * 1e-3) / 1e9
}

#[test]
fn bench_gemv_vs_cublaslt() {
    let Some(dev) = bench_enabled("bench_gemv_vs_cublaslt") else { return };
    // HBM reference: a 1 GiB device-to-device copy (bytes read + written).
    {
        let n = 1usize << 29;
        let src = dev.alloc::<bf16>(n).unwrap();
        let mut dst = dev.alloc::<bf16>(n).unwrap();
        let ms = median_ms(&dev, 5, 10, |_| dev.copy_rows(&mut dst, 0, &src, 0, 1, n));
        println!("BENCH | d2d copy | 1 GiB | {:.1} us | - | {:.0} GB/s (read + write)", ms * 1e3, gbps(4 * n, ms));
    }
    for &(name, rows, cols, f32_out) in SHAPES {
        let ws = weights(&dev, rows, cols);
        let copies = ws.len();
        for m in [1usize, 2, 4, 8] {
            let mut x = dev.alloc::<bf16>(m * cols).unwrap();
            dev.fill_uniform(&mut x, 7 + m as u64, -1.0, 1.0).unwrap();
            let bytes = (rows * cols + m * cols) * 2 + m * rows * if f32_out { 4 } else { 2 };
            let reps = if rows * cols > 100_000_000 { 20 } else { 100 };
            let (ours, theirs) = if f32_out {
                let mut out = dev.alloc::<f32>(m * rows).unwrap();
                let a = median_ms(&dev, 7, reps, |i| dev.matmul_f32(&mut out, &x, m, &ws[i % copies], rows, cols));
                let b =
                    median_ms(&dev, 7, reps, |i| dev.matmul_f32_cublaslt(&mut out, &x, m, &ws[i % copies], rows, cols));
                (a, b)
            } else {
                let mut out = dev.alloc::<bf16>(m * rows).unwrap();
                let a = median_ms(&dev, 7, reps, |i| dev.matmul(&mut out, &x, m, &ws[i % copies], rows, cols));
                let b = median_ms(&dev, 7, reps, |i| dev.matmul_cublaslt(&mut out, &x, m, &ws[i % copies], rows, cols));
                (a, b)
            };
            let out_ty = if f32_out { "f32" } else { "bf16" };
            for (path, ms) in [("gemv", ours), ("cublaslt", theirs)] {
                println!(
                    "BENCH | {path} {name} | M={m} N={rows} K={cols} out {out_ty} | {:.2} us | {:.2}x cuBLASLt | {:.0} GB/s",
                    ms * 1e3,
                    theirs / ms,
                    gbps(bytes, ms)
                );
            }
        }
    }
}

/// Tuning sweep of the GEMV's launch settings (bf16 output, or f32 for the LM heads).
#[test]
fn bench_gemv_tuning() {
    let Some(dev) = bench_enabled("bench_gemv_tuning") else { return };
    for &(name, rows, cols, f32_out) in SHAPES {
        let ws = weights(&dev, rows, cols);
        let copies = ws.len();
        let ms_list: &[usize] = if rows * cols > 100_000_000 || cols < 4096 { &[1] } else { &[1, 8] };
        for &m in ms_list {
            let mut x = dev.alloc::<bf16>(m * cols).unwrap();
            dev.fill_uniform(&mut x, 3, -1.0, 1.0).unwrap();
            let mut o16 = dev.alloc::<bf16>(m * rows).unwrap();
            let mut o32 = dev.alloc::<f32>(m * rows).unwrap();
            let bytes = (rows * cols + m * cols) * 2 + m * rows * if f32_out { 4 } else { 2 };
            let reps = if rows * cols > 100_000_000 { 10 } else { 40 };
            for stages in [2usize, 4, 6] {
                for warps in [4usize, 8, 16] {
                    for persistent in [false, true] {
                        for pdl in [0u8, 1, 2] {
                            dev.set_gemv_tuning(stages, warps, persistent, pdl).unwrap();
                            let ms = median_ms(&dev, 5, reps, |i| {
                                let w = &ws[i % copies];
                                if f32_out {
                                    dev.matmul_f32(&mut o32, &x, m, w, rows, cols)
                                } else {
                                    dev.matmul(&mut o16, &x, m, w, rows, cols)
                                }
                            });
                            println!(
                                "TUNE | {name} M={m} | p{stages} w{warps} persist={} pdl={pdl} | {:.2} us | {:.0} GB/s",
                                u8::from(persistent),
                                ms * 1e3,
                                gbps(bytes, ms)
                            );
                        }
                    }
                }
            }
        }
    }
}

/// GPU time per call with the host out of the picture: 20 calls (rotating W copies)
/// captured in one CUDA graph, as a decode step runs them; the GEMV with each PDL mode
/// (0: off; 1: programmatic launch; 2: also W's first copies before the wait) next to
/// cuBLASLt captured the same way.
#[test]
fn bench_gemv_graph() {
    let Some(dev) = bench_enabled("bench_gemv_graph") else { return };
    const CALLS: usize = 20;
    for &(name, rows, cols, f32_out) in SHAPES {
        let ws = weights(&dev, rows, cols);
        let copies = ws.len();
        for m in [1usize, 8] {
            let mut x = dev.alloc::<bf16>(m * cols).unwrap();
            dev.fill_uniform(&mut x, 11, -1.0, 1.0).unwrap();
            let mut o16 = dev.alloc::<bf16>(m * rows).unwrap();
            let mut o32 = dev.alloc::<f32>(m * rows).unwrap();
            let bytes = (rows * cols + m * cols) * 2 + m * rows * if f32_out { 4 } else { 2 };
            let mut time = |label: &str, lt: bool| {
                let graph = dev.capture(|| {
                    for i in 0..CALLS {
                        let w = &ws[i % copies];
                        match (f32_out, lt) {
                            (true, true) => dev.matmul_f32_cublaslt(&mut o32, &x, m, w, rows, cols)?,
                            (true, false) => dev.matmul_f32(&mut o32, &x, m, w, rows, cols)?,
                            (false, true) => dev.matmul_cublaslt(&mut o16, &x, m, w, rows, cols)?,
                            (false, false) => dev.matmul(&mut o16, &x, m, w, rows, cols)?,
                        }
                    }
                    Ok(())
                });
                match graph {
                    Ok(g) => {
                        let ms = median_ms(&dev, 7, 5, |_| dev.launch_graph(&g)) / CALLS as f64;
                        println!(
                            "GRAPH | {label} {name} | M={m} N={rows} K={cols} | {:.2} us | {:.0} GB/s",
                            ms * 1e3,
                            gbps(bytes, ms)
                        );
                    }
                    Err(e) => println!("GRAPH | {label} {name} | M={m} | capture failed: {e}"),
                }
            };
            time("cublaslt", true);
            for pdl in [0u8, 1, 2] {
                dev.set_gemv_tuning(6, 8, true, pdl).unwrap();
                time(&format!("gemv pdl={pdl}"), false);
            }
        }
    }
}

/// A decode-like pair: rms_norm writes x, the GEMM reads it (the GEMV's programmatic launch
/// can overlap only the norm's tail here, not another GEMV's).
#[test]
fn bench_gemv_after_norm() {
    let Some(dev) = bench_enabled("bench_gemv_after_norm") else { return };
    for &(name, rows, cols, _) in &SHAPES[..4] {
        let ws = weights(&dev, rows, cols);
        let copies = ws.len();
        let mut src = dev.alloc::<bf16>(cols).unwrap();
        dev.fill_uniform(&mut src, 5, -1.0, 1.0).unwrap();
        let mut norm_w = dev.alloc::<bf16>(cols).unwrap();
        dev.fill_uniform(&mut norm_w, 6, 0.5, 1.5).unwrap();
        let mut x = dev.alloc::<bf16>(cols).unwrap();
        let mut out = dev.alloc::<bf16>(rows).unwrap();
        let norm_ms = median_ms(&dev, 7, 100, |_| dev.rms_norm(&mut x, &src, &norm_w, 1, 1e-5));
        let lt = median_ms(&dev, 7, 100, |i| {
            dev.rms_norm(&mut x, &src, &norm_w, 1, 1e-5)?;
            dev.matmul_cublaslt(&mut out, &x, 1, &ws[i % copies], rows, cols)
        });
        for pdl in [0u8, 1, 2] {
            dev.set_gemv_tuning(6, 8, true, pdl).unwrap();
            let ms = median_ms(&dev, 7, 100, |i| {
                dev.rms_norm(&mut x, &src, &norm_w, 1, 1e-5)?;
                dev.matmul(&mut out, &x, 1, &ws[i % copies], rows, cols)
            });
            println!(
                "BENCH | norm+gemv {name} pdl={pdl} | M=1 N={rows} K={cols} | {:.2} us | norm alone {:.2} us | norm+cuBLASLt {:.2} us",
                ms * 1e3,
                norm_ms * 1e3,
                lt * 1e3
            );
        }
    }
}
