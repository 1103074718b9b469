//! Structured outputs: reads a request's `response_format` (OpenAI: `text`, `json_object`,
//! `json_schema` with `name`, `schema`, `strict`) or vLLM's `structured_outputs`
//! (`json`, `regex`, `grammar`, `choice`) into the engine's [`Constraint`], and
//! compile-checks it with tessera-constrain before the request is admitted: a grammar
//! that is malformed or does not compile within [`CHECK_BUDGET`] is a 400, never a stuck
//! worker. The workers enforce it token by token (constrained decoding).
//!
//! The grammar compiler needs the model's vocabulary as byte strings; [`GrammarCache`]
//! builds it from the codec on the first constrained request and keeps it.
//!
//! `strict` is accepted either way: the schema is always enforced as given (llguidance's
//! JSON Schema subset; unsupported keywords are a 400).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use tessera_constrain::{Compiler, Limits, Vocabulary};

use crate::app::AppState;
use crate::body::parse_json;
use crate::codec::Codec;
use crate::engine::Constraint;
use crate::error::ApiError;

/// How long the admission check may take (the issue's "a 400 within a second", with the
/// HTTP round trip around it).
pub const CHECK_BUDGET: Duration = Duration::from_millis(800);

/// Longest constraint text (schema, grammar or pattern) a request may carry. Each new
/// sequence's step message carries its constraint to the worker; the coordinator admits
/// new sequences into a step only while they fit half the 64 MiB gRPC message limit
/// (`SchedulerConfig::max_step_new_bytes`), so this bounds what one request can take of a
/// step. Real schemas are kilobytes (OpenAI's own limits are ~15,000 characters of
/// property names and enum values).
pub const MAX_CONSTRAINT_BYTES: usize = 1 << 20;

const PARAM: &str = "response_format";

/// The structured-output fields of a chat or completions body (other fields ignored).
#[derive(Debug, Default, Deserialize)]
struct Fields {
    response_format: Option<Value>,
    structured_outputs: Option<Value>,
}

/// The grammar compiler of the served model, built on first use (tens to hundreds of
/// milliseconds: it reads every token's bytes).
#[derive(Default)]
pub struct GrammarCache {
    compiler: OnceLock<Result<Compiler, String>>,
}

impl GrammarCache {
    /// The compiler for `codec`'s vocabulary (`eos_ids`: what a finished grammar allows).
    pub fn compiler(&self, codec: &dyn Codec, eos_ids: &[u32]) -> Result<Compiler, ApiError> {
        self.compiler
            .get_or_init(|| {
                let vocab = Vocabulary::from_pieces(codec.vocab_size() as usize, eos_ids, |id| {
                    let piece = codec.token_bytes(id).unwrap_or_default();
                    // A control token renders as nothing when special tokens are skipped.
                    let special = !piece.is_empty() && codec.decode(&[id], true).map(|t| t.is_empty()).unwrap_or(true);
                    (piece, special)
                })
                .map_err(|e| e.to_string())?;
                Compiler::new(vocab, Limits::default()).map_err(|e| e.to_string())
            })
            .clone()
            .map_err(|e| ApiError::Internal(format!("structured outputs: {e}")))
    }
}

impl std::fmt::Debug for GrammarCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCache").field("built", &self.compiler.get().is_some()).finish()
    }
}

/// The constraint a request asks for (`None`: free text), compile-checked.
pub async fn from_body(state: &AppState, body: &[u8]) -> Result<Option<Constraint>, ApiError> {
    let fields: Fields = parse_json(body)?;
    let Some(c) = parse(&fields)? else { return Ok(None) };
    check(state, &c).await?;
    Ok(Some(c))
}

/// Compiles `c` for the served model on a blocking thread, within [`CHECK_BUDGET`], after
/// checking its size against [`MAX_CONSTRAINT_BYTES`].
pub async fn check(state: &AppState, c: &Constraint) -> Result<(), ApiError> {
    let len = match c {
        Constraint::JsonSchema(t) | Constraint::Lark(t) | Constraint::Regex(t) => t.len(),
        Constraint::JsonObject => 0,
    };
    if len > MAX_CONSTRAINT_BYTES {
        return Err(ApiError::invalid(
            PARAM,
            format!("the {} is {len} bytes; at most {MAX_CONSTRAINT_BYTES} are accepted", c.kind()),
        ));
    }
    let state = state.clone();
    let job = c.clone();
    let r = tokio::task::spawn_blocking(move || {
        let compiler = state.grammars().compiler(state.codec(), state.eos_token_ids())?;
        compiler.check(&job, CHECK_BUDGET).map_err(|e| ApiError::invalid(PARAM, e.to_string()))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("structured outputs check: {e}")))?;
    r
}

fn parse(f: &Fields) -> Result<Option<Constraint>, ApiError> {
    let a = f.response_format.as_ref().filter(|v| !v.is_null()).map(response_format).transpose()?.flatten();
    let b = f.structured_outputs.as_ref().filter(|v| !v.is_null()).map(structured_outputs).transpose()?.flatten();
    match (a, b) {
        (Some(_), Some(_)) => {
            Err(ApiError::invalid(PARAM, "give either response_format or structured_outputs, not both"))
        }
        (a, b) => Ok(a.or(b)),
    }
}

/// OpenAI's `response_format`.
fn response_format(v: &Value) -> Result<Option<Constraint>, ApiError> {
    let bad = |m: &str| ApiError::invalid(PARAM, m.to_string());
    let o = v.as_object().ok_or_else(|| bad("response_format must be an object"))?;
    match o.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => {
            let js = o
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| bad("response_format.json_schema must be an object with `name` and `schema`"))?;
            match js.get("name") {
                Some(Value::String(n))
                    if !n.is_empty()
                        && n.len() <= 64
                        && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') => {}
                _ => {
                    return Err(bad(
                        "response_format.json_schema.name must be 1 to 64 letters, digits, underscores or dashes",
                    ))
                }
            }
            if !matches!(js.get("strict"), None | Some(Value::Null) | Some(Value::Bool(_))) {
                return Err(bad("response_format.json_schema.strict must be a boolean"));
            }
            match js.get("schema") {
                // No schema: any JSON value.
                None | Some(Value::Null) => Ok(Some(Constraint::JsonSchema("{}".into()))),
                Some(s @ Value::Object(_)) => Ok(Some(Constraint::JsonSchema(s.to_string()))),
                Some(_) => Err(bad("response_format.json_schema.schema must be a JSON Schema object")),
            }
        }
        Some(other) => {
            Err(bad(&format!("response_format.type {other:?} is not supported (use text, json_object or json_schema)")))
        }
        None => Err(bad("response_format.type is required")),
    }
}

/// vLLM's `structured_outputs`: exactly one of `json` (a schema, or its text), `regex`,
/// `grammar` (Lark) or `choice` (a list of strings: the output is one of them).
fn structured_outputs(v: &Value) -> Result<Option<Constraint>, ApiError> {
    const P: &str = "structured_outputs";
    let bad = |m: &str| ApiError::invalid(P, m.to_string());
    let o = v.as_object().ok_or_else(|| bad("structured_outputs must be an object"))?;
    let given: Vec<(&str, &Value)> = ["json", "regex", "grammar", "choice", "json_object"]
        .iter()
        .filter_map(|&k| o.get(k).filter(|v| !v.is_null()).map(|v| (k, v)))
        .collect();
    let [(key, value)] = given.as_slice() else {
        return if given.is_empty() {
            Ok(None)
        } else {
            Err(bad("structured_outputs takes one of json, regex, grammar, choice, json_object"))
        };
    };
    let text = |v: &Value| {
        v.as_str().map(str::to_owned).ok_or_else(|| bad(&format!("structured_outputs.{key} must be a string")))
    };
    Ok(Some(match *key {
        "json" => match value {
            Value::String(s) => Constraint::JsonSchema(s.clone()),
            Value::Object(_) => Constraint::JsonSchema(value.to_string()),
            _ => return Err(bad("structured_outputs.json must be a JSON Schema (object or string)")),
        },
        "json_object" => match value {
            Value::Bool(true) => Constraint::JsonObject,
            Value::Bool(false) => return Ok(None),
            _ => return Err(bad("structured_outputs.json_object must be a boolean")),
        },
        "regex" => Constraint::Regex(text(value)?),
        "grammar" => Constraint::Lark(text(value)?),
        _ => {
            let choices = value
                .as_array()
                .filter(|a| !a.is_empty())
                .and_then(|a| a.iter().map(|c| c.as_str()).collect::<Option<Vec<_>>>())
                .ok_or_else(|| bad("structured_outputs.choice must be a non-empty list of strings"))?;
            let alternatives: Vec<String> = choices.iter().map(|c| regex_syntax::escape(c)).collect();
            Constraint::Regex(alternatives.join("|"))
        }
    }))
}

// The cache is shared by request tasks through `AppState`.
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<Arc<GrammarCache>>();
};

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_rf(v: Value) -> Result<Option<Constraint>, ApiError> {
        parse(&Fields { response_format: Some(v), structured_outputs: None })
    }

    #[test]
    fn response_formats() {
        assert_eq!(parse_rf(serde_json::json!({"type": "text"})).unwrap(), None);
        assert_eq!(parse_rf(serde_json::json!({"type": "json_object"})).unwrap(), Some(Constraint::JsonObject));
        let schema = serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let got = parse_rf(
            serde_json::json!({"type": "json_schema", "json_schema": {"name": "x_1", "schema": schema.clone(), "strict": true}}),
        );
        match got.unwrap() {
            Some(Constraint::JsonSchema(s)) => assert_eq!(serde_json::from_str::<Value>(&s).unwrap(), schema),
            other => panic!("{other:?}"),
        }
        for bad in [
            serde_json::json!("json"),
            serde_json::json!({"type": "yaml"}),
            serde_json::json!({}),
            serde_json::json!({"type": "json_schema"}),
            serde_json::json!({"type": "json_schema", "json_schema": {"schema": {}}}),
            serde_json::json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
            serde_json::json!({"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}),
            serde_json::json!({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}),
        ] {
            let e = parse_rf(bad.clone()).expect_err(&bad.to_string());
            assert_eq!(e.param().as_deref(), Some("response_format"), "{bad}");
            assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn vllm_structured_outputs() {
        let so = |v: Value| parse(&Fields { response_format: None, structured_outputs: Some(v) });
        assert_eq!(so(serde_json::json!({"regex": "[0-9]+"})).unwrap(), Some(Constraint::Regex("[0-9]+".into())));
        assert_eq!(so(serde_json::json!({"choice": ["a.b", "c"]})).unwrap(), Some(Constraint::Regex(r"a\.b|c".into())));
        assert_eq!(
            so(serde_json::json!({"grammar": "start: \"x\""})).unwrap(),
            Some(Constraint::Lark("start: \"x\"".into()))
        );
        assert!(so(serde_json::json!({"regex": "a", "grammar": "b"})).is_err());
        assert!(so(serde_json::json!({"choice": []})).is_err());
        let both = Fields {
            response_format: Some(serde_json::json!({"type": "json_object"})),
            structured_outputs: Some(serde_json::json!({"regex": "a"})),
        };
        assert!(parse(&both).is_err());
    }
}
