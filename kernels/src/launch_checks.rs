//! The argument rules of the GPU launchers, one copy for both GPU backends: CUDA
//! (kernels/src/cuda) and HIP (kernels/src/hip) launch the same kernel sources, so they accept
//! the same shapes. Buffer lengths are checked against the shape an op is given on the host,
//! so a caller bug is an error naming the op instead of an out-of-bounds access on the device.
//! Pure functions of lengths (and the host side of the RoPE table): tested without a GPU.

use crate::cpu::attention::PagedKv;
use crate::cpu::rope::RopeParams;
use crate::error::check;
use crate::KernelError;

/// What the rules read of a launcher's inputs: a device buffer's length in elements (CUDA's
/// `Buf`, HIP's `DevBuf`).
pub(crate) trait Extent {
    fn extent(&self) -> usize;
}

impl<T> Extent for crate::cuda::Buf<T> {
    fn extent(&self) -> usize {
        self.len()
    }
}

/// The rotated dims of a device RoPE table (CUDA's `RopeCache`, HIP's `RopeTable`).
pub(crate) trait RopeDim {
    fn rotated(&self) -> usize;
}

impl RopeDim for crate::cuda::RopeCache {
    fn rotated(&self) -> usize {
        self.rope_dim()
    }
}

/// Largest head `qkv_rope_write` stages: QKV_WARPS (4) heads of f32 in 16 KiB of shared memory.
pub(crate) const QKV_MAX_HEAD_DIM: usize = 1024;

/// `v` as a kernel's u32 argument, or an error naming `what`.
pub(crate) fn to_u32(op: &'static str, what: &str, v: usize) -> Result<u32, KernelError> {
    u32::try_from(v).map_err(|_| KernelError::Shape { op, detail: format!("{what} {v} exceeds u32") })
}

/// `v` as a kernel's int argument, or an error naming `what`.
pub(crate) fn to_i32(op: &'static str, what: &str, v: usize) -> Result<i32, KernelError> {
    i32::try_from(v).map_err(|_| KernelError::Shape { op, detail: format!("{what} {v} exceeds i32") })
}

/// Checks `x` is `[n_rows, dim]` with `dim = w_len > 0` and `eps` usable; returns dim.
pub(crate) fn norm_shape(
    op: &'static str,
    x_len: usize,
    w_len: usize,
    n_rows: usize,
    eps: f32,
) -> Result<usize, KernelError> {
    check(w_len > 0, op, || "weight is empty".to_string())?;
    check(n_rows.checked_mul(w_len) == Some(x_len), op, || {
        format!("x has {x_len} values, expected {n_rows} rows x {w_len} (weight length)")
    })?;
    check(eps.is_finite() && eps >= 0.0, op, || format!("eps {eps} must be finite and >= 0"))?;
    Ok(w_len)
}

/// The (rows, dim) kernel arguments of a row norm over `x` `[n_rows, dim]` into `out`
/// (and, fused with the residual add, `residual`), all the same length; `None` when there
/// are no rows.
pub(crate) fn norm_args(
    op: &'static str,
    (out_len, residual_len, x_len, w_len): (usize, Option<usize>, usize, usize),
    n_rows: usize,
    eps: f32,
) -> Result<Option<(i32, i32)>, KernelError> {
    let dim = norm_shape(op, x_len, w_len, n_rows, eps)?;
    check(out_len == x_len && residual_len.is_none_or(|r| r == x_len), op, || match residual_len {
        Some(r) => format!("out has {out_len} values, residual {r}, x {x_len}"),
        None => format!("out has {out_len} values, x has {x_len}"),
    })?;
    if n_rows == 0 {
        return Ok(None);
    }
    Ok(Some((to_i32(op, "n_rows", n_rows)?, to_i32(op, "dim", dim)?)))
}

/// Lengths of the embedding gather's buffers; returns the vocabulary size (`table` rows).
pub(crate) fn embedding_shape(
    op: &'static str,
    out_len: usize,
    table_len: usize,
    n_ids: usize,
    dim: usize,
) -> Result<usize, KernelError> {
    check(dim > 0 && table_len.is_multiple_of(dim), op, || {
        format!("table has {table_len} values, not a whole number of rows of {dim}")
    })?;
    check(n_ids.checked_mul(dim) == Some(out_len), op, || {
        format!("out has {out_len} values, expected {n_ids} ids x {dim}")
    })?;
    Ok(table_len / dim)
}

/// SwiGLU on a packed gate|up GEMM output (`[n_rows, 2 ffn]` in, `[n_rows, ffn]` out):
/// returns ffn.
pub(crate) fn silu_packed_shape(
    op: &'static str,
    out_len: usize,
    gate_up_len: usize,
    n_rows: usize,
) -> Result<usize, KernelError> {
    check(n_rows > 0 && out_len.is_multiple_of(n_rows), op, || format!("out has {out_len} values, not {n_rows} rows"))?;
    let ffn = out_len / n_rows;
    check(gate_up_len == 2 * out_len, op, || {
        format!("gate_up has {gate_up_len} values, expected {n_rows} x 2 x {ffn}")
    })?;
    Ok(ffn)
}

/// The buffer lengths and shape of one fused Q/K/V preparation (`qkv_rope_write`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct QkvLens {
    pub n_tokens: usize,
    pub n_heads: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    pub qkv: usize,
    pub q_out: usize,
    pub positions: usize,
    pub slots: usize,
    pub bias: Option<usize>,
    pub qk_norm: Option<(usize, usize)>,
    pub k_cache: usize,
    pub v_cache: usize,
    pub rope_dim: usize,
    pub eps: f32,
}

/// What a valid [`QkvLens`] implies for the launch: heads per token (q, k and v) and cache
/// slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QkvDims {
    pub heads: usize,
    pub n_slots: usize,
}

/// Checks a Q/K/V preparation against `cache`'s geometry.
pub(crate) fn qkv_shape(op: &'static str, l: &QkvLens, cache: &PagedKv) -> Result<QkvDims, KernelError> {
    let (n, nh, nkv, hd) = (l.n_tokens, l.n_heads, l.n_kv, l.head_dim);
    check(nh > 0 && nkv > 0, op, || format!("n_heads {nh} and n_kv_heads {nkv} must be > 0"))?;
    check(hd > 0 && hd % 2 == 0 && hd <= QKV_MAX_HEAD_DIM, op, || {
        format!("head_dim {hd} must be even and in 2..={QKV_MAX_HEAD_DIM}")
    })?;
    check(l.rope_dim <= hd, op, || format!("rope dim {} exceeds head_dim {hd}", l.rope_dim))?;
    check(l.eps.is_finite() && l.eps >= 0.0, op, || format!("eps {} must be finite and >= 0", l.eps))?;
    check(cache.block_size > 0 && cache.n_kv_heads == nkv && cache.head_dim == hd, op, || {
        format!("cache {cache:?} does not match n_kv_heads {nkv}, head_dim {hd} (or block_size is 0)")
    })?;
    // Values per token of the GEMM output, of q, and of a cache slot.
    let heads = nkv.checked_mul(2).and_then(|k| k.checked_add(nh));
    let row = heads.and_then(|h| h.checked_mul(hd));
    let (heads, row) = match (heads, row) {
        (Some(h), Some(r)) => (h, r),
        _ => return Err(KernelError::Shape { op, detail: format!("{nh} + 2 x {nkv} heads overflow") }),
    };
    let (q_row, kv_row) = (nh * hd, nkv * hd);
    check(n.checked_mul(row) == Some(l.qkv), op, || {
        format!("qkv has {} values, expected {n} tokens x ({nh} + 2 x {nkv}) heads x {hd}", l.qkv)
    })?;
    check(n.checked_mul(q_row) == Some(l.q_out), op, || {
        format!("q_out has {} values, expected {n} tokens x {nh} heads x {hd}", l.q_out)
    })?;
    check(l.positions == n && l.slots == n, op, || {
        format!("{} positions and {} slots for {n} tokens", l.positions, l.slots)
    })?;
    if let Some(b) = l.bias {
        check(b == row, op, || format!("bias has {b} values, expected {row}"))?;
    }
    if let Some((qn, kn)) = l.qk_norm {
        check(qn == hd && kn == hd, op, || format!("q/k norm weights have {qn}/{kn} values, expected head_dim {hd}"))?;
    }
    let block = kv_row.checked_mul(cache.block_size).unwrap_or(0);
    check(block > 0 && l.k_cache == l.v_cache && l.k_cache.is_multiple_of(block), op, || {
        format!(
            "k cache {} / v cache {} values: not equal whole numbers of {block}-value blocks of {cache:?}",
            l.k_cache, l.v_cache
        )
    })?;
    Ok(QkvDims { heads, n_slots: l.k_cache / kv_row })
}

/// The (cos, sin) table of `params` for positions `0..max_positions`, `[max_positions,
/// rope_dim / 2]` pairs flattened, from the f64 angle exactly as the CPU reference computes
/// it (the kernels read it as float2).
pub(crate) fn rope_table(params: &RopeParams, max_positions: usize) -> Vec<f32> {
    let inv = params.inv_freq();
    let mut host = Vec::with_capacity(max_positions * inv.len() * 2);
    for p in 0..max_positions {
        for &f in inv {
            let (s, c) = (p as f64 * f).sin_cos();
            host.push(c as f32);
            host.push(s as f32);
        }
    }
    host
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lens(n: usize, nh: usize, nkv: usize, hd: usize, blocks: usize, bs: usize) -> QkvLens {
        QkvLens {
            n_tokens: n,
            n_heads: nh,
            n_kv: nkv,
            head_dim: hd,
            qkv: n * (nh + 2 * nkv) * hd,
            q_out: n * nh * hd,
            positions: n,
            slots: n,
            bias: Some((nh + 2 * nkv) * hd),
            qk_norm: Some((hd, hd)),
            k_cache: blocks * bs * nkv * hd,
            v_cache: blocks * bs * nkv * hd,
            rope_dim: hd,
            eps: 1e-6,
        }
    }

    #[test]
    fn qkv_shape_accepts_consistent_lengths_and_names_each_wrong_one() {
        let cache = PagedKv { block_size: 16, n_kv_heads: 2, head_dim: 64 };
        let ok = lens(7, 8, 2, 64, 5, 16);
        assert_eq!(qkv_shape("t", &ok, &cache).unwrap(), QkvDims { heads: 12, n_slots: 80 });
        let bad: [(&str, QkvLens); 8] = [
            ("qkv has", QkvLens { qkv: ok.qkv - 1, ..ok }),
            ("q_out has", QkvLens { q_out: ok.q_out + 64, ..ok }),
            ("positions", QkvLens { positions: 6, ..ok }),
            ("bias has", QkvLens { bias: Some(64), ..ok }),
            ("norm weights", QkvLens { qk_norm: Some((64, 32)), ..ok }),
            ("k cache", QkvLens { v_cache: ok.k_cache - 64 * 2 * 16, ..ok }),
            ("rope dim", QkvLens { rope_dim: 66, ..ok }),
            ("eps", QkvLens { eps: f32::NAN, ..ok }),
        ];
        for (what, l) in bad {
            let msg = qkv_shape("t", &l, &cache).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(msg.contains(what), "{what}: {msg}");
        }
        let odd = QkvLens { head_dim: 63, ..lens(1, 1, 1, 63, 1, 16) };
        assert!(qkv_shape("t", &odd, &PagedKv { block_size: 16, n_kv_heads: 1, head_dim: 63 }).is_err());
        let other_cache = PagedKv { block_size: 16, n_kv_heads: 4, head_dim: 64 };
        assert!(qkv_shape("t", &ok, &other_cache).is_err());
    }

    #[test]
    fn row_op_shapes() {
        assert_eq!(norm_shape("t", 12, 4, 3, 1e-5).unwrap(), 4);
        assert_eq!(norm_args("t", (12, Some(12), 12, 4), 3, 1e-5).unwrap(), Some((3, 4)));
        assert_eq!(norm_args("t", (0, None, 0, 4), 0, 1e-5).unwrap(), None);
        assert!(norm_args("t", (12, Some(8), 12, 4), 3, 1e-5).is_err());
        assert!(norm_args("t", (8, None, 12, 4), 3, 1e-5).is_err());
        assert!(norm_shape("t", 12, 4, 4, 1e-5).is_err());
        assert!(norm_shape("t", 0, 0, 0, 1e-5).is_err());
        assert!(norm_shape("t", 12, 4, 3, -1.0).is_err());
        assert_eq!(embedding_shape("t", 30, 100, 3, 10).unwrap(), 10);
        assert!(embedding_shape("t", 30, 105, 3, 10).is_err());
        assert!(embedding_shape("t", 31, 100, 3, 10).is_err());
        assert_eq!(silu_packed_shape("t", 15, 30, 3).unwrap(), 5);
        assert!(silu_packed_shape("t", 15, 29, 3).is_err());
        assert!(silu_packed_shape("t", 15, 30, 4).is_err());
    }

    #[test]
    fn rope_table_holds_cos_sin_of_each_angle() {
        let params = RopeParams::new(64, 10000.0, None, None).unwrap();
        let t = rope_table(&params, 9);
        assert_eq!(t.len(), 9 * 32 * 2);
        for p in 0..9 {
            for i in 0..32 {
                // theta_i = 10000^(-2i / 64), computed independently here.
                let angle = p as f64 * 10000f64.powf(-2.0 * i as f64 / 64.0);
                let at = (p * 32 + i) * 2;
                assert!((t[at] as f64 - angle.cos()).abs() < 1e-6 && (t[at + 1] as f64 - angle.sin()).abs() < 1e-6);
            }
        }
    }
}
