//! The request side of tool calling, common to both APIs: the offered tools, the choice, and
//! the conversation with its tool turns, validated (each error names its field) and
//! normalised. `openai_*` read OpenAI's shapes (`tools[].function`, `tool_choice`,
//! `messages[].tool_calls`, `role: "tool"`); `anthropic_*` read Anthropic's (`tools[]` with
//! `input_schema`, `tool_choice.type`, `tool_use` / `tool_result` blocks).

use std::collections::HashMap;

use serde_json::{Map, Value};

use crate::error::ApiError;

/// Longest tool name both APIs accept.
const MAX_NAME: usize = 64;

/// One offered tool.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDef {
    pub name: String,
    pub description: Option<String>,
    /// A JSON Schema object for the arguments.
    pub parameters: Value,
    /// `strict` (OpenAI `function.strict`, Anthropic `strict`): the arguments must follow the
    /// schema (enforced by the call grammar, forced or `auto`; see docs/tools.md).
    pub strict: bool,
}

/// Whether and which tool the model must call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default when tools are given).
    Auto,
    /// No call: tools are not offered and the output is not parsed for calls.
    None,
    /// At least one call (OpenAI `required`, Anthropic `any`).
    Required,
    /// One call to this tool.
    Named(String),
}

/// The tools of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolRequest {
    pub tools: Vec<ToolDef>,
    pub choice: ToolChoice,
    /// Several calls in one turn allowed (OpenAI `parallel_tool_calls`, Anthropic
    /// `!disable_parallel_tool_use`).
    pub parallel: bool,
}

impl ToolRequest {
    /// Tools are offered to the model and its output parsed for calls.
    pub fn active(&self) -> bool {
        !self.tools.is_empty() && self.choice != ToolChoice::None
    }

    /// A call must come (`required`, `any`, or a named tool).
    pub fn forced(&self) -> bool {
        self.active() && matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_))
    }

    pub fn names(&self) -> Vec<String> {
        self.tools.iter().map(|t| t.name.clone()).collect()
    }
}

/// A call in an assistant turn of the conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct CallIn {
    pub id: String,
    pub name: String,
    /// The arguments as JSON (an object when they parse as one; else the raw string).
    pub arguments: Value,
}

/// One turn of the conversation, ready for rendering. `role` is `system`, `user`,
/// `assistant` or `tool`.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    pub role: String,
    pub content: String,
    /// Assistant turns: the calls the model made.
    pub tool_calls: Vec<CallIn>,
    /// Tool turns: the call this answers, and the tool's name when known.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

impl Turn {
    pub fn text(role: &str, content: String) -> Self {
        Turn { role: role.to_owned(), content, tool_calls: Vec::new(), tool_call_id: None, name: None }
    }
}

/// Whether the conversation carries tool calls or results (then it needs tool rendering even
/// when no tools are offered now).
pub fn has_tool_turns(turns: &[Turn]) -> bool {
    turns.iter().any(|t| !t.tool_calls.is_empty() || t.role == "tool")
}

fn check_name(name: &str, param: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            param,
            format!("tool names must be 1 to {MAX_NAME} of a-z, A-Z, 0-9, _ and -, got {name:?}"),
        ))
    }
}

/// A schema object (or absent: no arguments).
fn schema(value: Option<&Value>, param: &str) -> Result<Value, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(serde_json::json!({"type": "object", "properties": {}})),
        Some(v @ Value::Object(_)) => Ok(v.clone()),
        Some(_) => Err(ApiError::invalid(param, "a tool's parameters must be a JSON Schema object")),
    }
}

/// A tool's optional `strict` flag (OpenAI `function.strict`, Anthropic `strict`).
fn strict(value: Option<&Value>, param: &str) -> Result<bool, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(param, "strict must be a boolean")),
    }
}

fn unique(tools: &[ToolDef], param: impl Fn(usize) -> String) -> Result<(), ApiError> {
    // A set, not a scan of the earlier tools: a body may list a hundred thousand of them.
    let mut seen = std::collections::HashSet::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        if !seen.insert(t.name.as_str()) {
            return Err(ApiError::invalid(param(i), format!("tool name {:?} is used twice", t.name)));
        }
    }
    Ok(())
}

fn choice_named(tools: &[ToolDef], name: &str) -> Result<ToolChoice, ApiError> {
    if tools.iter().any(|t| t.name == name) {
        Ok(ToolChoice::Named(name.to_owned()))
    } else {
        Err(ApiError::invalid("tool_choice", format!("tool_choice names {name:?}, which is not in tools")))
    }
}

/// OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.
pub fn openai_tools(
    tools: Option<&Value>,
    choice: Option<&Value>,
    parallel: Option<bool>,
) -> Result<ToolRequest, ApiError> {
    let defs = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let p = format!("tools[{i}]");
                match item.get("type").and_then(Value::as_str) {
                    Some("function") => {}
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{p}.type"),
                            "only tools of type \"function\" are supported",
                        ))
                    }
                }
                let f = item.get("function").filter(|f| f.is_object()).ok_or_else(|| {
                    ApiError::invalid(format!("{p}.function"), "a function tool needs a \"function\" object")
                })?;
                let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid(format!("{p}.function.name"), "a function needs a \"name\" string")
                })?;
                check_name(name, &format!("{p}.function.name"))?;
                let description = match f.get("description") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(_) => {
                        return Err(ApiError::invalid(
                            format!("{p}.function.description"),
                            "description must be a string",
                        ))
                    }
                };
                let strict = strict(f.get("strict"), &format!("{p}.function.strict"))?;
                let parameters = schema(f.get("parameters"), &format!("{p}.function.parameters"))?;
                Ok(ToolDef { name: name.to_owned(), description, parameters, strict })
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(ApiError::invalid("tools", "tools must be a list")),
    };
    unique(&defs, |i| format!("tools[{i}].function.name"))?;
    let choice = match choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice must be \"auto\", \"none\", \"required\" or a function, got {other:?}"),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            match (o.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(name)) => choice_named(&defs, name)?,
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ))
                }
            }
        }
        Some(_) => return Err(ApiError::invalid("tool_choice", "tool_choice must be a string or an object")),
    };
    if defs.is_empty() && matches!(choice, ToolChoice::Required) {
        return Err(ApiError::invalid("tool_choice", "tool_choice \"required\" needs tools"));
    }
    Ok(ToolRequest { tools: defs, choice, parallel: parallel.unwrap_or(true) })
}

/// Anthropic's `tools` (`name`, `description`, `input_schema`) and `tool_choice`.
pub fn anthropic_tools(tools: Option<&Value>, choice: Option<&Value>) -> Result<ToolRequest, ApiError> {
    let defs = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let p = format!("tools[{i}]");
                match item.get("type").and_then(Value::as_str) {
                    None | Some("custom") => {}
                    Some(other) => {
                        return Err(ApiError::invalid(
                            format!("{p}.type"),
                            format!("tools of type {other:?} are not supported; only client (custom) tools are"),
                        ))
                    }
                }
                let name = item
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::invalid(format!("{p}.name"), "a tool needs a \"name\" string"))?;
                check_name(name, &format!("{p}.name"))?;
                let description = item.get("description").and_then(Value::as_str).map(str::to_owned);
                let parameters = match item.get("input_schema") {
                    Some(v @ Value::Object(_)) => v.clone(),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{p}.input_schema"),
                            "a tool needs an \"input_schema\" JSON Schema object",
                        ))
                    }
                };
                let strict = strict(item.get("strict"), &format!("{p}.strict"))?;
                Ok(ToolDef { name: name.to_owned(), description, parameters, strict })
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(ApiError::invalid("tools", "tools must be a list")),
    };
    unique(&defs, |i| format!("tools[{i}].name"))?;
    let (choice, parallel) = match choice {
        None | Some(Value::Null) => (ToolChoice::Auto, true),
        Some(Value::Object(o)) => {
            let parallel = match o.get("disable_parallel_tool_use") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => !b,
                Some(_) => {
                    return Err(ApiError::invalid(
                        "tool_choice.disable_parallel_tool_use",
                        "disable_parallel_tool_use must be a boolean",
                    ))
                }
            };
            let choice = match (o.get("type").and_then(Value::as_str), o.get("name").and_then(Value::as_str)) {
                (Some("auto"), _) => ToolChoice::Auto,
                (Some("none"), _) => ToolChoice::None,
                (Some("any"), _) => ToolChoice::Required,
                (Some("tool"), Some(name)) => choice_named(&defs, name)?,
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "tool_choice.type must be \"auto\", \"any\", \"none\" or \"tool\" (with a \"name\")",
                    ))
                }
            };
            (choice, parallel)
        }
        Some(_) => return Err(ApiError::invalid("tool_choice", "tool_choice must be an object")),
    };
    if defs.is_empty() && matches!(choice, ToolChoice::Required) {
        return Err(ApiError::invalid("tool_choice", "tool_choice \"any\" needs tools"));
    }
    Ok(ToolRequest { tools: defs, choice, parallel })
}

/// Arguments as the template wants them: the JSON they encode when it parses, else the string.
fn parse_arguments(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
}

/// OpenAI's messages, with `tool_calls` on assistant turns and `tool` turns answering them.
/// A `tool` turn needs a `tool_call_id` naming a call of an earlier assistant turn.
pub fn openai_messages(messages: &[Value]) -> Result<Vec<Turn>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must contain at least one message"));
    }
    let mut turns = Turns::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let p = format!("messages[{i}]");
        let Some(m) = m.as_object() else {
            return Err(ApiError::invalid(p, "each message must be an object"));
        };
        let role = match m.get("role").and_then(Value::as_str) {
            Some("system" | "developer") => "system",
            Some(r @ ("user" | "assistant" | "tool")) => r,
            Some(other) => {
                return Err(ApiError::invalid(
                    format!("{p}.role"),
                    format!("unknown role {other:?}; expected system, developer, user, assistant or tool"),
                ))
            }
            None => return Err(ApiError::invalid(format!("{p}.role"), "each message needs a \"role\" string")),
        };
        let content = crate::validate::message_content(m.get("content"), role, &format!("{p}.content"))?;
        let mut turn = Turn::text(role, content);
        match role {
            "assistant" => turn.tool_calls = openai_calls(m, &p)?,
            "tool" => {
                let id = m.get("tool_call_id").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid(format!("{p}.tool_call_id"), "a tool message needs a \"tool_call_id\" string")
                })?;
                turn.name = Some(turns.answered_call(id, &format!("{p}.tool_call_id"))?);
                turn.tool_call_id = Some(id.to_owned());
            }
            _ => {}
        }
        turns.push(turn);
    }
    Ok(turns.turns)
}

fn openai_calls(m: &Map<String, Value>, p: &str) -> Result<Vec<CallIn>, ApiError> {
    let calls = match m.get("tool_calls") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(calls)) => calls,
        Some(_) => return Err(ApiError::invalid(format!("{p}.tool_calls"), "tool_calls must be a list")),
    };
    calls
        .iter()
        .enumerate()
        .map(|(j, c)| {
            let q = format!("{p}.tool_calls[{j}]");
            let id = c
                .get("id")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid(format!("{q}.id"), "a tool call needs an \"id\" string"))?;
            let f = c.get("function");
            let name = f
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid(format!("{q}.function.name"), "a tool call needs a function name"))?;
            let arguments = match f.and_then(|f| f.get("arguments")) {
                Some(Value::String(s)) => parse_arguments(s),
                None | Some(Value::Null) => Value::Object(Map::new()),
                Some(_) => {
                    return Err(ApiError::invalid(
                        format!("{q}.function.arguments"),
                        "arguments must be a string of JSON",
                    ))
                }
            };
            Ok(CallIn { id: id.to_owned(), name: name.to_owned(), arguments })
        })
        .collect()
}

/// The turns read so far, with the calls of the latest assistant turn by id. Looking a tool
/// turn's call up in that map, rather than scanning back for the assistant turn and through
/// its calls, keeps a request of many tool turns linear (it was quadratic in their number).
struct Turns {
    turns: Vec<Turn>,
    /// Call id -> tool name, of the latest assistant turn only; empty before any.
    latest_calls: HashMap<String, String>,
}

impl Turns {
    fn with_capacity(n: usize) -> Self {
        Turns { turns: Vec::with_capacity(n), latest_calls: HashMap::new() }
    }

    /// Appends `turn`; an assistant turn's calls replace the previous ones as those answerable.
    fn push(&mut self, turn: Turn) {
        if turn.role == "assistant" {
            // A fresh map rather than `clear`, which costs the old map's capacity each time.
            let mut calls = HashMap::with_capacity(turn.tool_calls.len());
            for c in &turn.tool_calls {
                // The first call with a repeated id answers it, as a front-to-back search did.
                calls.entry(c.id.clone()).or_insert_with(|| c.name.clone());
            }
            self.latest_calls = calls;
        }
        self.turns.push(turn);
    }

    /// The name of the call `id` answers: one of the calls of the latest assistant turn.
    fn answered_call(&self, id: &str, param: &str) -> Result<String, ApiError> {
        self.latest_calls.get(id).cloned().ok_or_else(|| {
            ApiError::invalid(param, format!("{id:?} does not name a tool call of the preceding assistant message"))
        })
    }
}

/// Anthropic's `system` and messages: `text`, `tool_use` (assistant) and `tool_result`
/// (user) blocks. A user message's `tool_result` blocks become `tool` turns (in order) before
/// its text; an `is_error` result's text is prefixed with `Error: `.
pub fn anthropic_messages(system: Option<&Value>, messages: &[Value]) -> Result<Vec<Turn>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must contain at least one message"));
    }
    let mut turns = Turns::with_capacity(messages.len() + 1);
    match system {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => turns.push(Turn::text("system", s.clone())),
        Some(Value::Array(blocks)) => {
            let texts = blocks.iter().enumerate().map(|(j, b)| block_text(b, &format!("system[{j}]")));
            turns.push(Turn::text("system", texts.collect::<Result<Vec<_>, _>>()?.join("\n")));
        }
        Some(_) => return Err(ApiError::invalid("system", "system must be a string or a list of text blocks")),
    }
    for (i, m) in messages.iter().enumerate() {
        let p = format!("messages[{i}]");
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            Some(other) => {
                return Err(ApiError::invalid(
                    format!("{p}.role"),
                    format!("unknown role {other:?}; expected user or assistant (use `system` for the system prompt)"),
                ))
            }
            None => return Err(ApiError::invalid(format!("{p}.role"), "each message needs a \"role\" string")),
        };
        let content = m.get("content").unwrap_or(&Value::Null);
        let blocks = match content {
            Value::String(s) => {
                turns.push(Turn::text(role, s.clone()));
                continue;
            }
            Value::Array(blocks) => blocks,
            _ => {
                return Err(ApiError::invalid(
                    format!("{p}.content"),
                    "content must be a string or a list of content blocks",
                ))
            }
        };
        let mut texts = Vec::new();
        let mut calls = Vec::new();
        let mut results = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let q = format!("{p}.content[{j}]");
            match (role, b.get("type").and_then(Value::as_str)) {
                (_, Some("text")) => texts.push(block_text(b, &q)?),
                ("assistant", Some("tool_use")) => {
                    let id = b.get("id").and_then(Value::as_str);
                    let name = b.get("name").and_then(Value::as_str);
                    let input = b.get("input").filter(|v| v.is_object());
                    match (id, name, input) {
                        (Some(id), Some(name), Some(input)) => {
                            calls.push(CallIn { id: id.to_owned(), name: name.to_owned(), arguments: input.clone() })
                        }
                        _ => {
                            return Err(ApiError::invalid(
                                q,
                                "a tool_use block needs \"id\" and \"name\" strings and an \"input\" object",
                            ))
                        }
                    }
                }
                ("user", Some("tool_result")) => {
                    let id = b.get("tool_use_id").and_then(Value::as_str).ok_or_else(|| {
                        ApiError::invalid(
                            format!("{q}.tool_use_id"),
                            "a tool_result block needs a \"tool_use_id\" string",
                        )
                    })?;
                    let name = turns.answered_call(id, &format!("{q}.tool_use_id"))?;
                    let mut text = match b.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Array(parts)) => parts
                            .iter()
                            .enumerate()
                            .map(|(k, part)| block_text(part, &format!("{q}.content[{k}]")))
                            .collect::<Result<Vec<_>, _>>()?
                            .join("\n"),
                        Some(_) => {
                            return Err(ApiError::invalid(
                                format!("{q}.content"),
                                "tool_result content must be a string or a list of text blocks",
                            ))
                        }
                    };
                    match b.get("is_error") {
                        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
                        Some(Value::Bool(true)) => text = format!("Error: {text}"),
                        Some(_) => {
                            return Err(ApiError::invalid(format!("{q}.is_error"), "is_error must be a boolean"))
                        }
                    }
                    let mut turn = Turn::text("tool", text);
                    turn.tool_call_id = Some(id.to_owned());
                    turn.name = Some(name);
                    results.push(turn);
                }
                (_, Some(other)) => {
                    return Err(ApiError::invalid(
                        format!("{q}.type"),
                        format!("content blocks of type {other:?} are not supported in {role} messages"),
                    ))
                }
                (_, None) => return Err(ApiError::invalid(format!("{q}.type"), "each content block needs a \"type\"")),
            }
        }
        let had_results = !results.is_empty();
        for t in results {
            turns.push(t);
        }
        if role == "assistant" {
            let mut turn = Turn::text(role, texts.join("\n"));
            turn.tool_calls = calls;
            turns.push(turn);
        } else if !texts.is_empty() || !had_results {
            turns.push(Turn::text(role, texts.join("\n")));
        }
    }
    Ok(turns.turns)
}

/// The text of a `text` block.
fn block_text(block: &Value, param: &str) -> Result<String, ApiError> {
    match (block.get("type").and_then(Value::as_str), block.get("text").and_then(Value::as_str)) {
        (Some("text"), Some(text)) => Ok(text.to_owned()),
        (Some("text"), None) => Err(ApiError::invalid(format!("{param}.text"), "a text block needs a \"text\" string")),
        (Some(other), _) => Err(ApiError::invalid(
            format!("{param}.type"),
            format!("content blocks of type {other:?} are not supported here; only \"text\" blocks are"),
        )),
        (None, _) => Err(ApiError::invalid(format!("{param}.type"), "each content block needs a \"type\"")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param(e: ApiError) -> Option<String> {
        match e {
            ApiError::InvalidRequest { param, .. } => param,
            _ => None,
        }
    }

    #[test]
    fn openai_choices_and_their_errors() {
        let tools =
            json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let r = openai_tools(Some(&tools), Some(&named), Some(false)).unwrap();
        assert_eq!(r.choice, ToolChoice::Named("get_weather".into()));
        assert!(r.forced() && !r.parallel);
        let none = openai_tools(Some(&tools), Some(&json!("none")), None).unwrap();
        assert!(!none.active());
        let unknown = json!({"type": "function", "function": {"name": "nope"}});
        assert_eq!(
            param(openai_tools(Some(&tools), Some(&unknown), None).unwrap_err()).as_deref(),
            Some("tool_choice")
        );
        assert_eq!(
            param(openai_tools(None, Some(&json!("required")), None).unwrap_err()).as_deref(),
            Some("tool_choice")
        );
        assert_eq!(
            param(openai_tools(Some(&tools), Some(&json!("sometimes")), None).unwrap_err()).as_deref(),
            Some("tool_choice")
        );
        let bad_name = json!([{"type": "function", "function": {"name": "get weather"}}]);
        assert_eq!(
            param(openai_tools(Some(&bad_name), None, None).unwrap_err()).as_deref(),
            Some("tools[0].function.name")
        );
        let twice = json!([tools[0], tools[0]]);
        assert_eq!(
            param(openai_tools(Some(&twice), None, None).unwrap_err()).as_deref(),
            Some("tools[1].function.name")
        );
    }

    #[test]
    fn openai_tool_turns_need_a_matching_call() {
        let call = json!({"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}});
        let ok = [
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": null, "tool_calls": [call]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "42"}),
        ];
        let turns = openai_messages(&ok).unwrap();
        assert_eq!(turns[1].tool_calls[0].arguments, json!({"a": 1}));
        assert_eq!(turns[2].name.as_deref(), Some("f"));
        let mut missing = ok.clone();
        missing[2] = json!({"role": "tool", "content": "42"});
        assert_eq!(param(openai_messages(&missing).unwrap_err()).as_deref(), Some("messages[2].tool_call_id"));
        let mut wrong = ok.clone();
        wrong[2] = json!({"role": "tool", "tool_call_id": "call_9", "content": "42"});
        assert_eq!(param(openai_messages(&wrong).unwrap_err()).as_deref(), Some("messages[2].tool_call_id"));
    }

    #[test]
    fn only_the_latest_assistant_turn_is_answered() {
        let call = |id: &str, name: &str| json!({"id": id, "type": "function", "function": {"name": name}});
        let first = json!({"role": "assistant", "content": null, "tool_calls": [call("c1", "f")]});
        // A repeated id answers the first call with it, as before the lookup became a map.
        let second = json!({"role": "assistant", "content": null, "tool_calls": [call("c2", "g"), call("c2", "h")]});
        let answer = |id: &str| json!({"role": "tool", "tool_call_id": id, "content": ""});
        let turns = openai_messages(&[first.clone(), answer("c1"), second.clone(), answer("c2")]).unwrap();
        assert_eq!((turns[1].name.as_deref(), turns[3].name.as_deref()), (Some("f"), Some("g")));
        let stale = [first.clone(), second, answer("c1")];
        assert_eq!(param(openai_messages(&stale).unwrap_err()).as_deref(), Some("messages[2].tool_call_id"));
        // An assistant turn without calls leaves nothing to answer.
        let plain = [first, json!({"role": "assistant", "content": "done"}), answer("c1")];
        assert_eq!(param(openai_messages(&plain).unwrap_err()).as_deref(), Some("messages[2].tool_call_id"));
    }

    /// Many tool turns answering one call: each is looked up in O(1). (Scanning back over
    /// every earlier turn for each took about n^2 / 2 = 1.25e9 steps here.)
    #[test]
    fn many_tool_turns_answer_one_call() {
        const N: usize = 50_000;
        let call = json!({"id": "a", "type": "function", "function": {"name": "f"}});
        let mut messages = vec![json!({"role": "assistant", "content": null, "tool_calls": [call]})];
        messages.extend(std::iter::repeat_n(json!({"role": "tool", "tool_call_id": "a", "content": ""}), N));
        let turns = openai_messages(&messages).unwrap();
        assert_eq!(turns.len(), N + 1);
        assert!(turns[1..].iter().all(|t| t.name.as_deref() == Some("f")));
        messages.push(json!({"role": "tool", "tool_call_id": "b", "content": ""}));
        let last = format!("messages[{}].tool_call_id", N + 1);
        assert_eq!(param(openai_messages(&messages).unwrap_err()), Some(last));

        let tool_use = json!({"type": "tool_use", "id": "a", "name": "f", "input": {}});
        let mut messages = vec![json!({"role": "assistant", "content": [tool_use]})];
        let result = json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a"}]});
        messages.extend(std::iter::repeat_n(result, N));
        let turns = anthropic_messages(None, &messages).unwrap();
        assert_eq!(turns.len(), N + 1);
        assert!(turns[1..].iter().all(|t| t.role == "tool" && t.name.as_deref() == Some("f")));
        messages.push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "b"}]}));
        let last = format!("messages[{}].content[0].tool_use_id", N + 1);
        assert_eq!(param(anthropic_messages(None, &messages).unwrap_err()), Some(last));
    }

    #[test]
    fn anthropic_blocks_become_turns() {
        let messages = [
            json!({"role": "user", "content": "weather?"}),
            json!({"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
            ]}),
            json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "thanks"}
            ]}),
        ];
        let turns = anthropic_messages(Some(&json!("be brief")), &messages).unwrap();
        let roles: Vec<&str> = turns.iter().map(|t| t.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(turns[2].tool_calls[0].arguments, json!({"city": "Paris"}));
        assert_eq!((turns[3].content.as_str(), turns[3].name.as_deref()), ("sunny", Some("get_weather")));
        let orphan = [json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]})];
        assert_eq!(
            param(anthropic_messages(None, &orphan).unwrap_err()).as_deref(),
            Some("messages[0].content[0].tool_use_id")
        );
        let any = json!({"type": "any", "disable_parallel_tool_use": true});
        let tools = json!([{"name": "get_weather", "input_schema": {"type": "object"}}]);
        let r = anthropic_tools(Some(&tools), Some(&any)).unwrap();
        assert_eq!((r.choice.clone(), r.parallel), (ToolChoice::Required, false));
        let named = json!({"type": "tool", "name": "other"});
        assert_eq!(param(anthropic_tools(Some(&tools), Some(&named)).unwrap_err()).as_deref(), Some("tool_choice"));
    }
}
