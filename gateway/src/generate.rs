//! Running the sequences of one request: plans them (prompts × n, seeds `seed + i`), admits
//! them with the engine, and turns each event channel into a stream of `ChoiceItem`s through
//! a `ChoiceAssembler`. Dropping a choice stream drops its receiver, which tells the engine to
//! abort that sequence (client gone, stop string matched, or a sibling failed).

use futures::stream::{self, Stream, StreamExt};

use crate::app::AppState;
use crate::choice::{ApiFinish, ChoiceAssembler, ChoiceError, Piece, TokenLogprob};
use crate::engine::{EventStream, GenerateRequest};
use crate::error::ApiError;
use crate::metrics::{ChoiceClock, RequestTracker};
use crate::openai::common::{PromptTokensDetails, Usage};
use crate::stop::StopMatcher;
use crate::validate::CommonParams;

/// One tokenized prompt and its resolved completion budget.
#[derive(Debug, Clone)]
pub struct PromptPlan {
    pub ids: Vec<u32>,
    pub max_tokens: u32,
}

/// What happened to one choice; `index` is the OpenAI choice index.
#[derive(Debug)]
pub struct ChoiceItem {
    pub index: u32,
    pub event: ChoiceEvent,
}

#[derive(Debug)]
pub enum ChoiceEvent {
    Delta {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// `stop_sequence`: the stop string that ended the choice, if one did.
    Finished {
        reason: ApiFinish,
        completion_tokens: u32,
        cached_tokens: Option<u32>,
        stop_sequence: Option<String>,
    },
    Failed(ChoiceError),
}

/// One engine request per choice: choice `p * n + i` is prompt `p`'s `i`-th sample, with seed
/// `seed + i` when a seed was given, so n > 1 gives different samples, reproducibly.
pub fn plan(response_id: &str, prompts: &[PromptPlan], params: &CommonParams) -> Vec<GenerateRequest> {
    let n = params.n;
    prompts
        .iter()
        .enumerate()
        .flat_map(|(p, prompt)| {
            (0..n).map(move |i| {
                let mut spec = params.spec.clone();
                spec.max_tokens = prompt.max_tokens;
                spec.seed = params.spec.seed.map(|s| s.wrapping_add(u64::from(i)));
                GenerateRequest {
                    request_id: format!("{response_id}-{}", p as u32 * n + i),
                    prompt_ids: prompt.ids.clone(),
                    params: spec,
                }
            })
        })
        .collect()
}

/// Admits every sequence, in order. If one is refused, the receivers already obtained are
/// dropped (aborting those sequences) and the refusal becomes the response.
pub async fn admit(state: &AppState, requests: Vec<GenerateRequest>) -> Result<Vec<EventStream>, ApiError> {
    let mut streams = Vec::with_capacity(requests.len());
    for req in requests {
        streams.push(state.engine().generate(req).await?);
    }
    Ok(streams)
}

/// The items of one choice, ending after its `Finished` or `Failed`; `clock` sees its events
/// (token timings, outcome) for the request's metrics.
pub fn choice_stream(
    index: u32,
    rx: EventStream,
    assembler: ChoiceAssembler,
    clock: ChoiceClock,
) -> impl Stream<Item = ChoiceItem> + Send {
    struct State {
        rx: Option<EventStream>,
        assembler: ChoiceAssembler,
        clock: ChoiceClock,
    }
    let state = State { rx: Some(rx), assembler, clock };
    stream::unfold(state, move |mut st| async move {
        let rx = st.rx.as_mut()?;
        let event = rx.recv().await;
        st.clock.on_event(&event);
        let items: Vec<ChoiceItem> = match st.assembler.on_event(event) {
            Ok(pieces) => {
                pieces.into_iter().map(|piece| ChoiceItem { index, event: to_event(piece, &st.assembler) }).collect()
            }
            Err(e) => vec![ChoiceItem { index, event: ChoiceEvent::Failed(e) }],
        };
        items.iter().for_each(|item| st.clock.on_item(item));
        if st.assembler.is_done() {
            // Release the sequence now rather than when the consumer drops this stream.
            st.rx = None;
        }
        Some((stream::iter(items), st))
    })
    .flatten()
}

fn to_event(piece: Piece, assembler: &ChoiceAssembler) -> ChoiceEvent {
    match piece {
        Piece::Delta { text, logprobs } => ChoiceEvent::Delta { text, logprobs },
        Piece::Finished { reason } => ChoiceEvent::Finished {
            reason,
            completion_tokens: assembler.completion_tokens(),
            cached_tokens: assembler.cached_tokens(),
            stop_sequence: assembler.stop_sequence().map(str::to_owned),
        },
    }
}

/// A finished choice, for non-streaming responses.
#[derive(Debug, Default)]
pub struct ChoiceResult {
    pub index: u32,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Option<ApiFinish>,
    pub completion_tokens: u32,
    pub cached_tokens: Option<u32>,
    /// The stop string that ended the choice, if one did.
    pub stop_sequence: Option<String>,
}

/// Runs all choices to the end. The first failure drops the others (aborting them).
pub async fn collect(streams: Vec<impl Stream<Item = ChoiceItem> + Send>) -> Result<Vec<ChoiceResult>, ApiError> {
    let runs = streams.into_iter().map(|s| async move {
        let mut s = std::pin::pin!(s);
        let mut result = ChoiceResult::default();
        while let Some(item) = s.next().await {
            result.index = item.index;
            match item.event {
                ChoiceEvent::Delta { text, logprobs } => {
                    result.text.push_str(&text);
                    result.logprobs.extend(logprobs);
                }
                ChoiceEvent::Finished { reason, completion_tokens, cached_tokens, stop_sequence } => {
                    result.finish = Some(reason);
                    result.stop_sequence = stop_sequence;
                    result.completion_tokens = completion_tokens;
                    result.cached_tokens = cached_tokens;
                }
                ChoiceEvent::Failed(e) => return Err(ApiError::from(e)),
            }
        }
        Ok(result)
    });
    futures::future::try_join_all(runs).await
}

/// Token counts for a request: each prompt counted once however many samples it had; the
/// cached count of a prompt is the one its lowest-index choice reported.
#[derive(Debug, Clone)]
pub struct UsageTally {
    prompt_lens: Vec<u32>,
    n: u32,
    completion_tokens: u32,
    cached: Vec<Option<(u32, u32)>>,
}

impl UsageTally {
    pub fn new(prompts: &[PromptPlan], n: u32) -> Self {
        UsageTally {
            prompt_lens: prompts.iter().map(|p| p.ids.len() as u32).collect(),
            n,
            completion_tokens: 0,
            cached: vec![None; prompts.len()],
        }
    }

    pub fn record(&mut self, index: u32, completion_tokens: u32, cached_tokens: Option<u32>) {
        self.completion_tokens += completion_tokens;
        let slot = self.cached.get_mut((index / self.n.max(1)) as usize);
        if let (Some(slot), Some(cached)) = (slot, cached_tokens) {
            if slot.is_none_or(|(first, _)| index < first) {
                *slot = Some((index, cached));
            }
        }
    }

    pub fn usage(&self) -> Usage {
        let prompt_tokens: u32 = self.prompt_lens.iter().sum();
        let cached_tokens = self.cached.iter().flatten().map(|&(_, c)| c).sum();
        Usage {
            prompt_tokens,
            completion_tokens: self.completion_tokens,
            total_tokens: prompt_tokens + self.completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// The assembler for one planned sequence.
pub fn assembler(state: &AppState, req: &GenerateRequest, params: &CommonParams) -> ChoiceAssembler {
    ChoiceAssembler::new(
        state.codec().new_stream_decoder(),
        StopMatcher::new(&params.stop_strings).including_stop(params.include_stop_str),
        req.params.stop_token_ids.clone(),
        req.params.logprobs.is_some(),
        state.codec().vocab_size(),
    )
    .with_min_tokens(req.params.min_tokens)
}

/// Plans, admits and wraps every sequence of a request: the choice streams, in index order.
pub async fn start(
    state: &AppState,
    response_id: &str,
    prompts: &[PromptPlan],
    params: &CommonParams,
) -> Result<Vec<impl Stream<Item = ChoiceItem> + Send + 'static>, ApiError> {
    let requests = plan(response_id, prompts, params);
    let assemblers: Vec<ChoiceAssembler> = requests.iter().map(|r| assembler(state, r, params)).collect();
    let receivers = admit(state, requests).await?;
    let tracker = RequestTracker::current();
    tracker.admitted(prompts, params.n);
    Ok(receivers
        .into_iter()
        .zip(assemblers)
        .enumerate()
        .map(|(i, (rx, asm))| choice_stream(i as u32, rx, asm, tracker.choice()))
        .collect())
}
