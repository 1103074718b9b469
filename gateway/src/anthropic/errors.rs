//! Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`, over the
//! gateway's `ApiError`: the same failures, mapped to Anthropic's error types and statuses.
//! The engine being overloaded is `overloaded_error` with status 529, Anthropic's own code for
//! it (the official clients map 529 to `OverloadedError` and retry it); a gateway with no
//! serving replica (or draining) is 503 `api_error`; both keep `Retry-After`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::error::ApiError;

/// An `ApiError` answered in Anthropic's shape.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(transparent)]
pub struct AnthropicError(#[from] pub ApiError);

#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize)]
pub struct ErrorDetail {
    #[serde(rename = "type")]
    pub error_type: &'static str,
    pub message: String,
}

/// Anthropic's status for overloaded.
pub const OVERLOADED: u16 = 529;

impl AnthropicError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        AnthropicError(ApiError::invalid(param, message))
    }

    pub fn status(&self) -> StatusCode {
        match self.0 {
            ApiError::Overloaded { .. } => StatusCode::from_u16(OVERLOADED).unwrap_or(StatusCode::TOO_MANY_REQUESTS),
            ref other => other.status(),
        }
    }

    pub fn error_type(&self) -> &'static str {
        match self.0 {
            ApiError::InvalidRequest { .. } | ApiError::MethodNotAllowed => "invalid_request_error",
            ApiError::Unauthorized(_) => "authentication_error",
            ApiError::ModelNotFound(_) | ApiError::RouteNotFound { .. } => "not_found_error",
            ApiError::PayloadTooLarge { .. } => "request_too_large",
            ApiError::Overloaded { .. } => "overloaded_error",
            ApiError::Unavailable { .. } | ApiError::Internal(_) => "api_error",
        }
    }

    /// The body; the message is `ApiError`'s (generic for internal errors), with the field
    /// named when there is one.
    pub fn body(&self) -> ErrorBody {
        let base = self.0.body().error;
        let message = match base.param {
            Some(param) if !base.message.contains(&param) => format!("{param}: {}", base.message),
            _ => base.message,
        };
        ErrorBody { kind: "error", error: ErrorDetail { error_type: self.error_type(), message } }
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        self.0.log();
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        if let ApiError::Overloaded { retry_after_s } | ApiError::Unavailable { retry_after_s } = self.0 {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
        }
        response
    }
}
