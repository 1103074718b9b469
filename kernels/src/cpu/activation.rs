//! Pointwise ops of the llama block: SwiGLU's `silu(gate) * up`, the residual add, the
//! q/k/v bias add (Qwen2) and scaling. All f32; long buffers are split across threads in
//! fixed-size chunks so each thread streams contiguous memory.
//!
//! SwiGLU comes twice: [`silu_mul`] / [`silu_mul_inplace`] with the C library's `e^x`
//! (the reference), and [`silu_mul_ggml_inplace`] with ggml's approximation
//! ([`super::exp_ggml`]), which the CPU engine uses to reproduce llama.cpp.

use super::par;

use super::exp_ggml::exp_ggml;
use crate::error::check;
use crate::quant::q8::ActsQ8;
use crate::KernelError;

#[cfg(target_arch = "x86_64")]
#[path = "swiglu_ggml_avx2.rs"]
mod swiglu_avx2;

/// Values per parallel task; calls shorter than this stay on the calling thread.
const CHUNK: usize = 1 << 14;

/// The same for SwiGLU, whose `e^x` per value costs more than an add: a batched decode's
/// 16 x 1536 values are worth 12 tasks on many cores (a multiple of 8, so the AVX2 body's
/// lanes fall the same way in any split).
const EXP_CHUNK: usize = 2048;

/// `silu(x) = x * sigmoid(x) = x / (1 + e^-x)`; large negative `x` gives -0, not NaN.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// SwiGLU: `out[i] = silu(gate[i]) * up[i]`; all three the same length
/// (`[n_tokens, intermediate]`).
pub fn silu_mul(out: &mut [f32], gate: &[f32], up: &[f32]) -> Result<(), KernelError> {
    check(gate.len() == up.len() && out.len() == gate.len(), "silu_mul", || {
        format!("lengths differ: out {}, gate {}, up {}", out.len(), gate.len(), up.len())
    })?;
    let run = |((o, g), u): ((&mut [f32], &[f32]), &[f32])| {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = silu(g) * u;
        }
    };
    if out.len() > EXP_CHUNK {
        par::for_each_chunk_mut(out, EXP_CHUNK, |i, o| run(((o, chunk(gate, i, EXP_CHUNK)), chunk(up, i, EXP_CHUNK))));
    } else {
        run(((out, gate), up));
    }
    Ok(())
}

/// SwiGLU into the gate buffer: `gate[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul_inplace(gate: &mut [f32], up: &[f32]) -> Result<(), KernelError> {
    check(gate.len() == up.len(), "silu_mul_inplace", || {
        format!("lengths differ: gate {}, up {}", gate.len(), up.len())
    })?;
    let run = |(g, u): (&mut [f32], &[f32])| {
        for (g, &u) in g.iter_mut().zip(u) {
            *g = silu(*g) * u;
        }
    };
    if gate.len() > EXP_CHUNK {
        par::for_each_chunk_mut(gate, EXP_CHUNK, |i, g| run((g, chunk(up, i, EXP_CHUNK))));
    } else {
        run((gate, up));
    }
    Ok(())
}

/// `silu(x)` as ggml's vectorised SwiGLU computes it: `x / (1 + exp_ggml(0 - x))`.
#[inline]
pub fn silu_ggml(x: f32) -> f32 {
    x / (1.0 + exp_ggml(0.0 - x))
}

/// SwiGLU into the gate buffer as llama.cpp's CPU backend (AVX-512 build) computes it:
/// `gate[i] = silu_ggml(gate[i]) * up[i]`. (ggml takes the C library's `e^x` for the last
/// `n % 16` values of a row; FFN widths are multiples of 16, and applying one formula
/// everywhere keeps a tensor-parallel rank's slice equal to the same columns of the
/// whole row.) Eight values at a time with AVX2 + FMA (`swiglu_ggml_avx2.rs`), same bits.
pub fn silu_mul_ggml_inplace(gate: &mut [f32], up: &[f32]) -> Result<(), KernelError> {
    check(gate.len() == up.len(), "silu_mul_ggml_inplace", || {
        format!("lengths differ: gate {}, up {}", gate.len(), up.len())
    })?;
    let run = |(g, u): (&mut [f32], &[f32])| silu_mul_ggml_slice(g, u);
    if gate.len() > EXP_CHUNK {
        par::for_each_chunk_mut(gate, EXP_CHUNK, |i, g| run((g, chunk(up, i, EXP_CHUNK))));
    } else {
        run((gate, up));
    }
    Ok(())
}

/// [`silu_mul_ggml_inplace`] straight into the 8-bit activations of the packed matmul
/// that reads it (`ActsQ8::quantize_plain` of the product, the same bits), one parallel
/// pass instead of two; `gate`, `up`: rows of `cols` values, `cols` a positive multiple
/// of 32.
pub fn silu_mul_ggml_q8(gate: &[f32], up: &[f32], cols: usize) -> Result<ActsQ8, KernelError> {
    const OP: &str = "silu_mul_ggml_q8";
    check(gate.len() == up.len(), OP, || format!("lengths differ: gate {}, up {}", gate.len(), up.len()))?;
    check(cols > 0 && cols.is_multiple_of(32) && gate.len().is_multiple_of(cols), OP, || {
        format!("{} values are not rows of {cols}, a positive multiple of 32", gate.len())
    })?;
    Ok(ActsQ8::quantize_rows_plain(gate.len() / cols, cols, |r, c0, o| {
        let at = r * cols + c0;
        o.copy_from_slice(&gate[at..at + o.len()]);
        // Pieces are whole 8-lane groups from a multiple of 8, so each value takes the
        // lanes it takes in a split of the in-place op.
        silu_mul_ggml_slice(o, &up[at..at + o.len()]);
    }))
}

/// `g = silu_ggml(g) * u` over one slice, with the AVX2 body where the CPU has it (the
/// detection is a cached load).
fn silu_mul_ggml_slice(g: &mut [f32], u: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: AVX2 and FMA were detected on this CPU.
        return unsafe { swiglu_avx2::silu_mul_inplace(g, u) };
    }
    for (g, &u) in g.iter_mut().zip(u) {
        *g = silu_ggml(*g) * u;
    }
}

/// Residual add: `a[i] += b[i]`.
pub fn add_inplace(a: &mut [f32], b: &[f32]) -> Result<(), KernelError> {
    check(a.len() == b.len(), "add_inplace", || format!("lengths differ: a {}, b {}", a.len(), b.len()))?;
    let run = |(a, b): (&mut [f32], &[f32])| {
        for (a, &b) in a.iter_mut().zip(b) {
            *a += b;
        }
    };
    if a.len() > CHUNK {
        par::for_each_chunk_mut(a, CHUNK, |i, x| run((x, chunk(b, i, CHUNK))));
    } else {
        run((a, b));
    }
    Ok(())
}

/// Adds `bias` (`[dim]`) to every row of `x` (`[n_rows, dim]`), e.g. Qwen2's q/k/v bias.
pub fn add_row_bias(x: &mut [f32], bias: &[f32]) -> Result<(), KernelError> {
    check(!bias.is_empty() && x.len().is_multiple_of(bias.len()), "add_row_bias", || {
        format!("x has {} values, not a whole number of rows of bias length {}", x.len(), bias.len())
    })?;
    let run = |row: &mut [f32]| {
        for (v, &b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    };
    if x.len() > CHUNK {
        par::for_each_row_mut(x, bias.len(), |_, row| run(row));
    } else {
        x.chunks_mut(bias.len()).for_each(run);
    }
    Ok(())
}

/// `x[i] *= s`.
pub fn scale_inplace(x: &mut [f32], s: f32) -> Result<(), KernelError> {
    check(s.is_finite(), "scale_inplace", || format!("scale {s} is not finite"))?;
    let run = |c: &mut [f32]| c.iter_mut().for_each(|v| *v *= s);
    if x.len() > CHUNK {
        par::for_each_chunk_mut(x, CHUNK, |_, c| run(c));
    } else {
        run(x);
    }
    Ok(())
}

/// Chunk `i` of `size` values of `x` (the last may be shorter): the partner of chunk `i`
/// of an output split by [`par::for_each_chunk_mut`] into chunks of `size`.
fn chunk(x: &[f32], i: usize, size: usize) -> &[f32] {
    &x[i * size..((i + 1) * size).min(x.len())]
}
