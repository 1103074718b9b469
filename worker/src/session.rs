//! One sequence run on a private KV cache: what `tessera generate` and the tests use.
//! The serving path schedules many sequences over a shared cache instead; both go
//! through the same batched `LlamaModel::forward`.

use crate::batch::{LogitsWanted, SeqChunk};
use crate::error::WorkerError;
use crate::kv_cache::KvCache;
use crate::llama::LlamaModel;

/// Block size of a session's private cache (positions per block).
const BLOCK_SIZE: usize = 16;

/// A single sequence: its cache, block table and how far it has run.
pub struct Session<'m> {
    model: &'m LlamaModel,
    kv: KvCache,
    block_table: Vec<u32>,
    /// Tokens already in the cache.
    pos: usize,
    /// Largest number of positions the cache holds.
    capacity: usize,
}

impl<'m> Session<'m> {
    /// A session able to hold `capacity` positions.
    pub fn new(model: &'m LlamaModel, capacity: usize) -> Self {
        let blocks = capacity.div_ceil(BLOCK_SIZE).max(1);
        Session {
            model,
            kv: model.new_kv_cache(blocks, BLOCK_SIZE),
            block_table: (0..blocks as u32).collect(),
            pos: 0,
            capacity: blocks * BLOCK_SIZE,
        }
    }

    /// Positions already run.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Runs `tokens` after what the session holds; returns the logits of the last token,
    /// `[vocab]`, or of every token with `all`, `[tokens.len(), vocab]`.
    pub fn feed(&mut self, tokens: &[u32], all: bool) -> Result<Vec<f32>, WorkerError> {
        if self.pos + tokens.len() > self.capacity {
            return Err(WorkerError::InvalidBatch(format!(
                "context full: {} + {} tokens > {} positions",
                self.pos,
                tokens.len(),
                self.capacity
            )));
        }
        let chunk = SeqChunk {
            tokens,
            first_pos: self.pos,
            block_table: &self.block_table,
            logits: if all { LogitsWanted::All } else { LogitsWanted::Last },
        };
        let logits = self.model.forward(std::slice::from_ref(&chunk), &mut self.kv)?;
        self.pos += tokens.len();
        Ok(logits.data)
    }
}
