//! CPU matmul against straightforward references, for every weight type, several shapes,
//! every kernel path (scalar, AVX2, AVX512-VNNI where the CPU has them), plus shape errors
//! and `dequantize_rows`.
//!
//! Weights are random blocks (random quant bytes, random f16 scales of sane size) or
//! random floats; activations are random with a different scale per token.
//! References, both in f64 from `dequantize_row` (checked against gguf-py in
//! `quant_fixtures.rs`):
//! - exact: `Σ W[r][c]·x[t][c]`. The matmul quantises each block of x to 8 bits
//!   (`d = max|x_block| / 127`, rounding error <= d/2 per value; for 32-value blocks the
//!   stored `d` and block sum are also rounded to f16, as in ggml), so the allowed error
//!   is that bound summed with weights `|W[r][c]|` (see `QuantX`), plus 1e-5 of
//!   `Σ|W||x|` for f32 sums. Measured errors are far below it: relative to
//!   `‖W_r‖·‖x_t‖` they stay under ~5e-3 (printed by the test), asserted < 1e-2.
//! - quantised: the same sum with x replaced by its 8-bit reconstruction, computed
//!   here independently; then only f32 rounding differs: 2e-5 of `Σ|W||x_q|`.
//!   F32/F16/BF16 weights use f32 activations, so both references are the exact one.

use half::f16;
use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tessera_kernels::cpu::matmul::{dequantize_rows, matmul, matmul_with, Isa};
use tessera_kernels::cpu::packed::PackedWeight;
use tessera_kernels::quant::q8::{ActsQ8, Q8_SCALES_F16};
use tessera_kernels::quant::{dequantize_row, GgmlType, Weight};

const ALL: [GgmlType; 9] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

fn uniform(rng: &mut ChaCha8Rng) -> f32 {
    (rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
}

/// Random f16 with magnitude in [1e-3, 3e-2] and a random sign, as little-endian bytes.
fn scale_bytes(rng: &mut ChaCha8Rng) -> [u8; 2] {
    let mag = 1e-3 * 30f32.powf((uniform(rng) + 1.0) / 2.0);
    let v = if rng.next_u32() & 1 == 0 { mag } else { -mag };
    f16::from_f32(v).to_bits().to_le_bytes()
}

/// `rows` random rows of `cols` values in type `ty`.
fn random_weight(ty: GgmlType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let n = rows * cols;
    match ty {
        GgmlType::F32 => (0..n).flat_map(|_| uniform(rng).to_le_bytes()).collect(),
        GgmlType::F16 => (0..n).flat_map(|_| f16::from_f32(uniform(rng)).to_bits().to_le_bytes()).collect(),
        GgmlType::BF16 => (0..n).flat_map(|_| ((uniform(rng).to_bits() >> 16) as u16).to_le_bytes()).collect(),
        _ => {
            let bb = ty.block_bytes();
            let mut data = vec![0u8; ty.bytes_for(n).unwrap()];
            rng.fill_bytes(&mut data);
            // Scale fields get sane f16 values; everything else stays random.
            let scale_offsets: &[usize] = match ty {
                GgmlType::Q4_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
                GgmlType::Q6K => &[208],
                _ => &[0],
            };
            for block in data.chunks_exact_mut(bb) {
                for &o in scale_offsets {
                    block[o..o + 2].copy_from_slice(&scale_bytes(rng));
                }
            }
            data
        }
    }
}

/// Activations `[n, cols]`: uniform values, a random scale per token, a few outliers.
fn random_x(n: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    let mut x = Vec::with_capacity(n * cols);
    for _ in 0..n {
        let scale = 0.05 + 4.0 * (uniform(rng) + 1.0);
        for _ in 0..cols {
            let outlier = if rng.next_u32().is_multiple_of(97) { 6.0 } else { 1.0 };
            x.push(uniform(rng) * scale * outlier);
        }
    }
    x
}

/// Block length of the 8-bit activation quantisation for weights of type `ty`.
fn act_block(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => None,
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => Some(32),
        _ => Some(256),
    }
}

/// Independent 8-bit quantisation of one token's activations, as the matmul's contract
/// says: per block, `d = max|x| / 127` (f32), `q = round_half_even(x · id)` (see below); for 32-value
/// blocks the stored scale `d16` and the block sum `s16 = d·Σq` are rounded to f16 when
/// the library says so (`Q8_SCALES_F16`, as ggml's Q8_0/Q8_1), for 256-value blocks (Q8_K)
/// `d` stays f32. (`d16 = d`, `s16 = d·Σq` when nothing is rounded.)
struct QuantX {
    /// The reconstruction `q · d16` of each value.
    xq: Vec<f64>,
    /// Per value, how far `q · d16` may be from x: `d/2 + |q|·|d16 - d|`.
    err: Vec<f64>,
    /// Per block, `s16 - d16·Σq`: the kernels use `s16` for the offset of Q4_0/Q4_1.
    s_err: Vec<f64>,
}

fn quantised_x(x: &[f32], block: usize) -> QuantX {
    let mut qx = QuantX { xq: Vec::new(), err: Vec::new(), s_err: Vec::new() };
    let f16_round = |v: f32| {
        if block == 32 && Q8_SCALES_F16 {
            f16::from_f32(v).to_f32()
        } else {
            v
        }
    };
    for b in x.chunks(block) {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        // The multiplier is `127 / max|x|` for 32-value blocks (as ggml's x86 Q8_0/Q8_1),
        // `1 / d` for 256-value ones.
        let id = match (d > 0.0, block == 32) {
            (false, _) => 0.0,
            (true, true) => 127.0 / amax,
            (true, false) => 1.0 / d,
        };
        let q: Vec<f32> = b.iter().map(|&v| (v * id).round_ties_even()).collect();
        let d16 = f16_round(d) as f64;
        let qsum: f32 = q.iter().sum();
        qx.s_err.push(f16_round(d * qsum) as f64 - d16 * qsum as f64);
        for &qv in &q {
            qx.xq.push(qv as f64 * d16);
            qx.err.push(d as f64 / 2.0 + (qv as f64).abs() * (d16 - d as f64).abs());
        }
    }
    qx
}

/// The offset term of each 32-value block of a Q4_0/Q4_1 row (the weight value at
/// quant 0: `-8·d` or `m`), which the kernels multiply by the activation sum `s16`.
fn block_offsets(ty: GgmlType, row: &[u8]) -> Vec<f64> {
    let f16_at = |b: &[u8], i: usize| f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32() as f64;
    match ty {
        GgmlType::Q4_0 => row.chunks_exact(18).map(|b| -8.0 * f16_at(b, 0)).collect(),
        GgmlType::Q4_1 => row.chunks_exact(20).map(|b| f16_at(b, 2)).collect(),
        _ => Vec::new(),
    }
}

/// Checks `matmul_with(isa)` against both references; returns the worst error relative to
/// `‖W_r‖·‖x_t‖` (for information).
fn check_case(isa: Isa, ty: GgmlType, rows: usize, cols: usize, n: usize, seed: u64) -> f64 {
    check_case_of(isa.name(), ty, rows, cols, n, seed, |out, x, w| matmul_with(isa, out, x, n, w).unwrap())
}

/// [`check_case`] for any implementation `mm(out, x, w)` of the matmul (`label` names it).
fn check_case_of(
    label: &str,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n: usize,
    seed: u64,
    mut mm: impl FnMut(&mut [f32], &[f32], &Weight),
) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let data = random_weight(ty, rows, cols, &mut rng);
    let x = random_x(n, cols, &mut rng);
    let w = Weight::new(ty, rows, cols, &data).unwrap();
    let mut out = vec![f32::NAN; n * rows];
    mm(&mut out, &x, &w);

    let row_bytes = ty.bytes_for(cols).unwrap();
    let mut wrow = vec![0.0f32; cols];
    let mut worst = 0.0f64;
    for r in 0..rows {
        dequantize_row(ty, &data[r * row_bytes..(r + 1) * row_bytes], &mut wrow).unwrap();
        let wnorm = wrow.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        for t in 0..n {
            let xt = &x[t * cols..(t + 1) * cols];
            let got = out[t * rows + r] as f64;
            let exact: f64 = wrow.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
            let abs_sum: f64 = wrow.iter().zip(xt).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            let (quant_ref, bound, q_abs_sum) = match act_block(ty) {
                None => (exact, 0.0, abs_sum),
                Some(block) => {
                    let qx = quantised_x(xt, block);
                    let offsets = block_offsets(ty, &data[r * row_bytes..(r + 1) * row_bytes]);
                    let s_term: f64 = offsets.iter().zip(&qx.s_err).map(|(m, e)| m * e).sum();
                    let s_bound: f64 = offsets.iter().zip(&qx.s_err).map(|(m, e)| (m * e).abs()).sum();
                    let q: f64 = wrow.iter().zip(&qx.xq).map(|(&a, &b)| a as f64 * b).sum();
                    let qa: f64 = wrow.iter().zip(&qx.xq).map(|(&a, &b)| (a as f64 * b).abs()).sum();
                    let bound: f64 = wrow.iter().zip(&qx.err).map(|(&a, &e)| (a as f64).abs() * e).sum();
                    (q + s_term, bound + s_bound, qa)
                }
            };
            let ctx = || format!("{label} {ty} rows={rows} cols={cols} n={n} r={r} t={t}");
            let err = (got - exact).abs();
            assert!(
                err <= bound + 1e-5 * abs_sum,
                "{}: got {got}, exact {exact}, err {err:e} > bound {bound:e}",
                ctx()
            );
            let qerr = (got - quant_ref).abs();
            assert!(qerr <= 2e-5 * q_abs_sum, "{}: got {got}, quantised-x ref {quant_ref}, err {qerr:e}", ctx());
            let xnorm = xt.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
            worst = worst.max(err / (wnorm * xnorm).max(1e-30));
        }
    }
    worst
}

fn cols_for(ty: GgmlType) -> &'static [usize] {
    match act_block(ty) {
        Some(256) => &[256, 512, 1536],
        _ => &[64, 256, 576, 1536],
    }
}

fn isas() -> Vec<Isa> {
    let mut v = vec![Isa::scalar()];
    v.extend(Isa::avx2());
    v.extend(Isa::vnni());
    v
}

#[test]
fn every_type_matches_reference() {
    let mut seed = 1;
    for isa in isas() {
        for ty in ALL {
            let mut worst = 0.0f64;
            for &cols in cols_for(ty) {
                for &rows in &[7usize, 64, 129] {
                    for &n in &[1usize, 3, 17] {
                        seed += 1;
                        worst = worst.max(check_case(isa, ty, rows, cols, n, seed));
                    }
                }
            }
            // The activation quantisation error, relative to ‖W_r‖·‖x_t‖, stays small.
            assert!(worst < 1e-2, "{} {ty}: relative error {worst:e}", isa.name());
            println!("{:6} {ty:5}: worst |err| / (‖W_r‖·‖x_t‖) = {worst:.2e}", isa.name());
        }
    }
}

#[test]
fn large_shapes_and_token_tiles() {
    // Many row chunks across threads, and more tokens than one token tile (64).
    for isa in isas() {
        check_case(isa, GgmlType::Q4_1, 1001, 576, 2, 100);
        check_case(isa, GgmlType::Q8_0, 300, 576, 70, 101);
        check_case(isa, GgmlType::Q4K, 130, 512, 67, 102);
        check_case(isa, GgmlType::F16, 100, 200, 66, 103); // 200 columns: SIMD tail
    }
}

#[test]
fn scalar_and_avx2_agree() {
    let Some(avx2) = Isa::avx2() else {
        eprintln!("no AVX2 on this CPU: nothing to compare");
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for ty in ALL {
        // n = 5 and 70: whole token groups of 4 and a ragged one; 2 and 3: one short group.
        for (&cols, &n) in cols_for(ty).iter().flat_map(|c| [2usize, 3, 5, 70].iter().map(move |n| (c, n))) {
            let rows = 37;
            let data = random_weight(ty, rows, cols, &mut rng);
            let x = random_x(n, cols, &mut rng);
            let w = Weight::new(ty, rows, cols, &data).unwrap();
            let (mut a, mut b) = (vec![0.0f32; n * rows], vec![0.0f32; n * rows]);
            matmul_with(Isa::scalar(), &mut a, &x, n, &w).unwrap();
            matmul_with(avx2, &mut b, &x, n, &w).unwrap();
            let row_bytes = ty.bytes_for(cols).unwrap();
            let mut wrow = vec![0.0f32; cols];
            for r in 0..rows {
                dequantize_row(ty, &data[r * row_bytes..(r + 1) * row_bytes], &mut wrow).unwrap();
                for t in 0..n {
                    let abs_sum: f32 = wrow.iter().zip(&x[t * cols..(t + 1) * cols]).map(|(p, q)| (p * q).abs()).sum();
                    let (s, v) = (a[t * rows + r], b[t * rows + r]);
                    if act_block(ty) == Some(32) {
                        // Q4_0/Q4_1/Q8_0: the same lanes, FMA chains and final sum.
                        assert!(s.to_bits() == v.to_bits(), "{ty} cols={cols} r={r} t={t}: scalar {s} avx2 {v}");
                    }
                    // Same integer block sums; at most the f32 summation order differs.
                    assert!((s - v).abs() <= 2e-6 * abs_sum, "{ty} cols={cols} r={r} t={t}: scalar {s} avx2 {v}");
                }
            }
        }
    }
}

/// The VNNI kernels compute the same i32 block dots as the AVX2 ones and the same f32
/// steps in the same order, so they must agree bit for bit on every tile shape (n = 1..5
/// covers each micro-kernel, 17 and 70 mixed tiles and two token tiles); every other type
/// shares the AVX2 kernels. Each token is also computed alone: batch invariance.
#[test]
fn vnni_equals_avx2_bit_for_bit() {
    let (Some(avx2), Some(vnni)) = (Isa::avx2(), Isa::vnni()) else {
        eprintln!("skipped vnni_equals_avx2_bit_for_bit: no AVX512-VNNI on this CPU (bench/gpu/run.sh runs it on the GPU host)");
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for ty in ALL {
        for &cols in cols_for(ty) {
            for &(rows, n) in &[(37usize, 1usize), (8, 2), (9, 3), (37, 4), (5, 5), (37, 17), (3, 70)] {
                let data = random_weight(ty, rows, cols, &mut rng);
                let x = random_x(n, cols, &mut rng);
                let w = Weight::new(ty, rows, cols, &data).unwrap();
                let (mut a, mut b) = (vec![0.0f32; n * rows], vec![0.0f32; n * rows]);
                matmul_with(avx2, &mut a, &x, n, &w).unwrap();
                matmul_with(vnni, &mut b, &x, n, &w).unwrap();
                for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                    assert!(p.to_bits() == q.to_bits(), "{ty} {rows}x{cols} n={n} out[{i}]: avx2 {p} vnni {q}");
                }
                let mut one = vec![0.0f32; rows];
                for t in 0..n {
                    matmul_with(vnni, &mut one, &x[t * cols..(t + 1) * cols], 1, &w).unwrap();
                    let batched = &b[t * rows..(t + 1) * rows];
                    assert!(
                        one.iter().zip(batched).all(|(p, q)| p.to_bits() == q.to_bits()),
                        "{ty} {rows}x{cols} n={n} token {t}: alone {one:?} batched {batched:?}"
                    );
                }
            }
        }
    }
    eprintln!("VNNI matmul kernels: bit-equal to the AVX2 ones on every type and tile shape");
}

#[test]
fn default_path_is_the_best_isa() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let data = random_weight(GgmlType::Q4_1, 33, 256, &mut rng);
    let x = random_x(2, 256, &mut rng);
    let w = Weight::new(GgmlType::Q4_1, 33, 256, &data).unwrap();
    let (mut a, mut b) = (vec![0.0f32; 66], vec![0.0f32; 66]);
    matmul(&mut a, &x, 2, &w).unwrap();
    matmul_with(Isa::best(), &mut b, &x, 2, &w).unwrap();
    assert_eq!(a, b);
}

#[test]
fn bad_lengths_are_errors() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let data = random_weight(GgmlType::Q4_1, 8, 64, &mut rng); // 8 rows x 40 bytes
    let w = Weight { ty: GgmlType::Q4_1, rows: 8, cols: 64, data: &data };
    let x = random_x(2, 64, &mut rng);
    let mut out = vec![0.0f32; 16];
    assert!(matmul(&mut out, &x, 2, &w).is_ok());
    assert!(matmul(&mut out, &x[..127], 2, &w).is_err(), "short x");
    assert!(matmul(&mut out[..15], &x, 2, &w).is_err(), "short out");
    assert!(matmul(&mut out, &x, 3, &w).is_err(), "n disagrees with x");
    assert!(matmul(&mut out, &x, usize::MAX, &w).is_err(), "n overflows");
    let short = Weight { data: &data[..319], ..w };
    assert!(matmul(&mut out, &x, 2, &short).is_err(), "short weight data");
    let long_rows = Weight { rows: 9, ..w };
    assert!(matmul(&mut [0.0; 18], &x, 2, &long_rows).is_err(), "rows disagree with data");
    let odd_cols = Weight { cols: 48, ..w };
    assert!(matmul(&mut out, &x[..96], 2, &odd_cols).is_err(), "cols not whole blocks");
    assert!(Weight::new(GgmlType::Q4K, 1, 64, &data[..144]).is_err(), "K type needs 256 columns");
    let err = matmul(&mut out, &x[..127], 2, &w).unwrap_err().to_string();
    assert!(err.contains("matmul") && err.contains("127"), "error names the op and the length: {err}");
}

#[test]
fn dequantize_rows_matches_dequantize_row() {
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    for ty in ALL {
        let cols = cols_for(ty)[0];
        let rows = 9;
        let data = random_weight(ty, rows, cols, &mut rng);
        let w = Weight::new(ty, rows, cols, &data).unwrap();
        let row_bytes = ty.bytes_for(cols).unwrap();
        let mut got = vec![f32::NAN; 3 * cols];
        dequantize_rows(&w, 5, &mut got).unwrap();
        for k in 0..3 {
            let mut want = vec![0.0f32; cols];
            dequantize_row(ty, &data[(5 + k) * row_bytes..(6 + k) * row_bytes], &mut want).unwrap();
            assert_eq!(&got[k * cols..(k + 1) * cols], &want[..], "{ty} row {}", 5 + k);
        }
        assert!(dequantize_rows(&w, 7, &mut got).is_err(), "{ty}: rows 7..10 of 9");
        assert!(dequantize_rows(&w, 9, &mut got[..cols]).is_err(), "{ty}: row 9 of 9");
        assert!(dequantize_rows(&w, 0, &mut got[..cols + 1]).is_err(), "{ty}: partial row");
        assert!(dequantize_rows(&w, 8, &mut got[..cols]).is_ok());
    }
}

/// The packed-weight types: every instruction set with a packed kernel for them.
const PACKED: [GgmlType; 3] = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0];

fn packed(w: &Weight, isa: Isa) -> Option<PackedWeight> {
    PackedWeight::pack(w, isa).unwrap()
}

/// The packed kernels (`cpu/packed.rs`) against the same references as the row-major
/// ones: row counts that leave a partial group of 16, and token counts around the tile of 8.
#[test]
fn packed_matches_reference() {
    let mut seed = 500;
    for isa in isas() {
        for ty in PACKED {
            let mut worst = 0.0f64;
            let mut ran = false;
            for &cols in &[32usize, 96, 576] {
                for &rows in &[5usize, 16, 37, 64] {
                    for &n in &[1usize, 3, 8, 9, 20] {
                        seed += 1;
                        let label = format!("packed {}", isa.name());
                        worst = worst.max(check_case_of(&label, ty, rows, cols, n, seed, |out, x, w| {
                            if let Some(p) = packed(w, isa) {
                                ran = true;
                                p.matmul(out, x, n).unwrap();
                            } else {
                                out.fill(0.0);
                                matmul_with(isa, out, x, n, w).unwrap();
                            }
                        }));
                    }
                }
            }
            assert!(worst < 1e-2, "packed {} {ty}: relative error {worst:e}", isa.name());
            assert!(ran, "packed {} {ty}: nothing packed", isa.name());
            println!("packed {:10} {ty:5}: ran {ran}, worst |err| / (‖W_r‖·‖x_t‖) = {worst:.2e}", isa.name());
        }
    }
}

/// Every SIMD packed kernel gives the scalar packed kernel's bits, on every tile width
/// (n = 1..9 and 21: tiles of 8 with every remainder) and a partial last group; and a
/// token computed alone gives the bits it gets in any batch (batch invariance).
#[test]
fn packed_simd_equals_scalar_bit_for_bit() {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let mut compared = Vec::new();
    for isa in [Isa::avx2(), Isa::vnni()].into_iter().flatten() {
        for ty in PACKED {
            for &(rows, cols) in &[(37usize, 576usize), (16, 64), (200, 96)] {
                let data = random_weight(ty, rows, cols, &mut rng);
                let w = Weight::new(ty, rows, cols, &data).unwrap();
                let Some(fast) = packed(&w, isa) else { continue };
                let slow = packed(&w, Isa::scalar()).expect("the scalar path packs every packed type");
                compared.push(format!("{} {ty}", isa.name()));
                for n in (1..=9).chain([21]) {
                    let x = random_x(n, cols, &mut rng);
                    let (mut a, mut b) = (vec![0.0f32; n * rows], vec![0.0f32; n * rows]);
                    slow.matmul(&mut a, &x, n).unwrap();
                    fast.matmul(&mut b, &x, n).unwrap();
                    for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                        assert!(
                            p.to_bits() == q.to_bits(),
                            "{} {ty} {rows}x{cols} n={n} out[{i}]: scalar {p} simd {q}",
                            isa.name()
                        );
                    }
                    let mut one = vec![0.0f32; rows];
                    for t in 0..n {
                        fast.matmul(&mut one, &x[t * cols..(t + 1) * cols], 1).unwrap();
                        let batched = &b[t * rows..(t + 1) * rows];
                        assert!(
                            one.iter().zip(batched).all(|(p, q)| p.to_bits() == q.to_bits()),
                            "{} {ty} n={n} token {t}: alone {one:?} batched {batched:?}",
                            isa.name()
                        );
                    }
                }
            }
        }
    }
    eprintln!("packed kernels bit-equal to the scalar packed kernel: {compared:?}");
}

/// The entries for activations quantised beforehand (`matmul_parts_q8`, `matmul_add_q8`)
/// give the bits of the entries that quantise `x` themselves, on every packed type and
/// path; activations of the wrong shape are errors.
#[test]
fn packed_q8_entries_equal_the_f32_entries() {
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    for isa in isas() {
        for ty in PACKED {
            let (rows, cols) = (37usize, 96usize);
            let data = random_weight(ty, rows, cols, &mut rng);
            let w = Weight::new(ty, rows, cols, &data).unwrap();
            let Some(p) = packed(&w, isa) else { continue };
            for n in [1usize, 3, 20] {
                let x = random_x(n, cols, &mut rng);
                let acts = ActsQ8::quantize_plain(&x, cols);
                let (mut a1, mut a2) = (vec![0.0f32; n * 30], vec![0.0f32; n * 7]);
                let (mut b1, mut b2) = (vec![0.0f32; n * 30], vec![0.0f32; n * 7]);
                p.matmul_parts(&mut [&mut a1, &mut a2], &x, n).unwrap();
                p.matmul_parts_q8(&mut [&mut b1, &mut b2], &acts, n).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!((bits(&a1), bits(&a2)), (bits(&b1), bits(&b2)), "{} {ty} n={n} parts", isa.name());
                let base = random_x(n, rows, &mut rng);
                let (mut c, mut d) = (base.clone(), base);
                p.matmul_add(&mut c, &x, n).unwrap();
                p.matmul_add_q8(&mut d, &acts, n).unwrap();
                assert_eq!(bits(&c), bits(&d), "{} {ty} n={n} add", isa.name());
            }
            let acts = ActsQ8::quantize_plain(&random_x(2, cols, &mut rng), cols);
            let mut out = vec![0.0f32; 3 * rows];
            assert!(p.matmul_parts_q8(&mut [&mut out], &acts, 3).is_err(), "two rows of activations for n = 3");
            let narrow = ActsQ8::quantize_plain(&random_x(3, 32, &mut rng), 32);
            assert!(p.matmul_add_q8(&mut out, &narrow, 3).is_err(), "rows of 32 for a 96-wide weight");
            // The same number of quants in rows of the wrong width, and short scale or
            // block-sum vectors: the kernels read those unchecked, so the entry refuses.
            let same_len = ActsQ8::quantize_plain(&random_x(9, 32, &mut rng), 32);
            assert!(p.matmul_add_q8(&mut out, &same_len, 3).is_err(), "nine rows of 32 as three of 96");
            let good = ActsQ8::quantize_plain(&random_x(3, cols, &mut rng), cols);
            let mut short_d = good.clone();
            short_d.d.pop();
            assert!(p.matmul_add_q8(&mut out, &short_d, 3).is_err(), "a scale missing");
            let mut short_s = good.clone();
            short_s.s.truncate(3);
            assert!(p.matmul_parts_q8(&mut [&mut out], &short_s, 3).is_err(), "block sums missing");
            assert!(p.matmul_add_q8(&mut out, &good, 3).is_ok(), "the well-formed activations pass");
        }
    }
}

/// What packs: Q4_0/Q4_1/Q8_0 only, with SIMD kernels on AVX2 and AVX-512 VNNI; shapes
/// are checked, and empty shapes give empty (or zero) outputs.
#[test]
fn packed_types_and_errors() {
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q4K, GgmlType::Q6K] {
        let data = random_weight(ty, 16, 256, &mut rng);
        let w = Weight::new(ty, 16, 256, &data).unwrap();
        assert!(packed(&w, Isa::best()).is_none() && packed(&w, Isa::scalar()).is_none(), "{ty} packed");
        assert!(!PackedWeight::has_simd_kernel(Isa::best(), ty));
    }
    for ty in PACKED {
        assert!(!PackedWeight::has_simd_kernel(Isa::scalar(), ty), "the scalar packed kernel is a reference only");
        for isa in [Isa::avx2(), Isa::vnni()].into_iter().flatten() {
            assert!(PackedWeight::has_simd_kernel(isa, ty), "{} {ty}", isa.name());
        }
    }
    let data = random_weight(GgmlType::Q8_0, 16, 64, &mut rng);
    let w = Weight::new(GgmlType::Q8_0, 16, 64, &data).unwrap();
    let p = packed(&w, Isa::scalar()).unwrap();
    assert_eq!((p.rows(), p.cols(), p.ty()), (16, 64, GgmlType::Q8_0));
    let mut out = vec![0.0f32; 2 * 16];
    assert!(p.matmul(&mut out, &[0.5; 63], 1).is_err(), "short x");
    assert!(p.matmul(&mut out, &[0.5; 128], 1).is_err(), "x of two tokens for n = 1");
    assert!(p.matmul(&mut out[..31], &[0.5; 128], 2).is_err(), "short out");
    let bad = Weight { ty: GgmlType::Q4_1, rows: 2, cols: 32, data: &data[..10] };
    assert!(PackedWeight::pack(&bad, Isa::scalar()).is_err(), "short weight data");
    let other = Weight::new(GgmlType::Q8_0, 16, 32, &data[..16 * 34]).unwrap();
    assert!(PackedWeight::pack_parts(&[w, other], Isa::scalar()).is_err(), "parts of different widths");
    assert!(PackedWeight::pack_parts(&[], Isa::scalar()).is_err(), "no parts");
    // Empty shapes: no rows, no columns (zeros out), no tokens.
    for isa in isas() {
        let none = Weight::new(GgmlType::Q4_1, 0, 64, &[]).unwrap();
        let p = packed(&none, isa).unwrap();
        p.matmul(&mut [], &[0.5; 128], 2).unwrap();
        let narrow = Weight::new(GgmlType::Q4_1, 3, 0, &[]).unwrap();
        let p = packed(&narrow, isa).unwrap();
        let mut out = [f32::NAN; 6];
        p.matmul(&mut out, &[], 2).unwrap();
        assert_eq!(out, [0.0; 6]);
        let p = packed(&w, isa).unwrap();
        p.matmul(&mut [], &[], 0).unwrap();
    }
}

/// Extreme values within the format: every nibble 15 (or Q8_0 quant -128 / 127) against
/// activation blocks quantised to all +127 or all -127, the largest integer block sums
/// (the i16 bound of the AVX2 kernels); the SIMD kernels must still give the scalar bits,
/// and the scalar kernel the exact sum.
#[test]
fn packed_extreme_values() {
    let (rows, cols, n) = (19usize, 64usize, 4usize);
    // Token t: constant blocks of +v or -v, so every activation quantises to +-127.
    let x: Vec<f32> = (0..n * cols).map(|i| if (i / 32 + i / cols) % 2 == 0 { 0.75 } else { -0.75 }).collect();
    let one = f16::from_f32(1.0).to_bits().to_le_bytes();
    for ty in PACKED {
        let bb = ty.block_bytes();
        let mut data = vec![0u8; rows * ty.bytes_for(cols).unwrap()];
        for (i, blk) in data.chunks_exact_mut(bb).enumerate() {
            blk[0..2].copy_from_slice(&one);
            match ty {
                GgmlType::Q4_1 => {
                    blk[2..4].copy_from_slice(&one);
                    blk[4..].fill(0xFF);
                }
                GgmlType::Q4_0 => blk[2..].fill(0xFF),
                _ => blk[2..].fill(if i % 2 == 0 { 0x80 } else { 0x7F }),
            }
        }
        let w = Weight::new(ty, rows, cols, &data).unwrap();
        let slow = packed(&w, Isa::scalar()).unwrap();
        let mut want = vec![0.0f32; n * rows];
        slow.matmul(&mut want, &x, n).unwrap();
        // Exact: x quantises to +-127 with d = 0.75 / 127 (f16-rounded); the weights are
        // 15 (Q4_1: 15 + 1; Q4_0: 15 - 8) or -128 / 127 in every row.
        let d = f16::from_f32(0.75 / 127.0).to_f32() as f64;
        for t in 0..n {
            for r in 0..rows {
                let mut exact = 0.0f64;
                for b in 0..cols / 32 {
                    let sign = if (b + t) % 2 == 0 { 1.0 } else { -1.0 };
                    let wv = match ty {
                        GgmlType::Q4_1 => 16.0,
                        GgmlType::Q4_0 => 7.0,
                        _ => {
                            if (r * (cols / 32) + b) % 2 == 0 {
                                -128.0
                            } else {
                                127.0
                            }
                        }
                    };
                    exact += sign * 32.0 * 127.0 * d * wv;
                }
                let got = want[t * rows + r] as f64;
                assert!((got - exact).abs() <= 1e-3 * exact.abs().max(1.0), "{ty} t={t} r={r}: {got} vs exact {exact}");
            }
        }
        for isa in [Isa::avx2(), Isa::vnni()].into_iter().flatten() {
            let fast = packed(&w, isa).unwrap();
            let mut got = vec![0.0f32; n * rows];
            fast.matmul(&mut got, &x, n).unwrap();
            assert!(
                got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{} {ty}: {got:?} vs scalar {want:?}",
                isa.name()
            );
        }
    }
}

/// Packing parts stacked row-wise is packing their concatenation, and `matmul_parts`
/// gives each part's output columns in a buffer of its own.
#[test]
fn packed_parts_equal_the_concatenation() {
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    for ty in PACKED {
        let (a, b) = (random_weight(ty, 21, 96, &mut rng), random_weight(ty, 8, 96, &mut rng));
        let (wa, wb) = (Weight::new(ty, 21, 96, &a).unwrap(), Weight::new(ty, 8, 96, &b).unwrap());
        let joined: Vec<u8> = a.iter().chain(&b).copied().collect();
        let wj = Weight::new(ty, 29, 96, &joined).unwrap();
        let x = random_x(5, 96, &mut rng);
        let (mut p, mut q) = (vec![0.0f32; 5 * 29], vec![0.0f32; 5 * 29]);
        let stacked = PackedWeight::pack_parts(&[wa, wb], Isa::best()).unwrap().unwrap();
        stacked.matmul(&mut p, &x, 5).unwrap();
        packed(&wj, Isa::best()).unwrap().matmul(&mut q, &x, 5).unwrap();
        assert!(p.iter().zip(&q).all(|(a, b)| a.to_bits() == b.to_bits()), "{ty}");

        // The outputs split between buffers (at, across and between the 16-row groups;
        // 14 tokens: a whole tile of 8 and a part one) equal the joint output's columns.
        let x = random_x(14, 96, &mut rng);
        let mut joint = vec![0.0f32; 14 * 29];
        stacked.matmul(&mut joint, &x, 14).unwrap();
        for split in [vec![21, 8], vec![16, 13], vec![3, 17, 9], vec![29], vec![0, 29], vec![1; 29]] {
            let mut bufs: Vec<Vec<f32>> = split.iter().map(|r| vec![f32::NAN; 14 * r]).collect();
            let mut outs: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            stacked.matmul_parts(&mut outs, &x, 14).unwrap();
            let mut c0 = 0;
            for (b, &r) in bufs.iter().zip(&split) {
                for t in 0..14 {
                    let want = &joint[t * 29 + c0..t * 29 + c0 + r];
                    assert!(
                        b[t * r..(t + 1) * r].iter().zip(want).all(|(a, w)| a.to_bits() == w.to_bits()),
                        "{ty} {split:?}"
                    );
                }
                c0 += r;
            }
        }
        // Outputs that do not add up to the rows, or are not whole rows, are refused.
        for split in [vec![21, 7], vec![21, 9], vec![29, 1]] {
            let mut bufs: Vec<Vec<f32>> = split.iter().map(|r| vec![0.0; 14 * r]).collect();
            let mut outs: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            assert!(stacked.matmul_parts(&mut outs, &x, 14).is_err(), "{ty} {split:?}");
        }
        let (mut a, mut b) = (vec![0.0f32; 14 * 21 + 1], vec![0.0f32; 14 * 8 - 1]);
        assert!(stacked.matmul_parts(&mut [&mut a, &mut b], &x, 14).is_err(), "{ty}: rows split mid-row");
    }
}

/// `matmul_add` is `matmul` then one f32 addition per value, bit for bit, at token
/// counts below, at and past a tile; shape errors leave `out` alone.
#[test]
fn packed_matmul_add_is_matmul_then_add() {
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    for ty in PACKED {
        let data = random_weight(ty, 37, 64, &mut rng);
        let w = Weight::new(ty, 37, 64, &data).unwrap();
        let p = packed(&w, Isa::best()).unwrap();
        for n in [1, 8, 13] {
            let x = random_x(n, 64, &mut rng);
            let base = random_x(n, 37, &mut rng);
            let mut product = vec![0.0f32; n * 37];
            p.matmul(&mut product, &x, n).unwrap();
            let mut got = base.clone();
            p.matmul_add(&mut got, &x, n).unwrap();
            let want: Vec<f32> = base.iter().zip(&product).map(|(a, b)| a + b).collect();
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{ty} n={n}");
        }
        let x = random_x(3, 64, &mut rng);
        let mut short = vec![1.0f32; 3 * 37 - 1];
        assert!(p.matmul_add(&mut short, &x, 3).is_err());
        assert!(short.iter().all(|&v| v == 1.0));
    }
}
