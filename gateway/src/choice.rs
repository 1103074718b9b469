//! Turns one sequence's engine events into client-facing pieces: incremental detokenization,
//! stop-string matching and logprob bookkeeping. Plain synchronous state (no I/O), driven by
//! `generate.rs`, so it is testable on its own.
//!
//! Rules:
//! - A token whose id is in the sequence's stop set (EOS, `stop_token_ids`) adds neither text
//!   nor a logprob entry; it still counts as a completion token.
//! - Tokens that formed a matched stop string keep their logprob entries (the engine did
//!   sample them) but their text is cut.
//! - Logprob entries travel with the next released text, so a streamed chunk never carries
//!   entries for text the client has not been sent; leftovers ride on the last piece.
//! - No stop string completed by one of the first `min_tokens` tokens ends the choice (vLLM's
//!   v1 detokenizer checks only once the output is longer); one completed by a later token
//!   counts, even if it began earlier. Stop ids are banned as long (the worker's sampler), so
//!   either way a stop comes after at least `min_tokens` tokens.

use crate::codec::{CodecError, StreamDecoder};
use crate::engine::{EngineError, EngineEvent, FinishReason};
use crate::stop::{StopMatcher, StopStep};

/// The logprob of one sampled token, with its most likely alternatives (most likely first).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// The finish reasons the API reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiFinish {
    Stop,
    Length,
    /// vLLM's reason for a sequence the engine gave up.
    Abort,
}

impl ApiFinish {
    pub fn as_str(self) -> &'static str {
        match self {
            ApiFinish::Stop => "stop",
            ApiFinish::Length => "length",
            ApiFinish::Abort => "abort",
        }
    }
}

/// What one engine event turns into.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Text to send (may be empty when only logprobs are left to deliver).
    Delta { text: String, logprobs: Vec<TokenLogprob> },
    /// The sequence is over; nothing follows. Drop the engine receiver.
    Finished { reason: ApiFinish },
}

/// Why a sequence failed midway.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChoiceError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Codec(#[from] CodecError),
    #[error("the engine ended the sequence with an error")]
    EngineFailed,
    #[error("the engine sent token id {0}, outside the vocabulary")]
    BadTokenId(u32),
    #[error("the engine closed the sequence without finishing it")]
    Truncated,
}

pub struct ChoiceAssembler {
    decoder: Box<dyn StreamDecoder>,
    matcher: StopMatcher,
    /// Sorted.
    stop_ids: Vec<u32>,
    want_logprobs: bool,
    /// Ids are valid below this; the engine's alternatives are checked against it.
    vocab_size: u32,
    pending_logprobs: Vec<TokenLogprob>,
    /// vLLM's `min_tokens`: the text of the tokens before this many is matched unchecked.
    min_tokens: u32,
    completion_tokens: u32,
    cached_tokens: Option<u32>,
    done: bool,
}

impl ChoiceAssembler {
    /// `stop_ids` sorted (as in `SamplingSpec::stop_token_ids`).
    pub fn new(
        decoder: Box<dyn StreamDecoder>,
        matcher: StopMatcher,
        stop_ids: Vec<u32>,
        want_logprobs: bool,
        vocab_size: u32,
    ) -> Self {
        ChoiceAssembler {
            decoder,
            matcher,
            stop_ids,
            want_logprobs,
            vocab_size,
            pending_logprobs: Vec::new(),
            min_tokens: 0,
            completion_tokens: 0,
            cached_tokens: None,
            done: false,
        }
    }

    /// No stop string completed by one of the choice's first `n` tokens ends it (vLLM's
    /// `min_tokens`).
    pub fn with_min_tokens(mut self, n: u32) -> Self {
        self.min_tokens = n;
        self
    }

    /// Tokens received so far, stop tokens included.
    pub fn completion_tokens(&self) -> u32 {
        self.completion_tokens
    }

    /// Prompt tokens served from the prefix cache, when the engine said.
    pub fn cached_tokens(&self) -> Option<u32> {
        self.cached_tokens
    }

    /// The stop string that ended the sequence, if one did.
    pub fn stop_sequence(&self) -> Option<&str> {
        self.matcher.matched()
    }

    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Feeds one event; `None` means the engine closed the channel.
    pub fn on_event(&mut self, event: Option<EngineEvent>) -> Result<Vec<Piece>, ChoiceError> {
        if self.done {
            return Ok(Vec::new());
        }
        let event = match event {
            Some(e) => e,
            None => {
                self.done = true;
                return Err(ChoiceError::Truncated);
            }
        };
        match event {
            EngineEvent::PromptInfo { cached_tokens } => {
                self.cached_tokens = Some(cached_tokens);
                Ok(Vec::new())
            }
            EngineEvent::Token { id, logprob, top } => self.on_token(id, logprob, top),
            EngineEvent::Finished { reason, .. } => {
                let reason = match reason {
                    FinishReason::Stop => ApiFinish::Stop,
                    FinishReason::Length => ApiFinish::Length,
                    FinishReason::Abort => ApiFinish::Abort,
                    FinishReason::Error => {
                        self.done = true;
                        return Err(ChoiceError::EngineFailed);
                    }
                };
                Ok(self.finish(reason))
            }
            EngineEvent::Error(e) => {
                self.done = true;
                Err(e.into())
            }
        }
    }

    fn on_token(&mut self, id: u32, logprob: Option<f32>, top: Vec<(u32, f32)>) -> Result<Vec<Piece>, ChoiceError> {
        self.completion_tokens += 1;
        if self.stop_ids.binary_search(&id).is_ok() {
            return Ok(Vec::new());
        }
        if let Some(&(bad, _)) = top.iter().find(|&&(alt, _)| alt >= self.vocab_size) {
            self.done = true;
            return Err(ChoiceError::BadTokenId(bad));
        }
        if self.want_logprobs {
            // An engine that ignored the request for logprobs is reported as -inf
            // (rendered as OpenAI's -9999.0) rather than failing the whole request.
            let logprob = logprob.unwrap_or(f32::NEG_INFINITY);
            self.pending_logprobs.push(TokenLogprob { id, logprob, top });
        }
        let text = match self.decoder.push(id) {
            Ok(t) => t,
            Err(e) => {
                self.done = true;
                return Err(e.into());
            }
        };
        Ok(match self.match_stops(&text) {
            StopStep::Continue(out) if out.is_empty() => Vec::new(),
            StopStep::Continue(out) => vec![self.delta(out)],
            StopStep::Stopped(out) => {
                self.done = true;
                let mut pieces: Vec<Piece> = self.flush(out).into_iter().collect();
                pieces.push(Piece::Finished { reason: ApiFinish::Stop });
                pieces
            }
        })
    }

    fn finish(&mut self, reason: ApiFinish) -> Vec<Piece> {
        self.done = true;
        let tail = self.decoder.finish();
        let (text, reason) = match self.match_stops(&tail) {
            StopStep::Continue(mut out) => {
                out.push_str(&self.matcher.finish());
                (out, reason)
            }
            StopStep::Stopped(out) => (out, ApiFinish::Stop),
        };
        let mut pieces: Vec<Piece> = self.flush(text).into_iter().collect();
        pieces.push(Piece::Finished { reason });
        pieces
    }

    /// Feeds `text` to the stop matcher, unchecked while at most `min_tokens` tokens came.
    fn match_stops(&mut self, text: &str) -> StopStep {
        if self.min_tokens > 0 && self.completion_tokens <= self.min_tokens {
            StopStep::Continue(self.matcher.push_unchecked(text))
        } else {
            self.matcher.push(text)
        }
    }

    /// A last delta when there is text or logprobs left to deliver.
    fn flush(&mut self, text: String) -> Option<Piece> {
        (!text.is_empty() || !self.pending_logprobs.is_empty()).then(|| self.delta(text))
    }

    fn delta(&mut self, text: String) -> Piece {
        Piece::Delta { text, logprobs: std::mem::take(&mut self.pending_logprobs) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::Codec;
    use crate::testing::{ByteCodec, EOS, VOCAB};

    fn assembler(stops: &[&str], logprobs: bool) -> ChoiceAssembler {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        ChoiceAssembler::new(
            ByteCodec::new("t").new_stream_decoder(),
            StopMatcher::new(&stops),
            vec![EOS],
            logprobs,
            VOCAB,
        )
    }

    fn token(id: u32, lp: f32) -> Option<EngineEvent> {
        Some(EngineEvent::Token { id, logprob: Some(lp), top: vec![((id + 1) % 256, lp - 1.0)] })
    }

    fn finished(reason: FinishReason) -> Option<EngineEvent> {
        Some(EngineEvent::Finished { reason, prompt_tokens: 3, completion_tokens: 0 })
    }

    /// Feeds all events; returns (text, logprob ids, finish reason).
    fn run(asm: &mut ChoiceAssembler, events: Vec<Option<EngineEvent>>) -> (String, Vec<u32>, Option<ApiFinish>) {
        let (mut text, mut ids, mut finish) = (String::new(), Vec::new(), None);
        for e in events {
            for p in asm.on_event(e).unwrap() {
                match p {
                    Piece::Delta { text: t, logprobs } => {
                        text.push_str(&t);
                        ids.extend(logprobs.iter().map(|l| l.id));
                    }
                    Piece::Finished { reason } => finish = Some(reason),
                }
            }
        }
        (text, ids, finish)
    }

    #[test]
    fn stop_token_adds_no_text_but_counts() {
        let mut asm = assembler(&[], true);
        let ids = ByteCodec::ids("hé!");
        let mut events: Vec<_> = ids.iter().enumerate().map(|(k, &id)| token(id, -(k as f32) - 0.5)).collect();
        events.insert(0, Some(EngineEvent::PromptInfo { cached_tokens: 2 }));
        events.push(token(EOS, -0.1));
        events.push(finished(FinishReason::Stop));
        let (text, lp_ids, finish) = run(&mut asm, events);
        assert_eq!(text, "hé!");
        assert_eq!(lp_ids, ids);
        assert_eq!(finish, Some(ApiFinish::Stop));
        assert_eq!(asm.completion_tokens(), ids.len() as u32 + 1);
        assert_eq!(asm.cached_tokens(), Some(2));
    }

    #[test]
    fn stop_string_cuts_text_and_keeps_logprobs_of_its_tokens() {
        let mut asm = assembler(&["##"], true);
        let ids = ByteCodec::ids("ab#c##de");
        let events: Vec<_> = ids.iter().map(|&id| token(id, -1.0)).collect();
        let (text, lp_ids, finish) = run(&mut asm, events);
        assert_eq!(text, "ab#c");
        // Every token up to the one completing the stop string; nothing after.
        assert_eq!(lp_ids, ids[..6].to_vec());
        assert_eq!(finish, Some(ApiFinish::Stop));
        assert!(asm.is_done());
        assert_eq!(asm.completion_tokens(), 6);
    }

    /// vLLM's `min_tokens`: a stop string completed by one of the first `min_tokens` tokens
    /// ends nothing; one completed by a later token ends the choice.
    #[test]
    fn stop_strings_wait_for_min_tokens() {
        let ids = ByteCodec::ids("a##b##c");
        let events = || ids.iter().map(|&id| token(id, -1.0)).collect::<Vec<_>>();
        for (min_tokens, want) in [(0, "a"), (2, "a"), (3, "a##b"), (5, "a##b"), (6, "a##b##c")] {
            let mut asm = assembler(&["##"], false).with_min_tokens(min_tokens);
            let mut all = events();
            all.push(finished(FinishReason::Length));
            let (text, _, finish) = run(&mut asm, all);
            assert_eq!(text, want, "min_tokens {min_tokens}");
            let reason = if want.len() == ids.len() { ApiFinish::Length } else { ApiFinish::Stop };
            assert_eq!(finish, Some(reason), "min_tokens {min_tokens}");
        }
    }

    #[test]
    fn held_back_text_is_released_at_length() {
        let mut asm = assembler(&["STOP"], false);
        let mut events: Vec<_> = ByteCodec::ids("x ST").iter().map(|&id| token(id, -1.0)).collect();
        events.push(finished(FinishReason::Length));
        assert_eq!(run(&mut asm, events), ("x ST".to_owned(), vec![], Some(ApiFinish::Length)));
    }

    #[test]
    fn failures_end_the_choice() {
        let mut asm = assembler(&[], false);
        assert_eq!(asm.on_event(None), Err(ChoiceError::Truncated));
        assert_eq!(asm.on_event(token(65, -1.0)), Ok(vec![]));

        let mut asm = assembler(&[], false);
        let err = EngineError::Unavailable { retry_after_s: 3 };
        assert_eq!(asm.on_event(Some(EngineEvent::Error(err.clone()))), Err(ChoiceError::Engine(err)));

        let mut asm = assembler(&[], false);
        assert_eq!(asm.on_event(finished(FinishReason::Error)), Err(ChoiceError::EngineFailed));

        let mut asm = assembler(&[], true);
        let bad = Some(EngineEvent::Token { id: 65, logprob: Some(-1.0), top: vec![(VOCAB + 7, -2.0)] });
        assert_eq!(asm.on_event(bad), Err(ChoiceError::BadTokenId(VOCAB + 7)));

        let mut asm = assembler(&[], false);
        assert!(matches!(asm.on_event(token(VOCAB, -1.0)), Err(ChoiceError::Codec(_))));
    }
}
