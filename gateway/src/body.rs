//! Request bodies: the raw-bytes extractor that turns axum's limit rejection into our 413,
//! and JSON parsing whose errors name the field (`param`) that did not fit.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::app::AppState;
use crate::error::ApiError;

/// The whole body, within `GatewayConfig::max_body_bytes` (enforced by `DefaultBodyLimit`).
pub struct RawBody(pub Bytes);

impl FromRequest<AppState> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        match Bytes::from_request(req, state).await {
            Ok(bytes) => Ok(RawBody(bytes)),
            Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(ApiError::PayloadTooLarge { limit: state.config().max_body_bytes })
            }
            Err(rejection) => Err(ApiError::InvalidRequest {
                message: format!("Could not read the request body: {}", rejection.body_text()),
                param: None,
                code: None,
            }),
        }
    }
}

/// Parses a JSON body into `T`; unknown fields are ignored (serde's default).
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        invalid_json(param_of(&path, &inner), inner)
    })?;
    de.end().map_err(|e| invalid_json(None, e))?;
    Ok(value)
}

fn invalid_json(param: Option<String>, e: serde_json::Error) -> ApiError {
    ApiError::InvalidRequest { message: format!("Invalid JSON body: {e}"), param, code: None }
}

/// The field a data error is about: its path (`messages[0].content`), with the name of a
/// missing field appended (serde reports those at the parent's path). Syntax errors have no
/// field.
fn param_of(path: &str, e: &serde_json::Error) -> Option<String> {
    if !e.is_data() || path.contains('?') {
        return None;
    }
    let missing = e.to_string().strip_prefix("missing field `").and_then(|r| r.split('`').next()).map(str::to_owned);
    match (path, missing) {
        (".", missing) => missing,
        (path, Some(field)) => Some(format!("{path}.{field}")),
        (path, None) => Some(path.to_owned()),
    }
}
