//! The grammars that hold the model's tool calls to their schemas, in llguidance's Lark
//! dialect, whose language is exactly what the parser reads as calls in the model's syntax:
//!
//! - a forced call (`tool_choice` `required` / `any` / a named tool): calls only, each
//!   tool's arguments held to its JSON Schema through `%json {...}`;
//! - `auto` when an offered tool is `strict`: either plain text that the parser never reads as
//!   a call, or calls (Hermes: after some text) whose arguments follow the schema for strict
//!   tools and are any JSON object for the others.
//!
//! The name and the JSON framing are literals, so the name comes first (the parser commits to
//! the call as soon as it is read) and nothing else can be written; after the last call only
//! EOS is allowed, so the sequence ends there.
//!
//! Arguments are compact JSON with `", "` and `": "` separators (no free whitespace: a small
//! model could otherwise pad forever). Non-strict tools' schemas are compiled leniently
//! (keywords llguidance does not know are ignored); strict ones are not.

use serde_json::{json, Value};

use super::parser::ToolSyntax;
use super::spec::{ToolChoice, ToolDef, ToolRequest};
use crate::app::AppState;
use crate::engine::{Constraint, SamplingSpec};
use crate::error::ApiError;

/// Sets the call grammar on `spec` (a forced call's, or `auto`'s when a tool is strict),
/// compile-checked like a `response_format` (a grammar that does not compile in time is a 400
/// on `tools`). A forced call and `response_format` together are a 400 on `tool_choice`; under
/// `auto`, a `response_format` wins and the strict schemas are not enforced.
pub async fn apply(
    state: &AppState,
    tools: &ToolRequest,
    syntax: ToolSyntax,
    spec: &mut SamplingSpec,
) -> Result<(), ApiError> {
    let grammar = if let Some(g) = forced_call_grammar(tools, syntax) {
        if spec.constraint.is_some() {
            return Err(ApiError::invalid("tool_choice", "a forced tool call cannot be combined with response_format"));
        }
        g
    } else if spec.constraint.is_some() {
        return Ok(());
    } else if let Some(g) = auto_call_grammar(tools, syntax) {
        g
    } else {
        return Ok(());
    };
    let constraint = Constraint::Lark(grammar);
    crate::structured::check(state, &constraint).await.map_err(|e| match e {
        ApiError::InvalidRequest { message, code, .. } => {
            ApiError::InvalidRequest { message: format!("tool schemas: {message}"), param: Some("tools".into()), code }
        }
        other => other,
    })?;
    spec.constraint = Some(constraint);
    Ok(())
}

/// The forced-call grammar for `tools`, or `None` when no call is forced.
pub fn forced_call_grammar(tools: &ToolRequest, syntax: ToolSyntax) -> Option<String> {
    if !tools.forced() {
        return None;
    }
    let chosen: Vec<&ToolDef> = match &tools.choice {
        ToolChoice::Named(name) => tools.tools.iter().filter(|t| &t.name == name).collect(),
        _ => tools.tools.iter().collect(),
    };
    let several = tools.parallel && tools.choice == ToolChoice::Required;
    let separator = match syntax {
        ToolSyntax::Hermes => "\\n",
        ToolSyntax::Llama3Json => "; ",
    };
    let mut g = String::new();
    if several {
        g.push_str(&format!("start: call (\"{separator}\" call)*\n"));
    } else {
        g.push_str("start: call\n");
    }
    let alternatives: Vec<String> = (0..chosen.len()).map(|i| format!("call_{i}")).collect();
    g.push_str(&format!("call: {}\n", alternatives.join(" | ")));
    let open = match syntax {
        ToolSyntax::Hermes => "<tool_call>\\n",
        ToolSyntax::Llama3Json => "",
    };
    for (i, tool) in chosen.iter().enumerate() {
        g.push_str(&call_rule(&format!("call_{i}"), open, tool, syntax, arguments_schema(tool)));
    }
    Some(g)
}

/// The grammar for `tool_choice: "auto"` when at least one offered tool is strict, or `None`
/// (no strict tool, or a choice other than `auto`). Its language: nothing, plain text the
/// parser reads as text only, or one call (several with `parallel`) then EOS. Hermes text
/// holds no `<tool_call>`, and the first call may follow some text (a lazy lexeme ending at
/// the first `<tool_call>`); Llama text never begins, after whitespace and `<|python_tag|>`,
/// with `{`, and calls come first. Strict tools' arguments follow their schema; the other
/// tools' are any JSON object (their schemas are not promised under `auto`, so one that
/// llguidance cannot compile must not fail the request).
pub fn auto_call_grammar(tools: &ToolRequest, syntax: ToolSyntax) -> Option<String> {
    if tools.choice != ToolChoice::Auto || !tools.active() || !tools.tools.iter().any(|t| t.strict) {
        return None;
    }
    let mut g = String::new();
    let (text, first, separator, open) = match syntax {
        ToolSyntax::Hermes => {
            (r"/(?s:.+)/ & ~/(?s:.*)<tool_call>(?s:.*)/", "open call", "\"\\n<tool_call>\" call", "\\n")
        }
        ToolSyntax::Llama3Json => (r"/(?s:.+)/ & ~/(\s|<\|python_tag\|>)*\{(?s:.*)/", "call", "\"; \" call", ""),
    };
    if tools.parallel {
        g.push_str(&format!("start: TEXT? | {first} ({separator})*\n"));
    } else {
        g.push_str(&format!("start: TEXT? | {first}\n"));
    }
    g.push_str(&format!("TEXT: {text}\n"));
    if syntax == ToolSyntax::Hermes {
        g.push_str("open[lazy]: /(?s:.*)<tool_call>/\n");
    }
    let alternatives: Vec<String> = (0..tools.tools.len()).map(|i| format!("call_{i}")).collect();
    g.push_str(&format!("call: {}\n", alternatives.join(" | ")));
    for (i, tool) in tools.tools.iter().enumerate() {
        let schema = if tool.strict { arguments_schema(tool) } else { any_object() };
        g.push_str(&call_rule(&format!("call_{i}"), open, tool, syntax, schema));
    }
    Some(g)
}

/// `rule: "<open>{"name": "<name>", "<key>": " %json <schema> "}<close>"` for one tool.
fn call_rule(rule: &str, open: &str, tool: &ToolDef, syntax: ToolSyntax, schema: Value) -> String {
    // Tool names are [A-Za-z0-9_-]+ (checked in spec.rs): nothing to escape.
    let (key, close) = match syntax {
        ToolSyntax::Hermes => ("arguments", "}\\n</tool_call>"),
        ToolSyntax::Llama3Json => ("parameters", "}"),
    };
    format!(
        "{rule}: \"{open}{{\\\"name\\\": \\\"{name}\\\", \\\"{key}\\\": \" %json {schema} \"{close}\"\n",
        name = tool.name
    )
}

/// The tool's parameters schema with llguidance's formatting options.
fn arguments_schema(tool: &ToolDef) -> Value {
    let schema = match &tool.parameters {
        Value::Object(o) => o.clone(),
        _ => serde_json::Map::new(),
    };
    with_format(schema, !tool.strict)
}

/// Any JSON object (a non-strict tool's arguments under `auto`).
fn any_object() -> Value {
    let mut schema = serde_json::Map::new();
    schema.insert("type".to_owned(), json!("object"));
    with_format(schema, false)
}

/// `schema` with llguidance's formatting options (compact JSON) in `x-guidance`.
fn with_format(mut schema: serde_json::Map<String, Value>, lenient: bool) -> Value {
    schema.insert(
        "x-guidance".to_owned(),
        json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": lenient}),
    );
    Value::Object(schema)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, strict: bool) -> ToolDef {
        ToolDef { name: name.into(), description: None, parameters: json!({"type": "object"}), strict }
    }

    #[test]
    fn grammars_for_each_choice() {
        let tools = vec![tool("get_weather", true), tool("search", false)];
        let auto = ToolRequest { tools: tools.clone(), choice: ToolChoice::Auto, parallel: true };
        assert_eq!(forced_call_grammar(&auto, ToolSyntax::Hermes), None);

        let named = ToolRequest { tools: tools.clone(), choice: ToolChoice::Named("search".into()), parallel: true };
        let g = forced_call_grammar(&named, ToolSyntax::Hermes).unwrap_or_default();
        let schema_value = json!({"type": "object", "x-guidance":
            {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": true}});
        let want = format!(
            "start: call\ncall: call_0\ncall_0: \"<tool_call>\\n{{\\\"name\\\": \\\"search\\\", \\\"arguments\\\": \" %json {} \"}}\\n</tool_call>\"\n",
            schema_value
        );
        assert_eq!(g, want);

        let required = ToolRequest { tools, choice: ToolChoice::Required, parallel: true };
        let g = forced_call_grammar(&required, ToolSyntax::Llama3Json).unwrap_or_default();
        assert!(g.starts_with("start: call (\"; \" call)*\ncall: call_0 | call_1\n"), "{g}");
        assert!(g.contains("\\\"parameters\\\": ") && g.contains("\"lenient\":false"), "{g}");
    }
}
