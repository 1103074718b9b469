//! `ModelConfig`: the hyperparameters of one model of the family (Llama 3, SmolLM2,
//! Qwen2, Qwen3), read from GGUF metadata or a Hugging Face `config.json`, and validated
//! once so the forward pass can rely on them (heads divide, head_dim is even, ...).
//!
//! Differences that matter between the two sources:
//! - RoPE pairing: llama.cpp's converter permutes Llama's q/k rows so that GGUF llama
//!   files rotate adjacent pairs (`Interleaved`); Qwen GGUFs and every HF checkpoint
//!   rotate the two halves of each head (`Neox`).
//! - Llama-3 RoPE scaling: an HF config carries its parameters (`rope_scaling`); a GGUF
//!   carries the per-frequency factors precomputed as the `rope_freqs.weight` tensor, so
//!   `rope_scaling` is `None` for GGUF and the forward pass uses that tensor instead.

use serde_json::Value;

use crate::gguf::{GgufFile, MetaValue};

/// Architectures Tessera runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
}

impl Arch {
    /// The GGUF `general.architecture` name.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
}

/// How RoPE pairs the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Rotates (x[2i], x[2i+1]): GGUF llama files.
    Interleaved,
    /// Rotates (x[i], x[i + head_dim/2]): Qwen GGUFs and all HF checkpoints.
    Neox,
}

/// Llama-3 frequency-dependent RoPE scaling (`rope_type: "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position: usize,
}

/// Hyperparameters of one model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    /// Per-head size; Qwen3 sets it apart from `hidden_size / num_heads`.
    pub head_dim: usize,
    pub vocab_size: usize,
    /// Trained context length.
    pub max_position: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// HF only; see the module comment for GGUF.
    pub rope_scaling: Option<RopeScaling>,
    pub rope_style: RopeStyle,
    /// The LM head reuses `token_embd.weight` (no `output.weight`).
    pub tie_embeddings: bool,
    /// q/k/v projections have biases (Qwen2).
    pub qkv_bias: bool,
    /// Per-head RMS norm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
}

/// A configuration that is missing, malformed, or outside what Tessera runs.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("unsupported architecture `{0}` (supported: {SUPPORTED})")]
    UnsupportedArch(String),
    #[error("missing config key `{0}`")]
    Missing(String),
    #[error("config key `{key}`: {reason}")]
    BadValue { key: String, reason: String },
    #[error("config.json is not a JSON object: {0}")]
    Json(String),
    #[error("unsupported model feature: {0}")]
    Unsupported(String),
    #[error("invalid model config: {0}")]
    Invalid(String),
}

const SUPPORTED: &str = "llama (incl. SmolLM2, Mistral-style), qwen2, qwen3";
const DEFAULT_ROPE_THETA: f32 = 10_000.0;

impl ModelConfig {
    /// Reads the `{arch}.*` keys of a GGUF file (and two facts from its tensor table).
    pub fn from_gguf(g: &GgufFile) -> Result<ModelConfig, ConfigError> {
        let arch_name =
            g.get("general.architecture").ok_or_else(|| ConfigError::Missing("general.architecture".into()))?;
        let arch_name = arch_name.as_str().ok_or_else(|| bad("general.architecture", "expected a string"))?;
        let arch = match arch_name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            other => return Err(ConfigError::UnsupportedArch(other.to_owned())),
        };
        let m = GgufKeys { g, arch: arch_name };

        let hidden_size = m.usize("embedding_length")?;
        let num_heads = m.usize("attention.head_count")?;
        let num_kv_heads = m.opt_usize("attention.head_count_kv")?.unwrap_or(num_heads);
        let head_dim = match m.opt_usize("attention.key_length")? {
            Some(d) => d,
            None => derived_head_dim(hidden_size, num_heads)?,
        };
        if let Some(v) = m.opt_usize("attention.value_length")? {
            if v != head_dim {
                return Err(ConfigError::Unsupported(format!(
                    "value head size {v} differs from key head size {head_dim}"
                )));
            }
        }
        if let Some(r) = m.opt_usize("rope.dimension_count")? {
            if r != head_dim {
                return Err(ConfigError::Unsupported(format!("partial RoPE over {r} of {head_dim} head dims")));
            }
        }
        if let Some(t) = m.opt("rope.scaling.type") {
            let t = t.as_str().ok_or_else(|| bad(&m.key("rope.scaling.type"), "expected a string"))?;
            let factor = m.opt_f64("rope.scaling.factor")?.unwrap_or(1.0);
            if t != "none" && !(t == "linear" && factor == 1.0) {
                return Err(ConfigError::Unsupported(format!("GGUF RoPE scaling type `{t}` (factor {factor})")));
            }
        }
        let vocab_size = match m.opt_usize("vocab_size")? {
            Some(v) => v,
            None => gguf_vocab_size(g)?,
        };

        let config = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: m.usize("feed_forward_length")?,
            num_layers: m.usize("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            max_position: m.usize("context_length")?,
            rms_norm_eps: m.f64("attention.layer_norm_rms_epsilon")? as f32,
            rope_theta: m.opt_f64("rope.freq_base")?.map_or(DEFAULT_ROPE_THETA, |v| v as f32),
            rope_scaling: None,
            rope_style: match arch {
                Arch::Llama => RopeStyle::Interleaved,
                Arch::Qwen2 | Arch::Qwen3 => RopeStyle::Neox,
            },
            tie_embeddings: g.tensor("output.weight").is_none(),
            qkv_bias: g.tensor("blk.0.attn_q.bias").is_some(),
            qk_norm: arch == Arch::Qwen3,
        };
        config.validate()?;
        Ok(config)
    }

    /// Reads a Hugging Face `config.json`.
    pub fn from_hf_config(json: &str) -> Result<ModelConfig, ConfigError> {
        let v: Value = serde_json::from_str(json).map_err(|e| ConfigError::Json(e.to_string()))?;
        let j = JsonKeys(v.as_object().ok_or_else(|| ConfigError::Json("top level is not an object".into()))?);

        let model_type = j.req("model_type")?.as_str().ok_or_else(|| bad("model_type", "expected a string"))?;
        let arch = match model_type {
            "llama" | "mistral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            other => return Err(ConfigError::UnsupportedArch(other.to_owned())),
        };
        if let Some(act) = j.opt("hidden_act") {
            if act.as_str() != Some("silu") {
                return Err(ConfigError::Unsupported(format!("hidden_act {act} (only silu)")));
            }
        }
        let max_position = j.usize("max_position_embeddings")?;
        check_sliding_window(&j, max_position)?;

        let hidden_size = j.usize("hidden_size")?;
        let num_heads = j.usize("num_attention_heads")?;
        let head_dim = match j.opt_usize("head_dim")? {
            Some(d) => d,
            None => derived_head_dim(hidden_size, num_heads)?,
        };
        // transformers 5 moved rope settings into `rope_parameters`.
        let rope_params = j.opt("rope_parameters").or_else(|| j.opt("rope_scaling"));
        let rope_theta = match j.opt_f64("rope_theta")? {
            Some(t) => t,
            None => match rope_params.and_then(|p| p.get("rope_theta")) {
                Some(t) => t.as_f64().ok_or_else(|| bad("rope_parameters.rope_theta", "expected a number"))?,
                None => f64::from(DEFAULT_ROPE_THETA),
            },
        };
        let config = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: j.usize("intermediate_size")?,
            num_layers: j.usize("num_hidden_layers")?,
            num_heads,
            num_kv_heads: j.opt_usize("num_key_value_heads")?.unwrap_or(num_heads),
            head_dim,
            vocab_size: j.usize("vocab_size")?,
            max_position,
            rms_norm_eps: j.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_theta: rope_theta as f32,
            rope_scaling: rope_params.map(hf_rope_scaling).transpose()?.flatten(),
            rope_style: RopeStyle::Neox,
            tie_embeddings: j.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            // Qwen2 always has q/k/v biases and its config does not say so.
            qkv_bias: arch == Arch::Qwen2 || j.opt_bool("attention_bias")?.unwrap_or(false),
            qk_norm: arch == Arch::Qwen3,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the invariants the forward pass relies on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |msg: String| Err(ConfigError::Invalid(msg));
        let sizes = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position", self.max_position),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return invalid(format!("{name} is 0"));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return invalid(format!(
                "{} attention heads do not divide into groups of {} KV heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return invalid(format!("head_dim {} is odd; RoPE rotates pairs", self.head_dim));
        }
        if self.num_heads.checked_mul(self.head_dim).is_none() {
            return invalid("num_heads * head_dim overflows".into());
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return invalid(format!("rms_norm_eps {} must be positive", self.rms_norm_eps));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return invalid(format!("rope_theta {} must be greater than 1", self.rope_theta));
        }
        if let Some(s) = &self.rope_scaling {
            let ok = s.factor.is_finite()
                && s.factor >= 1.0
                && s.low_freq_factor > 0.0
                && s.high_freq_factor.is_finite()
                && s.high_freq_factor > s.low_freq_factor
                && s.original_max_position > 0;
            if !ok {
                return invalid(format!(
                    "llama3 rope scaling {s:?}: needs factor >= 1, 0 < low_freq_factor < high_freq_factor, original_max_position > 0"
                ));
            }
        }
        Ok(())
    }

    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads.max(1)
    }
}

fn bad(key: &str, reason: &str) -> ConfigError {
    ConfigError::BadValue { key: key.to_owned(), reason: reason.to_owned() }
}

fn derived_head_dim(hidden: usize, heads: usize) -> Result<usize, ConfigError> {
    if heads == 0 || !hidden.is_multiple_of(heads) {
        return Err(ConfigError::Invalid(format!(
            "hidden size {hidden} does not divide into {heads} heads (and no head_dim is given)"
        )));
    }
    Ok(hidden / heads)
}

/// Vocabulary size when `{arch}.vocab_size` is absent: the tokenizer's token list, else
/// the embedding's row count.
fn gguf_vocab_size(g: &GgufFile) -> Result<usize, ConfigError> {
    if let Some(tokens) = g.get("tokenizer.ggml.tokens").and_then(MetaValue::as_array) {
        return Ok(tokens.len());
    }
    g.tensor("token_embd.weight").and_then(|t| t.dims.get(1)).and_then(|&n| usize::try_from(n).ok()).ok_or_else(|| {
        ConfigError::Missing("vocab_size (no {arch}.vocab_size, tokenizer.ggml.tokens or token_embd.weight)".into())
    })
}

/// Typed access to the `{arch}.` keys of a GGUF file.
struct GgufKeys<'a> {
    g: &'a GgufFile,
    arch: &'a str,
}

impl GgufKeys<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    fn opt(&self, suffix: &str) -> Option<&MetaValue> {
        self.g.get(&self.key(suffix))
    }

    fn opt_usize(&self, suffix: &str) -> Result<Option<usize>, ConfigError> {
        self.opt(suffix)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| bad(&self.key(suffix), &format!("expected a non-negative integer, found {v:?}")))
            })
            .transpose()
    }

    fn usize(&self, suffix: &str) -> Result<usize, ConfigError> {
        self.opt_usize(suffix)?.ok_or_else(|| ConfigError::Missing(self.key(suffix)))
    }

    fn opt_f64(&self, suffix: &str) -> Result<Option<f64>, ConfigError> {
        self.opt(suffix)
            .map(|v| v.as_f64().ok_or_else(|| bad(&self.key(suffix), &format!("expected a number, found {v:?}"))))
            .transpose()
    }

    fn f64(&self, suffix: &str) -> Result<f64, ConfigError> {
        self.opt_f64(suffix)?.ok_or_else(|| ConfigError::Missing(self.key(suffix)))
    }
}

/// Typed access to a config.json object; `null` counts as absent.
struct JsonKeys<'a>(&'a serde_json::Map<String, Value>);

impl JsonKeys<'_> {
    fn opt(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn req(&self, key: &str) -> Result<&Value, ConfigError> {
        self.opt(key).ok_or_else(|| ConfigError::Missing(key.into()))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, ConfigError> {
        self.opt(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| bad(key, &format!("expected a non-negative integer, found {v}")))
            })
            .transpose()
    }

    fn usize(&self, key: &str) -> Result<usize, ConfigError> {
        self.opt_usize(key)?.ok_or_else(|| ConfigError::Missing(key.into()))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>, ConfigError> {
        self.opt(key).map(|v| v.as_f64().ok_or_else(|| bad(key, &format!("expected a number, found {v}")))).transpose()
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, ConfigError> {
        self.opt(key)
            .map(|v| v.as_bool().ok_or_else(|| bad(key, &format!("expected true or false, found {v}"))))
            .transpose()
    }
}

/// Sliding-window attention is not implemented: refuse configs that use it.
fn check_sliding_window(j: &JsonKeys, max_position: usize) -> Result<(), ConfigError> {
    if j.opt_bool("use_sliding_window")? == Some(true) {
        return Err(ConfigError::Unsupported("sliding-window attention (use_sliding_window: true)".into()));
    }
    // Mistral sets the window without a flag; a window as long as the context is no window.
    let window = j.opt_usize("sliding_window")?;
    let uses_window = j.opt_bool("use_sliding_window")?.unwrap_or(true);
    if let Some(w) = window.filter(|&w| uses_window && w < max_position) {
        return Err(ConfigError::Unsupported(format!(
            "sliding-window attention (window {w} < context {max_position})"
        )));
    }
    Ok(())
}

/// `rope_scaling` / `rope_parameters`: `None` for plain RoPE, the parameters for llama3,
/// an error for the scaling kinds Tessera does not implement.
fn hf_rope_scaling(p: &Value) -> Result<Option<RopeScaling>, ConfigError> {
    const KEY: &str = "rope_scaling";
    let Some(obj) = p.as_object() else {
        return Err(bad(KEY, "expected an object"));
    };
    let kind = obj.get("rope_type").or_else(|| obj.get("type")).and_then(Value::as_str).unwrap_or("default");
    match kind {
        "default" => Ok(None),
        "llama3" => {
            let num = |k: &str| -> Result<f64, ConfigError> {
                obj.get(k)
                    .and_then(Value::as_f64)
                    .ok_or_else(|| bad(&format!("{KEY}.{k}"), "missing or not a number (llama3 scaling needs it)"))
            };
            let orig = obj
                .get("original_max_position_embeddings")
                .and_then(Value::as_u64)
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| bad(&format!("{KEY}.original_max_position_embeddings"), "missing or not an integer"))?;
            Ok(Some(RopeScaling {
                factor: num("factor")? as f32,
                low_freq_factor: num("low_freq_factor")? as f32,
                high_freq_factor: num("high_freq_factor")? as f32,
                original_max_position: orig,
            }))
        }
        other => Err(ConfigError::Unsupported(format!("RoPE scaling type `{other}` (only llama3)"))),
    }
}
