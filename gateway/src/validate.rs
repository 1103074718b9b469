//! Request validation: OpenAI's (and vLLM's) ranges, checked once, each error naming its
//! field in `param`. Produces the engine's `SamplingSpec` plus what the gateway itself needs
//! (stream flags, `n`, stop strings).

use std::collections::HashMap;

use serde_json::Value;

use crate::app::AppState;
use crate::codec::ChatMessage;
use crate::engine::SamplingSpec;
use crate::error::ApiError;
use crate::openai::chat::ChatMessageIn;
use crate::openai::common::SamplingFields;

/// OpenAI's limit on stop strings.
const MAX_STOP_STRINGS: usize = 4;
/// Anthropic documents no count; this many keeps the per-token matching cheap.
pub const MAX_STOP_SEQUENCES: usize = 64;
/// Longest stop string (bytes): the detokeniser holds back up to this much text.
const MAX_STOP_BYTES: usize = 4096;
const MAX_CHAT_TOP_LOGPROBS: i64 = 20;
const MAX_COMPLETION_LOGPROBS: i64 = 5;

/// The validated common part of a chat or completions request.
#[derive(Debug, Clone)]
pub struct CommonParams {
    pub stream: bool,
    pub include_usage: bool,
    pub n: u32,
    pub stop_strings: Vec<String>,
    /// vLLM's `include_stop_str_in_output`: the matched stop string stays in the text.
    pub include_stop_str: bool,
    /// What the client asked for; resolved per prompt by `resolve_max_tokens`.
    pub max_tokens: Option<u32>,
    /// Everything but `max_tokens` and `seed`, which are set per sequence.
    pub spec: SamplingSpec,
}

/// Validates the shared fields. `max_tokens` is `(param name, value)` because chat accepts
/// it under two names; `logprobs` is the endpoint's already-validated top-k request.
pub fn common(
    state: &AppState,
    f: &SamplingFields,
    max_tokens: (&str, Option<i64>),
    logprobs: Option<u32>,
) -> Result<CommonParams, ApiError> {
    state.check_model(f.model.as_deref())?;
    let vocab = state.codec().vocab_size();
    let stream = f.stream.unwrap_or(false);
    let include_usage = match &f.stream_options {
        Some(_) if !stream => {
            return Err(ApiError::invalid("stream_options", "stream_options is only allowed when stream is true"))
        }
        Some(o) => o.include_usage.unwrap_or(false),
        None => false,
    };
    let n = int_in("n", f.n, 1, i64::from(state.config().max_choices))?.unwrap_or(1) as u32;
    let max_name = max_tokens.0;
    let max_tokens = match max_tokens.1 {
        None => None,
        Some(m) if m < 1 => {
            return Err(ApiError::invalid(max_tokens.0, format!("{} must be at least 1, got {m}", max_tokens.0)))
        }
        Some(m) => Some(u32::try_from(m).unwrap_or(u32::MAX)),
    };
    let min_tokens = match f.min_tokens {
        None => 0,
        Some(m) if m < 0 => return Err(ApiError::invalid("min_tokens", format!("min_tokens must be >= 0, got {m}"))),
        Some(m) => match max_tokens {
            Some(max) if m > i64::from(max) => {
                return Err(ApiError::invalid(
                    "min_tokens",
                    format!("min_tokens must be at most {max_name} ({max}), got {m}"),
                ))
            }
            // Without max_tokens, the budget that fits the context ends it first.
            _ => u32::try_from(m).unwrap_or(u32::MAX),
        },
    };
    let ignore_eos = f.ignore_eos.unwrap_or(false);
    let mut stop_token_ids = token_ids("stop_token_ids", f.stop_token_ids.as_deref().unwrap_or(&[]), vocab)?;
    if !ignore_eos {
        stop_token_ids.extend_from_slice(state.eos_token_ids());
    }
    stop_token_ids.sort_unstable();
    stop_token_ids.dedup();
    let top_k = match f.top_k {
        None | Some(-1) | Some(0) => None,
        Some(k) if k < -1 => {
            return Err(ApiError::invalid("top_k", format!("top_k must be -1 (off) or at least 1, got {k}")))
        }
        Some(k) => Some(u32::try_from(k).unwrap_or(u32::MAX)),
    };
    let spec = SamplingSpec {
        temperature: float_in("temperature", f.temperature, 0.0, 2.0, true)?.unwrap_or(1.0),
        top_p: float_in("top_p", f.top_p, 0.0, 1.0, false)?.unwrap_or(1.0),
        top_k,
        min_p: float_in("min_p", f.min_p, 0.0, 1.0, true)?.unwrap_or(0.0),
        repetition_penalty: float_in("repetition_penalty", f.repetition_penalty, 0.0, f64::MAX, false)?.unwrap_or(1.0),
        frequency_penalty: float_in("frequency_penalty", f.frequency_penalty, -2.0, 2.0, true)?.unwrap_or(0.0),
        presence_penalty: float_in("presence_penalty", f.presence_penalty, -2.0, 2.0, true)?.unwrap_or(0.0),
        logit_bias: logit_bias(f, vocab)?,
        seed: f.seed.map(|s| s as u64),
        max_tokens: 1,
        min_tokens,
        stop_token_ids,
        ignore_eos,
        logprobs,
        constraint: None,
    };
    Ok(CommonParams {
        stream,
        include_usage,
        n,
        stop_strings: stop_strings(f.stop.as_ref())?,
        include_stop_str: f.include_stop_str_in_output.unwrap_or(false),
        max_tokens,
        spec,
    })
}

/// Chat's `logprobs` (bool) and `top_logprobs` (0..=20, only with `logprobs: true`).
pub fn chat_logprobs(logprobs: Option<bool>, top: Option<i64>) -> Result<Option<u32>, ApiError> {
    let top = int_in("top_logprobs", top, 0, MAX_CHAT_TOP_LOGPROBS)?;
    match (logprobs.unwrap_or(false), top) {
        (true, top) => Ok(Some(top.unwrap_or(0) as u32)),
        (false, Some(_)) => Err(ApiError::invalid("top_logprobs", "top_logprobs requires logprobs to be true")),
        (false, None) => Ok(None),
    }
}

/// Completions' `logprobs`: the number of alternatives, 0..=5.
pub fn completion_logprobs(logprobs: Option<i64>) -> Result<Option<u32>, ApiError> {
    Ok(int_in("logprobs", logprobs, 0, MAX_COMPLETION_LOGPROBS)?.map(|k| k as u32))
}

/// Chat messages for the template: roles checked (`developer` is OpenAI's newer `system`),
/// content flattened from text parts.
pub fn chat_messages(messages: &[ChatMessageIn]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must contain at least one message"));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "system" | "developer" => "system",
                r @ ("user" | "assistant" | "tool") => r,
                other => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].role"),
                        format!("unknown role {other:?}; expected system, developer, user, assistant or tool"),
                    ))
                }
            };
            let content = message_content(m.content.as_ref(), role, &format!("messages[{i}].content"))?;
            Ok(ChatMessage { role: role.to_owned(), content })
        })
        .collect()
}

/// Text of an OpenAI message's content: a string, text parts (joined by newlines), or
/// nothing for an assistant turn that only called tools; `param` names it in errors.
pub(crate) fn message_content(content: Option<&Value>, role: &str, param: &str) -> Result<String, ApiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        // An assistant turn that only called tools has no content.
        None | Some(Value::Null) if role == "assistant" => Ok(String::new()),
        Some(Value::Array(parts)) => {
            let texts = parts.iter().enumerate().map(|(j, part)| {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(text)) => Ok(text),
                    _ => Err(ApiError::invalid(
                        format!("{param}[{j}]"),
                        "only content parts of type \"text\" with a \"text\" string are supported",
                    )),
                }
            });
            Ok(texts.collect::<Result<Vec<_>, _>>()?.join("\n"))
        }
        _ => Err(ApiError::invalid(param, "content must be a string or a list of text parts")),
    }
}

/// Completion tokens for a prompt of `prompt_len` tokens: the request's `max_tokens` if the
/// `min_tokens` against the rest of the request, once the grammar and a prompt's token
/// budget are known: it cannot go with a grammar (`response_format`, a tool-call grammar),
/// which once complete allows only the stop ids that `min_tokens` bans, so the sequence could
/// only fail; and it must fit `budget`, the prompt's resolved `max_tokens` (vLLM checks it
/// against the default `max_tokens` as well).
pub fn check_min_tokens(spec: &SamplingSpec, budget: u32) -> Result<(), ApiError> {
    if spec.min_tokens == 0 {
        return Ok(());
    }
    if spec.constraint.is_some() {
        return Err(ApiError::invalid(
            "min_tokens",
            "min_tokens cannot be combined with response_format or a tool-call grammar",
        ));
    }
    if spec.min_tokens > budget {
        return Err(ApiError::invalid(
            "min_tokens",
            format!("min_tokens ({}) is more than the {budget} tokens the prompt leaves room for", spec.min_tokens),
        ));
    }
    Ok(())
}

/// total fits the context, else 400; without one, whatever fits (capped by the config).
/// `param` names the prompt field (`messages` or `prompt`).
pub fn resolve_max_tokens(
    state: &AppState,
    prompt_len: usize,
    requested: Option<u32>,
    param: &str,
) -> Result<u32, ApiError> {
    let config = state.config();
    if prompt_len == 0 {
        return Err(ApiError::invalid(param, "the prompt is empty"));
    }
    let too_long = |message: String| ApiError::InvalidRequest {
        message,
        param: Some(param.to_owned()),
        code: Some("context_length_exceeded"),
    };
    if prompt_len > config.max_prompt_tokens as usize {
        return Err(too_long(format!(
            "The prompt has {prompt_len} tokens, more than the limit of {} tokens.",
            config.max_prompt_tokens
        )));
    }
    // prompt_len <= max_prompt_tokens < max_model_len, so this is at least 1.
    let room = config.max_model_len - prompt_len as u32;
    match requested {
        Some(m) if m > room => Err(too_long(format!(
            "This model's maximum context length is {} tokens, but {} were requested \
             ({prompt_len} in the prompt, {m} for the completion). \
             Reduce the length of the prompt or max_tokens.",
            config.max_model_len,
            prompt_len as u64 + u64::from(m),
        ))),
        Some(m) => Ok(m),
        None => Ok(config.default_max_tokens.map_or(room, |d| d.min(room))),
    }
}

/// Token ids from the client: each in `0..vocab`.
pub fn token_ids(param: &str, ids: &[i64], vocab: u32) -> Result<Vec<u32>, ApiError> {
    ids.iter()
        .map(|&id| {
            u32::try_from(id).ok().filter(|&id| id < vocab).ok_or_else(|| {
                ApiError::invalid(param, format!("token id {id} is outside the vocabulary (0..{vocab})"))
            })
        })
        .collect()
}

fn stop_strings(stop: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let bad = || ApiError::invalid("stop", "stop must be a string or a list of strings");
    let stops: Vec<String> = match stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            items.iter().map(|v| v.as_str().map(str::to_owned).ok_or_else(bad)).collect::<Result<_, _>>()?
        }
        Some(_) => return Err(bad()),
    };
    check_stops("stop", &stops, MAX_STOP_STRINGS)?;
    Ok(stops)
}

/// At most `max` stop strings (request field `param`), none empty or over
/// `MAX_STOP_BYTES`.
pub fn check_stops(param: &str, stops: &[String], max: usize) -> Result<(), ApiError> {
    if stops.len() > max {
        return Err(ApiError::invalid(param, format!("at most {max} stop strings are allowed, got {}", stops.len())));
    }
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::invalid(param, "stop strings must not be empty"));
    }
    if let Some(s) = stops.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid(
            param,
            format!("a stop string is {} bytes; at most {MAX_STOP_BYTES} are allowed", s.len()),
        ));
    }
    Ok(())
}

/// The bias by token id, sorted. Keys such as "5", "05" and "+5" all parse to token 5: two
/// of them are refused, as which bias would win depends on the map's order.
fn logit_bias(f: &SamplingFields, vocab: u32) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = &f.logit_bias else { return Ok(Vec::new()) };
    let mut keys = HashMap::with_capacity(map.len());
    let mut bias = map
        .iter()
        .map(|(key, &value)| {
            let id = key.parse::<u32>().ok().filter(|&id| id < vocab).ok_or_else(|| {
                ApiError::invalid("logit_bias", format!("key {key:?} is not a token id in 0..{vocab}"))
            })?;
            if !(-100.0..=100.0).contains(&value) {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("bias {value} for token {id} is outside [-100, 100]"),
                ));
            }
            if let Some(other) = keys.insert(id, key) {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("keys {other:?} and {key:?} both name token {id}; give each token once"),
                ));
            }
            Ok((id, value as f32))
        })
        .collect::<Result<Vec<_>, _>>()?;
    bias.sort_unstable_by_key(|&(id, _)| id);
    Ok(bias)
}

/// An optional float in `[lo, hi]` (`(lo, hi]` when `!lo_inclusive`), both as given and as
/// the `f32` the engine gets: narrowing can turn an accepted value into 0, which the worker
/// reads as "unset" (`top_p` 1e-46 would sample everything), or into infinity.
fn float_in(param: &str, value: Option<f64>, lo: f64, hi: f64, lo_inclusive: bool) -> Result<Option<f32>, ApiError> {
    let Some(v) = value else { return Ok(None) };
    let in_range = |x: f64| (if lo_inclusive { x >= lo } else { x > lo }) && x <= hi;
    let narrow = v as f32;
    let open = if lo_inclusive { "[" } else { "(" };
    let range = if hi == f64::MAX { format!("{open}{lo}, inf)") } else { format!("{open}{lo}, {hi}]") };
    if !in_range(v) {
        return Err(ApiError::invalid(param, format!("{param} must be in {range}, got {v}")));
    }
    if !in_range(f64::from(narrow)) {
        return Err(ApiError::invalid(
            param,
            format!("{param} must be in {range} as a 32-bit float; {v} becomes {narrow}"),
        ));
    }
    Ok(Some(narrow))
}

/// An optional integer in `[lo, hi]`.
fn int_in(param: &str, value: Option<i64>, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
    match value {
        Some(v) if !(lo..=hi).contains(&v) => {
            Err(ApiError::invalid(param, format!("{param} must be between {lo} and {hi}, got {v}")))
        }
        other => Ok(other),
    }
}
