//! Which call syntax the gateway reads for a model whose chat template renders tools: the
//! probe prompt of the real Qwen2.5 / Qwen3 templates shows `<tool_call>` (Hermes), Llama
//! 3.1's a bare `{"name", "parameters"}` object; a template that does not render tools gets
//! no syntax (the fallback format is used).

use std::path::Path;

use tessera_gateway::model_codec::tool_syntax_of;
use tessera_gateway::tools::ToolSyntax;
use tessera_model::chat_template::ChatTemplate;

fn probe(name: &str) -> Option<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat_template").join(name);
    let source = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
    ChatTemplate::new(&source, "<s>", "</s>").unwrap_or_else(|e| panic!("{name}: {e}")).tool_probe()
}

#[test]
fn syntaxes_of_family_templates() {
    let syntax = |name: &str| probe(name).and_then(|p| tool_syntax_of(&p));
    assert_eq!(syntax("qwen2_5.jinja"), Some(ToolSyntax::Hermes));
    assert_eq!(syntax("qwen3.jinja"), Some(ToolSyntax::Hermes));
    assert_eq!(syntax("llama3_1.jinja"), Some(ToolSyntax::Llama3Json));
    assert_eq!(probe("smollm3.jinja").and_then(|p| tool_syntax_of(&p)), None);
    // A probe in some other syntax is not guessed at.
    assert_eq!(tool_syntax_of("[CALL tessera_probe_call(x=1)] tessera_probe_tool tessera_probe_result"), None);
}
