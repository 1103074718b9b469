//! `ByteCodec`: a tokenizer where token `b` (0..=255) is the byte `b`, plus two special
//! tokens, `<|bos|>` (256) and `<|eos|>` (257). Multi-byte characters span several tokens,
//! which exercises the incremental UTF-8 decoding exactly like byte-level BPE does.
//!
//! Chat template: `<|role|>content\n` per message, then `<|assistant|>` when a generation
//! prompt is asked for; a conversation starting with an assistant turn is rejected, the way
//! strict real templates raise on bad role order.

use crate::codec::{ChatMessage, Codec, CodecError, StreamDecoder};

pub const BOS: u32 = 256;
pub const EOS: u32 = 257;
pub const VOCAB: u32 = 258;
const BOS_TEXT: &str = "<|bos|>";
const EOS_TEXT: &str = "<|eos|>";

#[derive(Debug, Clone)]
pub struct ByteCodec {
    name: String,
}

impl ByteCodec {
    pub fn new(name: &str) -> Self {
        ByteCodec { name: name.to_owned() }
    }

    /// The ids of `text` (special-token markers become their ids), without BOS.
    pub fn ids(text: &str) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len());
        let mut rest = text;
        while !rest.is_empty() {
            if let Some(r) = rest.strip_prefix(BOS_TEXT) {
                ids.push(BOS);
                rest = r;
            } else if let Some(r) = rest.strip_prefix(EOS_TEXT) {
                ids.push(EOS);
                rest = r;
            } else {
                let c = rest.chars().next().map_or(1, char::len_utf8);
                ids.extend(rest.as_bytes()[..c].iter().map(|&b| u32::from(b)));
                rest = &rest[c..];
            }
        }
        ids
    }

    fn special(id: u32) -> Option<&'static str> {
        match id {
            BOS => Some(BOS_TEXT),
            EOS => Some(EOS_TEXT),
            _ => None,
        }
    }
}

impl Codec for ByteCodec {
    fn model_name(&self) -> &str {
        &self.name
    }

    fn vocab_size(&self) -> u32 {
        VOCAB
    }

    fn eos_token_ids(&self) -> Vec<u32> {
        vec![EOS]
    }

    fn encode_prompt(&self, text: &str, add_special: bool) -> Result<Vec<u32>, CodecError> {
        let mut ids = if add_special { vec![BOS] } else { Vec::new() };
        ids.extend(Self::ids(text));
        Ok(ids)
    }

    fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, CodecError> {
        if messages.first().is_some_and(|m| m.role == "assistant") {
            return Err(CodecError::Template("the conversation must not start with an assistant message".into()));
        }
        // BOS comes from `encode_prompt(.., true)`, as with a tokenizer that adds it.
        let mut out = String::new();
        for m in messages {
            out.push_str(&format!("<|{}|>{}\n", m.role, m.content));
        }
        if add_generation_prompt {
            out.push_str("<|assistant|>");
        }
        Ok(out)
    }

    fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, CodecError> {
        let mut bytes = Vec::with_capacity(ids.len());
        for &id in ids {
            match (u8::try_from(id), Self::special(id)) {
                (Ok(b), _) => bytes.push(b),
                (_, Some(text)) if !skip_special => bytes.extend_from_slice(text.as_bytes()),
                (_, Some(_)) => {}
                (Err(_), None) => return Err(CodecError::Decode(format!("token id {id} is outside the vocabulary"))),
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn new_stream_decoder(&self) -> Box<dyn StreamDecoder> {
        Box::new(ByteStreamDecoder { pending: Vec::new() })
    }

    fn token_bytes(&self, id: u32) -> Result<Vec<u8>, CodecError> {
        match (u8::try_from(id), Self::special(id)) {
            (Ok(b), _) => Ok(vec![b]),
            (_, Some(text)) => Ok(text.as_bytes().to_vec()),
            _ => Err(CodecError::Decode(format!("token id {id} is outside the vocabulary"))),
        }
    }
}

/// Holds the bytes of an unfinished UTF-8 character; special tokens produce no text.
struct ByteStreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder for ByteStreamDecoder {
    fn push(&mut self, id: u32) -> Result<String, CodecError> {
        match u8::try_from(id) {
            Ok(b) => self.pending.push(b),
            Err(_) if ByteCodec::special(id).is_some() => return Ok(String::new()),
            Err(_) => return Err(CodecError::Decode(format!("token id {id} is outside the vocabulary"))),
        }
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return Ok(out);
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return Ok(out);
                        }
                        // Bytes that can never be valid: replace them and go on.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha8Rng;
    use rand_core::{Rng, SeedableRng};

    /// Streaming any byte sequence must give what decoding it whole gives.
    #[test]
    fn stream_decoding_matches_whole_decoding() {
        let codec = ByteCodec::new("t");
        let mut rng = ChaCha8Rng::seed_from_u64(0xB17E);
        let samples = ["héllo wörld ✓ 🦀", "日本語", "a\u{10FFFF}b"];
        for round in 0..500 {
            let mut ids: Vec<u32> = if round % 2 == 0 {
                ByteCodec::ids(samples[round % samples.len()])
            } else {
                (0..rng.next_u32() % 24).map(|_| rng.next_u32() % 256).collect()
            };
            if round % 5 == 0 {
                ids.insert(ids.len() / 2, EOS);
            }
            let mut d = codec.new_stream_decoder();
            let mut streamed = String::new();
            for &id in &ids {
                streamed.push_str(&d.push(id).unwrap());
            }
            streamed.push_str(&d.finish());
            let whole = codec.decode(&ids, true).unwrap();
            assert_eq!(streamed, whole, "ids {ids:?}");
        }
    }

    #[test]
    fn specials_round_trip() {
        let codec = ByteCodec::new("t");
        let ids = codec.encode_prompt("a<|eos|>é", true).unwrap();
        assert_eq!(ids, vec![BOS, 97, EOS, 0xC3, 0xA9]);
        assert_eq!(codec.decode(&ids, false).unwrap(), "<|bos|>a<|eos|>é");
        assert_eq!(codec.decode(&ids, true).unwrap(), "aé");
        assert!(codec.decode(&[VOCAB], true).is_err());
    }
}
