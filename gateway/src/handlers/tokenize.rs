//! `POST /tokenize` and `POST /detokenize`, in vLLM's shapes: tokenize a prompt or a chat
//! (rendered with the template) into ids, and ids back into text.

use axum::extract::State;
use axum::Json;

use crate::app::AppState;
use crate::body::{parse_json, RawBody};
use crate::error::ApiError;
use crate::openai::extra::{DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse};
use crate::validate;

pub async fn tokenize(
    State(state): State<AppState>,
    RawBody(body): RawBody,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let req: TokenizeRequest = parse_json(&body)?;
    state.check_model(req.model.as_deref())?;
    let codec = state.codec();
    let tokens = match (&req.prompt, &req.messages) {
        (Some(prompt), None) => codec
            .encode_prompt(prompt, req.add_special_tokens.unwrap_or(true))
            .map_err(|e| ApiError::from_codec(e, "prompt"))?,
        (None, Some(messages)) => {
            let messages = validate::chat_messages(messages)?;
            let text = codec
                .render_chat(&messages, req.add_generation_prompt.unwrap_or(true))
                .map_err(|e| ApiError::from_codec(e, "messages"))?;
            codec
                .encode_prompt(&text, req.add_special_tokens.unwrap_or(true))
                .map_err(|e| ApiError::from_codec(e, "messages"))?
        }
        _ => return Err(ApiError::invalid("prompt", "give exactly one of prompt or messages")),
    };
    let token_strs = match req.return_token_strs {
        Some(true) => Some(
            tokens
                .iter()
                .map(|&id| {
                    let bytes = codec.token_bytes(id).map_err(|e| ApiError::Internal(e.to_string()))?;
                    Ok(String::from_utf8_lossy(&bytes).into_owned())
                })
                .collect::<Result<Vec<_>, ApiError>>()?,
        ),
        _ => None,
    };
    Ok(Json(TokenizeResponse { count: tokens.len(), max_model_len: state.config().max_model_len, tokens, token_strs }))
}

pub async fn detokenize(
    State(state): State<AppState>,
    RawBody(body): RawBody,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let req: DetokenizeRequest = parse_json(&body)?;
    state.check_model(req.model.as_deref())?;
    let codec = state.codec();
    let ids = validate::token_ids("tokens", &req.tokens, codec.vocab_size())?;
    let prompt = codec.decode(&ids, false).map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(Json(DetokenizeResponse { prompt }))
}
