//! The streaming detokenizer on the default model: for every llama.cpp fixture (300+ texts
//! and 120 random id sequences, many of which split characters across byte-level tokens)
//! the streamed text equals llama.cpp's concatenated pieces, and after every step the text
//! held back is at most one incomplete UTF-8 character; plus hand-made byte-token splits of
//! emoji, ZWJ sequences and CJK.

mod tokenizer_support;

use tessera_model::tokenizer::Tokenizer;
use tokenizer_support::{default_model, ids, load_gguf, read_jsonl, unhex};

/// GPT-2's byte -> character table, built the way GPT-2's `bytes_to_unicode` builds it.
fn gpt2_char(b: u8) -> char {
    let mut direct: Vec<u32> = (b'!'..=b'~').map(u32::from).collect();
    direct.extend(0xA1..=0xAC);
    direct.extend(0xAE..=0xFF);
    if direct.contains(&u32::from(b)) {
        return char::from(b);
    }
    let shifted = (0..=255u32).filter(|c| !direct.contains(c)).position(|c| c == u32::from(b)).unwrap();
    char::from_u32(256 + shifted as u32).unwrap()
}

fn byte_ids(tok: &Tokenizer, text: &str) -> Vec<u32> {
    text.bytes().map(|b| tok.token_id(&gpt2_char(b).to_string()).unwrap()).collect()
}

/// True when `tail` could still grow into one character: a lead byte followed by fewer
/// continuation bytes than it announces.
fn is_incomplete_char(tail: &[u8]) -> bool {
    let Some((&lead, rest)) = tail.split_first() else {
        return true;
    };
    let need = match lead {
        0xC2..=0xDF => 1,
        0xE0..=0xEF => 2,
        0xF0..=0xF4 => 3,
        _ => return false,
    };
    rest.len() < need && rest.iter().all(|&b| (0x80..=0xBF).contains(&b))
}

/// Streams `ids`; checks promptness after each step and returns the whole text.
fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool, pieces: Option<&[Vec<u8>]>) -> String {
    let mut s = tok.decode_stream(skip_special);
    let mut text = String::new();
    let mut bytes = Vec::new();
    for (i, &id) in ids.iter().enumerate() {
        text.push_str(&s.step(id).unwrap());
        if let Some(pieces) = pieces {
            bytes.extend_from_slice(&pieces[i]);
            // Where the bytes so far contain no invalid sequence, everything but an
            // incomplete last character must be out already.
            if !text.contains('\u{FFFD}') && bytes.starts_with(text.as_bytes()) {
                assert!(
                    is_incomplete_char(&bytes[text.len()..]),
                    "held back too much after {:?}: {text:?}",
                    &ids[..=i]
                );
            }
        }
    }
    text.push_str(&s.finish().unwrap());
    text
}

#[test]
fn streamed_text_equals_llama_cpp_pieces() {
    let Some(path) = default_model() else { return };
    let tok = load_gguf(&path);
    let rows: Vec<_> = read_jsonl("smollm2.jsonl").into_iter().chain(read_jsonl("smollm2.decode.jsonl")).collect();
    assert!(rows.len() > 400);
    let mut split_rows = 0;
    for row in &rows {
        let ids = ids(&row["ids"]);
        let pieces: Vec<Vec<u8>> =
            row["pieces"].as_array().unwrap().iter().map(|p| unhex(p.as_str().unwrap())).collect();
        if pieces.iter().any(|p| std::str::from_utf8(p).is_err()) {
            split_rows += 1;
        }
        let all: Vec<u8> = pieces.concat();
        assert_eq!(stream(&tok, &ids, false, Some(&pieces)), String::from_utf8_lossy(&all), "{ids:?}");
        // SmolLM2 has no space clean-up, so llama.cpp's detokenize without specials is the
        // concatenation of the non-control pieces.
        let want = unhex(row["decode_skip_special"].as_str().unwrap());
        assert_eq!(stream(&tok, &ids, true, None), String::from_utf8_lossy(&want), "{ids:?}");
    }
    assert!(split_rows > 30, "only {split_rows} rows split a character across tokens");
}

#[test]
fn emoji_zwj_and_cjk_split_into_byte_tokens() {
    let Some(path) = default_model() else { return };
    let tok = load_gguf(&path);
    let text = "a🙂👨\u{200d}👩\u{200d}👧中文";
    let ids = byte_ids(&tok, text);
    assert_eq!(ids.len(), text.len());
    let mut s = tok.decode_stream(true);
    let steps: Vec<String> = ids.iter().map(|&id| s.step(id).unwrap()).collect();
    assert_eq!(s.finish().unwrap(), "");
    // Each character comes out exactly at its last byte, never earlier, never split.
    let mut expected = Vec::new();
    for c in text.chars() {
        expected.extend(std::iter::repeat_n(String::new(), c.len_utf8() - 1));
        expected.push(c.to_string());
    }
    assert_eq!(steps, expected);

    // A character cut short by a following character: U+FFFD for the broken bytes only.
    let mut s = tok.decode_stream(true);
    let emoji = byte_ids(&tok, "🙂");
    let mut out = String::new();
    for &id in emoji[..2].iter().chain(byte_ids(&tok, "x").iter()) {
        out.push_str(&s.step(id).unwrap());
    }
    assert_eq!(out, "\u{FFFD}x");
    // Cut short by the end of the stream.
    let mut s = tok.decode_stream(true);
    for &id in &byte_ids(&tok, "中")[..2] {
        assert_eq!(s.step(id).unwrap(), "");
    }
    assert_eq!(s.finish().unwrap(), "\u{FFFD}");
}

#[test]
fn control_tokens_stream_only_when_not_skipped() {
    let Some(path) = default_model() else { return };
    let tok = load_gguf(&path);
    let ids = tok.encode("<|im_start|>assistant\nHi!<|im_end|>", false, true).unwrap();
    assert_eq!(stream(&tok, &ids, false, None), "<|im_start|>assistant\nHi!<|im_end|>");
    assert_eq!(stream(&tok, &ids, true, None), "assistant\nHi!");
}
