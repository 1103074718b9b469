//! API-key authentication: `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`)
//! against the configured keys, compared
//! in constant time (`subtle`) so response timing does not reveal how much of a key matched.
//! Every configured key is compared, with no early exit. (Key lengths are not hidden.)

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::Response;
use subtle::{Choice, ConstantTimeEq};

use crate::app::AppState;
use crate::error::ApiError;

/// Anthropic's header for the key.
pub const X_API_KEY: &str = "x-api-key";

pub async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Result<Response, ApiError> {
    check_api_key(&state, req.headers())?;
    Ok(next.run(req).await)
}

/// Ok when no keys are configured, or when `Authorization: Bearer` or `x-api-key` carries a
/// configured key (the bearer credential is checked when both are sent).
pub fn check_api_key(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let keys = &state.config().api_keys;
    if keys.is_empty() {
        return Ok(());
    }
    let bearer = headers.get(AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer_token);
    let x_api_key = headers.get(X_API_KEY).and_then(|v| v.to_str().ok()).map(str::trim).filter(|k| !k.is_empty());
    match bearer.or(x_api_key) {
        None => Err(ApiError::Unauthorized(
            "Missing API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`.",
        )),
        Some(key) if key_matches(keys, key) => Ok(()),
        Some(_) => Err(ApiError::Unauthorized("Incorrect API key provided.")),
    }
}

/// The token of a `Bearer` credential (scheme case-insensitive, RFC 7235).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

fn key_matches(keys: &[String], given: &str) -> bool {
    keys.iter().fold(Choice::from(0), |found, key| found | key.as_bytes().ct_eq(given.as_bytes())).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer   abc "), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("abc"), None);
    }

    #[test]
    fn any_configured_key_matches() {
        let keys = vec!["k-one".to_owned(), "k-two".to_owned()];
        assert!(key_matches(&keys, "k-two"));
        assert!(key_matches(&keys, "k-one"));
        assert!(!key_matches(&keys, "k-on"));
        assert!(!key_matches(&keys, "k-three"));
        assert!(!key_matches(&keys, ""));
    }
}
