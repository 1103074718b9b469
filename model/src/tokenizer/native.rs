//! Tessera's own implementation of llama.cpp's tokenizer for GGUF vocabularies: special
//! token splitting, then byte-level BPE (with a named pre-tokenizer) or SentencePiece per
//! text fragment; and the reverse, token pieces and detokenization with llama.cpp's
//! space clean-up.

use super::bpe::{self, BpeRanks};
use super::byte_level;
use super::error::{Result, TokenizerError};
use super::pretokenize::PreTokenizer;
use super::spec::{TokenizerSpec, VocabKind};
use super::special::{self, Fragment};
use super::vocab::{attr, Vocab};

pub(crate) struct NativeTokenizer {
    pub vocab: Vocab,
    pre: Option<PreTokenizer>,
    ranks: BpeRanks,
}

impl NativeTokenizer {
    pub(crate) fn new(spec: &TokenizerSpec) -> Result<Self> {
        let (vocab, pre_config) = Vocab::new(spec)?;
        let pre = pre_config.map(|c| PreTokenizer::new(c.patterns)).transpose()?;
        let ranks = BpeRanks::new(&spec.merges);
        if vocab.kind == VocabKind::Bpe && ranks.is_empty() {
            return Err(TokenizerError::MissingKey("tokenizer.ggml.merges"));
        }
        Ok(Self { vocab, pre, ranks })
    }

    pub(crate) fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let v = &self.vocab;
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && v.add_bos {
            out.extend(v.special.bos);
        }
        // SentencePiece prefixes a space to text that starts the input or follows a
        // special token (llama.cpp's `is_prev_special`, true at the start).
        let mut prev_special = true;
        for fragment in special::partition(v, text, parse_special) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(t) => {
                    match v.kind {
                        VocabKind::Bpe => self.encode_bpe(t, &mut out)?,
                        VocabKind::Spm => {
                            let mut escaped = String::with_capacity(t.len() + 3);
                            if v.add_space_prefix && prev_special {
                                escaped.push('▁');
                            }
                            escaped.push_str(&t.replace(' ', "▁"));
                            super::spm::tokenize(v, &escaped, &mut out)?;
                        }
                    }
                    prev_special = false;
                }
            }
        }
        if add_special && v.add_eos {
            out.extend(v.special.eos);
        }
        Ok(out)
    }

    fn encode_bpe(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let v = &self.vocab;
        let Some(pre) = &self.pre else { return Ok(()) };
        let mut encoded = String::new();
        let mut ranges = Vec::new();
        for word in pre.split(text)? {
            encoded.clear();
            byte_level::encode_into(word, &mut encoded);
            ranges.clear();
            match v.ignore_merges.then(|| v.text_to_id(&encoded)).flatten() {
                Some(id) => {
                    out.push(id);
                    continue;
                }
                None => bpe::merge_word(&encoded, &self.ranks, &mut ranges),
            }
            for r in ranges.iter().cloned() {
                let piece = &encoded[r];
                match v.text_to_id(piece) {
                    Some(id) => out.push(id),
                    // llama.cpp then looks each *byte* of the piece up as a one-byte token,
                    // which only ASCII can match, and drops the rest.
                    None => out.extend(
                        piece
                            .bytes()
                            .filter(u8::is_ascii)
                            .filter_map(|b| std::str::from_utf8(&[b]).ok().and_then(|s| v.text_to_id(s))),
                    ),
                }
            }
        }
        Ok(())
    }

    /// The bytes token `id` stands for. Control and unknown tokens give their text only
    /// when `special` is set; unused and undefined tokens give nothing.
    pub(crate) fn piece(&self, id: u32, special: bool, out: &mut Vec<u8>) -> Result<()> {
        let v = &self.vocab;
        let text = v.tokens.get(id as usize).ok_or(TokenizerError::TokenOutOfRange { id, size: v.len() })?;
        let a = v.attr(id);
        if a & (attr::CONTROL | attr::UNKNOWN) != 0 {
            if special {
                out.extend_from_slice(text.as_bytes());
            }
        } else if a & attr::USER_DEFINED != 0 {
            out.extend_from_slice(text.as_bytes());
        } else if a & attr::NORMAL != 0 {
            match v.kind {
                VocabKind::Bpe => byte_level::decode_into(text, out),
                VocabKind::Spm => out.extend_from_slice(text.replace('▁', " ").as_bytes()),
            }
        } else if a & attr::BYTE != 0 {
            out.push(parse_byte_token(text).ok_or_else(|| {
                TokenizerError::InvalidVocab(format!("byte token {id} is {text:?}, expected <0xXX>"))
            })?);
        }
        Ok(())
    }

    /// llama.cpp's `detokenize`: with `skip_special`, a leading BOS / trailing EOS that the
    /// tokenizer itself adds is dropped and control tokens render as nothing; SentencePiece
    /// drops the prefix space of the first piece; BPE vocabularies with `clean_spaces`
    /// remove spaces before punctuation and some contractions.
    pub(crate) fn decode(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>> {
        let v = &self.vocab;
        let mut ids = ids;
        let mut remove_space = v.add_space_prefix;
        if skip_special && v.add_bos {
            if let (Some(&first), Some(bos)) = (ids.first(), v.special.bos) {
                if first == bos {
                    remove_space = false;
                    ids = &ids[1..];
                }
            }
        }
        if skip_special && v.add_eos {
            if let (Some(&last), Some(eos)) = (ids.last(), v.special.eos) {
                if last == eos {
                    ids = &ids[..ids.len() - 1];
                }
            }
        }
        let mut out = Vec::with_capacity(ids.len() * 4);
        let mut piece = Vec::new();
        for &id in ids {
            piece.clear();
            self.piece(id, !skip_special, &mut piece)?;
            let skip = usize::from(remove_space && piece.first() == Some(&b' '));
            out.extend_from_slice(&piece[skip..]);
            remove_space = false;
        }
        if v.clean_spaces {
            clean_spaces(&mut out);
        }
        Ok(out)
    }
}

/// The byte of a `<0xXX>` token.
pub(crate) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// llama.cpp's three clean-up passes over detokenized bytes: drop the space in " ?", " !",
/// " .", " ,"; turn " ' " into "'"; drop the space before "'s", "'m", "'re", "'ve".
fn clean_spaces(text: &mut Vec<u8>) {
    let mut out: Vec<u8> = Vec::with_capacity(text.len());
    for (i, &x) in text.iter().enumerate() {
        if i > 0 && text[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            out.pop();
        }
        out.push(x);
    }
    let pass1 = std::mem::take(&mut out);
    // llama.cpp blanks the swallowed space in place, so the character after it no longer
    // sees a space before itself.
    let mut i = 0;
    let mut blanked = usize::MAX;
    while i < pass1.len() {
        let x = pass1[i];
        let prev_is_space = i > 0 && i - 1 != blanked && pass1[i - 1] == b' ';
        if x == b'\'' && prev_is_space && pass1.get(i + 1) == Some(&b' ') {
            out.pop();
            out.push(x);
            blanked = i + 1;
            i += 2;
            continue;
        }
        out.push(x);
        i += 1;
    }
    let pass2 = std::mem::take(&mut out);
    for (i, &x) in pass2.iter().enumerate() {
        if i > 0 && pass2[i - 1] == b' ' && x == b'\'' && i + 1 < pass2.len() {
            let x1 = pass2[i + 1];
            let x2 = pass2.get(i + 2).copied();
            let drop = matches!(x1, b's' | b'm') || matches!((x1, x2), (b'r', Some(b'e')) | (b'v', Some(b'e')));
            if drop {
                out.pop();
            }
        }
        out.push(x);
    }
    *text = out;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cleaned(s: &str) -> String {
        let mut v = s.as_bytes().to_vec();
        clean_spaces(&mut v);
        String::from_utf8(v).unwrap()
    }

    #[test]
    fn clean_spaces_matches_llama_cpp_passes() {
        assert_eq!(cleaned("Hi , there ! ok ."), "Hi, there! ok.");
        assert_eq!(cleaned("rock ' n roll"), "rock'n roll");
        assert_eq!(
            cleaned("it 's I 'm we 're they 've I 'll he 'd don 't"),
            "it's I'm we're they've I 'll he 'd don 't"
        );
        assert_eq!(cleaned(" ?"), "?");
        // The second quote follows a swallowed space, so it keeps its own spaces.
        assert_eq!(cleaned("a ' ' b"), "a'' b");
    }

    #[test]
    fn byte_tokens_parse_only_exact_form() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(10));
        assert_eq!(parse_byte_token("<0xff>"), Some(255));
        assert_eq!(parse_byte_token("<0x0A"), None);
        assert_eq!(parse_byte_token("<0x0AB>"), None);
    }
}
