//! The forward-pass backends an executor can drive: the CPU model with its f32 KV cache,
//! or a model on a GPU (NVIDIA through CUDA, AMD through HIP). Both take the same batch ([`SeqChunk`]s) and return the same
//! [`Logits`], so the executor, the service and everything above them are unchanged.

use tessera_model::config::ModelConfig;

use crate::batch::{Logits, SeqChunk};
use crate::cuda::{CudaModel, GpuSampler};
use crate::error::WorkerError;
use crate::hip::HipModel;
use crate::kv_cache::KvCache;
use crate::llama::LlamaModel;
use crate::parallel::Comms;

/// A loaded model with its KV memory.
pub enum Backend {
    /// The CPU model; `comms` links a tensor/pipeline-parallel shard to its peers.
    Cpu { model: Box<LlamaModel>, kv: KvCache, comms: Comms },
    /// The model and its sampler (the CUDA backend samples on the GPU, see executor.rs).
    Cuda(Box<CudaModel>, Box<GpuSampler>),
    /// A model on an AMD GPU; its logits are sampled on the host, as the CPU backend's.
    Hip(Box<HipModel>),
}

impl Backend {
    /// The CPU model with a cache of `num_blocks` blocks of `block_size` positions.
    pub fn cpu(model: LlamaModel, num_blocks: usize, block_size: usize) -> Self {
        Self::cpu_sharded(model, num_blocks, block_size, Comms::default())
    }

    /// A CPU shard of a tensor/pipeline-parallel replica with its collectives.
    pub fn cpu_sharded(model: LlamaModel, num_blocks: usize, block_size: usize, comms: Comms) -> Self {
        let kv = model.new_kv_cache(num_blocks, block_size);
        Backend::Cpu { model: Box::new(model), kv, comms }
    }

    /// Whether this backend's steps produce logits to sample (not a pipeline stage before
    /// the last).
    pub fn samples(&self) -> bool {
        match self {
            Backend::Cpu { model, .. } => model.shard.is_last_stage(),
            Backend::Cuda(m, _) => m.samples(),
            Backend::Hip(_) => true,
        }
    }

    /// A model on a GPU.
    pub fn cuda(model: CudaModel) -> Self {
        Backend::Cuda(Box::new(model), Box::default())
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Backend::Cpu { model, .. } => &model.config,
            Backend::Cuda(m, _) => m.config(),
            Backend::Hip(m) => m.config(),
        }
    }

    pub fn num_blocks(&self) -> usize {
        match self {
            Backend::Cpu { kv, .. } => kv.num_blocks,
            Backend::Cuda(m, _) => m.num_blocks(),
            Backend::Hip(m) => m.num_blocks(),
        }
    }

    pub fn block_size(&self) -> usize {
        match self {
            Backend::Cpu { kv, .. } => kv.block_size,
            Backend::Cuda(m, _) => m.block_size(),
            Backend::Hip(m) => m.block_size(),
        }
    }

    /// Whether `e`, the error of a failed step, left the GPU context unusable (a kernel
    /// faulted or trapped): a device error that says so, or one from a library (NCCL,
    /// cuBLASLt) worded otherwise, after which the stream's own state holds the sticky
    /// error. Polled, not waited for: work still queued may be blocked on a dead peer.
    /// Never on the CPU, nor for errors that are not the device's (a refused batch).
    pub fn context_lost_by(&self, e: &WorkerError) -> bool {
        let WorkerError::Kernel(k) = e else { return false };
        k.context_lost()
            || match self {
                Backend::Cpu { .. } => false,
                Backend::Cuda(m, _) => m.device().poll_error().is_err_and(|e| e.context_lost()),
                Backend::Hip(m) => m.context_lost(),
            }
    }

    /// `("cpu" | "cuda" | "hip", a description of the device)`.
    pub fn device(&self) -> (&'static str, String) {
        match self {
            Backend::Cpu { .. } => ("cpu", format!("cpu ({} threads)", rayon::current_num_threads())),
            Backend::Cuda(m, _) => ("cuda", format!("{} (GPU {})", m.device().name(), m.device().ordinal())),
            Backend::Hip(m) => ("hip", m.describe()),
        }
    }

    /// Runs one step over `chunks`, writing their K/V, and returns the logits asked for.
    pub fn forward(&mut self, chunks: &[SeqChunk]) -> Result<Logits, WorkerError> {
        match self {
            Backend::Cpu { model, kv, comms } => model.forward_sharded(chunks, kv, comms),
            Backend::Cuda(m, _) => m.forward(chunks),
            Backend::Hip(m) => m.forward(chunks),
        }
    }
}
