//! Splitting special tokens out of text before the text is tokenized, as llama.cpp's
//! `tokenizer_st_partition` does: for each special token, longest text first, every
//! occurrence in the still-unprocessed text pieces becomes that token's id. With
//! `parse_special == false` control and unknown tokens are left in the text (so a user
//! typing `<|im_start|>` gets ordinary tokens), but user-defined tokens are still split,
//! as Hugging Face's added tokens are.

use super::vocab::{attr, Vocab};

/// A piece of the input: text still to tokenize, or a token already decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

/// Cuts `text` into text fragments and special-token ids, in order.
pub(crate) fn partition<'t>(vocab: &Vocab, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
    let mut fragments = Vec::new();
    if text.is_empty() {
        return fragments;
    }
    fragments.push(Fragment::Text(text));
    for &id in &vocab.special_cache {
        let a = vocab.attr(id);
        if !parse_special && a & (attr::CONTROL | attr::UNKNOWN) != 0 {
            continue;
        }
        let Some(needle) = vocab.tokens.get(id as usize) else {
            continue;
        };
        // Cheap skip: most special tokens appear in no fragment.
        if !fragments.iter().any(|f| matches!(f, Fragment::Text(t) if t.contains(needle.as_str()))) {
            continue;
        }
        let mut next = Vec::with_capacity(fragments.len() + 2);
        for fragment in fragments {
            match fragment {
                Fragment::Text(t) => split_one(t, needle, id, a, &mut next),
                token => next.push(token),
            }
        }
        fragments = next;
    }
    fragments
}

/// Splits every occurrence of `needle` out of `text`, honouring the token's strip flags
/// (whitespace on its left / right side is swallowed).
fn split_one<'t>(text: &'t str, needle: &str, id: u32, a: u32, out: &mut Vec<Fragment<'t>>) {
    let mut rest = text;
    while let Some(pos) = rest.find(needle) {
        let mut left = &rest[..pos];
        if a & attr::LSTRIP != 0 {
            left = left.trim_end_matches(|c: char| c.is_ascii_whitespace() || c == '\x0b');
        }
        if !left.is_empty() {
            out.push(Fragment::Text(left));
        }
        out.push(Fragment::Token(id));
        rest = &rest[pos + needle.len()..];
        if a & attr::RSTRIP != 0 {
            rest = rest.trim_start_matches(|c: char| c.is_ascii_whitespace() || c == '\x0b');
        }
    }
    if !rest.is_empty() {
        out.push(Fragment::Text(rest));
    }
}
