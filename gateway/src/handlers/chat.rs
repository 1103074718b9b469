//! `POST /v1/chat/completions`: validate, render the chat template, tokenize, generate, and
//! answer with one `chat.completion` or a stream of `chat.completion.chunk`s (a role delta per
//! choice, content deltas, a finish chunk per choice, the usage chunk when asked, `[DONE]`).

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use tessera_telemetry::trace::FutureExt;

use crate::app::AppState;
use crate::body::{parse_json, RawBody};
use crate::choice::{ApiFinish, TokenLogprob};
use crate::error::ApiError;
use crate::generate::{self, PromptPlan, UsageTally};
use crate::ids::{new_id, unix_now};
use crate::logprobs;
use crate::openai::chat::{
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChunkChoice, Delta,
};
use crate::openai::common::{SamplingFields, Usage};
use crate::request_trace::{Operation, RequestTrace};
use crate::sse::{sse_response, ChunkRenderer};
use crate::tools::openai::PromptEnd;
use crate::validate;

pub async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Response, ApiError> {
    let trace = RequestTrace::start(Operation::Chat, state.model_name(), &headers);
    let result = chat(state, body, &trace).with_context(trace.context()).await;
    trace.handler_result(&result);
    result
}

/// Where the rendered prompt ends: `add_generation_prompt` (default true) and vLLM's
/// `continue_final_message` (which defaults the former to false; both true is refused).
fn prompt_end(req: &ChatCompletionRequest) -> Result<PromptEnd, ApiError> {
    match (req.continue_final_message.unwrap_or(false), req.add_generation_prompt) {
        (true, Some(true)) => Err(ApiError::invalid(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true",
        )),
        (true, _) => Ok(PromptEnd::ContinueFinal),
        (false, Some(false)) => Ok(PromptEnd::Closed),
        (false, _) => Ok(PromptEnd::GenerationPrompt),
    }
}

async fn chat(state: AppState, body: axum::body::Bytes, trace: &RequestTrace) -> Result<Response, ApiError> {
    let validate = trace.phase("validate");
    let fields: SamplingFields = parse_json(&body)?;
    let req: ChatCompletionRequest = parse_json(&body)?;
    let max_tokens = match req.max_completion_tokens {
        Some(m) => ("max_completion_tokens", Some(m)),
        None => ("max_tokens", fields.max_tokens),
    };
    let top_logprobs = validate::chat_logprobs(req.logprobs, req.top_logprobs)?;
    let mut params = validate::common(&state, &fields, max_tokens, top_logprobs)?;
    params.spec.constraint = crate::structured::from_body(&state, &body).await?;
    validate::chat_messages(&req.messages)?;
    // Tool calling (tools/openai.rs): tools, tool_choice and tool turns validated, the prompt
    // rendered with them, and a forced call's grammar set.
    let tools = crate::tools::openai::prepare(&state, &body, prompt_end(&req)?)?;
    crate::tools::grammar::apply(&state, &tools.tools, tools.syntax, &mut params.spec).await?;
    trace.request(&params);
    drop(validate);

    let tokenize = trace.phase("tokenize");
    let codec = state.codec();
    let ids = codec.encode_prompt(&tools.prompt, true).map_err(|e| ApiError::from_codec(e, "messages"))?;
    let max_tokens = validate::resolve_max_tokens(&state, ids.len(), params.max_tokens, "messages")?;
    validate::check_min_tokens(&params.spec, max_tokens)?;
    let prompts = [PromptPlan { ids, max_tokens }];
    drop(tokenize);

    let id = new_id("chatcmpl");
    let created = unix_now();
    let choices =
        generate::start(&state, &id, &prompts, &params).with_context(trace.begin_stream(&id, &prompts)).await?;
    let choices = trace.observe(choices);
    let mut tally = UsageTally::new(&prompts, params.n);
    if tools.tools.active() {
        let reply = crate::tools::openai::Reply {
            state: state.clone(),
            id,
            created,
            n: params.n,
            with_logprobs: top_logprobs.is_some(),
            include_usage: params.include_usage,
        };
        let choices = crate::tools::openai::parse_choices(choices, &tools);
        if params.stream {
            return Ok(crate::tools::openai::sse(reply, choices, tally, state.config().keep_alive));
        }
        return crate::tools::openai::respond(reply, choices, tally).await;
    }
    if params.stream {
        let renderer = ChatChunks {
            state: state.clone(),
            id,
            created,
            n: params.n,
            with_logprobs: top_logprobs.is_some(),
            include_usage: params.include_usage,
        };
        return Ok(sse_response(choices, renderer, tally, params.include_usage, state.config().keep_alive));
    }

    let results = generate::collect(choices).await?;
    let choices = results
        .into_iter()
        .map(|r| {
            tally.record(r.index, r.completion_tokens, r.cached_tokens);
            ChatChoice {
                index: r.index,
                message: AssistantMessage { role: "assistant", content: r.text },
                logprobs: top_logprobs.map(|_| logprobs::chat(codec, &r.logprobs)),
                finish_reason: r.finish.unwrap_or(ApiFinish::Stop).as_str(),
            }
        })
        .collect();
    let response = ChatCompletion {
        id,
        object: "chat.completion",
        created,
        model: state.model_name().to_owned(),
        choices,
        usage: tally.usage(),
    };
    Ok(Json(response).into_response())
}

struct ChatChunks {
    state: AppState,
    id: String,
    created: u64,
    n: u32,
    with_logprobs: bool,
    include_usage: bool,
}

impl ChatChunks {
    fn chunk(&self, choices: Vec<ChunkChoice>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.state.model_name().to_owned(),
            choices,
            usage: self.include_usage.then_some(None),
        }
    }
}

impl ChunkRenderer for ChatChunks {
    type Chunk = ChatCompletionChunk;

    fn opening(&mut self) -> Vec<ChatCompletionChunk> {
        (0..self.n)
            .map(|index| {
                let delta = Delta { role: Some("assistant"), content: Some(String::new()) };
                self.chunk(vec![ChunkChoice { index, delta, logprobs: None, finish_reason: None }])
            })
            .collect()
    }

    fn delta(&mut self, index: u32, text: String, entries: Vec<TokenLogprob>) -> ChatCompletionChunk {
        let logprobs = self.with_logprobs.then(|| logprobs::chat(self.state.codec(), &entries));
        let delta = Delta { role: None, content: Some(text) };
        self.chunk(vec![ChunkChoice { index, delta, logprobs, finish_reason: None }])
    }

    fn finish(&mut self, index: u32, reason: ApiFinish) -> ChatCompletionChunk {
        let choice =
            ChunkChoice { index, delta: Delta::default(), logprobs: None, finish_reason: Some(reason.as_str()) };
        self.chunk(vec![choice])
    }

    fn usage(&mut self, usage: Usage) -> ChatCompletionChunk {
        let mut chunk = self.chunk(Vec::new());
        chunk.usage = Some(Some(usage));
        chunk
    }
}
