//! A model's weights on the GPU, bf16: read from a model file (GGUF types dequantised on
//! the host, safetensors bf16 copied as is) or generated on the device for `--synthetic`.
//!
//! A tensor- or pipeline-parallel rank keeps only its share ([`TpPart`]): its stage's
//! layers, its slices of them and of the LM head, cut on the host before the upload, or
//! (random weights) generated whole on the device and sliced there, so a split synthetic
//! model is exactly the one-GPU model split.
//!
//! Projections computed together are stored stacked, as one GEMM operand: q|k|v rows
//! (`[(n_heads + 2 n_kv) * head_dim, hidden]`, this rank's heads) and gate|up rows
//! (`[2 * ffn, hidden]`, this rank's FFN slice, gate first, the layout `silu_mul_packed`
//! reads).

use std::ops::Range;

use rayon::prelude::*;

use tessera_kernels::cpu::rope::RopeStyle;
use tessera_kernels::cuda::{bf16, Buf, Copy2d, Device, QkvPrep, RopeCache};
use tessera_kernels::GgmlType;
use tessera_model::config::ModelConfig;
use tessera_model::weights::ModelFiles;

use super::tp::TpPart;
use crate::error::WorkerError;
use crate::gpu_store::GpuStore;
use crate::llama::{rope_params, rope_style};

/// One decoder layer's tensors (`B`: the device's bf16 buffer, CUDA's by default).
pub(crate) struct GpuLayer<B = Buf<bf16>> {
    pub attn_norm: B,
    pub qkv: B,
    /// Qwen2: the q|k|v bias, `[(n_heads + 2 n_kv) * head_dim]`.
    pub qkv_bias: Option<B>,
    /// Qwen3: per-head RMSNorm weights of q and k, `[head_dim]` each.
    pub qk_norm: Option<(B, B)>,
    pub o: B,
    pub ffn_norm: B,
    pub gate_up: B,
    pub down: B,
}

/// Every tensor of this rank's part of the model, on one device (`R`: its RoPE table).
pub(crate) struct GpuWeights<B = Buf<bf16>, R = RopeCache> {
    /// `[vocab, hidden]`, on the first pipeline stage only.
    pub embed: Option<B>,
    /// This rank's rows of the LM head, `[part.vocab, hidden]`, on the last stage only;
    /// `None` there when the head is the whole (tied) `embed`.
    pub lm_head: Option<B>,
    pub norm: B,
    /// This stage's layers (`part.layers`), in order.
    pub layers: Vec<GpuLayer<B>>,
    pub rope: R,
    pub rope_style: RopeStyle,
}

/// Positions the RoPE table covers: the model's context, at most 128k (its memory is
/// `positions * head_dim * 4` bytes).
pub(crate) fn rope_positions(c: &ModelConfig) -> usize {
    c.max_position.clamp(1, 131072)
}

/// Reads tensors from a file, converting to bf16 on the host; a tensor-parallel rank's
/// slices are cut here, before the upload.
struct FileReader<'a> {
    files: &'a ModelFiles,
}

impl FileReader<'_> {
    /// Rows `range` (`None`: all) of tensor `name` as bf16, only those rows converted; the
    /// tensor is checked to hold `rows x cols` values.
    fn host_rows(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        range: Option<Range<usize>>,
    ) -> Result<Vec<bf16>, WorkerError> {
        let v = self.files.tensor(name)?;
        if v.rows * v.cols != rows * cols || (rows > 1 && (v.rows != rows || v.cols != cols)) {
            return Err(WorkerError::TensorShape {
                name: name.to_string(),
                expected: format!("[{rows}, {cols}]"),
                found: format!("[{}, {}]", v.rows, v.cols),
            });
        }
        let (ty, vcols) = (v.ty, v.cols);
        let row_bytes = ty.bytes_for(vcols).ok_or_else(|| WorkerError::TensorShape {
            name: name.to_string(),
            expected: format!("rows of whole {ty} blocks"),
            found: format!("{vcols} columns"),
        })?;
        let range = range.unwrap_or(0..v.rows);
        let n_rows = range.len();
        let data =
            v.data.get(range.start * row_bytes..range.end * row_bytes).ok_or_else(|| WorkerError::TensorShape {
                name: name.to_string(),
                expected: format!("rows {range:?} of {row_bytes} bytes"),
                found: format!("{} bytes", v.data.len()),
            })?;
        let mut out = vec![bf16::ZERO; n_rows * vcols];
        if ty == GgmlType::BF16 {
            // safetensors / GGUF bf16: the bits as they are.
            out.par_iter_mut().zip(data.par_chunks_exact(2)).for_each(|(d, b)| {
                *d = bf16::from_bits(u16::from_le_bytes([b[0], b[1]]));
            });
            return Ok(out);
        }
        out.par_chunks_mut(vcols).zip(data.par_chunks(row_bytes)).try_for_each_init(
            || vec![0f32; vcols],
            |tmp, (dst, src)| -> Result<(), WorkerError> {
                tessera_kernels::quant::dequantize_row(ty, src, tmp)?;
                for (d, &s) in dst.iter_mut().zip(tmp.iter()) {
                    *d = bf16::from_f32(s);
                }
                Ok(())
            },
        )?;
        Ok(out)
    }

    /// Tensor `name` whole.
    fn host(&self, name: &str, rows: usize, cols: usize) -> Result<Vec<bf16>, WorkerError> {
        self.host_rows(name, rows, cols, None)
    }

    /// Elements `range` of vector `name` (`[n]`).
    fn host_vec(&self, name: &str, n: usize, range: Range<usize>) -> Result<Vec<bf16>, WorkerError> {
        let all = self.host(name, 1, n)?;
        all.get(range.clone()).map(<[bf16]>::to_vec).ok_or_else(|| WorkerError::TensorShape {
            name: name.to_string(),
            expected: format!("elements {range:?}"),
            found: format!("{} elements", all.len()),
        })
    }

    /// Columns `range` of every row of `[rows, cols]` tensor `name` (a row-parallel slice):
    /// `[rows, range.len()]`, copied row by row.
    fn host_cols(&self, name: &str, rows: usize, cols: usize, range: Range<usize>) -> Result<Vec<bf16>, WorkerError> {
        if range == (0..cols) {
            return self.host(name, rows, cols);
        }
        if range.end > cols || range.is_empty() {
            return Err(WorkerError::TensorShape {
                name: name.to_string(),
                expected: format!("columns {range:?} within 0..{cols}"),
                found: format!("[{rows}, {cols}]"),
            });
        }
        let all = self.host(name, rows, cols)?;
        let mut out = Vec::with_capacity(rows * range.len());
        for row in all.chunks_exact(cols) {
            out.extend_from_slice(&row[range.clone()]);
        }
        Ok(out)
    }

    fn upload<D: GpuStore>(&self, dev: &D, name: &str, rows: usize, cols: usize) -> Result<D::Buf, WorkerError> {
        dev.put(&self.host(name, rows, cols)?)
    }

    /// Row ranges of several `[rows, cols]` tensors stacked row-wise in one upload.
    fn stacked<D: GpuStore>(
        &self,
        dev: &D,
        parts: &[(String, usize, Range<usize>)],
        cols: usize,
    ) -> Result<D::Buf, WorkerError> {
        let mut all = Vec::with_capacity(parts.iter().map(|p| p.2.len()).sum::<usize>() * cols);
        for (name, rows, range) in parts {
            all.extend(self.host_rows(name, *rows, cols, Some(range.clone()))?);
        }
        dev.put(&all)
    }
}

impl<B, R> GpuWeights<B, R> {
    /// Uploads `part`'s share of every tensor `c` calls for from `files`: for its stage's
    /// layers the q/k/v rows of its heads, the gate/up rows of its FFN slice, the matching
    /// input columns of o and down, its bias slices, norms and QK-norm weights whole; the
    /// embedding (first stage), the final norm, and its vocabulary rows of the LM head
    /// (last stage).
    pub(crate) fn load<D: GpuStore<Buf = B, Rope = R>>(
        dev: &D,
        c: &ModelConfig,
        part: &TpPart,
        files: &ModelFiles,
    ) -> Result<Self, WorkerError> {
        let r = FileReader { files };
        let (h, hd, ffn) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (q_dim, kv_dim) = (c.num_heads * hd, c.num_kv_heads * hd);
        // This rank's rows of q and of k / v, and its FFN features.
        let qr = part.q_heads.start * hd..part.q_heads.end * hd;
        let kvr = part.kv_heads.start * hd..part.kv_heads.end * hd;
        let fr = part.ffn.clone();
        let embed =
            if part.is_first_stage() { Some(r.upload(dev, "token_embd.weight", c.vocab_size, h)?) } else { None };
        let whole_vocab = part.vocab == (0..c.vocab_size);
        let lm_head = match (part.is_last_stage(), files.has_tensor("output.weight")) {
            (false, _) => None,
            (true, true) => {
                Some(dev.put(&r.host_rows("output.weight", c.vocab_size, h, Some(part.vocab.clone()))?)?)
            }
            (true, false) if whole_vocab && embed.is_some() => None,
            (true, false) => {
                Some(dev.put(&r.host_rows("token_embd.weight", c.vocab_size, h, Some(part.vocab.clone()))?)?)
            }
        };
        let mut layers = Vec::with_capacity(part.layers.len());
        for i in part.layers.clone() {
            let n = |s: &str| format!("blk.{i}.{s}");
            let qkv_bias = if c.qkv_bias {
                let mut b = r.host_vec(&n("attn_q.bias"), q_dim, qr.clone())?;
                b.extend(r.host_vec(&n("attn_k.bias"), kv_dim, kvr.clone())?);
                b.extend(r.host_vec(&n("attn_v.bias"), kv_dim, kvr.clone())?);
                Some(dev.put(&b)?)
            } else {
                None
            };
            let qk_norm = if c.qk_norm {
                Some((r.upload(dev, &n("attn_q_norm.weight"), 1, hd)?, r.upload(dev, &n("attn_k_norm.weight"), 1, hd)?))
            } else {
                None
            };
            let qkv = [
                (n("attn_q.weight"), q_dim, qr.clone()),
                (n("attn_k.weight"), kv_dim, kvr.clone()),
                (n("attn_v.weight"), kv_dim, kvr.clone()),
            ];
            let gate_up = [(n("ffn_gate.weight"), ffn, fr.clone()), (n("ffn_up.weight"), ffn, fr.clone())];
            layers.push(GpuLayer {
                attn_norm: r.upload(dev, &n("attn_norm.weight"), 1, h)?,
                qkv: r.stacked(dev, &qkv, h)?,
                qkv_bias,
                qk_norm,
                o: dev.put(&r.host_cols(&n("attn_output.weight"), h, q_dim, qr.clone())?)?,
                ffn_norm: r.upload(dev, &n("ffn_norm.weight"), 1, h)?,
                gate_up: r.stacked(dev, &gate_up, h)?,
                down: dev.put(&r.host_cols(&n("ffn_down.weight"), h, ffn, fr.clone())?)?,
            });
        }
        let norm = r.upload(dev, "output_norm.weight", 1, h)?;
        let freq = if files.has_tensor("rope_freqs.weight") {
            Some(r.host("rope_freqs.weight", 1, hd / 2)?.iter().map(|v| v.to_f32()).collect())
        } else {
            None
        };
        let rope = dev.rope_table(&rope_params(c, freq)?, rope_positions(c))?;
        Ok(GpuWeights { embed, lm_head, norm, layers, rope, rope_style: rope_style(c) })
    }
}

impl<B, R> GpuWeights<B, R> {
    /// Layer `l`'s Q/K/V preparation over `qkv` (`[t, (heads + 2 kv heads) * head_dim]`, the
    /// q|k|v GEMM's output) for tokens at `positions` going to cache `slots`: its bias and
    /// QK-norm weights, this model's RoPE table and style.
    pub(crate) fn qkv_prep<'a, U>(
        &'a self,
        c: &ModelConfig,
        l: &'a GpuLayer<B>,
        qkv: &'a B,
        t: usize,
        positions: &'a U,
        slots: &'a U,
    ) -> QkvPrep<'a, B, U, R> {
        QkvPrep {
            qkv,
            n_tokens: t,
            n_heads: c.num_heads,
            n_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            bias: l.qkv_bias.as_ref(),
            qk_norm: l.qk_norm.as_ref().map(|(a, b)| (a, b)),
            eps: c.rms_norm_eps,
            positions,
            rope: &self.rope,
            style: self.rope_style,
            slots,
        }
    }
}

impl GpuWeights {
    /// Random weights of shape `c`, generated on the device from `seed`: matrices uniform
    /// with the standard deviation 0.02 of HF's initialiser, the residual branches' output
    /// projections (o, down) scaled by `1 / sqrt(2 * layers)` as GPT-2 and Megatron
    /// initialise them, norm weights near 1, so activations stay in a realistic range
    /// through every layer and a rounding difference is not amplified from layer to layer
    /// the way an unscaled random network amplifies it (which would hide a real error in
    /// a split-vs-whole comparison below the noise). Each tensor is drawn whole
    /// from its own seed (the same sequence for every part) and `part`'s share is cut from
    /// it on the device, so every split of a seed is the same model as one GPU's.
    pub(crate) fn synthetic(dev: &Device, c: &ModelConfig, part: &TpPart, seed: u64) -> Result<Self, WorkerError> {
        let (h, hd, ffn) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (q_dim, kv_dim) = (c.num_heads * hd, c.num_kv_heads * hd);
        let qr = part.q_heads.start * hd..part.q_heads.end * hd;
        let kvr = part.kv_heads.start * hd..part.kv_heads.end * hd;
        let fr = part.ffn.clone();
        let a = 0.02 * 3f32.sqrt();
        let a_out = a / (2.0 * c.num_layers.max(1) as f32).sqrt();
        let mut gen = Synth { dev, seed };
        let embed = gen.rand(part.is_first_stage(), c.vocab_size * h, -a, a)?;
        let head_source =
            if c.tie_embeddings { None } else { gen.rand(part.is_last_stage(), c.vocab_size * h, -a, a)? };
        let whole_vocab = part.vocab == (0..c.vocab_size);
        let lm_head = match (head_source, &embed) {
            _ if !part.is_last_stage() => None,
            (Some(src), _) => Some(gen.rows(src, h, std::slice::from_ref(&part.vocab))?),
            (None, Some(_)) if whole_vocab => None,
            // Tied: the head is the embedding, which this stage may not hold; draw it again.
            (None, _) => {
                let src = Synth { dev, seed }.rand(true, c.vocab_size * h, -a, a)?;
                let src = src.ok_or_else(|| WorkerError::InvalidBatch("no embedding drawn".into()))?;
                Some(gen.rows(src, h, std::slice::from_ref(&part.vocab))?)
            }
        };
        let mut layers = Vec::with_capacity(part.layers.len());
        for i in 0..c.num_layers {
            let mine = part.layers.contains(&i);
            let attn_norm = gen.rand(mine, h, 0.9, 1.1)?;
            let qkv = gen.rand(mine, (q_dim + 2 * kv_dim) * h, -a, a)?;
            let qkv_bias = if c.qkv_bias { gen.rand(mine, q_dim + 2 * kv_dim, -0.1, 0.1)? } else { None };
            let qk_norm =
                if c.qk_norm { Some((gen.rand(mine, hd, 0.9, 1.1)?, gen.rand(mine, hd, 0.9, 1.1)?)) } else { None };
            let o = gen.rand(mine, h * q_dim, -a_out, a_out)?;
            let ffn_norm = gen.rand(mine, h, 0.9, 1.1)?;
            let gate_up = gen.rand(mine, 2 * ffn * h, -a, a)?;
            let down = gen.rand(mine, h * ffn, -a_out, a_out)?;
            let (Some(attn_norm), Some(qkv), Some(o), Some(ffn_norm), Some(gate_up), Some(down)) =
                (attn_norm, qkv, o, ffn_norm, gate_up, down)
            else {
                continue;
            };
            let qkv_rows =
                [qr.clone(), q_dim + kvr.start..q_dim + kvr.end, q_dim + kv_dim + kvr.start..q_dim + kv_dim + kvr.end];
            layers.push(GpuLayer {
                attn_norm,
                qkv: gen.rows(qkv, h, &qkv_rows)?,
                qkv_bias: qkv_bias.map(|b| gen.rows(b, 1, &qkv_rows)).transpose()?,
                qk_norm: match qk_norm {
                    Some((Some(q), Some(k))) => Some((q, k)),
                    _ => None,
                },
                o: gen.cols(o, h, q_dim, qr.clone())?,
                ffn_norm,
                gate_up: gen.rows(gate_up, h, &[fr.clone(), ffn + fr.start..ffn + fr.end])?,
                down: gen.cols(down, h, ffn, fr.clone())?,
            });
        }
        let norm = gen.rand(true, h, 0.9, 1.1)?.ok_or_else(|| WorkerError::InvalidBatch("no norm drawn".into()))?;
        let rope = dev.rope_cache(&rope_params(c, None)?, rope_positions(c))?;
        dev.synchronize()?;
        Ok(GpuWeights { embed, lm_head, norm, layers, rope, rope_style: rope_style(c) })
    }
}

/// The random tensors of a synthetic model, one seed per tensor in a fixed order, and the
/// device-side slicing of a part's share.
struct Synth<'a> {
    dev: &'a Device,
    seed: u64,
}

impl Synth<'_> {
    /// The next tensor (`len` values uniform in `lo..hi`) when `keep`; either way its seed
    /// is used up, so later tensors get the same values whatever this part keeps.
    fn rand(&mut self, keep: bool, len: usize, lo: f32, hi: f32) -> Result<Option<Buf<bf16>>, WorkerError> {
        self.seed = self.seed.wrapping_add(1);
        if !keep {
            return Ok(None);
        }
        let mut b = self.dev.alloc_weight::<bf16>(len)?;
        self.dev.fill_uniform(&mut b, self.seed, lo, hi)?;
        Ok(Some(b))
    }

    /// Row ranges of `src` (`[_, row_len]`) stacked in order; `src` itself when they are
    /// all of it in order (one GPU's whole tensor: no copy, no second allocation).
    fn rows(&self, src: Buf<bf16>, row_len: usize, ranges: &[Range<usize>]) -> Result<Buf<bf16>, WorkerError> {
        if covers_in_order(ranges, src.len() / row_len.max(1)) {
            return Ok(src);
        }
        let total: usize = ranges.iter().map(|r| r.len()).sum();
        let mut out = self.dev.alloc_weight::<bf16>(total * row_len)?;
        let mut at = 0;
        for r in ranges {
            self.dev.copy_rows(&mut out, at, &src, r.start, r.len(), row_len)?;
            at += r.len();
        }
        Ok(out)
    }

    /// Columns `range` of `src` (`[rows, cols]`): `[rows, range.len()]`; `src` itself when
    /// the range is every column.
    fn cols(&self, src: Buf<bf16>, rows: usize, cols: usize, range: Range<usize>) -> Result<Buf<bf16>, WorkerError> {
        if range == (0..cols) {
            return Ok(src);
        }
        let w = range.len();
        let mut out = self.dev.alloc_weight::<bf16>(rows * w)?;
        self.dev.copy_2d(&mut out, &src, &Copy2d::columns(rows, cols, range.start, w))?;
        Ok(out)
    }
}

/// Whether `ranges`, in order, are exactly `0..rows` (each starting where the last ended).
fn covers_in_order(ranges: &[Range<usize>], rows: usize) -> bool {
    let mut at = 0;
    for r in ranges {
        if r.start != at {
            return false;
        }
        at = r.end;
    }
    at == rows
}

#[cfg(test)]
mod tests {
    use super::covers_in_order;

    #[test]
    fn whole_tensor_only_when_ranges_tile_it_in_order() {
        assert!(covers_in_order(&[0..10], 10));
        assert!(covers_in_order(&[0..4, 4..10], 10));
        assert!(!covers_in_order(&[0..4], 10)); // a part's share
        assert!(!covers_in_order(&[4..10, 0..4], 10)); // reordered rows
        assert!(!covers_in_order(&[0..4, 5..10], 10)); // a gap
        assert!(!covers_in_order(&[0..4, 4..12], 10)); // past the end
        assert!(!covers_in_order(&[2..4, 12..14], 10)); // two tp parts' slices (q and k/v)
    }
}
