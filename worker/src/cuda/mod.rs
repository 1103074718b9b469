//! The CUDA backend of the worker: the model's weights in GPU memory as bf16, a paged bf16
//! KV cache sized from the free GPU memory, and the forward pass over the kernels of
//! `tessera_kernels::cuda`. Compiled always; without the kernels' `cuda` feature opening a
//! device is a clear error ("not compiled"), so callers need no `#[cfg]`. A model can be
//! split over GPUs by tensor and pipeline parallelism (`tp.rs`), one rank per GPU.

mod allreduce;
mod forward;
mod sampler;
pub mod shapes;
mod tp;
mod weights;

use tessera_kernels::cuda::{Device, NcclComm, NcclId};
use tessera_model::config::ModelConfig;
use tessera_model::weights::ModelFiles;

use crate::error::WorkerError;
use crate::parallel::Shard;

pub use forward::{CudaModel, DeviceLogits, QueuedStep, StepTiming, MAX_GRAPH_BATCH};
// The HIP forward pass (crate::hip) runs on these.
#[cfg_attr(not(feature = "hip"), allow(unused_imports))]
pub(crate) use forward::{GpuKv, Scratch};
pub use sampler::{GpuSampler, QueuedSample, RowRequest};
pub use tp::TpPart;
#[cfg_attr(not(feature = "hip"), allow(unused_imports))]
pub(crate) use weights::{rope_positions, GpuWeights};

/// How to place a model on a GPU.
#[derive(Debug, Clone)]
pub struct CudaOptions {
    /// GPU ordinal.
    pub device: usize,
    /// Positions per KV block.
    pub block_size: usize,
    /// KV blocks; `None` sizes the cache from the free memory.
    pub num_blocks: Option<usize>,
    /// Fraction of the device memory free after loading the weights that the KV cache may
    /// take (the rest holds activations, cuBLASLt's workspace and the CUDA context's needs).
    pub kv_fraction: f64,
    /// Largest step (tokens) the activations must fit; reserved before sizing the KV cache.
    pub max_step_tokens: usize,
    /// Capture CUDA graphs for decode batches up to this size at load (0: none; the
    /// default is [`MAX_GRAPH_BATCH`], or 0 with `TESSERA_DECODE_GRAPHS=0`, for A/B runs of
    /// graph replays against the same kernels launched one by one).
    pub graph_max_batch: usize,
    /// Split the o and down GEMMs of weights of at least this many values (`None`: the
    /// engine's threshold, forward.rs's `SPLIT_MIN_WEIGHT`; tests split small models with 0).
    pub split_min_weight: Option<usize>,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            device: 0,
            block_size: 16,
            num_blocks: None,
            kv_fraction: 0.9,
            max_step_tokens: 8192,
            graph_max_batch: if std::env::var("TESSERA_DECODE_GRAPHS").as_deref() == Ok("0") {
                0
            } else {
                forward::MAX_GRAPH_BATCH
            },
            split_min_weight: None,
        }
    }
}

/// KV bytes per block for `c` (a tensor-parallel rank: its [`TpPart::local_config`]): K
/// and V of every layer, bf16.
pub fn kv_bytes_per_block(c: &ModelConfig, block_size: usize) -> usize {
    2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * 2
}

/// What the CUDA kernels take of a model beyond `ModelConfig::validate`: a head size the
/// attention kernels were compiled for and a vocabulary the sampler's ids hold. Checked
/// before any device memory is touched, so such a file is refused at load rather than
/// failing every step (or, for a huge head size, sizing a RoPE table of that width).
fn check_supported(c: &ModelConfig) -> Result<(), WorkerError> {
    use tessera_kernels::cuda::{sample_params::MAX_SAMPLE_VOCAB, HEAD_DIMS};
    if !HEAD_DIMS.contains(&c.head_dim) {
        return Err(WorkerError::Unavailable(format!(
            "head_dim {} is not one the CUDA kernels take ({HEAD_DIMS:?})",
            c.head_dim
        )));
    }
    if c.vocab_size > MAX_SAMPLE_VOCAB {
        return Err(WorkerError::Unavailable(format!(
            "a vocabulary of {} tokens is over the GPU sampler's {MAX_SAMPLE_VOCAB}",
            c.vocab_size
        )));
    }
    Ok(())
}

impl CudaModel {
    /// Loads `files` onto the GPU.
    pub fn load(files: &ModelFiles, opts: &CudaOptions) -> Result<Self, WorkerError> {
        let config = files.config()?;
        config.validate().map_err(tessera_model::error::ModelError::from)?;
        check_supported(&config)?;
        let dev = Device::new(opts.device)?;
        let part = TpPart::whole(&config);
        let w = weights::GpuWeights::load(&dev, &config, &part, files);
        Self::assemble(dev, config, &part, w, Comms::default(), opts)
    }

    /// Loads rank `shard.tp_rank`'s share of stage `shard.stage` of `files` onto GPU
    /// `opts.device`, joining its tensor-parallel group and its pipeline (`ids`, made by
    /// their rank 0s with `Device::nccl_unique_id`); blocks until every rank of the group
    /// has joined and loaded. A split the model does not allow is an error before any
    /// device is touched, the same on every rank.
    pub fn load_shard(
        files: &ModelFiles,
        opts: &CudaOptions,
        shard: &Shard,
        ids: &GroupIds,
    ) -> Result<Self, WorkerError> {
        let config = files.config()?;
        config.validate().map_err(tessera_model::error::ModelError::from)?;
        check_supported(&config)?;
        let part = TpPart::of_shard(&config, shard)?;
        let dev = Device::new(opts.device)?;
        let comms = join(&dev, &part, ids)?;
        let w = weights::GpuWeights::load(&dev, &config, &part, files);
        Self::assemble(dev, config, &part, w, comms, opts)
    }

    /// A random-weight model of the named shape ([`shapes::SHAPES`]), generated on the GPU.
    pub fn synthetic(shape: &str, seed: u64, opts: &CudaOptions) -> Result<Self, WorkerError> {
        let config = synthetic_config(shape)?;
        let dev = Device::new(opts.device)?;
        let part = TpPart::whole(&config);
        let w = weights::GpuWeights::synthetic(&dev, &config, &part, seed);
        Self::assemble(dev, config, &part, w, Comms::default(), opts)
    }

    /// Rank `shard.tp_rank`'s share of stage `shard.stage` of a random-weight model of the
    /// named shape (see [`CudaModel::load_shard`]): the same model as
    /// [`CudaModel::synthetic`] with the same seed, split.
    pub fn synthetic_shard(
        shape: &str,
        seed: u64,
        opts: &CudaOptions,
        shard: &Shard,
        ids: &GroupIds,
    ) -> Result<Self, WorkerError> {
        let config = synthetic_config(shape)?;
        let part = TpPart::of_shard(&config, shard)?;
        let dev = Device::new(opts.device)?;
        let comms = join(&dev, &part, ids)?;
        let w = weights::GpuWeights::synthetic(&dev, &config, &part, seed);
        Self::assemble(dev, config, &part, w, comms, opts)
    }

    /// Sizes the KV cache, allocates it and captures the decode graphs. `w` may be an
    /// error: a tensor-parallel rank still takes part in the group's agreement (see
    /// `CudaModel::new`) so its peers fail too instead of waiting for it.
    fn assemble(
        dev: Device,
        config: ModelConfig,
        part: &TpPart,
        w: Result<weights::GpuWeights, WorkerError>,
        comms: Comms,
        opts: &CudaOptions,
    ) -> Result<Self, WorkerError> {
        // The context this backend serves (and the worker advertises): what its RoPE table
        // covers, which may be shorter than the model's.
        let mut config = config;
        config.max_position = weights::rope_positions(&config);
        let local = part.local_config(&config);
        let loaded = w.and_then(|w| Ok((w, kv_blocks(&dev, &local, opts)?)));
        let mut m = CudaModel::new(dev, config, local, part, loaded, comms, opts.block_size)?;
        if let Some(w) = opts.split_min_weight {
            m.set_split_min_weight(w)?;
        }
        if opts.graph_max_batch > 0 {
            m.capture_decode_graphs(opts.graph_max_batch)?;
        }
        Ok(m)
    }
}

fn synthetic_config(shape: &str) -> Result<ModelConfig, WorkerError> {
    shapes::synthetic_config(shape).ok_or_else(|| {
        WorkerError::InvalidBatch(format!("unknown synthetic shape {shape:?}; known: {}", shapes::SHAPES.join(", ")))
    })
}

/// The NCCL ids of a shard's groups: its tensor-parallel group (rank 0's, needed when
/// tp > 1) and its pipeline (stage 0's, needed when pp > 1).
#[derive(Debug, Clone, Default)]
pub struct GroupIds {
    pub tp: Option<NcclId>,
    pub pp: Option<NcclId>,
}

/// A rank's communicators: its tensor-parallel group and its pipeline (each `None` when
/// that dimension is 1).
#[derive(Default)]
pub(crate) struct Comms {
    pub tp: Option<NcclComm>,
    pub pp: Option<NcclComm>,
}

/// Joins the groups of `part`: the tensor-parallel group first, then the pipeline (every
/// rank in the same order, so the joins pair up).
fn join(dev: &Device, part: &TpPart, ids: &GroupIds) -> Result<Comms, WorkerError> {
    let need = |what: &str, id: &Option<NcclId>| {
        id.clone().ok_or_else(|| WorkerError::Collective(format!("no NCCL id for the {what} group")))
    };
    let tp =
        if part.tp > 1 { Some(dev.nccl_join(&need("tensor-parallel", &ids.tp)?, part.rank, part.tp)?) } else { None };
    let pp =
        if part.stages > 1 { Some(dev.nccl_join(&need("pipeline", &ids.pp)?, part.stage, part.stages)?) } else { None };
    Ok(Comms { tp, pp })
}

/// KV blocks for a model shaped `local` on `dev`: as asked, or what fits in
/// `opts.kv_fraction` of the memory left after the step activations' reserve.
fn kv_blocks(dev: &Device, local: &ModelConfig, opts: &CudaOptions) -> Result<usize, WorkerError> {
    let free = if opts.num_blocks.is_some() { 0 } else { dev.memory_info()?.0 };
    kv_blocks_in(free, local, opts)
}

/// KV blocks for a model shaped `local` on a GPU with `free` bytes (the CUDA and HIP
/// backends size their caches alike): as asked, or what fits in `opts.kv_fraction` of the
/// memory left after the step activations' reserve.
pub(crate) fn kv_blocks_in(free: usize, local: &ModelConfig, opts: &CudaOptions) -> Result<usize, WorkerError> {
    let per_block = kv_bytes_per_block(local, opts.block_size.max(1));
    let num_blocks = match opts.num_blocks {
        Some(n) => n,
        None => {
            let reserve = opts.max_step_tokens * forward::Scratch::bytes_per_token(local)
                + opts.max_step_tokens.min(512) * local.vocab_size * 4
                + (1 << 30);
            let budget = (free.saturating_sub(reserve) as f64 * opts.kv_fraction.clamp(0.0, 1.0)) as usize;
            budget / per_block.max(1)
        }
    };
    if num_blocks == 0 || opts.block_size == 0 {
        return Err(WorkerError::InvalidBatch(format!(
            "no room for a KV cache: {num_blocks} blocks of {} positions",
            opts.block_size
        )));
    }
    Ok(num_blocks)
}
