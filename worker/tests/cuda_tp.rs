//! Tensor and pipeline parallelism on the CUDA backend: a model split over two GPUs (one
//! thread per rank; NCCL all-reduces after the o and down GEMMs and an all-gather of the
//! vocab-parallel LM head's logits under tp; the residual stream sent between stages under
//! pp) against the same model on one GPU.
//!
//! - Without a GPU (whenever the default model is present): SmolLM2-135M (9 heads, 3 KV
//!   heads) cannot be split over 2 tensor ranks, and a pipeline stage whose layers do not
//!   chain is refused; both before any device is touched, with a message naming why.
//! - With `TESSERA_GPU_TESTS=1` and two GPUs, over a two-sequence prefill and
//!   teacher-forced decode steps replayed from CUDA graphs (relative L2 error of all logits
//!   <= 1e-2, or twice the model's own noise floor where that is higher: the one-GPU
//!   model with its prompts prefilled in 4 chunks against 1; argmax equal on >= 95% of rows,
//!   or on as many as twice the floor's differing rows allow; and the ranks that produce
//!   logits agree):
//!   SmolLM2 at pp=2; a random-weight llama-3.1-8b shape (`--synthetic`, whose split is the
//!   one-GPU model split) at tp=2 and at pp=2; and with `TESSERA_TORCH_REF=<dir>` (the
//!   random Qwen3 checkpoint of bench/gpu/torch_qwen3_ref.py, 16 heads / 8 KV heads) at tp=2.

mod common;

use std::path::{Path, PathBuf};

use tessera_kernels::cuda::Device;
use tessera_model::weights::ModelFiles;
use tessera_worker::batch::{LogitsWanted, SeqChunk};
use tessera_worker::cuda::{CudaModel, CudaOptions, GroupIds};
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

/// Stage-major ranks of a `tp x pp` split of a model of `layers` layers: rank i is stage
/// i / tp, tensor rank i % tp, on GPU i, with its groups' NCCL ids (fresh ones where NCCL
/// is available, else any bytes: such loads must fail before joining).
fn shards(layers: usize, tp: usize, pp: usize) -> Vec<(Shard, GroupIds)> {
    let id = || Some(Device::nccl_unique_id().unwrap_or(tessera_kernels::cuda::NcclId([0x5a; 128])));
    let tp_ids: Vec<_> = (0..pp).map(|_| if tp > 1 { id() } else { None }).collect();
    let pp_ids: Vec<_> = (0..tp).map(|_| if pp > 1 { id() } else { None }).collect();
    (0..tp * pp)
        .map(|i| {
            let (stage, rank) = (i / tp, i % tp);
            let span = stage * layers / pp..(stage + 1) * layers / pp;
            let shard = Shard { tp_rank: rank, tp, stage, stages: pp, layers: span };
            (shard, GroupIds { tp: tp_ids[stage].clone(), pp: pp_ids[rank].clone() })
        })
        .collect()
}

/// Loads every rank of `splits` (rank i on GPU i) with `load`, one thread per rank (a
/// rank's load blocks until its groups have joined), and runs `then` on each loaded model
/// in its thread.
fn per_rank<T: Send>(
    splits: Vec<(Shard, GroupIds)>,
    load: impl Fn(&CudaOptions, &Shard, &GroupIds) -> Result<CudaModel, WorkerError> + Sync,
    then: impl Fn(usize, CudaModel) -> T + Sync,
) -> Vec<Result<T, WorkerError>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = splits
            .into_iter()
            .enumerate()
            .map(|(i, (shard, ids))| {
                let (load, then) = (&load, &then);
                s.spawn(move || load(&opts(i), &shard, &ids).map(|m| then(i, m)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

fn file_loader(path: &Path) -> impl Fn(&CudaOptions, &Shard, &GroupIds) -> Result<CudaModel, WorkerError> + Sync + '_ {
    move |o, shard, ids| CudaModel::load_shard(&ModelFiles::open(path)?, o, shard, ids)
}

#[test]
fn bad_splits_are_refused_before_touching_a_gpu() {
    let Some(path) = common::model_path::default_model() else { return };
    let layers = ModelFiles::open(&path).expect("open model").config().expect("config").num_layers;
    for (r, res) in per_rank(shards(layers, 2, 1), file_loader(&path), |_, _| ()).into_iter().enumerate() {
        let msg = match res {
            Err(e) => e.to_string(),
            Ok(()) => panic!("rank {r} loaded SmolLM2 split over 2 GPUs"),
        };
        assert!(msg.contains("9 attention heads are not divisible by tp 2"), "rank {r}: {msg}");
    }
    // Stages whose layers do not start at 0 / end at the last layer, or run past it.
    let files = ModelFiles::open(&path).expect("open model");
    for (stage, span, want) in [
        (0, 5..15, "the first stage starts at layer 0"),
        (1, 15..29, "the last ends at layer"),
        (1, 15..31, "does not fit a model of"),
    ] {
        let shard = Shard { tp_rank: 0, tp: 1, stage, stages: 2, layers: span.clone() };
        let ids = GroupIds::default();
        let msg = CudaModel::load_shard(&files, &opts(0), &shard, &ids).err().expect("bad stage refused").to_string();
        assert!(msg.contains(want), "stage {stage} layers {span:?}: {msg}");
    }
}

/// Both sequences' first `PREFILL` tokens in one step (every logit row), then one decode
/// step of both per remaining token, fed the true next token (teacher forcing). Returns
/// every logit row in order and, per decode step, whether it replayed a CUDA graph.
fn run_script(m: &mut CudaModel, seqs: &[Vec<u32>; 2]) -> (Vec<f32>, Vec<bool>) {
    run_script_chunked(m, seqs, PREFILL)
}

/// [`run_script`] with the prompts prefilled `chunk` tokens per step (later chunks attend
/// to the cached pages of earlier ones): the same model computed in another order, whose
/// difference from one chunk is the model's own rounding noise. Rows come back in
/// [`run_script`]'s order (every prompt row of sequence 0, then of sequence 1, then the
/// decode steps).
fn run_script_chunked(m: &mut CudaModel, seqs: &[Vec<u32>; 2], chunk: usize) -> (Vec<f32>, Vec<bool>) {
    let tables: Vec<Vec<u32>> =
        (0..2u32).map(|i| (100 * i..100 * i + 200u32.div_ceil(BLOCK as u32)).collect()).collect();
    let vocab = m.config().vocab_size;
    let mut per_seq = [Vec::new(), Vec::new()];
    for start in (0..PREFILL).step_by(chunk.max(1)) {
        let end = (start + chunk).min(PREFILL);
        let prefill: Vec<SeqChunk> = (0..2)
            .map(|i| SeqChunk {
                tokens: &seqs[i][start..end],
                first_pos: start,
                block_table: &tables[i],
                logits: LogitsWanted::All,
            })
            .collect();
        let data = m.forward(&prefill).expect("prefill").data;
        if !data.is_empty() {
            let (a, b) = data.split_at((end - start) * vocab);
            per_seq[0].extend_from_slice(a);
            per_seq[1].extend_from_slice(b);
        }
    }
    let [mut rows, second] = per_seq;
    rows.extend(second);
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
    if !two_gpus("random_qwen3_split_over_two_gpus_matches_one_gpu") {
        return;
    }
    let Ok(dir) = std::env::var("TESSERA_TORCH_REF") else {
        eprintln!("skipped random_qwen3_split_over_two_gpus_matches_one_gpu: set TESSERA_TORCH_REF (bench/gpu/run.sh)");
        return;
    };
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

    let one = CudaModel::load(&files, &opts(0)).expect("load on one GPU");
    check_split("qwen3 tp=2", one, shards(config.num_layers, 2, 1), file_loader(&model), &seqs);
}

/// Whether the GPU tests run here (`TESSERA_GPU_TESTS=1` and two GPUs); says why not.
fn two_gpus(test: &str) -> bool {
    if std::env::var("TESSERA_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped {test}: set TESSERA_GPU_TESTS=1");
        return false;
    }
    let gpus = Device::count().expect("count GPUs");
    if gpus < 2 {
        // bench/gpu/run.sh's two-GPU stage sets this: there a missing GPU fails the test.
        if std::env::var("TESSERA_NEED_TWO_GPUS").as_deref() == Ok("1") {
            panic!("{test}: TESSERA_NEED_TWO_GPUS=1 but {gpus} GPU(s) present, 2 needed");
        }
        eprintln!("skipped {test}: {gpus} GPU(s), 2 needed");
    }
    gpus >= 2
}

/// `seqs` through `one` (a whole model) and through every rank of `splits`: the logits of
/// the ranks that produce them (the last stage's) against one GPU's, as the issue bounds
/// them; every decode step of every rank replayed a CUDA graph.
fn check_split(
    label: &str,
    mut one: CudaModel,
    splits: Vec<(Shard, GroupIds)>,
    load: impl Fn(&CudaOptions, &Shard, &GroupIds) -> Result<CudaModel, WorkerError> + Sync,
    seqs: &[Vec<u32>; 2],
) {
    let vocab = one.config().vocab_size;
    let (want, _) = run_script(&mut one, seqs);
    let (reordered, _) = run_script_chunked(&mut one, seqs, PREFILL / 4);
    let (floor, floor_agree) = compare(&reordered, &want, vocab);
    drop(one);
    // The bound, or twice the model's own noise floor where that is above it (a
    // deep random bf16 model: a rounding flip in the bf16 residual stream propagates).
    let bound = f64::max(1e-2, 2.0 * floor);
    // Likewise argmax: at most 5% of rows differ, or twice as many as differ at the floor.
    let rows = want.len() / vocab;
    let max_differ = usize::max(rows / 20, 2 * (rows - floor_agree));
    eprintln!("RESULT {label}: one GPU, prompts in 4 chunks vs 1: relative L2 error {floor:.3e} (noise floor)");
    let ranks = per_rank(splits, load, |_, mut m| (m.samples(), run_script(&mut m, seqs)));
    let ranks: Vec<_> =
        ranks.into_iter().enumerate().map(|(r, x)| x.unwrap_or_else(|e| panic!("{label} rank {r}: {e}"))).collect();
    let mut producers: Vec<&Vec<f32>> = Vec::new();
    for (r, (samples, (got, graphs))) in ranks.iter().enumerate() {
        assert!(graphs.iter().all(|&g| g), "{label} rank {r}: a decode step ran without its CUDA graph");
        if !samples {
            assert!(got.is_empty(), "{label} rank {r}: a stage before the last returned logits");
            continue;
        }
        producers.push(got);
        assert_eq!(got.len(), want.len(), "{label} rank {r}");
        let (err, agree) = compare(got, &want, vocab);
        let pct = 100.0 * agree as f64 / rows as f64;
        let split = 2 * PREFILL * vocab;
        let (pre, _) = compare(&got[..split], &want[..split], vocab);
        let (dec, _) = compare(&got[split..], &want[split..], vocab);
        eprintln!(
            "RESULT {label} rank {r} vs one GPU: relative L2 error {err:.3e} (prefill rows {pre:.3e}, decode rows \
             {dec:.3e}), argmax equal {agree}/{rows} = {pct:.1}%"
        );
        assert!(err <= bound, "{label} rank {r}: relative L2 error {err:.3e} > {bound:.3e}");
        assert!(rows - agree <= max_differ, "{label} rank {r}: argmax differs on {} rows > {max_differ}", rows - agree);
    }
    let first = producers.first().unwrap_or_else(|| panic!("{label}: no rank produced logits"));
    for other in &producers[1..] {
        let (between, _) = compare(other, first, vocab);
        assert!(between <= 1e-3, "{label}: the ranks' logits differ: {between:.3e}");
    }
}

/// Two pseudo-random token sequences of `n` ids below `vocab`.
fn random_seqs(n: usize, vocab: usize) -> [Vec<u32>; 2] {
    let mut state = 0x1234_5678_u64;
    let mut next = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 33) % vocab as u64) as u32
    };
    [(0..n).map(|_| next()).collect(), (0..n).map(|_| next()).collect()]
}

#[test]
fn smollm2_over_two_pipeline_stages_matches_one_gpu() {
    if !two_gpus("smollm2_over_two_pipeline_stages_matches_one_gpu") {
        return;
    }
    let Some(path) = common::model_path::default_model() else { panic!("TESSERA_GPU_TESTS=1 needs the default model") };
    let files = ModelFiles::open(&path).expect("open model");
    let c = files.config().expect("config");
    let one = CudaModel::load(&files, &opts(0)).expect("load on one GPU");
    check_split(
        "smollm2 pp=2",
        one,
        shards(c.num_layers, 1, 2),
        file_loader(&path),
        &random_seqs(PREFILL + 16, c.vocab_size),
    );
}

#[test]
fn synthetic_llama_8b_split_tp2_and_pp2_matches_one_gpu() {
    if !two_gpus("synthetic_llama_8b_split_tp2_and_pp2_matches_one_gpu") {
        return;
    }
    const SHAPE: &str = "llama-3.1-8b";
    let synth = |o: &CudaOptions, shard: &Shard, ids: &GroupIds| CudaModel::synthetic_shard(SHAPE, 7, o, shard, ids);
    let one = CudaModel::synthetic(SHAPE, 7, &opts(0)).expect("synthetic on one GPU");
    let c = one.config().clone();
    let seqs = random_seqs(PREFILL + 8, c.vocab_size);
    check_split("llama-3.1-8b pp=2", one, shards(c.num_layers, 1, 2), synth, &seqs);
    let one = CudaModel::synthetic(SHAPE, 7, &opts(0)).expect("synthetic on one GPU");
    check_split("llama-3.1-8b tp=2", one, shards(c.num_layers, 2, 1), synth, &seqs);
}

/// One GPU: the noise floor `check_split` allows for, measured alone (and chunked prefill
/// checked against one-step prefill on a deep model): the same synthetic llama-3.1-8b
/// with its prompts in 4 chunks vs 1 stays close.
#[test]
fn synthetic_llama_8b_chunked_prefill_noise_floor() {
    if std::env::var("TESSERA_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped synthetic_llama_8b_chunked_prefill_noise_floor: set TESSERA_GPU_TESTS=1");
        return;
    }
    let mut one = CudaModel::synthetic("llama-3.1-8b", 7, &opts(0)).expect("synthetic on one GPU");
    let vocab = one.config().vocab_size;
    let seqs = random_seqs(PREFILL + 8, vocab);
    let (want, _) = run_script(&mut one, &seqs);
    let (got, _) = run_script_chunked(&mut one, &seqs, PREFILL / 4);
    let (err, agree) = compare(&got, &want, vocab);
    let rows = want.len() / vocab;
    eprintln!(
        "RESULT llama-3.1-8b one GPU, prompts in 4 chunks vs 1: relative L2 error {err:.3e}, argmax {agree}/{rows}"
    );
    assert!(err <= 0.2, "chunked prefill is far from one-step prefill: {err:.3e}");
}
