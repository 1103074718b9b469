//! `tessera bench --device cuda`: the GPU numbers of issue 4 on one model (a file, or a
//! `--synthetic` random-weight model of a real shape), in one run, as a markdown table:
//!
//! - the bf16 GEMM peak measured now (the model's gate|up shape at M = 4096), the
//!   denominator of the prefill fraction;
//! - prefill: one sequence of P random tokens in one step, tok/s and the fraction of that
//!   peak (matmul FLOPs plus causal attention FLOPs over the time);
//! - decode at B concurrent sequences (as llama-batched-bench: each with a `--decode-prompt`
//!   token prompt, then `--gen-tokens` steps of all B, greedy on the GPU): aggregate tok/s,
//!   and at B = 1 the MBU (bf16 bytes streamed per token / time / 4.8 TB/s);
//! - per decode step, the host time (index building and uploads, when the GPU has nothing
//!   to do; then the kernel launches, overlapping the GPU) against the step's wall time.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use tessera_kernels::cuda::bf16;
use tessera_model::weights::ModelFiles;
use tessera_worker::batch::{LogitsWanted, SeqChunk};
use tessera_worker::cuda::shapes::bf16_bytes_per_token;
use tessera_worker::cuda::{CudaModel, CudaOptions, GreedySampler};

use crate::bench::BenchArgs;

/// H200 HBM3e datasheet bandwidth, the MBU denominator ANCHORS.md uses.
const HBM_BYTES_PER_S: f64 = 4.8e12;
const BLOCK: usize = 16;

fn pseudo_random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % vocab as u64) as u32
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

pub fn run(args: &BenchArgs, ordinal: usize) -> Result<()> {
    let opts = CudaOptions { device: ordinal, block_size: BLOCK, ..CudaOptions::default() };
    let t0 = Instant::now();
    let (mut m, name) = match (&args.synthetic, &args.model) {
        (Some(shape), _) => (CudaModel::synthetic(shape, 42, &opts)?, format!("{shape} (synthetic bf16)")),
        (None, model) => {
            let path = crate::default_model::resolve(model.as_deref())?;
            let files = ModelFiles::open(&path).with_context(|| format!("opening {}", path.display()))?;
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            (CudaModel::load(&files, &opts)?, name)
        }
    };
    let c = m.config().clone();
    let bytes_per_token = bf16_bytes_per_token(&c) as f64;
    println!(
        "# {name} on {}: loaded in {:.1} s; {} KV blocks of {BLOCK}; {:.2} GB of bf16 weights per decoded token",
        m.device().name(),
        t0.elapsed().as_secs_f64(),
        m.num_blocks(),
        bytes_per_token / 1e9
    );
    println!();
    println!("| test | value | detail |");
    println!("|---|---|---|");

    let peak = gemm_peak(&m, &c)?;
    println!(
        "| bf16 GEMM peak (M=4096, {}x{}) | {:.0} TFLOP/s | cuBLASLt, this run |",
        2 * c.intermediate_size,
        c.hidden_size,
        peak / 1e12
    );

    let matmul_params = (bytes_per_token / 2.0) - (c.hidden_size as f64);
    for &p in &args.prompts {
        let tokens = pseudo_random_tokens(p, c.vocab_size, 7);
        let table: Vec<u32> = (0..p.div_ceil(BLOCK) as u32).collect();
        if table.len() > m.num_blocks() {
            bail!("prompt of {p} tokens does not fit the KV cache");
        }
        let chunk = SeqChunk { tokens: &tokens, first_pos: 0, block_table: &table, logits: LogitsWanted::Last };
        m.forward(&[chunk])?; // warm-up: GEMM plans, scratch
        let mut times = Vec::new();
        for _ in 0..args.repetitions.max(1) {
            let t = Instant::now();
            m.forward(&[chunk])?; // returns after the logits are on the host
            times.push(t.elapsed().as_secs_f64());
        }
        let s = median(times);
        let attn = 2.0 * 2.0 * (p as f64) * (p as f64 + 1.0) / 2.0 * (c.num_heads * c.head_dim * c.num_layers) as f64;
        let flops = 2.0 * matmul_params * p as f64 + attn;
        println!(
            "| prefill {p} tokens | {:.0} tok/s | {:.1} ms, {:.0} TFLOP/s = {:.0}% of the GEMM peak |",
            p as f64 / s,
            s * 1e3,
            flops / s / 1e12,
            100.0 * flops / s / peak
        );
    }

    for &b in &args.batches {
        decode_batch(&mut m, &c, b, args, bytes_per_token)?;
    }
    Ok(())
}

/// FLOP/s of the model's largest GEMM at M = 4096, median of 5 timings of 10 calls.
fn gemm_peak(m: &CudaModel, c: &tessera_model::config::ModelConfig) -> Result<f64> {
    let dev = m.device();
    let (mm, rows, cols) = (4096, 2 * c.intermediate_size, c.hidden_size);
    let mut x = dev.alloc::<bf16>(mm * cols)?;
    let mut w = dev.alloc::<bf16>(rows * cols)?;
    let mut out = dev.alloc::<bf16>(mm * rows)?;
    dev.fill_uniform(&mut x, 1, -1.0, 1.0)?;
    dev.fill_uniform(&mut w, 2, -0.05, 0.05)?;
    dev.matmul(&mut out, &x, mm, &w, rows, cols)?;
    let mut times = Vec::new();
    for _ in 0..5 {
        times.push(dev.time_ms(10, || dev.matmul(&mut out, &x, mm, &w, rows, cols))?);
    }
    Ok(2.0 * (mm * rows * cols) as f64 / (median(times) / 1e3))
}

/// `b` sequences: prefill their prompts (steps of at most 8192 tokens), then
/// `gen_tokens` decode steps of all of them with greedy sampling on the GPU.
fn decode_batch(
    m: &mut CudaModel,
    c: &tessera_model::config::ModelConfig,
    b: usize,
    args: &BenchArgs,
    bytes_per_token: f64,
) -> Result<()> {
    let (prompt, gen) = (args.decode_prompt, args.gen_tokens);
    let per_seq = (prompt + gen + 1).div_ceil(BLOCK);
    if per_seq * b > m.num_blocks() {
        println!("| decode, {b} sequences | skipped | needs {} KV blocks, {} exist |", per_seq * b, m.num_blocks());
        return Ok(());
    }
    let tables: Vec<Vec<u32>> = (0..b).map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect()).collect();
    let prompts: Vec<Vec<u32>> = (0..b).map(|i| pseudo_random_tokens(prompt, c.vocab_size, 100 + i as u64)).collect();
    let per_step = (8192 / prompt.max(1)).max(1);
    let mut next: Vec<u32> = Vec::with_capacity(b);
    for group in (0..b).collect::<Vec<_>>().chunks(per_step) {
        let chunks: Vec<SeqChunk> = group
            .iter()
            .map(|&i| SeqChunk {
                tokens: &prompts[i],
                first_pos: 0,
                block_table: &tables[i],
                logits: LogitsWanted::Last,
            })
            .collect();
        next.extend(greedy(m, &chunks, &mut None)?);
    }
    let mut sampler = None;
    let (mut wall, mut prep, mut enqueue, mut graphs) = (Vec::new(), Vec::new(), Vec::new(), 0);
    let t_all = Instant::now();
    for step in 0..gen {
        let t = Instant::now();
        let toks: Vec<[u32; 1]> = next.iter().map(|&x| [x]).collect();
        let chunks: Vec<SeqChunk> = (0..b)
            .map(|i| SeqChunk {
                tokens: &toks[i],
                first_pos: prompt + step,
                block_table: &tables[i],
                logits: LogitsWanted::Last,
            })
            .collect();
        next = greedy(m, &chunks, &mut sampler)?;
        let timing = m.last_step_timing();
        graphs += usize::from(timing.graph);
        wall.push(t.elapsed().as_secs_f64());
        prep.push(timing.prep.as_secs_f64());
        enqueue.push(timing.enqueue.as_secs_f64());
    }
    let total = t_all.elapsed().as_secs_f64();
    let tok_s = (b * gen) as f64 / total;
    let step = median(wall);
    let mbu =
        if b == 1 { format!(", MBU {:.0}%", 100.0 * bytes_per_token / step / HBM_BYTES_PER_S) } else { String::new() };
    println!(
        "| decode, {b} sequences ({prompt}+{gen}) | {tok_s:.0} tok/s | step {:.2} ms{mbu}; host per step: prep {:.0} µs (GPU idle) + launches {:.0} µs; {graphs}/{gen} steps from a CUDA graph |",
        step * 1e3,
        median(prep) * 1e6,
        median(enqueue) * 1e6
    );
    Ok(())
}

/// One step with greedy sampling on the GPU.
fn greedy(m: &mut CudaModel, chunks: &[SeqChunk], sampler: &mut Option<GreedySampler>) -> Result<Vec<u32>> {
    Ok(m.forward_greedy(chunks, sampler)?)
}
