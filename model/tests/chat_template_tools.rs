//! Tool calling through real family templates (Qwen2.5, Qwen3, Llama 3.1): conversations with
//! offered tools, assistant `tool_calls` and `tool` results, rendered by `render_json` and
//! compared with what Python's jinja2 renders the way Hugging Face's `apply_chat_template`
//! does (tests/fixtures/chat_template/gen_tools_jinja2.py made tools.jsonl); and the tool probe
//! that tells templates which render tools from templates which do not.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tessera_model::chat_template::ChatTemplate;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat_template").join(name)
}

fn template(name: &str, bos: &str, eos: &str) -> ChatTemplate {
    let source = std::fs::read_to_string(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    ChatTemplate::new(&source, bos, eos).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn tool_conversations_match_jinja2() {
    let text = std::fs::read_to_string(fixture("tools.jsonl")).expect("tools.jsonl");
    let mut cases = 0;
    for line in text.lines() {
        let case: Value = serde_json::from_str(line).expect("fixture line");
        let s = |k: &str| case[k].as_str().unwrap_or_default();
        let t = template(s("template"), s("bos"), s("eos"));
        let got = t.render_json(&case["messages"], Some(&case["tools"]), true).expect("renders");
        assert_eq!(got, s("prompt"), "{} {}", s("template"), case["messages"]);
        cases += 1;
    }
    assert_eq!(cases, 8);
}

#[test]
fn probe_finds_tool_rendering_templates() {
    for (name, bos, eos) in [
        ("qwen2_5.jinja", "<s>", "</s>"),
        ("qwen3.jinja", "<s>", "</s>"),
        ("llama3_1.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    ] {
        let probe = template(name, bos, eos).tool_probe();
        assert!(probe.as_deref().is_some_and(|p| p.contains("tessera_probe_tool")), "{name}: {probe:?}");
    }
    // A template that ignores tools and tool calls (SmolLM2-style) renders only the result.
    let plain = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
                 {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let t = ChatTemplate::new(plain, "", "").expect("compiles");
    assert_eq!(t.tool_probe(), None);
    assert!(t
        .render_json(&serde_json::json!([{"role": "tool", "content": "r"}]), None, false)
        .is_ok_and(|p| p.contains("r")));
}
