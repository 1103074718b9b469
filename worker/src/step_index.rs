//! The host side of a GPU step's index data, shared by the CUDA and HIP forward passes: the
//! batch's chunks stacked into one token list (ids, positions, KV cache slots) with each
//! sequence's block table, context length and query range, and the rows whose logits are
//! wanted. A backend uploads these arrays once per step; every layer's kernels read them.

use tessera_kernels::cuda::FROM_SAMPLED;

use crate::batch::SeqChunk;
use crate::error::WorkerError;

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

/// The block of a decode graph's table mirror that [`update_mirror`] changed: rows
/// `rows`, columns `cols` (entries of `[rows, max_blocks]`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct TableDelta {
    pub rows: std::ops::Range<usize>,
    pub cols: std::ops::Range<usize>,
}

/// Writes decode chunks' used block-table entries (chunk `i` into row `i` of `mirror`,
/// `[rows, mb]`, the host copy of a graph's device tables) and returns the smallest block
/// that holds every entry that changed, or `None`. A decode step usually appends a block
/// to a few sequences: the block is then one or two columns wide, where copying whole rows
/// of the rows between the first and the last changed one would move the whole mirror
/// when those sequences sit at both ends of the batch. The rest of the block is unchanged
/// entries, which the device already holds (the mirror changes only through this, or is
/// filled with `u32::MAX` after a failed upload so that every used entry differs).
///
/// Every chunk's used blocks (`first_pos + tokens` positions) must fit a row (`<= mb`, as
/// the graph's choice in `CudaModel::step` ensures) and `mirror` must hold a row per chunk.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn update_mirror(
    mirror: &mut [u32],
    mb: usize,
    chunks: &[SeqChunk],
    block_size: usize,
) -> Option<TableDelta> {
    debug_assert!(chunks.len().saturating_mul(mb) <= mirror.len(), "a mirror row per chunk");
    let mut rows: Option<(usize, usize)> = None;
    let (mut c0, mut c1) = (usize::MAX, 0);
    for (i, s) in chunks.iter().enumerate() {
        let used = (s.first_pos + s.tokens.len()).div_ceil(block_size);
        let (row, new) = (&mut mirror[i * mb..i * mb + used], &s.block_table[..used]);
        if row != new {
            let first = row.iter().zip(new).position(|(a, b)| a != b).unwrap_or(used);
            row[first..].copy_from_slice(&new[first..]);
            rows = Some(rows.map_or((i, i), |(a, _)| (a, i)));
            (c0, c1) = (c0.min(first), c1.max(used));
        }
    }
    rows.map(|(a, z)| TableDelta { rows: a..z + 1, cols: c0..c1 })
}

/// Checks a step's chunks that take their one token from the previous step's sampled rows
/// (`rows[i]`: chunk `i`'s row there, `None`: its own token; empty: no chunk does):
/// one entry per chunk, each such chunk one token long, each row below `sampled` (the
/// rows sampled before; `None`: nothing was). Returns whether any chunk does.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn check_from_sampled(
    chunks: &[SeqChunk],
    rows: &[Option<u32>],
    sampled: Option<usize>,
) -> Result<bool, WorkerError> {
    if rows.iter().all(Option::is_none) {
        return Ok(false);
    }
    let bad = |m: String| Err(WorkerError::InvalidBatch(m));
    if rows.len() != chunks.len() {
        return bad(format!("{} sampled-row entries for {} chunks", rows.len(), chunks.len()));
    }
    let Some(sampled) = sampled else {
        return bad("a chunk takes a sampled token, but nothing was sampled before".into());
    };
    for (i, (c, r)) in chunks.iter().zip(rows).enumerate() {
        let Some(r) = *r else { continue };
        if c.tokens.len() != 1 {
            return bad(format!("chunk {i} takes a sampled token but has {} tokens", c.tokens.len()));
        }
        if r as usize >= sampled || r & FROM_SAMPLED != 0 {
            return bad(format!("chunk {i} takes sampled row {r} of {sampled}"));
        }
    }
    Ok(true)
}

/// Flags the ids of the chunks [`check_from_sampled`] passed: chunk `i`'s first token,
/// at `ids[start(i)]`, becomes `FROM_SAMPLED | rows[i]`, which the device replaces with
/// that sampled token (`Device::take_sampled_ids`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn flag_from_sampled(ids: &mut [u32], rows: &[Option<u32>], start: impl Fn(usize) -> usize) {
    for (i, r) in rows.iter().enumerate() {
        if let Some(r) = *r {
            ids[start(i)] = FROM_SAMPLED | r;
        }
    }
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

    fn decode(tokens: &[u32; 1], first_pos: usize, table: &[u32]) -> SeqChunk<'static> {
        // Leaked so the chunks can outlive the loop that builds them (test only).
        let (t, b): (&'static [u32], &'static [u32]) = (Box::leak(Box::new(*tokens)), Box::leak(table.into()));
        SeqChunk { tokens: t, first_pos, block_table: b, logits: LogitsWanted::Last }
    }

    #[test]
    fn appends_at_both_ends_of_a_batch_change_one_column() {
        let (mb, bs) = (8, 4);
        let mut mirror = vec![0u32; 4 * mb];
        let tables: Vec<Vec<u32>> = (0..4u32).map(|i| (0..8).map(|j| 100 * i + j + 1).collect()).collect();
        // Four sequences of tables 8 blocks long, at positions from 10 (blocks of 4).
        let step = |pos: &[usize]| -> Vec<SeqChunk<'static>> {
            pos.iter().enumerate().map(|(i, &p)| decode(&[1], p, &tables[i])).collect()
        };
        // Position p uses (p + 1) / 4 blocks, rounded up: 10 and 11 use 3, 12..15 use 4.
        let first = update_mirror(&mut mirror, mb, &step(&[10, 11, 10, 11]), bs);
        assert_eq!(first, Some(TableDelta { rows: 0..4, cols: 0..3 }));
        assert_eq!(update_mirror(&mut mirror, mb, &step(&[10, 11, 10, 11]), bs), None, "nothing changed");
        let d = update_mirror(&mut mirror, mb, &step(&[11, 11, 11, 12]), bs);
        assert_eq!(d, Some(TableDelta { rows: 3..4, cols: 3..4 }));
        let d = update_mirror(&mut mirror, mb, &step(&[12, 12, 11, 13]), bs);
        assert_eq!(d, Some(TableDelta { rows: 0..2, cols: 3..4 }));
        // The first and the last row take a fifth block: one column of all four rows travels,
        // not the rows' whole width.
        let d = update_mirror(&mut mirror, mb, &step(&[16, 13, 11, 16]), bs);
        assert_eq!(d, Some(TableDelta { rows: 0..4, cols: 4..5 }));
        for (i, used) in [5, 4, 3, 5].into_iter().enumerate() {
            assert_eq!(&mirror[i * mb..i * mb + used], &tables[i][..used], "row {i}");
        }
        // A new sequence in row 1 (another table): its row changes from its first entry.
        let other: Vec<u32> = (0..8).map(|j| 900 + j).collect();
        let chunks = [decode(&[1], 16, &tables[0]), decode(&[1], 13, &other), decode(&[1], 11, &tables[2])];
        let d = update_mirror(&mut mirror, mb, &chunks, bs);
        assert_eq!(d, Some(TableDelta { rows: 1..2, cols: 0..4 }));
        assert_eq!(&mirror[mb..mb + 4], &other[..4]);
    }

    /// Steps of a batch whose rows append blocks at staggered times and sometimes change
    /// sequence (a new table in that row): copying each step's delta from the mirror into
    /// a second array (the device's tables) keeps every used entry equal to the chunk's.
    #[test]
    fn the_deltas_keep_a_device_copy_equal_to_every_chunks_table() {
        let (rows, mb, bs) = (12usize, 16usize, 4usize);
        let (mut mirror, mut device) = (vec![0u32; rows * mb], vec![0u32; rows * mb]);
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut pos: Vec<usize> = (0..rows).map(|i| i * 3 % 20).collect();
        let mut tables: Vec<Vec<u32>> = (0..rows).map(|_| (0..mb).map(|_| (next() % 1000) as u32).collect()).collect();
        let mut narrow = 0;
        for _ in 0..200 {
            for i in 0..rows {
                if next() % 17 == 0 {
                    // A new sequence takes the row.
                    tables[i] = (0..mb).map(|_| (next() % 1000) as u32).collect();
                    pos[i] = (next() % 20) as usize;
                } else {
                    pos[i] = (pos[i] + 1) % (mb * bs);
                }
            }
            let chunks: Vec<SeqChunk> = (0..rows).map(|i| decode(&[1], pos[i], &tables[i])).collect();
            if let Some(d) = update_mirror(&mut mirror, mb, &chunks, bs) {
                narrow += usize::from(d.cols.len() < mb / 2);
                for r in d.rows.clone() {
                    let span = r * mb + d.cols.start..r * mb + d.cols.end;
                    device[span.clone()].copy_from_slice(&mirror[span]);
                }
            }
            for (i, c) in chunks.iter().enumerate() {
                let used = (c.first_pos + 1).div_ceil(bs);
                assert_eq!(&device[i * mb..i * mb + used], &c.block_table[..used], "row {i}");
            }
        }
        assert!(narrow > 50, "most deltas are narrow: {narrow} of 200");
    }

    #[test]
    fn chunks_take_sampled_rows_only_when_valid() {
        let (one, two, table) = ([5u32], [5u32, 6], [3u32, 4]);
        let chunk = |tokens| SeqChunk { tokens, first_pos: 2, block_table: &table, logits: LogitsWanted::Last };
        let chunks = [chunk(&two[..]), chunk(&one[..]), chunk(&one[..])];
        assert!(!check_from_sampled(&chunks, &[], None).unwrap(), "no entries: own tokens");
        assert!(!check_from_sampled(&chunks, &[None, None, None], None).unwrap());
        assert!(check_from_sampled(&chunks, &[None, Some(3), Some(0)], Some(4)).unwrap());
        let refused = |rows: &[Option<u32>], sampled| {
            matches!(check_from_sampled(&chunks, rows, sampled), Err(WorkerError::InvalidBatch(_)))
        };
        assert!(refused(&[None, Some(4), None], Some(4)), "row past the sampled ones");
        assert!(refused(&[None, Some(0), None], None), "nothing sampled before");
        assert!(refused(&[Some(0), None, None], Some(4)), "a two-token chunk");
        assert!(refused(&[None, Some(0)], Some(4)), "an entry per chunk");
        assert!(refused(&[None, Some(FROM_SAMPLED), None], Some(usize::MAX)), "a row with the flag bit");

        // The stacked ids of a 2-token chunk then two decodes: the decodes' ids at 2 and 3.
        let mut ids = vec![5, 6, 5, 5];
        let starts = [0usize, 2, 3];
        flag_from_sampled(&mut ids, &[None, Some(3), Some(0)], |i| starts[i]);
        assert_eq!(ids, [5, 6, FROM_SAMPLED | 3, FROM_SAMPLED]);
    }
}
