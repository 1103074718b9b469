//! The HIP backend's forward pass end to end. Needs an AMD GPU and the default model: runs
//! only with `TESSERA_HIP_TESTS=1` (skipped with a message otherwise) and has not run yet, no
//! AMD GPU being available when it was written.
//!
//! - SmolLM2-135M (Q4_1 dequantised to bf16) on the GPU against the CPU backend, teacher
//!   forced over llama.cpp's fixture prompts: top-1 agreement >= 95% (the bound the CUDA
//!   backend's test uses for the same bf16-vs-f32 comparison).
//! - A mixed step (a prefill chunk, a later chunk of another sequence and a decode) gives each
//!   sequence the logits it gets alone (relative error < 2e-2, as for CUDA).
//! - Bad batches are errors, and the model still runs a good one after them.
//!
//! Without the `hip` feature the one test here checks the loader's message.

mod common;

use tessera_model::bundle::ModelBundle;
use tessera_worker::batch::{LogitsWanted, SeqChunk};
use tessera_worker::cuda::CudaOptions;
use tessera_worker::hip::HipModel;
use tessera_worker::llama::LlamaModel;
use tessera_worker::sampling::argmax;
use tessera_worker::session::Session;

const BLOCK: usize = 16;

fn opts() -> CudaOptions {
    CudaOptions { num_blocks: Some(512), block_size: BLOCK, ..CudaOptions::default() }
}

fn enabled(test: &str) -> Option<ModelBundle> {
    if std::env::var("TESSERA_HIP_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped {test}: set TESSERA_HIP_TESTS=1 on a machine with an AMD GPU");
        return None;
    }
    let path = common::model_path::default_model().expect("TESSERA_HIP_TESTS=1 needs the default model");
    Some(ModelBundle::open(&path).expect("open the default model"))
}

fn table(first_block: u32, positions: usize) -> Vec<u32> {
    (first_block..first_block + positions.div_ceil(BLOCK) as u32).collect()
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

#[cfg(not(feature = "hip"))]
#[test]
fn without_the_feature_loading_says_hip_is_not_compiled() {
    let Some(path) = common::model_path::default_model() else {
        eprintln!("skipped without_the_feature_loading_says_hip_is_not_compiled: no default model");
        return;
    };
    let bundle = ModelBundle::open(&path).expect("open the default model");
    let msg = HipModel::load(&bundle.files, &opts()).err().map(|e| e.to_string()).unwrap_or_default();
    assert_eq!(msg, tessera_worker::hip::NOT_COMPILED);
}

#[test]
fn smollm2_on_hip_agrees_with_the_cpu_backend() {
    let Some(bundle) = enabled("smollm2_on_hip_agrees_with_the_cpu_backend") else { return };
    let mut gpu = HipModel::load(&bundle.files, &opts()).expect("load on the AMD GPU");
    let cpu = LlamaModel::load(bundle.files.clone()).expect("load on the CPU");
    let vocab = cpu.config.vocab_size;
    let (mut agree, mut total) = (0usize, 0usize);
    for case in common::llama_cpp_fixture::load_cases() {
        let mut input = case.prompt_ids.clone();
        input.extend_from_slice(&case.tokens[..case.tokens.len() - 1]);
        let t = table(0, input.len());
        let chunk = SeqChunk { tokens: &input, first_pos: 0, block_table: &t, logits: LogitsWanted::All };
        let g = gpu.forward(&[chunk]).expect("hip forward").data;
        let c = Session::new(&cpu, input.len() + 1).feed(&input, true).expect("cpu forward");
        assert_eq!(g.len(), c.len());
        assert!(g.iter().all(|v| v.is_finite()), "{}: non-finite logits", case.name);
        for r in case.prompt_ids.len() - 1..input.len() {
            let row = r * vocab..(r + 1) * vocab;
            agree += usize::from(argmax(&g[row.clone()]) == argmax(&c[row]));
            total += 1;
        }
    }
    let pct = 100.0 * agree as f64 / total.max(1) as f64;
    eprintln!("HIP vs CPU top-1: {agree}/{total} ({pct:.2}%)");
    assert!(pct >= 95.0, "HIP vs CPU top-1 {pct:.2}%");
}

#[test]
fn a_mixed_step_matches_each_sequence_alone() {
    let Some(bundle) = enabled("a_mixed_step_matches_each_sequence_alone") else { return };
    let mut m = HipModel::load(&bundle.files, &opts()).expect("load on the AMD GPU");
    let vocab = m.config().vocab_size;
    let prompts: Vec<Vec<u32>> =
        (0..3u32).map(|s| (0..40 + 13 * s).map(|i| (i * 7919 + s * 104729) % vocab as u32).collect()).collect();
    let tables: Vec<Vec<u32>> = (0..3).map(|s| table(s as u32 * 8, 128)).collect();
    // Alone: each sequence's last-row logits after its whole prompt (its own blocks).
    let alone: Vec<Vec<f32>> = (0..3)
        .map(|s| {
            let c = SeqChunk { tokens: &prompts[s], first_pos: 0, block_table: &tables[s], logits: LogitsWanted::Last };
            m.forward(&[c]).expect("alone").data
        })
        .collect();
    // Mixed, over fresh blocks: sequence 0's first 30 tokens are cached by an earlier step,
    // sequence 2 is cached up to its last token; then one step runs sequence 0's rest
    // (a later chunk), sequence 1 whole (a prefill) and sequence 2's last token (a decode).
    let fresh: Vec<Vec<u32>> = (0..3).map(|s| table(64 + s as u32 * 8, 128)).collect();
    let n2 = prompts[2].len();
    let warm = [
        SeqChunk { tokens: &prompts[0][..30], first_pos: 0, block_table: &fresh[0], logits: LogitsWanted::None },
        SeqChunk { tokens: &prompts[2][..n2 - 1], first_pos: 0, block_table: &fresh[2], logits: LogitsWanted::None },
    ];
    m.forward(&warm).expect("warm-up step");
    let step = [
        SeqChunk { tokens: &prompts[0][30..], first_pos: 30, block_table: &fresh[0], logits: LogitsWanted::Last },
        SeqChunk { tokens: &prompts[1], first_pos: 0, block_table: &fresh[1], logits: LogitsWanted::Last },
        SeqChunk {
            tokens: &prompts[2][n2 - 1..],
            first_pos: n2 - 1,
            block_table: &fresh[2],
            logits: LogitsWanted::Last,
        },
    ];
    let mixed = m.forward(&step).expect("mixed step");
    for (s, want) in alone.iter().enumerate() {
        let e = rel_err(mixed.chunk(s), want);
        eprintln!("sequence {s}: rel err {e:.2e}");
        assert!(e < 2e-2, "sequence {s}: rel err {e}");
    }
}

#[test]
fn bad_batches_are_errors_and_the_model_runs_on() {
    let Some(bundle) = enabled("bad_batches_are_errors_and_the_model_runs_on") else { return };
    let mut m = HipModel::load(&bundle.files, &opts()).expect("load on the AMD GPU");
    let vocab = m.config().vocab_size as u32;
    let t = table(0, 32);
    let bad_token = [vocab];
    let bad = SeqChunk { tokens: &bad_token, first_pos: 0, block_table: &t, logits: LogitsWanted::Last };
    assert!(m.forward(&[bad]).is_err());
    let short_table = [0u32];
    let ids = [1u32, 2, 3];
    let short = SeqChunk { tokens: &ids, first_pos: 15, block_table: &short_table, logits: LogitsWanted::Last };
    assert!(m.forward(&[short]).is_err());
    let ok = SeqChunk { tokens: &ids, first_pos: 0, block_table: &t, logits: LogitsWanted::Last };
    let out = m.forward(&[ok]).expect("a good batch after bad ones");
    assert_eq!(out.data.len(), vocab as usize);
    assert!(out.data.iter().all(|v| v.is_finite()));
}
