//! RMSNorm: `y = x / sqrt(mean(x^2) + eps) * w`, row by row.
//!
//! Rows are any `[n_rows, dim]` split with a `[dim]` weight, so the same op serves the
//! block norms (`dim` = hidden size, one row per token) and Qwen3's per-head q/k norms
//! (`dim` = head_dim, one row per (token, head)).
//!
//! Precision follows llama.cpp: squares are formed in f32 and summed in f64, then
//! the scale `1 / sqrt(mean + eps)` and the products are f32. The sum runs in ggml's
//! order, one f64 chain ([`SumOrder::Ggml`], about a microsecond for a 576-value row: an
//! add's latency per value), or over eight f64 lanes ([`SumOrder::Lanes`], the engine's
//! fast path: several times quicker; the f64 results differ by a few units of 2^-53,
//! which changes the f32 scale only for a sum within that of an f32 rounding boundary).

use super::par;

use crate::error::check;
use crate::quant::q8::ActsQ8;
use crate::KernelError;

/// Below this many values a call runs on the calling thread: spreading it costs more
/// than normalising a few rows. In ggml's order a row's sum is an f64 chain, about a
/// microsecond for 576 values, so a batched decode's 16 rows are worth splitting (set
/// for that order; the lanes' sum is several times quicker).
const PAR_MIN_ELEMS: usize = 2048;

/// How a row's sum of squares is added up (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SumOrder {
    /// One f64 chain in index order, as ggml: llama.cpp's bits.
    Ggml,
    /// Eight f64 partial sums (value `i` into lane `i % 8`), then added pairwise.
    Lanes,
}

/// `out[r] = rms_norm(x[r]) * w` for each of `n_rows` rows. `x`, `out`: `[n_rows, dim]`,
/// `w`: `[dim]` (its length gives `dim`).
pub fn rms_norm(out: &mut [f32], x: &[f32], w: &[f32], n_rows: usize, eps: f32) -> Result<(), KernelError> {
    rms_norm_with(SumOrder::Ggml, out, x, w, n_rows, eps)
}

/// [`rms_norm`] with the sum of squares added up in `order`.
pub fn rms_norm_with(
    order: SumOrder,
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    n_rows: usize,
    eps: f32,
) -> Result<(), KernelError> {
    let dim = check_shape("rms_norm", x.len(), w.len(), n_rows, eps)?;
    check(out.len() == x.len(), "rms_norm", || format!("out has {} values, x has {}", out.len(), x.len()))?;
    let row = |(o, xr): (&mut [f32], &[f32])| norm_row(order, o, xr, w, eps);
    if x.len() >= PAR_MIN_ELEMS {
        par::for_each_row_mut(out, dim, |i, o| row((o, &x[i * dim..(i + 1) * dim])));
    } else {
        out.chunks_mut(dim).zip(x.chunks(dim)).for_each(row);
    }
    Ok(())
}

/// [`rms_norm`] in place: `x` (`[n_rows, dim]`) is overwritten by its normalised rows.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], n_rows: usize, eps: f32) -> Result<(), KernelError> {
    rms_norm_inplace_with(SumOrder::Ggml, x, w, n_rows, eps)
}

/// [`rms_norm_inplace`] with the sum of squares added up in `order`.
pub fn rms_norm_inplace_with(
    order: SumOrder,
    x: &mut [f32],
    w: &[f32],
    n_rows: usize,
    eps: f32,
) -> Result<(), KernelError> {
    let dim = check_shape("rms_norm_inplace", x.len(), w.len(), n_rows, eps)?;
    let row = |xr: &mut [f32]| {
        let s = inv_rms(order, xr, eps);
        for (v, &wv) in xr.iter_mut().zip(w) {
            *v = (*v * s) * wv;
        }
    };
    if x.len() >= PAR_MIN_ELEMS {
        par::for_each_row_mut(x, dim, |_, xr| row(xr));
    } else {
        x.chunks_mut(dim).for_each(row);
    }
    Ok(())
}

/// Checks `x` is `[n_rows, dim]` with `dim = w_len > 0` and `eps` usable; returns `dim`.
fn check_shape(op: &'static str, x_len: usize, w_len: usize, n_rows: usize, eps: f32) -> Result<usize, KernelError> {
    check(w_len > 0, op, || "weight is empty".to_string())?;
    check(n_rows.checked_mul(w_len) == Some(x_len), op, || {
        format!("x has {x_len} values, expected {n_rows} rows x {w_len} (weight length)")
    })?;
    check(eps.is_finite() && eps >= 0.0, op, || format!("eps {eps} must be finite and >= 0"))?;
    Ok(w_len)
}

/// [`rms_norm_with`] straight into the 8-bit activations of the packed matmul that reads
/// it (`ActsQ8::quantize_plain` of the normed rows, the same bits), one parallel pass
/// instead of two. `dim` must be a multiple of 32.
pub fn rms_norm_q8(order: SumOrder, x: &[f32], w: &[f32], n_rows: usize, eps: f32) -> Result<ActsQ8, KernelError> {
    let dim = check_shape("rms_norm_q8", x.len(), w.len(), n_rows, eps)?;
    check(dim.is_multiple_of(32), "rms_norm_q8", || format!("rows of {dim} values are not whole 32-value blocks"))?;
    // A piece of a row needs the whole row's scale (a row wider than a piece is normed
    // once per piece, to the same bits).
    Ok(ActsQ8::quantize_rows_plain(n_rows, dim, |r, c0, o| {
        let xr = &x[r * dim..(r + 1) * dim];
        scale_into(o, &xr[c0..], &w[c0..], inv_rms(order, xr, eps));
    }))
}

/// One row: `o = (xr * inv_rms) * w`.
fn norm_row(order: SumOrder, o: &mut [f32], xr: &[f32], w: &[f32], eps: f32) {
    scale_into(o, xr, w, inv_rms(order, xr, eps));
}

/// `o = (x * s) * w`, as far as `o` reaches.
fn scale_into(o: &mut [f32], x: &[f32], w: &[f32], s: f32) {
    for ((o, &xv), &wv) in o.iter_mut().zip(x).zip(w) {
        *o = (xv * s) * wv;
    }
}

/// `1 / sqrt(mean(row^2) + eps)`, the squares (f32) summed in f64 in `order`.
fn inv_rms(order: SumOrder, row: &[f32], eps: f32) -> f32 {
    let sum: f64 = match order {
        SumOrder::Ggml => row.iter().map(|&v| f64::from(v * v)).sum(),
        SumOrder::Lanes => {
            let mut lanes = [0.0f64; 8];
            let chunks = row.chunks_exact(8);
            let tail = chunks.remainder();
            for c in chunks {
                for (l, &v) in lanes.iter_mut().zip(c) {
                    *l += f64::from(v * v);
                }
            }
            for (l, &v) in lanes.iter_mut().zip(tail) {
                *l += f64::from(v * v);
            }
            ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))
        }
    };
    let mean = (sum / row.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}
