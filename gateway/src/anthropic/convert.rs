//! A Messages request onto the chat path: `system` and `messages` into template messages, the
//! sampling fields into `validate::common` (so ranges and errors match chat's), stop sequences
//! into stop strings; the `anthropic-version` header check; and the finish of a choice into
//! Anthropic's `stop_reason`.

use axum::http::HeaderMap;
use serde_json::Value;

use super::errors::AnthropicError;
use super::types::{MessageIn, MessagesRequest};
use crate::app::AppState;
use crate::choice::ApiFinish;
use crate::codec::ChatMessage;
use crate::openai::common::SamplingFields;
use crate::validate::{self, CommonParams};

pub const ANTHROPIC_VERSION: &str = "anthropic-version";

/// `anthropic-version` is optional; when sent it must look like a date (`2023-06-01`).
pub fn check_version(headers: &HeaderMap) -> Result<(), AnthropicError> {
    let Some(value) = headers.get(ANTHROPIC_VERSION) else {
        return Ok(());
    };
    let ok = value.to_str().is_ok_and(is_date_like);
    if ok {
        Ok(())
    } else {
        Err(AnthropicError::invalid(
            ANTHROPIC_VERSION,
            "the anthropic-version header must be a date such as 2023-06-01",
        ))
    }
}

/// `YYYY-MM-DD` with a plausible month and day.
fn is_date_like(s: &str) -> bool {
    let parts: Vec<&str> = s.trim().split('-').collect();
    let digits = |p: &str, n: usize| p.len() == n && p.bytes().all(|b| b.is_ascii_digit());
    match parts.as_slice() {
        [y, m, d] if digits(y, 4) && digits(m, 2) && digits(d, 2) => {
            matches!(m.parse::<u32>(), Ok(1..=12)) && matches!(d.parse::<u32>(), Ok(1..=31))
        }
        _ => false,
    }
}

/// The sampling parameters: Anthropic's fields through chat's validation. Temperature is
/// limited to Anthropic's 0..=1 first; stop sequences are not limited in number.
pub fn params(state: &AppState, req: &MessagesRequest) -> Result<CommonParams, AnthropicError> {
    if let Some(t) = req.temperature {
        if !(0.0..=1.0).contains(&t) {
            return Err(AnthropicError::invalid("temperature", format!("temperature must be in [0, 1], got {t}")));
        }
    }
    if let Some(user_id) = req.metadata.as_ref().and_then(|m| m.user_id.as_deref()) {
        tracing::debug!(user_id, "anthropic metadata");
    }
    let fields = SamplingFields {
        model: req.model.clone(),
        stream: req.stream,
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        ..SamplingFields::default()
    };
    let mut params = validate::common(state, &fields, ("max_tokens", Some(req.max_tokens)), None)?;
    params.stop_strings = req.stop_sequences.clone().unwrap_or_default();
    Ok(params)
}

/// The conversation for the template: `system` first (when given), then the messages.
pub fn messages(system: Option<&Value>, messages: &[MessageIn]) -> Result<Vec<ChatMessage>, AnthropicError> {
    if messages.is_empty() {
        return Err(AnthropicError::invalid("messages", "messages must contain at least one message"));
    }
    let mut out = Vec::with_capacity(messages.len() + 1);
    match system {
        None | Some(Value::Null) => {}
        Some(system) => out.push(ChatMessage { role: "system".to_owned(), content: text_of(system, "system")? }),
    }
    for (i, m) in messages.iter().enumerate() {
        let role = match m.role.as_str() {
            r @ ("user" | "assistant") => r,
            other => {
                return Err(AnthropicError::invalid(
                    format!("messages[{i}].role"),
                    format!("unknown role {other:?}; expected user or assistant (use `system` for the system prompt)"),
                ))
            }
        };
        let content = text_of(&m.content, &format!("messages[{i}].content"))?;
        out.push(ChatMessage { role: role.to_owned(), content });
    }
    Ok(out)
}

/// A string, or the text of a list of `text` blocks (joined by newlines). Other block types
/// are refused: this gateway does not take tools or images yet.
fn text_of(value: &Value, param: &str) -> Result<String, AnthropicError> {
    match value {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let texts = blocks.iter().enumerate().map(|(j, block)| {
                let kind = block.get("type").and_then(Value::as_str);
                match (kind, block.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(text)) => Ok(text),
                    (Some("text"), None) => Err(AnthropicError::invalid(
                        format!("{param}[{j}].text"),
                        "a text block needs a \"text\" string",
                    )),
                    (Some(other), _) => Err(AnthropicError::invalid(
                        format!("{param}[{j}].type"),
                        format!("content blocks of type {other:?} are not supported; only \"text\" blocks are"),
                    )),
                    (None, _) => Err(AnthropicError::invalid(
                        format!("{param}[{j}].type"),
                        "each content block needs a \"type\"",
                    )),
                }
            });
            Ok(texts.collect::<Result<Vec<_>, _>>()?.join("\n"))
        }
        _ => Err(AnthropicError::invalid(param, "content must be a string or a list of text blocks")),
    }
}

/// Anthropic's `stop_reason`: a stop string is `stop_sequence`, EOS `end_turn`, the budget
/// `max_tokens`. A sequence the engine aborted has no Anthropic reason; it is `end_turn`.
pub fn stop_reason(finish: Option<ApiFinish>, stop_sequence: Option<&str>) -> &'static str {
    match (finish, stop_sequence) {
        (_, Some(_)) => "stop_sequence",
        (Some(ApiFinish::Length), None) => "max_tokens",
        _ => "end_turn",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn date_like_versions() {
        assert!(is_date_like("2023-06-01"));
        assert!(!is_date_like("2023-13-01"));
        assert!(!is_date_like("latest"));
        assert!(!is_date_like("2023-6-1"));
    }

    #[test]
    fn stop_reasons() {
        assert_eq!(stop_reason(Some(ApiFinish::Stop), Some("##")), "stop_sequence");
        assert_eq!(stop_reason(Some(ApiFinish::Stop), None), "end_turn");
        assert_eq!(stop_reason(Some(ApiFinish::Length), None), "max_tokens");
    }
}
