//! Numerically stable softmax over one row, in place: `x[i] = e^(x[i]-m) / sum_j e^(x[j]-m)`
//! with `m = max(x)`, so no exponent overflows. Exponentials are f32, the sum f64.

use crate::error::check;
use crate::KernelError;

/// Softmax of `x` in place. `-inf` entries (masked) get probability 0; a row with no
/// finite entry, or containing NaN or `+inf`, is an error.
pub fn softmax_inplace(x: &mut [f32]) -> Result<(), KernelError> {
    const OP: &str = "softmax_inplace";
    check(x.iter().all(|&v| !v.is_nan() && v != f32::INFINITY), OP, || "row has NaN or +inf".to_string())?;
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    check(m > f32::NEG_INFINITY, OP, || format!("row of {} values has no finite entry", x.len()))?;
    let mut sum = 0.0f64;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += f64::from(*v);
    }
    // sum >= 1: the max contributes e^0.
    let inv = (1.0 / sum) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
    Ok(())
}

/// [`softmax_inplace`] on each `[n_cols]` row of `x` (`[n_rows, n_cols]`).
pub fn softmax_rows_inplace(x: &mut [f32], n_cols: usize) -> Result<(), KernelError> {
    check(n_cols > 0 && x.len().is_multiple_of(n_cols), "softmax_rows_inplace", || {
        format!("{} values is not a whole number of rows of {n_cols}", x.len())
    })?;
    x.chunks_mut(n_cols).try_for_each(softmax_inplace)
}
