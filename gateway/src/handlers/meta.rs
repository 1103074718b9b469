//! `GET /v1/models`, `GET /health` (the process is alive) and `GET /ready` (the engine can take
//! requests: 200, else 503 so load balancers route around this gateway).

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};

use crate::app::AppState;
use crate::error::ApiError;
use crate::openai::extra::{ModelCard, ModelList};

pub async fn models(State(state): State<AppState>) -> Json<ModelList> {
    let card = ModelCard {
        id: state.model_name().to_owned(),
        object: "model",
        created: state.created(),
        owned_by: "tessera",
        max_model_len: state.config().max_model_len,
    };
    Json(ModelList { object: "list", data: vec![card] })
}

pub async fn health() -> StatusCode {
    StatusCode::OK
}

pub async fn ready(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    if state.engine().ready() {
        Ok(Json(json!({ "status": "ready" })))
    } else {
        Err(ApiError::Unavailable { retry_after_s: 1 })
    }
}

/// `GET /metrics` in Prometheus text format (names after vLLM's, under the `tessera:`
/// prefix): the engine's load (summed over its replicas; absent while the engine reports
/// nothing), then the gateway's own request counts and latencies (`metrics.rs`).
pub async fn metrics(State(state): State<AppState>) -> ([(axum::http::header::HeaderName, &'static str); 1], String) {
    let mut out = String::new();
    if let Some(s) = state.engine().stats() {
        let usage = if s.kv_blocks_total > 0 { s.kv_blocks_used as f64 / s.kv_blocks_total as f64 } else { 0.0 };
        for (name, help, value) in [
            ("tessera:num_requests_running", "Sequences in the running set.", s.running as f64),
            ("tessera:num_requests_waiting", "Sequences waiting for admission.", s.waiting as f64),
            ("tessera:kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).", usage),
            ("tessera:kv_cache_blocks_used", "KV blocks in use.", s.kv_blocks_used as f64),
            ("tessera:kv_cache_blocks_total", "KV blocks in all replicas.", s.kv_blocks_total as f64),
        ] {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}\n"));
        }
    }
    out.push_str(&state.metrics().render());
    ([(axum::http::header::CONTENT_TYPE, tessera_telemetry::admin::METRICS_CONTENT_TYPE)], out)
}
