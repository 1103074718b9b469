//! A Messages request onto the chat path: the sampling fields into `validate::common` (so
//! ranges and errors match chat's), stop sequences into stop strings; the `anthropic-version`
//! header check; and the finish of a choice into Anthropic's `stop_reason`. The conversation
//! (`system`, text / `tool_use` / `tool_result` blocks) and tools are read by
//! `tools::spec::anthropic_messages` and rendered by `tools::render`.

use axum::http::HeaderMap;

use super::errors::AnthropicError;
use super::types::MessagesRequest;
use crate::app::AppState;
use crate::choice::ApiFinish;
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
    let stops = req.stop_sequences.clone().unwrap_or_default();
    validate::check_stops("stop_sequences", &stops, validate::MAX_STOP_SEQUENCES)?;
    params.stop_strings = stops;
    Ok(params)
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
