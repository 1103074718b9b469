//! Named model shapes for `--synthetic`: the configs of real checkpoints (from their
//! `config.json`), so a random-weight model streams exactly the bytes the real one does
//! and benchmarks need no 16 GB download.

use tessera_model::config::{Arch, ModelConfig, RopeScaling, RopeStyle};

/// Names [`synthetic_config`] knows, for error messages and `--help`.
pub const SHAPES: &[&str] =
    &["llama-3.1-8b", "llama-3-8b-v49k", "qwen3-8b", "qwen3-32b", "qwen3-0.6b", "qwen2.5-7b", "smollm2-135m"];

#[allow(clippy::too_many_arguments)]
fn base(
    arch: Arch,
    hidden: usize,
    ffn: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
) -> ModelConfig {
    ModelConfig {
        arch,
        hidden_size: hidden,
        intermediate_size: ffn,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        vocab_size: vocab,
        max_position: 32768,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        rope_scaling: None,
        rope_style: RopeStyle::Neox,
        tie_embeddings: false,
        qkv_bias: false,
        qk_norm: false,
    }
}

/// The config of shape `name`, or `None` for an unknown name.
pub fn synthetic_config(name: &str) -> Option<ModelConfig> {
    let llama3 = |vocab: usize| ModelConfig {
        max_position: 131072,
        rms_norm_eps: 1e-5,
        rope_theta: 500_000.0,
        rope_scaling: Some(RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        }),
        rope_style: RopeStyle::Interleaved,
        ..base(Arch::Llama, 4096, 14336, 32, 32, 8, 128, vocab)
    };
    Some(match name {
        "llama-3.1-8b" => llama3(128256),
        // The shape llama.cpp was measured on in ANCHORS.md: Llama-3-8B with SmolLM2's vocabulary.
        "llama-3-8b-v49k" => ModelConfig { rope_scaling: None, max_position: 8192, ..llama3(49152) },
        "qwen3-8b" => ModelConfig { qk_norm: true, ..base(Arch::Qwen3, 4096, 12288, 36, 32, 8, 128, 151936) },
        "qwen3-32b" => ModelConfig { qk_norm: true, ..base(Arch::Qwen3, 5120, 25600, 64, 64, 8, 128, 151936) },
        "qwen3-0.6b" => {
            ModelConfig { qk_norm: true, tie_embeddings: true, ..base(Arch::Qwen3, 1024, 3072, 28, 16, 8, 128, 151936) }
        }
        "qwen2.5-7b" => ModelConfig { qkv_bias: true, ..base(Arch::Qwen2, 3584, 18944, 28, 28, 4, 128, 152064) },
        "smollm2-135m" => ModelConfig {
            rms_norm_eps: 1e-5,
            rope_theta: 100_000.0,
            max_position: 8192,
            tie_embeddings: true,
            rope_style: RopeStyle::Interleaved,
            ..base(Arch::Llama, 576, 1536, 30, 9, 3, 64, 49152)
        },
        _ => return None,
    })
}

/// Bytes of bf16 weights a decode step streams: every matrix once (the embedding only by
/// the rows it gathers, ignored here; the LM head always), the unit of MBU.
pub fn bf16_bytes_per_token(c: &ModelConfig) -> u64 {
    let (h, hd) = (c.hidden_size as u64, c.head_dim as u64);
    let qkv = (c.num_heads as u64 + 2 * c.num_kv_heads as u64) * hd * h;
    let o = c.num_heads as u64 * hd * h;
    let mlp = 3 * c.intermediate_size as u64 * h;
    let layer = qkv + o + mlp + 2 * h;
    2 * (c.num_layers as u64 * layer + c.vocab_size as u64 * h + h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_shape_is_valid() {
        for name in SHAPES {
            let c = synthetic_config(name).unwrap_or_else(|| panic!("{name} listed but unknown"));
            c.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        assert!(synthetic_config("llama-9000").is_none());
    }

    #[test]
    fn llama_8b_streams_about_15_gb_per_token() {
        // ANCHORS.md: Llama-3.1-8B bf16 streams ~15.0 GB per token; the 49k-vocab variant
        // llama.cpp ran reads 14.36 GB (its embedding rows are gathered, not streamed).
        let b = bf16_bytes_per_token(&synthetic_config("llama-3.1-8b").unwrap()) as f64 / 1e9;
        assert!((b - 15.01).abs() < 0.05, "{b}");
        let b = bf16_bytes_per_token(&synthetic_config("llama-3-8b-v49k").unwrap()) as f64 / 1e9;
        assert!((b - 14.36).abs() < 0.05, "{b}");
    }
}
