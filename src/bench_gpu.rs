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
//!   to do; then the kernel launches, overlapping the GPU) against the step's wall time,
//!   and on one GPU the step's wall time split by GPU timestamps (crate::step_split): host
//!   preparation, forward pass, sampling with read-back, and the time between steps.
//!
//! With `--tp N` and/or `--pp M`: the decode test at tp = 1 on the first GPU, then on N x M
//! GPUs with the model split (one thread per rank, stage-major: rank i is stage i / N,
//! tensor rank i % N, on GPU first + i), and the ratio. Every rank runs the same steps;
//! the last stage's tensor rank 0 samples greedily and hands the tokens to the others over
//! channels. With pipeline stages each batch is split into M micro-batches stepped in
//! turn, so the stages work on different micro-batches at once (as the coordinator keeps
//! M steps in flight). A `--synthetic` split model is the one-GPU model split (same seed).

use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use tessera_kernels::cuda::{bf16, Device, NcclId};
use tessera_model::weights::ModelFiles;
use tessera_worker::batch::{LogitsWanted, SeqChunk};
use tessera_worker::cuda::shapes::{bf16_bytes_per_token, synthetic_config};
use tessera_worker::cuda::{CudaModel, CudaOptions, GpuSampler, GroupIds, RowRequest, StepTiming};
use tessera_worker::parallel::Shard;
use tessera_worker::sampling::{Sampled, SamplingError};

use crate::bench::BenchArgs;
use crate::step_split::{median, StepSplit};

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

/// The model under test: a synthetic shape or a file.
enum Source {
    Synthetic(String),
    File(PathBuf),
}

impl Source {
    fn of(args: &BenchArgs) -> Result<Self> {
        Ok(match &args.synthetic {
            Some(shape) => Source::Synthetic(shape.clone()),
            None => Source::File(crate::default_model::resolve(args.model.as_deref())?),
        })
    }

    fn name(&self) -> String {
        match self {
            Source::Synthetic(shape) => format!("{shape} (synthetic bf16)"),
            Source::File(path) => path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        }
    }

    fn open(path: &Path) -> Result<ModelFiles> {
        ModelFiles::open(path).with_context(|| format!("opening {}", path.display()))
    }

    /// The whole model on `opts.device`.
    fn load(&self, opts: &CudaOptions) -> Result<CudaModel> {
        Ok(match self {
            Source::Synthetic(shape) => CudaModel::synthetic(shape, 42, opts)?,
            Source::File(path) => CudaModel::load(&Self::open(path)?, opts)?,
        })
    }

    fn num_layers(&self) -> Result<usize> {
        Ok(match self {
            Source::Synthetic(shape) => {
                synthetic_config(shape).ok_or_else(|| anyhow!("unknown synthetic shape {shape:?}"))?.num_layers
            }
            Source::File(path) => Self::open(path)?.config()?.num_layers,
        })
    }

    /// The share of `shard` on `opts.device`, in groups `ids`.
    fn load_shard(&self, opts: &CudaOptions, shard: &Shard, ids: &GroupIds) -> Result<CudaModel> {
        Ok(match self {
            Source::Synthetic(shape) => CudaModel::synthetic_shard(shape, 42, opts, shard, ids)?,
            Source::File(path) => CudaModel::load_shard(&Self::open(path)?, opts, shard, ids)?,
        })
    }
}

fn options(device: usize, args: &BenchArgs) -> CudaOptions {
    CudaOptions { device, block_size: BLOCK, num_blocks: args.kv_blocks, ..CudaOptions::default() }
}

pub fn run(args: &BenchArgs, ordinal: usize) -> Result<()> {
    if args.tp > 1 || args.pp > 1 {
        return run_parallel(args, ordinal);
    }
    let source = Source::of(args)?;
    let t0 = Instant::now();
    let mut m = source.load(&options(ordinal, args))?;
    let name = source.name();
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
        let outcome = decode_batch(&mut m, b, args, &Role::Solo, 1)?;
        println!("{}", decode_row(b, args, &outcome, bytes_per_token));
    }
    for &depth in &args.batch1_depths {
        // A prompt of at least one token: the model needs one to prefill.
        let at = BenchArgs { decode_prompt: depth.max(1), stagger: false, ..args.clone() };
        let outcome = decode_batch(&mut m, 1, &at, &Role::Solo, 1)?;
        println!("{}", decode_row(1, &at, &outcome, bytes_per_token));
    }
    Ok(())
}

/// The decode test at tp = 1 on GPU `first`, then split over GPUs `first..first + tp * pp`.
fn run_parallel(args: &BenchArgs, first: usize) -> Result<()> {
    let (tp, pp) = (args.tp.max(1), args.pp.max(1));
    let ranks = tp * pp;
    let present = Device::count()?;
    if first + ranks > present {
        bail!("--tp {tp} --pp {pp} from GPU {first} needs GPUs {first}..{}, {present} present", first + ranks);
    }
    let source = Source::of(args)?;
    let t0 = Instant::now();
    let mut m = source.load(&options(first, args))?;
    let c = m.config().clone();
    println!(
        "# {} on {}: tp=1 on GPU {first} loaded in {:.1} s, {} KV blocks of {BLOCK}; {:.2} GB of bf16 weights per decoded token",
        source.name(),
        m.device().name(),
        t0.elapsed().as_secs_f64(),
        m.num_blocks(),
        bf16_bytes_per_token(&c) as f64 / 1e9
    );
    let mut single = Vec::with_capacity(args.batches.len());
    for &b in &args.batches {
        single.push(decode_batch(&mut m, b, args, &Role::Solo, 1)?);
    }
    drop(m);

    // One NCCL id per tensor group (one per stage) and per pipeline (one per tensor rank).
    let ids = |n: usize, used: bool| -> Result<Vec<Option<NcclId>>> {
        (0..n).map(|_| used.then(Device::nccl_unique_id).transpose().map_err(Into::into)).collect()
    };
    let (tp_ids, pp_ids) = (ids(pp, tp > 1)?, ids(tp, pp > 1)?);
    let layers = source.num_layers()?;
    if layers < pp {
        bail!("{layers} layers cannot form {pp} pipeline stages");
    }
    let leader = (pp - 1) * tp;
    let t0 = Instant::now();
    let (txs, rxs): (Vec<_>, Vec<_>) = (1..ranks).map(|_| channel::<Vec<u32>>()).unzip();
    let (mut txs, mut rxs) = (Some(txs), rxs.into_iter());
    let roles: Vec<Role> = (0..ranks)
        .map(|i| match i == leader {
            true => Role::Leader(txs.take().unwrap_or_default()),
            false => rxs.next().map_or(Role::Solo, Role::Follower),
        })
        .collect();
    let results: Vec<Result<RankRun>> = std::thread::scope(|s| {
        let handles: Vec<_> = roles
            .into_iter()
            .enumerate()
            .map(|(i, role)| {
                let source = &source;
                let (stage, rank) = (i / tp, i % tp);
                let group = GroupIds { tp: tp_ids[stage].clone(), pp: pp_ids[rank].clone() };
                s.spawn(move || -> Result<RankRun> {
                    let span = stage * layers / pp..(stage + 1) * layers / pp;
                    let shard = Shard { tp_rank: rank, tp, stage, stages: pp, layers: span };
                    let mut m = source
                        .load_shard(&options(first + i, args), &shard, &group)
                        .with_context(|| format!("stage {stage} tp rank {rank} on GPU {}", first + i))?;
                    let (loaded_s, blocks) = (t0.elapsed().as_secs_f64(), m.num_blocks());
                    if i == leader && tp > 1 {
                        println!("# all-reduce: {}", m.all_reduce_path());
                    }
                    let rank_bytes = bf16_bytes_per_token(m.local_config()) as f64;
                    let mut outcomes = Vec::with_capacity(args.batches.len());
                    for &b in &args.batches {
                        let o = decode_batch(&mut m, b, args, &role, pp).with_context(|| format!("rank {i}"))?;
                        outcomes.push(o);
                    }
                    Ok(RankRun { loaded_s, blocks, rank_bytes, outcomes })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a rank's thread panicked")))).collect()
    });
    let mut lead = None;
    for (i, r) in results.into_iter().enumerate() {
        let r = r?;
        if i == leader {
            lead = Some(r);
        }
    }
    let lead = lead.ok_or_else(|| anyhow!("the sampling rank did not run"))?;
    let split = format!("tp={tp} pp={pp}");
    println!(
        "# {split} on GPUs {first}..{}: loaded in {:.1} s, {} KV blocks; {:.2} GB of bf16 weights per token on the \
         sampling GPU (vocab-parallel LM head where the vocabulary divides by tp)",
        first + ranks,
        lead.loaded_s,
        lead.blocks,
        lead.rank_bytes / 1e9
    );
    println!();
    println!("| decode | tp=1 | {split} | {split} / tp=1 | {split} detail |");
    println!("|---|---|---|---|---|");
    for ((&b, one), many) in args.batches.iter().zip(&single).zip(&lead.outcomes) {
        let cell = |o: &Outcome| match o {
            Outcome::Ran(d) => format!("{:.0} tok/s", d.tok_s),
            Outcome::Skipped { .. } => "skipped".into(),
        };
        let ratio = match (one, many) {
            (Outcome::Ran(a), Outcome::Ran(z)) => format!("{:.2}x", z.tok_s / a.tok_s),
            _ => "-".into(),
        };
        let detail = match many {
            Outcome::Ran(d) => {
                let mbu = if b == 1 {
                    format!(", per-GPU MBU {:.0}%", 100.0 * lead.rank_bytes / d.step / HBM_BYTES_PER_S)
                } else {
                    String::new()
                };
                format!("step {:.2} ms{mbu}; {}/{} steps from a CUDA graph", d.step * 1e3, d.graphs, args.gen_tokens)
            }
            Outcome::Skipped { needed, have } => format!("needs {needed} KV blocks, {have} exist"),
        };
        println!(
            "| {b} sequences ({}+{}) | {} | {} | {ratio} | {detail} |",
            args.decode_prompt,
            args.gen_tokens,
            cell(one),
            cell(many)
        );
        if b == 1 {
            if let (Outcome::Ran(a), Outcome::Ran(z)) = (one, many) {
                eprintln!(
                    "RESULT {split} batch-1 decode {:.0} tok/s vs tp=1 {:.0} tok/s: {:.2}x (tp=2 target >= 1.8x)",
                    z.tok_s,
                    a.tok_s,
                    z.tok_s / a.tok_s
                );
            }
        }
    }
    Ok(())
}

/// What a tp rank's thread measured.
struct RankRun {
    loaded_s: f64,
    blocks: usize,
    /// bf16 bytes this rank streams per decoded token.
    rank_bytes: f64,
    outcomes: Vec<Outcome>,
}

/// Where a decode step's next tokens come from.
enum Role {
    /// One GPU: greedy on its own logits.
    Solo,
    /// The last stage's tensor rank 0: greedy on its logits, sent to every other rank.
    Leader(Vec<Sender<Vec<u32>>>),
    /// Another rank: runs the step, then takes the leader's tokens.
    Follower(Receiver<Vec<u32>>),
}

/// One decode test's measurements.
struct Decode {
    tok_s: f64,
    /// Median wall time of a step, s.
    step: f64,
    prep: f64,
    /// Of `prep`: the chunks' checks and the input copies (medians).
    validate: f64,
    upload: f64,
    enqueue: f64,
    graphs: usize,
    /// The step's wall time by GPU timestamps (one GPU only).
    split: Option<StepSplit>,
    /// Each step was queued before the step before's tokens were read (its host time
    /// overlaps that step's GPU time; its last mark follows the sampling on the GPU).
    overlapped: bool,
}

enum Outcome {
    Ran(Decode),
    Skipped { needed: usize, have: usize },
}

fn decode_row(b: usize, args: &BenchArgs, outcome: &Outcome, bytes_per_token: f64) -> String {
    let (prompt, gen) = (args.decode_prompt, args.gen_tokens);
    let stagger = if args.stagger { ", prompts +0..15" } else { "" };
    let d = match outcome {
        Outcome::Skipped { needed, have } => {
            return format!("| decode, {b} sequences | skipped | needs {needed} KV blocks, {have} exist |")
        }
        Outcome::Ran(d) => d,
    };
    let mbu = if b == 1 {
        format!(", MBU {:.0}%", 100.0 * bytes_per_token / d.step / HBM_BYTES_PER_S)
    } else {
        String::new()
    };
    // Queued ahead, a step's host work runs beside the step before on the GPU, and its
    // last mark follows its sampling there, not the host's read of the rows.
    let (host, sampling) =
        if d.overlapped { ("beside the step before", "sampling") } else { ("GPU idle", "sampling and read-back") };
    let split = match d.split {
        Some(s) => format!(
            "; by GPU timestamps: prep {:.0} + forward {:.0} + {sampling} {:.0} + between steps {:.0} µs",
            s.prep, s.forward, s.sampling, s.between
        ),
        None => String::new(),
    };
    format!(
        "| decode, {b} sequences ({prompt}+{gen}{stagger}) | {:.0} tok/s | step {:.2} ms{mbu}; host per step: prep {:.0} µs ({host}; checks {:.0}, copies {:.0}) + launches {:.0} µs; {}/{gen} steps from a CUDA graph{split} |",
        d.tok_s,
        d.step * 1e3,
        d.prep * 1e6,
        d.validate * 1e6,
        d.upload * 1e6,
        d.enqueue * 1e6,
        d.graphs
    )
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
/// `gen_tokens` decode steps of all of them with greedy sampling on the GPU, the batch
/// split into `micro` micro-batches stepped in turn (pipeline stages overlap on them).
/// Every rank of a split model calls this with the same arguments (its block count is the
/// group's, so all skip or all run).
fn decode_batch(m: &mut CudaModel, b: usize, args: &BenchArgs, role: &Role, micro: usize) -> Result<Outcome> {
    let (prompt, gen) = (args.decode_prompt, args.gen_tokens);
    let vocab = m.config().vocab_size;
    // With `--stagger`, sequence i's prompt is i % BLOCK tokens longer.
    let len = |i: usize| prompt + if args.stagger { i % BLOCK } else { 0 };
    let per_seq = (len(BLOCK - 1) + gen + 1).div_ceil(BLOCK);
    if per_seq * b > m.num_blocks() {
        return Ok(Outcome::Skipped { needed: per_seq * b, have: m.num_blocks() });
    }
    let tables: Vec<Vec<u32>> = (0..b).map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect()).collect();
    let prompts: Vec<Vec<u32>> = (0..b).map(|i| pseudo_random_tokens(len(i), vocab, 100 + i as u64)).collect();
    let per_step = (8192 / len(BLOCK - 1).max(1)).max(1);
    let all: Vec<usize> = (0..b).collect();
    let groups: Vec<&[usize]> = all.chunks(b.div_ceil(micro.max(1)).max(1)).collect();
    let mut sampler = GpuSampler::new();
    // Each micro-batch's next tokens; `None` until a follower takes them from the leader.
    let mut next: Vec<Option<Vec<u32>>> = Vec::with_capacity(groups.len());
    for group in &groups {
        let mut toks = Vec::with_capacity(group.len());
        for part in group.chunks(per_step) {
            let chunks: Vec<SeqChunk> = part
                .iter()
                .map(|&i| SeqChunk {
                    tokens: &prompts[i],
                    first_pos: 0,
                    block_table: &tables[i],
                    logits: LogitsWanted::Last,
                })
                .collect();
            let got = launch(m, &chunks, &mut sampler, role)?;
            toks.extend(match got {
                Some(t) => t,
                None => take(role)?,
            });
        }
        next.push(Some(toks));
    }
    let mut times = StepTimes::default();
    // On one GPU the model marks each step on the GPU's clock (four marks per step;
    // TESSERA_BENCH_MARKS=0: none, to time the steps without them. On an H200 one A/B
    // found the same tok/s within a call's noise, two others 0.3-1% more without marks on
    // llama-3.1-8b but not on v49k: RESULTS 2026-12-04).
    if matches!(role, Role::Solo) && std::env::var("TESSERA_BENCH_MARKS").as_deref() != Ok("0") {
        let marks = m.device().marks(4 * gen * groups.len())?;
        m.set_marks(Some(marks));
    }
    // One GPU, one micro-batch: each step is queued before the last one's tokens are read,
    // its ids taken from the GPU's sampled tokens (`CudaModel::queue_sample`), so the host's
    // work overlaps the GPU's (TESSERA_BENCH_OVERLAP=0: one step at a time, as before).
    let overlap =
        matches!(role, Role::Solo) && groups.len() == 1 && std::env::var("TESSERA_BENCH_OVERLAP").as_deref() != Ok("0");
    let t_all = Instant::now();
    if overlap {
        let first = next[0].take().ok_or_else(|| anyhow!("no tokens after the prefill"))?;
        // The chunks' own tokens: the prefill's, then placeholders the device replaces.
        let toks: Vec<[u32; 1]> = first.iter().map(|&x| [x]).collect();
        let chunks_at = |step| decode_chunks(groups[0], &toks, &tables, |i| len(i) + step);
        next[0] = Some(decode_ahead(m, first, gen, chunks_at, &mut sampler, &mut times)?);
    } else {
        for step in 0..gen {
            for (g, group) in groups.iter().enumerate() {
                let now = match next[g].take() {
                    Some(t) => t,
                    None => take(role)?,
                };
                let t = Instant::now();
                let toks: Vec<[u32; 1]> = now.iter().map(|&x| [x]).collect();
                let chunks = decode_chunks(group, &toks, &tables, |i| len(i) + step);
                next[g] = launch(m, &chunks, &mut sampler, role)?;
                times.push(m.last_step_timing(), t);
            }
        }
    }
    // A follower takes the last step's tokens too, so the next test starts in step.
    for slot in next.iter_mut().filter(|s| s.is_none()) {
        *slot = Some(take(role)?);
    }
    m.device().synchronize()?;
    let total = t_all.elapsed().as_secs_f64();
    let split = match m.take_marks() {
        Some(marks) => StepSplit::from_marks(&marks.times_us()?),
        None => None,
    };
    Ok(Outcome::Ran(Decode {
        tok_s: (b * gen) as f64 / total,
        step: median(times.wall),
        prep: median(times.prep),
        validate: median(times.validate),
        upload: median(times.upload),
        enqueue: median(times.enqueue),
        graphs: times.graphs / groups.len().max(1),
        split,
        overlapped: overlap,
    }))
}

/// The overlapped loop on one GPU: `gen` greedy steps of one batch (the sequences whose
/// next tokens are `first`; `chunks_at(step)` their chunks, on `first` as their own tokens),
/// each queued before the step before's tokens are read and taking them from the GPU's
/// sampled rows. Returns the last step's tokens.
fn decode_ahead<'a>(
    m: &mut CudaModel,
    first: Vec<u32>,
    gen: usize,
    chunks_at: impl Fn(usize) -> Vec<SeqChunk<'a>>,
    sampler: &mut GpuSampler,
    times: &mut StepTimes,
) -> Result<Vec<u32>> {
    let requests = vec![RowRequest::greedy(); first.len()];
    // Every row takes its own row's token of the step before (the order never changes).
    let same_rows: Vec<Option<u32>> = (0..first.len() as u32).map(Some).collect();
    let (mut pending, mut last) = (None, first);
    for step in 0..gen {
        let t = Instant::now();
        let from = if step == 0 { &[][..] } else { &same_rows[..] };
        let queued = m.queue_sample(&chunks_at(step), from, &requests, sampler)?;
        let timing = m.last_step_timing();
        if let Some(before) = pending.replace(queued) {
            last = greedy_tokens(m.finish_sample(before, sampler)?)?;
        }
        times.push(timing, t);
    }
    if let Some(before) = pending {
        last = greedy_tokens(m.finish_sample(before, sampler)?)?;
    }
    Ok(last)
}

/// Each decode step's host times (seconds) and how many ran a CUDA graph.
#[derive(Default)]
struct StepTimes {
    wall: Vec<f64>,
    prep: Vec<f64>,
    validate: Vec<f64>,
    upload: Vec<f64>,
    enqueue: Vec<f64>,
    graphs: usize,
}

impl StepTimes {
    /// A step that started at `t0` (its wall time ends now) with the model's `timing`.
    fn push(&mut self, timing: StepTiming, t0: Instant) {
        self.graphs += usize::from(timing.graph);
        self.wall.push(t0.elapsed().as_secs_f64());
        self.prep.push(timing.prep.as_secs_f64());
        self.validate.push(timing.validate.as_secs_f64());
        self.upload.push(timing.upload.as_secs_f64());
        self.enqueue.push(timing.enqueue.as_secs_f64());
    }
}

/// A decode step's chunks: sequence `group[j]` runs `toks[j]` at `pos(group[j])`, greedy.
fn decode_chunks<'a>(
    group: &[usize],
    toks: &'a [[u32; 1]],
    tables: &'a [Vec<u32>],
    pos: impl Fn(usize) -> usize,
) -> Vec<SeqChunk<'a>> {
    group
        .iter()
        .zip(toks)
        .map(|(&i, tok)| SeqChunk {
            tokens: tok,
            first_pos: pos(i),
            block_table: &tables[i],
            logits: LogitsWanted::Last,
        })
        .collect()
}

/// Runs one step: its next tokens (greedy on the GPU) for a rank that samples, which the
/// leader also sends to every other rank; `None` for a follower, which takes them later
/// with [`take`] (so a pipeline stage can start its next micro-batch first).
fn launch(m: &mut CudaModel, chunks: &[SeqChunk], sampler: &mut GpuSampler, role: &Role) -> Result<Option<Vec<u32>>> {
    match role {
        Role::Solo => Ok(Some(m.forward_greedy(chunks, sampler)?)),
        Role::Leader(others) => {
            let tokens = m.forward_greedy(chunks, sampler)?;
            for tx in others {
                tx.send(tokens.clone()).map_err(|_| anyhow!("a rank stopped"))?;
            }
            Ok(Some(tokens))
        }
        Role::Follower(_) => {
            m.forward_device(chunks)?;
            Ok(None)
        }
    }
}

/// The tokens of a step's greedy rows (a failed row is an error: greedy rows cannot fail).
fn greedy_tokens(rows: Vec<Result<Sampled, SamplingError>>) -> Result<Vec<u32>> {
    Ok(rows.into_iter().map(|r| r.map(|s| s.token)).collect::<Result<_, _>>()?)
}

/// A follower's next tokens from the leader, in step order.
fn take(role: &Role) -> Result<Vec<u32>> {
    match role {
        Role::Follower(rx) => rx.recv().map_err(|_| anyhow!("the sampling rank stopped")),
        _ => bail!("only a follower takes tokens from the leader"),
    }
}
