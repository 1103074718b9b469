//! `validate_chunks`, the check every backend runs on a step before touching memory: the
//! bounds a malformed Step message could otherwise use to make a backend read out of range
//! or allocate without limit.

use tessera_worker::batch::{validate_chunks, LogitsWanted, SeqChunk};

fn chunk<'a>(tokens: &'a [u32], first_pos: usize, table: &'a [u32]) -> SeqChunk<'a> {
    SeqChunk { tokens, first_pos, block_table: table, logits: LogitsWanted::Last }
}

#[test]
fn steps_are_bounded_by_the_cache_and_the_positions() {
    let (vocab, blocks, bs) = (100, 8, 4);
    let table = [0u32, 1, 2];
    let ok = validate_chunks(&[chunk(&[1, 2, 3], 0, &table)], vocab, blocks, bs, 64);
    assert!(ok.is_ok(), "{ok:?}");
    let err = |chunks: &[SeqChunk], max_pos| {
        validate_chunks(chunks, vocab, blocks, bs, max_pos).expect_err("refused").to_string()
    };
    // A position the backend cannot place (the GPU's RoPE table ends at max_pos).
    assert!(err(&[chunk(&[1, 2, 3], 8, &[0, 1, 2])], 10).contains("positions up to 11"));
    // first_pos near usize::MAX: no wrap-around past the table check.
    assert!(err(&[chunk(&[1, 2], usize::MAX - 1, &table)], usize::MAX).contains("block table covers 12 positions"));
    // More tokens than the cache's 32 slots, through a table repeating one block.
    let long = vec![1u32; 33];
    let repeated = vec![0u32; 9];
    assert!(err(&[chunk(&long, 0, &repeated)], usize::MAX).contains("33 tokens in one step"));
    // Outside the vocabulary, outside the cache, a table too short.
    assert!(err(&[chunk(&[100], 0, &table)], 64).contains("outside the vocabulary"));
    assert!(err(&[chunk(&[1], 0, &[8])], 64).contains("block id 8"));
    assert!(err(&[chunk(&[1], 12, &table)], 64).contains("block table covers 12 positions"));
}

/// The GPU step index is a dense [chunks x longest table] array: one chunk far into a
/// context (its table repeating a block) next to many one-token chunks must not size it.
#[test]
fn the_dense_block_table_of_a_step_is_capped() {
    let (vocab, blocks, bs) = (100, 64, 16); // 1,024 slots
    let far = 3 << 20; // 3M positions: 196,608 blocks
    let table = vec![0u32; far / bs + 1];
    let one = [1u32];
    let mut chunks = vec![chunk(&one, far, &table)];
    chunks.extend((0..200).map(|_| chunk(&one, 0, &table)));
    let e = validate_chunks(&chunks, vocab, blocks, bs, usize::MAX).expect_err("refused").to_string();
    assert!(e.contains("201 chunks x 196609 blocks"), "{e}");
    // The same long chunk alone is within the cap.
    assert!(validate_chunks(&chunks[..1], vocab, blocks, bs, usize::MAX).is_ok());
}
