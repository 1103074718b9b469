//! `tessera generate`: one prompt, one sequence, on the CPU engine; prints the text as it
//! is produced, then prefill and decode speed.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use tessera_model::chat_template::ChatMessage;
use tessera_worker::llama::LlamaModel;
use tessera_worker::sampling::{Sampler, SamplingParams};
use tessera_worker::session::Session;

use tessera_model::bundle::ModelBundle;

/// Generate text from one prompt.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Model file (GGUF) or Hugging Face directory; the default model when absent.
    #[arg(long, env = "TESSERA_MODEL")]
    pub model: Option<PathBuf>,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Render the prompt as a user message through the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat.
    #[arg(long)]
    pub system: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of the sampler's random generator.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Worker threads for the CPU kernels (default: all cores).
    #[arg(long, env = "TESSERA_THREADS")]
    pub threads: Option<usize>,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    crate::threads::init(args.threads)?;
    let path = crate::default_model::resolve(args.model.as_deref())?;
    let loaded = ModelBundle::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let model = LlamaModel::load(Arc::clone(&loaded.files)).context("loading the model weights")?;

    let prompt_ids = if args.chat {
        let mut msgs = Vec::new();
        if let Some(s) = &args.system {
            msgs.push(ChatMessage { role: "system".into(), content: s.clone() });
        }
        msgs.push(ChatMessage { role: "user".into(), content: args.prompt.clone() });
        let text = loaded.chat_template()?.render(&msgs, true)?;
        loaded.tokenizer.encode(&text, false, true)?
    } else {
        loaded.tokenizer.encode(&args.prompt, true, false)?
    };
    if prompt_ids.is_empty() {
        anyhow::bail!("the prompt tokenized to nothing");
    }

    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k as u32,
        top_p: args.top_p,
        seed: args.seed,
        ..SamplingParams::greedy()
    };
    params.validate()?;
    let mut sampler = Sampler::new(params)?;
    // The model places positions below its context: the prompt must fit, and generation
    // stops when the context is full (the last token sampled needs no position of its own).
    let context = model.config.max_position;
    if prompt_ids.len() > context {
        anyhow::bail!("the prompt is {} tokens, longer than the model's context of {context}", prompt_ids.len());
    }
    let capacity = (prompt_ids.len() + args.max_tokens).min(context);
    let mut session = Session::new(&model, capacity);
    let stops = loaded.tokenizer.stop_token_ids().to_vec();
    let mut history = prompt_ids.clone();
    let mut detok = loaded.tokenizer.decode_stream(true);
    let mut out = std::io::stdout().lock();

    let t0 = Instant::now();
    let mut logits = session.feed(&prompt_ids, false)?;
    let prefill = t0.elapsed();
    let t1 = Instant::now();
    let mut generated = 0usize;
    while generated < args.max_tokens {
        let s = sampler.sample(&mut logits, &history, generated)?;
        generated += 1;
        if stops.contains(&s.token) {
            break;
        }
        history.push(s.token);
        let text = detok.step(s.token)?;
        out.write_all(text.as_bytes())?;
        out.flush()?;
        if generated == args.max_tokens || session.position() >= capacity {
            break;
        }
        logits = session.feed(&[s.token], false)?;
    }
    out.write_all(detok.finish()?.as_bytes())?;
    writeln!(out)?;
    let decode = t1.elapsed();
    eprintln!(
        "prefill: {} tokens in {:.3} s ({:.1} tok/s); decode: {} tokens in {:.3} s ({:.1} tok/s)",
        prompt_ids.len(),
        prefill.as_secs_f64(),
        prompt_ids.len() as f64 / prefill.as_secs_f64(),
        generated,
        decode.as_secs_f64(),
        generated as f64 / decode.as_secs_f64().max(1e-9),
    );
    Ok(())
}
