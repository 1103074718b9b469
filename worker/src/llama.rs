//! The Llama-family decoder (Llama 3, SmolLM2, Qwen2, Qwen3) on the CPU kernels.
//!
//! The three architectures share one block: Qwen2 adds biases to q/k/v, Qwen3 adds a
//! per-head RMSNorm on q and k before RoPE. Those are two optional fields rather than
//! three copies of the same file. Field names follow the Hugging Face checkpoint.
//!
//! `forward` runs one pass over a whole batch: every chunk's tokens are stacked into one
//! `[T, hidden]` activation so each weight matrix is streamed once per step for all
//! sequences; only attention is per sequence (its own positions and block table).

use std::sync::{Arc, Mutex};

use tessera_kernels::cpu::matmul::Isa;
use tessera_kernels::cpu::norm::SumOrder;
use tessera_kernels::cpu::packed::PackedWeight;
use tessera_kernels::cpu::{activation, attention, attention_f16, attention_tiled, matmul, norm, rope};
use tessera_kernels::quant::q8::ActsQ8;
use tessera_kernels::GgmlType;
use tessera_model::config::{Arch, ModelConfig, RopeStyle};
use tessera_model::weights::ModelFiles;

use crate::batch::{Logits, SeqChunk};
use crate::error::WorkerError;
use crate::kv_cache::KvCache;
use crate::op_profile::{self as prof, Op};
use crate::parallel::{gather_columns, Comms, Shard};
use crate::shard;
use crate::weights::{Linear, WeightLoader};

/// `TESSERA_CPU_PACKED`: `0` loads models with the row-major matmul kernels.
fn packed_by_default() -> bool {
    std::env::var("TESSERA_CPU_PACKED").map(|v| v != "0").unwrap_or(true)
}

/// A loaded model, ready to run batches.
pub struct LlamaModel {
    pub config: ModelConfig,
    /// The part of the model this worker runs (all of it unless tensor/pipeline parallel).
    pub shard: Shard,
    /// `[vocab, hidden]`.
    embed_tokens: Linear,
    /// This stage's layers (`shard.layers`), with this tensor rank's heads and features.
    layers: Vec<DecoderLayer>,
    /// Final RMSNorm weight, `[hidden]`.
    norm: Vec<f32>,
    /// `[vocab / tp, hidden]`: this tensor rank's vocabulary rows (the embedding's when tied).
    lm_head: Linear,
    /// Query and KV heads of this tensor rank.
    q_heads: std::ops::Range<usize>,
    kv_heads: std::ops::Range<usize>,
    rope: rope::RopeParams,
    rope_style: rope::RopeStyle,
    /// Keeps the storage behind every `Linear` alive.
    _files: Arc<ModelFiles>,
    /// The last step's logits buffer, handed back by the executor
    /// ([`LlamaModel::recycle_logits`]): a batch's `[rows, vocab]` (3 MB for 16 rows of
    /// SmolLM2) is then neither allocated nor zeroed again each step.
    spare_logits: Mutex<Vec<f32>>,
    /// The fast path's rounding beside the packed matmuls: attention by
    /// `cpu::attention_tiled` (f32 softmax, the whole batch in one call) and norms summed
    /// over eight lanes; else `cpu::attention_f16` and ggml's sum order (llama.cpp's
    /// rounding). On with the packed kernels on CPUs that have them (see
    /// [`LlamaModel::set_packed_kernels`]).
    fast_path: bool,
}

/// Where a layer's norm left its output for the projection after it.
enum Normed {
    /// f32 rows in the step's `xn` buffer.
    InXn,
    /// Already quantised for the projection's packed matrix (the fast path: one pass for
    /// the norm and the quantisation, `norm::rms_norm_q8`).
    Q8(ActsQ8),
}

struct DecoderLayer {
    /// `[hidden]`.
    input_layernorm: Vec<f32>,
    self_attn: SelfAttention,
    /// `[hidden]`.
    post_attention_layernorm: Vec<f32>,
    mlp: Mlp,
}

/// Weights whose outputs are computed together (q/k/v, gate/up): one pass over the input
/// and one activation quantisation for all of them when the parts share a type.
struct Stacked {
    /// The parts (views into the model file, or shards of them).
    parts: Vec<Linear>,
    /// How the parts are multiplied.
    joint: Joint,
}

enum Joint {
    /// The parts packed as one stacked matrix (`cpu::packed`), built straight from them.
    Packed(Arc<PackedWeight>),
    /// A row-major copy of the stacked parts, `[sum of the parts' rows, hidden]`.
    Fused(Linear),
    /// One matmul per part (types differ; each part may be packed on its own).
    Separate,
}

impl Stacked {
    /// The parts, not yet joined: [`Stacked::set_packed`] (which loading calls) forms the
    /// joint matrix.
    fn new(parts: Vec<Linear>) -> Self {
        Stacked { parts, joint: Joint::Separate }
    }

    /// See [`LlamaModel::set_packed_kernels`]. Packed (where this CPU has a SIMD kernel
    /// for the parts' shared type), the joint matrix is packed straight from the parts and
    /// no row-major copy is kept; otherwise the row-major copy of the stack when the parts
    /// share a type, else each part on its own (packed if it can be).
    fn set_packed(&mut self, on: bool) -> Result<(), WorkerError> {
        if on && matches!(self.joint, Joint::Packed(_)) {
            return Ok(());
        }
        for p in &mut self.parts {
            p.pack(false)?;
        }
        let weights: Vec<_> = self.parts.iter().map(|p| p.weight()).collect();
        let Some(first) = weights.first() else { return Ok(()) };
        let same = weights.iter().all(|w| w.ty == first.ty && w.cols == first.cols);
        if on && same && PackedWeight::has_simd_kernel(Isa::best(), first.ty) {
            if let Some(p) = PackedWeight::pack_parts(&weights, Isa::best())? {
                self.joint = Joint::Packed(Arc::new(p));
                return Ok(());
            }
        }
        if !matches!(self.joint, Joint::Fused(_)) {
            let refs: Vec<&Linear> = self.parts.iter().collect();
            self.joint = Linear::fuse(&refs).map_or(Joint::Separate, Joint::Fused);
        }
        if on && matches!(self.joint, Joint::Separate) {
            for p in &mut self.parts {
                p.pack(true)?;
            }
        }
        Ok(())
    }

    fn is_packed(&self) -> bool {
        matches!(self.joint, Joint::Packed(_)) || self.parts.iter().any(Linear::is_packed)
    }

    /// The joint packed matrix, when the parts were packed as one.
    fn packed(&self) -> Option<&PackedWeight> {
        match &self.joint {
            Joint::Packed(p) => Some(p),
            _ => None,
        }
    }

    /// [`Stacked::forward`] of a norm's output as [`LlamaModel::norm_for`] left it.
    fn forward_normed(
        &self,
        normed: &Normed,
        xn: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
        scratch: &mut Vec<f32>,
    ) -> Result<(), WorkerError> {
        match (normed, self.packed()) {
            (Normed::Q8(acts), Some(p)) => Ok(p.matmul_parts_q8(outs, acts, n)?),
            (Normed::Q8(_), None) => {
                Err(WorkerError::InvalidBatch("quantised activations for an unpacked projection".into()))
            }
            (Normed::InXn, _) => self.forward(xn, n, outs, scratch),
        }
    }

    /// `x` is `[n, cols]`; writes part `i`'s output `[n, rows_i]` into `outs[i]`.
    /// `scratch` holds the joint output of a row-major fused matrix (the packed one
    /// writes each part's rows straight into its output).
    fn forward(&self, x: &[f32], n: usize, outs: &mut [&mut [f32]], scratch: &mut Vec<f32>) -> Result<(), WorkerError> {
        let total: usize = self.parts.iter().map(|p| p.rows).sum();
        match &self.joint {
            Joint::Separate => {
                for (w, out) in self.parts.iter().zip(outs.iter_mut()) {
                    w.matmul(out, x, n)?;
                }
                return Ok(());
            }
            // Each part's rows straight into its output.
            Joint::Packed(p) => {
                debug_assert!(
                    outs.len() == self.parts.len() && outs.iter().zip(&self.parts).all(|(o, p)| o.len() == n * p.rows)
                );
                return Ok(p.matmul_parts(outs, x, n)?);
            }
            Joint::Fused(w) => {
                scratch.resize(n * total, 0.0);
                w.matmul(scratch, x, n)?;
            }
        }
        for (t, row) in scratch.chunks_exact(total).enumerate() {
            let mut c0 = 0;
            for (out, p) in outs.iter_mut().zip(&self.parts) {
                let r = p.rows;
                out[t * r..(t + 1) * r].copy_from_slice(&row[c0..c0 + r]);
                c0 += r;
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
        Self::load_shard(files, None)
    }

    /// Loads this worker's part of the model (`None`: all of it); see [`crate::parallel`]
    /// for how tensor-parallel ranks split the weights.
    pub fn load_shard(files: Arc<ModelFiles>, shard: Option<Shard>) -> Result<Self, WorkerError> {
        let config = files.config()?;
        config.validate().map_err(tessera_model::error::ModelError::from)?;
        let shard = shard.unwrap_or_else(|| Shard::whole(config.num_layers));
        check_shard(&config, &shard)?;
        let w = WeightLoader::new(files.clone());
        let c = &config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q_dim, kv_dim) = (c.num_heads * hd, c.num_kv_heads * hd);
        let (q_heads, kv_heads) = shard::head_ranges(c.num_heads, c.num_kv_heads, shard.tp, shard.tp_rank);
        let (qr, kvr) = (q_heads.start * hd..q_heads.end * hd, kv_heads.start * hd..kv_heads.end * hd);
        let (h_rows, ffn_rows) = (shard.split(h), shard.split(c.intermediate_size));
        let embed_tokens = w.linear("token_embd.weight", c.vocab_size, h)?;
        let lm_head =
            if w.has("output.weight") { w.linear("output.weight", c.vocab_size, h)? } else { embed_tokens.clone() };
        let lm_head = shard::rows(&lm_head, shard.split(c.vocab_size))?;
        let mut layers = Vec::with_capacity(shard.layers.len());
        for i in shard.layers.clone() {
            let n = |s: &str| format!("blk.{i}.{s}");
            let bias = if c.qkv_bias {
                Some([
                    shard::slice_vec(&w.vector(&n("attn_q.bias"), q_dim)?, qr.clone())?,
                    shard::slice_vec(&w.vector(&n("attn_k.bias"), kv_dim)?, kvr.clone())?,
                    shard::slice_vec(&w.vector(&n("attn_v.bias"), kv_dim)?, kvr.clone())?,
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
                        shard::rows(&w.linear(&n("attn_q.weight"), q_dim, h)?, qr.clone())?,
                        shard::rows(&w.linear(&n("attn_k.weight"), kv_dim, h)?, kvr.clone())?,
                        shard::rows(&w.linear(&n("attn_v.weight"), kv_dim, h)?, kvr.clone())?,
                    ]),
                    o_proj: shard::rows(&w.linear(&n("attn_output.weight"), h, q_dim)?, h_rows.clone())?,
                    bias,
                    qk_norm,
                },
                post_attention_layernorm: w.vector(&n("ffn_norm.weight"), h)?,
                mlp: Mlp {
                    gate_up_proj: Stacked::new(vec![
                        shard::rows(&w.linear(&n("ffn_gate.weight"), c.intermediate_size, h)?, ffn_rows.clone())?,
                        shard::rows(&w.linear(&n("ffn_up.weight"), c.intermediate_size, h)?, ffn_rows.clone())?,
                    ]),
                    down_proj: shard::rows(&w.linear(&n("ffn_down.weight"), h, c.intermediate_size)?, h_rows.clone())?,
                },
            });
        }
        let freq_factors = if w.has("rope_freqs.weight") { Some(w.vector("rope_freqs.weight", hd / 2)?) } else { None };
        // llama.cpp's angle arithmetic where it has one (everything but Llama-3 scaling
        // from a config.json): the engine is checked against its output.
        let rope = match c.rope_scaling {
            None => rope_params(c, freq_factors)?.with_angles(rope::RopeAngles::Ggml)?,
            Some(_) => rope_params(c, freq_factors)?,
        };
        let rope_style = rope_style(c);
        let norm = w.vector("output_norm.weight", h)?;
        debug_assert!(matches!(c.arch, Arch::Llama | Arch::Qwen2 | Arch::Qwen3));
        let mut model = LlamaModel {
            config,
            shard,
            embed_tokens,
            layers,
            norm,
            lm_head,
            q_heads,
            kv_heads,
            rope,
            rope_style,
            _files: w.files().clone(),
            spare_logits: Mutex::new(Vec::new()),
            fast_path: false,
        };
        model.set_packed_kernels(packed_by_default())?;
        Ok(model)
    }

    /// Whether the layer and output matmuls take the packed kernels (`cpu::packed`:
    /// Q4_0/Q4_1/Q8_0 weights repacked sixteen rows side by side, about twice as fast on
    /// AVX2 and AVX-512 VNNI), with attention by the tiled f32-softmax kernel
    /// (`cpu::attention_tiled`) and norms summed over eight lanes (on CPUs with the packed
    /// kernels), or the row-major matmuls, the f16-accumulator attention and ggml's norm
    /// sums, which round exactly as llama.cpp's CPU kernels do
    /// (`tests/llama_cpp_agreement.rs`). Both are batch invariant; their outputs differ in
    /// the last bits. On by default (`TESSERA_CPU_PACKED=0` turns it off); packing copies
    /// the weights of those types once (the file's stay mapped).
    pub fn set_packed_kernels(&mut self, on: bool) -> Result<(), WorkerError> {
        // Only the last pipeline stage multiplies by the LM head.
        self.lm_head.pack(on && self.shard.is_last_stage())?;
        for layer in &mut self.layers {
            layer.self_attn.qkv_proj.set_packed(on)?;
            layer.mlp.gate_up_proj.set_packed(on)?;
            layer.self_attn.o_proj.pack(on)?;
            layer.mlp.down_proj.pack(on)?;
        }
        // The fast path with the packed kernels where this CPU has them: decided by the CPU
        // alone, so every shard of a replica (whatever weight types its layers hold) rounds
        // the same way as one worker would.
        self.fast_path = on && PackedWeight::has_simd_kernel(Isa::best(), GgmlType::Q8_0);
        Ok(())
    }

    /// Gives a step's logits buffer back for the next step's (see `spare_logits`).
    pub fn recycle_logits(&self, data: Vec<f32>) {
        let mut spare = self.spare_logits.lock().unwrap_or_else(|e| e.into_inner());
        if data.capacity() > spare.capacity() {
            *spare = data;
        }
    }

    /// Whether any matmul takes the packed kernels (see [`LlamaModel::set_packed_kernels`]).
    pub fn packed_kernels(&self) -> bool {
        self.lm_head.is_packed()
            || self.layers.iter().any(|l| {
                l.mlp.down_proj.is_packed()
                    || l.self_attn.o_proj.is_packed()
                    || l.mlp.gate_up_proj.is_packed()
                    || l.self_attn.qkv_proj.is_packed()
            })
    }

    /// Bytes of KV one block of `block_size` positions takes for this shard.
    pub fn kv_bytes_per_block(&self, block_size: usize) -> usize {
        KvCache::bytes_per_block(self.layers.len(), block_size, self.kv_heads.len(), self.config.head_dim)
    }

    /// A KV cache shaped for this model (this shard's layers and KV heads).
    pub fn new_kv_cache(&self, num_blocks: usize, block_size: usize) -> KvCache {
        KvCache::new(self.layers.len(), num_blocks, block_size, self.kv_heads.len(), self.config.head_dim)
    }

    /// Runs one step over `chunks`, writing their K/V into `kv`, and returns the logits
    /// each chunk asked for.
    pub fn forward(&self, chunks: &[SeqChunk], kv: &mut KvCache) -> Result<Logits, WorkerError> {
        self.forward_sharded(chunks, kv, &mut Comms::default())
    }

    /// [`LlamaModel::forward`] for a shard: gathers the tensor-parallel ranks' features
    /// through `comms.tp`, receives the residual stream from the previous pipeline stage
    /// and sends it on through `comms.pp`. A stage other than the last returns no logit
    /// rows (every chunk's span is empty).
    pub fn forward_sharded(
        &self,
        chunks: &[SeqChunk],
        kv: &mut KvCache,
        comms: &mut Comms,
    ) -> Result<Logits, WorkerError> {
        // An unsharded model runs the whole step on a thread of rayon's pool (the caller
        // waits once per step). Called from outside the pool, every parallel kernel of the
        // step (hundreds per decode step) would instead queue its work into the pool and put
        // the calling thread to sleep until it is done, a futex round trip each; from
        // inside, the caller takes its share of the work itself and at most wakes the other
        // threads (tg64 on 2 threads, 2-core AVX2 machine: 79-83 -> 100-102 tok/s, and the
        // matmul split threshold could drop, see kernels' matmul.rs). A shard stays outside:
        // its step blocks in collectives, and a pool thread blocked there while it waits in
        // a `join` could take up another rank's step of the same process (ranks as threads
        // in tests) and deadlock on it.
        if self.shard.tp == 1 && self.shard.stages == 1 {
            rayon::scope(|_| self.forward_step(chunks, kv, comms))
        } else {
            self.forward_step(chunks, kv, comms)
        }
    }

    /// [`LlamaModel::forward_sharded`]'s body.
    fn forward_step(&self, chunks: &[SeqChunk], kv: &mut KvCache, comms: &mut Comms) -> Result<Logits, WorkerError> {
        let c = &self.config;
        // Positions past the model's context are refused as on the GPUs: the CPU's RoPE
        // would place them, but attention's cost grows with them, so a run at a wild
        // position would hold the worker for minutes.
        crate::batch::validate_chunks(chunks, c.vocab_size, kv.num_blocks, kv.block_size, c.max_position.max(1))?;
        let sh = &self.shard;
        let sharded = sh.tp > 1;
        if (sharded && comms.tp.is_none()) || (sh.stages > 1 && comms.pp.is_none()) {
            return Err(WorkerError::Collective("a sharded model needs its tensor / pipeline collectives".into()));
        }
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (n_heads, n_kv) = (self.q_heads.len(), self.kv_heads.len());
        let (q_dim, kv_dim) = (n_heads * hd, n_kv * hd);
        let (q_full, ffn_full) = (c.num_heads * hd, c.intermediate_size);
        let ffn = ffn_full / sh.tp;
        let h_local = h / sh.tp;
        let t_total: usize = chunks.iter().map(|s| s.tokens.len()).sum();
        // Token positions of the stacked batch, `[T]`, and their RoPE angles (every
        // layer's q and k take the same).
        let positions: Vec<u32> =
            chunks.iter().flat_map(|s| (s.first_pos..s.first_pos + s.tokens.len()).map(|p| p as u32)).collect();
        let angles = prof::time(Op::Rope, || self.rope.table(&positions));

        let (sum, eps) = (if self.fast_path { SumOrder::Lanes } else { SumOrder::Ggml }, c.rms_norm_eps);
        // Each chunk as the attention kernels take it (the same for every layer).
        let seqs: Vec<attention::SeqSlice> = chunks
            .iter()
            .map(|s| attention::SeqSlice {
                block_table: s.block_table,
                first_pos: s.first_pos,
                n_tokens: s.tokens.len(),
            })
            .collect();

        // Residual stream, `[T, hidden]`: embedded here on the first stage, else received.
        let mut x = vec![0.0f32; t_total * h];
        if sh.is_first_stage() {
            let embed = self.embed_tokens.weight();
            prof::time(Op::Embed, || {
                for (row, &tok) in chunks.iter().flat_map(|s| s.tokens.iter()).enumerate() {
                    matmul::dequantize_rows(&embed, tok as usize, &mut x[row * h..(row + 1) * h])?;
                }
                Ok::<_, WorkerError>(())
            })?;
        } else if let Some(pp) = comms.pp.as_mut() {
            pp.recv(sh.stage - 1, &mut x)?;
        }

        let mut xn = vec![0.0f32; t_total * h];
        let mut q = vec![0.0f32; t_total * q_dim];
        let mut k = vec![0.0f32; t_total * kv_dim];
        let mut v = vec![0.0f32; t_total * kv_dim];
        let mut attn = vec![0.0f32; t_total * q_dim];
        let mut o = vec![0.0f32; t_total * h];
        let mut gate = vec![0.0f32; t_total * ffn];
        let mut up = vec![0.0f32; t_total * ffn];
        // Tensor parallel: the gathered attention output and SwiGLU output, this rank's
        // share of o / down outputs, and the all-gather's scratch.
        let (mut attn_full, mut act_full, mut part, mut gathered) = if sharded {
            (
                vec![0.0f32; t_total * q_full],
                vec![0.0f32; t_total * ffn_full],
                vec![0.0f32; t_total * h_local],
                Vec::new(),
            )
        } else {
            (Vec::new(), Vec::new(), Vec::new(), Vec::new())
        };
        // Output of a fused projection before it is split, `[T, sum of parts]`.
        let mut fused = Vec::new();

        for (li, layer) in self.layers.iter().enumerate() {
            let sa = &layer.self_attn;
            let normed = prof::time(Op::Norm, || {
                self.norm_for(&sa.qkv_proj, sum, &mut xn, &x, &layer.input_layernorm, t_total, eps)
            })?;
            prof::time(Op::Qkv, || {
                sa.qkv_proj.forward_normed(&normed, &xn, t_total, &mut [&mut q, &mut k, &mut v], &mut fused)?;
                if let Some([bq, bk, bv]) = &sa.bias {
                    activation::add_row_bias(&mut q, bq)?;
                    activation::add_row_bias(&mut k, bk)?;
                    activation::add_row_bias(&mut v, bv)?;
                }
                if let Some([nq, nk]) = &sa.qk_norm {
                    norm::rms_norm_inplace_with(sum, &mut q, nq, t_total * n_heads, eps)?;
                    norm::rms_norm_inplace_with(sum, &mut k, nk, t_total * n_kv, eps)?;
                }
                Ok::<_, WorkerError>(())
            })?;
            prof::time(Op::Rope, || {
                rope::rope_qk_with_table(&mut q, &mut k, t_total, n_heads, n_kv, hd, &angles, self.rope_style)
            })?;

            let cache = attention::PagedKv { block_size: kv.block_size, n_kv_heads: n_kv, head_dim: hd };
            // K/V of every chunk go into the cache first (each chunk writes only its own
            // new positions; shared prefix blocks are full and never written).
            prof::time(Op::KvWrite, || {
                let mut row = 0;
                for seq in &seqs {
                    let n = seq.n_tokens;
                    let (kr, vr) = (&k[row * kv_dim..(row + n) * kv_dim], &v[row * kv_dim..(row + n) * kv_dim]);
                    attention_f16::write_kv_f16(&cache, &mut kv.k[li], &mut kv.v[li], kr, vr, seq)?;
                    row += n;
                }
                Ok::<_, WorkerError>(())
            })?;
            let (k_cache, v_cache) = (&kv.k[li], &kv.v[li]);
            let scale = 1.0 / (hd as f32).sqrt();
            if self.fast_path {
                // Every chunk in one call, split over (token, kv group) units.
                prof::time(Op::Attention, || {
                    attention_tiled::attention_tiled(&cache, k_cache, v_cache, &mut attn, &q, &seqs, n_heads, scale)
                })?;
            } else {
                prof::time(Op::Attention, || {
                    attention_f16::attention_f16_batch(&cache, k_cache, v_cache, &mut attn, &q, &seqs, n_heads, scale)
                })?;
            }
            // The residual add: inside the projection's tasks unsharded, after the
            // all-gather sharded.
            prof::time(Op::OProj, || match comms.tp.as_deref_mut().filter(|_| sharded) {
                Some(tp) => {
                    gather_columns(tp, &attn, t_total, &mut attn_full, &mut gathered)?;
                    sa.o_proj.matmul(&mut part, &attn_full, t_total)?;
                    gather_columns(tp, &part, t_total, &mut o, &mut gathered)
                }
                None => sa.o_proj.matmul_add(&mut x, &attn, t_total, &mut o),
            })?;
            if sharded {
                prof::time(Op::Residual, || activation::add_inplace(&mut x, &o))?;
            }

            let normed = prof::time(Op::Norm, || {
                self.norm_for(&layer.mlp.gate_up_proj, sum, &mut xn, &x, &layer.post_attention_layernorm, t_total, eps)
            })?;
            prof::time(Op::GateUp, || {
                layer.mlp.gate_up_proj.forward_normed(&normed, &xn, t_total, &mut [&mut gate, &mut up], &mut fused)
            })?;
            // Unsharded on the fast path, SwiGLU writes the down projection's 8-bit
            // activations straight away (one pass for both).
            if let Some(down) = layer.mlp.down_proj.packed().filter(|_| self.fast_path && !sharded) {
                let acts = prof::time(Op::Swiglu, || activation::silu_mul_ggml_q8(&gate, &up, ffn))?;
                prof::time(Op::Down, || down.matmul_add_q8(&mut x, &acts, t_total))?;
                continue;
            }
            prof::time(Op::Swiglu, || activation::silu_mul_ggml_inplace(&mut gate, &up))?;
            prof::time(Op::Down, || match comms.tp.as_deref_mut().filter(|_| sharded) {
                Some(tp) => {
                    gather_columns(tp, &gate, t_total, &mut act_full, &mut gathered)?;
                    layer.mlp.down_proj.matmul(&mut part, &act_full, t_total)?;
                    gather_columns(tp, &part, t_total, &mut o, &mut gathered)
                }
                None => layer.mlp.down_proj.matmul_add(&mut x, &gate, t_total, &mut o),
            })?;
            if sharded {
                prof::time(Op::Residual, || activation::add_inplace(&mut x, &o))?;
            }
        }

        if !sh.is_last_stage() {
            if let Some(pp) = comms.pp.as_mut() {
                pp.send(sh.stage + 1, &x)?;
            }
            return Ok(Logits { vocab: c.vocab_size, data: Vec::new(), spans: vec![(0, 0); chunks.len()] });
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
        let data = prof::time(Op::Head, || {
            let mut seln = vec![0.0f32; sel.len()];
            norm::rms_norm_with(sum, &mut seln, &sel, &self.norm, picked.len(), eps)?;
            // Every value is written below (the LM head's output); a recycled buffer keeps
            // its old values until then.
            let mut data = std::mem::take(&mut *self.spare_logits.lock().unwrap_or_else(|e| e.into_inner()));
            data.resize(picked.len() * c.vocab_size, 0.0);
            if !picked.is_empty() {
                match comms.tp.as_deref_mut().filter(|_| sharded) {
                    Some(tp) => {
                        let mut local = vec![0.0f32; picked.len() * self.lm_head.rows];
                        self.lm_head.matmul(&mut local, &seln, picked.len())?;
                        gather_columns(tp, &local, picked.len(), &mut data, &mut gathered)?;
                    }
                    None => self.lm_head.matmul(&mut data, &seln, picked.len())?,
                }
            }
            Ok::<_, WorkerError>(data)
        })?;
        Ok(Logits { vocab: c.vocab_size, data, spans })
    }
}

impl LlamaModel {
    /// A layer's RMSNorm of `x` for the projection `proj` after it: on the fast path, with
    /// `proj` packed, straight into its 8-bit activations (`norm::rms_norm_q8`); else into
    /// `xn`.
    #[allow(clippy::too_many_arguments)]
    fn norm_for(
        &self,
        proj: &Stacked,
        sum: SumOrder,
        xn: &mut [f32],
        x: &[f32],
        w: &[f32],
        n: usize,
        eps: f32,
    ) -> Result<Normed, WorkerError> {
        if self.fast_path && proj.packed().is_some() {
            return Ok(Normed::Q8(norm::rms_norm_q8(sum, x, w, n, eps)?));
        }
        norm::rms_norm_with(sum, xn, x, w, n, eps)?;
        Ok(Normed::InXn)
    }
}

/// The RoPE of `c`: Llama-3 scaling from an HF config, or a GGUF's precomputed
/// `rope_freqs.weight` factors when the file has them. Shared by the CPU and CUDA models.
pub(crate) fn rope_params(c: &ModelConfig, freq_factors: Option<Vec<f32>>) -> Result<rope::RopeParams, WorkerError> {
    Ok(rope::RopeParams::new(
        c.head_dim,
        c.rope_theta,
        c.rope_scaling.as_ref().map(|s| rope::Llama3Scaling {
            factor: s.factor,
            low_freq_factor: s.low_freq_factor,
            high_freq_factor: s.high_freq_factor,
            original_max_position: s.original_max_position,
        }),
        freq_factors,
    )?)
}

/// The kernels' name for `c`'s rotation layout.
pub(crate) fn rope_style(c: &ModelConfig) -> rope::RopeStyle {
    match c.rope_style {
        RopeStyle::Interleaved => rope::RopeStyle::Interleaved,
        RopeStyle::Neox => rope::RopeStyle::Neox,
    }
}

/// Refuses a shard this model cannot be split into (the coordinator's placement checks
/// the same; a worker does not trust its Load request).
fn check_shard(c: &ModelConfig, s: &Shard) -> Result<(), WorkerError> {
    let bad = |why: String| Err(WorkerError::InvalidBatch(format!("shard {s:?}: {why}")));
    if s.tp == 0 || s.tp_rank >= s.tp || s.stages == 0 || s.stage >= s.stages {
        return bad("rank out of range".into());
    }
    if s.layers.start > s.layers.end || s.layers.end > c.num_layers || s.layers.is_empty() {
        return bad(format!("layers outside 0..{}", c.num_layers));
    }
    let kv_ok = c.num_kv_heads.is_multiple_of(s.tp) || s.tp.is_multiple_of(c.num_kv_heads);
    for (what, n) in [
        ("attention heads", c.num_heads),
        ("hidden size", c.hidden_size),
        ("FFN size", c.intermediate_size),
        ("vocabulary", c.vocab_size),
    ] {
        if n % s.tp != 0 {
            return bad(format!("{what} {n} not divisible by tp {}", s.tp));
        }
    }
    if !kv_ok {
        return bad(format!("{} KV heads cannot be split or replicated over tp {}", c.num_kv_heads, s.tp));
    }
    Ok(())
}
