//! Chat templates rendered by Tessera against llama.cpp's server (`POST /apply-template`):
//! the default model's own template (read from its GGUF) and three family templates from
//! llama.cpp's template collection (Qwen2.5, Qwen3, SmolLM3), over seven conversations
//! (system + user, user only, multi-turn, unicode, whitespace and template-like content,
//! empty content), with and without the generation prompt. Fixtures and the script that
//! made them: tests/fixtures/chat_template/.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tessera_model::chat_template::{gguf_chat_template, ChatMessage, ChatTemplate};
use tessera_model::gguf::GgufFile;
use tessera_model::tokenizer::Tokenizer;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat_template").join(name)
}

/// Renders every fixture row of `name` and returns the disagreements.
fn compare(template: &ChatTemplate, name: &str) -> Vec<String> {
    let text = std::fs::read_to_string(fixture(&format!("{name}.jsonl"))).unwrap();
    let mut bad = Vec::new();
    let mut n = 0;
    for line in text.lines() {
        let row: Value = serde_json::from_str(line).unwrap();
        let messages: Vec<ChatMessage> = row["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let add = row["add_generation_prompt"].as_bool().unwrap();
        let want = row["prompt"].as_str().unwrap();
        match template.render(&messages, add) {
            Ok(got) if got == want => {}
            got => {
                bad.push(format!("{name} {messages:?} add_generation_prompt={add}:\n  got  {got:?}\n  want {want:?}"))
            }
        }
        n += 1;
    }
    assert!(n >= 8, "{name}: only {n} fixture rows");
    bad
}

#[path = "../../tests/support/default_model.rs"]
mod default_model;

#[test]
fn default_model_template_matches_llama_server() {
    let Some(path) = default_model::default_model() else { return };
    let file = GgufFile::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let source = gguf_chat_template(&file).expect("the default model carries a chat template");
    let bos = tok.bos_token_id().and_then(|id| tok.token_text(id)).unwrap();
    let eos = tok.eos_token_id().and_then(|id| tok.token_text(id)).unwrap();
    let template = ChatTemplate::new(source, bos, eos).unwrap().with_tokenizer_adding_bos(tok.add_bos_token());
    let bad = compare(&template, "smollm2");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn family_templates_match_llama_server() {
    let mut bad = Vec::new();
    for name in ["qwen2_5", "qwen3", "smollm3"] {
        let source = std::fs::read_to_string(fixture(&format!("{name}.jinja"))).unwrap();
        // The server rendered these with the default model's BOS/EOS texts.
        let template = ChatTemplate::new(&source, "<|im_start|>", "<|im_end|>").unwrap();
        bad.extend(compare(&template, name));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
