//! A static bound on the regular expressions of a constraint (regex constraints, and the
//! `pattern` / `patternProperties` of JSON schemas), checked before llguidance sees them.
//! llguidance compiles lazily, so a pattern like `(a{1000}){1000}` compiles in microseconds
//! and only explodes later, token by token, inside a worker; counting the size a pattern
//! has once its counted repetitions are unrolled catches that class at admission.

use regex_syntax::hir::{Hir, HirKind};
use serde_json::Value;

use crate::error::ConstrainError;

/// Largest unrolled size of one pattern (a 20k-character literal is far beyond any real
/// field format).
pub const MAX_UNROLLED: u64 = 20_000;

/// Size of `h` with every counted repetition unrolled (`x{n,m}` counts `m` copies, an
/// unbounded one `max(n, 1)`), saturating.
fn unrolled(h: &Hir) -> u64 {
    match h.kind() {
        HirKind::Empty | HirKind::Look(_) | HirKind::Class(_) => 1,
        HirKind::Literal(l) => l.0.len() as u64,
        HirKind::Repetition(r) => {
            let copies = u64::from(r.max.unwrap_or(r.min).max(1));
            copies.saturating_mul(unrolled(&r.sub))
        }
        HirKind::Capture(c) => unrolled(&c.sub),
        HirKind::Concat(v) | HirKind::Alternation(v) => v.iter().map(unrolled).fold(0, u64::saturating_add),
    }
}

/// Refuses a pattern whose unrolled size is over [`MAX_UNROLLED`]. A pattern that does not
/// parse here is left to llguidance (its dialect differs slightly), which reports it.
pub(crate) fn check_regex(kind: &'static str, rx: &str) -> Result<(), ConstrainError> {
    let Ok(h) = regex_syntax::ParserBuilder::new().nest_limit(64).build().parse(rx) else { return Ok(()) };
    let size = unrolled(&h);
    if size > MAX_UNROLLED {
        return Err(ConstrainError::Invalid {
            kind,
            message: format!(
                "pattern {:?} is too complex: {size} units once its repetitions are unrolled (limit {MAX_UNROLLED})",
                truncate(rx)
            ),
        });
    }
    Ok(())
}

/// [`check_regex`] on every `pattern` and `patternProperties` key of a JSON schema.
pub(crate) fn check_schema(kind: &'static str, v: &Value) -> Result<(), ConstrainError> {
    match v {
        Value::Object(m) => {
            for (k, child) in m {
                match (k.as_str(), child) {
                    ("pattern", Value::String(rx)) => check_regex(kind, rx)?,
                    ("patternProperties", Value::Object(props)) => {
                        for rx in props.keys() {
                            check_regex(kind, rx)?;
                        }
                    }
                    _ => {}
                }
                check_schema(kind, child)?;
            }
            Ok(())
        }
        Value::Array(items) => items.iter().try_for_each(|c| check_schema(kind, c)),
        _ => Ok(()),
    }
}

fn truncate(s: &str) -> String {
    if s.chars().count() <= 60 {
        s.to_owned()
    } else {
        format!("{}...", s.chars().take(60).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unrolled_sizes() {
        let size = |rx: &str| unrolled(&regex_syntax::parse(rx).unwrap());
        assert_eq!(size("abc"), 3);
        assert_eq!(size("[a-z]{5}"), 5);
        assert_eq!(size("(ab){3,7}"), 14);
        assert_eq!(size("(a{10}){20}"), 200);
        assert_eq!(size("x+y*"), 2);
        assert_eq!(size("a|bc"), 3);
        assert!(check_regex("regex", "(a{1000}){1000}").is_err());
        assert!(check_regex("regex", "^[0-9]{5}(-[0-9]{4})?$").is_ok());
        // Unparsable here: left to llguidance.
        assert!(check_regex("regex", "a(b").is_ok());
    }

    #[test]
    fn schemas_are_walked() {
        let ok =
            serde_json::json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]{3}$"}}});
        assert!(check_schema("JSON schema", &ok).is_ok());
        let deep = serde_json::json!({"items": [{"properties": {"b": {"pattern": "(x{500}){100}"}}}]});
        assert!(check_schema("JSON schema", &deep).is_err());
        let keys = serde_json::json!({"patternProperties": {"[a-z]{30000}": {}}});
        assert!(check_schema("JSON schema", &keys).is_err());
    }
}
