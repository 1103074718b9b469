//! The CUDA backend of the worker: the model's weights in GPU memory as bf16, a paged bf16
//! KV cache sized from the free GPU memory, and the forward pass over the kernels of
//! `tessera_kernels::cuda`. Compiled always; without the kernels' `cuda` feature opening a
//! device is a clear error ("not compiled"), so callers need no `#[cfg]`.

mod forward;
mod greedy;
mod sampler;
pub mod shapes;
mod weights;

use tessera_kernels::cuda::Device;
use tessera_model::config::ModelConfig;
use tessera_model::weights::ModelFiles;

use crate::error::WorkerError;

pub use forward::{CudaModel, DeviceLogits, StepTiming, MAX_GRAPH_BATCH};
pub use greedy::GreedySampler;
pub use sampler::{GpuSampler, RowRequest};

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
    /// Capture CUDA graphs for decode batches up to this size at load (0: none).
    pub graph_max_batch: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            device: 0,
            block_size: 16,
            num_blocks: None,
            kv_fraction: 0.9,
            max_step_tokens: 8192,
            graph_max_batch: forward::MAX_GRAPH_BATCH,
        }
    }
}

/// KV bytes per block for `c`: K and V of every layer, bf16.
pub fn kv_bytes_per_block(c: &ModelConfig, block_size: usize) -> usize {
    2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * 2
}

impl CudaModel {
    /// Loads `files` onto the GPU.
    pub fn load(files: &ModelFiles, opts: &CudaOptions) -> Result<Self, WorkerError> {
        let config = files.config()?;
        config.validate().map_err(tessera_model::error::ModelError::from)?;
        let dev = Device::new(opts.device)?;
        let w = weights::GpuWeights::load(&dev, &config, files)?;
        Self::with_weights(dev, config, w, opts)
    }

    /// A random-weight model of the named shape ([`shapes::SHAPES`]), generated on the GPU.
    pub fn synthetic(shape: &str, seed: u64, opts: &CudaOptions) -> Result<Self, WorkerError> {
        let config = shapes::synthetic_config(shape).ok_or_else(|| {
            WorkerError::InvalidBatch(format!(
                "unknown synthetic shape {shape:?}; known: {}",
                shapes::SHAPES.join(", ")
            ))
        })?;
        let dev = Device::new(opts.device)?;
        let w = weights::GpuWeights::synthetic(&dev, &config, seed)?;
        Self::with_weights(dev, config, w, opts)
    }

    fn with_weights(
        dev: Device,
        config: ModelConfig,
        w: weights::GpuWeights,
        opts: &CudaOptions,
    ) -> Result<Self, WorkerError> {
        let per_block = kv_bytes_per_block(&config, opts.block_size.max(1));
        let num_blocks = match opts.num_blocks {
            Some(n) => n,
            None => {
                let (free, _) = dev.memory_info()?;
                let reserve = opts.max_step_tokens * forward::Scratch::bytes_per_token(&config)
                    + opts.max_step_tokens.min(512) * config.vocab_size * 4
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
        let mut m = CudaModel::new(dev, config, w, num_blocks, opts.block_size)?;
        if opts.graph_max_batch > 0 {
            m.capture_decode_graphs(opts.graph_max_batch)?;
        }
        Ok(m)
    }
}
