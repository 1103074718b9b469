//! Moving a sequence off a failed replica: what travels (the prompt, the tokens generated
//! so far, the stop criteria and the client's event channel with what it has been told)
//! and how the receiving replica re-creates it.
//!
//! The receiving replica admits the sequence exactly as it would re-admit one it had
//! preempted: prompt then output in one token buffer, all of it re-prefilled, the next
//! token sampled after the last one, the sampler told how many tokens were generated
//! before (a seeded sampler resumes its stream there). Greedy output is therefore the
//! same as an undisturbed run's. The client sees one stream: no second `PromptInfo`, no
//! token twice, and `Finished` carries the original prompt size and the total count.

use prost::Message as _;
use tessera_proto::coordinator as cpb;
use tessera_proto::worker as pb;

use crate::engine::EventTx;
use crate::seq_trace::SeqTrace;
use crate::sequence::{Sequence, StopCriteria};

/// A request's client as the engine serves it; travels with a migrated sequence.
#[derive(Debug)]
pub struct ClientState {
    pub events: EventTx,
    pub sampling: pb::SamplingParams,
    /// Prompt tokens of the original request.
    pub prompt_tokens: usize,
    /// Tokens sent so far.
    pub completion_tokens: usize,
    /// Whether `PromptInfo` was sent.
    pub announced: bool,
    /// The request's coordinator spans (empty when untraced); they move with it.
    pub trace: SeqTrace,
}

impl ClientState {
    /// A request without a seed gets one here, once: every tensor rank of a replica
    /// samples it from the same random stream (they must agree, `ReplicaLink::recv`),
    /// and so does a replica the sequence moves to.
    pub fn new(events: EventTx, mut sampling: pb::SamplingParams, prompt_tokens: usize) -> Self {
        sampling.seed.get_or_insert_with(|| {
            use std::hash::{BuildHasher, Hasher};
            // std's RandomState is keyed from OS randomness, distinct per instance.
            std::collections::hash_map::RandomState::new().build_hasher().finish()
        });
        ClientState {
            events,
            sampling,
            prompt_tokens,
            completion_tokens: 0,
            announced: false,
            trace: SeqTrace::default(),
        }
    }

    /// Ends the client's stream with an error event saying `message`.
    pub fn fail(mut self, message: &str) {
        self.trace.fail(message);
        let _ = self.events.send(Ok(cpb::GenerateEvent {
            event: Some(cpb::generate_event::Event::Finished(cpb::Finished {
                reason: cpb::FinishReason::Error as i32,
                prompt_tokens: self.prompt_tokens as u32,
                completion_tokens: self.completion_tokens as u32,
                message: message.to_string(),
            })),
        }));
    }
}

/// An unfinished sequence leaving a failed replica.
#[derive(Debug)]
pub struct Migrant {
    pub prompt: Vec<u32>,
    /// Tokens generated (and sent to the client) so far.
    pub output: Vec<u32>,
    pub stop: StopCriteria,
    pub client: ClientState,
    /// Replicas it has been handed to so far (bounds the moves when several fail at once).
    pub hops: usize,
    /// Why it left its replica (the error the client gets when no replica can take it).
    pub reason: String,
}

impl Migrant {
    /// The migrant of `seq`, served to `client`, leaving because of `reason`.
    pub fn new(seq: &Sequence, client: ClientState, reason: &str) -> Self {
        Migrant {
            prompt: seq.prompt().to_vec(),
            output: seq.output().to_vec(),
            stop: seq.stop.clone(),
            client,
            hops: 0,
            reason: reason.to_string(),
        }
    }

    /// The sequence to admit on the receiving replica under id `id`: prompt then output,
    /// waiting, to be re-prefilled like a preempted one.
    pub fn sequence(&self, id: u64) -> Sequence {
        let mut seq = Sequence::new(id, self.prompt.clone(), self.stop.clone(), id)
            .with_wire_bytes(self.client.sampling.encoded_len());
        for &t in &self.output {
            seq.push_output(t);
        }
        seq
    }

    /// No replica can take it: the client's stream ends with an error event.
    pub fn fail(self) {
        let msg = format!("{}; no other replica could take the request over", self.reason);
        self.client.fail(&msg);
    }
}
