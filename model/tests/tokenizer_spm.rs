//! SentencePiece tokenization on a small hand-built vocabulary (no SPM model ships with
//! Tessera; llama.cpp's Llama 2 vocab is exercised in tokenizer_llama_vocabs.rs when
//! available). Every expected id list below was worked out by hand from llama.cpp's
//! algorithm: spaces become `▁`, a `▁` is prefixed to text at the start or after a special
//! token, the adjacent pair whose concatenation is a token with the highest score merges
//! first (leftmost on ties), and characters left without a token fall back to `<0xXX>`
//! byte tokens (or `<unk>` when the vocabulary has none).

use tessera_model::tokenizer::{TokenType, Tokenizer, TokenizerSpec, VocabKind};

/// (text, score) pieces after <unk>, <s>, </s> and, when `bytes`, the 256 byte tokens.
fn spec(pieces: &[(&str, f32)], bytes: bool) -> TokenizerSpec {
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut types = vec![TokenType::Unknown as i32, TokenType::Control as i32, TokenType::Control as i32];
    let mut scores = vec![0.0, 0.0, 0.0];
    if bytes {
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(TokenType::Byte as i32);
            scores.push(0.0);
        }
    }
    for (t, s) in pieces {
        tokens.push(t.to_string());
        types.push(TokenType::Normal as i32);
        scores.push(*s);
    }
    let mut spec = TokenizerSpec::new(VocabKind::Spm, tokens);
    spec.scores = scores;
    spec.token_types = types;
    spec
}

const PIECES: &[(&str, f32)] = &[
    ("▁h", -5.0),
    ("▁he", -4.0),
    ("▁hell", -7.0),
    ("▁hello", -1.0),
    ("he", -3.0),
    ("ll", -2.0),
    ("lo", -8.0),
    ("▁w", -5.0),
    ("or", -4.0),
    ("ld", -4.0),
    ("▁wor", -6.0),
    ("▁world", -2.0),
    ("▁", -10.0),
    ("h", -10.0),
    ("e", -10.0),
    ("l", -10.0),
    ("o", -10.0),
    ("w", -10.0),
    ("r", -10.0),
    ("d", -10.0),
];

fn byte(b: u8) -> u32 {
    3 + u32::from(b)
}

fn tok() -> Tokenizer {
    Tokenizer::from_spec(&spec(PIECES, true)).unwrap()
}

fn id(t: &Tokenizer, text: &str) -> u32 {
    t.token_id(text).unwrap()
}

#[test]
fn defaults_are_llama_cpps_for_sentencepiece() {
    let t = tok();
    assert_eq!((t.bos_token_id(), t.eos_token_id()), (Some(1), Some(2)));
    assert!(t.add_bos_token());
    assert_eq!(t.stop_token_ids(), &[2]); // </s>
}

#[test]
fn merges_follow_scores_to_whole_words() {
    let t = tok();
    // ▁ h e l l o: ll(-2) > he(-3) > ▁he(-4) > ▁hell(-7) > ▁hello(-1, appears last).
    assert_eq!(t.encode("hello", true, true).unwrap(), [1, id(&t, "▁hello")]);
    assert_eq!(t.encode("hello world", false, true).unwrap(), [id(&t, "▁hello"), id(&t, "▁world")]);
    // "hel" stops at ▁he + l: ▁hel is not a token.
    assert_eq!(t.encode("hel", false, true).unwrap(), [id(&t, "▁he"), id(&t, "l")]);
}

#[test]
fn higher_score_wins_and_ties_go_left() {
    let no_prefix = |pieces: &[(&str, f32)]| {
        let mut s = spec(pieces, true);
        s.add_space_prefix = Some(false);
        Tokenizer::from_spec(&s).unwrap()
    };
    let base = [("a", -10.0), ("b", -10.0), ("c", -10.0)];
    let t = no_prefix(&[base.as_slice(), &[("ab", -1.0), ("bc", -2.0)]].concat());
    assert_eq!(t.encode("abc", false, true).unwrap(), [id(&t, "ab"), id(&t, "c")]);
    let t = no_prefix(&[base.as_slice(), &[("ab", -2.0), ("bc", -1.0)]].concat());
    assert_eq!(t.encode("abc", false, true).unwrap(), [id(&t, "a"), id(&t, "bc")]);
    let t = no_prefix(&[base.as_slice(), &[("ab", -1.0), ("bc", -1.0)]].concat());
    assert_eq!(t.encode("abc", false, true).unwrap(), [id(&t, "ab"), id(&t, "c")]);
    // "aaa" with "aa": the leftmost pair merges first.
    let t = no_prefix(&[("a", -10.0), ("aa", -1.0)]);
    assert_eq!(t.encode("aaa", false, true).unwrap(), [id(&t, "aa"), id(&t, "a")]);
}

#[test]
fn characters_without_tokens_fall_back_to_bytes() {
    let t = tok();
    // ▁ h é: ▁h merges; é (C3 A9) has no token.
    assert_eq!(t.encode("hé", false, true).unwrap(), [id(&t, "▁h"), byte(0xC3), byte(0xA9)]);
    // 🙂 is F0 9F 99 82; the lone ▁ before it is a token.
    assert_eq!(t.encode("🙂", false, true).unwrap(), [id(&t, "▁"), byte(0xF0), byte(0x9F), byte(0x99), byte(0x82)]);
    assert_eq!(t.decode(&t.encode("hé 🙂!", true, true).unwrap(), true).unwrap(), " hé 🙂!");
}

#[test]
fn without_byte_tokens_unknown_characters_become_unk() {
    let t = Tokenizer::from_spec(&spec(PIECES, false)).unwrap();
    assert_eq!(t.encode("hé", false, true).unwrap(), [t.token_id("▁h").unwrap(), 0, 0]);
}

#[test]
fn space_prefix_goes_at_the_start_and_after_special_tokens() {
    let t = tok();
    assert_eq!(t.encode("<s>hello</s>world", false, true).unwrap(), [1, id(&t, "▁hello"), 2, id(&t, "▁world")]);
    // Not parsed as special: "<s>" is text, its characters fall back to bytes after ▁.
    let plain = t.encode("<s>", false, false).unwrap();
    assert_eq!(plain, [id(&t, "▁"), byte(b'<'), byte(b's'), byte(b'>')]);
    let mut s = spec(PIECES, true);
    s.add_space_prefix = Some(false);
    let t = Tokenizer::from_spec(&s).unwrap();
    // h e l l o: ll(-2), then he(-3); "hell" and "llo" are not tokens.
    assert_eq!(t.encode("hello", false, true).unwrap(), [id(&t, "he"), id(&t, "ll"), id(&t, "o")]);
}

#[test]
fn decode_drops_the_prefix_space_like_llama_cpp() {
    let t = tok();
    let ids = [1, id(&t, "▁hello"), id(&t, "▁world")];
    assert_eq!(t.decode(&ids, false).unwrap(), "<s> hello world");
    // With BOS removed as special, llama.cpp keeps the space of the following piece.
    assert_eq!(t.decode(&ids, true).unwrap(), " hello world");
    assert_eq!(t.decode(&ids[1..], true).unwrap(), "hello world");
    assert_eq!(t.decode(&[byte(0xC3), byte(0xA9)], true).unwrap(), "é");
    assert_eq!(t.token_to_piece(id(&t, "▁world")).unwrap(), b" world");
    assert_eq!(t.token_to_piece(byte(0xFF)).unwrap(), [0xFF]);
}

#[test]
fn stream_holds_split_characters_until_complete() {
    let t = tok();
    let mut s = t.decode_stream(true);
    let steps: Vec<String> = [id(&t, "▁h"), byte(0xF0), byte(0x9F), byte(0x99), byte(0x82), byte(0xE4), byte(0xB8)]
        .iter()
        .map(|&i| s.step(i).unwrap())
        .collect();
    assert_eq!(steps, [" h", "", "", "", "🙂", "", ""]);
    // The stream ends inside 中 (E4 B8 AD): the truncated sequence becomes one U+FFFD.
    assert_eq!(s.finish().unwrap(), "\u{FFFD}");
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let t = tok();
    assert!(t.decode(&[100_000], false).is_err());
    assert!(t.token_to_piece(u32::MAX).is_err());
    assert!(t.decode_stream(false).step(9999).is_err());
    assert!(Tokenizer::from_spec(&TokenizerSpec::new(VocabKind::Spm, vec![])).is_err());
    let dup = TokenizerSpec::new(VocabKind::Spm, vec!["a".into(), "a".into()]);
    assert!(Tokenizer::from_spec(&dup).is_err());
    let mut short = spec(PIECES, true);
    short.scores.truncate(5);
    assert!(Tokenizer::from_spec(&short).is_err());
}
