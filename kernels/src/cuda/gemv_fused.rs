//! The decode GEMV with a layer's small steps folded in (`kernels/cuda/gemv.cu`'s fused
//! modes). At batch 1 a Llama layer's RMSNorms, SwiGLU and residual adds cost a launch and a
//! few µs each while moving almost no data; folded into the GEMVs next to them, a layer
//! runs qkv (with RoPE and the K/V write), attention, o, gate_up and down and nothing else:
//! - [`Device::matmul_rms_norm`]: `out = rms_norm(x) · Wᵀ` (the norm before qkv),
//! - [`Device::matmul_rms_norm_swiglu`]: `act = silu(g) * u` of `rms_norm(x) · [Wg; Wu]ᵀ`
//!   (the norm before the FFN, gate_up and SwiGLU),
//! - [`Device::matmul_add_residual`]: `residual += x · Wᵀ` (o and down with their adds),
//! - [`Device::matmul_rms_norm_rope`]: the norm, the qkv projection and `qkv_rope_write`'s
//!   bias, RoPE and q / K / V writes (Llama-style models: no q/k norm, interleaved RoPE).
//!
//! The residual and SwiGLU modes round where the unfused kernels round (the GEMM's bf16
//! output, the residual's bf16 sum). The norm is factored out of the sum: `rms_norm(x) · Wᵀ
//! = s · ((x ⊙ gamma) · Wᵀ)` with the row's `s = rsqrt(mean(x²) + eps)` applied to the f32
//! sum, so no warp waits for the whole row's sum of squares before its first product
//! (H200, batch 1: -2.3 µs per Llama-8B layer; bench/RESULTS.md). So x is rounded to bf16 as
//! `x * gamma` rather than as the normalised `x * s * gamma`: the norm modes agree with
//! `rms_norm` then `matmul` within bf16 rounding, not bit for bit, as the cuBLASLt GEMMs of
//! larger steps already do; among themselves (norm, norm + SwiGLU, norm + RoPE) they agree
//! bit for bit.
//! They take at most [`MAX_M`] rows of x (decode batches); [`Device::fused_gemv_applies`]
//! and [`Device::fused_norm_gemv_applies`] say whether a shape can go this way, callers keep
//! the unfused path for the rest.

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use super::device::{Buf, Device};
use super::gemm::check_gemm_operands;
use super::gemv::{GemvCall, GemvRope, Mode, MAX_M};
use super::qkv_args::{qkv_lens, QkvPrep};
use crate::cpu::attention::PagedKv;
use crate::cpu::rope::RopeStyle;
use crate::error::check;
use crate::launch_checks::{qkv_shape, to_u32, QkvDims};
use crate::KernelError;

impl Device {
    /// Whether [`Device::matmul_add_residual`] takes `m` rows of x against W `[rows, cols]`.
    pub fn fused_gemv_applies(&self, m: usize, rows: usize, cols: usize) -> bool {
        (1..=MAX_M).contains(&m) && cols.is_multiple_of(8) && i32::try_from(rows).is_ok() && i32::try_from(cols).is_ok()
    }

    /// Whether the normalising GEMVs ([`Device::matmul_rms_norm`],
    /// [`Device::matmul_rms_norm_swiglu`]) take the shape: also, the `m` normalised rows of
    /// x must fit in a CTA's shared memory next to the ring.
    pub fn fused_norm_gemv_applies(&self, m: usize, rows: usize, cols: usize) -> bool {
        self.fused_gemv_applies(m, rows, cols) && self.kernels.gemv.normalised_fits(m, cols)
    }

    /// `out[m, rows] = rms_norm(x; gamma, eps) · Wᵀ` for x `[m, cols]`, gamma `[cols]`,
    /// W `[rows, cols]`, the norm factored out of the sum (see the module comment).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_rms_norm(
        &self,
        out: &mut Buf<bf16>,
        x: &Buf<bf16>,
        gamma: &Buf<bf16>,
        eps: f32,
        m: usize,
        w: &Buf<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_matmul_rms_norm";
        check_norm(OP, gamma, eps, cols)?;
        check_operands(OP, x, m, w, rows, cols, out.len(), rows)?;
        let (op, _g) = out.inner.device_ptr_mut(&self.stream);
        let call =
            GemvCall { mode: Mode::Norm, x, m, w, rows, cols, gamma: Some(gamma), eps, rope: GemvRope::default() };
        self.gemv_launch(op, &call)
    }

    /// `act[m, ffn] = silu(g) * u` where `[g | u] = rms_norm(x; gamma, eps) · Wᵀ` and W is
    /// the packed gate|up weight `[2 ffn, cols]` (gate rows first), as
    /// [`Device::matmul_rms_norm`] and `silu_mul_packed` compute it.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_rms_norm_swiglu(
        &self,
        act: &mut Buf<bf16>,
        x: &Buf<bf16>,
        gamma: &Buf<bf16>,
        eps: f32,
        m: usize,
        gate_up: &Buf<bf16>,
        ffn: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_matmul_rms_norm_swiglu";
        check_norm(OP, gamma, eps, cols)?;
        check_operands(OP, x, m, gate_up, 2 * ffn, cols, act.len(), ffn)?;
        let (op, _g) = act.inner.device_ptr_mut(&self.stream);
        let rope = GemvRope::default();
        let call =
            GemvCall { mode: Mode::NormSwiglu, x, m, w: gate_up, rows: 2 * ffn, cols, gamma: Some(gamma), eps, rope };
        self.gemv_launch(op, &call)
    }

    /// `residual[m, rows] += x · Wᵀ` in place, rounded as `matmul` then the add of
    /// `add_rms_norm`: `residual = bf16(residual + bf16(x · Wᵀ))`.
    pub fn matmul_add_residual(
        &self,
        residual: &mut Buf<bf16>,
        x: &Buf<bf16>,
        m: usize,
        w: &Buf<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_matmul_add_residual";
        check_operands(OP, x, m, w, rows, cols, residual.len(), rows)?;
        let (op, _g) = residual.inner.device_ptr_mut(&self.stream);
        let call =
            GemvCall { mode: Mode::Residual, x, m, w, rows, cols, gamma: None, eps: 0.0, rope: GemvRope::default() };
        self.gemv_launch(op, &call)
    }

    /// Whether [`Device::matmul_rms_norm_rope`] takes the Q/K/V preparation `p` (without
    /// its projection) after a norm of rows of `cols` values: a decode-sized step, no q/k
    /// norm, interleaved RoPE, heads of a multiple of 16 dims, and the shape
    /// [`Device::fused_norm_gemv_applies`] takes.
    pub fn fused_rope_gemv_applies(&self, p: &QkvPrep, cols: usize) -> bool {
        let rows = (p.n_heads + 2 * p.n_kv_heads) * p.head_dim;
        p.qk_norm.is_none()
            && matches!(p.style, RopeStyle::Interleaved)
            && p.head_dim.is_multiple_of(16)
            && self.fused_norm_gemv_applies(p.n_tokens, rows, cols)
    }

    /// `rms_norm(x; gamma, eps) · Wᵀ` for the packed q|k|v weight W `[(n_heads + 2 n_kv) *
    /// head_dim, cols]`, then what [`Device::qkv_rope_write`] does with it, in one kernel:
    /// `q_out` and the caches get the values `matmul_rms_norm` + `qkv_rope_write` write (the
    /// same bits). `p` describes the preparation; its `qkv` buffer is not read (only its
    /// length is checked, as `qkv_rope_write` would). Callers check
    /// [`Device::fused_rope_gemv_applies`] first.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_rms_norm_rope(
        &self,
        q_out: &mut Buf<bf16>,
        k_cache: &mut Buf<bf16>,
        v_cache: &mut Buf<bf16>,
        cache: &PagedKv,
        p: &QkvPrep,
        x: &Buf<bf16>,
        gamma: &Buf<bf16>,
        eps: f32,
        w: &Buf<bf16>,
        cols: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_matmul_rms_norm_rope";
        check(self.fused_rope_gemv_applies(p, cols), OP, || {
            format!(
                "{} tokens, head_dim {}, q/k norm {}, {:?} RoPE, {cols} columns: not a fused shape",
                p.n_tokens,
                p.head_dim,
                p.qk_norm.is_some(),
                p.style
            )
        })?;
        let lens = qkv_lens(p, q_out.len(), k_cache.len(), v_cache.len());
        let QkvDims { heads, n_slots } = qkv_shape(OP, &lens, cache)?;
        let (m, hd) = (p.n_tokens, p.head_dim);
        check_norm(OP, gamma, eps, cols)?;
        check_operands(OP, x, m, w, heads * hd, cols, q_out.len(), p.n_heads * hd)?;
        let u = |what: &str, v: usize| to_u32(OP, what, v);
        let s = &self.stream;
        let ptr = |b: &Buf<bf16>| b.inner.device_ptr(s).0;
        let rope = GemvRope {
            q_out: q_out.inner.device_ptr_mut(s).0,
            k_cache: k_cache.inner.device_ptr_mut(s).0,
            v_cache: v_cache.inner.device_ptr_mut(s).0,
            bias: p.bias.map_or(0, ptr),
            positions: p.positions.inner.device_ptr(s).0,
            slots: p.slots.inner.device_ptr(s).0,
            cos_sin: p.rope.table.inner.device_ptr(s).0,
            n_slots: n_slots as u64,
            n_heads: u("n_heads", p.n_heads)?,
            n_kv: u("n_kv_heads", p.n_kv_heads)?,
            head_dim: u("head_dim", hd)?,
            half_rot: u("rope_dim/2", p.rope.rope_dim / 2)?,
            max_pos: u("max_positions", p.rope.max_positions)?,
            pad: 0,
        };
        // `out` is not written in this mode: q_out's pointer stands in.
        let call = GemvCall { mode: Mode::NormRope, x, m, w, rows: heads * hd, cols, gamma: Some(gamma), eps, rope };
        self.gemv_launch(rope.q_out, &call)
    }
}

fn check_norm(op: &'static str, gamma: &Buf<bf16>, eps: f32, cols: usize) -> Result<(), KernelError> {
    check(gamma.len() == cols, op, || format!("gamma has {} values, x rows {cols}", gamma.len()))?;
    check(eps.is_finite() && eps >= 0.0, op, || format!("eps {eps} is not a finite non-negative number"))
}

/// The GEMM operands' lengths (`out_width` values per row of x), and at most [`MAX_M`]
/// rows of x.
#[allow(clippy::too_many_arguments)]
fn check_operands(
    op: &'static str,
    x: &Buf<bf16>,
    m: usize,
    w: &Buf<bf16>,
    rows: usize,
    cols: usize,
    out_len: usize,
    out_width: usize,
) -> Result<(), KernelError> {
    check((1..=MAX_M).contains(&m), op, || format!("m={m} outside 1..={MAX_M}"))?;
    check_gemm_operands(op, x, m, w, rows, cols, out_len, out_width)
}
