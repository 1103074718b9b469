//! Slicing weights for tensor parallelism: each tp rank keeps only its part of every
//! matrix, in the file's own (possibly quantised) type.
//!
//! - Column-parallel layers (q, k, v, gate, up, and the vocabulary shard of the embedding
//!   and LM head) split the output dimension: a rank keeps whole rows, so [`rows`] is a view
//!   into the same storage.
//! - Row-parallel layers (o, down) split the input dimension: a rank keeps a slice of every
//!   row, so [`cols`] copies; a quantised row can only be cut between blocks, which is
//!   why `coordinator::placement` checks the block alignment of these splits up front.
//!
//! Head ownership follows the same rules as `coordinator::placement`: query heads split
//! evenly; KV heads split evenly when `tp <= n_kv`, else each KV head is replicated on
//! `tp / n_kv` consecutive ranks.

use std::ops::Range;

use crate::error::WorkerError;
use crate::weights::Linear;

/// Rows `range` of `w` (column-parallel layers: q, k, v, gate, up, and the vocab shard of
/// embedding / LM head): a view sharing `w`'s storage, no copy.
pub fn rows(w: &Linear, range: Range<usize>) -> Result<Linear, WorkerError> {
    if range.is_empty() || range.end > w.rows {
        return Err(bad_range("row", w, &range, format!("a non-empty range of rows within 0..{}", w.rows)));
    }
    w.row_view(range.clone())
        .ok_or_else(|| bad_range("row", w, &range, format!("whole {} rows of {} values", w.ty, w.cols)))
}

/// Columns `range` of every row (row-parallel layers: o, down): a new owned weight. The
/// range must start and end on block boundaries of `w.ty`.
pub fn cols(w: &Linear, range: Range<usize>) -> Result<Linear, WorkerError> {
    let block = w.ty.block_elems();
    let expected =
        || format!("a non-empty range within 0..{} on {} block boundaries (multiples of {block})", w.cols, w.ty);
    if range.is_empty() || range.end > w.cols || !range.start.is_multiple_of(block) || !range.end.is_multiple_of(block)
    {
        return Err(bad_range("column", w, &range, expected()));
    }
    let (Some(first), Some(last)) = (w.ty.bytes_for(range.start), w.ty.bytes_for(range.end)) else {
        return Err(bad_range("column", w, &range, expected()));
    };
    let src = w.weight();
    let row_bytes = src.check("shard::cols")?;
    let mut out = Vec::with_capacity(w.rows * (last - first));
    // `row_bytes > 0`: the range is non-empty and within `w.cols`, so `w.cols > 0`.
    for row in src.data.chunks_exact(row_bytes) {
        let part = row.get(first..last).ok_or_else(|| bad_range("column", w, &range, expected()))?;
        out.extend_from_slice(part);
    }
    Linear::from_parts(w.ty, w.rows, range.len(), out)
}

/// Elements `range` of a vector (biases of q/k/v).
pub fn slice_vec(v: &[f32], range: Range<usize>) -> Result<Vec<f32>, WorkerError> {
    match v.get(range.clone()) {
        Some(part) if !part.is_empty() => Ok(part.to_vec()),
        _ => Err(WorkerError::TensorShape {
            name: format!("shard of a vector of {} values", v.len()),
            expected: format!("a non-empty range within 0..{}", v.len()),
            found: format!("{range:?}"),
        }),
    }
}

/// The heads tp rank `rank` owns: (query heads, KV heads). Query heads split evenly; KV
/// heads split evenly when `tp <= n_kv`, else rank `r` holds KV head `r / (tp / n_kv)`
/// (replicated). Expects a split `coordinator::placement` accepted (`n_heads % tp == 0`,
/// `n_kv % tp == 0` or `tp % n_kv == 0`, `rank < tp`); other inputs give meaningless but
/// never panicking ranges (empty for `tp == 0` or `n_kv == 0`).
pub fn head_ranges(n_heads: usize, n_kv: usize, tp: usize, rank: usize) -> (Range<usize>, Range<usize>) {
    if tp == 0 || n_kv == 0 {
        return (0..0, 0..0);
    }
    let q_per = n_heads / tp;
    let q = rank.saturating_mul(q_per)..rank.saturating_add(1).saturating_mul(q_per);
    let kv = if tp <= n_kv {
        let per = n_kv / tp;
        rank.saturating_mul(per)..rank.saturating_add(1).saturating_mul(per)
    } else {
        let head = rank / (tp / n_kv);
        head..head.saturating_add(1)
    };
    (q, kv)
}

fn bad_range(kind: &str, w: &Linear, range: &Range<usize>, expected: String) -> WorkerError {
    WorkerError::TensorShape {
        name: format!("{kind} shard of a [{}, {}] {} weight", w.rows, w.cols, w.ty),
        expected,
        found: format!("{range:?}"),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use half::f16;
    use rand_chacha::ChaCha8Rng;
    use rand_core::{Rng, SeedableRng};
    use tessera_kernels::cpu::matmul::matmul;
    use tessera_kernels::quant::dequantize_row;
    use tessera_kernels::GgmlType;
    use tessera_model::gguf::{GgufFile, GgufWriter};
    use tessera_model::weights::ModelFiles;

    use super::*;
    use crate::weights::WeightLoader;

    const TYPES: [GgmlType; 4] = [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::Q4K];

    fn uniform(rng: &mut ChaCha8Rng) -> f32 {
        (rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
    }

    /// `rows x cols` random values in `ty`: random quant bytes with sane f16 scales (a
    /// random magnitude in [1e-3, 3e-2] and sign), or random f32.
    fn random_bytes(ty: GgmlType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
        if ty == GgmlType::F32 {
            return (0..rows * cols).flat_map(|_| uniform(rng).to_le_bytes()).collect();
        }
        let mut data = vec![0u8; ty.bytes_for(rows * cols).unwrap()];
        rng.fill_bytes(&mut data);
        let scale_offsets: &[usize] = match ty {
            GgmlType::Q4_1 | GgmlType::Q4K => &[0, 2],
            _ => &[0],
        };
        for block in data.chunks_exact_mut(ty.block_bytes()) {
            for &o in scale_offsets {
                let mag = 1e-3 * 30f32.powf((uniform(rng) + 1.0) / 2.0);
                let v = if rng.next_u32() & 1 == 0 { mag } else { -mag };
                block[o..o + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        data
    }

    fn random_linear(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Linear {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        Linear::from_parts(ty, rows, cols, random_bytes(ty, rows, cols, &mut rng)).unwrap()
    }

    /// Activations `[n, cols]` with a different scale per token.
    fn random_x(n: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut x = Vec::with_capacity(n * cols);
        for _ in 0..n {
            let scale = 0.1 + 3.0 * (uniform(&mut rng) + 1.0);
            x.extend((0..cols).map(|_| uniform(&mut rng) * scale));
        }
        x
    }

    fn dequantized(w: &Linear) -> Vec<Vec<f32>> {
        let wt = w.weight();
        let row_bytes = wt.check("test").unwrap();
        wt.data
            .chunks_exact(row_bytes)
            .map(|r| {
                let mut out = vec![0.0; w.cols];
                dequantize_row(w.ty, r, &mut out).unwrap();
                out
            })
            .collect()
    }

    fn mm(x: &[f32], n: usize, w: &Linear) -> Vec<f32> {
        let mut out = vec![0.0; n * w.rows];
        matmul(&mut out, x, n, &w.weight()).unwrap();
        out
    }

    /// The same rows, three ways: the shard's matmul equals the matching outputs of the
    /// full matmul bit for bit, and the shard's bytes are the full weight's (a view).
    fn check_row_shards(full: &Linear, shards: &[Range<usize>], x: &[f32], n: usize) {
        let want = mm(x, n, full);
        let row_bytes = full.weight().row_bytes("test").unwrap();
        for r in shards {
            let s = rows(full, r.clone()).unwrap();
            assert_eq!((s.ty, s.rows, s.cols), (full.ty, r.len(), full.cols));
            let full_data = full.weight().data;
            assert!(std::ptr::eq(s.weight().data.as_ptr(), full_data[r.start * row_bytes..].as_ptr()), "a view");
            let got = mm(x, n, &s);
            for t in 0..n {
                let expect = &want[t * full.rows + r.start..t * full.rows + r.end];
                let got = &got[t * r.len()..(t + 1) * r.len()];
                assert_eq!(got, expect, "{} rows {r:?}, token {t}", full.ty);
            }
        }
    }

    #[test]
    fn row_shards_match_full_matmul_exactly() {
        let (rows_n, cols_n, n) = (24, 512, 5);
        let x = random_x(n, cols_n, 7);
        for (i, ty) in TYPES.into_iter().enumerate() {
            let full = random_linear(ty, rows_n, cols_n, 100 + i as u64);
            // tp=3 (8 rows each), tp=4, and an uneven pair.
            let shards = [0..8, 8..16, 16..24, 0..6, 18..24, 0..5, 5..24];
            check_row_shards(&full, &shards, &x, n);
            // A shard of a shard is the same view as the direct shard.
            let inner = rows(&rows(&full, 8..24).unwrap(), 3..9).unwrap();
            assert!(std::ptr::eq(inner.weight().data, rows(&full, 11..17).unwrap().weight().data));
        }
    }

    #[test]
    fn row_shards_of_a_mapped_weight() {
        let (rows_n, cols_n, n) = (12, 256, 3);
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut g = GgufWriter::new();
        g.add_tensor(
            "w",
            GgmlType::Q4_1,
            &[cols_n as u64, rows_n as u64],
            random_bytes(GgmlType::Q4_1, rows_n, cols_n, &mut rng),
        );
        let files = ModelFiles::Gguf(GgufFile::from_bytes(g.to_bytes().unwrap()).unwrap());
        let loader = WeightLoader::new(Arc::new(files));
        let full = loader.linear("w", rows_n, cols_n).unwrap();
        check_row_shards(&full, &[0..4, 4..8, 8..12, 3..10], &random_x(n, cols_n, 12), n);
    }

    #[test]
    fn column_shards_sum_to_full_matmul() {
        let (rows_n, cols_n, n) = (10, 768, 4);
        let x = random_x(n, cols_n, 21);
        for (i, ty) in TYPES.into_iter().enumerate() {
            let full = random_linear(ty, rows_n, cols_n, 200 + i as u64);
            let splits: Vec<Vec<usize>> = match ty {
                GgmlType::F32 => vec![vec![0, 100, 333, 768], vec![0, 256, 512, 768]],
                GgmlType::Q4K => vec![vec![0, 256, 512, 768], vec![0, 512, 768]],
                _ => vec![vec![0, 256, 512, 768], vec![0, 96, 640, 768], vec![0, 32, 768]],
            };
            let full_deq = dequantized(&full);
            let full_out = mm(&x, n, &full);
            for bounds in splits {
                let mut sum = vec![0.0f32; n * rows_n];
                for b in bounds.windows(2) {
                    let (c0, c1) = (b[0], b[1]);
                    let s = cols(&full, c0..c1).unwrap();
                    assert_eq!((s.ty, s.rows, s.cols), (ty, rows_n, c1 - c0));
                    // The shard decodes to exactly those columns of the full weight.
                    for (got, want) in dequantized(&s).iter().zip(&full_deq) {
                        assert_eq!(got[..], want[c0..c1], "{ty} columns {c0}..{c1}");
                    }
                    let xs: Vec<f32> = x.chunks_exact(cols_n).flat_map(|row| row[c0..c1].to_vec()).collect();
                    for (acc, v) in sum.iter_mut().zip(mm(&xs, n, &s)) {
                        *acc += v;
                    }
                }
                for t in 0..n {
                    let xt = &x[t * cols_n..(t + 1) * cols_n];
                    for (r, wr) in full_deq.iter().enumerate() {
                        let exact: f64 = wr.iter().zip(xt).map(|(&w, &v)| w as f64 * v as f64).sum();
                        let abs: f64 = wr.iter().zip(xt).map(|(&w, &v)| (w as f64 * v as f64).abs()).sum();
                        let norms = wr.iter().map(|&w| (w as f64).powi(2)).sum::<f64>().sqrt()
                            * xt.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
                        let (got, whole) = (sum[t * rows_n + r] as f64, full_out[t * rows_n + r] as f64);
                        // Same 8-bit activation blocks in both (the cuts are block-aligned),
                        // so only the f32 summation order differs.
                        assert!((got - whole).abs() <= 1e-5 * abs, "{ty} {bounds:?} t{t} r{r}: {got} vs {whole}");
                        // And both are the matmul of the dequantised weights (the kernel's
                        // activation rounding stays well under 1e-2 of |W_r||x_t|).
                        assert!((got - exact).abs() <= 1e-2 * norms, "{ty} {bounds:?} t{t} r{r}: {got} vs {exact}");
                    }
                }
            }
        }
    }

    fn shape_error(r: Result<Linear, WorkerError>) -> String {
        match r {
            Err(e @ WorkerError::TensorShape { .. }) => e.to_string(),
            Err(e) => panic!("wrong error kind: {e}"),
            Ok(_) => panic!("expected an error"),
        }
    }

    #[test]
    fn bad_ranges_are_errors() {
        let w = random_linear(GgmlType::Q4_1, 12, 512, 31);
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 3..2;
        for r in [reversed.clone(), 5..5, 0..13, 12..14] {
            let msg = shape_error(rows(&w, r.clone()));
            assert!(msg.contains("row shard of a [12, 512] Q4_1 weight") && msg.contains(&format!("{r:?}")), "{msg}");
        }
        let msg = shape_error(cols(&w, 16..48));
        assert!(msg.contains("multiples of 32") && msg.contains("16..48"), "{msg}");
        for r in [0..544, 32..32, reversed.clone(), 0..40] {
            shape_error(cols(&w, r));
        }
        let k = random_linear(GgmlType::Q4K, 2, 512, 32);
        let msg = shape_error(cols(&k, 0..128));
        assert!(msg.contains("Q4_K block boundaries (multiples of 256)"), "{msg}");
        assert!(cols(&k, 256..512).is_ok());

        let v: Vec<f32> = random_x(1, 8, 33);
        assert_eq!(slice_vec(&v, 2..5).unwrap(), vec![v[2], v[3], v[4]]);
        for r in [2..10, 4..4, reversed] {
            assert!(matches!(slice_vec(&v, r), Err(WorkerError::TensorShape { .. })));
        }
    }

    /// Independent check of `head_ranges`: query ranges tile `0..n_heads` in rank order,
    /// and each rank's KV range is exactly the KV heads its query heads attend with.
    #[test]
    fn head_ranges_match_grouped_attention() {
        let cases = [
            (9, 3, 1),
            (9, 3, 3),
            (32, 8, 2),
            (32, 8, 4),
            (32, 8, 8),
            (32, 8, 16),
            (32, 8, 32),
            (12, 12, 4),
            (16, 2, 8),
            (28, 4, 2),
        ];
        for (heads, kv, tp) in cases {
            let group = heads / kv;
            let mut next_q = 0;
            let mut kv_seen = vec![0usize; kv];
            for rank in 0..tp {
                let (q, k) = head_ranges(heads, kv, tp, rank);
                assert_eq!((q.start, q.len()), (next_q, heads / tp), "{heads}/{kv} tp={tp} rank {rank}");
                next_q = q.end;
                let used: Vec<usize> = q.clone().map(|h| h / group).collect();
                let (lo, hi) = (used[0], used[used.len() - 1] + 1);
                assert_eq!(k, lo..hi, "{heads}/{kv} tp={tp} rank {rank}");
                for h in k {
                    kv_seen[h] += 1;
                }
            }
            assert_eq!(next_q, heads);
            // Split: every KV head on one rank; replicated: on tp / kv ranks.
            let copies = if tp <= kv { 1 } else { tp / kv };
            assert!(kv_seen.iter().all(|&c| c == copies), "{heads}/{kv} tp={tp}: {kv_seen:?}");
        }
        assert_eq!(head_ranges(9, 3, 3, 1), (3..6, 1..2));
        assert_eq!(head_ranges(32, 8, 16, 5), (10..12, 2..3));
        assert_eq!(head_ranges(32, 8, 0, 0), (0..0, 0..0));
    }
}
