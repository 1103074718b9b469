//! Replica placement: which worker of a replica runs which slice of the model under
//! tensor parallelism (`tp` ranks per pipeline stage) and pipeline parallelism (`pp`
//! stages, each a contiguous layer range). Checked once, before any weight is loaded, so
//! a shape that cannot be split is a clear configuration error instead of a worker
//! failing half-way through loading.
//!
//! How a layer splits over the `tp` ranks of a stage (Megatron-style):
//! - column-parallel (output rows split): q, k, v, gate, up; the vocabulary rows of the
//!   embedding and the LM head;
//! - row-parallel (input columns split, followed by an all-reduce): o, down;
//! - `hidden_size` is never split: every rank holds the full residual stream.
//!
//! KV heads either split evenly (`n_kv % tp == 0`) or, when there are fewer KV heads
//! than ranks, each KV head is replicated on `tp / n_kv` ranks (`tp % n_kv == 0`).
//!
//! Worker order within a replica: `worker = pp_rank * tp + tp_rank`.

use std::ops::Range;

use tessera_model::config::ModelConfig;

/// The layout of one replica over `tp * pp` workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub tp: usize,
    pub pp: usize,
    /// One entry per worker, in worker order.
    pub ranks: Vec<RankPlan>,
}

/// What one worker of the replica runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPlan {
    /// Index into the replica's worker list: `pp_rank * tp + tp_rank`.
    pub worker: usize,
    pub tp_rank: usize,
    pub pp_rank: usize,
    /// The decoder layers of this worker's pipeline stage.
    pub layers: Range<usize>,
}

/// Why a model cannot be placed with the requested degrees.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlacementError {
    #[error("{name} must be at least 1")]
    Zero { name: &'static str },
    #[error("{heads} attention heads cannot be split over tp={tp}")]
    Heads { heads: usize, tp: usize },
    #[error("{kv_heads} KV heads can be neither split over nor replicated evenly on tp={tp}")]
    KvHeads { kv_heads: usize, tp: usize },
    #[error(
        "hidden size {size} cannot be split over tp={tp} (each rank owns hidden/tp output features of o and down)"
    )]
    Hidden { size: usize, tp: usize },
    #[error("FFN size {size} cannot be split over tp={tp}")]
    Intermediate { size: usize, tp: usize },
    #[error("vocabulary of {vocab} tokens cannot be split over tp={tp} (vocab-parallel embedding and LM head)")]
    Vocab { vocab: usize, tp: usize },
    #[error("{layers} layers cannot fill pp={pp} pipeline stages")]
    Layers { layers: usize, pp: usize },
    #[error("tp={tp} x pp={pp} workers overflows")]
    TooManyWorkers { tp: usize, pp: usize },
    #[error(
        "{what} shard of {cols} input columns (tp={tp}) is not a multiple of the {block}-value quantisation block"
    )]
    BlockAlignment { what: &'static str, cols: usize, tp: usize, block: usize },
}

impl Placement {
    /// Checks that `c` splits over `tp` ranks and `pp` stages and lays the workers out.
    ///
    /// Layers split as evenly as possible; when `num_layers % pp != 0` the first
    /// `num_layers % pp` stages get one extra layer (e.g. 30 layers over 4 stages:
    /// 8, 8, 7, 7).
    pub fn plan(c: &ModelConfig, tp: usize, pp: usize) -> Result<Self, PlacementError> {
        if tp == 0 {
            return Err(PlacementError::Zero { name: "tp" });
        }
        if pp == 0 {
            return Err(PlacementError::Zero { name: "pp" });
        }
        if !c.num_heads.is_multiple_of(tp) {
            return Err(PlacementError::Heads { heads: c.num_heads, tp });
        }
        let kv = c.num_kv_heads;
        let kv_ok = kv > 0 && (kv.is_multiple_of(tp) || tp.is_multiple_of(kv));
        if !kv_ok {
            return Err(PlacementError::KvHeads { kv_heads: kv, tp });
        }
        if !c.hidden_size.is_multiple_of(tp) {
            return Err(PlacementError::Hidden { size: c.hidden_size, tp });
        }
        if !c.intermediate_size.is_multiple_of(tp) {
            return Err(PlacementError::Intermediate { size: c.intermediate_size, tp });
        }
        if !c.vocab_size.is_multiple_of(tp) {
            return Err(PlacementError::Vocab { vocab: c.vocab_size, tp });
        }
        if c.num_layers < pp {
            return Err(PlacementError::Layers { layers: c.num_layers, pp });
        }
        let workers = tp.checked_mul(pp).ok_or(PlacementError::TooManyWorkers { tp, pp })?;

        let (base, extra) = (c.num_layers / pp, c.num_layers % pp);
        let mut ranks = Vec::with_capacity(workers);
        let mut start = 0;
        for pp_rank in 0..pp {
            let len = base + usize::from(pp_rank < extra);
            let layers = start..start + len;
            start += len;
            for tp_rank in 0..tp {
                ranks.push(RankPlan { worker: pp_rank * tp + tp_rank, tp_rank, pp_rank, layers: layers.clone() });
            }
        }
        Ok(Placement { tp, pp, ranks })
    }

    /// One worker running the whole model (its layer range is left to the worker: a
    /// whole-model Load ignores it).
    pub fn single() -> Self {
        Placement { tp: 1, pp: 1, ranks: vec![RankPlan { worker: 0, tp_rank: 0, pp_rank: 0, layers: 0..0 }] }
    }

    /// Workers one replica needs (`tp * pp`).
    pub fn workers(&self) -> usize {
        self.ranks.len()
    }

    /// For quantised weights: checks that each row-parallel shard (a slice of every row
    /// along the input dimension) starts and ends on a `block_elems` boundary, which
    /// slicing a quantised row requires. Column-parallel layers keep whole rows and need
    /// no check. Shards: o has `num_heads * head_dim / tp` columns, down `intermediate / tp`.
    pub fn check_block_alignment(&self, c: &ModelConfig, block_elems: usize) -> Result<(), PlacementError> {
        if block_elems == 0 {
            return Err(PlacementError::Zero { name: "block_elems" });
        }
        let tp = self.tp.max(1);
        let shards = [("attn_output", c.num_heads * c.head_dim / tp), ("ffn_down", c.intermediate_size / tp)];
        for (what, cols) in shards {
            if cols % block_elems != 0 {
                return Err(PlacementError::BlockAlignment { what, cols, tp: self.tp, block: block_elems });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
// Stage lists such as `vec![0..30]` (one stage) are meant as written.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use tessera_model::config::{Arch, RopeStyle};

    use super::*;

    fn config(
        hidden: usize,
        layers: usize,
        heads: usize,
        kv: usize,
        head_dim: usize,
        ffn: usize,
        vocab: usize,
    ) -> ModelConfig {
        let c = ModelConfig {
            arch: Arch::Llama,
            hidden_size: hidden,
            intermediate_size: ffn,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim,
            vocab_size: vocab,
            max_position: 8192,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            rope_style: RopeStyle::Interleaved,
            tie_embeddings: true,
            qkv_bias: false,
            qk_norm: false,
        };
        assert!(c.validate().is_ok(), "test config must be a valid model");
        c
    }

    fn smollm2() -> ModelConfig {
        config(576, 30, 9, 3, 64, 1536, 49152)
    }

    fn llama_8b() -> ModelConfig {
        config(4096, 32, 32, 8, 128, 14336, 128256)
    }

    /// The expected plan written out independently: workers in order, stage of each.
    fn expected(tp: usize, stages: &[Range<usize>]) -> Vec<RankPlan> {
        let mut out = Vec::new();
        for (pp_rank, layers) in stages.iter().enumerate() {
            for tp_rank in 0..tp {
                out.push(RankPlan { worker: out.len(), tp_rank, pp_rank, layers: layers.clone() });
            }
        }
        out
    }

    #[test]
    fn smollm2_valid_layouts() {
        let c = smollm2();
        for (tp, pp, stages) in
            [(1, 1, vec![0..30]), (3, 1, vec![0..30]), (1, 2, vec![0..15, 15..30]), (3, 2, vec![0..15, 15..30])]
        {
            let p = Placement::plan(&c, tp, pp).unwrap();
            assert_eq!((p.tp, p.pp, p.workers()), (tp, pp, tp * pp));
            assert_eq!(p.ranks, expected(tp, &stages), "tp={tp} pp={pp}");
        }
        // tp=3 pp=2 spelled out: worker 4 is stage 1, tp rank 1.
        let p = Placement::plan(&c, 3, 2).unwrap();
        assert_eq!(p.ranks[4], RankPlan { worker: 4, tp_rank: 1, pp_rank: 1, layers: 15..30 });
    }

    #[test]
    fn uneven_layers_go_to_earlier_stages() {
        let p = Placement::plan(&smollm2(), 1, 4).unwrap();
        let layers: Vec<_> = p.ranks.iter().map(|r| r.layers.clone()).collect();
        assert_eq!(layers, vec![0..8, 8..16, 16..23, 23..30]);
        let p = Placement::plan(&smollm2(), 3, 30).unwrap();
        assert_eq!(p.workers(), 90);
        assert!(p.ranks.iter().all(|r| r.layers == (r.pp_rank..r.pp_rank + 1)));
    }

    #[test]
    fn smollm2_tp2_is_refused() {
        let err = Placement::plan(&smollm2(), 2, 1).unwrap_err();
        assert_eq!(err, PlacementError::Heads { heads: 9, tp: 2 });
        assert_eq!(err.to_string(), "9 attention heads cannot be split over tp=2");
    }

    #[test]
    fn llama_8b_layouts() {
        let c = llama_8b();
        for tp in [2, 4, 8, 16] {
            let p = Placement::plan(&c, tp, 1).unwrap();
            assert_eq!(p.ranks, expected(tp, &[0..32]), "tp={tp}");
        }
        let p = Placement::plan(&c, 8, 3).unwrap();
        let stages: Vec<_> = p.ranks.iter().step_by(8).map(|r| r.layers.clone()).collect();
        assert_eq!(stages, vec![0..11, 11..22, 22..32]);

        let err = Placement::plan(&c, 3, 1).unwrap_err();
        assert_eq!(err.to_string(), "32 attention heads cannot be split over tp=3");
        assert_eq!(Placement::plan(&c, 1, 33).unwrap_err(), PlacementError::Layers { layers: 32, pp: 33 });
        assert_eq!(Placement::plan(&c, 0, 1).unwrap_err(), PlacementError::Zero { name: "tp" });
        assert_eq!(Placement::plan(&c, 2, 0).unwrap_err(), PlacementError::Zero { name: "pp" });
    }

    #[test]
    fn each_remaining_rule_is_checked() {
        // 24 heads / 8 KV heads at tp=6: the heads split (24 % 6), the KV heads neither
        // split (8 % 6) nor replicate evenly (6 % 8).
        let c = config(1536, 4, 24, 8, 64, 1536, 1536);
        assert_eq!(Placement::plan(&c, 6, 1).unwrap_err(), PlacementError::KvHeads { kv_heads: 8, tp: 6 });
        // FFN 100 over tp=8 (heads 32, KV 8, vocab 1024 all fine).
        let c = config(4096, 4, 32, 8, 128, 100, 1024);
        assert_eq!(Placement::plan(&c, 8, 1).unwrap_err(), PlacementError::Intermediate { size: 100, tp: 8 });
        // Hidden 4100 over tp=8 (heads 32, KV 8, FFN, vocab fine).
        let c = config(4100, 4, 32, 8, 128, 1024, 1024);
        assert_eq!(Placement::plan(&c, 8, 1).unwrap_err(), PlacementError::Hidden { size: 4100, tp: 8 });
        // Vocab 1001 over tp=2.
        let c = config(4096, 4, 32, 8, 128, 1024, 1001);
        let err = Placement::plan(&c, 2, 1).unwrap_err();
        assert_eq!(err, PlacementError::Vocab { vocab: 1001, tp: 2 });
        assert!(err.to_string().contains("1001 tokens cannot be split over tp=2"));
    }

    #[test]
    fn block_alignment() {
        let c = smollm2();
        let p = Placement::plan(&c, 3, 1).unwrap();
        // o: 576 / 3 = 192 columns, down: 1536 / 3 = 512: both whole Q4_1 blocks of 32.
        assert_eq!(p.check_block_alignment(&c, 32), Ok(()));
        // K-quant blocks of 256: 192 is not a multiple.
        let err = p.check_block_alignment(&c, 256).unwrap_err();
        assert_eq!(err, PlacementError::BlockAlignment { what: "attn_output", cols: 192, tp: 3, block: 256 });
        assert!(err.to_string().contains("192 input columns"));
        let p1 = Placement::plan(&c, 1, 1).unwrap();
        assert_eq!(p1.check_block_alignment(&c, 32), Ok(()));
        // Llama-8B, K-quants: tp=8 gives o 512 and down 1792 = 7 * 256 columns; tp=16 gives
        // o 256 but down 896, which is not a multiple of 256.
        let c8 = llama_8b();
        assert_eq!(Placement::plan(&c8, 8, 1).unwrap().check_block_alignment(&c8, 256), Ok(()));
        let err = Placement::plan(&c8, 16, 1).unwrap().check_block_alignment(&c8, 256).unwrap_err();
        assert_eq!(err, PlacementError::BlockAlignment { what: "ffn_down", cols: 896, tp: 16, block: 256 });
        assert_eq!(p.check_block_alignment(&c, 0), Err(PlacementError::Zero { name: "block_elems" }));
    }
}
