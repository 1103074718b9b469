//! Checks a Generate request at the coordinator's edge. The gateway validates what
//! clients send, but the coordinator is a gRPC service of its own: a malformed message
//! (an id outside the vocabulary, a sampling value out of range) must be refused here,
//! with INVALID_ARGUMENT, rather than reach a worker and fail the step that every other
//! sequence of the replica shares.

use prost::Message;
use tessera_proto::coordinator as cpb;

/// Largest encoded sampling parameters (a structured-output grammar is most of them) a
/// request may carry: a new sequence's first step message carries them to every worker, and
/// a step must stay under the workers' message limit (`tessera_proto::MAX_MESSAGE_BYTES`,
/// 64 MiB) even when such a sequence is admitted alone (the scheduler always lets a step's
/// first new sequence in). Far above the gateway's own 1 MiB cap on a constraint.
pub const MAX_SAMPLING_BYTES: usize = 8 << 20;

/// Why a request is refused; the message names the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidRequest(pub String);

fn bad(msg: String) -> Result<(), InvalidRequest> {
    Err(InvalidRequest(msg))
}

/// Checks token ids against `vocab_size` and sampling values against the ranges the
/// worker's sampler accepts (OpenAI's, with 0 meaning "off" where proto3 defaults apply).
pub fn validate(req: &cpb::GenerateRequest, vocab_size: usize) -> Result<(), InvalidRequest> {
    if req.prompt_ids.is_empty() {
        return bad("prompt_ids is empty".into());
    }
    if req.max_tokens == 0 {
        return bad("max_tokens must be at least 1".into());
    }
    let in_vocab = |what: &str, ids: &[u32]| -> Result<(), InvalidRequest> {
        match ids.iter().find(|&&id| id as usize >= vocab_size) {
            Some(id) => bad(format!("{what}: token id {id} is outside the vocabulary of {vocab_size}")),
            None => Ok(()),
        }
    };
    in_vocab("prompt_ids", &req.prompt_ids)?;
    in_vocab("stop_token_ids", &req.stop_token_ids)?;
    let Some(s) = &req.sampling else { return Ok(()) };
    let size = s.encoded_len();
    if size > MAX_SAMPLING_BYTES {
        return bad(format!("sampling is {size} bytes encoded (its constraint mostly); at most {MAX_SAMPLING_BYTES}"));
    }
    in_vocab("logit_bias", &s.logit_bias.keys().copied().collect::<Vec<_>>())?;
    let range =
        |name: &str, v: f32, ok: bool| if ok { Ok(()) } else { bad(format!("sampling.{name} = {v} is out of range")) };
    range("temperature", s.temperature, (0.0..=2.0).contains(&s.temperature))?;
    range("top_p", s.top_p, (0.0..=1.0).contains(&s.top_p))?;
    range("min_p", s.min_p, (0.0..=1.0).contains(&s.min_p))?;
    let rp = s.repetition_penalty;
    range("repetition_penalty", rp, rp == 0.0 || (rp.is_finite() && rp > 0.0))?;
    range("presence_penalty", s.presence_penalty, (-2.0..=2.0).contains(&s.presence_penalty))?;
    range("frequency_penalty", s.frequency_penalty, (-2.0..=2.0).contains(&s.frequency_penalty))?;
    if let Some((&id, &b)) = s.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(*b)) {
        return bad(format!("sampling.logit_bias[{id}] = {b} is out of range (-100 to 100)"));
    }
    if s.top_logprobs > 20 {
        return bad(format!("sampling.top_logprobs = {} is more than 20", s.top_logprobs));
    }
    Ok(())
}
