//! Rotary position embedding (RoPE), applied in place to q or k rows, or to both in one
//! pass ([`rope_qk_with_table`], what the model calls).
//!
//! Dimension pair `i` (of `rope_dim / 2`) of a token at position `p` is rotated by the
//! angle `p * inv_freq[i]`, with `inv_freq[i] = theta^(-2i / rope_dim)` (llama.cpp's
//! `theta_i = p * base^(-2i/d)`), optionally reshaped by Llama-3 scaling or divided by
//! per-pair frequency factors (llama.cpp's `rope_freqs.weight`). Dimensions at and past
//! `rope_dim` pass through unchanged (partial rotary).
//!
//! Precision: by default ([`RopeAngles::Exact`]) `inv_freq` and the angle are computed
//! in f64 and `sin`/`cos` rounded to f32: the exact angle. [`RopeAngles::Ggml`] instead
//! takes llama.cpp's CPU steps, all f32 (`theta_scale = theta^(-2/rope_dim)`, the angle
//! of pair `i` is the position multiplied by `theta_scale` `i` times, then divided by
//! frequency factor `i`), which differ from the exact angle only by their rounding but
//! let the CPU engine reproduce llama.cpp's rotated q/k bit for bit. The rotation is
//! `x0·cos - x1·sin`, `x0·sin + x1·cos` with the `x0` product fused (one FMA each), as
//! ggml's compiled loop does.

use super::par::{self, SharedMut};

use crate::error::check;
use crate::KernelError;

/// Below this many values a call runs on the calling thread.
const PAR_MIN_ELEMS: usize = 2048;

/// Which dimensions form a rotated pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(2i, 2i + 1)`: llama.cpp's LLAMA ("normal") rope, for GGUF llama models
    /// whose q/k rows the converter permuted.
    Interleaved,
    /// Pairs `(i, i + rope_dim / 2)`: HF's `rotate_half`, for qwen2/qwen3 and for llama
    /// checkpoints in HF layout.
    Neox,
}

/// Llama-3.x frequency scaling (HF `rope_type: "llama3"`). With wavelength
/// `w = 2*pi / inv_freq`, `lo = original_max_position / low_freq_factor` and
/// `hi = original_max_position / high_freq_factor`:
/// - `w < hi` (high frequency): unchanged;
/// - `w > lo` (low frequency): divided by `factor`;
/// - otherwise: `(1 - s) * inv_freq / factor + s * inv_freq` with
///   `s = (original_max_position / w - low_freq_factor) / (high_freq_factor - low_freq_factor)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    /// The context length the model was trained with before scaling.
    pub original_max_position: usize,
}

/// How [`rope`] computes each position's angles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeAngles {
    /// `pos * inv_freq[i]` in f64; `sin`/`cos` rounded to f32.
    Exact,
    /// llama.cpp's CPU arithmetic (see the module docs). Not available with Llama-3
    /// scaling from a config (llama.cpp only knows it as frequency factors).
    Ggml,
}

/// The per-pair inverse frequencies of one model's RoPE.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeParams {
    rope_dim: usize,
    /// `[rope_dim / 2]`, radians per position.
    inv_freq: Vec<f64>,
    angles: RopeAngles,
    /// For [`RopeAngles::Ggml`]: `theta^(-2 / rope_dim)` in f32, and the frequency
    /// factors (`[rope_dim / 2]`) if any. `None` with Llama-3 scaling.
    ggml: Option<(f32, Option<Vec<f32>>)>,
}

impl RopeParams {
    /// Builds the frequencies for `rope_dim` rotated dimensions (even, usually head_dim)
    /// and base `theta`. `llama3` (from a config.json) and `freq_factors` (`[rope_dim/2]`,
    /// from a GGUF `rope_freqs.weight`, which already encodes the same scaling) are two
    /// spellings of one adjustment: passing both is rejected rather than scaling twice.
    pub fn new(
        rope_dim: usize,
        theta: f32,
        llama3: Option<Llama3Scaling>,
        freq_factors: Option<Vec<f32>>,
    ) -> Result<Self, KernelError> {
        const OP: &str = "rope_params";
        check(rope_dim > 0 && rope_dim.is_multiple_of(2), OP, || format!("rope dim {rope_dim} must be even and > 0"))?;
        check(theta.is_finite() && theta > 0.0, OP, || format!("theta {theta} must be finite and > 0"))?;
        check(!(llama3.is_some() && freq_factors.is_some()), OP, || {
            "both Llama-3 scaling and rope_freqs factors given; they encode the same scaling".to_string()
        })?;
        let half = rope_dim / 2;
        let base = f64::from(theta);
        let mut inv_freq: Vec<f64> = (0..half).map(|i| base.powf(-2.0 * i as f64 / rope_dim as f64)).collect();
        if let Some(s) = llama3 {
            check_llama3(&s)?;
            for f in &mut inv_freq {
                *f = llama3_inv_freq(*f, &s);
            }
        }
        if let Some(ff) = &freq_factors {
            check(ff.len() == half, OP, || format!("{} frequency factors, expected rope_dim/2 = {half}", ff.len()))?;
            check(ff.iter().all(|&v| v.is_finite() && v > 0.0), OP, || {
                "frequency factors must be finite and > 0".to_string()
            })?;
            for (f, &d) in inv_freq.iter_mut().zip(ff) {
                *f /= f64::from(d);
            }
        }
        let ggml = llama3.is_none().then(|| (theta.powf(-2.0 / rope_dim as f32), freq_factors));
        Ok(Self { rope_dim, inv_freq, angles: RopeAngles::Exact, ggml })
    }

    /// These parameters with angles computed as `angles` says. [`RopeAngles::Ggml`] is
    /// refused for parameters built with Llama-3 scaling.
    pub fn with_angles(mut self, angles: RopeAngles) -> Result<Self, KernelError> {
        check(angles == RopeAngles::Exact || self.ggml.is_some(), "rope_params", || {
            "ggml-style angles need frequency factors, not Llama-3 scaling from a config".to_string()
        })?;
        self.angles = angles;
        Ok(self)
    }

    /// How the angles are computed.
    pub fn angles(&self) -> RopeAngles {
        self.angles
    }

    /// Writes the `(cos, sin)` of each pair's angle at position `pos` into `cs`
    /// (`[rope_dim / 2]`).
    fn cos_sin(&self, pos: u32, cs: &mut [(f32, f32)]) {
        match (&self.ggml, self.angles) {
            (Some((theta_scale, ff)), RopeAngles::Ggml) => {
                let mut theta = pos as f32;
                for (i, out) in cs.iter_mut().enumerate() {
                    let t = match ff {
                        Some(ff) => theta / ff[i],
                        None => theta,
                    };
                    *out = (t.cos(), t.sin());
                    theta *= theta_scale;
                }
            }
            _ => {
                for (out, &f) in cs.iter_mut().zip(self.inv_freq.iter()) {
                    let (s, c) = (f64::from(pos) * f).sin_cos();
                    *out = (c as f32, s as f32);
                }
            }
        }
    }

    /// The angles of `positions` (a step's tokens): see [`RopeTable`].
    pub fn table(&self, positions: &[u32]) -> RopeTable {
        let half = self.rope_dim / 2;
        let mut cs = vec![(0.0f32, 0.0f32); positions.len() * half];
        if half > 0 {
            if cs.len() >= PAR_MIN_ELEMS {
                par::for_each_row_mut(&mut cs, half, |t, row| self.cos_sin(positions[t], row));
            } else {
                cs.chunks_mut(half).zip(positions).for_each(|(row, &p)| self.cos_sin(p, row));
            }
        }
        RopeTable { half, tokens: positions.len(), cs }
    }

    /// Number of rotated dimensions per head.
    pub fn rope_dim(&self) -> usize {
        self.rope_dim
    }

    /// Radians per position of each pair, `[rope_dim / 2]`.
    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }
}

fn check_llama3(s: &Llama3Scaling) -> Result<(), KernelError> {
    const OP: &str = "rope_params";
    let finite_pos = |v: f32| v.is_finite() && v > 0.0;
    check(finite_pos(s.factor), OP, || format!("llama3 factor {} must be finite and > 0", s.factor))?;
    check(finite_pos(s.low_freq_factor) && finite_pos(s.high_freq_factor), OP, || {
        format!("llama3 low/high freq factors {}/{} must be finite and > 0", s.low_freq_factor, s.high_freq_factor)
    })?;
    check(s.high_freq_factor > s.low_freq_factor, OP, || {
        format!("llama3 high_freq_factor {} must exceed low_freq_factor {}", s.high_freq_factor, s.low_freq_factor)
    })?;
    check(s.original_max_position > 0, OP, || "llama3 original_max_position must be > 0".to_string())
}

/// Applies [`Llama3Scaling`] to one inverse frequency.
fn llama3_inv_freq(inv_freq: f64, s: &Llama3Scaling) -> f64 {
    let old_ctx = s.original_max_position as f64;
    let (factor, lo_f, hi_f) = (f64::from(s.factor), f64::from(s.low_freq_factor), f64::from(s.high_freq_factor));
    let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
    if wavelen < old_ctx / hi_f {
        inv_freq
    } else if wavelen > old_ctx / lo_f {
        inv_freq / factor
    } else {
        let smooth = (old_ctx / wavelen - lo_f) / (hi_f - lo_f);
        (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
    }
}

/// The `(cos, sin)` of every rotated pair at each token of a step, `[tokens, rope_dim / 2]`:
/// the angles depend only on the position, so a model computes them once per step and
/// rotates every layer's q and k with them ([`rope_qk_with_table`]) instead of taking a
/// `sin` and a `cos` per pair, token, layer and tensor.
pub struct RopeTable {
    half: usize,
    tokens: usize,
    cs: Vec<(f32, f32)>,
}

impl RopeTable {
    /// Token `t`'s `(cos, sin)` pairs.
    fn token(&self, t: usize) -> &[(f32, f32)] {
        &self.cs[t * self.half..(t + 1) * self.half]
    }
}

/// Rotates `x` (`[n_tokens, n_heads * head_dim]`) in place; token `t` is at absolute
/// position `positions[t]`. The first `params.rope_dim()` dims of each head are rotated.
pub fn rope(
    x: &mut [f32],
    n_tokens: usize,
    n_heads: usize,
    head_dim: usize,
    positions: &[u32],
    params: &RopeParams,
    style: RopeStyle,
) -> Result<(), KernelError> {
    check(positions.len() == n_tokens, "rope", || format!("{} positions for {n_tokens} tokens", positions.len()))?;
    rope_with_table(x, n_tokens, n_heads, head_dim, &params.table(positions), style)
}

/// [`rope`] with the angles from `table` (made by [`RopeParams::table`] for these
/// tokens' positions): the same values.
pub fn rope_with_table(
    x: &mut [f32],
    n_tokens: usize,
    n_heads: usize,
    head_dim: usize,
    table: &RopeTable,
    style: RopeStyle,
) -> Result<(), KernelError> {
    let row = check_rows("rope", x.len(), n_tokens, n_heads, head_dim, table)?;
    let token = |t: usize, xr: &mut [f32]| rotate_token(xr, table.token(t), head_dim, style);
    if x.len() >= PAR_MIN_ELEMS {
        par::for_each_row_mut(x, row, token);
    } else {
        x.chunks_mut(row).enumerate().for_each(|(t, xr)| token(t, xr));
    }
    Ok(())
}

/// [`rope_with_table`] on a step's q (`[n_tokens, n_heads * head_dim]`) and k
/// (`[n_tokens, n_kv_heads * head_dim]`) in one parallel pass, a token's q and k rows per
/// task: one op fewer per layer than a call each, the same values.
#[allow(clippy::too_many_arguments)]
pub fn rope_qk_with_table(
    q: &mut [f32],
    k: &mut [f32],
    n_tokens: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    table: &RopeTable,
    style: RopeStyle,
) -> Result<(), KernelError> {
    let q_row = check_rows("rope q", q.len(), n_tokens, n_heads, head_dim, table)?;
    let k_row = check_rows("rope k", k.len(), n_tokens, n_kv_heads, head_dim, table)?;
    // Saturating: with no tokens the rows were checked against empty slices only.
    let per = par::rows_per_task(q_row.saturating_add(k_row));
    let parallel = q.len() + k.len() >= PAR_MIN_ELEMS;
    let (qs, ks) = (SharedMut::new(q), SharedMut::new(k));
    let task = |i: usize| {
        for t in i * per..((i + 1) * per).min(n_tokens) {
            // SAFETY: token `t`'s rows of q and k (both checked to hold `n_tokens` rows)
            // belong to this task alone.
            let (qr, kr) = unsafe { (qs.slice(t * q_row, (t + 1) * q_row), ks.slice(t * k_row, (t + 1) * k_row)) };
            rotate_token(qr, table.token(t), head_dim, style);
            rotate_token(kr, table.token(t), head_dim, style);
        }
    };
    let tasks = n_tokens.div_ceil(per);
    if parallel {
        par::for_each_task(tasks, task);
    } else {
        (0..tasks).for_each(task);
    }
    Ok(())
}

/// Checks `len` values as `n_tokens` rows of `n_heads` heads of `head_dim` against
/// `table`; returns the row length.
fn check_rows(
    op: &'static str,
    len: usize,
    n_tokens: usize,
    n_heads: usize,
    head_dim: usize,
    table: &RopeTable,
) -> Result<usize, KernelError> {
    let half = table.half;
    check(n_heads > 0 && head_dim > 0, op, || format!("n_heads {n_heads} and head_dim {head_dim} must be > 0"))?;
    check(2 * half <= head_dim, op, || format!("rope dim {} exceeds head_dim {head_dim}", 2 * half))?;
    let row = n_heads.checked_mul(head_dim);
    check(row.and_then(|r| r.checked_mul(n_tokens)) == Some(len), op, || {
        format!("x has {len} values, expected {n_tokens} tokens x {n_heads} heads x {head_dim}")
    })?;
    check(table.tokens == n_tokens, op, || format!("an angle table of {} tokens for {n_tokens}", table.tokens))?;
    Ok(row.unwrap_or(0))
}

/// Rotates every head of one token's row `xr` by the token's angles `cs`.
fn rotate_token(xr: &mut [f32], cs: &[(f32, f32)], head_dim: usize, style: RopeStyle) {
    let half = cs.len();
    for head in xr.chunks_exact_mut(head_dim) {
        match style {
            RopeStyle::Interleaved => {
                for (pair, &(c, s)) in head[..2 * half].chunks_exact_mut(2).zip(cs) {
                    (pair[0], pair[1]) = rotate(pair[0], pair[1], c, s);
                }
            }
            RopeStyle::Neox => {
                let (lo, hi) = head[..2 * half].split_at_mut(half);
                for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(cs) {
                    (*a, *b) = rotate(*a, *b, c, s);
                }
            }
        }
    }
}

/// `(x0·c - x1·s, x0·s + x1·c)`, each with its `x0` product fused into the subtraction
/// or addition (the order of ggml's compiled rotation).
#[inline]
fn rotate(x0: f32, x1: f32, c: f32, s: f32) -> (f32, f32) {
    (x0.mul_add(c, -(x1 * s)), x0.mul_add(s, x1 * c))
}
