//! The settings files of a Hugging Face directory: tokenizer_config.json in its string
//! and list-of-templates forms, special tokens as strings or AddedToken objects,
//! chat_template.jinja, and generation_config.json's one-or-many EOS ids.

use std::path::PathBuf;

use tessera_model::hf::{parse_generation_config, parse_tokenizer_config, HfDir, HfError};

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-hf-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn tokenizer_config_forms() {
    let t = parse_tokenizer_config(
        r#"{"add_bos_token": false, "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "lstrip": false},
            "chat_template": "{{ messages }}", "model_max_length": 8192}"#,
    )
    .unwrap();
    assert_eq!(t.chat_template.as_deref(), Some("{{ messages }}"));
    assert_eq!((t.bos_token.as_deref(), t.eos_token.as_deref()), (Some("<|im_start|>"), Some("<|im_end|>")));
    assert_eq!(t.add_bos_token, Some(false));
    assert!(t.named_templates.is_empty());

    let t = parse_tokenizer_config(
        r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
            "bos_token": null, "eos_token": "</s>"}"#,
    )
    .unwrap();
    assert_eq!(t.chat_template.as_deref(), Some("D"));
    assert_eq!(t.named_templates.get("tool_use").map(String::as_str), Some("T"));
    assert_eq!((t.bos_token, t.eos_token.as_deref(), t.add_bos_token), (None, Some("</s>"), None));

    assert!(parse_tokenizer_config(r#"{"chat_template": 5}"#).unwrap_err().contains("chat_template"));
    assert!(parse_tokenizer_config(r#"{"chat_template": [{"name": "x"}]}"#).unwrap_err().contains("template"));
    assert!(parse_tokenizer_config(r#"{"eos_token": {"id": 3}}"#).unwrap_err().contains("eos_token"));
    assert!(parse_tokenizer_config("nope").unwrap_err().contains("JSON"));
}

#[test]
fn generation_config_forms() {
    let g = parse_generation_config(
        r#"{"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "temperature": 0.6}"#,
    )
    .unwrap();
    assert_eq!((g.bos_token_id, g.eos_token_ids), (Some(128000), vec![128001, 128008, 128009]));
    let g = parse_generation_config(r#"{"eos_token_id": 2}"#).unwrap();
    assert_eq!((g.bos_token_id, g.eos_token_ids), (None, vec![2]));
    assert!(parse_generation_config(r#"{"eos_token_id": -1}"#).unwrap_err().contains("eos_token_id"));
    assert!(parse_generation_config(r#"{"eos_token_id": [1, 99999999999]}"#).unwrap_err().contains("eos_token_id"));
}

#[test]
fn directory() {
    let dir = temp_dir("dir");
    assert!(matches!(HfDir::open(&dir), Err(HfError::Io { .. })), "config.json is required");
    std::fs::write(dir.join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
    let d = HfDir::open(&dir).unwrap();
    assert_eq!(d.config_json, r#"{"model_type": "llama"}"#);
    assert_eq!((d.tokenizer_json.clone(), d.tokenizer_config.chat_template.clone()), (None, None));
    assert!(d.generation.eos_token_ids.is_empty());

    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"eos_token": "<|eot_id|>"}"#).unwrap();
    std::fs::write(dir.join("chat_template.jinja"), "{% for m in messages %}{{ m.content }}{% endfor %}").unwrap();
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [7, 9]}"#).unwrap();
    let d = HfDir::open(&dir).unwrap();
    assert_eq!(d.tokenizer_json, Some(dir.join("tokenizer.json")));
    assert_eq!(d.tokenizer_config.eos_token.as_deref(), Some("<|eot_id|>"));
    assert_eq!(d.tokenizer_config.chat_template.as_deref(), Some("{% for m in messages %}{{ m.content }}{% endfor %}"));
    assert_eq!(d.generation.eos_token_ids, vec![7, 9]);

    // tokenizer_config.json's own template wins over the separate file.
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": "inline"}"#).unwrap();
    assert_eq!(HfDir::open(&dir).unwrap().tokenizer_config.chat_template.as_deref(), Some("inline"));

    std::fs::write(dir.join("generation_config.json"), "{").unwrap();
    let msg = HfDir::open(&dir).unwrap_err().to_string();
    assert!(msg.contains("generation_config.json") && msg.contains("JSON"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}
