//! Renders `TokenLogprob`s in the two wire shapes: chat's `logprobs.content[]` (token, logprob,
//! UTF-8 bytes, top alternatives) and completions' parallel lists. A token's text is its raw
//! bytes decoded lossily: a byte-level token may hold part of a character, which `bytes` keeps.

use serde_json::{Map, Value};

use crate::choice::TokenLogprob;
use crate::codec::Codec;
use crate::openai::chat::{ChatLogprobs, ChatTokenLogprob, TopLogprob};
use crate::openai::common::wire_logprob;
use crate::openai::completions::CompletionLogprobs;

/// (text, bytes) of a token. Ids were checked against the vocabulary by the assembler, so a
/// failure here is a codec bug; it renders as an empty token rather than failing the request.
fn token(codec: &dyn Codec, id: u32) -> (String, Vec<u8>) {
    let bytes = codec.token_bytes(id).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

pub fn chat(codec: &dyn Codec, entries: &[TokenLogprob]) -> ChatLogprobs {
    let content = entries
        .iter()
        .map(|e| {
            let (token_text, bytes) = token(codec, e.id);
            let top_logprobs = e
                .top
                .iter()
                .map(|&(id, lp)| {
                    let (token, bytes) = token(codec, id);
                    TopLogprob { token, logprob: wire_logprob(lp), bytes }
                })
                .collect();
            ChatTokenLogprob { token: token_text, logprob: wire_logprob(e.logprob), bytes, top_logprobs }
        })
        .collect();
    ChatLogprobs { content }
}

/// `text_offset` continues from `*offset` (characters of the choice's tokens so far). Each
/// `top_logprobs` map holds the sampled token besides its `logprobs` alternatives, as OpenAI
/// documents (up to `logprobs + 1` entries; with `logprobs: 0` just the sampled token).
pub fn completion(codec: &dyn Codec, entries: &[TokenLogprob], offset: &mut u32) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for e in entries {
        let (text, _) = token(codec, e.id);
        out.text_offset.push(*offset);
        *offset += text.chars().count() as u32;
        out.token_logprobs.push(wire_logprob(e.logprob));
        let mut top: Map<String, Value> =
            e.top.iter().map(|&(id, lp)| (token(codec, id).0, Value::from(wire_logprob(lp)))).collect();
        if !e.top.iter().any(|&(id, _)| id == e.id) {
            top.entry(text.clone()).or_insert_with(|| Value::from(wire_logprob(e.logprob)));
        }
        out.tokens.push(text);
        out.top_logprobs.push(top);
    }
    out
}
