//! The matcher over the real default model's vocabulary: random walks through the masks
//! (every step picks a random allowed token, the most adversarial "model") must end in text
//! that an independent check accepts; disallowed tokens are refused; bad and pathological
//! grammars are refused quickly.

use std::time::{Duration, Instant};

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use serde_json::Value;
use tessera_constrain::{
    mask_allows, mask_words, Compiler, ConstrainError, Constraint, Limits, SeqMatcher, Vocabulary,
};
use tessera_model::gguf::GgufFile;
use tessera_model::tokenizer::Tokenizer;

#[path = "../../tests/support/default_model.rs"]
mod default_model;
use default_model::default_model as model_path;

struct Fixture {
    tok: Tokenizer,
    compiler: Compiler,
}

fn fixture() -> Option<Fixture> {
    let file = GgufFile::open(&model_path()?).expect("open the model");
    let tok = Tokenizer::from_gguf(&file).expect("tokenizer");
    let vocab = Vocabulary::from_pieces(tok.vocab_size(), tok.stop_token_ids(), |id| {
        let piece = tok.token_to_piece(id).unwrap_or_default();
        let special = !piece.is_empty() && tok.decode_bytes(&[id], true).map(|b| b.is_empty()).unwrap_or(true);
        (piece, special)
    })
    .expect("vocabulary");
    let compiler = Compiler::new(vocab, Limits::default()).expect("compiler");
    Some(Fixture { tok, compiler })
}

fn allowed(mask: &[u32], n: usize) -> Vec<u32> {
    (0..n as u32).filter(|&t| mask_allows(mask, t)).collect()
}

/// Walks `m` with random allowed tokens until an end-of-sequence id is drawn (each step
/// where one is allowed ends with probability 1/2); returns the text without it.
fn walk(fx: &Fixture, m: &mut SeqMatcher, rng: &mut ChaCha8Rng, max_steps: usize) -> String {
    let n = fx.tok.vocab_size();
    let eos = fx.tok.stop_token_ids();
    let mut mask = vec![0u32; mask_words(n)];
    let mut out = Vec::new();
    for _ in 0..max_steps {
        m.fill_mask(&mut mask).expect("mask");
        let ok = allowed(&mask, n);
        assert!(!ok.is_empty());
        let eos_ok: Vec<u32> = ok.iter().copied().filter(|t| eos.contains(t)).collect();
        let t = if !eos_ok.is_empty() && (rng.next_u32().is_multiple_of(2) || ok.len() == eos_ok.len()) {
            eos_ok[0]
        } else {
            let text: Vec<u32> = ok.iter().copied().filter(|t| !eos.contains(t)).collect();
            text[rng.next_u32() as usize % text.len()]
        };
        // No special token other than the end-of-sequence ids is ever allowed.
        assert!(
            eos.contains(&t)
                || !fx.tok.decode_bytes(&[t], true).expect("decode").is_empty()
                || fx.tok.token_to_piece(t).expect("piece").is_empty()
        );
        m.commit(t).expect("commit an allowed token");
        if eos.contains(&t) {
            return String::from_utf8(out).expect("constrained output is UTF-8");
        }
        out.extend(fx.tok.token_to_piece(t).expect("piece"));
    }
    panic!("no end after {max_steps} steps: {:?}", String::from_utf8_lossy(&out));
}

/// An independent check of the schema used below (not a JSON Schema implementation).
fn check_person(v: &Value) -> Result<(), String> {
    let o = v.as_object().ok_or("not an object")?;
    for k in o.keys() {
        if !["name", "age", "role", "tags", "address"].contains(&k.as_str()) {
            return Err(format!("unexpected key {k}"));
        }
    }
    let name = o.get("name").and_then(Value::as_str).ok_or("name")?;
    if name.chars().count() < 1 || name.chars().count() > 8 {
        return Err(format!("name length: {name:?}"));
    }
    let age = o.get("age").and_then(Value::as_i64).ok_or("age")?;
    if !(0..=120).contains(&age) {
        return Err(format!("age {age}"));
    }
    let role = o.get("role").and_then(Value::as_str).ok_or("role")?;
    if !["admin", "user", "guest"].contains(&role) {
        return Err(format!("role {role}"));
    }
    if let Some(tags) = o.get("tags") {
        let tags = tags.as_array().ok_or("tags")?;
        if tags.len() > 3 || tags.iter().any(|t| t.as_str().is_none_or(|s| s.chars().count() > 5)) {
            return Err(format!("tags {tags:?}"));
        }
    }
    if let Some(a) = o.get("address") {
        let a = a.as_object().ok_or("address")?;
        let zip = a.get("zip").and_then(Value::as_str).ok_or("zip")?;
        if zip.len() != 5 || !zip.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("zip {zip:?}"));
        }
        if a.keys().any(|k| k != "zip" && k != "city") {
            return Err("address keys".into());
        }
        if let Some(c) = a.get("city") {
            if c.as_str().is_none_or(|s| s.chars().count() > 6) {
                return Err("city".into());
            }
        }
    }
    Ok(())
}

const PERSON: &str = r#"{
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    "address": {
      "type": "object",
      "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "city": {"type": "string", "maxLength": 6}},
      "required": ["zip"],
      "additionalProperties": false
    }
  },
  "required": ["name", "age", "role"],
  "additionalProperties": false
}"#;

#[test]
fn random_walks_through_a_schema_produce_valid_json() {
    let Some(fx) = fixture() else { return };
    let c = Constraint::JsonSchema(PERSON.into());
    for seed in 0..12 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut m = fx.compiler.compile(&c).expect("compile");
        let text = walk(&fx, &mut m, &mut rng, 400);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        check_person(&v).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
    }
}

#[test]
fn json_object_mode_yields_objects() {
    let Some(fx) = fixture() else { return };
    // Unbounded strings: a random walk would rarely close one, so end early walks by
    // taking a closing token whenever the mask has one. Here only the first mask is checked
    // token by token: it must allow exactly the tokens that can start a compact object.
    let mut m = fx.compiler.compile(&Constraint::JsonObject).expect("compile");
    let n = fx.tok.vocab_size();
    let mut mask = vec![0u32; mask_words(n)];
    m.fill_mask(&mut mask).expect("mask");
    let ok = allowed(&mask, n);
    assert!(ok.contains(&fx.tok.encode("{", false, false).expect("encode")[0]));
    for t in ok {
        let piece = fx.tok.token_to_piece(t).expect("piece");
        assert_eq!(
            piece.first(),
            Some(&b'{'),
            "token {t} {:?} cannot start an object",
            String::from_utf8_lossy(&piece)
        );
    }
    // A whole object token by token through the matcher: `{"a": [1, {"b": null}]}` compactly.
    let text = r#"{"a":[1,{"b":null}],"c":"x"}"#;
    let ids = fx.tok.encode(text, false, false).expect("encode");
    let mut m = fx.compiler.compile(&Constraint::JsonObject).expect("compile");
    for &t in &ids {
        m.fill_mask(&mut mask).expect("mask");
        assert!(mask_allows(&mask, t), "token {t} of a valid object was masked");
        m.commit(t).expect("commit");
    }
    assert!(m.is_accepting());
    m.fill_mask(&mut mask).expect("mask");
    assert!(fx.tok.stop_token_ids().iter().all(|&e| mask_allows(&mask, e)));
}

#[test]
fn disallowed_tokens_are_refused_and_finish_allows_only_eos() {
    let Some(fx) = fixture() else { return };
    let c = Constraint::JsonSchema(
        r#"{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"],"additionalProperties":false}"#
            .into(),
    );
    let mut m = fx.compiler.compile(&c).expect("compile");
    let bad = fx.tok.encode("hello", false, false).expect("encode")[0];
    assert!(matches!(m.commit(bad), Err(ConstrainError::Matcher(_))));
    let mut m = fx.compiler.compile(&c).expect("compile");
    m.replay(&fx.tok.encode(r#"{"ok":true}"#, false, false).expect("encode")).expect("replay");
    let n = fx.tok.vocab_size();
    let mut mask = vec![0u32; mask_words(n)];
    m.fill_mask(&mut mask).expect("mask");
    let ok = allowed(&mask, n);
    let mut eos = fx.tok.stop_token_ids().to_vec();
    eos.sort_unstable();
    assert_eq!(ok, eos, "a complete object allows only the end-of-sequence ids");
    m.commit(eos[0]).expect("eos");
    assert!(m.is_finished());
    assert!(m.commit(bad).is_err());
}

#[test]
fn regex_walks_match_the_pattern() {
    let Some(fx) = fixture() else { return };
    let c = Constraint::Regex("[0-9]{3}-[a-z]{2,4}".into());
    for seed in 0..8 {
        let mut rng = ChaCha8Rng::seed_from_u64(100 + seed);
        let mut m = fx.compiler.compile(&c).expect("compile");
        let text = walk(&fx, &mut m, &mut rng, 50);
        let b = text.as_bytes();
        let ok = b.len() >= 6
            && b.len() <= 8
            && b[..3].iter().all(u8::is_ascii_digit)
            && b[3] == b'-'
            && b[4..].iter().all(u8::is_ascii_lowercase);
        assert!(ok, "seed {seed}: {text:?}");
    }
}

#[test]
fn bad_grammars_are_invalid() {
    let Some(fx) = fixture() else { return };
    let cases = [
        Constraint::JsonSchema("{not json".into()),
        Constraint::JsonSchema("[1, 2]".into()),
        Constraint::JsonSchema(r#"{"type": "frobnicate"}"#.into()),
        Constraint::JsonSchema(r#"{"type": "integer", "minimum": 5, "maximum": 1}"#.into()),
        Constraint::Regex("a(b".into()),
        Constraint::Lark("start: undefined_rule".into()),
        Constraint::Lark("   ".into()),
    ];
    for c in cases {
        let r = fx.compiler.check(&c, Duration::from_secs(1));
        assert!(matches!(r, Err(ConstrainError::Invalid { .. })), "{c:?}: {r:?}");
    }
}

#[test]
fn pathological_grammars_fail_within_a_second() {
    let Some(fx) = fixture() else { return };
    let deep =
        (0..200).fold(r#"{"type":"integer"}"#.to_string(), |inner, _| format!(r#"{{"type":"array","items":{inner}}}"#));
    let cases = [
        // Repetition that only explodes once unrolled (llguidance compiles it lazily).
        Constraint::Regex("(a{1000}){1000}".into()),
        Constraint::Regex("[a-z]{100000}".into()),
        Constraint::JsonSchema(r#"{"type":"string","pattern":"^(ab{100}){1000}$"}"#.into()),
        Constraint::JsonSchema(r#"{"patternProperties":{"^x{50000}$":{"type":"integer"}}}"#.into()),
        // Catastrophic patterns whose emptiness check with a length bound runs out of fuel.
        Constraint::JsonSchema(r#"{"type":"string","pattern":"^(x+x+)+y$","minLength":100000}"#.into()),
        Constraint::JsonSchema(r#"{"type":"string","pattern":"(.*a){25}","maxLength":100}"#.into()),
        // Nesting deeper than the JSON parser allows.
        Constraint::JsonSchema(deep),
    ];
    for c in cases {
        let t = Instant::now();
        let r = fx.compiler.check(&c, Duration::from_secs(1));
        let took = t.elapsed();
        assert!(took < Duration::from_millis(1500), "{c:?} took {took:?}");
        assert!(matches!(r, Err(ConstrainError::Invalid { .. } | ConstrainError::TooSlow { .. })), "{c:?}: {r:?}");
    }
    // Counted repetition within the limit is fine.
    assert_eq!(fx.compiler.check(&Constraint::Regex("[0-9]{4}-[0-9]{2}".into()), Duration::from_secs(1)), Ok(()));
}
