//! What one forward pass runs: a batch of sequence chunks (prefill chunks and decodes
//! mixed), each with its positions and block table. This is the explicit
//! `ForwardContext` of the design: no global state describes a step.

/// One sequence's share of a forward pass.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// Token ids to run, at positions `first_pos..first_pos + tokens.len()`.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions before it are already in the KV cache.
    pub first_pos: usize,
    /// KV block ids covering at least `first_pos + tokens.len()` positions.
    pub block_table: &'a [u32],
    /// Which rows of logits to return for this chunk.
    pub logits: LogitsWanted,
}

/// Rows of logits a chunk asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill chunk that is not the prompt's last).
    None,
    /// Only after the last token (decode, last prefill chunk).
    Last,
    /// After every token (teacher-forced evaluation, prompt logprobs).
    All,
}

impl LogitsWanted {
    /// How many logit rows a chunk of `n` tokens produces.
    pub fn rows(self, n: usize) -> usize {
        match self {
            LogitsWanted::None => 0,
            LogitsWanted::Last => usize::from(n > 0),
            LogitsWanted::All => n,
        }
    }
}

/// The logits of a forward pass: for each chunk, its rows in order, each `vocab` long.
pub struct Logits {
    pub vocab: usize,
    /// `[sum of rows, vocab]`.
    pub data: Vec<f32>,
    /// Start row of each chunk in `data` and its row count.
    pub spans: Vec<(usize, usize)>,
}

impl Logits {
    /// The logit rows of chunk `i`, `[rows, vocab]`.
    pub fn chunk(&self, i: usize) -> &[f32] {
        let (start, rows) = self.spans[i];
        &self.data[start * self.vocab..(start + rows) * self.vocab]
    }

    /// Mutable view of chunk `i`'s rows.
    pub fn chunk_mut(&mut self, i: usize) -> &mut [f32] {
        let (start, rows) = self.spans[i];
        &mut self.data[start * self.vocab..(start + rows) * self.vocab]
    }

    /// Every chunk's logit rows at once (as [`Logits::chunk_mut`] gives them one at a
    /// time), or an error when the spans do not run back to back from row 0 over exactly
    /// the data (every backend builds them so).
    pub fn rows_mut(&mut self) -> Result<Vec<&mut [f32]>, String> {
        let total: usize = self.spans.iter().map(|s| s.1).sum();
        if total.checked_mul(self.vocab) != Some(self.data.len()) {
            return Err(format!("{} logit values for {total} rows of {}", self.data.len(), self.vocab));
        }
        let mut out = Vec::with_capacity(self.spans.len());
        let mut rest: &mut [f32] = &mut self.data;
        let mut at = 0;
        for &(start, rows) in &self.spans {
            if start != at {
                return Err(format!("logit rows of a chunk start at {start}, expected {at}"));
            }
            let (chunk, tail) = std::mem::take(&mut rest).split_at_mut(rows * self.vocab);
            out.push(chunk);
            rest = tail;
            at += rows;
        }
        Ok(out)
    }
}

/// The largest of `ids` (0 for none) as a `usize`.
fn max_id(ids: &[u32]) -> usize {
    ids.iter().copied().max().unwrap_or(0) as usize
}

/// Rejects a batch that would index outside the vocabulary or the KV cache: every
/// backend calls this before touching memory, so bad ids are an error, never a wild read.
/// A step also writes each token's K/V to a slot of its own, so it never holds more tokens
/// than the cache has slots: that bounds the activations a message can make a backend
/// allocate (a long table of one repeated block would otherwise let it ask for any size).
///
/// `max_positions`: positions the backend can place (the GPU backends' RoPE table; the
/// model's context on the CPU). The GPU step index is a dense `[chunks, longest table]` array, so
/// that product is capped too (legitimate steps stay far below it: 1,024 sequences of 128k
/// positions in 16-position blocks are 8M entries).
pub fn validate_chunks(
    chunks: &[SeqChunk],
    vocab: usize,
    num_blocks: usize,
    block_size: usize,
    max_positions: usize,
) -> Result<(), crate::error::WorkerError> {
    use crate::error::WorkerError;
    const MAX_TABLE_ENTRIES: usize = 1 << 25;
    let slots = num_blocks.saturating_mul(block_size);
    let total = chunks.iter().fold(0usize, |n, s| n.saturating_add(s.tokens.len()));
    if total > slots {
        return Err(WorkerError::InvalidBatch(format!(
            "{total} tokens in one step, the KV cache has {slots} slots ({num_blocks} blocks of {block_size})"
        )));
    }
    for (i, s) in chunks.iter().enumerate() {
        if s.tokens.is_empty() {
            return Err(WorkerError::InvalidBatch(format!("chunk {i} has no tokens")));
        }
        // Here and for the tables (thousands of entries a step): the largest id first, a
        // loop the compiler vectorises; the offending one only for the message.
        if max_id(s.tokens) >= vocab {
            let t = s.tokens.iter().find(|&&t| t as usize >= vocab).copied().unwrap_or_default();
            return Err(WorkerError::InvalidBatch(format!(
                "chunk {i}: token id {t} outside the vocabulary of {vocab}"
            )));
        }
        let end = s.first_pos.saturating_add(s.tokens.len());
        if end > max_positions {
            return Err(WorkerError::InvalidBatch(format!(
                "chunk {i}: positions up to {end}, the model places {max_positions}"
            )));
        }
        if s.block_table.len().saturating_mul(block_size) < end {
            return Err(WorkerError::InvalidBatch(format!(
                "chunk {i}: block table covers {} positions, {end} needed",
                s.block_table.len() * block_size
            )));
        }
        if max_id(s.block_table) >= num_blocks {
            let b = s.block_table.iter().find(|&&b| b as usize >= num_blocks).copied().unwrap_or_default();
            return Err(WorkerError::InvalidBatch(format!("chunk {i}: block id {b} >= {num_blocks}")));
        }
    }
    let longest = chunks
        .iter()
        .map(|s| s.first_pos.saturating_add(s.tokens.len()).div_ceil(block_size.max(1)))
        .max()
        .unwrap_or(0);
    if chunks.len().saturating_mul(longest) > MAX_TABLE_ENTRIES {
        return Err(WorkerError::InvalidBatch(format!(
            "{} chunks x {longest} blocks of block table in one step (at most {MAX_TABLE_ENTRIES} entries)",
            chunks.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Logits;

    fn logits(spans: Vec<(usize, usize)>, rows: usize) -> Logits {
        Logits { vocab: 3, data: (0..rows * 3).map(|v| v as f32).collect(), spans }
    }

    #[test]
    fn rows_mut_gives_each_chunk_its_rows() {
        // Chunks of 2, 0 (no logits wanted) and 1 rows.
        let mut l = logits(vec![(0, 2), (2, 0), (2, 1)], 3);
        let want: Vec<Vec<f32>> = (0..3).map(|i| l.chunk_mut(i).to_vec()).collect();
        let rows = l.rows_mut().unwrap();
        assert_eq!(rows.len(), 3);
        for (got, want) in rows.iter().zip(&want) {
            assert_eq!(&got[..], &want[..]);
        }
        assert_eq!(&rows[0][..], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert!(rows[1].is_empty());
        assert_eq!(&rows[2][..], &[6.0, 7.0, 8.0]);
    }

    #[test]
    fn rows_mut_refuses_spans_that_do_not_cover_the_data() {
        assert!(logits(vec![(0, 2)], 3).rows_mut().is_err(), "a row left over");
        assert!(logits(vec![(0, 2), (2, 2)], 3).rows_mut().is_err(), "short data");
        assert!(logits(vec![(1, 2)], 3).rows_mut().is_err(), "a gap before the first chunk");
        assert!(logits(vec![(0, 1), (2, 1), (1, 1)], 3).rows_mut().is_err(), "out of order");
        assert!(logits(vec![], 0).rows_mut().unwrap().is_empty());
    }
}
