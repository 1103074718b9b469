//! The Llama-family forward pass on one AMD GPU: the CUDA backend's step (cuda/forward.rs's
//! `run_layers`) over the HIP launchers of the same kernel sources, without what HIP lacks
//! or does not need yet: no graphs, no tensor or pipeline parallelism, no GPU sampler (the
//! logits come back to the host and the executor samples them with the CPU sampler,
//! crate::sampling, as for the CPU backend).
//!
//! Shared with CUDA rather than copied: the weight loader (GGUF dequantised to bf16 on the
//! host, `GpuWeights::load` over [`GpuStore`]), the step's activations (`Scratch`), the KV
//! cache's layout and sizing (`GpuKv`, `kv_blocks_in`) and the step index
//! (crate::step_index). Per layer: add + RMSNorm, the q|k|v GEMM (rocBLAS), `qkv_rope_write`,
//! attention.cu's portable paged kernel (prefill, decode and mixed batches alike), the o GEMM,
//! add + RMSNorm, the gate|up GEMM, SwiGLU, the down GEMM; the LM head writes f32 logits.
//!
//! Nothing here has run on an AMD GPU (none was available): it compiles, its host logic is
//! CUDA's, and each launcher has a GPU test (kernels/tests/hip_*.rs) that needs
//! TESSERA_HIP_TESTS=1.

use tessera_kernels::cpu::attention::PagedKv;
use tessera_kernels::cpu::rope::RopeParams;
use tessera_kernels::cuda::ModuleCache;
use tessera_kernels::hip::attention::{paged_attention, PagedInputs};
use tessera_kernels::hip::ops::{add_rms_norm, embedding, rms_norm, silu_mul_packed};
use tessera_kernels::hip::qkv::qkv_rope_write;
use tessera_kernels::hip::{bf16, Blas, DevBuf, Device, RopeTable};
use tessera_model::config::ModelConfig;
use tessera_model::weights::ModelFiles;

use crate::batch::{validate_chunks, Logits, SeqChunk};
use crate::cuda::{kv_blocks_in, rope_positions, CudaOptions, GpuKv, GpuWeights, Scratch, TpPart};
use crate::error::WorkerError;
use crate::gpu_store::GpuStore;
use crate::step_index::{rows_of, spans_of, HostIndex};

/// Head dims attention.cu's portable kernel is instantiated for.
pub const HEAD_DIMS: [usize; 2] = [64, 128];

type Buf = DevBuf<bf16>;

impl GpuStore for Device {
    type Buf = Buf;
    type Rope = RopeTable;

    fn put(&self, host: &[bf16]) -> Result<Buf, WorkerError> {
        Ok(self.upload(host)?)
    }

    fn zeros(&self, len: usize) -> Result<Buf, WorkerError> {
        Ok(self.alloc(len)?)
    }

    fn rope_table(&self, params: &RopeParams, positions: usize) -> Result<RopeTable, WorkerError> {
        Ok(RopeTable::new(self, params, positions)?)
    }
}

/// A model on one AMD GPU with its paged KV cache: the HIP backend of the executor.
pub struct HipModel {
    dev: Device,
    blas: Blas,
    config: ModelConfig,
    w: GpuWeights<Buf, RopeTable>,
    kv: GpuKv<Buf>,
    /// The last step's activations, index arrays and logits, kept for the next step (reused
    /// where it has the same sizes).
    scratch: Option<Scratch<Buf>>,
    index: Option<DevIndex>,
    logits: Option<DevBuf<f32>>,
}

/// A step's index arrays on the device.
struct DevIndex {
    ids: DevBuf<u32>,
    positions: DevBuf<u32>,
    slots: DevBuf<u32>,
    tables: DevBuf<u32>,
    ctx: DevBuf<u32>,
    cu_q: DevBuf<u32>,
}

impl DevIndex {
    /// `h` on the device, in `old`'s buffers where their lengths match (a run of decode steps
    /// of one batch size allocates nothing). Overwriting them is safe: every step ends with
    /// the stream drained (the logits' download, or a synchronize).
    fn fill(dev: &Device, old: Option<DevIndex>, h: &HostIndex) -> Result<Self, WorkerError> {
        let mut o = old.map(|o| [o.ids, o.positions, o.slots, o.tables, o.ctx, o.cu_q].map(Some));
        let mut put = |i: usize, host: &[u32]| reuse(dev, o.as_mut().and_then(|o| o[i].take()), host);
        Ok(DevIndex {
            ids: put(0, &h.ids)?,
            positions: put(1, &h.positions)?,
            slots: put(2, &h.slots)?,
            tables: put(3, &h.tables)?,
            ctx: put(4, &h.ctx)?,
            cu_q: put(5, &h.cu_q)?,
        })
    }
}

/// `host` on the device: written into `old` when it is as long, else uploaded anew.
fn reuse(dev: &Device, old: Option<DevBuf<u32>>, host: &[u32]) -> Result<DevBuf<u32>, WorkerError> {
    match old {
        Some(mut b) if b.len() == host.len() => {
            dev.write(&mut b, host)?;
            Ok(b)
        }
        _ => Ok(dev.upload(host)?),
    }
}

/// Why `c` cannot run on this backend, if it cannot.
pub fn unsupported(c: &ModelConfig) -> Option<String> {
    (!HEAD_DIMS.contains(&c.head_dim))
        .then(|| format!("head_dim {}: the HIP attention kernel is built for {HEAD_DIMS:?}", c.head_dim))
}

impl HipModel {
    /// Loads `files` onto AMD GPU `opts.device` (its kernel modules compiled by hipRTC or read
    /// from the module cache first); the KV cache is sized as the CUDA backend sizes it
    /// (`opts.graph_max_batch` is not used).
    pub fn load(files: &ModelFiles, opts: &CudaOptions) -> Result<Self, WorkerError> {
        let config = files.config()?;
        config.validate().map_err(tessera_model::error::ModelError::from)?;
        if let Some(why) = unsupported(&config) {
            return Err(WorkerError::Unavailable(why));
        }
        let mut dev = Device::new(opts.device).map_err(super::worker_error)?;
        dev.load_modules(&ModuleCache::default_location())?;
        let blas = Blas::new(&dev)?;
        let w = GpuWeights::load(&dev, &config, &TpPart::whole(&config), files)?;
        let free = if opts.num_blocks.is_some() { 0 } else { dev.memory_info()?.0 };
        let num_blocks = kv_blocks_in(free, &config, opts)?;
        let per_layer = num_blocks * opts.block_size * config.num_kv_heads * config.head_dim;
        let mut kv = GpuKv { k: Vec::new(), v: Vec::new(), num_blocks, block_size: opts.block_size };
        for _ in 0..config.num_layers {
            kv.k.push(dev.alloc(per_layer)?);
            kv.v.push(dev.alloc(per_layer)?);
        }
        dev.synchronize()?;
        Ok(HipModel { dev, blas, config, w, kv, scratch: None, index: None, logits: None })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Whether the GPU context is unusable (see `Backend::context_lost`; synchronised, not
    /// polled: a HIP model is never split over GPUs, so nothing queued waits on a peer).
    pub fn context_lost(&self) -> bool {
        self.dev.synchronize().is_err_and(|e| e.context_lost())
    }

    /// The GPU in words: name, ordinal, arch.
    pub fn describe(&self) -> String {
        format!("{} (AMD GPU {}, {})", self.dev.name(), self.dev.ordinal(), self.dev.arch())
    }

    pub fn num_blocks(&self) -> usize {
        self.kv.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.kv.block_size
    }

    /// Runs one step over `chunks`, writing their K/V, and returns the logits asked for.
    pub fn forward(&mut self, chunks: &[SeqChunk]) -> Result<Logits, WorkerError> {
        let vocab = self.config.vocab_size;
        validate_chunks(chunks, vocab, self.kv.num_blocks, self.kv.block_size, rope_positions(&self.config))?;
        let h = HostIndex::build(chunks, self.kv.block_size);
        let t = h.ids.len();
        if t == 0 {
            return Ok(Logits { vocab, data: Vec::new(), spans: spans_of(&h.picked) });
        }
        let d = &self.dev;
        let idx = DevIndex::fill(d, self.index.take(), &h)?;
        let mut s = match self.scratch.take() {
            Some(s) if s.t == t => s,
            _ => Scratch::new(d, &self.config, t)?,
        };
        let r = self.run_layers(&mut s, &idx).and_then(|()| self.lm_head(&s, &h));
        (self.scratch, self.index) = (Some(s), Some(idx));
        Ok(Logits { vocab, data: r?, spans: spans_of(&h.picked) })
    }

    /// Every decoder layer and the final norm over `s.t` tokens, K/V into the cache.
    fn run_layers(&mut self, s: &mut Scratch<Buf>, idx: &DevIndex) -> Result<(), WorkerError> {
        let (d, w, c, blas) = (&self.dev, &self.w, &self.config, &self.blas);
        let (hidden, hd, ffn, t) = (c.hidden_size, c.head_dim, c.intermediate_size, s.t);
        let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
        let eps = c.rms_norm_eps;
        let cache = PagedKv { block_size: self.kv.block_size, n_kv_heads: c.num_kv_heads, head_dim: hd };
        let embed = w.embed.as_ref().ok_or_else(|| WorkerError::InvalidBatch("no embedding loaded".into()))?;
        embedding(d, &mut s.x, embed, &idx.ids, hidden)?;
        for (li, l) in w.layers.iter().enumerate() {
            if li == 0 {
                rms_norm(d, &mut s.xn, &s.x, &l.attn_norm, t, eps)?;
            } else {
                add_rms_norm(d, &mut s.xn, &mut s.x, &s.out, &l.attn_norm, t, eps)?;
            }
            blas.gemm(d, &mut s.qkv, &s.xn, &l.qkv, (t, qd + 2 * kvd, hidden))?;
            let prep = w.qkv_prep(c, l, &s.qkv, t, &idx.positions, &idx.slots);
            let (k_cache, v_cache) = (&mut self.kv.k[li], &mut self.kv.v[li]);
            qkv_rope_write(d, &mut s.q, k_cache, v_cache, &cache, &prep)?;
            let paged = PagedInputs {
                k_cache,
                v_cache,
                block_tables: &idx.tables,
                context_lens: &idx.ctx,
                cu_q: &idx.cu_q,
                block_size: cache.block_size,
                n_kv: c.num_kv_heads,
                head_dim: hd,
            };
            paged_attention(d, &mut s.attn, &s.q, &paged, c.num_heads, 1.0 / (hd as f32).sqrt())?;
            blas.gemm(d, &mut s.out, &s.attn, &l.o, (t, hidden, qd))?;
            add_rms_norm(d, &mut s.xn, &mut s.x, &s.out, &l.ffn_norm, t, eps)?;
            blas.gemm(d, &mut s.gate_up, &s.xn, &l.gate_up, (t, 2 * ffn, hidden))?;
            silu_mul_packed(d, &mut s.act, &s.gate_up, t)?;
            blas.gemm(d, &mut s.out, &s.act, &l.down, (t, hidden, ffn))?;
        }
        // The last sublayer's residual add, normalised for the head.
        add_rms_norm(d, &mut s.xn, &mut s.x, &s.out, &w.norm, t, eps)?;
        Ok(())
    }

    /// The LM head over the wanted rows of the final activations: `[rows, vocab]` f32 on the
    /// host.
    fn lm_head(&mut self, s: &Scratch<Buf>, h: &HostIndex) -> Result<Vec<f32>, WorkerError> {
        let (d, c) = (&self.dev, &self.config);
        let rows = rows_of(&h.picked);
        if rows == 0 {
            d.synchronize()?;
            return Ok(Vec::new());
        }
        let head = self.w.lm_head.as_ref().or(self.w.embed.as_ref());
        let head = head.ok_or_else(|| WorkerError::InvalidBatch("no LM head loaded".into()))?;
        let picked;
        let sel = if rows == s.t {
            &s.xn
        } else {
            let mut buf = d.alloc::<bf16>(rows * c.hidden_size)?;
            let mut at = 0;
            for &(first, n) in &h.picked {
                d.copy_rows(&mut buf, at, &s.xn, first, n, c.hidden_size)?;
                at += n;
            }
            picked = buf;
            &picked
        };
        let mut logits = match self.logits.take() {
            Some(l) if l.len() == rows * c.vocab_size => l,
            _ => d.alloc::<f32>(rows * c.vocab_size)?,
        };
        let r = self.blas.gemm_f32(d, &mut logits, sel, head, (rows, c.vocab_size, c.hidden_size));
        let data = r.and_then(|()| d.download(&logits));
        self.logits = Some(logits);
        Ok(data?)
    }
}
