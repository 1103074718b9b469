//! The host side of a GPU step's index data, shared by the CUDA and HIP forward passes: the
//! batch's chunks stacked into one token list (ids, positions, KV cache slots) with each
//! sequence's block table, context length and query range, and the rows whose logits are
//! wanted. A backend uploads these arrays once per step; every layer's kernels read them.

use crate::batch::SeqChunk;

/// One step's index arrays, built on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostIndex {
    /// `[T]` token ids, positions and cache slots (`block * block_size + offset`).
    pub ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    /// `[chunks, max_blocks]` block tables; entries past a sequence's context are 0.
    pub tables: Vec<u32>,
    pub max_blocks: usize,
    /// `[chunks]` positions cached after the step (the chunk's own included).
    pub ctx: Vec<u32>,
    /// `[chunks + 1]` query offsets: chunk `i` owns tokens `cu_q[i]..cu_q[i + 1]`.
    pub cu_q: Vec<u32>,
    /// The longest chunk (1: a pure decode step).
    pub max_q: usize,
    /// `(first row, rows)` of the stacked batch whose logits are wanted, per chunk.
    pub picked: Vec<(usize, usize)>,
}

impl HostIndex {
    /// The index of `chunks` (validated by `batch::validate_chunks`: every table covers its
    /// chunk's positions).
    pub(crate) fn build(chunks: &[SeqChunk], block_size: usize) -> Self {
        let t: usize = chunks.iter().map(|s| s.tokens.len()).sum();
        let (mut ids, mut positions, mut slots) = (Vec::with_capacity(t), Vec::with_capacity(t), Vec::with_capacity(t));
        let max_blocks = chunks.iter().map(|s| (s.first_pos + s.tokens.len()).div_ceil(block_size)).max().unwrap_or(1);
        let mut tables = vec![0u32; chunks.len() * max_blocks];
        let (mut ctx, mut cu_q) = (Vec::with_capacity(chunks.len()), Vec::with_capacity(chunks.len() + 1));
        let mut picked = Vec::with_capacity(chunks.len());
        let (mut row, mut max_q) = (0usize, 0usize);
        cu_q.push(0u32);
        for (i, s) in chunks.iter().enumerate() {
            let n = s.tokens.len();
            ids.extend_from_slice(s.tokens);
            for p in s.first_pos..s.first_pos + n {
                positions.push(p as u32);
                slots.push(slot_of(s.block_table, p, block_size));
            }
            let used = (s.first_pos + n).div_ceil(block_size);
            tables[i * max_blocks..i * max_blocks + used].copy_from_slice(&s.block_table[..used]);
            ctx.push((s.first_pos + n) as u32);
            row += n;
            cu_q.push(row as u32);
            max_q = max_q.max(n);
            let rows = s.logits.rows(n);
            picked.push((row - rows, rows));
        }
        HostIndex { ids, positions, slots, tables, max_blocks, ctx, cu_q, max_q, picked }
    }

    /// The longest context of the step.
    pub(crate) fn max_context(&self) -> usize {
        self.ctx.iter().copied().max().unwrap_or(0) as usize
    }
}

/// Wanted logit rows in all, of a step's `picked` spans.
pub(crate) fn rows_of(picked: &[(usize, usize)]) -> usize {
    picked.iter().map(|p| p.1).sum()
}

/// Each chunk's (first row, rows) in the step's logits, which hold only the wanted rows of
/// `picked` (`(first row of the batch, rows)` per chunk).
pub(crate) fn spans_of(picked: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut at = 0;
    picked
        .iter()
        .map(|&(_, n)| {
            at += n;
            (at - n, n)
        })
        .collect()
}

/// The cache slot (`block * block_size + offset`) of position `p` (the table covers it:
/// `validate_chunks` checked).
pub(crate) fn slot_of(table: &[u32], p: usize, block_size: usize) -> u32 {
    table[p / block_size] * block_size as u32 + (p % block_size) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::LogitsWanted;

    #[test]
    fn a_mixed_batch_stacks_its_chunks() {
        // A 5-token prefill from 0 (last row wanted), a decode at position 17, a 3-token chunk
        // after 30 positions wanting all rows; blocks of 8.
        let (t0, t1, t2) = ([11u32, 12, 13, 14, 15], [21u32], [31u32, 32, 33]);
        let (b0, b1, b2) = ([7u32], [3u32, 9, 4], [1u32, 2, 5, 6, 8]);
        let chunks = [
            SeqChunk { tokens: &t0, first_pos: 0, block_table: &b0, logits: LogitsWanted::Last },
            SeqChunk { tokens: &t1, first_pos: 17, block_table: &b1, logits: LogitsWanted::Last },
            SeqChunk { tokens: &t2, first_pos: 30, block_table: &b2, logits: LogitsWanted::All },
        ];
        let ix = HostIndex::build(&chunks, 8);
        assert_eq!(ix.ids, [11, 12, 13, 14, 15, 21, 31, 32, 33]);
        assert_eq!(ix.positions, [0, 1, 2, 3, 4, 17, 30, 31, 32]);
        // Position 17 is block 2 of its table (id 4), offset 1; 30..32 are ids 6 and 8.
        assert_eq!(ix.slots, [56, 57, 58, 59, 60, 33, 54, 55, 64]);
        assert_eq!(ix.max_blocks, 5);
        assert_eq!(ix.tables, [7, 0, 0, 0, 0, 3, 9, 4, 0, 0, 1, 2, 5, 6, 8]);
        assert_eq!(ix.ctx, [5, 18, 33]);
        assert_eq!(ix.cu_q, [0, 5, 6, 9]);
        assert_eq!((ix.max_q, ix.max_context(), rows_of(&ix.picked)), (5, 33, 5));
        assert_eq!(ix.picked, [(4, 1), (5, 1), (6, 3)]);
        assert_eq!(spans_of(&ix.picked), [(0, 1), (1, 1), (2, 3)]);
    }
}
