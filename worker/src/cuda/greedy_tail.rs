//! The greedy tail of a decode graph: the sampling launches of a step whose every row is
//! plain argmax, recorded into a second copy of the bucket's graph after the LM head, with
//! the packed result written straight into page-locked host memory.
//!
//! Why: sampled eagerly, a step's first sampling kernel starts a few µs after the graph has
//! ended (a kernel queued behind a graph waits for the graph's completion to be noticed),
//! and each further launch adds its own gap; inside the graph they follow the LM head as
//! its other kernels follow each other. Greedy decoding (benchmarks, `temperature: 0`
//! requests) is the case where every input of those launches is fixed: a plain greedy
//! row's token and logprob do not depend on its seed, draw or truncation parameters (see
//! [`RowRequest::is_plain_greedy`]), so the tail samples every row with
//! `SampleParams::greedy()` and no entries, which gives what the eager sampler gives.

use tessera_kernels::cuda::{Buf, Device, SampleOutput, SampleParams, SamplePaths};

use super::sampler::{to_sampled, RowRequest};
use crate::error::WorkerError;
use crate::sampling::{Sampled, SamplingError};

/// The fixed inputs and the output of one bucket's greedy tail (`rows`: the bucket's size).
pub(crate) struct GreedyTail {
    rows: usize,
    out: SampleOutput,
    /// `[rows]` greedy parameters.
    params: Buf<SampleParams>,
    /// `[rows + 1]` zeros: no row has penalty or bias entries.
    offsets: Buf<u32>,
    /// One unused entry each (a device buffer cannot be empty).
    tokens: Buf<u32>,
    values: Buf<f32>,
}

impl GreedyTail {
    /// The tail of a `rows`-row bucket, or `None` where the driver does not map page-locked
    /// memory (then the graph would need a copy back, and these steps sample eagerly).
    pub(crate) fn new(dev: &Device, rows: usize) -> Result<Option<Self>, WorkerError> {
        let out = dev.sample_output(rows, 0)?;
        if !out.maps_to_host() {
            return Ok(None);
        }
        Ok(Some(GreedyTail {
            rows,
            out,
            params: dev.upload(&vec![SampleParams::greedy(); rows])?,
            offsets: dev.upload(&vec![0u32; rows + 1])?,
            tokens: dev.upload(&[0u32])?,
            values: dev.upload(&[0f32])?,
        }))
    }

    /// Queues the argmax of every row of `logits` (`[rows, vocab]`) and the pack of the
    /// results into the host stage: the launches a graph records. Run once eagerly before
    /// the capture, so that the split path's scratch is allocated outside it.
    pub(crate) fn queue(&mut self, dev: &Device, logits: &mut Buf<f32>, vocab: usize) -> Result<(), WorkerError> {
        let greedy = std::iter::repeat_n((SampleParams::greedy(), 0, 0), self.rows);
        let paths = SamplePaths::for_rows(vocab, greedy);
        let (p, o, t, v) = (&self.params, &self.offsets, &self.tokens, &self.values);
        let x = std::env::var("TWIN_X").unwrap_or_default();
        if x == "empty" {
            return Ok(());
        }
        dev.sample_paths(&mut self.out, logits, vocab, p, o, t, t, o, t, v, paths)?;
        if x == "nopack" {
            return Ok(());
        }
        self.out.pack_to_host(dev, self.rows)?;
        Ok(())
    }

    /// After a replay of the graph that recorded [`GreedyTail::queue`]: waits for it and
    /// returns the first `n_rows` rows' draws.
    pub(crate) fn read(
        &mut self,
        dev: &Device,
        n_rows: usize,
    ) -> Result<Vec<Result<Sampled, SamplingError>>, WorkerError> {
        let rows = if std::env::var("TWIN_X").as_deref() == Ok("nopack") {
            self.out.read(dev, n_rows, false)?
        } else {
            self.out.read_packed(dev, self.rows, n_rows)?
        };
        Ok(rows.into_iter().map(to_sampled).collect())
    }
}

/// Whether every request of a step can take a graph's greedy tail.
pub(crate) fn all_plain_greedy(requests: &[RowRequest], vocab: usize) -> bool {
    !requests.is_empty() && requests.iter().all(|r| r.is_plain_greedy(vocab))
}
