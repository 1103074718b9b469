//! The grammar that forces a tool call (`tool_choice` `required` / `any` / a named tool):
//! a Lark grammar in llguidance's dialect whose language is exactly the calls the parser
//! accepts, in the model's syntax, with each tool's arguments held to its JSON Schema through
//! `%json {...}`. The name and the JSON framing are literals, so the name comes first (the
//! parser commits to the call as soon as it is read) and nothing else can be written; after
//! the last call only EOS is allowed, so the sequence ends there.
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

/// Sets the forced-call grammar on `spec` when a call is forced, compile-checked like a
/// `response_format` (a grammar that does not compile in time is a 400 on `tools`). A forced
/// call and `response_format` together are a 400 on `tool_choice`.
pub async fn apply(
    state: &AppState,
    tools: &ToolRequest,
    syntax: ToolSyntax,
    spec: &mut SamplingSpec,
) -> Result<(), ApiError> {
    let Some(grammar) = forced_call_grammar(tools, syntax) else { return Ok(()) };
    if spec.constraint.is_some() {
        return Err(ApiError::invalid("tool_choice", "a forced tool call cannot be combined with response_format"));
    }
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
    for (i, tool) in chosen.iter().enumerate() {
        let schema = arguments_schema(tool);
        // Tool names are [A-Za-z0-9_-]+ (checked in spec.rs): nothing to escape.
        let (open, key, close) = match syntax {
            ToolSyntax::Hermes => ("<tool_call>\\n", "arguments", "}\\n</tool_call>"),
            ToolSyntax::Llama3Json => ("", "parameters", "}"),
        };
        g.push_str(&format!(
            "call_{i}: \"{open}{{\\\"name\\\": \\\"{name}\\\", \\\"{key}\\\": \" %json {schema} \"{close}\"\n",
            name = tool.name
        ));
    }
    Some(g)
}

/// The tool's parameters schema with llguidance's formatting options.
fn arguments_schema(tool: &ToolDef) -> Value {
    let mut schema = match &tool.parameters {
        Value::Object(o) => o.clone(),
        _ => serde_json::Map::new(),
    };
    schema.insert(
        "x-guidance".to_owned(),
        json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": !tool.strict}),
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
