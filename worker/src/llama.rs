//! The Llama-family decoder (Llama 3, SmolLM2, Qwen2, Qwen3) on the CPU kernels.
//!
//! The three architectures share one block: Qwen2 adds biases to q/k/v, Qwen3 adds a
//! per-head RMSNorm on q and k before RoPE. Those are two optional fields rather than
//! three copies of the same file. Field names follow the Hugging Face checkpoint.
//!
//! `forward` runs one pass over a whole batch: every chunk's tokens are stacked into one
//! `[T, hidden]` activation so each weight matrix is streamed once per step for all
//! sequences; only attention is per sequence (its own positions and block table).

use std::sync::Arc;

use rayon::prelude::*;

use tessera_kernels::cpu::{activation, attention, matmul, norm, rope};
use tessera_model::config::{Arch, ModelConfig, RopeStyle};
use tessera_model::weights::ModelFiles;

use crate::batch::{Logits, SeqChunk};
use crate::error::WorkerError;
use crate::kv_cache::KvCache;
use crate::weights::{Linear, WeightLoader};

/// A loaded model, ready to run batches.
pub struct LlamaModel {
    pub config: ModelConfig,
    /// `[vocab, hidden]`.
    embed_tokens: Linear,
    layers: Vec<DecoderLayer>,
    /// Final RMSNorm weight, `[hidden]`.
    norm: Vec<f32>,
    /// `[vocab, hidden]`; the embedding itself when tied.
    lm_head: Linear,
    rope: rope::RopeParams,
    rope_style: rope::RopeStyle,
    /// Keeps the storage behind every `Linear` alive.
    _files: Arc<ModelFiles>,
}

struct DecoderLayer {
    /// `[hidden]`.
    input_layernorm: Vec<f32>,
    self_attn: SelfAttention,
    /// `[hidden]`.
    post_attention_layernorm: Vec<f32>,
    mlp: Mlp,
}

/// Weights whose outputs are computed together: one stacked matrix when the parts share
/// a type (one pass over the input, one activation quantisation), else the parts.
enum Stacked {
    /// `[sum of the parts' rows, hidden]`; the parts' row counts.
    Fused(Linear, Vec<usize>),
    Separate(Vec<Linear>),
}

impl Stacked {
    fn new(parts: Vec<Linear>) -> Self {
        let refs: Vec<&Linear> = parts.iter().collect();
        match Linear::fuse(&refs) {
            Some(f) => Stacked::Fused(f, parts.iter().map(|p| p.rows).collect()),
            None => Stacked::Separate(parts),
        }
    }

    /// `x` is `[n, cols]`; writes part `i`'s output `[n, rows_i]` into `outs[i]`.
    /// `scratch` holds the fused output.
    fn forward(&self, x: &[f32], n: usize, outs: &mut [&mut [f32]], scratch: &mut Vec<f32>) -> Result<(), WorkerError> {
        match self {
            Stacked::Separate(parts) => {
                for (w, out) in parts.iter().zip(outs.iter_mut()) {
                    matmul::matmul(out, x, n, &w.weight())?;
                }
            }
            Stacked::Fused(w, rows) => {
                scratch.resize(n * w.rows, 0.0);
                matmul::matmul(scratch, x, n, &w.weight())?;
                for (t, row) in scratch.chunks_exact(w.rows).enumerate() {
                    let mut c0 = 0;
                    for (out, &r) in outs.iter_mut().zip(rows) {
                        out[t * r..(t + 1) * r].copy_from_slice(&row[c0..c0 + r]);
                        c0 += r;
                    }
                }
            }
        }
        Ok(())
    }
}

struct SelfAttention {
    /// q `[n_heads * head_dim, hidden]`, k and v `[n_kv_heads * head_dim, hidden]`.
    qkv_proj: Stacked,
    /// `[hidden, n_heads * head_dim]`.
    o_proj: Linear,
    /// Qwen2: biases of q, k, v.
    bias: Option<[Vec<f32>; 3]>,
    /// Qwen3: per-head RMSNorm weights of q and k, `[head_dim]` each.
    qk_norm: Option<[Vec<f32>; 2]>,
}

struct Mlp {
    /// gate and up, `[intermediate, hidden]` each.
    gate_up_proj: Stacked,
    /// `[hidden, intermediate]`.
    down_proj: Linear,
}

impl LlamaModel {
    /// Loads every tensor the config calls for, checking shapes.
    pub fn load(files: Arc<ModelFiles>) -> Result<Self, WorkerError> {
        let config = files.config()?;
        config.validate().map_err(tessera_model::error::ModelError::from)?;
        let w = WeightLoader::new(files.clone());
        let c = &config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q_dim, kv_dim) = (c.num_heads * hd, c.num_kv_heads * hd);
        let embed_tokens = w.linear("token_embd.weight", c.vocab_size, h)?;
        let lm_head =
            if w.has("output.weight") { w.linear("output.weight", c.vocab_size, h)? } else { embed_tokens.clone() };
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let bias = if c.qkv_bias {
                Some([
                    w.vector(&n("attn_q.bias"), q_dim)?,
                    w.vector(&n("attn_k.bias"), kv_dim)?,
                    w.vector(&n("attn_v.bias"), kv_dim)?,
                ])
            } else {
                None
            };
            let qk_norm = if c.qk_norm {
                Some([w.vector(&n("attn_q_norm.weight"), hd)?, w.vector(&n("attn_k_norm.weight"), hd)?])
            } else {
                None
            };
            layers.push(DecoderLayer {
                input_layernorm: w.vector(&n("attn_norm.weight"), h)?,
                self_attn: SelfAttention {
                    qkv_proj: Stacked::new(vec![
                        w.linear(&n("attn_q.weight"), q_dim, h)?,
                        w.linear(&n("attn_k.weight"), kv_dim, h)?,
                        w.linear(&n("attn_v.weight"), kv_dim, h)?,
                    ]),
                    o_proj: w.linear(&n("attn_output.weight"), h, q_dim)?,
                    bias,
                    qk_norm,
                },
                post_attention_layernorm: w.vector(&n("ffn_norm.weight"), h)?,
                mlp: Mlp {
                    gate_up_proj: Stacked::new(vec![
                        w.linear(&n("ffn_gate.weight"), c.intermediate_size, h)?,
                        w.linear(&n("ffn_up.weight"), c.intermediate_size, h)?,
                    ]),
                    down_proj: w.linear(&n("ffn_down.weight"), h, c.intermediate_size)?,
                },
            });
        }
        let freq_factors = if w.has("rope_freqs.weight") { Some(w.vector("rope_freqs.weight", hd / 2)?) } else { None };
        let rope = rope::RopeParams::new(
            hd,
            c.rope_theta,
            c.rope_scaling.as_ref().map(|s| rope::Llama3Scaling {
                factor: s.factor,
                low_freq_factor: s.low_freq_factor,
                high_freq_factor: s.high_freq_factor,
                original_max_position: s.original_max_position,
            }),
            freq_factors,
        )?;
        let rope_style = match c.rope_style {
            RopeStyle::Interleaved => rope::RopeStyle::Interleaved,
            RopeStyle::Neox => rope::RopeStyle::Neox,
        };
        let norm = w.vector("output_norm.weight", h)?;
        debug_assert!(matches!(c.arch, Arch::Llama | Arch::Qwen2 | Arch::Qwen3));
        Ok(LlamaModel { config, embed_tokens, layers, norm, lm_head, rope, rope_style, _files: w.files().clone() })
    }

    /// A KV cache shaped for this model.
    pub fn new_kv_cache(&self, num_blocks: usize, block_size: usize) -> KvCache {
        let c = &self.config;
        KvCache::new(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)
    }

    /// Runs one step over `chunks`, writing their K/V into `kv`, and returns the logits
    /// each chunk asked for.
    pub fn forward(&self, chunks: &[SeqChunk], kv: &mut KvCache) -> Result<Logits, WorkerError> {
        let c = &self.config;
        crate::batch::validate_chunks(chunks, c.vocab_size, kv.num_blocks, kv.block_size)?;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q_dim, kv_dim, ffn) = (c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size);
        let t_total: usize = chunks.iter().map(|s| s.tokens.len()).sum();
        // Token positions of the stacked batch, `[T]`.
        let positions: Vec<u32> =
            chunks.iter().flat_map(|s| (s.first_pos..s.first_pos + s.tokens.len()).map(|p| p as u32)).collect();

        // Residual stream, `[T, hidden]`.
        let mut x = vec![0.0f32; t_total * h];
        let embed = self.embed_tokens.weight();
        for (row, &tok) in chunks.iter().flat_map(|s| s.tokens.iter()).enumerate() {
            matmul::dequantize_rows(&embed, tok as usize, &mut x[row * h..(row + 1) * h])?;
        }

        let mut xn = vec![0.0f32; t_total * h];
        let mut q = vec![0.0f32; t_total * q_dim];
        let mut k = vec![0.0f32; t_total * kv_dim];
        let mut v = vec![0.0f32; t_total * kv_dim];
        let mut attn = vec![0.0f32; t_total * q_dim];
        let mut o = vec![0.0f32; t_total * h];
        let mut gate = vec![0.0f32; t_total * ffn];
        let mut up = vec![0.0f32; t_total * ffn];
        // Output of a fused projection before it is split, `[T, sum of parts]`.
        let mut fused = Vec::new();

        for (li, layer) in self.layers.iter().enumerate() {
            let sa = &layer.self_attn;
            norm::rms_norm(&mut xn, &x, &layer.input_layernorm, t_total, c.rms_norm_eps)?;
            sa.qkv_proj.forward(&xn, t_total, &mut [&mut q, &mut k, &mut v], &mut fused)?;
            if let Some([bq, bk, bv]) = &sa.bias {
                activation::add_row_bias(&mut q, bq)?;
                activation::add_row_bias(&mut k, bk)?;
                activation::add_row_bias(&mut v, bv)?;
            }
            if let Some([nq, nk]) = &sa.qk_norm {
                norm::rms_norm_inplace(&mut q, nq, t_total * c.num_heads, c.rms_norm_eps)?;
                norm::rms_norm_inplace(&mut k, nk, t_total * c.num_kv_heads, c.rms_norm_eps)?;
            }
            rope::rope(&mut q, t_total, c.num_heads, hd, &positions, &self.rope, self.rope_style)?;
            rope::rope(&mut k, t_total, c.num_kv_heads, hd, &positions, &self.rope, self.rope_style)?;

            let cache = attention::PagedKv { block_size: kv.block_size, n_kv_heads: c.num_kv_heads, head_dim: hd };
            // K/V of every chunk go into the cache first (each chunk writes only its own
            // new positions; shared prefix blocks are full and never written).
            let mut row = 0;
            for s in chunks {
                let n = s.tokens.len();
                let seq = attention::SeqSlice { block_table: &s.block_table, first_pos: s.first_pos, n_tokens: n };
                let (kr, vr) = (&k[row * kv_dim..(row + n) * kv_dim], &v[row * kv_dim..(row + n) * kv_dim]);
                attention::write_kv(&cache, &mut kv.k[li], &mut kv.v[li], kr, vr, &seq)?;
                row += n;
            }
            // Then attention for all chunks in one parallel region: one region per
            // sequence cost more in waking threads than the work at decode batch sizes.
            let mut outs: Vec<&mut [f32]> = Vec::with_capacity(chunks.len());
            let mut rest: &mut [f32] = &mut attn;
            for s in chunks {
                let (head, tail) = rest.split_at_mut(s.tokens.len() * q_dim);
                outs.push(head);
                rest = tail;
            }
            let starts: Vec<usize> = chunks
                .iter()
                .scan(0, |acc, s| {
                    let r = *acc;
                    *acc += s.tokens.len();
                    Some(r)
                })
                .collect();
            let (k_cache, v_cache) = (&kv.k[li], &kv.v[li]);
            let scale = 1.0 / (hd as f32).sqrt();
            outs.into_par_iter().zip(chunks.par_iter().zip(starts.par_iter())).try_for_each(|(out, (s, &r0))| {
                let n = s.tokens.len();
                let seq = attention::SeqSlice { block_table: &s.block_table, first_pos: s.first_pos, n_tokens: n };
                let qs = &q[r0 * q_dim..(r0 + n) * q_dim];
                attention::attention(&cache, k_cache, v_cache, out, qs, &seq, c.num_heads, scale)
            })?;
            matmul::matmul(&mut o, &attn, t_total, &sa.o_proj.weight())?;
            activation::add_inplace(&mut x, &o)?;

            norm::rms_norm(&mut xn, &x, &layer.post_attention_layernorm, t_total, c.rms_norm_eps)?;
            layer.mlp.gate_up_proj.forward(&xn, t_total, &mut [&mut gate, &mut up], &mut fused)?;
            activation::silu_mul_inplace(&mut gate, &up)?;
            matmul::matmul(&mut o, &gate, t_total, &layer.mlp.down_proj.weight())?;
            activation::add_inplace(&mut x, &o)?;
        }

        // Gather the rows whose logits were asked for, then norm + LM head on those only.
        let mut spans = Vec::with_capacity(chunks.len());
        let mut picked: Vec<usize> = Vec::new();
        let mut row = 0;
        for s in chunks {
            let n = s.tokens.len();
            let rows = s.logits.rows(n);
            spans.push((picked.len(), rows));
            picked.extend((row + n - rows)..(row + n));
            row += n;
        }
        let mut sel = vec![0.0f32; picked.len() * h];
        for (i, &r) in picked.iter().enumerate() {
            sel[i * h..(i + 1) * h].copy_from_slice(&x[r * h..(r + 1) * h]);
        }
        let mut seln = vec![0.0f32; sel.len()];
        norm::rms_norm(&mut seln, &sel, &self.norm, picked.len(), c.rms_norm_eps)?;
        let mut data = vec![0.0f32; picked.len() * c.vocab_size];
        if !picked.is_empty() {
            matmul::matmul(&mut data, &seln, picked.len(), &self.lm_head.weight())?;
        }
        Ok(Logits { vocab: c.vocab_size, data, spans })
    }
}
