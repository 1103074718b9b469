//! Anthropic's `POST /v1/messages` and `POST /v1/messages/count_tokens`, and the API-key check
//! for them (`x-api-key` or `Authorization: Bearer`) with errors in Anthropic's shape. The
//! request is rendered through the chat template and generated exactly as chat is
//! (`generate::start`); `anthropic/` holds the translation and the event stream, `tools/`
//! the conversation with its tool blocks and, when tools are active, the response.

use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use tessera_telemetry::trace::FutureExt;

use crate::anthropic::convert::{self, stop_reason};
use crate::anthropic::errors::AnthropicError;
use crate::anthropic::stream::sse_response;
use crate::anthropic::types::{
    ContentBlock, CountTokensRequest, CountTokensResponse, MessageResponse, MessageUsage, MessagesRequest,
};
use crate::app::AppState;
use crate::auth::check_api_key;
use crate::body::{parse_json, RawBody};
use crate::error::ApiError;
use crate::generate::{self, PromptPlan};
use crate::ids::new_id;
use crate::request_trace::{Operation, RequestTrace};
use crate::tools;
use crate::validate;

/// The auth middleware of the Anthropic routes.
pub async fn require_api_key(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Result<Response, AnthropicError> {
    check_api_key(&state, req.headers())?;
    Ok(next.run(req).await)
}

pub async fn messages(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<RawBody, ApiError>,
) -> Result<Response, AnthropicError> {
    let trace = RequestTrace::start(Operation::Messages, state.model_name(), &headers);
    let result = messages_traced(state, &headers, body, &trace).with_context(trace.context()).await;
    if let Err(e) = &result {
        trace.failed(e.status().as_u16(), e.error_type(), e.to_string());
    }
    result
}

async fn messages_traced(
    state: AppState,
    headers: &HeaderMap,
    body: Result<RawBody, ApiError>,
    trace: &RequestTrace,
) -> Result<Response, AnthropicError> {
    let validate = trace.phase("validate");
    convert::check_version(headers)?;
    let RawBody(body) = body?;
    let req: MessagesRequest = parse_json(&body)?;
    let mut params = convert::params(&state, &req)?;
    // Text, tool_use and tool_result blocks, tools and tool_choice (tools/anthropic.rs).
    let prepared = tools::anthropic::prepare(&state, &body)?;
    tools::grammar::apply(&state, &prepared.tools, prepared.syntax, &mut params.spec).await?;
    trace.request(&params);
    drop(validate);

    let tokenize = trace.phase("tokenize");
    let ids = prompt_ids(&state, &prepared.prompt)?;
    let max_tokens = validate::resolve_max_tokens(&state, ids.len(), params.max_tokens, "messages")?;
    let input_tokens = ids.len() as u32;
    let prompts = [PromptPlan { ids, max_tokens }];
    drop(tokenize);

    let id = new_id("msg").replacen('-', "_", 1);
    let model = state.model_name().to_owned();
    let choices =
        generate::start(&state, &id, &prompts, &params).with_context(trace.begin_stream(&id, &prompts)).await?;
    let mut choices = trace.observe(choices);
    let usage = MessageUsage { input_tokens, output_tokens: 0 };
    if prepared.tools.active() {
        let choice = choices.pop().ok_or_else(|| ApiError::Internal("no choice stream".to_owned()))?;
        let choice = tools::anthropic::parse_choice(choice, &prepared);
        let start = MessageResponse::new(id, model, Vec::new(), usage);
        if params.stream {
            return Ok(tools::anthropic::sse(start, choice, state.config().keep_alive));
        }
        return tools::anthropic::respond(start, choice).await;
    }
    if params.stream {
        let choice = choices.pop().ok_or_else(|| ApiError::Internal("no choice stream".to_owned()))?;
        let start = MessageResponse::new(id, model, Vec::new(), usage);
        return Ok(sse_response(start, choice, state.config().keep_alive));
    }
    let result =
        generate::collect(choices).await?.pop().ok_or_else(|| ApiError::Internal("no choice result".to_owned()))?;
    let usage = MessageUsage { input_tokens, output_tokens: result.completion_tokens };
    let mut message = MessageResponse::new(id, model, vec![ContentBlock::text(result.text)], usage);
    message.stop_reason = Some(stop_reason(result.finish, result.stop_sequence.as_deref()));
    message.stop_sequence = result.stop_sequence;
    Ok(Json(message).into_response())
}

pub async fn count_tokens(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<RawBody, ApiError>,
) -> Result<Json<CountTokensResponse>, AnthropicError> {
    convert::check_version(&headers)?;
    let RawBody(body) = body?;
    let req: CountTokensRequest = parse_json(&body)?;
    state.check_model(req.model.as_deref())?;
    let _ = &req.messages;
    let prepared = tools::anthropic::prepare(&state, &body)?;
    let ids = prompt_ids(&state, &prepared.prompt)?;
    Ok(Json(CountTokensResponse { input_tokens: ids.len() as u32 }))
}

/// The ids of the rendered prompt, encoded exactly as chat encodes them.
fn prompt_ids(state: &AppState, prompt: &str) -> Result<Vec<u32>, AnthropicError> {
    Ok(state.codec().encode_prompt(prompt, true).map_err(|e| ApiError::from_codec(e, "messages"))?)
}
