//! SentencePiece (BPE-style) tokenization of one text fragment, as llama.cpp's
//! `llm_tokenizer_spm_session` does it: spaces are already escaped to `▁`; start from the
//! UTF-8 characters, repeatedly merge the adjacent pair whose concatenation is a vocabulary
//! token with the highest score (leftmost on ties), then emit each final symbol's id, or
//! its bytes as `<0xXX>` tokens when it is not in the vocabulary.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::error::{Result, TokenizerError};
use super::vocab::Vocab;

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge; the heap pops the highest score, then the lowest left index.
struct Bigram {
    score: f32,
    left: usize,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

/// Tokenizes `text` (spaces already `▁`) and appends the ids to `out`.
pub(crate) fn tokenize(vocab: &Vocab, text: &str, out: &mut Vec<u32>) -> Result<()> {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (start, c) in text.char_indices() {
        let i = symbols.len();
        symbols.push(Symbol { start, len: c.len_utf8(), prev: i.checked_sub(1), next: None });
        if i > 0 {
            symbols[i - 1].next = Some(i);
        }
    }
    let mut queue = BinaryHeap::new();
    let push = |queue: &mut BinaryHeap<Bigram>, symbols: &[Symbol], left: usize| {
        let Some(right) = symbols[left].next else {
            return;
        };
        let (l, r) = (&symbols[left], &symbols[right]);
        let joined = &text[l.start..r.start + r.len];
        if let Some(id) = vocab.text_to_id(joined) {
            let score = vocab.scores.get(id as usize).copied().unwrap_or(0.0);
            queue.push(Bigram { score, left, size: joined.len() });
        }
    };
    for left in 0..symbols.len() {
        push(&mut queue, &symbols, left);
    }
    while let Some(Bigram { left, size, .. }) = queue.pop() {
        let Some(right) = symbols[left].next else {
            continue;
        };
        let (l, r) = (symbols[left], symbols[right]);
        if l.len == 0 || r.len == 0 || l.len + r.len != size {
            continue;
        }
        symbols[left].len += r.len;
        symbols[right].len = 0;
        symbols[left].next = r.next;
        if let Some(after) = r.next {
            symbols[after].prev = Some(left);
        }
        if let Some(before) = symbols[left].prev {
            push(&mut queue, &symbols, before);
        }
        push(&mut queue, &symbols, left);
    }
    // Every merged symbol is a token by construction; only unmerged characters can miss.
    for s in symbols.iter().filter(|s| s.len > 0) {
        let piece = &text[s.start..s.start + s.len];
        if let Some(id) = vocab.text_to_id(piece) {
            out.push(id);
            continue;
        }
        for &b in piece.as_bytes() {
            match vocab.byte_to_id(b).or(vocab.special.unk) {
                Some(id) => out.push(id),
                None => return Err(TokenizerError::NoByteToken(b)),
            }
        }
    }
    Ok(())
}
