//! The Llama-family forward pass on the CUDA kernels, over a paged bf16 KV cache in GPU
//! memory. Same batch semantics as the CPU model (`crate::llama`): all chunks' tokens are
//! stacked into one `[T, hidden]` activation so every weight is streamed once per step;
//! attention reads each sequence's own block table.
//!
//! Per layer: `add_rms_norm` (the previous sublayer's residual add fused with this norm),
//! the q|k|v GEMM, `qkv_rope_write` (bias, Qwen3 QK-norm, RoPE, K/V into the cache, in one
//! kernel), paged attention (split-KV decode when every chunk is one token, else the
//! causal prefill kernel, which handles mixed batches), the o GEMM, `add_rms_norm`, the
//! gate|up GEMM, SwiGLU, the down GEMM. The residual stream is bf16, as in HF's bf16
//! models. Logits come out of the LM head GEMM in f32. Without tensor parallelism, unfused
//! steps of [`SPLIT_MIN_ROWS`] to [`SPLIT_MAX_ROWS`] tokens split the o and down GEMMs'
//! inner dimension (f32 partials, which `add_parts_rms_norm` after them sums and rounds as
//! the GEMM's bf16 output would be).
//!
//! Steps of at most [`FUSED_MAX_ROWS`] tokens (small decode batches) fold the small steps
//! into the GEMVs instead (`gemv_fused.rs` in the kernels): norm + qkv (for Llama-style
//! models also RoPE and the K/V write: no `qkv_rope_write`), attention, o + residual add,
//! norm + gate|up + SwiGLU, down + residual add; three or four kernels fewer per layer, the
//! unfused path's values within bf16 rounding (the norms are factored out of the GEMV sums).
//!
//! Tensor parallel (see `tp.rs`): every shape here is this rank's (its heads, KV heads and
//! FFN slice), and the o and down GEMMs' partial sums are all-reduced over NCCL before the
//! `add_rms_norm` that consumes them (fused path: the all-reduce adds them into the residual
//! stream itself). Every rank runs the same steps in the same order (the
//! same eager kernels, the same graph buckets, captured in the same order), so their
//! collectives pair up.
//!
//! Activations live in a [`Scratch`] sized for the step's token count and kept for reuse.
//! Decode steps (one token per sequence, up to [`MAX_GRAPH_BATCH`] sequences) replay a
//! CUDA graph captured at load for the next larger batch bucket: its inputs are fixed
//! buffers overwritten before each replay (padding rows have context 0 and write no K/V),
//! so such a step is two host-to-device copies from page-locked memory (the ids,
//! positions, slots and context lengths packed together, which the graph's first kernel
//! splits; the block-table entries that changed) and one launch.

use std::time::{Duration, Instant};

use tessera_kernels::cpu::attention::PagedKv;
use tessera_kernels::cuda::{
    bf16, Buf, Completion, Copy2d, DecodeWorkspace, Device, Graph, HostStage, Marks, PagedBatch,
};
use tessera_model::config::ModelConfig;

use crate::batch::{validate_chunks, Logits, SeqChunk};
use crate::error::WorkerError;
use crate::gpu_store::GpuStore;
use crate::step_index::{check_from_sampled, flag_from_sampled, rows_of, slot_of, spans_of, update_mirror, HostIndex};

use super::allreduce::TpAllReduce;
use super::sampler::{GpuSampler, QueuedSample, RowRequest};
use super::tp::TpPart;
use super::weights::{rope_positions, GpuWeights};
use super::Comms;
use crate::sampling::{Sampled, SamplingError};

/// Decode-attention scratch: (sequence, head, split) rows for this many sequence-splits
/// per head (e.g. one sequence in 512 splits, or 64 in 8).
const DECODE_SPLIT_ROWS: usize = 512;
/// Largest step (tokens) that runs the fused GEMVs: all the GEMV takes. H200, synthetic
/// Llama-3-8B decode (`tessera bench`): fused vs `TESSERA_FUSED_GEMV=0` 234 vs 221 tok/s at 1
/// sequence, 449 vs 423 at 2, 869 vs 835 at 4; at 5 and 8 sequences, since the norm is
/// factored out of the GEMV sum, fused vs `TESSERA_FUSED_MAX_ROWS=4` 1075-1086 vs 1016-1025
/// and 1706-1721 vs 1612-1622 (bench/RESULTS.md, 2026-12-03). Before that, 8 rows fused were
/// slower (1619 vs 1655): every CTA waited for the norm of 8 rows.
const FUSED_MAX_ROWS: usize = 8;
/// [`Core::fused_max_rows`] from the environment (see there).
fn fused_max_rows() -> usize {
    if std::env::var("TESSERA_FUSED_GEMV").as_deref() == Ok("0") {
        return 0;
    }
    std::env::var("TESSERA_FUSED_MAX_ROWS").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(FUSED_MAX_ROWS)
}

/// Unfused steps of at most this many tokens run the o and down GEMMs with their inner
/// dimension split in [`SPLIT_K`] chunks (f32 partials summed by the `add_parts_rms_norm`
/// after them; not under tensor parallelism, whose all-reduce sums bf16 outputs). H200,
/// Llama-3-8B shapes (bench/gpu/split_gemm.cu): o 12.6 -> 10.6 µs at 16 tokens, 11.7 -> 11.2
/// at 64, 16.3 -> 15.1 at 256; down 31.9 -> 30.1, 35.1 -> 32.6, 48.3 -> 44.7. Model
/// (`tessera bench`, llama-3-8b-v49k, two calls): +1.8% at 16 sequences, +0.7% at 64, +1.1%
/// at 128.
const SPLIT_MAX_ROWS: usize = 256;
/// The smallest split step: up to 8 tokens the plain GEMV (gemv.rs) streams W faster than
/// any cuBLASLt GEMM (unfused steps that small run when `TESSERA_FUSED_MAX_ROWS` is lower, or
/// the fused GEMVs do not fit a model). 9-15 tokens were not timed split; 16 is the smallest
/// measured step, and split it gains.
const SPLIT_MIN_ROWS: usize = 9;
/// Only weights of at least this many values split: SmolLM2's (576 x 576, 576 x 1536) GEMMs
/// are latency-bound, and split they served 4-7% fewer tokens at 16 sessions. Tests lower
/// it with [`CudaModel::set_split_min_weight`].
const SPLIT_MIN_WEIGHT: usize = 4096 * 4096;
/// Chunks of the split GEMMs; `TESSERA_SPLIT_K` overrides it (1: no split) for A/B runs.
const SPLIT_K: usize = 2;
/// [`SPLIT_K`], or `TESSERA_SPLIT_K` (at most the kernels' limit).
fn split_k() -> usize {
    let k = std::env::var("TESSERA_SPLIT_K").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(SPLIT_K);
    k.min(tessera_kernels::cuda::MAX_SPLITS)
}

/// Activation sets kept for reuse (one per recent step size).
const SCRATCH_KEPT: usize = 4;
/// Decode batch sizes with a captured graph; a batch runs in the smallest that holds it.
const GRAPH_BUCKETS: &[usize] = &[1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256];
/// The largest decode batch replayed from a graph; larger ones launch kernel by kernel.
pub const MAX_GRAPH_BATCH: usize = 256;
/// Longest context a graph serves (its block tables are this wide); longer sequences'
/// steps launch kernel by kernel.
const GRAPH_MAX_CONTEXT: usize = 8192;

/// One layer's K and V caches, `[num_blocks, block_size, n_kv_heads, head_dim]` bf16.
pub(crate) struct GpuKv<B = Buf<bf16>> {
    pub k: Vec<B>,
    pub v: Vec<B>,
    pub num_blocks: usize,
    pub block_size: usize,
}

/// Activations of a step of `t` tokens (`B`: the device's bf16 buffer; HIP's forward pass
/// uses the same set).
pub(crate) struct Scratch<B = Buf<bf16>> {
    pub t: usize,
    /// Residual stream and its normalised copy, `[t, hidden]`.
    pub x: B,
    pub xn: B,
    /// `[t, q + 2 kv]`.
    pub qkv: B,
    /// Rotated queries and attention output, `[t, n_heads * head_dim]`.
    pub q: B,
    pub attn: B,
    /// Sublayer output before its residual add, `[t, hidden]`.
    pub out: B,
    /// `[t, 2 ffn]` and `[t, ffn]`.
    pub gate_up: B,
    pub act: B,
}

impl<B> Scratch<B> {
    pub(crate) fn new<D: GpuStore<Buf = B>>(dev: &D, c: &ModelConfig, t: usize) -> Result<Self, WorkerError> {
        let (h, qd, kvd, ffn) =
            (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size);
        Ok(Scratch {
            t,
            x: dev.zeros(t * h)?,
            xn: dev.zeros(t * h)?,
            qkv: dev.zeros(t * (qd + 2 * kvd))?,
            q: dev.zeros(t * qd)?,
            attn: dev.zeros(t * qd)?,
            out: dev.zeros(t * h)?,
            gate_up: dev.zeros(t * 2 * ffn)?,
            act: dev.zeros(t * ffn)?,
        })
    }
}

impl Scratch {
    /// Device bytes per token of a scratch set.
    pub(crate) fn bytes_per_token(c: &ModelConfig) -> usize {
        let (h, qd, kvd, ffn) =
            (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size);
        2 * (3 * h + qd + 2 * kvd + 2 * qd + 3 * ffn)
    }
}

/// Step buffers shared by every step size (steps run one at a time on the stream, so the
/// eager steps and every decode graph use the same ones).
struct Workspaces {
    decode: DecodeWorkspace,
    /// The split GEMMs' partials (`None`: no split, see [`SPLIT_MAX_ROWS`]).
    split: Option<SplitParts>,
}

/// f32 partial outputs of the o and down GEMMs split in `splits` chunks, room for
/// [`SPLIT_MAX_ROWS`] tokens; which of the two split.
struct SplitParts {
    splits: usize,
    o: bool,
    down: bool,
    buf: Buf<f32>,
}

impl SplitParts {
    /// The partials' buffer when this rank splits its o or down GEMM: no tensor
    /// parallelism (its all-reduce sums bf16 outputs), `splits` > 1, a weight of at least
    /// `min_weight` values whose inner dimension (attention width, FFN width) cuts into
    /// chunks of a multiple of 8 values.
    fn new(
        dev: &Device,
        c: &ModelConfig,
        comms: &Comms,
        splits: usize,
        min_weight: usize,
    ) -> Result<Option<Self>, WorkerError> {
        let h = c.hidden_size;
        let splits_ok = |cols: usize| cols.is_multiple_of(8 * splits) && cols * h >= min_weight;
        let (o, down) = (splits_ok(c.num_heads * c.head_dim), splits_ok(c.intermediate_size));
        if comms.tp.is_some() || splits < 2 || !(o || down) {
            return Ok(None);
        }
        Ok(Some(SplitParts { splits, o, down, buf: dev.alloc::<f32>(splits * SPLIT_MAX_ROWS * h)? }))
    }

    /// Whether `which`'s projection splits.
    fn splits(&self, which: Sublayer) -> bool {
        match which {
            Sublayer::Attention => self.o,
            Sublayer::Ffn => self.down,
        }
    }
}

/// The step's index data, uploaded once and read by the kernels of every layer.
struct StepIndex {
    ids: Buf<u32>,
    positions: Buf<u32>,
    slots: Buf<u32>,
    block_tables: Buf<u32>,
    max_blocks: usize,
    context_lens: Buf<u32>,
    /// Prefill only: `[num_seqs + 1]` query offsets.
    cu_q: Option<Buf<u32>>,
    max_context: usize,
    max_q: usize,
    /// `(first row, rows)` of the stacked batch whose logits are wanted, per chunk.
    picked: Vec<(usize, usize)>,
}

/// Host copies of a graph's padded inputs, in page-locked memory (kept to avoid allocating
/// per step; a copy from it is only queued, see `tessera_kernels::cuda::HostStage`).
struct GraphHost {
    b: usize,
    /// `[4, b]` then `[b, max_blocks]`. The first part: token ids, positions, cache slots,
    /// context lengths, uploaded in one copy into the graph's `packed` buffer and split by
    /// its first kernel. The second: the device's block tables as last uploaded.
    stage: HostStage<u32>,
    /// False after a failed upload: the mirror may be ahead of the device, so the next
    /// step rewrites it (and so uploads every used entry) before comparing.
    tables_valid: bool,
}

/// A decode step of up to `b` sequences, captured: fixed inputs, activations and logits.
struct DecodeGraph {
    b: usize,
    idx: StepIndex,
    host: GraphHost,
    /// `[4, b]`: the step's packed inputs on the device (see [`GraphHost::stage`]).
    packed: Buf<u32>,
    /// The activations the graph reads and writes: owned here so they live as long as it.
    _scratch: Scratch,
    /// `[b, vocab]` (one element on a pipeline stage before the last).
    logits: Buf<f32>,
    /// The vocab-parallel head's buffers the graph reads and writes.
    _vocab: Option<VocabScratch>,
    graph: Graph,
}

/// A vocab-parallel LM head's buffers for `rows` rows: this rank's logits `[rows, vocab /
/// tp]` and every rank's, gathered `[tp, rows, vocab / tp]`.
struct VocabScratch {
    rows: usize,
    local: Buf<f32>,
    gathered: Buf<f32>,
}

impl VocabScratch {
    /// The buffers for `rows` rows when `core` splits the vocabulary, else `None`.
    fn new(core: &Core, rows: usize) -> Result<Option<Self>, WorkerError> {
        if !core.vocab_split() || !core.part.is_last_stage() {
            return Ok(None);
        }
        let vp = core.part.vocab.len();
        Ok(Some(VocabScratch {
            rows,
            local: core.dev.alloc(rows * vp)?,
            gathered: core.dev.alloc(core.part.tp * rows * vp)?,
        }))
    }
}

impl StepIndex {
    /// Fixed input buffers of a `b`-row decode graph with tables `max_blocks` wide, the
    /// packed `[4, b]` upload they are split from, and the host arrays that fill them.
    fn fixed(
        dev: &Device,
        b: usize,
        max_blocks: usize,
        block_size: usize,
    ) -> Result<(Self, Buf<u32>, GraphHost), WorkerError> {
        let mut host = GraphHost { b, stage: dev.alloc_stage(4 * b + b * max_blocks)?, tables_valid: true };
        // Padding rows: slot u32::MAX (no K/V write), context 0.
        host.stage.as_mut_slice()?[2 * b..3 * b].fill(u32::MAX);
        let mut packed = dev.alloc(4 * b)?;
        dev.write_staged(&mut packed, &host.stage, 0)?;
        let idx = StepIndex {
            ids: dev.alloc(b)?,
            positions: dev.alloc(b)?,
            slots: dev.upload(&vec![u32::MAX; b])?,
            block_tables: dev.alloc(b * max_blocks)?,
            max_blocks,
            context_lens: dev.alloc(b)?,
            cu_q: None,
            max_context: max_blocks * block_size,
            max_q: 1,
            picked: (0..b).map(|i| (i, 1)).collect(),
        };
        Ok((idx, packed, host))
    }

    /// Writes a decode batch (one token per chunk, `chunks.len() <= b`) into a graph's
    /// inputs; rows past the batch are padding. The ids, positions, slots and context
    /// lengths go up in one copy into `packed` (the graph splits it). The stage's tail
    /// mirrors the device's block tables, so only the block of entries that changed is
    /// uploaded, one strided copy ([`update_mirror`]: a decode step usually appends a block
    /// to a few sequences; entries past a row's context are never read). Returns the time
    /// the copies took.
    fn refill(
        &mut self,
        dev: &Device,
        host: &mut GraphHost,
        packed: &mut Buf<u32>,
        chunks: &[SeqChunk],
        from_sampled: &[Option<u32>],
        block_size: usize,
    ) -> Result<Duration, WorkerError> {
        let (mb, b) = (self.max_blocks, host.b);
        let (inputs, mirror) = host.stage.as_mut_slice()?.split_at_mut(4 * b);
        let (ids, rest) = inputs.split_at_mut(b);
        let (positions, rest) = rest.split_at_mut(b);
        let (slots, ctx) = rest.split_at_mut(b);
        ids.fill(0);
        positions.fill(0);
        slots.fill(u32::MAX);
        ctx.fill(0);
        for (i, s) in chunks.iter().enumerate() {
            let p = s.first_pos;
            ids[i] = s.tokens[0];
            positions[i] = p as u32;
            slots[i] = slot_of(s.block_table, p, block_size);
            ctx[i] = (p + 1) as u32;
        }
        flag_from_sampled(ids, from_sampled, |i| i);
        if !host.tables_valid {
            // Differs from every real table: every used entry changes.
            mirror.fill(u32::MAX);
            host.tables_valid = true;
        }
        let delta = update_mirror(mirror, mb, chunks, block_size);
        let t = Instant::now();
        let copies = (|| {
            dev.write_staged(packed, &host.stage, 0)?;
            let Some(d) = delta else { return Ok(()) };
            let block = Copy2d::block(mb, d.rows, d.cols);
            // The mirror starts after the packed inputs in the stage.
            dev.write_2d(&mut self.block_tables, &host.stage, &Copy2d { src_at: block.src_at + 4 * b, ..block })
        })();
        if let Err(e) = copies {
            host.tables_valid = false;
            return Err(e.into());
        }
        Ok(t.elapsed())
    }

    /// An eager step's index; chunks with a `from_sampled` row get flagged ids.
    fn build(
        dev: &Device,
        chunks: &[SeqChunk],
        from_sampled: &[Option<u32>],
        block_size: usize,
    ) -> Result<Self, WorkerError> {
        let mut h = HostIndex::build(chunks, block_size);
        flag_from_sampled(&mut h.ids, from_sampled, |i| h.cu_q[i] as usize);
        let all_decode = h.max_q == 1;
        Ok(StepIndex {
            ids: dev.upload(&h.ids)?,
            positions: dev.upload(&h.positions)?,
            slots: dev.upload(&h.slots)?,
            block_tables: dev.upload(&h.tables)?,
            max_blocks: h.max_blocks,
            max_context: h.max_context(),
            context_lens: dev.upload(&h.ctx)?,
            cu_q: if all_decode { None } else { Some(dev.upload(&h.cu_q)?) },
            max_q: h.max_q,
            picked: h.picked,
        })
    }
}

/// Host time of the last step: `prep` (validation, index building, uploads: the GPU has
/// nothing of this step to run yet) and `enqueue` (launching the kernels or the graph; the
/// GPU runs them meanwhile). Their sum is the CPU cost of a step.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepTiming {
    pub prep: Duration,
    /// Of `prep`: checking the chunks, and copying the inputs to the device (a graph's
    /// step; an eager step's `upload` also holds building them and its buffers).
    pub validate: Duration,
    pub upload: Duration,
    pub enqueue: Duration,
    /// Whether the step replayed a captured graph.
    pub graph: bool,
}

/// A step queued by [`CudaModel::queue_sample`] whose sampled rows are not read yet.
#[must_use = "a queued step's rows are read by CudaModel::finish_sample"]
pub struct QueuedStep {
    /// `None`: the step sampled nothing (and has finished).
    sample: Option<QueuedSample>,
}

impl QueuedStep {
    /// A handle that waits until the step's rows are written on the GPU (`None`: the step
    /// sampled nothing and has finished).
    pub fn completion(&self) -> Option<Completion> {
        self.sample.as_ref().map(QueuedSample::completion)
    }
}

/// A step's logits on the device: the first `rows` rows of `buf` (`[padded rows, vocab]`
/// f32; a graph's padding rows follow them) and each chunk's (first row, rows).
pub struct DeviceLogits<'a> {
    pub buf: &'a mut Buf<f32>,
    pub rows: usize,
    pub spans: Vec<(usize, usize)>,
}

/// What every step reads: the device, the config, the weights and this rank's place.
struct Core {
    dev: Device,
    /// The model as this rank runs it: its heads, KV heads, FFN width and layers (the whole
    /// model on one GPU; see `TpPart::local_config`).
    config: ModelConfig,
    w: GpuWeights,
    /// The tensor-parallel group's and the pipeline's communicators (`None`: size 1).
    comms: Comms,
    part: TpPart,
    /// How the tensor-parallel group sums partial outputs: one-shot over NVLink peer
    /// memory for small messages, NCCL for the rest (nothing on one GPU).
    allreduce: TpAllReduce,
    /// Largest step (tokens) that runs the fused GEMVs (norms, SwiGLU and residual adds
    /// inside the projections): [`FUSED_MAX_ROWS`], or for A/B runs `TESSERA_FUSED_MAX_ROWS`
    /// (0 or `TESSERA_FUSED_GEMV=0`: never; past 8 the GEMV's own limit holds, see `fused`).
    fused_max_rows: usize,
    /// Whether fused steps also fold RoPE and the K/V write into the qkv GEMV where the
    /// model allows (`TESSERA_FUSED_ROPE=0` turns it off for A/B runs).
    fused_rope: bool,
    /// Positions per split-KV chunk of decode attention (`TESSERA_DECODE_SPLIT_LEN`, for
    /// tuning runs); `None`: the kernel's automatic split.
    decode_split_len: Option<usize>,
}

impl Core {
    /// This rank computes a slice of the vocabulary's logits (vocab-parallel head).
    fn vocab_split(&self) -> bool {
        self.part.vocab.len() < self.config.vocab_size
    }

    /// Whether a step of `t` tokens runs the fused GEMVs: at most `fused_max_rows`, and
    /// every projection's shape fits them (16-byte rows, the normalised rows in shared
    /// memory).
    fn fused(&self, t: usize) -> bool {
        let c = &self.config;
        let (h, qd, kvd, ffn) =
            (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size);
        t <= self.fused_max_rows
            && self.dev.fused_norm_gemv_applies(t, qd + 2 * kvd, h)
            && self.dev.fused_norm_gemv_applies(t, 2 * ffn, h)
            && self.dev.fused_gemv_applies(t, h, qd)
            && self.dev.fused_gemv_applies(t, h, ffn)
    }
}

/// A model on one GPU (or one rank's share of it) with its KV cache: the CUDA backend of
/// the executor.
pub struct CudaModel {
    core: Core,
    /// The whole model's config (what callers see; `core.config` is this rank's part).
    model_config: ModelConfig,
    kv: GpuKv,
    ws: Workspaces,
    scratch: Vec<Scratch>,
    /// Logits of the last step run kernel by kernel.
    eager_logits: Option<Buf<f32>>,
    /// The vocab-parallel head's buffers of the last step run kernel by kernel.
    eager_vocab: Option<VocabScratch>,
    graphs: Vec<DecodeGraph>,
    timing: StepTiming,
    /// GPU timestamps of each step, when a benchmark asked for them ([`CudaModel::set_marks`]).
    marks: Option<Marks>,
}

impl CudaModel {
    /// `model_config` is the whole model, `local` this rank's part of it (`part`; the same
    /// on one GPU); `loaded` its weights and the KV blocks to allocate, or why loading
    /// failed.
    ///
    /// With communicators (a tensor- or pipeline-parallel rank), every rank reports its
    /// block count (0: it failed) to the others before any returns, so a failed rank fails
    /// the whole group instead of leaving its peers waiting in a collective; the ranks then
    /// use the smallest count.
    pub(crate) fn new(
        dev: Device,
        model_config: ModelConfig,
        local: ModelConfig,
        part: &TpPart,
        loaded: Result<(GpuWeights, usize), WorkerError>,
        comms: Comms,
        block_size: usize,
    ) -> Result<Self, WorkerError> {
        let c = &local;
        let prepared = loaded.and_then(|(w, num_blocks)| {
            let per_layer = num_blocks * block_size * c.num_kv_heads * c.head_dim;
            let mut kv = GpuKv { k: Vec::new(), v: Vec::new(), num_blocks, block_size };
            for _ in 0..c.num_layers {
                kv.k.push(dev.alloc(per_layer)?);
                kv.v.push(dev.alloc(per_layer)?);
            }
            let decode = dev.decode_workspace(DECODE_SPLIT_ROWS, c.num_heads, c.head_dim, 1)?;
            let split = SplitParts::new(&dev, c, &comms, split_k(), SPLIT_MIN_WEIGHT)?;
            Ok((w, kv, Workspaces { decode, split }))
        });
        // Tensor group first, then the pipeline: a failure anywhere reaches every rank.
        let mut mine = prepared.as_ref().map_or(0, |p| u32::try_from(p.1.num_blocks).unwrap_or(u32::MAX));
        for (comm, what) in [(&comms.tp, "tensor-parallel rank"), (&comms.pp, "pipeline stage")] {
            let Some(comm) = comm else { continue };
            let all = super::tp::all_gather_u32(&dev, comm, comm.rank(), comm.world(), mine)?;
            if let Some(r) = all.iter().position(|&n| n == 0) {
                return Err(WorkerError::Collective(format!(
                    "{what} {r} of {} failed to load its shard (see its log)",
                    all.len()
                )));
            }
            mine = all.iter().copied().min().unwrap_or(0);
        }
        let (w, mut kv, ws) = prepared?;
        kv.num_blocks = mine as usize;
        let allreduce = match &comms.tp {
            Some(comm) => TpAllReduce::setup(&dev, comm, MAX_GRAPH_BATCH, local.hidden_size)?,
            None => TpAllReduce::none(),
        };
        // Every GEMM this device runs from now on multiplies by a weight, and weights are
        // written only at load (finished here): the small-batch GEMV may start streaming W
        // before the previous kernel ends (6-stage ring, 8 warps, one wave, early PDL;
        // `TESSERA_GEMV_TUNING=stages,warps` overrides the first two for tuning runs).
        dev.synchronize()?;
        let (stages, warps) = std::env::var("TESSERA_GEMV_TUNING")
            .ok()
            .and_then(|v| {
                let (a, b) = v.split_once(',')?;
                Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
            })
            .unwrap_or((6, 8));
        dev.set_gemv_tuning(stages, warps, true, 2)?;
        // Decode batches up to this many sequences run the lean attention kernel, beside
        // which the o GEMV starts early (for A/B runs; default: the kernels' choice).
        if let Some(n) = std::env::var("TESSERA_DECODE_LEAN_SEQS").ok().and_then(|v| v.parse().ok()) {
            dev.set_decode_lean_max_seqs(n);
        }
        // Decode attention starts beside the kernel that writes q and the newest K/V and
        // copies the older K/V meanwhile: run_layers' decode steps take their tables and
        // lengths from the step's inputs and their older K/V from earlier steps, as
        // set_decode_early_start requires (`TESSERA_DECODE_EARLY=0`: plain launches). That
        // holds because the step's first kernels (unpack4, embedding, nccl_recv) are plain
        // launches that never trigger early: every programmatic kernel of the layers starts
        // after they finished. Keep them so.
        dev.set_decode_early_start(std::env::var("TESSERA_DECODE_EARLY").as_deref() != Ok("0"));
        Ok(CudaModel {
            core: Core {
                dev,
                config: local,
                w,
                comms,
                part: part.clone(),
                allreduce,
                fused_max_rows: fused_max_rows(),
                fused_rope: std::env::var("TESSERA_FUSED_ROPE").as_deref() != Ok("0"),
                decode_split_len: std::env::var("TESSERA_DECODE_SPLIT_LEN").ok().and_then(|v| v.parse().ok()),
            },
            model_config,
            kv,
            ws,
            scratch: Vec::new(),
            eager_logits: None,
            eager_vocab: None,
            graphs: Vec::new(),
            timing: StepTiming::default(),
            marks: None,
        })
    }

    /// Whether unfused steps of [`SPLIT_MIN_ROWS`] to [`SPLIT_MAX_ROWS`] tokens split the o
    /// or down GEMM (for tests).
    #[doc(hidden)]
    pub fn splits_gemms(&self) -> bool {
        self.ws.split.is_some()
    }

    /// Splits the o and down GEMMs of weights of at least `min_weight` values (instead of
    /// [`SPLIT_MIN_WEIGHT`]; tests split a small model's with 0). Before any decode graph is
    /// captured: the graphs keep the buffers and plans they were recorded with.
    pub(crate) fn set_split_min_weight(&mut self, min_weight: usize) -> Result<(), WorkerError> {
        if !self.graphs.is_empty() {
            return Err(WorkerError::InvalidBatch("the split GEMMs are set before the decode graphs".into()));
        }
        self.ws.split = None; // the old partials' buffer is freed before the new one is made
        self.ws.split = SplitParts::new(&self.core.dev, &self.core.config, &self.core.comms, split_k(), min_weight)?;
        Ok(())
    }

    /// The whole model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.model_config
    }

    /// The model as this rank runs it (its heads and FFN width; the whole model at tp = 1).
    pub fn local_config(&self) -> &ModelConfig {
        &self.core.config
    }

    /// (rank, world) of this model's tensor-parallel group; (0, 1) on one GPU.
    pub fn tp(&self) -> (usize, usize) {
        (self.core.part.rank, self.core.part.tp)
    }

    /// (stage, stages) of this model's pipeline; (0, 1) without one.
    pub fn pp(&self) -> (usize, usize) {
        (self.core.part.stage, self.core.part.stages)
    }

    /// How this rank's tensor-parallel all-reduces run (one-shot up to a size, NCCL above,
    /// or why one-shot is off), for logs and benchmarks.
    pub fn all_reduce_path(&self) -> &str {
        self.core.allreduce.note()
    }

    /// Whether this rank's steps produce logits (the last pipeline stage).
    pub fn samples(&self) -> bool {
        self.core.part.is_last_stage()
    }

    pub fn device(&self) -> &Device {
        &self.core.dev
    }

    pub fn num_blocks(&self) -> usize {
        self.kv.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.kv.block_size
    }

    /// Host time of the last [`CudaModel::forward_device`].
    pub fn last_step_timing(&self) -> StepTiming {
        self.timing
    }

    /// From now on every step records marks into `marks` (until they run out): at its start,
    /// before its graph or kernels are queued (its inputs' copies queued before it) and after
    /// them; a step through [`CudaModel::forward_sample`] (or `forward_greedy`) records a
    /// fourth once its sampled rows are on the host (or, sampling nothing, once the step has
    /// finished). So per such step: host preparation, the forward pass, sampling with its
    /// read-back, and (to the next step's first mark) the caller's time between steps.
    /// Steps through `forward` or `forward_device` record only the first three, so a run
    /// that mixes them with sampled steps cannot be split in fours.
    pub fn set_marks(&mut self, marks: Option<Marks>) {
        self.marks = marks;
    }

    /// The marks recorded since [`CudaModel::set_marks`], which stops recording.
    pub fn take_marks(&mut self) -> Option<Marks> {
        self.marks.take()
    }

    /// Batch sizes with a captured decode graph.
    pub fn graph_batches(&self) -> Vec<usize> {
        self.graphs.iter().map(|g| g.b).collect()
    }

    /// Captures the decode graphs of every bucket up to `max_batch` (at load: a few
    /// hundred ms). Capturing only records; a replay writes K/V only for real rows.
    pub fn capture_decode_graphs(&mut self, max_batch: usize) -> Result<(), WorkerError> {
        let bs = self.kv.block_size;
        let max_ctx = GRAPH_MAX_CONTEXT.min(self.core.config.max_position.max(1));
        let max_blocks = max_ctx.div_ceil(bs);
        self.graphs.clear();
        for &b in GRAPH_BUCKETS.iter().filter(|&&b| b <= max_batch.min(MAX_GRAPH_BATCH)) {
            let (mut idx, packed, host) = StepIndex::fixed(&self.core.dev, b, max_blocks, bs)?;
            let mut scratch = Scratch::new(&self.core.dev, &self.core.config, b)?;
            let mut logits = self.core.dev.alloc::<f32>(self.logits_len(b))?;
            let mut vocab = VocabScratch::new(&self.core, b)?;
            // One eager run first: creates the GEMM plans (host work) outside the capture.
            run_layers(&self.core, &mut self.kv, &mut self.ws, &mut scratch, &idx)?;
            lm_head(&self.core, &scratch, &idx, &mut logits, &mut vocab)?;
            self.core.dev.synchronize()?;
            let (core, kv, ws) = (&self.core, &mut self.kv, &mut self.ws);
            let graph = core.dev.capture(|| {
                let i = &mut idx;
                core.dev.unpack4(&packed, [&mut i.ids, &mut i.positions, &mut i.slots, &mut i.context_lens])?;
                run_layers(core, kv, ws, &mut scratch, &idx).map_err(into_kernel)?;
                lm_head(core, &scratch, &idx, &mut logits, &mut vocab).map_err(into_kernel)
            })?;
            self.graphs.push(DecodeGraph { b, idx, host, packed, _scratch: scratch, logits, _vocab: vocab, graph });
        }
        Ok(())
    }

    /// Elements of the logits buffer of a step with `rows` wanted rows: `[rows, vocab]` on
    /// the last pipeline stage, one (unused) element before it.
    fn logits_len(&self, rows: usize) -> usize {
        if self.samples() {
            (rows * self.core.config.vocab_size).max(1)
        } else {
            1
        }
    }

    /// Takes the scratch set for `t` tokens out of the pool (allocating it when new).
    fn take_scratch(&mut self, t: usize) -> Result<Scratch, WorkerError> {
        match self.scratch.iter().position(|s| s.t == t) {
            Some(i) => Ok(self.scratch.remove(i)),
            None => Scratch::new(&self.core.dev, &self.core.config, t),
        }
    }

    fn put_scratch(&mut self, s: Scratch) {
        if self.scratch.len() >= SCRATCH_KEPT {
            self.scratch.remove(0);
        }
        self.scratch.push(s);
    }

    /// Runs one step and returns the logits each chunk asked for, on the host.
    /// A pipeline stage before the last returns no logits (empty data and spans).
    pub fn forward(&mut self, chunks: &[SeqChunk]) -> Result<Logits, WorkerError> {
        let vocab = self.core.config.vocab_size;
        let (graph, rows, spans) = self.step(chunks, None)?;
        if !self.samples() {
            self.core.dev.synchronize()?;
            return Ok(Logits { vocab, data: Vec::new(), spans: Vec::new() });
        }
        let buf = logits_of(&mut self.graphs, &mut self.eager_logits, graph)?;
        let mut data = self.core.dev.download(buf)?;
        data.truncate(rows * vocab);
        Ok(Logits { vocab, data, spans })
    }

    /// Runs one step, leaving the wanted logits on the device.
    pub fn forward_device(&mut self, chunks: &[SeqChunk]) -> Result<DeviceLogits<'_>, WorkerError> {
        let (graph, rows, spans) = self.step(chunks, None)?;
        let buf = logits_of(&mut self.graphs, &mut self.eager_logits, graph)?;
        Ok(DeviceLogits { buf, rows, spans })
    }

    /// Runs one step and takes the argmax of each wanted row on the GPU (only the token
    /// ids come back to the host).
    pub fn forward_greedy(&mut self, chunks: &[SeqChunk], sampler: &mut GpuSampler) -> Result<Vec<u32>, WorkerError> {
        let rows = chunks.iter().map(|s| s.logits.rows(s.tokens.len())).sum();
        let requests = vec![RowRequest::greedy(); rows];
        let rows = self.forward_sample(chunks, &requests, sampler)?;
        Ok(rows.into_iter().map(|s| s.map(|s| s.token)).collect::<Result<_, _>>()?)
    }

    /// Runs one step and samples each wanted row on the GPU with `requests` (one per
    /// chunk that asked for logits, in order; each such chunk must want one row). A
    /// pipeline stage before the last runs its layers, passes the activations on and
    /// samples nothing.
    pub fn forward_sample(
        &mut self,
        chunks: &[SeqChunk],
        requests: &[RowRequest],
        sampler: &mut GpuSampler,
    ) -> Result<Vec<Result<Sampled, SamplingError>>, WorkerError> {
        let queued = self.queue_step(chunks, &[], requests, sampler)?;
        let rows = match queued {
            Some(q) => sampler.finish(q)?,
            None => Vec::new(),
        };
        mark(&self.core.dev, &mut self.marks)?;
        Ok(rows)
    }

    /// Queues one step and its sampling as [`CudaModel::forward_sample`] does, without
    /// waiting for the sampled rows ([`CudaModel::finish_sample`] reads them), so the host
    /// can queue the next step while the GPU runs this one. A chunk `i` with
    /// `from_sampled[i] = Some(row)` (one token long; `from_sampled` empty: none) runs the
    /// token sampled in row `row` of the sampling queued last on `sampler` (the step
    /// before), which the device puts in place of the chunk's own token (a placeholder,
    /// still a valid id): the host need not have read it. A step that samples nothing
    /// (a pipeline stage before the last, no wanted rows) has finished on return.
    ///
    /// With marks ([`CudaModel::set_marks`]) the step's fourth mark follows its sampling
    /// on the stream (not the host's read of the rows, as for `forward_sample`).
    pub fn queue_sample(
        &mut self,
        chunks: &[SeqChunk],
        from_sampled: &[Option<u32>],
        requests: &[RowRequest],
        sampler: &mut GpuSampler,
    ) -> Result<QueuedStep, WorkerError> {
        let sample = self.queue_step(chunks, from_sampled, requests, sampler)?;
        mark(&self.core.dev, &mut self.marks)?;
        Ok(QueuedStep { sample })
    }

    /// Waits for a step queued by [`CudaModel::queue_sample`] (its sampling only: steps
    /// queued after it run on) and returns its sampled rows, as `forward_sample` would.
    pub fn finish_sample(
        &mut self,
        step: QueuedStep,
        sampler: &mut GpuSampler,
    ) -> Result<Vec<Result<Sampled, SamplingError>>, WorkerError> {
        match step.sample {
            Some(q) => sampler.finish(q),
            None => Ok(Vec::new()),
        }
    }

    /// `forward_sample`'s work up to the queued sampling (`None`: nothing sampled, the
    /// step has finished), without its last mark.
    fn queue_step(
        &mut self,
        chunks: &[SeqChunk],
        from_sampled: &[Option<u32>],
        requests: &[RowRequest],
        sampler: &mut GpuSampler,
    ) -> Result<Option<QueuedSample>, WorkerError> {
        let last = sampler.last_tokens();
        let takes = check_from_sampled(chunks, from_sampled, last.map(|t| t.1))?;
        let from = last.filter(|_| takes).map(|(tokens, rows)| (from_sampled, tokens, rows));
        let (graph, rows, _) = self.step(chunks, from)?;
        if !self.samples() {
            self.core.dev.synchronize()?;
            return Ok(None);
        }
        if rows != requests.len() {
            return Err(WorkerError::InvalidBatch(format!("{rows} logit rows, {} sample requests", requests.len())));
        }
        if rows == 0 {
            // A step of prefill chunks none of which ends its prompt: nothing to sample.
            self.core.dev.synchronize()?;
            return Ok(None);
        }
        let buf = logits_of(&mut self.graphs, &mut self.eager_logits, graph)?;
        Ok(Some(sampler.queue(&self.core.dev, buf, self.core.config.vocab_size, requests)?))
    }

    /// Runs one step: the graph whose logits buffer holds the result (`None`: the eager
    /// one), the wanted rows and each chunk's span. `from`: the chunks' sampled rows (as
    /// [`CudaModel::queue_sample`] takes them, checked) with the sampled tokens and rows.
    #[allow(clippy::type_complexity)]
    fn step(
        &mut self,
        chunks: &[SeqChunk],
        from: Option<(&[Option<u32>], &Buf<u32>, usize)>,
    ) -> Result<(Option<usize>, usize, Vec<(usize, usize)>), WorkerError> {
        let from_sampled = from.map_or(&[][..], |f| f.0);
        let t0 = Instant::now();
        mark(&self.core.dev, &mut self.marks)?;
        let c = &self.core.config;
        validate_chunks(chunks, c.vocab_size, self.kv.num_blocks, self.kv.block_size, rope_positions(c))?;
        let validate = t0.elapsed();
        let bs = self.kv.block_size;
        // A graph's step has one token and one logit row per sequence: a one-token prefill
        // chunk that is not the prompt's last (no row) runs eagerly.
        let decode = chunks.iter().all(|s| s.tokens.len() == 1 && s.logits.rows(1) == 1);
        let graph = if decode { self.graphs.iter().position(|g| g.b >= chunks.len()) } else { None };
        let graph = graph.filter(|&g| {
            let mb = self.graphs[g].idx.max_blocks;
            chunks.iter().all(|s| (s.first_pos + 1).div_ceil(bs) <= mb)
        });
        if let Some(g) = graph {
            let dg = &mut self.graphs[g];
            let upload = dg.idx.refill(&self.core.dev, &mut dg.host, &mut dg.packed, chunks, from_sampled, bs)?;
            if let Some((_, tokens, sampled)) = from {
                // The ids are the packed array's first row.
                self.core.dev.take_sampled_ids(&mut dg.packed, chunks.len(), tokens, sampled)?;
            }
            mark(&self.core.dev, &mut self.marks)?;
            let t1 = Instant::now();
            self.core.dev.launch_graph(&dg.graph)?;
            self.timing = StepTiming { prep: t1 - t0, validate, upload, enqueue: t1.elapsed(), graph: true };
            mark(&self.core.dev, &mut self.marks)?;
            let spans = (0..chunks.len()).map(|i| (i, 1)).collect();
            return Ok((Some(g), chunks.len(), spans));
        }
        let t: usize = chunks.iter().map(|s| s.tokens.len()).sum();
        let mut idx = StepIndex::build(&self.core.dev, chunks, from_sampled, bs)?;
        if let Some((_, tokens, sampled)) = from {
            let n = idx.ids.len();
            self.core.dev.take_sampled_ids(&mut idx.ids, n, tokens, sampled)?;
        }
        let mut s = self.take_scratch(t)?;
        let (rows, spans) = (rows_of(&idx.picked), spans_of(&idx.picked));
        let need = self.logits_len(rows);
        let mut logits = match self.eager_logits.take() {
            Some(l) if l.len() == need => l,
            _ => self.core.dev.alloc::<f32>(need)?,
        };
        let mut vocab = match self.eager_vocab.take() {
            Some(v) if v.rows == rows => Some(v),
            _ => VocabScratch::new(&self.core, rows)?,
        };
        mark(&self.core.dev, &mut self.marks)?;
        let (upload, t1) = (t0.elapsed() - validate, Instant::now());
        let r = run_layers(&self.core, &mut self.kv, &mut self.ws, &mut s, &idx);
        let r = r.and_then(|()| lm_head(&self.core, &s, &idx, &mut logits, &mut vocab));
        self.eager_vocab = vocab;
        self.put_scratch(s);
        self.timing = StepTiming { prep: t1 - t0, validate, upload, enqueue: t1.elapsed(), graph: false };
        self.eager_logits = Some(logits);
        r?;
        mark(&self.core.dev, &mut self.marks)?;
        Ok((None, rows, spans))
    }
}

/// Records the next of `marks` (a benchmark's, [`CudaModel::set_marks`]) if there are any.
fn mark(dev: &Device, marks: &mut Option<Marks>) -> Result<(), WorkerError> {
    if let Some(m) = marks.as_mut() {
        dev.mark(m)?;
    }
    Ok(())
}

impl Drop for CudaModel {
    /// NCCL's order of teardown: finish the queued work, free the graphs that recorded
    /// collectives, then the communicator (fields would drop it first).
    fn drop(&mut self) {
        if self.core.comms.tp.is_some() || self.core.comms.pp.is_some() {
            let _ = self.core.dev.synchronize();
            self.graphs.clear();
            self.core.allreduce = TpAllReduce::none();
            self.core.comms = Comms::default();
        }
    }
}

/// The buffer holding a step's logits: `graph`'s, or the eager step's. Takes the fields,
/// not the model, so the device stays borrowable next to it.
fn logits_of<'a>(
    graphs: &'a mut [DecodeGraph],
    eager: &'a mut Option<Buf<f32>>,
    graph: Option<usize>,
) -> Result<&'a mut Buf<f32>, WorkerError> {
    match graph {
        Some(g) => graphs.get_mut(g).map(|d| &mut d.logits),
        None => eager.as_mut(),
    }
    .ok_or_else(|| WorkerError::InvalidBatch("the step left no logits".into()))
}

/// Graph capture needs a `KernelError`; a forward error inside it is one already, or a
/// batch problem that cannot happen for the fixed inputs.
fn into_kernel(e: WorkerError) -> tessera_kernels::KernelError {
    match e {
        WorkerError::Kernel(k) => k,
        other => tessera_kernels::KernelError::Device { op: "cuda_forward", detail: other.to_string() },
    }
}

/// Every decoder layer and the final norm over `s.t` tokens, K/V into `kv`.
fn run_layers(
    core: &Core,
    kv: &mut GpuKv,
    ws: &mut Workspaces,
    s: &mut Scratch,
    idx: &StepIndex,
) -> Result<(), WorkerError> {
    let (dev, w, c) = (&core.dev, &core.w, &core.config);
    let (h, hd, ffn, t) = (c.hidden_size, c.head_dim, c.intermediate_size, s.t);
    let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
    let eps = c.rms_norm_eps;
    let cache = PagedKv { block_size: kv.block_size, n_kv_heads: c.num_kv_heads, head_dim: hd };
    let scale = 1.0 / (hd as f32).sqrt();
    // The residual stream: embedded on the first stage, else received from the stage before.
    match (&w.embed, &core.comms.pp) {
        (Some(embed), _) if core.part.is_first_stage() => dev.embedding(&mut s.x, embed, &idx.ids, h)?,
        (_, Some(pp)) if !core.part.is_first_stage() => dev.nccl_recv(pp, &mut s.x, t * h, core.part.stage - 1)?,
        _ => return Err(WorkerError::InvalidBatch("this stage has neither the embedding nor a previous stage".into())),
    }
    // Fused (decode-sized steps): the residual stream `x` is complete at every layer's
    // start (the o and down GEMVs add into it, or the add follows the all-reduce), and the
    // norms and SwiGLU run inside the qkv and gate_up GEMVs. Unfused: each sublayer's add
    // is fused with the next norm instead.
    let fused = core.fused(t);
    // Unfused steps of SPLIT_MIN_ROWS to SPLIT_MAX_ROWS tokens: the o and down outputs may
    // arrive as split partials, which the add_parts_rms_norm after them sums.
    let mut parts = ws.split.as_mut().filter(|_| !fused && (SPLIT_MIN_ROWS..=SPLIT_MAX_ROWS).contains(&t));
    for (li, l) in w.layers.iter().enumerate() {
        let prep = w.qkv_prep(c, l, &s.qkv, t, &idx.positions, &idx.slots);
        if fused && core.fused_rope && dev.fused_rope_gemv_applies(&prep, h) {
            // Norm, projection, bias, RoPE and the K/V write in one kernel (Llama-style).
            let (q, k, v) = (&mut s.q, &mut kv.k[li], &mut kv.v[li]);
            dev.matmul_rms_norm_rope(q, k, v, &cache, &prep, &s.x, &l.attn_norm, eps, &l.qkv, h)?;
        } else {
            if fused {
                dev.matmul_rms_norm(&mut s.qkv, &s.x, &l.attn_norm, eps, t, &l.qkv, qd + 2 * kvd, h)?;
            } else {
                if li == 0 {
                    dev.rms_norm(&mut s.xn, &s.x, &l.attn_norm, t, eps)?;
                } else {
                    add_norm(core, parts.as_deref(), Sublayer::Ffn, s, &l.attn_norm)?;
                }
                dev.matmul(&mut s.qkv, &s.xn, t, &l.qkv, qd + 2 * kvd, h)?;
            }
            let prep = w.qkv_prep(c, l, &s.qkv, t, &idx.positions, &idx.slots);
            dev.qkv_rope_write(&mut s.q, &mut kv.k[li], &mut kv.v[li], &cache, &prep)?;
        }
        let batch = PagedBatch {
            cache,
            k_cache: &kv.k[li],
            v_cache: &kv.v[li],
            block_tables: &idx.block_tables,
            max_blocks: idx.max_blocks,
            context_lens: &idx.context_lens,
        };
        match &idx.cu_q {
            None => {
                let ws = Some(&mut ws.decode);
                let split = core.decode_split_len;
                dev.paged_decode_attention(&mut s.attn, &s.q, &batch, c.num_heads, scale, idx.max_context, split, ws)?;
            }
            Some(cu_q) => {
                dev.paged_prefill_attention(&mut s.attn, &s.q, &batch, cu_q, idx.max_q, c.num_heads, scale)?;
            }
        }
        if !fused {
            project(core, parts.as_deref_mut(), s, Sublayer::Attention, &l.o, qd)?;
            add_norm(core, parts.as_deref(), Sublayer::Attention, s, &l.ffn_norm)?;
            dev.matmul(&mut s.gate_up, &s.xn, t, &l.gate_up, 2 * ffn, h)?;
            dev.silu_mul_packed(&mut s.act, &s.gate_up, t)?;
            project(core, parts.as_deref_mut(), s, Sublayer::Ffn, &l.down, ffn)?;
            continue;
        }
        add_projection(core, s, Sublayer::Attention, &l.o, qd)?;
        dev.matmul_rms_norm_swiglu(&mut s.act, &s.x, &l.ffn_norm, eps, t, &l.gate_up, ffn, h)?;
        add_projection(core, s, Sublayer::Ffn, &l.down, ffn)?;
    }
    // Completes the residual stream (unfused: the last sublayer's add) and normalises it
    // for the head; a stage before the last passes the completed stream on instead.
    if fused {
        dev.rms_norm(&mut s.xn, &s.x, &w.norm, t, eps)?;
    } else {
        add_norm(core, parts.as_deref(), Sublayer::Ffn, s, &w.norm)?;
    }
    if let (false, Some(pp)) = (core.part.is_last_stage(), &core.comms.pp) {
        dev.nccl_send(pp, &s.x, t * h, core.part.stage + 1)?;
    }
    Ok(())
}

/// Which sublayer's output projection [`add_projection`] runs: o reads the attention
/// output, down the SwiGLU activation.
#[derive(Clone, Copy)]
enum Sublayer {
    Attention,
    Ffn,
}

/// Fused path: a row-parallel projection (o or down) of `s.t` tokens added into the
/// residual stream `s.x`. On one GPU the GEMV adds in place; under tensor parallelism the
/// partial sums are all-reduced into it (one kernel on the one-shot path).
fn add_projection(
    core: &Core,
    s: &mut Scratch,
    which: Sublayer,
    w: &Buf<bf16>,
    cols: usize,
) -> Result<(), WorkerError> {
    let (dev, h, t) = (&core.dev, core.config.hidden_size, s.t);
    let Scratch { x, out, attn, act, .. } = s;
    let input = match which {
        Sublayer::Attention => &*attn,
        Sublayer::Ffn => &*act,
    };
    match &core.comms.tp {
        None => Ok(dev.matmul_add_residual(x, input, t, w, h, cols)?),
        Some(comm) => {
            dev.matmul(out, input, t, w, h, cols)?;
            core.allreduce.run_add(dev, comm, out, x)
        }
    }
}

/// Unfused path: a row-parallel projection (o or down) of `s.t` tokens, its output for the
/// next [`add_norm`]: split partials (where `parts` splits it), or `s.out` summed over the
/// tensor-parallel group.
fn project(
    core: &Core,
    parts: Option<&mut SplitParts>,
    s: &mut Scratch,
    which: Sublayer,
    w: &Buf<bf16>,
    cols: usize,
) -> Result<(), WorkerError> {
    let (dev, h, t) = (&core.dev, core.config.hidden_size, s.t);
    let input = match which {
        Sublayer::Attention => &s.attn,
        Sublayer::Ffn => &s.act,
    };
    match parts {
        Some(p) if p.splits(which) => Ok(dev.matmul_parts(&mut p.buf, p.splits, input, t, w, h, cols)?),
        _ => {
            dev.matmul(&mut s.out, input, t, w, h, cols)?;
            all_reduce(core, &mut s.out)
        }
    }
}

/// Unfused path: the output of `after`'s [`project`] added into the residual stream `s.x`,
/// and `s.xn` = its norm with `gamma`.
fn add_norm(
    core: &Core,
    parts: Option<&SplitParts>,
    after: Sublayer,
    s: &mut Scratch,
    gamma: &Buf<bf16>,
) -> Result<(), WorkerError> {
    let (dev, eps, t) = (&core.dev, core.config.rms_norm_eps, s.t);
    match parts {
        Some(p) if p.splits(after) => dev.add_parts_rms_norm(&mut s.xn, &mut s.x, &p.buf, p.splits, gamma, t, eps)?,
        _ => dev.add_rms_norm(&mut s.xn, &mut s.x, &s.out, gamma, t, eps)?,
    }
    Ok(())
}

/// Sums a row-parallel GEMM's partial outputs (`[t, hidden]`) over the tensor-parallel
/// group, in place; nothing on one GPU.
fn all_reduce(core: &Core, out: &mut Buf<bf16>) -> Result<(), WorkerError> {
    if let Some(comm) = &core.comms.tp {
        core.allreduce.run(&core.dev, comm, out)?;
    }
    Ok(())
}

/// The LM head over the wanted rows of the final normalised activations, into `logits`
/// (`[wanted rows, vocab]`), on the last pipeline stage. A vocab-parallel rank computes
/// its slice of each row into `vs` (sized for these rows), all-gathers every rank's, and
/// interleaves them into whole rows.
fn lm_head(
    core: &Core,
    s: &Scratch,
    idx: &StepIndex,
    logits: &mut Buf<f32>,
    vs: &mut Option<VocabScratch>,
) -> Result<(), WorkerError> {
    let (dev, c) = (&core.dev, &core.config);
    let (h, vocab) = (c.hidden_size, c.vocab_size);
    let rows: usize = idx.picked.iter().map(|p| p.1).sum();
    if rows == 0 || !core.part.is_last_stage() {
        return Ok(());
    }
    let head = core.w.lm_head.as_ref().or(core.w.embed.as_ref());
    let head = head.ok_or_else(|| WorkerError::InvalidBatch("the last stage holds no LM head".into()))?;
    let picked;
    let sel = if rows == s.t {
        &s.xn
    } else {
        let mut buf = dev.alloc::<bf16>(rows * h)?;
        let mut at = 0;
        for &(first, n) in &idx.picked {
            dev.copy_rows(&mut buf, at, &s.xn, first, n, h)?;
            at += n;
        }
        picked = buf;
        &picked
    };
    match (core.vocab_split(), &core.comms.tp, vs.as_mut()) {
        (true, Some(comm), Some(v)) if v.rows == rows => {
            let vp = core.part.vocab.len();
            dev.matmul_f32(&mut v.local, sel, rows, head, vp, h)?;
            dev.nccl_all_gather(comm, &v.local, &mut v.gathered)?;
            for r in 0..core.part.tp {
                let block =
                    Copy2d { rows, width: vp, src_pitch: vp, src_at: r * rows * vp, dst_pitch: vocab, dst_at: r * vp };
                dev.copy_2d(logits, &v.gathered, &block)?;
            }
        }
        (true, ..) => return Err(WorkerError::InvalidBatch(format!("no vocab-parallel buffers for {rows} rows"))),
        (false, ..) => dev.matmul_f32(logits, sel, rows, head, vocab, h)?,
    }
    Ok(())
}
