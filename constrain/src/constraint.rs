//! The grammars Tessera accepts (the worker's `Constraint` message, the gateway's
//! `response_format`), and their translation into llguidance's grammar description.

use llguidance::api::TopLevelGrammar;
use serde_json::Value;

use crate::complexity::{check_regex, check_schema};
use crate::error::ConstrainError;

/// A grammar the generated text must follow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Constraint {
    /// One JSON value valid against this JSON Schema (its JSON text).
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// A Lark grammar (llguidance's dialect).
    Lark(String),
    /// A regular expression the whole output matches.
    Regex(String),
}

impl Constraint {
    /// A short name for error messages ("JSON schema", "regex", ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonSchema(_) => "JSON schema",
            Constraint::JsonObject => "JSON object",
            Constraint::Lark(_) => "Lark grammar",
            Constraint::Regex(_) => "regex",
        }
    }

    /// llguidance's description of this grammar. JSON is generated compactly (no free
    /// whitespace between tokens) unless the schema says otherwise through llguidance's
    /// `x-guidance` options: a sampled model could otherwise spend its whole budget on
    /// whitespace and never close the value.
    pub(crate) fn to_grammar(&self) -> Result<TopLevelGrammar, ConstrainError> {
        let invalid = |message: String| ConstrainError::Invalid { kind: self.kind(), message };
        Ok(match self {
            Constraint::JsonSchema(text) => {
                let schema: Value = serde_json::from_str(text).map_err(|e| invalid(format!("not JSON: {e}")))?;
                match schema {
                    Value::Object(_) | Value::Bool(_) => {}
                    _ => return Err(invalid("a schema must be a JSON object or a boolean".into())),
                }
                check_schema(self.kind(), &schema)?;
                TopLevelGrammar::from_json_schema(compact(schema))
            }
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"}))),
            Constraint::Lark(text) => {
                if text.trim().is_empty() {
                    return Err(invalid("the grammar is empty".into()));
                }
                TopLevelGrammar::from_lark(text.clone())
            }
            Constraint::Regex(rx) => {
                // llguidance embeds the pattern in a Lark rule; check it parses as a regex
                // first so a bad one is reported as such.
                regex_syntax::Parser::new().parse(rx).map_err(|e| invalid(e.to_string()))?;
                check_regex(self.kind(), rx)?;
                TopLevelGrammar::from_regex(rx)
            }
        })
    }
}

/// `schema` with llguidance's compact-JSON option added when it sets none of its own.
fn compact(schema: Value) -> Value {
    match schema {
        Value::Object(mut m) if !m.contains_key("x-guidance") => {
            m.insert("x-guidance".into(), serde_json::json!({"whitespace_flexible": false}));
            Value::Object(m)
        }
        Value::Bool(true) => serde_json::json!({"x-guidance": {"whitespace_flexible": false}}),
        other => other,
    }
}
