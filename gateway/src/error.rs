//! `ApiError`: every failure the HTTP API reports, mapped once to a status code and OpenAI's
//! error body `{"error": {"message", "type", "param", "code"}}`. 5xx messages are generic
//! (the detail goes to the log); `error_type()` doubles as a metric label.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::choice::ChoiceError;
use crate::codec::CodecError;
use crate::engine::EngineError;

const INTERNAL_MESSAGE: &str = "The server had an error while processing your request.";

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// 400: malformed JSON, a value out of range, a prompt too long. `param` names the field.
    #[error("{message}")]
    InvalidRequest { message: String, param: Option<String>, code: Option<&'static str> },
    /// 401: no `Authorization: Bearer` key, or one that is not configured.
    #[error("{0}")]
    Unauthorized(&'static str),
    /// 404: `model` names a model this gateway does not serve.
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// 404: no such route.
    #[error("Invalid URL ({method} {path})")]
    RouteNotFound { method: String, path: String },
    /// 405: the route exists, the method does not.
    #[error("Method not allowed")]
    MethodNotAllowed,
    /// 413: the body is over the configured limit.
    #[error("The request body is larger than the limit of {limit} bytes.")]
    PayloadTooLarge { limit: usize },
    /// 429 with `Retry-After`.
    #[error("The server is overloaded; retry in {retry_after_s} s.")]
    Overloaded { retry_after_s: u32 },
    /// 503 with `Retry-After`.
    #[error("The service is unavailable; retry in {retry_after_s} s.")]
    Unavailable { retry_after_s: u32 },
    /// 500; the string is for the log only.
    #[error("internal error: {0}")]
    Internal(String),
}

/// The wire form of an error, also sent as an SSE event when a stream fails midway.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub error_type: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 naming the offending field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest { message: message.into(), param: Some(param.into()), code: None }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::ModelNotFound(_) | ApiError::RouteNotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `type`; also the metric label.
    pub fn error_type(&self) -> &'static str {
        match self {
            ApiError::Overloaded { .. } => "rate_limit_error",
            ApiError::Unavailable { .. } | ApiError::Internal(_) => "server_error",
            _ => "invalid_request_error",
        }
    }

    pub fn param(&self) -> Option<String> {
        match self {
            ApiError::InvalidRequest { param, .. } => param.clone(),
            ApiError::ModelNotFound(_) => Some("model".to_owned()),
            _ => None,
        }
    }

    pub fn code(&self) -> Option<&'static str> {
        match self {
            ApiError::InvalidRequest { code, .. } => *code,
            ApiError::Unauthorized(_) => Some("invalid_api_key"),
            ApiError::ModelNotFound(_) => Some("model_not_found"),
            ApiError::RouteNotFound { .. } => Some("unknown_url"),
            ApiError::PayloadTooLarge { .. } => Some("request_too_large"),
            ApiError::Overloaded { .. } => Some("overloaded"),
            ApiError::Unavailable { .. } => Some("service_unavailable"),
            ApiError::MethodNotAllowed | ApiError::Internal(_) => None,
        }
    }

    fn retry_after_s(&self) -> Option<u32> {
        match self {
            ApiError::Overloaded { retry_after_s } | ApiError::Unavailable { retry_after_s } => Some(*retry_after_s),
            _ => None,
        }
    }

    /// The body clients see; internal details never leave the process.
    pub fn body(&self) -> ErrorBody {
        let message = match self {
            ApiError::Internal(_) => INTERNAL_MESSAGE.to_owned(),
            other => other.to_string(),
        };
        ErrorBody {
            error: ErrorDetail { message, error_type: self.error_type(), param: self.param(), code: self.code() },
        }
    }

    /// Logs what the client will not see.
    pub fn log(&self) {
        if let ApiError::Internal(detail) = self {
            tracing::error!(error = %detail, "internal error");
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.log();
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        let headers = response.headers_mut();
        if let Some(secs) = self.retry_after_s() {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if matches!(self, ApiError::Unauthorized(_)) {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Overloaded { retry_after_s } => ApiError::Overloaded { retry_after_s },
            EngineError::Unavailable { retry_after_s } => ApiError::Unavailable { retry_after_s },
            EngineError::InvalidRequest(message) => ApiError::InvalidRequest { message, param: None, code: None },
            EngineError::Internal(detail) => ApiError::Internal(detail),
        }
    }
}

impl From<ChoiceError> for ApiError {
    fn from(e: ChoiceError) -> Self {
        match e {
            ChoiceError::Engine(e) => e.into(),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

impl ApiError {
    /// A codec failure on the client's input: template errors are the client's fault
    /// (`param` names where the text came from), the rest are ours.
    pub fn from_codec(e: CodecError, param: &str) -> Self {
        match e {
            CodecError::Template(_) => ApiError::invalid(param, e.to_string()),
            // Say which stage failed in the log; the client gets the generic 500.
            other => ApiError::Internal(other.to_string()),
        }
    }
}
