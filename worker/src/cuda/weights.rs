//! A model's weights on the GPU, bf16: read from a model file (GGUF types dequantised on
//! the host, safetensors bf16 copied as is) or generated on the device for `--synthetic`.
//!
//! A tensor-parallel rank keeps only its share ([`TpPart`]): sliced on the host before the
//! upload, or generated at its local shape.
//!
//! Projections computed together are stored stacked, as one GEMM operand: q|k|v rows
//! (`[(n_heads + 2 n_kv) * head_dim, hidden]`, this rank's heads) and gate|up rows
//! (`[2 * ffn, hidden]`, this rank's FFN slice, gate first, the layout `silu_mul_packed`
//! reads).

use std::ops::Range;

use rayon::prelude::*;

use tessera_kernels::cpu::rope::RopeStyle;
use tessera_kernels::cuda::{bf16, Buf, Device, RopeCache};
use tessera_kernels::GgmlType;
use tessera_model::config::ModelConfig;
use tessera_model::weights::ModelFiles;

use super::tp::TpPart;
use crate::error::WorkerError;
use crate::llama::{rope_params, rope_style};

/// One decoder layer's tensors.
pub(crate) struct GpuLayer {
    pub attn_norm: Buf<bf16>,
    pub qkv: Buf<bf16>,
    /// Qwen2: the q|k|v bias, `[(n_heads + 2 n_kv) * head_dim]`.
    pub qkv_bias: Option<Buf<bf16>>,
    /// Qwen3: per-head RMSNorm weights of q and k, `[head_dim]` each.
    pub qk_norm: Option<(Buf<bf16>, Buf<bf16>)>,
    pub o: Buf<bf16>,
    pub ffn_norm: Buf<bf16>,
    pub gate_up: Buf<bf16>,
    pub down: Buf<bf16>,
}

/// Every tensor of the model, on one device.
pub(crate) struct GpuWeights {
    /// `[vocab, hidden]`.
    pub embed: Buf<bf16>,
    /// `[vocab, hidden]`; `None` when tied to `embed`.
    pub lm_head: Option<Buf<bf16>>,
    pub norm: Buf<bf16>,
    pub layers: Vec<GpuLayer>,
    pub rope: RopeCache,
    pub rope_style: RopeStyle,
}

/// Positions the RoPE table covers: the model's context, at most 128k (its memory is
/// `positions * head_dim * 4` bytes).
fn rope_positions(c: &ModelConfig) -> usize {
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

    fn upload(&self, dev: &Device, name: &str, rows: usize, cols: usize) -> Result<Buf<bf16>, WorkerError> {
        Ok(dev.upload(&self.host(name, rows, cols)?)?)
    }

    /// Row ranges of several `[rows, cols]` tensors stacked row-wise in one upload.
    fn stacked(
        &self,
        dev: &Device,
        parts: &[(String, usize, Range<usize>)],
        cols: usize,
    ) -> Result<Buf<bf16>, WorkerError> {
        let mut all = Vec::with_capacity(parts.iter().map(|p| p.2.len()).sum::<usize>() * cols);
        for (name, rows, range) in parts {
            all.extend(self.host_rows(name, *rows, cols, Some(range.clone()))?);
        }
        Ok(dev.upload(&all)?)
    }
}

impl GpuWeights {
    /// Uploads `part`'s share of every tensor `c` calls for from `files`: the q/k/v rows
    /// of its heads, the gate/up rows of its FFN slice, the matching input columns of o and
    /// down, its bias slices; norms, QK-norm weights, embedding and LM head whole.
    pub(crate) fn load(dev: &Device, c: &ModelConfig, part: &TpPart, files: &ModelFiles) -> Result<Self, WorkerError> {
        let r = FileReader { files };
        let (h, hd, ffn) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (q_dim, kv_dim) = (c.num_heads * hd, c.num_kv_heads * hd);
        // This rank's rows of q and of k / v, and its FFN features.
        let qr = part.q_heads.start * hd..part.q_heads.end * hd;
        let kvr = part.kv_heads.start * hd..part.kv_heads.end * hd;
        let fr = part.ffn.clone();
        let embed = r.upload(dev, "token_embd.weight", c.vocab_size, h)?;
        let lm_head = if files.has_tensor("output.weight") {
            Some(r.upload(dev, "output.weight", c.vocab_size, h)?)
        } else {
            None
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let qkv_bias = if c.qkv_bias {
                let mut b = r.host_vec(&n("attn_q.bias"), q_dim, qr.clone())?;
                b.extend(r.host_vec(&n("attn_k.bias"), kv_dim, kvr.clone())?);
                b.extend(r.host_vec(&n("attn_v.bias"), kv_dim, kvr.clone())?);
                Some(dev.upload(&b)?)
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
                o: dev.upload(&r.host_cols(&n("attn_output.weight"), h, q_dim, qr.clone())?)?,
                ffn_norm: r.upload(dev, &n("ffn_norm.weight"), 1, h)?,
                gate_up: r.stacked(dev, &gate_up, h)?,
                down: dev.upload(&r.host_cols(&n("ffn_down.weight"), h, ffn, fr.clone())?)?,
            });
        }
        let norm = r.upload(dev, "output_norm.weight", 1, h)?;
        let freq = if files.has_tensor("rope_freqs.weight") {
            Some(r.host("rope_freqs.weight", 1, hd / 2)?.iter().map(|v| v.to_f32()).collect())
        } else {
            None
        };
        let rope = dev.rope_cache(&rope_params(c, freq)?, rope_positions(c))?;
        Ok(GpuWeights { embed, lm_head, norm, layers, rope, rope_style: rope_style(c) })
    }

    /// Random weights of shape `local` (a rank's [`TpPart::local_config`], or the whole
    /// model), generated on the device from `seed`: matrices uniform with the standard
    /// deviation 0.02 of HF's initialiser, norm weights near 1, so activations stay in a
    /// realistic range through every layer. Replicated tensors (norms, embedding, LM head)
    /// are the same on every rank; the sharded ones draw from `rank`'s own stream, so the
    /// values differ from a one-GPU model's (fine for speed; correctness is checked on
    /// real files).
    pub(crate) fn synthetic(dev: &Device, local: &ModelConfig, seed: u64, rank: usize) -> Result<Self, WorkerError> {
        let c = local;
        let (h, hd, ffn) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (q_dim, kv_dim) = (c.num_heads * hd, c.num_kv_heads * hd);
        let a = 0.02 * 3f32.sqrt();
        let salt = (rank as u64) << 40;
        let mut next = seed;
        let mut rand = |len: usize, lo: f32, hi: f32, sharded: bool| -> Result<Buf<bf16>, WorkerError> {
            let mut b = dev.alloc::<bf16>(len)?;
            next = next.wrapping_add(1);
            dev.fill_uniform(&mut b, if sharded { next ^ salt } else { next }, lo, hi)?;
            Ok(b)
        };
        let embed = rand(c.vocab_size * h, -a, a, false)?;
        let lm_head = if c.tie_embeddings { None } else { Some(rand(c.vocab_size * h, -a, a, false)?) };
        let mut layers = Vec::with_capacity(c.num_layers);
        for _ in 0..c.num_layers {
            layers.push(GpuLayer {
                attn_norm: rand(h, 0.9, 1.1, false)?,
                qkv: rand((q_dim + 2 * kv_dim) * h, -a, a, true)?,
                qkv_bias: if c.qkv_bias { Some(rand(q_dim + 2 * kv_dim, -0.1, 0.1, true)?) } else { None },
                qk_norm: if c.qk_norm { Some((rand(hd, 0.9, 1.1, false)?, rand(hd, 0.9, 1.1, false)?)) } else { None },
                o: rand(h * q_dim, -a, a, true)?,
                ffn_norm: rand(h, 0.9, 1.1, false)?,
                gate_up: rand(2 * ffn * h, -a, a, true)?,
                down: rand(h * ffn, -a, a, true)?,
            });
        }
        let norm = rand(h, 0.9, 1.1, false)?;
        let rope = dev.rope_cache(&rope_params(c, None)?, rope_positions(c))?;
        dev.synchronize()?;
        Ok(GpuWeights { embed, lm_head, norm, layers, rope, rope_style: rope_style(c) })
    }
}
