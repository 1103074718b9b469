//! Tools and tool turns into the prompt. A conversation without tools or tool turns renders
//! exactly as before (`Codec::render_chat`). Otherwise:
//! - when the model's chat template renders tools itself (`Codec::tool_syntax` is `Some`),
//!   the conversation goes to it as Hugging Face's `apply_chat_template` would pass it:
//!   `tools` as `[{"type": "function", "function": {name, description, parameters}}]`,
//!   assistant turns with `tool_calls` (arguments as JSON objects), `tool` turns with
//!   `tool_call_id` and `name`;
//! - otherwise the fallback format of docs/tools.md: a system block listing the tools,
//!   assistant calls written as `<tool_call>` blocks, tool results as a user turn of
//!   `<tool_response>` blocks; calls are then parsed in the Hermes syntax.

use serde_json::{json, Value};

use super::parser::ToolSyntax;
use super::spec::{has_tool_turns, CallIn, ToolRequest, Turn};
use crate::codec::{ChatMessage, Codec, CodecError};

/// The rendered prompt and the syntax the model's calls will come in.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    pub text: String,
    pub syntax: ToolSyntax,
}

/// Renders `turns` with the offered tools (none when `tools` is not active).
pub fn render(
    codec: &dyn Codec,
    turns: &[Turn],
    tools: &ToolRequest,
    add_generation_prompt: bool,
) -> Result<Rendered, CodecError> {
    let offered = tools.active();
    if !offered && !has_tool_turns(turns) {
        let plain: Vec<ChatMessage> =
            turns.iter().map(|t| ChatMessage { role: t.role.clone(), content: t.content.clone() }).collect();
        let text = codec.render_chat(&plain, add_generation_prompt)?;
        return Ok(Rendered { text, syntax: ToolSyntax::Hermes });
    }
    if let Some(syntax) = codec.tool_syntax() {
        let messages = Value::Array(turns.iter().map(template_message).collect());
        let tools_json = offered.then(|| tools_for_template(tools));
        let text = codec.render_chat_tools(&messages, tools_json.as_ref(), add_generation_prompt)?;
        return Ok(Rendered { text, syntax });
    }
    let plain = fallback_messages(turns, offered.then_some(tools));
    let text = codec.render_chat(&plain, add_generation_prompt)?;
    Ok(Rendered { text, syntax: ToolSyntax::Hermes })
}

/// The tools as chat templates expect them (OpenAI's shape).
pub fn tools_for_template(tools: &ToolRequest) -> Value {
    Value::Array(tools.tools.iter().map(tool_json).collect())
}

fn tool_json(t: &super::spec::ToolDef) -> Value {
    let mut function = serde_json::Map::new();
    function.insert("name".into(), Value::String(t.name.clone()));
    if let Some(d) = &t.description {
        function.insert("description".into(), Value::String(d.clone()));
    }
    function.insert("parameters".into(), t.parameters.clone());
    json!({"type": "function", "function": Value::Object(function)})
}

fn template_message(t: &Turn) -> Value {
    let mut m = serde_json::Map::new();
    m.insert("role".into(), Value::String(t.role.clone()));
    m.insert("content".into(), Value::String(t.content.clone()));
    if !t.tool_calls.is_empty() {
        let calls = t
            .tool_calls
            .iter()
            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
            .collect();
        m.insert("tool_calls".into(), Value::Array(calls));
    }
    if let Some(id) = &t.tool_call_id {
        m.insert("tool_call_id".into(), Value::String(id.clone()));
    }
    if let Some(name) = &t.name {
        m.insert("name".into(), Value::String(name.clone()));
    }
    Value::Object(m)
}

/// The system block of the fallback format (docs/tools.md).
pub fn fallback_tools_block(tools: &ToolRequest) -> String {
    let mut s = String::from(
        "# Tools\n\nYou can call the functions below. Their signatures are JSON objects inside <tools></tools>:\n<tools>\n",
    );
    for t in &tools.tools {
        s.push_str(&tool_json(t).to_string());
        s.push('\n');
    }
    s.push_str(
        "</tools>\n\nTo call a function, write a block like this for each call, and nothing else in it:\n\
         <tool_call>\n{\"name\": \"<function name>\", \"arguments\": {<the arguments as JSON>}}\n</tool_call>\n\
         The results come back in the next user turn, each inside <tool_response></tool_response>.",
    );
    s
}

/// One call as the fallback format writes it (and the model is asked to).
pub fn fallback_call(c: &CallIn) -> String {
    // Name first, so a parser reading it back knows the tool before the arguments.
    format!(
        "<tool_call>\n{{\"name\": {}, \"arguments\": {}}}\n</tool_call>",
        Value::String(c.name.clone()),
        c.arguments
    )
}

/// The conversation in the fallback format, as plain messages for any chat template.
pub fn fallback_messages(turns: &[Turn], tools: Option<&ToolRequest>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(turns.len() + 1);
    let mut rest = turns;
    if let Some(tools) = tools {
        let block = fallback_tools_block(tools);
        let content = match turns.first() {
            Some(t) if t.role == "system" => {
                rest = &turns[1..];
                format!("{}\n\n{block}", t.content)
            }
            _ => block,
        };
        out.push(ChatMessage { role: "system".into(), content });
    }
    for t in rest {
        match t.role.as_str() {
            "assistant" if !t.tool_calls.is_empty() => {
                let mut parts: Vec<String> = Vec::new();
                if !t.content.is_empty() {
                    parts.push(t.content.clone());
                }
                parts.extend(t.tool_calls.iter().map(fallback_call));
                out.push(ChatMessage { role: "assistant".into(), content: parts.join("\n") });
            }
            "tool" => {
                let block = format!("<tool_response>\n{}\n</tool_response>", t.content);
                // Consecutive results share one user turn.
                match out.last_mut() {
                    Some(last) if last.role == "user" && last.content.ends_with("</tool_response>") => {
                        last.content.push('\n');
                        last.content.push_str(&block);
                    }
                    _ => out.push(ChatMessage { role: "user".into(), content: block }),
                }
            }
            _ => out.push(ChatMessage { role: t.role.clone(), content: t.content.clone() }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::ByteCodec;
    use crate::tools::spec::{ToolChoice, ToolDef};

    fn weather() -> ToolRequest {
        let parameters = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
        let def =
            ToolDef { name: "get_weather".into(), description: Some("Weather now".into()), parameters, strict: false };
        ToolRequest { tools: vec![def], choice: ToolChoice::Auto, parallel: true }
    }

    /// The fallback rendering, written out by hand from docs/tools.md.
    #[test]
    fn fallback_format_round_trip() {
        let mut assistant = Turn::text("assistant", String::new());
        assistant.tool_calls = vec![
            CallIn { id: "c1".into(), name: "get_weather".into(), arguments: json!({"city": "Paris"}) },
            CallIn { id: "c2".into(), name: "get_weather".into(), arguments: json!({"city": "Oslo"}) },
        ];
        let mut r1 = Turn::text("tool", "18C".into());
        r1.tool_call_id = Some("c1".into());
        let mut r2 = Turn::text("tool", "3C".into());
        r2.tool_call_id = Some("c2".into());
        let turns =
            vec![Turn::text("system", "Be brief.".into()), Turn::text("user", "Weather?".into()), assistant, r1, r2];
        let out = render(&ByteCodec::new("t"), &turns, &weather(), true).unwrap();
        // serde_json's key order (sorted, or insertion order where llguidance turns on
        // `preserve_order`), written independently of `tool_json`.
        let tools_line = json!({"type": "function", "function": {"name": "get_weather", "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
        .to_string();
        let want = format!(
            "<|system|>Be brief.\n\n# Tools\n\nYou can call the functions below. Their signatures are JSON objects inside <tools></tools>:\n<tools>\n{tools_line}\n</tools>\n\n\
             To call a function, write a block like this for each call, and nothing else in it:\n\
             <tool_call>\n{{\"name\": \"<function name>\", \"arguments\": {{<the arguments as JSON>}}}}\n</tool_call>\n\
             The results come back in the next user turn, each inside <tool_response></tool_response>.\n\
             <|user|>Weather?\n\
             <|assistant|><tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\":\"Paris\"}}}}\n</tool_call>\n\
             <tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\":\"Oslo\"}}}}\n</tool_call>\n\
             <|user|><tool_response>\n18C\n</tool_response>\n<tool_response>\n3C\n</tool_response>\n<|assistant|>"
        );
        assert_eq!(out.text, want);
        assert_eq!(out.syntax, ToolSyntax::Hermes);
        // tool_choice none: the tools are not offered, the history still renders.
        let mut none = weather();
        none.choice = ToolChoice::None;
        let out = render(&ByteCodec::new("t"), &turns, &none, true).unwrap();
        assert!(!out.text.contains("# Tools") && out.text.contains("<tool_response>\n3C"));
    }
}
