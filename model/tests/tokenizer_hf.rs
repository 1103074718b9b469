//! The Hugging Face path (`Tokenizer::from_hf_file`, through the `tokenizers` crate). No
//! tokenizer.json ships with Tessera, so the test writes SmolLM2's from the GGUF metadata,
//! in the shape Hugging Face publishes it (byte-level BPE; digits split one by one, then
//! GPT-2's byte-level pre-tokenizer; the 17 control tokens as special added tokens), plus a
//! tokenizer_config.json and generation_config.json, and checks that the same public API
//! gives llama.cpp's ids, text and stop tokens on the default model's fixtures.

mod tokenizer_support;

use serde_json::{json, Map, Value};
use tessera_model::gguf::GgufFile;
use tessera_model::tokenizer::{TokenType, Tokenizer, TokenizerSpec};
use tokenizer_support::{default_model, ids, read_jsonl, unhex};

fn write_hf_dir(spec: &TokenizerSpec, dir: &std::path::Path) {
    let vocab: Map<String, Value> = spec.tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
    let added: Vec<Value> = spec
        .tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| spec.token_types[*i] == TokenType::Control as i32)
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": spec.merges},
    });
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config = json!({"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": true},
                        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    std::fs::write(dir.join("generation_config.json"), json!({"eos_token_id": [2, 0]}).to_string()).unwrap();
}

#[test]
fn hf_tokenizer_json_agrees_with_llama_cpp() {
    let Some(path) = default_model() else { return };
    let spec = TokenizerSpec::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let dir = std::env::temp_dir().join(format!("tessera-hf-tokenizer-{}", std::process::id()));
    write_hf_dir(&spec, &dir);
    let tok = Tokenizer::from_hf_file(&dir.join("tokenizer.json")).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();

    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!((tok.bos_token_id(), tok.eos_token_id(), tok.eot_token_id()), (Some(1), Some(2), Some(2)));
    assert!(!tok.add_bos_token());
    assert_eq!(tok.stop_token_ids(), &[0, 2]);
    assert_eq!(tok.hf_chat_template(), Some("{% for m in messages %}{{ m.content }}{% endfor %}"));
    assert_eq!(tok.token_text(2), Some("<|im_end|>"));

    let mut bad = Vec::new();
    for row in read_jsonl("smollm2.jsonl") {
        let text = row["text"].as_str().unwrap();
        for (key, parse_special) in [("ids", true), ("ids_no_parse_special", false)] {
            let want = ids(&row[key]);
            let got = tok.encode(text, true, parse_special).unwrap();
            if got != want {
                bad.push(format!("encode {text:?} parse_special={parse_special}: got {got:?}, llama.cpp {want:?}"));
            }
        }
    }
    for row in read_jsonl("smollm2.jsonl").into_iter().chain(read_jsonl("smollm2.decode.jsonl")) {
        let ids = ids(&row["ids"]);
        for (key, skip) in [("decode", false), ("decode_skip_special", true)] {
            let want = String::from_utf8_lossy(&unhex(row[key].as_str().unwrap())).into_owned();
            let got = tok.decode(&ids, skip).unwrap();
            if got != want {
                bad.push(format!("{key} {ids:?}: got {got:?}, llama.cpp {want:?}"));
            }
            // Streaming gives the same text as one decode.
            let mut s = tok.decode_stream(skip);
            let mut streamed = String::new();
            for &id in &ids {
                streamed.push_str(&s.step(id).unwrap());
            }
            streamed.push_str(&s.finish().unwrap());
            if streamed != want {
                bad.push(format!("stream {key} {ids:?}: got {streamed:?}, want {want:?}"));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "{} disagreements:\n{}",
        bad.len(),
        bad.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
    );
    assert!(tok.decode(&[49152], false).is_err());

    // Bytes SmolLM2's vocabulary has no token for (0x04, 0xF1, ...) encode as nothing on both
    // paths, as llama.cpp does.
    let native = Tokenizer::from_spec(&spec).unwrap();
    for text in ["a\u{4}b", "x\u{40000}y", "\u{13}\u{14}\u{16}\u{1d}", "\u{6}"] {
        let (hf, gguf) = (tok.encode(text, true, true).unwrap(), native.encode(text, true, true).unwrap());
        assert_eq!(hf, gguf, "{text:?}");
        assert!(hf.iter().all(|&id| id < 49152));
    }
}
