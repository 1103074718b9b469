//! `POST /v1/completions`: the prompt is a string, a list of strings, a list of token ids, or
//! a list of such lists; each prompt gets `n` choices (choice `p * n + i`). Answers with one
//! `text_completion` or a stream of them.
//!
//! `echo` (OpenAI, vLLM): each choice's text starts with its prompt's, the string as given
//! or the ids decoded (special tokens kept, as `/detokenize` and vLLM do); a stream sends it
//! as each choice's first chunk, before any token.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;
use tessera_telemetry::trace::FutureExt;

use crate::app::AppState;
use crate::body::{parse_json, RawBody};
use crate::choice::{ApiFinish, TokenLogprob};
use crate::error::ApiError;
use crate::generate::{self, PromptPlan, UsageTally};
use crate::ids::{new_id, unix_now};
use crate::logprobs;
use crate::openai::common::{SamplingFields, Usage};
use crate::openai::completions::{Completion, CompletionChoice, CompletionRequest};
use crate::request_trace::{Operation, RequestTrace};
use crate::sse::{sse_response, ChunkRenderer};
use crate::validate;

pub async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Response, ApiError> {
    let trace = RequestTrace::start(Operation::TextCompletion, state.model_name(), &headers);
    let result = complete(state, body, &trace).with_context(trace.context()).await;
    trace.handler_result(&result);
    result
}

async fn complete(state: AppState, body: axum::body::Bytes, trace: &RequestTrace) -> Result<Response, ApiError> {
    let validate = trace.phase("validate");
    let fields: SamplingFields = parse_json(&body)?;
    let req: CompletionRequest = parse_json(&body)?;
    let top_logprobs = validate::completion_logprobs(req.logprobs)?;
    let mut params = validate::common(&state, &fields, ("max_tokens", fields.max_tokens), top_logprobs)?;
    params.spec.constraint = crate::structured::from_body(&state, &body).await?;
    unsupported(&req, params.n)?;
    trace.request(&params);
    drop(validate);

    let tokenize = trace.phase("tokenize");
    let prompts = prompt_ids(&state, req.prompt.as_ref())?;
    let echo = if req.echo == Some(true) { echo_texts(&state, &prompts)? } else { Vec::new() };
    let total = prompts.len() as u64 * u64::from(params.n);
    if total > u64::from(state.config().max_choices) {
        return Err(ApiError::invalid(
            "n",
            format!(
                "{} prompts x n = {total} sequences, more than the limit of {}",
                prompts.len(),
                state.config().max_choices
            ),
        ));
    }
    let prompts = prompts
        .into_iter()
        .map(|Prompt { ids, .. }| {
            let max_tokens = validate::resolve_max_tokens(&state, ids.len(), params.max_tokens, "prompt")?;
            validate::check_min_tokens(&params.spec, max_tokens)?;
            Ok(PromptPlan { ids, max_tokens })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    drop(tokenize);

    let id = new_id("cmpl");
    let created = unix_now();
    let choices =
        generate::start(&state, &id, &prompts, &params).with_context(trace.begin_stream(&id, &prompts)).await?;
    let choices = trace.observe(choices);
    let mut tally = UsageTally::new(&prompts, params.n);
    let mut renderer = CompletionChunks {
        state: state.clone(),
        id,
        created,
        with_logprobs: top_logprobs.is_some(),
        include_usage: params.include_usage,
        offsets: vec![0; choices.len()],
        echo,
        n: params.n,
    };
    if params.stream {
        return Ok(sse_response(choices, renderer, tally, params.include_usage, state.config().keep_alive));
    }

    let results = generate::collect(choices).await?;
    let choices = results
        .into_iter()
        .map(|r| {
            tally.record(r.index, r.completion_tokens, r.cached_tokens);
            let reason = r.finish.unwrap_or(ApiFinish::Stop);
            let text = match renderer.echo_of(r.index) {
                Some(prompt) => format!("{prompt}{}", r.text),
                None => r.text,
            };
            renderer.choice(r.index, text, &r.logprobs, Some(reason))
        })
        .collect();
    let mut response = renderer.response(choices);
    response.usage = Some(Some(tally.usage()));
    Ok(Json(response).into_response())
}

/// Parameters that would change the output and that this server does not implement are
/// refused rather than ignored.
fn unsupported(req: &CompletionRequest, n: u32) -> Result<(), ApiError> {
    // With logprobs, echo also returns the prompt tokens' logprobs (OpenAI, vLLM); the
    // engine computes logprobs of sampled tokens only, so that pair is refused.
    if req.echo == Some(true) && req.logprobs.is_some() {
        return Err(ApiError::invalid(
            "echo",
            "echo with logprobs is not supported (it needs the prompt's logprobs); ask for one or the other",
        ));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    match req.best_of {
        Some(b) if b != i64::from(n) => Err(ApiError::invalid("best_of", "best_of is not supported (it must equal n)")),
        _ => Ok(()),
    }
}

/// One prompt of the request: its ids, and its text when it was given as text.
struct Prompt {
    ids: Vec<u32>,
    text: Option<String>,
}

/// What `echo` puts before each prompt's choices: the prompt's text as given, or its ids decoded.
fn echo_texts(state: &AppState, prompts: &[Prompt]) -> Result<Vec<String>, ApiError> {
    prompts
        .iter()
        .map(|p| match &p.text {
            Some(text) => Ok(text.clone()),
            None => state.codec().decode(&p.ids, false).map_err(|e| ApiError::from_codec(e, "prompt")),
        })
        .collect()
}

/// The prompts: strings tokenized with BOS added (and kept as given, for `echo`), ids checked.
fn prompt_ids(state: &AppState, prompt: Option<&Value>) -> Result<Vec<Prompt>, ApiError> {
    let codec = state.codec();
    let vocab = codec.vocab_size();
    let encode = |s: &str| {
        let ids = codec.encode_prompt(s, true).map_err(|e| ApiError::from_codec(e, "prompt"))?;
        Ok(Prompt { ids, text: Some(s.to_owned()) })
    };
    let ids = |items: &[Value]| -> Result<Prompt, ApiError> {
        let ints: Vec<i64> = items
            .iter()
            .map(|v| v.as_i64().ok_or_else(|| ApiError::invalid("prompt", "a token-id prompt must hold only integers")))
            .collect::<Result<_, _>>()?;
        Ok(Prompt { ids: validate::token_ids("prompt", &ints, vocab)?, text: None })
    };
    let shape_error = || {
        ApiError::invalid(
            "prompt",
            "prompt must be a string, a list of strings, a list of token ids, or a list of lists of token ids",
        )
    };
    match prompt {
        None | Some(Value::Null) => Err(ApiError::invalid("prompt", "prompt is required")),
        Some(Value::String(s)) => Ok(vec![encode(s)?]),
        Some(Value::Array(items)) => match items.first() {
            None => Err(ApiError::invalid("prompt", "prompt must not be an empty list")),
            Some(Value::String(_)) => {
                items.iter().map(|v| v.as_str().ok_or_else(shape_error).and_then(encode)).collect()
            }
            Some(Value::Number(_)) => Ok(vec![ids(items)?]),
            Some(Value::Array(_)) => {
                items.iter().map(|v| v.as_array().ok_or_else(shape_error).and_then(|a| ids(a))).collect()
            }
            Some(_) => Err(shape_error()),
        },
        Some(_) => Err(shape_error()),
    }
}

struct CompletionChunks {
    state: AppState,
    id: String,
    created: u64,
    with_logprobs: bool,
    include_usage: bool,
    /// Characters of each choice's logprob tokens so far (`text_offset`).
    offsets: Vec<u32>,
    /// `echo`: each prompt's text, which its choices start with; empty without echo.
    echo: Vec<String>,
    /// Choices per prompt: choice `i` is prompt `i / n`'s.
    n: u32,
}

impl CompletionChunks {
    /// The echoed prompt text choice `index` starts with, under `echo`.
    fn echo_of(&self, index: u32) -> Option<&str> {
        self.echo.get((index / self.n.max(1)) as usize).map(String::as_str)
    }

    fn choice(
        &mut self,
        index: u32,
        text: String,
        entries: &[TokenLogprob],
        finish: Option<ApiFinish>,
    ) -> CompletionChoice {
        let logprobs = match (self.with_logprobs, self.offsets.get_mut(index as usize)) {
            (true, Some(offset)) => Some(logprobs::completion(self.state.codec(), entries, offset)),
            _ => None,
        };
        CompletionChoice { index, text, logprobs, finish_reason: finish.map(ApiFinish::as_str) }
    }

    fn response(&self, choices: Vec<CompletionChoice>) -> Completion {
        Completion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.state.model_name().to_owned(),
            choices,
            usage: None,
        }
    }

    fn chunk(&self, choices: Vec<CompletionChoice>) -> Completion {
        let mut chunk = self.response(choices);
        chunk.usage = self.include_usage.then_some(None);
        chunk
    }
}

impl ChunkRenderer for CompletionChunks {
    type Chunk = Completion;

    /// Under `echo`, each choice's prompt text, before any token.
    fn opening(&mut self) -> Vec<Completion> {
        let choices = self.echo.len() as u32 * self.n;
        (0..choices)
            .filter_map(|index| {
                let text = self.echo_of(index)?.to_owned();
                Some(self.chunk(vec![CompletionChoice { index, text, logprobs: None, finish_reason: None }]))
            })
            .collect()
    }

    fn delta(&mut self, index: u32, text: String, entries: Vec<TokenLogprob>) -> Completion {
        let choice = self.choice(index, text, &entries, None);
        self.chunk(vec![choice])
    }

    fn finish(&mut self, index: u32, reason: ApiFinish) -> Completion {
        let choice =
            CompletionChoice { index, text: String::new(), logprobs: None, finish_reason: Some(reason.as_str()) };
        self.chunk(vec![choice])
    }

    fn usage(&mut self, usage: Usage) -> Completion {
        let mut chunk = self.chunk(Vec::new());
        chunk.usage = Some(Some(usage));
        chunk
    }
}
