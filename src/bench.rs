//! `tessera bench`: prefill and decode speed of the CPU engine on one sequence, measured
//! the way llama.cpp's `llama-bench` does (`pp`: a prompt of random tokens in one pass;
//! `tg`: that many single-token decode steps), so the two print comparable tok/s.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use tessera_model::weights::ModelFiles;
use tessera_worker::batch::{LogitsWanted, SeqChunk};
use tessera_worker::llama::LlamaModel;
use tessera_worker::op_profile;
use tessera_worker::sampling::argmax;
use tessera_worker::session::Session;

/// Measure prefill and decode tokens per second.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Model file or directory; the default model when absent.
    #[arg(long, env = "TESSERA_MODEL")]
    pub model: Option<PathBuf>,
    /// Prompt length of the prefill test.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Decode steps of the generation test.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Repetitions; the mean and standard deviation are printed.
    #[arg(long, default_value_t = 3)]
    pub repetitions: usize,
    /// CPU threads (default: all cores).
    #[arg(long, env = "TESSERA_THREADS")]
    pub threads: Option<usize>,
    /// Where to run: `cpu`, or `cuda` / `cuda:N` for the GPU benchmark (bench_gpu.rs).
    #[arg(long, default_value = "cpu")]
    pub device: tessera_worker::service::DeviceChoice,
    /// CPU: also decode this many sequences together (each after the prompt of the prefill
    /// test), `--gen-tokens` steps of one token each: the batched decode of a served load.
    #[arg(long, default_value_t = 0)]
    pub cpu_batch: usize,
    /// GPU only: a random-weight model of this shape instead of a file (llama-3.1-8b,
    /// llama-3-8b-v49k, qwen3-8b, qwen3-32b, ...).
    #[arg(long)]
    pub synthetic: Option<String>,
    /// GPU only: prefill lengths to measure.
    #[arg(long, value_delimiter = ',', default_value = "512,4096")]
    pub prompts: Vec<usize>,
    /// GPU only: concurrent sequences of the decode test.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64,128,256")]
    pub batches: Vec<usize>,
    /// GPU only: prompt tokens of each sequence in the decode test.
    #[arg(long, default_value_t = 512)]
    pub decode_prompt: usize,
    /// GPU only: the batch-1 decode test again after prompts of these lengths (0 runs a
    /// one-token prompt): llama-bench's `tg128` decodes from an empty context and its `-d
    /// 4096` after 4096 tokens, so these rows are the exact conditions of its batch-1
    /// numbers (ANCHORS.md), where the decode test's 512-token prompt matches
    /// llama-batched-bench's. The flag with no value skips them.
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "0,4096")]
    pub batch1_depths: Vec<usize>,
    /// GPU only: sequence i of the decode test gets i % 16 more prompt tokens, so the
    /// sequences start new KV blocks at different steps, as served ones do (by default
    /// they all start one every 16 steps together). The longest sequence must still fit the
    /// decode graphs' context, or its steps run eagerly (the report counts graph steps).
    #[arg(long)]
    pub stagger: bool,
    /// GPU only: tensor-parallel ranks, one thread per GPU (`--device cuda:N`: GPUs N..N+tp);
    /// above 1, the decode test runs at tp = 1 and at this tp and prints their ratio.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// GPU only: pipeline stages (GPUs N..N+tp*pp, stage-major); above 1, the decode test
    /// also runs at tp = 1 and splits each batch into `pp` micro-batches kept in flight.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// GPU only: KV blocks of 16 positions to allocate on each GPU (default: as many as fit
    /// the free memory, as `tessera serve` sizes them); decode tests needing more are
    /// skipped. For comparing steps with and without most of the memory mapped.
    #[arg(long)]
    pub kv_blocks: Option<usize>,
}

pub fn run(args: BenchArgs) -> Result<()> {
    if let tessera_worker::service::DeviceChoice::Cuda(ordinal) = args.device {
        return crate::bench_gpu::run(&args, ordinal);
    }
    if let tessera_worker::service::DeviceChoice::Hip(_) = args.device {
        anyhow::bail!("--device hip: the benchmark runs on the CPU and CUDA; HIP serves through `tessera worker`");
    }
    if args.synthetic.is_some() || args.tp > 1 || args.pp > 1 {
        anyhow::bail!("--synthetic models, --tp and --pp run on GPUs: add --device cuda");
    }
    crate::threads::init(args.threads)?;
    let path = crate::default_model::resolve(args.model.as_deref())?;
    let files = Arc::new(ModelFiles::open(&path).with_context(|| format!("opening {}", path.display()))?);
    let model = LlamaModel::load(files)?;
    let vocab = model.config.vocab_size as u64;
    // A fixed pseudo-random prompt (SplitMix64), so runs are comparable.
    let mut state = 0x5eed_u64;
    let prompt: Vec<u32> = (0..args.prompt_tokens)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % vocab) as u32
        })
        .collect();
    // Warm-up, untimed (as llama-bench does): the first pass faults the memory-mapped
    // weights in and starts the thread pool.
    Session::new(&model, 16).feed(&[0; 16], false)?;
    let reps = args.repetitions.max(1);
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    // Per-op time of each test (TESSERA_CPU_OP_PROFILE=1), and the wall time it covers.
    let mut pp_ops = OpTotals::default();
    let mut tg_ops = OpTotals::default();
    op_profile::take();
    for _ in 0..reps {
        if args.prompt_tokens > 0 {
            let mut s = Session::new(&model, args.prompt_tokens);
            let t = Instant::now();
            s.feed(&prompt, false)?;
            let took = t.elapsed();
            pp.push(args.prompt_tokens as f64 / took.as_secs_f64());
            pp_ops.add(took, args.prompt_tokens);
        }
        if args.gen_tokens > 0 {
            let mut s = Session::new(&model, args.gen_tokens + 1);
            let mut tok = prompt.first().copied().unwrap_or(1);
            let t = Instant::now();
            for _ in 0..args.gen_tokens {
                let logits = s.feed(&[tok], false)?;
                tok = argmax(&logits);
            }
            let took = t.elapsed();
            tg.push(args.gen_tokens as f64 / took.as_secs_f64());
            tg_ops.add(took, args.gen_tokens);
        }
    }
    let mut bg = Vec::new();
    let mut bg_ops = OpTotals::default();
    if args.cpu_batch > 0 && args.gen_tokens > 0 {
        for _ in 0..reps {
            let (rate, took) = batched_decode(&model, &prompt, args.cpu_batch, args.gen_tokens)?;
            bg.push(rate);
            bg_ops.add(took, args.cpu_batch * args.gen_tokens);
        }
    }
    let threads = rayon::current_num_threads();
    println!("| model | threads | test | tok/s |");
    println!("|---|---|---|---|");
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if !pp.is_empty() {
        println!("| {name} | {threads} | pp{} | {} |", args.prompt_tokens, mean_sd(&pp));
    }
    if !tg.is_empty() {
        println!("| {name} | {threads} | tg{} | {} |", args.gen_tokens, mean_sd(&tg));
    }
    let batch_label = format!("tg{} x{} after pp{}", args.gen_tokens, args.cpu_batch, args.prompt_tokens);
    if !bg.is_empty() {
        println!("| {name} | {threads} | {batch_label} | {} |", mean_sd(&bg));
    }
    if op_profile::enabled() {
        for (label, ops) in [
            (format!("pp{}", args.prompt_tokens), &pp_ops),
            (format!("tg{}", args.gen_tokens), &tg_ops),
            (batch_label, &bg_ops),
        ] {
            if ops.tokens > 0 {
                println!("\n{}", op_profile::table(&label, &ops.totals, ops.wall_ns, ops.tokens));
            }
        }
    }
    Ok(())
}

/// `batch` sequences, each prefilled with `prompt` (untimed), then `steps` decode steps
/// of all of them in one forward pass each (greedy): aggregate tok/s and the time taken.
fn batched_decode(
    model: &LlamaModel,
    prompt: &[u32],
    batch: usize,
    steps: usize,
) -> Result<(f64, std::time::Duration)> {
    const BLOCK: usize = 16;
    let per_seq = (prompt.len() + steps + 1).div_ceil(BLOCK);
    let mut kv = model.new_kv_cache(per_seq * batch, BLOCK);
    let tables: Vec<Vec<u32>> =
        (0..batch).map(|b| ((b * per_seq) as u32..((b + 1) * per_seq) as u32).collect()).collect();
    let vocab = model.config.vocab_size;
    let mut next = vec![prompt.first().copied().unwrap_or(1); batch];
    for (b, table) in tables.iter().enumerate() {
        if !prompt.is_empty() {
            let chunk = SeqChunk { tokens: prompt, first_pos: 0, block_table: table, logits: LogitsWanted::Last };
            next[b] = argmax(&model.forward(std::slice::from_ref(&chunk), &mut kv)?.data[..vocab]);
        }
    }
    op_profile::take(); // the prefills are not part of this test
    let t = Instant::now();
    for step in 0..steps {
        let toks = next.clone();
        let chunks: Vec<SeqChunk> = toks
            .iter()
            .zip(&tables)
            .map(|(tok, table)| SeqChunk {
                tokens: std::slice::from_ref(tok),
                first_pos: prompt.len() + step,
                block_table: table,
                logits: LogitsWanted::Last,
            })
            .collect();
        let logits = model.forward(&chunks, &mut kv)?;
        for (b, n) in next.iter_mut().enumerate() {
            *n = argmax(logits.chunk(b));
        }
        model.recycle_logits(logits.data); // as the serving executor does
    }
    let took = t.elapsed();
    Ok(((batch * steps) as f64 / took.as_secs_f64(), took))
}

/// One test's per-op totals over its repetitions (see `op_profile`).
#[derive(Default)]
struct OpTotals {
    totals: [(u64, u64); op_profile::Op::ALL.len()],
    wall_ns: u64,
    tokens: u64,
}

impl OpTotals {
    /// Adds the ops timed since the last `take` and the run's wall time and tokens.
    fn add(&mut self, wall: std::time::Duration, tokens: usize) {
        for (t, (ns, calls)) in self.totals.iter_mut().zip(op_profile::take()) {
            t.0 += ns;
            t.1 += calls;
        }
        self.wall_ns += u64::try_from(wall.as_nanos()).unwrap_or(u64::MAX);
        self.tokens += tokens as u64;
    }
}

fn mean_sd(xs: &[f64]) -> String {
    let m = xs.iter().sum::<f64>() / xs.len() as f64;
    let var = xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / xs.len() as f64;
    format!("{m:.2} ± {:.2}", var.sqrt())
}
