//! A worker's place in a tensor- and pipeline-parallel replica ([`Shard`]) and its links to
//! the other ranks ([`Comms`]).
//!
//! The CPU backend shards so that every value is computed exactly as one worker computes
//! it: column-parallel everywhere (each rank owns whole output features with the full
//! input), and the outputs gathered instead of partial sums reduced. A rank's q/k/v heads,
//! o rows, gate/up rows, down rows and LM-head vocabulary rows each see the complete input
//! row, so the int8 activation quantisation and the summation order are the single
//! worker's, and TP/PP replicas produce bit-identical logits and greedy tokens. The price
//! is an all-gather of the attention output and of the SwiGLU output where Megatron-style
//! TP all-reduces the smaller partial sums; on GPUs (NCCL) the usual all-reduce scheme
//! fits better.

use std::ops::Range;

use crate::collective::{Collective, CollectiveError};
use crate::error::WorkerError;

/// Which part of the model this worker runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    pub tp_rank: usize,
    pub tp: usize,
    pub stage: usize,
    pub stages: usize,
    /// Layers this stage runs.
    pub layers: Range<usize>,
}

impl Shard {
    /// The whole model on one worker.
    pub fn whole(num_layers: usize) -> Self {
        Shard { tp_rank: 0, tp: 1, stage: 0, stages: 1, layers: 0..num_layers }
    }

    pub fn is_first_stage(&self) -> bool {
        self.stage == 0
    }

    pub fn is_last_stage(&self) -> bool {
        self.stage + 1 == self.stages
    }

    /// Rows `[rank * n / tp, (rank + 1) * n / tp)` of `n` split over the tensor ranks.
    pub fn split(&self, n: usize) -> Range<usize> {
        let per = n / self.tp.max(1);
        self.tp_rank * per..(self.tp_rank + 1) * per
    }
}

/// The collectives of a sharded worker: its tensor-parallel group (world `tp`, rank
/// `tp_rank`) and its pipeline (world `stages`, rank `stage`: the same tp rank of every
/// stage).
#[derive(Default)]
pub struct Comms {
    pub tp: Option<Box<dyn Collective>>,
    pub pp: Option<Box<dyn Collective>>,
}

impl From<CollectiveError> for WorkerError {
    fn from(e: CollectiveError) -> Self {
        WorkerError::Collective(e.to_string())
    }
}

/// `local` is this rank's `[rows, cols / tp]` share of a `[rows, cols]` matrix whose
/// columns are split over the group in rank order; fills `out` with the whole matrix.
/// `gathered` is scratch (`[tp, rows, cols / tp]` after the call).
pub fn gather_columns(
    tp: &mut dyn Collective,
    local: &[f32],
    rows: usize,
    out: &mut [f32],
    gathered: &mut Vec<f32>,
) -> Result<(), WorkerError> {
    let world = tp.world();
    let part = local.len() / rows.max(1);
    if part * rows != local.len() || out.len() != rows * part * world {
        return Err(WorkerError::InvalidBatch(format!(
            "gather of {} values as {rows} rows from {world} ranks into {} values",
            local.len(),
            out.len()
        )));
    }
    gathered.resize(local.len() * world, 0.0);
    tp.all_gather(local, gathered)?;
    let cols = part * world;
    for (r, piece) in gathered.chunks_exact(local.len().max(1)).enumerate().take(world) {
        for row in 0..rows {
            out[row * cols + r * part..row * cols + (r + 1) * part]
                .copy_from_slice(&piece[row * part..(row + 1) * part]);
        }
    }
    Ok(())
}
