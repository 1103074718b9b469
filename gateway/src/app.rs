//! The router: `AppState` (config, engine, codec) and `app(state)`, which tests drive directly
//! with `tower::ServiceExt::oneshot`. Authentication covers every route except `/health` and
//! `/ready` (`/v1/messages*` answer its errors in Anthropic's shape); unknown routes and
//! methods get OpenAI-shaped 404/405 bodies.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request};
use axum::middleware;
use axum::routing::{get, post};
use axum::Router;
use tower_http::trace::TraceLayer;

use crate::auth::require_api_key;
use crate::codec::Codec;
use crate::config::{ConfigError, GatewayConfig};
use crate::drain::{self, Drain};
use crate::engine::Engine;
use crate::error::ApiError;
use crate::handlers;
use crate::ids::unix_now;
use crate::metrics::{self, GatewayMetrics};

/// Shared by every request; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Shared>,
}

struct Shared {
    config: GatewayConfig,
    engine: Arc<dyn Engine>,
    codec: Arc<dyn Codec>,
    model_name: String,
    /// Sorted, deduplicated.
    eos_token_ids: Vec<u32>,
    /// Start time, for `/v1/models`' `created`.
    created: u64,
    /// Request counts and latencies (`GET /metrics`).
    metrics: Arc<GatewayMetrics>,
    /// Graceful drain on SIGTERM (drain.rs).
    drain: Drain,
    /// The grammar compiler for structured outputs, built on first use (structured.rs).
    grammars: crate::structured::GrammarCache,
}

impl AppState {
    pub fn new(config: GatewayConfig, engine: Arc<dyn Engine>, codec: Arc<dyn Codec>) -> Result<Self, ConfigError> {
        config.validate()?;
        let model_name = config.served_model_name.clone().unwrap_or_else(|| codec.model_name().to_owned());
        let mut eos_token_ids = codec.eos_token_ids();
        eos_token_ids.sort_unstable();
        eos_token_ids.dedup();
        let metrics = Arc::new(GatewayMetrics::new());
        let drain = Drain::new();
        let grammars = crate::structured::GrammarCache::default();
        let shared =
            Shared { config, engine, codec, model_name, eos_token_ids, created: unix_now(), metrics, drain, grammars };
        Ok(AppState { inner: Arc::new(shared) })
    }

    pub fn config(&self) -> &GatewayConfig {
        &self.inner.config
    }

    pub fn engine(&self) -> &dyn Engine {
        &*self.inner.engine
    }

    pub fn codec(&self) -> &dyn Codec {
        &*self.inner.codec
    }

    /// The name clients must use in `model`.
    pub fn model_name(&self) -> &str {
        &self.inner.model_name
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.inner.eos_token_ids
    }

    /// The structured-outputs grammar compiler (structured.rs).
    pub fn grammars(&self) -> &crate::structured::GrammarCache {
        &self.inner.grammars
    }

    pub fn created(&self) -> u64 {
        self.inner.created
    }

    pub fn metrics(&self) -> &Arc<GatewayMetrics> {
        &self.inner.metrics
    }

    /// The drain state: started on SIGTERM (see `drain::on_signal`).
    pub fn drain(&self) -> &Drain {
        &self.inner.drain
    }

    /// 404 unless `model` is absent or names the served model.
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.model_name() => Err(ApiError::ModelNotFound(m.to_owned())),
            _ => Ok(()),
        }
    }
}

pub fn app(state: AppState) -> Router {
    // Generation requests are counted by outcome (metrics.rs), after authentication.
    let generation = Router::new()
        .route("/v1/chat/completions", post(handlers::chat::chat_completions))
        .route("/v1/completions", post(handlers::completions::completions))
        .route_layer(middleware::from_fn_with_state(state.clone(), metrics::track_requests));
    let protected = Router::new()
        .merge(generation)
        .route("/v1/models", get(handlers::meta::models))
        .route("/tokenize", post(handlers::tokenize::tokenize))
        .route("/detokenize", post(handlers::tokenize::detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_api_key));
    // Anthropic's Messages API: its own auth layer, so errors come in Anthropic's shape.
    let anthropic = Router::new()
        .route("/v1/messages", post(handlers::messages::messages))
        .route_layer(middleware::from_fn_with_state(state.clone(), metrics::track_requests))
        .route("/v1/messages/count_tokens", post(handlers::messages::count_tokens))
        .route_layer(middleware::from_fn_with_state(state.clone(), handlers::messages::require_api_key));
    let open = Router::new()
        .route("/health", get(handlers::meta::health))
        .route("/ready", get(handlers::meta::ready))
        .route("/metrics", get(handlers::meta::metrics));
    protected
        .merge(anthropic)
        .merge(open)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config().max_body_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), drain::track))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

async fn not_found(req: Request) -> ApiError {
    ApiError::RouteNotFound { method: req.method().to_string(), path: req.uri().path().to_owned() }
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}
