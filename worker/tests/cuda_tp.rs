//! Tensor parallelism on the CUDA backend: a model split over two GPUs (one thread per
//! rank, NCCL all-reduces after the o and down GEMMs) against the same model on one GPU.
//!
//! - SmolLM2-135M (9 heads, 3 KV heads) cannot be split over 2 GPUs: every rank's load is
//!   a clear error naming the heads, before any device is touched (so this part also runs
//!   without a GPU, whenever the default model is present).
//! - With `TESSERA_GPU_TESTS=1`, two GPUs and `TESSERA_TORCH_REF=<dir>` (the random Qwen3
//!   checkpoint of bench/gpu/torch_qwen3_ref.py, 16 heads / 8 KV heads): tp=2 against tp=1
//!   over a two-sequence prefill and teacher-forced decode steps replayed from CUDA graphs:
//!   relative L2 error of all logits <= 1e-2, argmax agreement >= 95%, and both ranks'
//!   logits (replicated LM head over all-reduced activations) agree.

mod common;

use std::path::{Path, PathBuf};

use tessera_kernels::cuda::{Device, NcclId};
use tessera_model::weights::ModelFiles;
use tessera_worker::batch::{LogitsWanted, SeqChunk};
use tessera_worker::cuda::{CudaModel, CudaOptions};
use tessera_worker::parallel::Shard;
use tessera_worker::sampling::argmax;
use tessera_worker::WorkerError;

const BLOCK: usize = 16;
const BLOCKS: usize = 512;
/// Prompt tokens of each sequence prefilled in the first step; the rest are decoded.
const PREFILL: usize = 120;

fn opts(device: usize) -> CudaOptions {
    CudaOptions { device, num_blocks: Some(BLOCKS), block_size: BLOCK, ..CudaOptions::default() }
}

/// Loads rank r of `tp` on GPU r, one thread per rank (a rank's load blocks until every
/// rank has joined), and runs `then` on each loaded model in its thread.
fn per_rank<T: Send>(
    model: &Path,
    layers: usize,
    tp: usize,
    id: &NcclId,
    then: impl Fn(usize, CudaModel) -> T + Sync,
) -> Vec<Result<T, WorkerError>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..tp)
            .map(|r| {
                let then = &then;
                s.spawn(move || {
                    let files = ModelFiles::open(model).expect("open model");
                    let shard = Shard { tp_rank: r, tp, stage: 0, stages: 1, layers: 0..layers };
                    CudaModel::load_shard(&files, &opts(r), &shard, id).map(|m| then(r, m))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

/// A real id where NCCL is available, else any bytes (the loads must fail before joining).
fn group_id() -> NcclId {
    Device::nccl_unique_id().unwrap_or(NcclId([0x5a; 128]))
}

#[test]
fn smollm2_cannot_be_split_over_two_gpus() {
    let Some(path) = common::model_path::default_model() else { return };
    let layers = ModelFiles::open(&path).expect("open model").config().expect("config").num_layers;
    let results = per_rank(&path, layers, 2, &group_id(), |_, _| ());
    for (r, res) in results.into_iter().enumerate() {
        let msg = match res {
            Err(e) => e.to_string(),
            Ok(()) => panic!("rank {r} loaded SmolLM2 split over 2 GPUs"),
        };
        assert!(msg.contains("9 attention heads are not divisible by tp 2"), "rank {r}: {msg}");
    }
    // A pipeline-parallel GPU shard is refused the same way.
    let files = ModelFiles::open(&path).expect("open model");
    let pp = Shard { tp_rank: 0, tp: 3, stage: 0, stages: 2, layers: 0..layers / 2 };
    let msg = CudaModel::load_shard(&files, &opts(0), &pp, &group_id()).err().expect("pp shard refused").to_string();
    assert!(msg.contains("pipeline parallel (pp=2) is not supported on GPU workers"), "{msg}");
}

/// Both sequences' first `PREFILL` tokens in one step (every logit row), then one decode
/// step of both per remaining token, fed the true next token (teacher forcing). Returns
/// every logit row in order and, per decode step, whether it replayed a CUDA graph.
fn run_script(m: &mut CudaModel, seqs: &[Vec<u32>; 2]) -> (Vec<f32>, Vec<bool>) {
    let tables: Vec<Vec<u32>> =
        (0..2u32).map(|i| (100 * i..100 * i + 200u32.div_ceil(BLOCK as u32)).collect()).collect();
    let prefill: Vec<SeqChunk> = (0..2)
        .map(|i| SeqChunk {
            tokens: &seqs[i][..PREFILL],
            first_pos: 0,
            block_table: &tables[i],
            logits: LogitsWanted::All,
        })
        .collect();
    let mut rows = m.forward(&prefill).expect("prefill").data;
    let mut graphs = Vec::new();
    for p in PREFILL..seqs[0].len() {
        let decode: Vec<SeqChunk> = (0..2)
            .map(|i| SeqChunk {
                tokens: &seqs[i][p..p + 1],
                first_pos: p,
                block_table: &tables[i],
                logits: LogitsWanted::Last,
            })
            .collect();
        rows.extend(m.forward(&decode).expect("decode").data);
        graphs.push(m.last_step_timing().graph);
    }
    (rows, graphs)
}

/// (relative L2 error over all values, rows whose argmax agrees) of `got` vs `want`.
fn compare(got: &[f32], want: &[f32], vocab: usize) -> (f64, usize) {
    let num: f64 = got.iter().zip(want).map(|(&a, &b)| (a as f64 - b as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|&b| (b as f64).powi(2)).sum();
    let agree = got.chunks(vocab).zip(want.chunks(vocab)).filter(|(g, w)| argmax(g) == argmax(w)).count();
    ((num / den.max(1e-30)).sqrt(), agree)
}

#[test]
fn random_qwen3_split_over_two_gpus_matches_one_gpu() {
    if std::env::var("TESSERA_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped random_qwen3_split_over_two_gpus_matches_one_gpu: set TESSERA_GPU_TESTS=1");
        return;
    }
    let Ok(dir) = std::env::var("TESSERA_TORCH_REF") else {
        eprintln!("skipped random_qwen3_split_over_two_gpus_matches_one_gpu: set TESSERA_TORCH_REF (bench/gpu/run.sh)");
        return;
    };
    let gpus = Device::count().expect("count GPUs");
    if gpus < 2 {
        eprintln!("skipped random_qwen3_split_over_two_gpus_matches_one_gpu: {gpus} GPU(s), 2 needed");
        return;
    }
    let dir = PathBuf::from(dir);
    let tokens: Vec<u32> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokens.json")).expect("tokens.json")).unwrap();
    assert!(tokens.len() > PREFILL + 8, "{} tokens", tokens.len());
    // The second sequence: the same ids in another order, so the two rows of each decode
    // step differ.
    let mut other = tokens.clone();
    other.rotate_left(tokens.len() / 3);
    let seqs = [tokens, other];
    let model = dir.join("model");
    let files = ModelFiles::open(&model).expect("open HF dir");
    let config = files.config().expect("config");
    assert_eq!((config.num_heads, config.num_kv_heads), (16, 8), "the reference checkpoint's heads");

    let mut single = CudaModel::load(&files, &opts(0)).expect("load on one GPU");
    let (want, _) = run_script(&mut single, &seqs);
    drop(single);

    let ranks = per_rank(&model, config.num_layers, 2, &Device::nccl_unique_id().expect("NCCL id"), |r, mut m| {
        assert_eq!(m.tp(), (r, 2));
        assert_eq!((m.local_config().num_heads, m.local_config().num_kv_heads), (8, 4));
        run_script(&mut m, &seqs)
    });
    let ranks: Vec<(Vec<f32>, Vec<bool>)> =
        ranks.into_iter().enumerate().map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}"))).collect();
    let vocab = config.vocab_size;
    let rows = want.len() / vocab;
    let (err, agree) = compare(&ranks[0].0, &want, vocab);
    let (between, _) = compare(&ranks[1].0, &ranks[0].0, vocab);
    let pct = 100.0 * agree as f64 / rows as f64;
    eprintln!(
        "RESULT qwen3 tp=2 vs tp=1: relative L2 error {err:.3e}, argmax equal {agree}/{rows} = {pct:.1}%; \
         rank 1 vs rank 0 {between:.3e}"
    );
    assert_eq!(ranks[0].0.len(), want.len());
    for (r, (_, graphs)) in ranks.iter().enumerate() {
        assert!(graphs.iter().all(|&g| g), "rank {r}: a decode step ran without its CUDA graph");
    }
    assert!(err <= 1e-2, "relative L2 error {err:.3e} > 1e-2");
    assert!(pct >= 95.0, "argmax agreement {pct:.1}% < 95%");
    assert!(between <= 1e-3, "the two ranks' logits differ: {between:.3e}");
}
