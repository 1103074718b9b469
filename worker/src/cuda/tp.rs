//! Tensor and pipeline parallelism of the CUDA model.
//!
//! Tensor parallel, Megatron style: each of `tp` GPUs keeps the q/k/v rows of its heads and
//! the gate/up rows of its FFN slice (column-parallel), and the matching input columns of o
//! and down (row-parallel), so the o and down GEMMs give partial sums that one all-reduce
//! per sublayer completes. The LM head is vocab-parallel: each rank computes the logits of
//! its slice of the vocabulary (when the vocabulary divides by `tp`) and an all-gather
//! assembles the full rows, so every rank
//! sees the whole vocabulary and samples the same token. Norms, QK-norm weights and the
//! embedding are replicated (the residual stream is the same on every rank).
//!
//! Pipeline parallel: stage `s` of `stages` keeps a contiguous range of layers; the first
//! embeds, the others receive the residual stream from the stage before (NCCL send/recv
//! over a second communicator joining the same tensor rank of every stage), and only the
//! last holds the LM head and produces logits.
//!
//! [`TpPart`] is a rank's share (checked once, with a message naming what does not divide);
//! its [`TpPart::local_config`] is the model as this rank runs it (its heads, FFN width and
//! layer count), so the forward pass, the KV cache and the activations are sized from it
//! unchanged.

use std::ops::Range;

use tessera_kernels::cuda::{bf16, Device, NcclComm};
use tessera_model::config::ModelConfig;

use crate::error::WorkerError;
use crate::parallel::Shard;
use crate::shard::head_ranges;

/// One rank's share of a tensor- and pipeline-parallel model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpPart {
    pub tp: usize,
    pub rank: usize,
    /// Query heads this rank attends with.
    pub q_heads: Range<usize>,
    /// KV heads it keeps (its own when `tp <= n_kv`, else one replicated head).
    pub kv_heads: Range<usize>,
    /// Rows of gate and up, columns of down.
    pub ffn: Range<usize>,
    /// Rows of the LM head (vocabulary entries) whose logits this rank computes: its slice,
    /// or the whole vocabulary when that does not divide by `tp`.
    pub vocab: Range<usize>,
    /// Pipeline stage and stage count.
    pub stage: usize,
    pub stages: usize,
    /// Layers this stage runs.
    pub layers: Range<usize>,
}

impl TpPart {
    /// The whole model on one GPU.
    pub fn whole(c: &ModelConfig) -> Self {
        TpPart {
            tp: 1,
            rank: 0,
            q_heads: 0..c.num_heads,
            kv_heads: 0..c.num_kv_heads,
            ffn: 0..c.intermediate_size,
            vocab: 0..c.vocab_size,
            stage: 0,
            stages: 1,
            layers: 0..c.num_layers,
        }
    }

    /// Rank `rank` of `tp` over every layer, or an error naming what `c` cannot be split by.
    pub fn new(c: &ModelConfig, tp: usize, rank: usize) -> Result<Self, WorkerError> {
        let bad = |why: String| Err(WorkerError::InvalidBatch(format!("tensor parallel split tp={tp}: {why}")));
        if tp == 0 || rank >= tp {
            return bad(format!("rank {rank} is not one of 0..{tp}"));
        }
        if !c.num_heads.is_multiple_of(tp) {
            return bad(format!("{} attention heads are not divisible by tp {tp}", c.num_heads));
        }
        let kv = c.num_kv_heads;
        if kv == 0 || (!kv.is_multiple_of(tp) && !tp.is_multiple_of(kv)) {
            return bad(format!("{kv} KV heads can be neither split over nor replicated on tp {tp} ranks"));
        }
        if !c.intermediate_size.is_multiple_of(tp) {
            return bad(format!("the FFN size {} is not divisible by tp {tp}", c.intermediate_size));
        }
        let (q_heads, kv_heads) = head_ranges(c.num_heads, kv, tp, rank);
        let per = c.intermediate_size / tp;
        // A vocabulary that does not divide evenly stays whole on every rank (replicated head).
        let vocab = if c.vocab_size.is_multiple_of(tp) {
            let vper = c.vocab_size / tp;
            rank * vper..(rank + 1) * vper
        } else {
            0..c.vocab_size
        };
        Ok(TpPart {
            tp,
            rank,
            q_heads,
            kv_heads,
            ffn: rank * per..(rank + 1) * per,
            vocab,
            stage: 0,
            stages: 1,
            layers: 0..c.num_layers,
        })
    }

    /// The part `shard` asks for: its tensor rank's share of its stage's layers.
    pub fn of_shard(c: &ModelConfig, shard: &Shard) -> Result<Self, WorkerError> {
        let l = &shard.layers;
        if shard.stages == 0 || shard.stage >= shard.stages || l.is_empty() || l.end > c.num_layers {
            return Err(WorkerError::InvalidBatch(format!(
                "pipeline stage {} of {} with layers {l:?} does not fit a model of {} layers",
                shard.stage, shard.stages, c.num_layers
            )));
        }
        if (shard.stage == 0) != (l.start == 0) || (shard.stage + 1 == shard.stages) != (l.end == c.num_layers) {
            return Err(WorkerError::InvalidBatch(format!(
                "pipeline stage {} of {} cannot run layers {l:?}: the first stage starts at layer 0 and the \
                 last ends at layer {}",
                shard.stage, shard.stages, c.num_layers
            )));
        }
        let mut part = Self::new(c, shard.tp, shard.tp_rank)?;
        (part.stage, part.stages, part.layers) = (shard.stage, shard.stages, l.clone());
        Ok(part)
    }

    pub fn is_first_stage(&self) -> bool {
        self.stage == 0
    }

    pub fn is_last_stage(&self) -> bool {
        self.stage + 1 == self.stages
    }

    /// `c` as this rank runs it: its query heads, KV heads, FFN width and layers.
    pub fn local_config(&self, c: &ModelConfig) -> ModelConfig {
        ModelConfig {
            num_heads: self.q_heads.len(),
            num_kv_heads: self.kv_heads.len(),
            intermediate_size: self.ffn.len(),
            num_layers: self.layers.len(),
            ..c.clone()
        }
    }
}

/// Every rank's `value`, in rank order, through one bf16 all-reduce: rank `r` writes the
/// four bytes of its value as small integers (exact in bf16) into its own four slots of a
/// zeroed `[4 * world]` buffer, so the sum holds every rank's bytes untouched.
pub(crate) fn all_gather_u32(
    dev: &Device,
    comm: &NcclComm,
    rank: usize,
    world: usize,
    value: u32,
) -> Result<Vec<u32>, WorkerError> {
    let mut buf = dev.upload(&encode_u32(value, rank, world))?;
    dev.all_reduce_sum(comm, &mut buf)?;
    let summed = dev.download(&buf)?;
    decode_u32(&summed, world)
}

fn encode_u32(value: u32, rank: usize, world: usize) -> Vec<bf16> {
    let mut slots = vec![bf16::ZERO; 4 * world];
    for (i, b) in value.to_le_bytes().into_iter().enumerate() {
        slots[4 * rank + i] = bf16::from_f32(f32::from(b));
    }
    slots
}

fn decode_u32(summed: &[bf16], world: usize) -> Result<Vec<u32>, WorkerError> {
    if summed.len() != 4 * world {
        return Err(WorkerError::Collective(format!("gathered {} values for {world} ranks", summed.len())));
    }
    summed
        .chunks_exact(4)
        .map(|bytes| {
            let mut le = [0u8; 4];
            for (d, v) in le.iter_mut().zip(bytes) {
                let f = v.to_f32();
                if !(0.0..=255.0).contains(&f) || f.fract() != 0.0 {
                    return Err(WorkerError::Collective(format!("gathered byte {f} is not one of 0..=255")));
                }
                *d = f as u8;
            }
            Ok(u32::from_le_bytes(le))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::shapes::synthetic_config;

    #[test]
    fn parts_tile_heads_and_ffn() {
        for (shape, tp) in [("llama-3.1-8b", 2), ("llama-3.1-8b", 4), ("llama-3.1-8b", 16), ("qwen2.5-7b", 4)] {
            let c = synthetic_config(shape).unwrap();
            let parts: Vec<TpPart> = (0..tp).map(|r| TpPart::new(&c, tp, r).unwrap()).collect();
            let group = c.num_heads / c.num_kv_heads;
            let (mut q_next, mut f_next) = (0, 0);
            for p in &parts {
                assert_eq!((p.q_heads.start, p.ffn.start), (q_next, f_next), "{shape} tp={tp}");
                (q_next, f_next) = (p.q_heads.end, p.ffn.end);
                // Every local query head's KV head is kept locally, in the same grouping.
                let local = p.local_config(&c);
                let local_group = local.num_heads / local.num_kv_heads;
                for (i, h) in p.q_heads.clone().enumerate() {
                    assert_eq!(p.kv_heads.start + i / local_group, h / group, "{shape} tp={tp} head {h}");
                }
                assert_eq!(local.hidden_size, c.hidden_size);
                assert_eq!(local.vocab_size, c.vocab_size);
                local.validate().unwrap();
            }
            assert_eq!((q_next, f_next), (c.num_heads, c.intermediate_size));
        }
    }

    #[test]
    fn splits_that_do_not_divide_are_clear_errors() {
        let smol = synthetic_config("smollm2-135m").unwrap(); // 9 heads, 3 KV heads
        let msg = TpPart::new(&smol, 2, 0).unwrap_err().to_string();
        assert!(msg.contains("9 attention heads are not divisible by tp 2"), "{msg}");
        assert!(TpPart::new(&smol, 3, 2).is_ok());
        let llama = synthetic_config("llama-3.1-8b").unwrap(); // 32 heads, 8 KV heads
        let msg = TpPart::new(&ModelConfig { num_kv_heads: 32, ..llama.clone() }, 64, 0).unwrap_err().to_string();
        assert!(msg.contains("32 attention heads"), "{msg}");
        let msg = TpPart::new(&ModelConfig { num_heads: 24, num_kv_heads: 6, ..llama.clone() }, 4, 0)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("6 KV heads"), "{msg}");
        let msg =
            TpPart::new(&ModelConfig { intermediate_size: 14335, ..llama.clone() }, 2, 1).unwrap_err().to_string();
        assert!(msg.contains("FFN size 14335"), "{msg}");
        assert!(TpPart::new(&llama, 2, 2).unwrap_err().to_string().contains("rank 2"));
        // Pipeline stages: the first starts at layer 0, the last ends at the last layer.
        let stage = |stage, stages, layers| Shard { tp_rank: 1, tp: 2, stage, stages, layers };
        let first = TpPart::of_shard(&llama, &stage(0, 2, 0..16)).unwrap();
        assert_eq!((first.layers.clone(), first.is_first_stage(), first.is_last_stage()), (0..16, true, false));
        assert_eq!(first.local_config(&llama).num_layers, 16);
        let last = TpPart::of_shard(&llama, &stage(1, 2, 16..32)).unwrap();
        assert_eq!((last.is_first_stage(), last.is_last_stage(), last.q_heads.clone()), (false, true, 16..32));
        let msg = TpPart::of_shard(&llama, &stage(0, 1, 0..16)).unwrap_err().to_string();
        assert!(msg.contains("the last ends at layer 32"), "{msg}");
        let msg = TpPart::of_shard(&llama, &stage(1, 2, 16..33)).unwrap_err().to_string();
        assert!(msg.contains("does not fit a model of 32 layers"), "{msg}");
        let ok = Shard { tp_rank: 1, tp: 2, stage: 0, stages: 1, layers: 0..32 };
        assert_eq!(TpPart::of_shard(&llama, &ok).unwrap(), TpPart::new(&llama, 2, 1).unwrap());
    }

    /// The LM head is split by vocabulary rows where the vocabulary divides, whole on
    /// every rank where it does not.
    #[test]
    fn vocab_is_split_where_it_divides() {
        let llama = synthetic_config("llama-3.1-8b").unwrap(); // 128256 entries
        let parts: Vec<_> = (0..2).map(|r| TpPart::new(&llama, 2, r).unwrap().vocab).collect();
        assert_eq!(parts, vec![0..64128, 64128..128256]);
        let odd = ModelConfig { vocab_size: 128257, ..llama };
        assert_eq!(TpPart::new(&odd, 2, 1).unwrap().vocab, 0..128257);
    }

    /// The all-gather's encoding: the sum of every rank's slots (as NCCL's bf16 sum would
    /// compute it, in any order) decodes to every rank's value.
    #[test]
    fn u32_gather_encoding_survives_a_bf16_sum() {
        let values = [0u32, 1, 255, 256, 0xdead_beef, u32::MAX, 1_234_567];
        let world = values.len();
        let mut sum = vec![bf16::ZERO; 4 * world];
        for (r, &v) in values.iter().enumerate().rev() {
            for (s, e) in sum.iter_mut().zip(encode_u32(v, r, world)) {
                *s = bf16::from_f32(s.to_f32() + e.to_f32());
            }
        }
        assert_eq!(decode_u32(&sum, world).unwrap(), values);
        assert!(decode_u32(&sum[1..], world).is_err());
        sum[3] = bf16::from_f32(0.5);
        assert!(decode_u32(&sum, world).is_err());
    }
}
