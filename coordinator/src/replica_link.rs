//! The coordinator's connection to one model replica: `tp x pp` workers (one for a plain
//! replica). Setup asks every worker for its collective addresses, then loads every shard
//! at once (each rank's load blocks until its peers have connected to it), then opens the
//! step streams. A step goes to every worker; they exchange activations among themselves
//! (tensor-parallel gathers, pipeline sends) and the leader, the last stage's tensor rank
//! 0, returns the sampled tokens. Any rank's failure fails the step, and so, with decode
//! lookahead, does a tensor rank of the last stage that sampled differently from the leader
//! (each rank runs its own sampled token in a lookahead decode, so they must agree), and so
//! does a reply no healthy worker sends (a token outside the vocabulary). A step that runs
//! past the deadline fails too: by default 60 s for a replica of GPU workers, 300 s
//! otherwise ([`default_step_timeout`]).

use std::time::Duration;

use futures::future::try_join_all;
use tessera_proto::worker as pb;

use crate::placement::Placement;
use crate::worker_link::{LinkError, WorkerLink};

/// What every shard of a replica loads.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    pub model_path: String,
    pub block_size: u32,
    pub kv_memory_bytes: u64,
    /// Most tokens one step runs (the scheduler's budget; see `pb::LoadRequest`).
    pub max_step_tokens: u32,
    /// Keeps this replica's collectives apart from other replicas'.
    pub group: u64,
}

/// The workers of one replica with open step streams.
pub struct ReplicaLink {
    links: Vec<WorkerLink>,
    leader: usize,
    /// A step that takes longer fails the replica (a rank that hangs without dying).
    step_timeout: Duration,
    /// Pipeline stages (steps kept in flight).
    depth: usize,
    /// Whether the last stage's tensor ranks must have sampled alike (lookahead decodes).
    check_ranks: bool,
    /// The model's vocabulary: a sampled token at or past it is a faulty reply.
    vocab: u32,
}

/// Per-step deadline of a replica with a CPU rank, unless the operator sets one: far above
/// any real step (a long CPU prefill chunk takes seconds on a small machine).
pub const CPU_STEP_TIMEOUT: Duration = Duration::from_secs(300);
/// Per-step deadline of a replica whose every rank is a GPU, unless the operator sets one.
/// A healthy GPU step takes well under a second (an 8B model's 8,192-token prefill chunk
/// ~0.2 s on an H200), so a hung kernel, or a rank blocked in a collective on a peer that
/// hung, fails the replica within a minute instead of five (vLLM's engine-iteration
/// timeout is the same 60 s).
pub const GPU_STEP_TIMEOUT: Duration = Duration::from_secs(60);

/// The per-step deadline for a replica whose ranks report these device kinds (Info's
/// `device`: "cpu", "cuda", "hip"): [`GPU_STEP_TIMEOUT`] when every rank is a GPU, else
/// [`CPU_STEP_TIMEOUT`] (an unknown or empty kind counts as a CPU: the longer deadline).
pub fn default_step_timeout<'a>(devices: impl IntoIterator<Item = &'a str>) -> Duration {
    let mut devices = devices.into_iter().peekable();
    let all_gpus = devices.peek().is_some() && devices.all(|d| matches!(d, "cuda" | "hip"));
    if all_gpus {
        GPU_STEP_TIMEOUT
    } else {
        CPU_STEP_TIMEOUT
    }
}

impl ReplicaLink {
    /// Sets up the replica on `addrs` (worker `i` of the placement at `addrs[i]`). The
    /// returned info is the leader's, with the smallest KV block count of any rank (the
    /// scheduler's pool must fit on every rank). With `tls`, every link is mutual TLS.
    pub async fn connect(
        addrs: &[String],
        placement: &Placement,
        spec: &LoadSpec,
        wait: Duration,
        tls: Option<&tonic::transport::ClientTlsConfig>,
    ) -> Result<(Self, pb::WorkerInfo), LinkError> {
        let mut clients = try_join_all(addrs.iter().map(|a| WorkerLink::dial(a, wait, tls))).await?;
        let mut infos = Vec::with_capacity(addrs.len());
        for (c, a) in clients.iter_mut().zip(addrs) {
            infos.push(WorkerLink::info_of(c, a).await?);
        }
        let (tp, pp) = (placement.tp, placement.pp);
        let loads = placement.ranks.iter().map(|r| {
            let tp_peers = (0..tp).map(|t| infos[r.pp_rank * tp + t].tp_collective_addr.clone()).collect();
            let pp_peers = (0..pp).map(|p| infos[p * tp + r.tp_rank].pp_collective_addr.clone()).collect();
            pb::LoadRequest {
                model_path: spec.model_path.clone(),
                block_size: spec.block_size,
                num_blocks: 0,
                kv_memory_bytes: spec.kv_memory_bytes,
                max_step_tokens: spec.max_step_tokens,
                shard: Some(pb::Shard {
                    tp_rank: r.tp_rank as u32,
                    tp_size: tp as u32,
                    pp_rank: r.pp_rank as u32,
                    pp_size: pp as u32,
                    layer_begin: r.layers.start as u32,
                    layer_end: r.layers.end as u32,
                    tp_peers,
                    pp_peers,
                    group: spec.group,
                }),
            }
        });
        let loaded =
            try_join_all(clients.iter_mut().zip(addrs).zip(loads).map(|((c, a), load)| WorkerLink::load(c, a, load)))
                .await?;
        let mut links = Vec::with_capacity(addrs.len());
        for (c, a) in clients.into_iter().zip(addrs) {
            links.push(WorkerLink::open(c, a).await?);
        }
        let leader = (pp - 1) * tp;
        let mut info = loaded[leader].clone();
        info.num_blocks = loaded.iter().map(|i| i.num_blocks).min().unwrap_or(0);
        info.ranks_sample_alike = loaded.iter().all(|i| i.ranks_sample_alike);
        let step_timeout = default_step_timeout(loaded.iter().map(|i| i.device.as_str()));
        let vocab = info.vocab_size;
        let link = ReplicaLink { links, leader, step_timeout, depth: pp, check_ranks: false, vocab };
        Ok((link, info))
    }

    /// Makes every step check that the last stage's tensor ranks sampled alike (a
    /// tensor-parallel replica with lookahead decodes, which run each rank's own token).
    pub fn with_rank_check(mut self, on: bool) -> Self {
        self.check_ranks = on;
        self
    }

    /// The per-step deadline.
    pub fn step_timeout(&self) -> Duration {
        self.step_timeout
    }

    /// Sets the per-step deadline.
    pub fn with_step_timeout(mut self, t: Duration) -> Self {
        self.step_timeout = t;
        self
    }

    /// The leader's address (for messages).
    pub fn addr(&self) -> &str {
        self.links[self.leader].addr()
    }

    /// Runs one step on every worker; the leader's reply. Fails when any worker fails or
    /// the step outlives the deadline.
    pub async fn step(&mut self, req: pb::StepRequest) -> Result<pb::StepReply, LinkError> {
        let want = req.step_id;
        self.send(req).await?;
        self.recv(want).await
    }

    /// Queues one step on every worker's stream (a pipeline keeps several in flight).
    pub async fn send(&mut self, req: pb::StepRequest) -> Result<(), LinkError> {
        try_join_all(self.links.iter_mut().map(|l| l.send(req.clone()))).await.map(drop)
    }

    /// Waits for step `want` (the oldest unanswered one) on every worker; the leader's
    /// reply. Fails when any worker fails or the deadline passes.
    pub async fn recv(&mut self, want: u64) -> Result<pb::StepReply, LinkError> {
        let after = self.step_timeout;
        let addr = self.links[self.leader].addr().to_string();
        let (leader, check, vocab) = (self.leader, self.check_ranks, self.vocab);
        let all = async {
            let mut replies = try_join_all(self.links.iter_mut().map(|l| l.recv(want))).await?;
            // The last stage's tensor ranks (the leader and the ranks after it) sample on
            // their own; with lookahead each runs its own token, so they must agree. (A
            // rank whose grammar compiler failed where the leader's did not fails the
            // replica here: its next lookahead would compute another sequence.)
            // A token outside the vocabulary would be appended to its sequence and sent
            // back in the next step, which every worker refuses: the sequence would fail
            // each replica it migrates to. The worker that sent it is faulty; the reply is
            // not used.
            if let Err(detail) = tokens_in_vocab(&replies[leader], vocab) {
                return Err(LinkError::BadReply { addr: addr.clone(), step: want, detail });
            }
            let others = if check { &replies[leader + 1..] } else { &[] };
            for other in others {
                if let Err(detail) = same_samples(&replies[leader], other) {
                    return Err(LinkError::RanksDisagree { addr: addr.clone(), step: want, detail });
                }
            }
            Ok(replies.swap_remove(leader))
        };
        tokio::time::timeout(after, all).await.map_err(|_| LinkError::StepTimeout { addr, step: want, after })?
    }

    /// Steps a replica keeps in flight: one per pipeline stage.
    pub fn depth(&self) -> usize {
        self.depth
    }
}

/// Whether every token `reply` sampled is below `vocab`; the first that is not, if any.
fn tokens_in_vocab(reply: &pb::StepReply, vocab: u32) -> Result<(), String> {
    match reply.sampled.iter().find(|s| s.token >= vocab) {
        Some(s) => Err(format!("sequence {}: token {} outside the vocabulary of {vocab}", s.seq_id, s.token)),
        None => Ok(()),
    }
}

/// Whether two ranks' replies to one step sampled the same token for the same sequences
/// and failed the same sequences; what differs first, if not.
fn same_samples(leader: &pb::StepReply, other: &pb::StepReply) -> Result<(), String> {
    let ids = |r: &pb::StepReply| r.sampled.iter().map(|s| (s.seq_id, s.token)).collect::<Vec<_>>();
    let (a, b) = (ids(leader), ids(other));
    if let Some(((sa, ta), (_, tb))) = a.iter().zip(&b).find(|(x, y)| x != y) {
        return Err(format!("sequence {sa}: token {ta} vs {tb}"));
    }
    if a.len() != b.len() {
        return Err(format!("{} vs {} sampled sequences", a.len(), b.len()));
    }
    let failed = |r: &pb::StepReply| r.seq_errors.iter().map(|e| e.seq_id).collect::<Vec<_>>();
    if failed(leader) != failed(other) {
        return Err(format!("failed sequences {:?} vs {:?}", failed(leader), failed(other)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(samples: &[(u64, u32)], failed: &[u64]) -> pb::StepReply {
        pb::StepReply {
            step_id: 1,
            sampled: samples
                .iter()
                .map(|&(seq_id, token)| pb::Sampled { seq_id, token, ..Default::default() })
                .collect(),
            seq_errors: failed.iter().map(|&seq_id| pb::SequenceError { seq_id, message: "x".into() }).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn ranks_agree_only_on_equal_tokens_and_failures() {
        let a = reply(&[(1, 10), (2, 20)], &[3]);
        assert_eq!(same_samples(&a, &reply(&[(1, 10), (2, 20)], &[3])), Ok(()));
        // Timings and log-probabilities may differ; tokens may not.
        let mut timed = reply(&[(1, 10), (2, 20)], &[3]);
        timed.forward_us = 99;
        assert_eq!(same_samples(&a, &timed), Ok(()));
        let e = same_samples(&a, &reply(&[(1, 10), (2, 21)], &[3])).unwrap_err();
        assert!(e.contains("sequence 2: token 20 vs 21"), "{e}");
        assert!(same_samples(&a, &reply(&[(1, 10)], &[3])).is_err());
        assert!(same_samples(&a, &reply(&[(1, 10), (2, 20)], &[])).is_err());
    }

    #[test]
    fn gpu_replicas_get_the_short_deadline_only_when_every_rank_is_a_gpu() {
        assert_eq!(default_step_timeout(["cuda"]), GPU_STEP_TIMEOUT);
        assert_eq!(default_step_timeout(["cuda", "cuda", "hip"]), GPU_STEP_TIMEOUT);
        assert_eq!(default_step_timeout(["cpu"]), CPU_STEP_TIMEOUT);
        // One CPU rank in the replica: its steps may take as long as a CPU step.
        assert_eq!(default_step_timeout(["cuda", "cpu"]), CPU_STEP_TIMEOUT);
        // A worker that reports no kind (or one unknown here) gets the longer deadline.
        assert_eq!(default_step_timeout(["cuda", ""]), CPU_STEP_TIMEOUT);
        assert_eq!(default_step_timeout(["tpu"]), CPU_STEP_TIMEOUT);
        assert_eq!(default_step_timeout(std::iter::empty::<&str>()), CPU_STEP_TIMEOUT);
        assert!(GPU_STEP_TIMEOUT < CPU_STEP_TIMEOUT);
    }

    #[test]
    fn a_token_outside_the_vocabulary_is_a_bad_reply() {
        assert_eq!(tokens_in_vocab(&reply(&[(1, 10), (2, 99)], &[]), 100), Ok(()));
        let e = tokens_in_vocab(&reply(&[(1, 10), (2, 100)], &[]), 100).unwrap_err();
        assert!(e.contains("sequence 2: token 100"), "{e}");
        assert!(tokens_in_vocab(&reply(&[(7, u32::MAX)], &[]), 100).is_err());
        // A reply that sampled nothing (a pipeline stage, a failed sequence) is fine.
        assert_eq!(tokens_in_vocab(&reply(&[], &[3]), 100), Ok(()));
    }
}
