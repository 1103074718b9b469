//! Greedy sampling on the GPU for whole batches: the argmax of each logits row without
//! copying the logits to the host (at 256 rows of a 128k vocabulary that copy is 128 MB a
//! step). Used by the benchmark and by steps where every row is greedy.

use tessera_kernels::cuda::{Buf, Device, SampleOutput, SampleParams};

use crate::error::WorkerError;

/// Reusable buffers for [`GreedySampler::sample`].
pub struct GreedySampler {
    out: SampleOutput,
    params: Buf<SampleParams>,
    /// Empty CSR lists (`[rows + 1]` zero offsets, one unused entry).
    offsets: Buf<u32>,
    tokens: Buf<u32>,
    values: Buf<f32>,
    rows: usize,
}

impl GreedySampler {
    pub fn new(dev: &Device, rows: usize) -> Result<Self, WorkerError> {
        Ok(GreedySampler {
            out: dev.sample_output(rows, 1)?,
            params: dev.upload(&vec![SampleParams::greedy(); rows])?,
            offsets: dev.alloc(rows + 1)?,
            tokens: dev.alloc(1)?,
            values: dev.alloc(1)?,
            rows,
        })
    }

    /// Rows this sampler takes.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The argmax of each row of `logits` (`[rows, vocab]`, `rows` as made).
    pub fn sample(&mut self, dev: &Device, logits: &mut Buf<f32>, vocab: usize) -> Result<Vec<u32>, WorkerError> {
        if logits.len() != self.rows * vocab {
            return Err(WorkerError::InvalidBatch(format!(
                "greedy sampler made for {} rows, logits hold {} values of vocab {vocab}",
                self.rows,
                logits.len()
            )));
        }
        let (o, t) = (&self.offsets, &self.tokens);
        dev.sample(&mut self.out, logits, vocab, &self.params, o, t, t, o, t, &self.values)?;
        Ok(dev.download(self.out.tokens())?)
    }
}
