//! Shared by the tokenizer tests: where the model and the llama.cpp fixtures are, and the
//! comparison of a tokenizer against one fixture set (tests/fixtures/tokenizer/*.jsonl,
//! written by gen_llama_cpp.py from libllama).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde_json::Value;
use tessera_model::gguf::GgufFile;
use tessera_model::tokenizer::Tokenizer;

pub fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer")
}

#[path = "../../../tests/support/default_model.rs"]
mod default_model_path;
#[allow(unused_imports)]
pub use default_model_path::default_model;

pub fn load_gguf(path: &Path) -> Tokenizer {
    let file = GgufFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap()).collect()
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

pub fn read_jsonl(name: &str) -> Vec<Value> {
    let path = fixture_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

pub fn read_json(name: &str) -> Value {
    let path = fixture_dir().join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// llama.cpp renders a byte-level token character outside GPT-2's byte table (Command-R's
/// vocabulary stores some emoji raw) as "[UNK_BYTE_0x<hex><token text>]"; Tessera emits the
/// character itself. That one documented difference is not compared.
fn is_unk_byte(bytes: &[u8]) -> bool {
    bytes.windows(12).any(|w| w == b"[UNK_BYTE_0x")
}

fn show(bytes: &[u8]) -> String {
    format!("{:?}", String::from_utf8_lossy(bytes))
}

/// Compares `tok` with every row of `<name>.jsonl` and `<name>.decode.jsonl`; returns one
/// line per disagreement.
pub fn compare_with_fixtures(tok: &Tokenizer, name: &str) -> Vec<String> {
    let mut bad = Vec::new();
    let meta = read_json(&format!("{name}.meta.json"));
    let n_rows;
    {
        let rows = read_jsonl(&format!("{name}.jsonl"));
        n_rows = rows.len();
        for row in &rows {
            let text = row["text"].as_str().unwrap();
            for (key, parse_special) in [("ids", true), ("ids_no_parse_special", false)] {
                let want = ids(&row[key]);
                match tok.encode(text, true, parse_special) {
                    Ok(got) if got == want => {}
                    got => bad.push(format!(
                        "{name} encode {text:?} parse_special={parse_special}: got {got:?}, llama.cpp {want:?}"
                    )),
                }
            }
        }
        let decode_rows = read_jsonl(&format!("{name}.decode.jsonl"));
        for row in rows.iter().chain(decode_rows.iter()) {
            let ids = ids(&row["ids"]);
            for (i, (&id, piece)) in ids.iter().zip(row["pieces"].as_array().unwrap()).enumerate() {
                let want = unhex(piece.as_str().unwrap());
                if is_unk_byte(&want) {
                    continue;
                }
                match tok.token_to_piece(id) {
                    Ok(got) if got == want => {}
                    got => bad.push(format!(
                        "{name} piece #{i} of {ids:?} (id {id}): got {got:?}, llama.cpp {}",
                        show(&want)
                    )),
                }
            }
            for (key, skip) in [("decode", false), ("decode_skip_special", true)] {
                let want = unhex(row[key].as_str().unwrap());
                if is_unk_byte(&want) {
                    continue;
                }
                match tok.decode_bytes(&ids, skip) {
                    Ok(got) if got == want => {}
                    Ok(got) => bad.push(format!("{name} {key} {ids:?}: got {}, llama.cpp {}", show(&got), show(&want))),
                    Err(e) => bad.push(format!("{name} {key} {ids:?}: error {e}")),
                }
            }
        }
    }
    assert!(n_rows >= 80, "{name}: only {n_rows} fixture strings");
    if tok.vocab_size() as u64 != meta["n_vocab"].as_u64().unwrap() {
        bad.push(format!("{name} vocab size {} != {}", tok.vocab_size(), meta["n_vocab"]));
    }
    if tok.stop_token_ids() != ids(&meta["eog"]).as_slice() {
        bad.push(format!("{name} stop ids {:?} != llama.cpp eog {:?}", tok.stop_token_ids(), meta["eog"]));
    }
    let opt = |v: &Value| v.as_i64().filter(|&i| i >= 0).map(|i| i as u32);
    if tok.bos_token_id() != opt(&meta["bos"]) || tok.eos_token_id() != opt(&meta["eos"]) {
        bad.push(format!(
            "{name} bos/eos {:?}/{:?} != {}/{}",
            tok.bos_token_id(),
            tok.eos_token_id(),
            meta["bos"],
            meta["eos"]
        ));
    }
    if tok.add_bos_token() != meta["add_bos"].as_bool().unwrap() {
        bad.push(format!("{name} add_bos {} != {}", tok.add_bos_token(), meta["add_bos"]));
    }
    bad
}

/// Panics listing the first disagreements, if any.
pub fn assert_none(bad: &[String]) {
    if !bad.is_empty() {
        let shown: Vec<&str> = bad.iter().take(25).map(String::as_str).collect();
        panic!("{} disagreements with llama.cpp:\n{}", bad.len(), shown.join("\n"));
    }
}
