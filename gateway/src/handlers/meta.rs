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
