//! Byte-pair merging of one pre-tokenized word, as llama.cpp's `llm_tokenizer_bpe_session`
//! does it: start from the word's characters, repeatedly merge the adjacent pair with the
//! lowest merge rank (leftmost first on ties), then look each final symbol up in the vocab.
//! Symbols that are not tokens fall back to one token per byte.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Merge ranks, keyed by "left right" (the merge line as stored, split at its first space
/// after the first byte, as llama.cpp splits it).
pub(crate) struct BpeRanks {
    ranks: HashMap<String, u32>,
}

impl BpeRanks {
    pub(crate) fn new(merges: &[String]) -> Self {
        let mut ranks = HashMap::with_capacity(merges.len());
        for (rank, line) in merges.iter().enumerate() {
            let Some(pos) = line.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                continue;
            };
            let key = format!("{} {}", &line[..pos], &line[pos + 1..]);
            // The first occurrence of a pair keeps its rank.
            ranks.entry(key).or_insert(rank as u32);
        }
        Self { ranks }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.ranks.is_empty()
    }

    /// The rank of merging `left` with `right`; `key` is scratch space.
    fn rank(&self, left: &str, right: &str, key: &mut String) -> Option<u32> {
        key.clear();
        key.push_str(left);
        key.push(' ');
        key.push_str(right);
        self.ranks.get(key.as_str()).copied()
    }
}

/// One symbol of the word: a byte range, linked to its live neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// Merges `word` and appends the byte ranges of its final symbols to `out`.
pub(crate) fn merge_word(word: &str, ranks: &BpeRanks, out: &mut Vec<std::ops::Range<usize>>) {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
    for (start, c) in word.char_indices() {
        let i = symbols.len();
        symbols.push(Symbol { start, len: c.len_utf8(), prev: i.checked_sub(1), next: None });
        if i > 0 {
            symbols[i - 1].next = Some(i);
        }
    }
    // (rank, left index, combined byte length): popped smallest rank, then leftmost.
    let mut queue: BinaryHeap<Reverse<(u32, usize, usize)>> = BinaryHeap::new();
    let mut key = String::new();
    let text = |s: &Symbol| &word[s.start..s.start + s.len];
    let push = |queue: &mut BinaryHeap<_>, symbols: &[Symbol], left: usize, key: &mut String| {
        let Some(right) = symbols[left].next else {
            return;
        };
        let (l, r) = (&symbols[left], &symbols[right]);
        if let Some(rank) = ranks.rank(text(l), text(r), key) {
            queue.push(Reverse((rank, left, l.len + r.len)));
        }
    };
    for left in 0..symbols.len() {
        push(&mut queue, &symbols, left, &mut key);
    }
    while let Some(Reverse((_, left, size))) = queue.pop() {
        let Some(right) = symbols[left].next else {
            continue;
        };
        // A pair is stale once either side has changed: lengths only ever grow, and a
        // symbol merged away has length zero.
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
            push(&mut queue, &symbols, before, &mut key);
        }
        push(&mut queue, &symbols, left, &mut key);
    }
    out.extend(symbols.iter().filter(|s| s.len > 0).map(|s| s.start..s.start + s.len));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn merged(word: &str, merges: &[&str]) -> Vec<String> {
        let ranks = BpeRanks::new(&merges.iter().map(|m| m.to_string()).collect::<Vec<_>>());
        let mut out = Vec::new();
        merge_word(word, &ranks, &mut out);
        out.into_iter().map(|r| word[r].to_string()).collect()
    }

    #[test]
    fn lowest_rank_merges_first() {
        // "b c" outranks "a b", so "abc" becomes a + bc, and then "a bc" applies.
        assert_eq!(merged("abc", &["b c", "a b"]), ["a", "bc"]);
        assert_eq!(merged("abc", &["b c", "a b", "a bc"]), ["abc"]);
        assert_eq!(merged("abc", &["a b", "b c"]), ["ab", "c"]);
    }

    #[test]
    fn ties_merge_leftmost_first() {
        assert_eq!(merged("aaa", &["a a"]), ["aa", "a"]);
        assert_eq!(merged("aaaa", &["a a", "aa aa"]), ["aaaa"]);
    }

    #[test]
    fn multibyte_characters_are_single_symbols() {
        assert_eq!(merged("Ġé", &[]), ["Ġ", "é"]);
        assert_eq!(merged("Ġé", &["Ġ é"]), ["Ġé"]);
    }
}
