//! Tensor- and pipeline-parallel CPU workers (threads joined by the TCP collective, as
//! separate processes are in a cluster) produce logits bit-identical to one worker: every
//! rank computes whole output features from whole input rows (see worker/src/parallel.rs),
//! so only the placement of the work changes, never the arithmetic.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use common::synthetic::{self, Family, Shape};
use tessera_kernels::GgmlType;
use tessera_model::weights::ModelFiles;
use tessera_worker::batch::{LogitsWanted, SeqChunk};
use tessera_worker::collective::{Collective, TcpCollective};
use tessera_worker::llama::LlamaModel;
use tessera_worker::parallel::{Comms, Shard};

/// Splits over tp 1, 2, 4 (4 replicates the 2 KV heads) and 2 or 4 stages.
const SHAPE: Shape = Shape { hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, ffn: 128, vocab: 64, layers: 4 };
const BLOCK: usize = 4;

/// Two steps over two sequences: prefill chunks (all logits of one), then a decode of
/// one and the rest of the other's prompt. Returns every step's logits.
fn run(model: &LlamaModel, comms: &mut Comms) -> Vec<Vec<f32>> {
    let mut kv = model.new_kv_cache(16, BLOCK);
    let a = synthetic::tokens(SHAPE.vocab, 11, 1);
    let b = synthetic::tokens(SHAPE.vocab, 9, 2);
    let (ta, tb): (Vec<u32>, Vec<u32>) = ((0..4).collect(), (4..8).collect());
    let step1 = [
        SeqChunk { tokens: &a[..7], first_pos: 0, block_table: &ta, logits: LogitsWanted::All },
        SeqChunk { tokens: &b[..5], first_pos: 0, block_table: &tb, logits: LogitsWanted::Last },
    ];
    let step2 = [
        SeqChunk { tokens: &a[7..8], first_pos: 7, block_table: &ta, logits: LogitsWanted::Last },
        SeqChunk { tokens: &b[5..], first_pos: 5, block_table: &tb, logits: LogitsWanted::All },
    ];
    vec![
        model.forward_sharded(&step1, &mut kv, comms).expect("step 1").data,
        model.forward_sharded(&step2, &mut kv, comms).expect("step 2").data,
    ]
}

fn listeners(n: usize) -> (Vec<TcpListener>, Vec<SocketAddr>) {
    let ls: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let addrs = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    (ls, addrs)
}

/// Runs a tp x pp replica in threads; returns the logits of the last stage's tp rank 0.
// `stage` and `rank` index two tables transposed to each other: a range loop reads best.
#[allow(clippy::needless_range_loop)]
fn replica(files: &Arc<ModelFiles>, tp: usize, pp: usize) -> Vec<Vec<f32>> {
    let layers = SHAPE.layers;
    // One TP group per stage, one pipeline per tp rank.
    let mut tp_groups: Vec<(Vec<Option<TcpListener>>, Vec<SocketAddr>)> =
        (0..pp).map(|_| listeners(tp)).map(|(l, a)| (l.into_iter().map(Some).collect(), a)).collect();
    let mut pp_groups: Vec<(Vec<Option<TcpListener>>, Vec<SocketAddr>)> =
        (0..tp).map(|_| listeners(pp)).map(|(l, a)| (l.into_iter().map(Some).collect(), a)).collect();
    let mut handles = Vec::new();
    for stage in 0..pp {
        for rank in 0..tp {
            let tl = tp_groups[stage].0[rank].take().unwrap();
            let ta = tp_groups[stage].1.clone();
            let pl = pp_groups[rank].0[stage].take().unwrap();
            let pa = pp_groups[rank].1.clone();
            let files = files.clone();
            handles.push(std::thread::spawn(move || {
                let t = Duration::from_secs(20);
                let per = layers / pp;
                let shard = Shard { tp_rank: rank, tp, stage, stages: pp, layers: stage * per..(stage + 1) * per };
                let model = LlamaModel::load_shard(files, Some(shard)).expect("load shard");
                let mut comms = Comms::default();
                if tp > 1 {
                    comms.tp = Some(Box::new(TcpCollective::connect(rank, tl, &ta, 1 + stage as u64, t, t).unwrap())
                        as Box<dyn Collective>);
                }
                if pp > 1 {
                    comms.pp = Some(Box::new(TcpCollective::connect(stage, pl, &pa, 100 + rank as u64, t, t).unwrap())
                        as Box<dyn Collective>);
                }
                ((stage, rank), run(&model, &mut comms))
            }));
        }
    }
    let results: Vec<_> = handles.into_iter().map(|h| h.join().expect("rank thread")).collect();
    // Every rank of the last stage holds the same logits; earlier stages return none.
    let last: Vec<&Vec<Vec<f32>>> = results.iter().filter(|((s, _), _)| *s == pp - 1).map(|(_, l)| l).collect();
    for other in &last[1..] {
        assert_eq!(*other, last[0], "tp ranks of the last stage disagree");
    }
    for ((s, _), l) in &results {
        if *s != pp - 1 {
            assert!(l.iter().all(|step| step.is_empty()), "stage {s} returned logits");
        }
    }
    last[0].clone()
}

#[test]
fn tensor_and_pipeline_parallel_logits_equal_one_worker() {
    for (family, ty) in
        [(Family::Llama, GgmlType::Q8_0), (Family::Qwen2, GgmlType::Q4_1), (Family::Qwen3, GgmlType::F32)]
    {
        let (files, _) = synthetic::build(family, &SHAPE, ty, 7);
        let single = run(&LlamaModel::load(files.clone()).expect("load"), &mut Comms::default());
        assert!(single.iter().all(|s| !s.is_empty() && s.iter().all(|v| v.is_finite())));
        for (tp, pp) in [(2, 1), (1, 2), (2, 2), (4, 1), (1, 4)] {
            let got = replica(&files, tp, pp);
            assert_eq!(got.len(), single.len());
            for (step, (g, s)) in got.iter().zip(&single).enumerate() {
                assert!(g == s, "{family:?} {ty:?} tp={tp} pp={pp} step {step}: logits differ from one worker");
            }
            eprintln!("{family:?} {ty:?}: tp={tp} pp={pp} bit-identical to one worker");
        }
    }
}

#[test]
fn impossible_shards_are_refused() {
    let (files, _) = synthetic::build(Family::Llama, &SHAPE, GgmlType::Q8_0, 3);
    for shard in [
        Shard { tp_rank: 0, tp: 3, stage: 0, stages: 1, layers: 0..4 },
        Shard { tp_rank: 2, tp: 2, stage: 0, stages: 1, layers: 0..4 },
        Shard { tp_rank: 0, tp: 1, stage: 0, stages: 2, layers: 2..9 },
        Shard { tp_rank: 0, tp: 1, stage: 0, stages: 1, layers: 2..2 },
    ] {
        assert!(LlamaModel::load_shard(files.clone(), Some(shard.clone())).is_err(), "{shard:?} accepted");
    }
    // A sharded model without its collectives is an error, not a wrong answer.
    let m =
        LlamaModel::load_shard(files, Some(Shard { tp_rank: 0, tp: 2, stage: 0, stages: 1, layers: 0..4 })).unwrap();
    let mut kv = m.new_kv_cache(4, BLOCK);
    let t: Vec<u32> = (0..4).collect();
    let c = [SeqChunk { tokens: &[1, 2], first_pos: 0, block_table: &t, logits: LogitsWanted::Last }];
    assert!(m.forward_sharded(&c, &mut kv, &mut Comms::default()).is_err());
}
