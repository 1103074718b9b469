//! [`HipModel`] in a build without the `hip` feature: loading says HIP was not compiled in,
//! so the backend, the service and the CLI name the type without `#[cfg]`.

use std::convert::Infallible;

use tessera_model::config::ModelConfig;
use tessera_model::weights::ModelFiles;

use crate::batch::{Logits, SeqChunk};
use crate::cuda::CudaOptions;
use crate::error::WorkerError;

/// Stands in for the HIP model; cannot be constructed.
pub struct HipModel {
    never: Infallible,
}

impl HipModel {
    pub fn load(_files: &ModelFiles, _opts: &CudaOptions) -> Result<Self, WorkerError> {
        Err(WorkerError::Unavailable(super::NOT_COMPILED.into()))
    }

    pub fn config(&self) -> &ModelConfig {
        match self.never {}
    }

    pub fn num_blocks(&self) -> usize {
        match self.never {}
    }

    pub fn block_size(&self) -> usize {
        match self.never {}
    }

    pub fn describe(&self) -> String {
        match self.never {}
    }

    pub fn context_lost(&self) -> bool {
        match self.never {}
    }

    pub fn forward(&mut self, _chunks: &[SeqChunk]) -> Result<Logits, WorkerError> {
        match self.never {}
    }
}
