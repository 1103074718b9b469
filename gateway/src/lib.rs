//! Tessera's gateway: the OpenAI-compatible HTTP front end (axum), which also speaks
//! Anthropic's Messages API (`anthropic/`, `handlers/messages.rs`). It validates requests,
//! renders the chat template, tokenizes, sends token ids to an `Engine` (the coordinator's
//! gRPC client in production, `testing::FakeEngine` in tests), and streams the tokens back,
//! detokenized incrementally with stop strings matched here. Text never crosses the engine
//! boundary; errors map to HTTP once, in `error.rs`.
//!
//! Request path: `app.rs` (router, auth) -> `handlers/*` -> `validate.rs` -> `generate.rs`
//! (one engine sequence per choice) -> `choice.rs` (detokenize, `stop.rs`) -> JSON or `sse.rs`.

pub mod anthropic;
pub mod app;
pub mod auth;
pub mod body;
pub mod choice;
pub mod codec;
pub mod config;
pub mod drain;
pub mod engine;
pub mod error;
pub mod generate;
pub mod grpc_engine;
pub mod handlers;
pub mod ids;
pub mod leader;
pub mod logprobs;
pub mod metrics;
#[cfg(feature = "model")]
pub mod model_codec;
pub mod openai;
pub mod request_trace;
pub mod serve;
pub mod sse;
pub mod stop;
pub mod structured;
pub mod testing;
pub mod tools;
pub mod validate;

pub use app::{app, AppState};
pub use codec::{ChatMessage, Codec, CodecError, StreamDecoder};
pub use config::{ConfigError, GatewayConfig};
pub use engine::{
    Constraint, Engine, EngineError, EngineEvent, EventStream, FinishReason, GenerateRequest, SamplingSpec,
};
pub use error::ApiError;
#[cfg(feature = "model")]
pub use model_codec::ModelCodec;
pub use serve::{serve, serve_on, shutdown_signal, ServeError};
