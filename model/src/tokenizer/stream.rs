//! Incremental detokenization for streaming: feed generated ids one at a time and get
//! back text that never ends in a broken UTF-8 sequence. A character split over several
//! byte tokens (an emoji, a CJK character from a byte-fallback vocabulary) is held back
//! until its last byte arrives; bytes that can never form a character are emitted as
//! U+FFFD as soon as that is certain, and [`DecodeStream::finish`] flushes a truncated tail
//! as U+FFFD.
//!
//! GGUF vocabularies stream token pieces (llama.cpp's server does the same: generated text
//! is the concatenation of `token_to_piece`, without `detokenize`'s space clean-up).
//! Hugging Face tokenizers, whose decoders may look across tokens, stream by decoding a
//! short window of ids and emitting what it adds, the way TGI and `tokenizers` do.

use super::error::Result;
use super::{Inner, Tokenizer};

/// Streaming detokenizer; see the module docs. Created by [`Tokenizer::decode_stream`].
pub struct DecodeStream<'a> {
    tokenizer: &'a Tokenizer,
    skip_special: bool,
    state: State,
}

enum State {
    /// Bytes received but not yet emitted: at most one incomplete UTF-8 sequence.
    Bytes { pending: Vec<u8>, piece: Vec<u8> },
    /// `ids[..read]` have been emitted; `ids[..prefix]` is decode context only.
    Window { ids: Vec<u32>, prefix: usize, read: usize },
}

impl<'a> DecodeStream<'a> {
    pub(crate) fn new(tokenizer: &'a Tokenizer, skip_special: bool) -> Self {
        let state = match &tokenizer.inner {
            Inner::Native(_) => State::Bytes { pending: Vec::new(), piece: Vec::new() },
            Inner::Hf(_) => State::Window { ids: Vec::new(), prefix: 0, read: 0 },
        };
        Self { tokenizer, skip_special, state }
    }

    /// Adds one id; returns the text that became complete (often empty mid-character).
    pub fn step(&mut self, id: u32) -> Result<String> {
        match (&mut self.state, &self.tokenizer.inner) {
            (State::Bytes { pending, piece }, Inner::Native(native)) => {
                piece.clear();
                native.piece(id, !self.skip_special, piece)?;
                pending.extend_from_slice(piece);
                Ok(take_complete(pending))
            }
            (State::Window { ids, prefix, read }, Inner::Hf(hf)) => {
                ids.push(id);
                let before = hf.decode(&ids[*prefix..*read], self.skip_special)?;
                let after = hf.decode(&ids[*prefix..], self.skip_special)?;
                if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
                    let new_text = match after.strip_prefix(before.as_str()) {
                        Some(rest) => rest.to_string(),
                        // A decoder rewrote earlier text; emit what differs from here on.
                        None => after.get(before.len()..).unwrap_or_default().to_string(),
                    };
                    // Keep one emitted token as context for the next window.
                    ids.drain(..*prefix);
                    *read -= *prefix;
                    *prefix = *read;
                    *read = ids.len();
                    Ok(new_text)
                } else {
                    Ok(String::new())
                }
            }
            // The state is chosen from the same `inner` in `new`.
            _ => Ok(String::new()),
        }
    }

    /// Ends the stream: whatever is still held back, with U+FFFD for bytes that never
    /// completed a character.
    pub fn finish(&mut self) -> Result<String> {
        match (&mut self.state, &self.tokenizer.inner) {
            (State::Bytes { pending, .. }, _) => {
                let text = String::from_utf8_lossy(pending).into_owned();
                pending.clear();
                Ok(text)
            }
            (State::Window { ids, prefix, read }, Inner::Hf(hf)) => {
                let before = hf.decode(&ids[*prefix..*read], self.skip_special)?;
                let after = hf.decode(&ids[*prefix..], self.skip_special)?;
                ids.clear();
                (*prefix, *read) = (0, 0);
                Ok(after.get(before.len()..).unwrap_or_default().to_string())
            }
            _ => Ok(String::new()),
        }
    }
}

/// Removes and returns the longest prefix of `pending` that is complete text, turning
/// invalid bytes into U+FFFD; an incomplete sequence at the end stays in `pending`.
fn take_complete(pending: &mut Vec<u8>) -> String {
    let mut out = String::new();
    let mut start = 0;
    loop {
        match std::str::from_utf8(&pending[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = pending.len();
                break;
            }
            Err(e) => {
                let valid = start + e.valid_up_to();
                // `valid_up_to` marks a UTF-8 boundary, so this cannot fail.
                out.push_str(std::str::from_utf8(&pending[start..valid]).unwrap_or_default());
                match e.error_len() {
                    Some(bad) => {
                        out.push('\u{FFFD}');
                        start = valid + bad;
                    }
                    None => {
                        start = valid;
                        break;
                    }
                }
            }
        }
    }
    pending.drain(..start);
    out
}

#[cfg(test)]
mod tests {
    use super::take_complete;

    #[test]
    fn holds_incomplete_sequences_and_replaces_invalid_bytes() {
        let mut p = vec![b'a', 0xF0, 0x9F];
        assert_eq!(take_complete(&mut p), "a");
        assert_eq!(p, [0xF0, 0x9F]);
        p.extend_from_slice(&[0x99, 0x82, b'b']);
        assert_eq!(take_complete(&mut p), "🙂b");
        assert!(p.is_empty());
        // 0xFF can never start a character: replaced at once, the rest still flows.
        p.extend_from_slice(&[0xFF, b'c', 0xE4, 0xB8]);
        assert_eq!(take_complete(&mut p), "\u{FFFD}c");
        assert_eq!(p, [0xE4, 0xB8]);
        // A lead byte followed by a non-continuation is invalid, not incomplete.
        p.push(b'd');
        assert_eq!(take_complete(&mut p), "\u{FFFD}d");
        assert!(p.is_empty());
    }
}
