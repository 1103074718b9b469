//! The CUDA backend end to end (needs a GPU: set `TESSERA_GPU_TESTS=1`; skipped otherwise).
//!
//! - SmolLM2-135M (the default model, Q4_1 dequantised to bf16) on the GPU against llama.cpp
//!   on the same bf16 weights (teacher-forced top-1, issue 4 asks >= 98%), against llama.cpp
//!   on the Q4_1 file and against the CPU backend.
//! - Batching: a mixed step (prefill chunks and decodes of several sequences) gives each
//!   sequence the logits it gets alone, and chunked prefill equals one-pass prefill.
//! - With `TESSERA_TORCH_REF=<dir>` (made by bench/gpu/torch_qwen3_ref.py on the device), a
//!   random-weight Qwen3 checkpoint's logits against PyTorch/transformers: relative error
//!   <= 1e-2 over all logits, and no row worse than PyTorch's own bf16 forward by > 25%.

mod common;

use common::llama_cpp_fixture::{load_cases, load_fixture, log_softmax_at, Case};

use tessera_model::bundle::ModelBundle;
use tessera_model::weights::ModelFiles;
use tessera_worker::batch::{LogitsWanted, SeqChunk};
use tessera_worker::cuda::{CudaModel, CudaOptions};
use tessera_worker::llama::LlamaModel;
use tessera_worker::sampling::argmax;
use tessera_worker::session::Session;

const BLOCK: usize = 16;
const BLOCKS: usize = 512;

fn enabled(test: &str) -> bool {
    let on = std::env::var("TESSERA_GPU_TESTS").as_deref() == Ok("1");
    if !on {
        eprintln!("skipped {test}: set TESSERA_GPU_TESTS=1 on a machine with a CUDA GPU");
    }
    on
}

fn opts() -> CudaOptions {
    CudaOptions { num_blocks: Some(BLOCKS), block_size: BLOCK, ..CudaOptions::default() }
}

fn table(first_block: u32, n: usize) -> Vec<u32> {
    (first_block..first_block + n.div_ceil(BLOCK) as u32).collect()
}

/// All logits of `tokens` run as one chunk from position 0 (blocks from `first_block`).
fn gpu_all_logits(m: &mut CudaModel, tokens: &[u32], first_block: u32) -> Vec<f32> {
    let t = table(first_block, tokens.len());
    let chunk = SeqChunk { tokens, first_pos: 0, block_table: &t, logits: LogitsWanted::All };
    m.forward(&[chunk]).expect("gpu forward").data
}

/// Teacher-forced agreement with one llama.cpp fixture.
struct Agreement {
    /// Positions where the GPU's top-1 is llama.cpp's token.
    with_llama: usize,
    /// Positions where the GPU's top-1 is the CPU backend's (when it was run).
    with_cpu: usize,
    positions: usize,
    /// Mean |GPU logprob - llama.cpp logprob| over llama.cpp's top-5 at every position.
    mean_lp_err: f64,
}

impl Agreement {
    /// Top-1 agreement with llama.cpp, percent.
    fn llama_pct(&self) -> f64 {
        100.0 * self.with_llama as f64 / self.positions as f64
    }

    /// Top-1 agreement with the CPU backend, percent.
    fn cpu_pct(&self) -> f64 {
        100.0 * self.with_cpu as f64 / self.positions as f64
    }
}

/// The GPU's logits over each case's prompt + llama.cpp's greedy tokens, against the
/// fixture's tokens and top-5 logprobs (end-of-generation tokens excluded from the argmax, as
/// the fixture was made with `ignore_eos`); with `cpu`, also against the CPU backend's top-1.
fn agreement(gpu: &mut CudaModel, cpu: Option<&LlamaModel>, cases: &[Case], eog: &[u32], vocab: usize) -> Agreement {
    let (mut with_llama, mut with_cpu, mut positions) = (0usize, 0usize, 0usize);
    let (mut lp_err, mut n_lp) = (0.0f64, 0usize);
    for case in cases {
        let mut input = case.prompt_ids.clone();
        input.extend_from_slice(&case.tokens[..case.tokens.len() - 1]);
        let g = gpu_all_logits(gpu, &input, 0);
        assert!(g.iter().all(|v| v.is_finite()), "{}: non-finite GPU logits", case.name);
        let c = cpu.map(|cpu| Session::new(cpu, input.len() + 1).feed(&input, true).expect("cpu forward"));
        let base = case.prompt_ids.len() - 1;
        let mut case_agree = 0;
        for (i, &want) in case.tokens.iter().enumerate() {
            let r = base + i;
            let mut gr = g[r * vocab..(r + 1) * vocab].to_vec();
            for &(id, lp) in &case.top5[i] {
                lp_err += (log_softmax_at(&gr, id) - lp).abs();
                n_lp += 1;
            }
            for &e in eog {
                gr[e as usize] = f32::NEG_INFINITY;
            }
            let top = argmax(&gr);
            case_agree += usize::from(top == want);
            if let Some(c) = &c {
                assert_eq!(g.len(), c.len());
                let mut cr = c[r * vocab..(r + 1) * vocab].to_vec();
                for &e in eog {
                    cr[e as usize] = f32::NEG_INFINITY;
                }
                with_cpu += usize::from(top == argmax(&cr));
            }
        }
        eprintln!("{}: GPU top-1 = llama.cpp at {case_agree}/{}", case.name, case.tokens.len());
        with_llama += case_agree;
        positions += case.tokens.len();
    }
    Agreement { with_llama, with_cpu, positions, mean_lp_err: lp_err / n_lp as f64 }
}

/// Two references. (1) llama.cpp on the bf16 GGUF that holds exactly the GPU's weights
/// (model/examples/gguf_bf16.rs made it from the default model; its fixture
/// smollm2_bf16_greedy.jsonl, KV cache in bf16 as here): the same weights and storage types
/// on both sides, so this measures the forward pass, and issue 4's >= 98% applies.
/// (2) llama.cpp on the Q4_1 file itself, whose CPU path also quantises every matmul input
/// to 8 bits (the GPU keeps bf16 activations), and the CPU backend, which follows that
/// path: close, not equal.
#[test]
fn smollm2_on_gpu_agrees_with_llama_cpp_and_the_cpu_backend() {
    if !enabled("smollm2_on_gpu_agrees_with_llama_cpp_and_the_cpu_backend") {
        return;
    }
    let Some(path) = common::model_path::default_model() else { panic!("TESSERA_GPU_TESTS=1 needs the default model") };
    let bundle = ModelBundle::open(&path).expect("open model");
    let eog = bundle.tokenizer.stop_token_ids().to_vec();
    let mut gpu = CudaModel::load(&bundle.files, &opts()).expect("load on GPU");
    let cpu = LlamaModel::load(bundle.files.clone()).expect("load on CPU");
    let vocab = cpu.config.vocab_size;

    let same = agreement(&mut gpu, None, &load_fixture("smollm2_bf16_greedy.jsonl"), &eog, vocab);
    eprintln!(
        "RESULT smollm2 gpu teacher-forced top-1 vs llama.cpp on the same bf16 weights: {}/{} = {:.2}%, mean |logprob - llama.cpp| {:.4}",
        same.with_llama,
        same.positions,
        same.llama_pct(),
        same.mean_lp_err
    );
    let q4 = agreement(&mut gpu, Some(&cpu), &load_cases(), &eog, vocab);
    eprintln!(
        "RESULT smollm2 gpu teacher-forced top-1 vs llama.cpp on the Q4_1 file (8-bit activations): {}/{} = {:.2}%, vs CPU backend {}/{} = {:.2}%, mean |logprob - llama.cpp| {:.4}",
        q4.with_llama,
        q4.positions,
        q4.llama_pct(),
        q4.with_cpu,
        q4.positions,
        q4.cpu_pct(),
        q4.mean_lp_err
    );
    assert!(same.llama_pct() >= 98.0, "GPU vs llama.cpp (bf16) top-1 {:.2}%", same.llama_pct());
    assert!(same.mean_lp_err < 0.1, "mean logprob deviation (bf16) {:.4}", same.mean_lp_err);
    assert!(q4.llama_pct() >= 95.0, "GPU vs llama.cpp (Q4_1) top-1 {:.2}%", q4.llama_pct());
    assert!(q4.cpu_pct() >= 95.0, "GPU vs CPU top-1 {:.2}%", q4.cpu_pct());
    assert!(q4.mean_lp_err < 0.15, "mean logprob deviation (Q4_1) {:.4}", q4.mean_lp_err);
}

/// Max |a - b| over max |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f64, |m, &v| m.max((v as f64).abs())).max(1e-6);
    a.iter().zip(b).fold(0f64, |m, (&x, &y)| m.max((x as f64 - y as f64).abs())) / scale
}

#[test]
fn mixed_batches_and_chunked_prefill_match_single_sequences() {
    if !enabled("mixed_batches_and_chunked_prefill_match_single_sequences") {
        return;
    }
    let Some(path) = common::model_path::default_model() else { panic!("TESSERA_GPU_TESTS=1 needs the default model") };
    let files = ModelFiles::open(&path).expect("open model");
    let mut m = CudaModel::load(&files, &opts()).expect("load on GPU");
    let vocab = m.config().vocab_size;
    let seqs: Vec<Vec<u32>> =
        (0..3u32).map(|s| (0..40 + 17 * s).map(|i| (i * 7919 + s * 104_729) % vocab as u32).collect()).collect();
    // Reference: each sequence alone, one pass, all logits (blocks 0.. reused per sequence).
    let alone: Vec<Vec<f32>> = seqs.iter().map(|s| gpu_all_logits(&mut m, s, 0)).collect();
    // Now the three together from disjoint blocks (100, 200, 300): step 1 prefills the
    // first 30 tokens of each; then sequence 0 decodes one token at a time while 1 and 2
    // prefill the rest in one chunk each, asking for all their logits.
    let tables: Vec<Vec<u32>> = (0..3).map(|i| table(100 * (i as u32 + 1), seqs[i].len())).collect();
    let first: Vec<SeqChunk> = (0..3)
        .map(|i| SeqChunk { tokens: &seqs[i][..30], first_pos: 0, block_table: &tables[i], logits: LogitsWanted::All })
        .collect();
    let l = m.forward(&first).expect("step 1");
    for (i, a) in alone.iter().enumerate() {
        let e = rel_err(l.chunk(i), &a[..30 * vocab]);
        assert!(e < 2e-2, "seq {i}, first chunk: rel err {e}");
    }
    let rest: Vec<SeqChunk> = vec![
        SeqChunk { tokens: &seqs[0][30..31], first_pos: 30, block_table: &tables[0], logits: LogitsWanted::Last },
        SeqChunk { tokens: &seqs[1][30..], first_pos: 30, block_table: &tables[1], logits: LogitsWanted::All },
        SeqChunk { tokens: &seqs[2][30..], first_pos: 30, block_table: &tables[2], logits: LogitsWanted::Last },
    ];
    let l = m.forward(&rest).expect("step 2");
    let e0 = rel_err(l.chunk(0), &alone[0][30 * vocab..31 * vocab]);
    let e1 = rel_err(l.chunk(1), &alone[1][30 * vocab..]);
    let n2 = seqs[2].len();
    let e2 = rel_err(l.chunk(2), &alone[2][(n2 - 1) * vocab..]);
    eprintln!("mixed step rel errors: {e0:.2e} {e1:.2e} {e2:.2e}");
    assert!(e0 < 2e-2 && e1 < 2e-2 && e2 < 2e-2, "mixed step: {e0} {e1} {e2}");
    // Pure decode steps (split-KV attention, replayed from the batch-1 CUDA graph). bf16
    // rounding differs between the one-token fused GEMVs and an M=40 GEMM (the fused ones
    // round x * gamma, not the normalised row), and over SmolLM2's 30 layers that reaches
    // 2.6e-2 on these random tokens (H200, 2026-12-03): the bound is the staggered test's
    // 5e-2 for "another batch shape"; attention over a wrong block or position moves the
    // logits by far more. The argmax may flip at a near-tie: our pick must be within 2e-2
    // of the scale of the reference's best logit.
    for p in 31..40 {
        let d = [SeqChunk {
            tokens: &seqs[0][p..p + 1],
            first_pos: p,
            block_table: &tables[0],
            logits: LogitsWanted::Last,
        }];
        let l = m.forward(&d).expect("decode");
        let e = rel_err(l.chunk(0), &alone[0][p * vocab..(p + 1) * vocab]);
        eprintln!("decode at {p}: rel err {e:.3e}");
        assert!(e < 5e-2, "decode at {p}: rel err {e}");
        let reference = &alone[0][p * vocab..(p + 1) * vocab];
        let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
        let best = reference[argmax(reference) as usize];
        let ours = reference[argmax(l.chunk(0)) as usize];
        assert!(best - ours <= 2e-2 * scale, "decode at {p}: picked a token {} below the best", best - ours);
    }
}

/// Decode batches replayed from the CUDA graphs while their sequences cross block
/// boundaries at different steps and change rows (the graph's block tables are updated by
/// the changed entries only): every step's logits equal those of a second model that runs
/// the same steps without graphs (its tables built whole each step), up to the split-KV
/// plan's rounding, and stay near each sequence's logits alone (bf16 noise of another
/// batch shape, ~2e-2; attention over a wrong block moves them by far more).
#[test]
fn staggered_decode_batches_keep_their_block_tables_on_the_gpu() {
    if !enabled("staggered_decode_batches_keep_their_block_tables_on_the_gpu") {
        return;
    }
    let Some(path) = common::model_path::default_model() else { panic!("TESSERA_GPU_TESTS=1 needs the default model") };
    let files = ModelFiles::open(&path).expect("open model");
    let mut m = CudaModel::load(&files, &opts()).expect("load on GPU");
    let mut eager = CudaModel::load(&files, &CudaOptions { graph_max_batch: 0, ..opts() }).expect("load on GPU");
    let vocab = m.config().vocab_size;
    let n = 4usize;
    let seqs: Vec<Vec<u32>> =
        (0..n as u32).map(|s| (0..70 + 5 * s).map(|i| (i * 6007 + s * 7907 + 13) % vocab as u32).collect()).collect();
    let alone: Vec<Vec<f32>> = seqs.iter().map(|s| gpu_all_logits(&mut m, s, 0)).collect();
    // Disjoint blocks from 100, 150, ...; prompts of 20, 25, 30, 35 tokens, so the
    // sequences reach each 16-position boundary at different steps.
    let tables: Vec<Vec<u32>> = (0..n).map(|i| table(100 + 50 * i as u32, seqs[i].len())).collect();
    let mut pos: Vec<usize> = (0..n).map(|i| 20 + 5 * i).collect();
    let prefill: Vec<SeqChunk> = (0..n)
        .map(|i| SeqChunk {
            tokens: &seqs[i][..pos[i]],
            first_pos: 0,
            block_table: &tables[i],
            logits: LogitsWanted::Last,
        })
        .collect();
    m.forward(&prefill).expect("prefill");
    eager.forward(&prefill).expect("prefill without graphs");
    let (mut step, mut worst, mut worst_eager, mut checked) = (0usize, 0f64, 0f64, 0usize);
    loop {
        // Live sequences, in an order that rotates every 7 steps (rows change sequences).
        let mut live: Vec<usize> = (0..n).filter(|&i| pos[i] < seqs[i].len()).collect();
        if live.is_empty() {
            break;
        }
        let turn = (step / 7) % live.len();
        live.rotate_left(turn);
        let chunks: Vec<SeqChunk> = live
            .iter()
            .map(|&i| SeqChunk {
                tokens: &seqs[i][pos[i]..pos[i] + 1],
                first_pos: pos[i],
                block_table: &tables[i],
                logits: LogitsWanted::Last,
            })
            .collect();
        let l = m.forward(&chunks).expect("decode step");
        assert!(m.last_step_timing().graph, "step {step} ran eagerly");
        let le = eager.forward(&chunks).expect("decode step without graphs");
        assert!(!eager.last_step_timing().graph);
        for (row, &i) in live.iter().enumerate() {
            let p = pos[i];
            let e = rel_err(l.chunk(row), le.chunk(row));
            assert!(e < 5e-3, "step {step}, sequence {i} at {p} (row {row}): graph vs eager rel err {e}");
            let a = rel_err(l.chunk(row), &alone[i][p * vocab..(p + 1) * vocab]);
            assert!(a < 5e-2, "step {step}, sequence {i} at {p} (row {row}): rel err {a} from its logits alone");
            worst_eager = worst_eager.max(e);
            worst = worst.max(a);
            checked += 1;
        }
        for &i in &live {
            pos[i] += 1;
        }
        step += 1;
    }
    eprintln!(
        "staggered graph decode: {checked} rows over {step} steps, worst rel err vs eager {worst_eager:.2e}, vs alone {worst:.2e}"
    );
}

#[test]
fn bad_batches_are_errors_not_crashes() {
    if !enabled("bad_batches_are_errors_not_crashes") {
        return;
    }
    let Some(path) = common::model_path::default_model() else { panic!("TESSERA_GPU_TESTS=1 needs the default model") };
    let files = ModelFiles::open(&path).expect("open model");
    let mut m = CudaModel::load(&files, &opts()).expect("load on GPU");
    let t = table(0, 4);
    let bad_token = [SeqChunk { tokens: &[u32::MAX], first_pos: 0, block_table: &t, logits: LogitsWanted::Last }];
    assert!(m.forward(&bad_token).is_err());
    let short = [SeqChunk { tokens: &[1; 40], first_pos: 0, block_table: &t, logits: LogitsWanted::Last }];
    assert!(m.forward(&short).is_err());
    let bad_block =
        [SeqChunk { tokens: &[1], first_pos: 0, block_table: &[BLOCKS as u32], logits: LogitsWanted::Last }];
    assert!(m.forward(&bad_block).is_err());
    // The model still works afterwards.
    let ok = [SeqChunk { tokens: &[1, 2, 3], first_pos: 0, block_table: &t, logits: LogitsWanted::Last }];
    assert!(m.forward(&ok).expect("good batch").data.iter().all(|v| v.is_finite()));
}

/// A decode step's chunks: row `r` runs sequence `ord[r]`'s token `toks[r]` at `pos(ord[r])`.
fn decode_rows<'a>(
    ord: &[usize],
    toks: &'a [[u32; 1]],
    tables: &'a [Vec<u32>],
    pos: impl Fn(usize) -> usize,
) -> Vec<SeqChunk<'a>> {
    ord.iter()
        .zip(toks)
        .map(|(&i, t)| SeqChunk { tokens: t, first_pos: pos(i), block_table: &tables[i], logits: LogitsWanted::Last })
        .collect()
}

/// The overlapped decode loop (`queue_sample` of step N+1 before step N's rows are read,
/// its chunks naming N's sampled rows): the same greedy tokens as steps run one at a time
/// on their host-side tokens, with graphs and eagerly, while the batch's row order rotates
/// (a chunk's row in the step before is not its row now) and one sequence runs its own
/// token. Then a row past the previous sampling, and a chunk of two tokens naming one, are
/// refused, and the model still decodes.
#[test]
fn overlapped_decode_takes_the_sampled_tokens_on_the_device() {
    use tessera_worker::cuda::{GpuSampler, RowRequest};
    if !enabled("overlapped_decode_takes_the_sampled_tokens_on_the_device") {
        return;
    }
    let Some(path) = common::model_path::default_model() else { panic!("TESSERA_GPU_TESTS=1 needs the default model") };
    let files = ModelFiles::open(&path).expect("open model");
    let (n, steps) = (4usize, 40usize);
    for graphs in [true, false] {
        let o = if graphs { opts() } else { CudaOptions { graph_max_batch: 0, ..opts() } };
        let mut m = CudaModel::load(&files, &o).expect("load on GPU");
        let vocab = m.config().vocab_size as u32;
        let prompts: Vec<Vec<u32>> =
            (0..n as u32).map(|s| (0..9 + 3 * s).map(|i| (i * 6007 + s * 7907 + 13) % vocab).collect()).collect();
        // Row order of step k: the sequences rotated by k / 3.
        let order = |k: usize| -> Vec<usize> { (0..n).map(|r| (r + k / 3) % n).collect() };
        let greedy = vec![RowRequest::greedy(); n];
        // Each run's own blocks: sequence i of run `run` from 64 (2 run + i).
        let tables = |run: u32| -> Vec<Vec<u32>> { (0..n as u32).map(|i| table(64 * (2 * run + i), 100)).collect() };
        let prefill = |m: &mut CudaModel, tables: &[Vec<u32>], sampler: &mut GpuSampler| -> Vec<u32> {
            let chunks: Vec<SeqChunk> = (0..n)
                .map(|i| SeqChunk {
                    tokens: &prompts[i],
                    first_pos: 0,
                    block_table: &tables[i],
                    logits: LogitsWanted::Last,
                })
                .collect();
            m.forward_greedy(&chunks, sampler).expect("prefill")
        };
        // One step at a time: out[i] is sequence i's generated tokens.
        let (t0, mut sampler) = (tables(0), GpuSampler::new());
        let mut want: Vec<Vec<u32>> = prefill(&mut m, &t0, &mut sampler).into_iter().map(|t| vec![t]).collect();
        for k in 0..steps {
            let ord = order(k);
            let toks: Vec<[u32; 1]> = ord.iter().map(|&i| [*want[i].last().unwrap()]).collect();
            let chunks = decode_rows(&ord, &toks, &t0, |i| prompts[i].len() + k);
            let got = m.forward_greedy(&chunks, &mut sampler).expect("decode step");
            assert_eq!(m.last_step_timing().graph, graphs);
            for (&i, t) in ord.iter().zip(got) {
                want[i].push(t);
            }
        }
        // Overlapped: step k queued before step k - 1's rows are read. Sequence 0 runs its
        // own (host) token, taken from the run above; the others name their row of k - 1.
        let (t1, mut sampler) = (tables(1), GpuSampler::new());
        let first = prefill(&mut m, &t1, &mut sampler);
        let mut got: Vec<Vec<u32>> = first.iter().map(|&t| vec![t]).collect();
        let mut pending = None;
        for (k, &own) in want[0][..steps].iter().enumerate() {
            let ord = order(k);
            let toks: Vec<[u32; 1]> = ord.iter().map(|&i| [if i == 0 { own } else { first[i] }]).collect();
            let from: Vec<Option<u32>> = match k {
                0 => Vec::new(),
                _ => {
                    let before = order(k - 1);
                    ord.iter().map(|&i| (i != 0).then(|| before.iter().position(|&j| j == i).unwrap() as u32)).collect()
                }
            };
            let chunks = decode_rows(&ord, &toks, &t1, |i| prompts[i].len() + k);
            let q = m.queue_sample(&chunks, &from, &greedy, &mut sampler).expect("queued decode step");
            if let Some((prev, q_prev)) = pending.replace((ord, q)) {
                let rows = m.finish_sample(q_prev, &mut sampler).expect("rows of the step before");
                for (&i, r) in prev.iter().zip(rows) {
                    got[i].push(r.expect("sampled").token);
                }
            }
        }
        let (prev, q) = pending.expect("a last step");
        for (&i, r) in prev.iter().zip(m.finish_sample(q, &mut sampler).expect("last rows")) {
            got[i].push(r.expect("sampled").token);
        }
        assert_eq!(got, want, "graphs {graphs}: overlapped vs one step at a time");
        eprintln!("overlapped decode (graphs {graphs}): {n} x {steps} tokens equal");

        // Refused: a row past the 4 sampled last, a 2-token chunk naming a row.
        let last: Vec<[u32; 1]> = (0..n).map(|i| [got[i][steps]]).collect();
        let chunks: Vec<SeqChunk> = (0..n)
            .map(|i| SeqChunk {
                tokens: &last[i],
                first_pos: prompts[i].len() + steps,
                block_table: &t1[i],
                logits: LogitsWanted::Last,
            })
            .collect();
        let past = vec![Some(n as u32); n];
        assert!(m.queue_sample(&chunks, &past, &greedy, &mut sampler).is_err(), "row {n} of {n}");
        let two = [last[0][0], last[0][0]];
        let long = [SeqChunk { tokens: &two, ..chunks[0] }];
        assert!(m.queue_sample(&long, &[Some(0)], &greedy[..1], &mut sampler).is_err(), "two tokens");
        // Still decodes: the sync step from the host's tokens gives finite, in-vocab ids.
        let ok = m.forward_greedy(&chunks, &mut sampler).expect("a good step after the refusals");
        assert!(ok.iter().all(|&t| t < vocab));
    }
}

/// bench/gpu/torch_qwen3_ref.py's output, the model loaded on the GPU.
struct TorchRef {
    tokens: Vec<u32>,
    /// transformers' f32 and bf16 logits, `[tokens, vocab]`.
    want: Vec<f32>,
    torch_bf16: Vec<f32>,
    m: CudaModel,
}

/// The PyTorch reference of `$TESSERA_TORCH_REF` (None, with a note, when it is not set).
fn torch_ref(test: &str) -> Option<TorchRef> {
    torch_ref_with(test, &opts())
}

/// [`torch_ref`] with the o and down GEMMs split (the threshold at 0: the engine splits
/// only 8B-sized weights), asserted to split.
fn torch_ref_split(test: &str) -> Option<TorchRef> {
    let r = torch_ref_with(test, &CudaOptions { split_min_weight: Some(0), ..opts() })?;
    assert!(r.m.splits_gemms(), "{test}: split_min_weight 0 did not make the model split its GEMMs");
    Some(r)
}

/// [`torch_ref`] with the model loaded with `options`.
fn torch_ref_with(test: &str, options: &CudaOptions) -> Option<TorchRef> {
    let Ok(dir) = std::env::var("TESSERA_TORCH_REF") else {
        eprintln!("skipped {test}: set TESSERA_TORCH_REF (see bench/gpu/run.sh)");
        return None;
    };
    let dir = std::path::PathBuf::from(dir);
    let tokens: Vec<u32> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokens.json")).expect("tokens.json")).unwrap();
    let f32s = |name: &str| -> Vec<f32> {
        let bytes = std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    };
    let (want, torch_bf16) = (f32s("logits.f32"), f32s("logits_bf16.f32"));
    let files = ModelFiles::open(&dir.join("model")).expect("open HF dir");
    let m = CudaModel::load(&files, options).expect("load on GPU");
    Some(TorchRef { tokens, want, torch_bf16, m })
}

/// A random-weight Qwen3 checkpoint against PyTorch: `$TESSERA_TORCH_REF` holds the HF
/// directory (`model/`), the token ids (`tokens.json`) and transformers' f32 logits of
/// them (`logits.f32`, `[tokens, vocab]` little-endian), made by
/// bench/gpu/torch_qwen3_ref.py.
#[test]
fn random_qwen3_matches_pytorch() {
    let Some(TorchRef { tokens, want, torch_bf16, mut m }) = torch_ref("random_qwen3_matches_pytorch") else { return };
    assert!(!m.splits_gemms(), "this model's GEMMs are below the split threshold");
    let got = gpu_all_logits(&mut m, &tokens, 0);
    assert_eq!(got.len(), want.len());
    let vocab = m.config().vocab_size;
    let (ours, ours_worst, top1) = errors(&got, &want, vocab);
    let (theirs, theirs_worst, _) = errors(&torch_bf16, &want, vocab);
    eprintln!(
        "RESULT qwen3 vs pytorch f32: relative L2 error {ours:.3e} (worst row {ours_worst:.3e}), top-1 equal {top1}/{}; \
         pytorch's own bf16 forward: {theirs:.3e} (worst row {theirs_worst:.3e})",
        tokens.len()
    );
    assert!(ours <= 1e-2, "relative error {ours:.3e} > 1e-2");
    assert!(ours_worst <= 1.25 * theirs_worst.max(1e-2), "worst row {ours_worst:.3e} vs torch bf16 {theirs_worst:.3e}");
}

/// The same prefill with the o and down GEMMs split in two (f32 partials summed by the
/// norm after them; the engine splits only 8B-sized weights, so the test lowers the
/// threshold for this model's 1024 x 2048 and 1024 x 3072 through `split_min_weight`): the
/// same bounds against PyTorch.
#[test]
fn random_qwen3_with_split_gemms_matches_pytorch() {
    let Some(TorchRef { tokens, want, torch_bf16, mut m }) =
        torch_ref_split("random_qwen3_with_split_gemms_matches_pytorch")
    else {
        return;
    };
    let got = gpu_all_logits(&mut m, &tokens, 0);
    let vocab = m.config().vocab_size;
    let (ours, ours_worst, top1) = errors(&got, &want, vocab);
    let (_, theirs_worst, _) = errors(&torch_bf16, &want, vocab);
    eprintln!(
        "RESULT qwen3 with split GEMMs vs pytorch f32: relative L2 error {ours:.3e} (worst row {ours_worst:.3e}), \
         top-1 equal {top1}/{}",
        tokens.len()
    );
    assert!(ours <= 1e-2, "relative error {ours:.3e} > 1e-2");
    assert!(ours_worst <= 1.25 * theirs_worst.max(1e-2), "worst row {ours_worst:.3e} vs torch bf16 {theirs_worst:.3e}");
}

/// The decode path against PyTorch: the steps of one and two single-token sequences (the
/// fused GEMVs: norms, SwiGLU and residual adds inside the GEMVs; split-KV attention; a CUDA
/// graph) give the logits of transformers' forward at the same positions, as the prefill
/// above does. The random Qwen3 is prefilled to 192 tokens twice (blocks 0.. and 100..);
/// each copy then decodes 4 tokens alone, and both decode the last 4 together.
#[test]
fn random_qwen3_decode_steps_match_pytorch() {
    let Some(TorchRef { tokens, want, torch_bf16, mut m }) = torch_ref("random_qwen3_decode_steps_match_pytorch")
    else {
        return;
    };
    let vocab = m.config().vocab_size;
    let n = tokens.len();
    assert!(n >= 200, "the reference has {n} tokens, 200 expected");
    let pre = n - 8;
    let tables = [table(0, n), table(100, n)];
    let prefill: Vec<SeqChunk> = tables
        .iter()
        .map(|t| SeqChunk { tokens: &tokens[..pre], first_pos: 0, block_table: t, logits: LogitsWanted::Last })
        .collect();
    m.forward(&prefill).expect("prefill");
    let step = |m: &mut CudaModel, seqs: &[usize], p: usize| -> Vec<Vec<f32>> {
        let chunks: Vec<SeqChunk> = seqs
            .iter()
            .map(|&i| SeqChunk {
                tokens: &tokens[p..p + 1],
                first_pos: p,
                block_table: &tables[i],
                logits: LogitsWanted::Last,
            })
            .collect();
        let l = m.forward(&chunks).expect("decode step");
        (0..seqs.len()).map(|i| l.chunk(i).to_vec()).collect()
    };
    // (position, logits) of every decoded token.
    let mut got: Vec<(usize, Vec<f32>)> = Vec::new();
    for i in 0..2 {
        for p in pre..pre + 4 {
            got.extend(step(&mut m, &[i], p).into_iter().map(|l| (p, l)));
        }
    }
    for p in pre + 4..n {
        got.extend(step(&mut m, &[0, 1], p).into_iter().map(|l| (p, l)));
    }
    let rows =
        |src: &[f32]| -> Vec<f32> { got.iter().flat_map(|(p, _)| src[p * vocab..(p + 1) * vocab].to_vec()).collect() };
    let ours: Vec<f32> = got.iter().flat_map(|(_, l)| l.iter().copied()).collect();
    let (want, torch_bf16) = (rows(&want), rows(&torch_bf16));
    let (err, worst, top1) = errors(&ours, &want, vocab);
    let (_, theirs_worst, _) = errors(&torch_bf16, &want, vocab);
    eprintln!(
        "RESULT qwen3 decode steps vs pytorch f32: relative L2 error {err:.3e} (worst row {worst:.3e}), top-1 equal \
         {top1}/{}; pytorch's own bf16 forward on those rows: worst {theirs_worst:.3e}",
        got.len()
    );
    assert!(err <= 1e-2, "relative error {err:.3e} > 1e-2");
    assert!(worst <= 1.25 * theirs_worst.max(1e-2), "worst row {worst:.3e} vs torch bf16 {theirs_worst:.3e}");
}

/// The split GEMMs on the decode path against PyTorch: 16 copies of the random Qwen3's
/// sequence (the threshold at 0, so its o and down split) prefilled to 192 tokens in one
/// step, then 8 decode steps of all 16, replayed from the 16-sequence CUDA graph (unfused:
/// cuBLASLt GEMMs, the split o and down, add_parts_rms_norm). Every row against transformers'
/// logits at its position, the prefill test's bounds (H200, 2026-12-03: 9.783e-3, 128/128
/// top-1; bench/RESULTS.md).
#[test]
fn random_qwen3_split_decode_graph_matches_pytorch() {
    let Some(TorchRef { tokens, want, torch_bf16, mut m }) =
        torch_ref_split("random_qwen3_split_decode_graph_matches_pytorch")
    else {
        return;
    };
    let vocab = m.config().vocab_size;
    let n = tokens.len();
    assert!(n >= 200, "the reference has {n} tokens, 200 expected");
    let (copies, pre) = (16u32, n - 8);
    let tables: Vec<Vec<u32>> = (0..copies).map(|i| table(i * 16, n)).collect();
    let prefill: Vec<SeqChunk> = tables
        .iter()
        .map(|t| SeqChunk { tokens: &tokens[..pre], first_pos: 0, block_table: t, logits: LogitsWanted::Last })
        .collect();
    m.forward(&prefill).expect("prefill");
    let (mut ours, mut rows) = (Vec::new(), Vec::new());
    for p in pre..n {
        let chunks: Vec<SeqChunk> = tables
            .iter()
            .map(|t| SeqChunk { tokens: &tokens[p..p + 1], first_pos: p, block_table: t, logits: LogitsWanted::Last })
            .collect();
        let l = m.forward(&chunks).expect("decode step");
        assert!(m.last_step_timing().graph, "the 16-sequence step at {p} ran eagerly");
        for i in 0..chunks.len() {
            ours.extend_from_slice(l.chunk(i));
            rows.push(p);
        }
    }
    let pick =
        |src: &[f32]| -> Vec<f32> { rows.iter().flat_map(|&p| src[p * vocab..(p + 1) * vocab].to_vec()).collect() };
    let (want, torch_bf16) = (pick(&want), pick(&torch_bf16));
    let (err, worst, top1) = errors(&ours, &want, vocab);
    let (_, theirs_worst, _) = errors(&torch_bf16, &want, vocab);
    eprintln!(
        "RESULT qwen3 split decode graph (16 sequences) vs pytorch f32: relative L2 error {err:.3e} (worst row \
         {worst:.3e}), top-1 equal {top1}/{}; pytorch's own bf16 forward on those rows: worst {theirs_worst:.3e}",
        rows.len()
    );
    assert!(err <= 1e-2, "relative error {err:.3e} > 1e-2");
    assert!(worst <= 1.25 * theirs_worst.max(1e-2), "worst row {worst:.3e} vs torch bf16 {theirs_worst:.3e}");
}

/// (relative L2 error over all logits, worst row's relative L2 error, rows whose argmax
/// agrees) of `got` against `want`, both `[rows, vocab]`.
fn errors(got: &[f32], want: &[f32], vocab: usize) -> (f64, f64, usize) {
    let (mut num_all, mut den_all, mut worst, mut top1) = (0f64, 0f64, 0f64, 0);
    for (g, w) in got.chunks(vocab).zip(want.chunks(vocab)) {
        let num: f64 = g.iter().zip(w).map(|(&a, &b)| (a as f64 - b as f64).powi(2)).sum();
        let den: f64 = w.iter().map(|&b| (b as f64).powi(2)).sum();
        worst = worst.max((num / den.max(1e-30)).sqrt());
        num_all += num;
        den_all += den;
        top1 += usize::from(argmax(g) == argmax(w));
    }
    ((num_all / den_all.max(1e-30)).sqrt(), worst, top1)
}

/// The default model twice on the GPU: a model to run reference forwards on, and an
/// executor over the other.
fn reference_and_executor() -> (CudaModel, tessera_worker::executor::Executor) {
    use tessera_worker::backend::Backend;
    let Some(path) = common::model_path::default_model() else { panic!("TESSERA_GPU_TESTS=1 needs the default model") };
    let files = ModelFiles::open(&path).expect("open model");
    let reference = CudaModel::load(&files, &opts()).expect("load on GPU");
    let ex =
        tessera_worker::executor::Executor::new(Backend::cuda(CudaModel::load(&files, &opts()).expect("load on GPU")));
    (reference, ex)
}

/// A new sequence with `params` and 64 positions of blocks from `first_block`.
fn new_seq(
    id: u64,
    params: tessera_worker::sampling::SamplingParams,
    first_block: u32,
) -> tessera_worker::executor::NewSequence {
    tessera_worker::executor::NewSequence {
        seq_id: id,
        params,
        block_table: table(first_block, 64),
        cached_tokens: Vec::new(),
        num_generated: 0,
    }
}

/// `Executor::start` queues a lookahead step behind the pending one (its tokens taken on the
/// GPU) when it can, and completes the pending one first when it cannot: the same tokens as
/// `step` one at a time, for a greedy sequence, a seeded temperature-sampled one (its draw
/// counts the pending step's) and, joining at step 5 and finished at step 10, one with a
/// repetition penalty (which needs the pending step's token on the host: no queueing behind
/// while it runs).
#[test]
fn executor_queues_lookahead_steps_behind_the_pending_one() {
    use std::collections::HashMap;
    use tessera_worker::executor::{Run, StepInput, StepOutput};
    use tessera_worker::sampling::SamplingParams;
    if !enabled("executor_queues_lookahead_steps_behind_the_pending_one") {
        return;
    }
    let (_, mut pipelined) = reference_and_executor();
    let (_, mut one_by_one) = reference_and_executor();
    let params = |id: u64| match id {
        1 => SamplingParams::greedy(),
        2 => SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(7), ..SamplingParams::default() },
        _ => SamplingParams { temperature: 0.0, repetition_penalty: 1.3, ..SamplingParams::default() },
    };
    let prompt = |id: u64| -> Vec<u32> { (0..8 + 3 * id as u32).map(|i| 200 + 53 * i + 11 * id as u32).collect() };
    let steps = 16usize;
    // Step k's input: sequences 1 and 2 from step 0, sequence 3 from step 5 to 9.
    let input = |k: usize| -> StepInput {
        let mut x = StepInput::default();
        let prefill =
            |id: u64| Run { seq_id: id, tokens: prompt(id), first_pos: 0, sample: true, from_previous: false };
        let decode = |id: u64, since: usize| Run {
            seq_id: id,
            tokens: Vec::new(),
            first_pos: prompt(id).len() + k - since - 1,
            sample: true,
            from_previous: true,
        };
        for id in [1u64, 2] {
            if k == 0 {
                x.new_sequences.push(new_seq(id, params(id), 64 * id as u32));
                x.runs.push(prefill(id));
            } else {
                x.runs.push(decode(id, 0));
            }
        }
        match k {
            5 => {
                x.new_sequences.push(new_seq(3, params(3), 192));
                x.runs.push(prefill(3));
            }
            6..=9 => x.runs.push(decode(3, 5)),
            10 => x.finished.push(3),
            _ => {}
        }
        x
    };
    let mut want: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
    let keep = |to: &mut HashMap<u64, Vec<u32>>, out: StepOutput| {
        assert!(out.errors.is_empty(), "{:?}", out.errors);
        for (id, s) in out.sampled {
            to.entry(id).or_default().push(s.token);
        }
    };
    let mut behind = Vec::new();
    for k in 0..steps {
        keep(&mut want, one_by_one.step(input(k)).expect("step one at a time"));
        let started = pipelined.start(input(k));
        behind.push(started.queued_behind);
        if let Some(prev) = started.previous {
            keep(&mut got, prev.expect("the step before"));
        }
        if let Some(out) = started.this.expect("started") {
            keep(&mut got, out);
        }
    }
    assert!(pipelined.step(StepInput::default()).is_err(), "step while a step is pending");
    keep(&mut got, pipelined.complete().expect("a pending step").expect("the last step"));
    assert!(pipelined.complete().is_none(), "nothing pending after");
    assert_eq!(got, want, "queued behind vs one at a time");
    // Queued behind at every decode step but while sequence 3 decodes (6-9) and when it is
    // finished (10: the pending step ran it).
    let expect: Vec<bool> = (0..steps).map(|k| k >= 1 && !(6..=10).contains(&k)).collect();
    assert_eq!(behind, expect, "which steps were queued behind the pending one");
    eprintln!("executor lookahead queueing: {:?} tokens equal", got.values().map(Vec::len).collect::<Vec<_>>());
}

/// The executor on the CUDA backend samples on the GPU: greedy tokens and top-5 logprobs
/// equal what the downloaded logits give, and seeded sampling replays.
#[test]
fn executor_samples_on_the_gpu() {
    use tessera_worker::executor::{Run, StepInput};
    use tessera_worker::sampling::SamplingParams;
    if !enabled("executor_samples_on_the_gpu") {
        return;
    }
    let (mut reference, mut ex) = reference_and_executor();
    let prompt: Vec<u32> = (0..12).map(|i| 100 + 37 * i).collect();

    // Greedy with logprobs against the reference logits.
    let greedy = SamplingParams { logprobs: Some(5), ..SamplingParams::greedy() };
    let new = new_seq;
    let out = ex
        .step(StepInput {
            new_sequences: vec![new(1, greedy.clone(), 0)],
            runs: vec![Run { seq_id: 1, tokens: prompt.clone(), first_pos: 0, sample: true, from_previous: false }],
            ..Default::default()
        })
        .expect("step");
    let s = &out.sampled[0].1;
    let t = table(10, 64);
    let row = reference
        .forward(&[SeqChunk { tokens: &prompt, first_pos: 0, block_table: &t, logits: LogitsWanted::Last }])
        .expect("reference")
        .data;
    assert_eq!(s.token, argmax(&row), "greedy token");
    assert!(
        (s.logprob as f64 - log_softmax_at(&row, s.token)).abs() < 1e-3,
        "logprob {} vs {}",
        s.logprob,
        log_softmax_at(&row, s.token)
    );
    assert_eq!(s.top.len(), 5);
    for w in s.top.windows(2) {
        assert!(w[0].1 >= w[1].1, "top logprobs sorted");
    }
    for &(id, lp) in &s.top {
        assert!((lp as f64 - log_softmax_at(&row, id)).abs() < 1e-3, "top token {id}");
    }

    // Two sequences with one seed in one batch draw the same tokens; another seed differs.
    let sampled =
        |seed: u64| SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(seed), ..SamplingParams::default() };
    let mut toks: [Vec<u32>; 3] = Default::default();
    let mut last = [0u32; 3];
    for step in 0..12usize {
        let mut input = StepInput::default();
        if step == 0 {
            input.new_sequences = vec![new(10, sampled(7), 20), new(11, sampled(7), 30), new(12, sampled(8), 40)];
        }
        for (k, id) in [10u64, 11, 12].into_iter().enumerate() {
            let (tokens, first_pos) =
                if step == 0 { (prompt.clone(), 0) } else { (vec![last[k]], prompt.len() + step - 1) };
            input.runs.push(Run { seq_id: id, tokens, first_pos, sample: true, from_previous: false });
        }
        let out = ex.step(input).expect("sampling step");
        for (k, (_, s)) in out.sampled.iter().enumerate() {
            last[k] = s.token;
            toks[k].push(s.token);
        }
    }
    eprintln!("seeded draws: {:?} / {:?} / {:?}", toks[0], toks[1], toks[2]);
    assert_eq!(toks[0], toks[1], "same seed, same tokens");
    assert_ne!(toks[0], toks[2], "another seed, other tokens");
}

/// Steps the scheduler sends that sample nothing or not every chunk, on the GPU: a prefill
/// chunk that does not end its prompt, alone (no row to sample), and a one-token such chunk
/// beside a decode (a batch of one-token chunks, which the decode graphs would take if
/// every chunk wanted a row). The prompt finished later, and the decode, give the tokens a
/// single whole-prompt forward gives.
#[test]
fn steps_with_unsampled_chunks_run_on_the_gpu() {
    use tessera_worker::executor::{Run, StepInput};
    use tessera_worker::sampling::SamplingParams;
    if !enabled("steps_with_unsampled_chunks_run_on_the_gpu") {
        return;
    }
    let (mut reference, mut ex) = reference_and_executor();
    let a: Vec<u32> = (0..12).map(|i| 200 + 41 * i).collect();
    let c: Vec<u32> = (0..6).map(|i| 300 + 17 * i).collect();
    let greedy_last = |m: &mut CudaModel, tokens: &[u32]| {
        let t = table(40, tokens.len());
        let chunk = SeqChunk { tokens, first_pos: 0, block_table: &t, logits: LogitsWanted::Last };
        argmax(&m.forward(&[chunk]).expect("reference").data)
    };
    let new = |id: u64, first_block: u32| new_seq(id, SamplingParams::greedy(), first_block);
    let run = |seq_id, tokens: &[u32], first_pos, sample| Run {
        seq_id,
        tokens: tokens.to_vec(),
        first_pos,
        sample,
        from_previous: false,
    };
    // C's prompt, sampled; A's first 8 tokens alone, nothing to sample.
    let out = ex
        .step(StepInput { new_sequences: vec![new(3, 20)], runs: vec![run(3, &c, 0, true)], ..Default::default() })
        .expect("C's prompt");
    let c_next = out.sampled[0].1.token;
    assert_eq!(c_next, greedy_last(&mut reference, &c));
    let out = ex
        .step(StepInput { new_sequences: vec![new(1, 0)], runs: vec![run(1, &a[..8], 0, false)], ..Default::default() })
        .expect("a step with no row to sample");
    assert!(out.sampled.is_empty() && out.errors.is_empty());
    // One token of A (no row) beside C's decode (one row).
    let out = ex
        .step(StepInput { runs: vec![run(1, &a[8..9], 8, false), run(3, &[c_next], 6, true)], ..Default::default() })
        .expect("one-token chunks, one of them unsampled");
    assert_eq!(out.sampled.len(), 1);
    let mut c_all = c.clone();
    c_all.push(c_next);
    assert_eq!(out.sampled[0].1.token, greedy_last(&mut reference, &c_all), "C's decode");
    // The rest of A's prompt: its first token is what the whole prompt gives.
    let out =
        ex.step(StepInput { runs: vec![run(1, &a[9..], 9, true)], ..Default::default() }).expect("A's last chunk");
    assert_eq!(out.sampled[0].1.token, greedy_last(&mut reference, &a), "A after three chunks");
}

/// A row the GPU sampler cannot take (a logit-bias token past the vocabulary) fails its
/// own sequence, as on the CPU; the other sequence of the step gets its greedy token and
/// goes on decoding.
#[test]
fn a_bad_sampling_row_fails_only_its_sequence_on_the_gpu() {
    use tessera_worker::executor::{Run, StepInput};
    use tessera_worker::sampling::SamplingParams;
    if !enabled("a_bad_sampling_row_fails_only_its_sequence_on_the_gpu") {
        return;
    }
    let (mut reference, mut ex) = reference_and_executor();
    let vocab = reference.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..9).map(|i| 200 + 41 * i).collect();
    let bad = SamplingParams { logit_bias: vec![(vocab + 5, 1.0)], ..SamplingParams::greedy() };
    let run =
        |id, tokens: Vec<u32>, first_pos| Run { seq_id: id, tokens, first_pos, sample: true, from_previous: false };
    let out = ex
        .step(StepInput {
            new_sequences: vec![new_seq(1, bad, 0), new_seq(2, SamplingParams::greedy(), 10)],
            runs: vec![run(1, prompt.clone(), 0), run(2, prompt.clone(), 0)],
            ..Default::default()
        })
        .expect("the step goes on without the bad row");
    assert_eq!(out.errors.len(), 1, "{:?}", out.errors);
    assert_eq!(out.errors[0].0, 1);
    assert!(out.errors[0].1.contains("outside the vocabulary"), "{}", out.errors[0].1);
    assert_eq!(out.sampled.len(), 1);
    assert_eq!(out.sampled[0].0, 2);
    let t = table(20, 64);
    let row = reference
        .forward(&[SeqChunk { tokens: &prompt, first_pos: 0, block_table: &t, logits: LogitsWanted::Last }])
        .expect("reference")
        .data;
    let first = out.sampled[0].1.token;
    assert_eq!(first, argmax(&row), "the good sequence's greedy token");
    let out = ex
        .step(StepInput { finished: vec![1], runs: vec![run(2, vec![first], prompt.len())], ..Default::default() })
        .expect("next step");
    assert!(out.errors.is_empty() && out.sampled.len() == 1, "{:?}", out.errors);
}

/// vLLM's `min_tokens` on the GPU sampler (the ban rides on the bias entries as -inf): a stop
/// id forced by a +100 bias is not sampled before the sequence has `min_tokens` output
/// tokens, and is from then on; greedy, with logprobs (never a banned id among the top ones)
/// and sampled. A random-weight SmolLM2 shape, so no model file is needed.
#[test]
fn min_tokens_bans_the_stop_ids_on_the_gpu() {
    use tessera_worker::backend::Backend;
    use tessera_worker::executor::{Executor, Run, StepInput};
    use tessera_worker::sampling::SamplingParams;
    if !enabled("min_tokens_bans_the_stop_ids_on_the_gpu") {
        return;
    }
    let model = CudaModel::synthetic("smollm2-135m", 7, &opts()).expect("synthetic model on the GPU");
    let mut ex = Executor::new(Backend::cuda(model));
    let (stop, other) = (2u32, 9u32);
    let with = |base: SamplingParams| SamplingParams {
        logit_bias: vec![(stop, 100.0)],
        min_tokens: 3,
        min_tokens_stop_ids: vec![stop, other],
        ..base
    };
    let cases = [
        ("greedy", with(SamplingParams::greedy())),
        ("logprobs", with(SamplingParams { logprobs: Some(5), ..SamplingParams::greedy() })),
        ("sampled", with(SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(3), ..SamplingParams::default() })),
    ];
    let prompt: Vec<u32> = (0..10).map(|i| 100 + 37 * i).collect();
    for (k, (label, params)) in cases.into_iter().enumerate() {
        let id = k as u64 + 1;
        let new = new_seq(id, params, 10 * k as u32);
        let first = Run { seq_id: id, tokens: prompt.clone(), first_pos: 0, sample: true, from_previous: false };
        let mut input = StepInput { new_sequences: vec![new], runs: vec![first], ..Default::default() };
        let mut got = Vec::new();
        for step in 0..5 {
            let out = ex.step(input).expect("step");
            assert!(out.errors.is_empty(), "{label}: {:?}", out.errors);
            let s = &out.sampled[0].1;
            if step < 3 {
                assert!(s.top.iter().all(|&(t, lp)| t != stop && t != other && lp.is_finite()), "{label}: {:?}", s.top);
            }
            got.push(s.token);
            let run = Run {
                seq_id: id,
                tokens: vec![s.token],
                first_pos: prompt.len() + step,
                sample: true,
                from_previous: false,
            };
            input = StepInput { runs: vec![run], ..Default::default() };
        }
        eprintln!("{label}: {got:?}");
        assert!(got[..3].iter().all(|&t| t != stop && t != other), "{label}: a stop id before 3 tokens: {got:?}");
        assert_eq!(got[3..], [stop, stop], "{label}: {got:?}");
        ex.step(StepInput { finished: vec![id], ..Default::default() }).expect("finish");
    }
}

/// The GPU sampler across steps whose requests change and come back (a bias on, off, on
/// again; logprobs asked for, then not): its inputs are uploaded only when they change and
/// its outputs read back through page-locked staging, so each step must still see its own
/// requests. Expected tokens and top-3 ids from the logits on the host.
#[test]
fn gpu_sampler_follows_changing_requests() {
    use tessera_kernels::cuda::Device;
    use tessera_worker::cuda::{GpuSampler, RowRequest};
    if !enabled("gpu_sampler_follows_changing_requests") {
        return;
    }
    let (vocab, rows) = (1000usize, 3usize);
    let dev = Device::new(0).unwrap();
    // Distinct pseudo-random logits: 7919 is invertible mod the prime 4093 and every index
    // is below 4093, so no two values are equal (no argmax or top-3 ties).
    let logits: Vec<f32> = (0..vocab * rows).map(|i| ((i * 7919 + 13) % 4093) as f32 / 409.3 - 5.0).collect();
    let best = |r: usize| argmax(&logits[r * vocab..(r + 1) * vocab]) as u32;
    let top3 = |r: usize| {
        let mut ids: Vec<u32> = (0..vocab as u32).collect();
        ids.sort_by(|&a, &b| logits[r * vocab + b as usize].total_cmp(&logits[r * vocab + a as usize]));
        ids[..3].to_vec()
    };
    // A token of row 0 that is not its argmax, lifted to the top by its bias.
    let lifted = (best(0) + 1) % vocab as u32;
    let greedy = || vec![RowRequest::greedy(); rows];
    let biased = || {
        let mut r = greedy();
        r[0].bias = vec![(lifted, 1000.0)];
        r
    };
    let with_logprobs = || {
        let mut r = greedy();
        r[1].params.n_logprobs = 3;
        r
    };
    let steps = [greedy(), biased(), greedy(), greedy(), with_logprobs(), greedy(), biased(), biased()];
    let mut sampler = GpuSampler::new();
    let mut buf = dev.upload(&logits).unwrap();
    for (i, requests) in steps.iter().enumerate() {
        dev.write_at(&mut buf, 0, &logits).unwrap(); // the sampler adjusts the logits in place
        let got = sampler.sample(&dev, &mut buf, vocab, requests).unwrap();
        assert_eq!(got.len(), rows, "step {i}");
        for (r, (req, row)) in requests.iter().zip(&got).enumerate() {
            let row = row.as_ref().unwrap();
            let want = if req.bias.is_empty() { best(r) } else { lifted };
            assert_eq!(row.token, want, "step {i} row {r}");
            let ids: Vec<u32> = row.top.iter().map(|t| t.0).collect();
            let want_top = if req.params.n_logprobs == 3 { top3(r) } else { Vec::new() };
            assert_eq!(ids, want_top, "step {i} row {r}: top logprobs");
        }
    }
}
