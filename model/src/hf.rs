//! A Hugging Face model directory: `config.json` (read by `ModelConfig::from_hf_config`),
//! `tokenizer.json`, and the tokenizer and generation settings the gateway needs: the chat
//! template (`tokenizer_config.json`'s string or list-of-named-templates form, or the
//! newer separate `chat_template.jinja`), the BOS/EOS token strings, and EOS ids from
//! `generation_config.json`. The weights are opened by `safetensors::SafeTensorsSet`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// A model directory that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

/// The chat-template and special-token settings of `tokenizer_config.json`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenizerConfig {
    /// The default template (the `"default"` entry of the list form).
    pub chat_template: Option<String>,
    /// Other named templates of the list form (e.g. `"tool_use"`).
    pub named_templates: BTreeMap<String, String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub add_bos_token: Option<bool>,
}

/// What `generation_config.json` says about stopping.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GenerationConfig {
    /// `eos_token_id`, which may be one id or a list.
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
}

/// The non-weight files of a model directory.
#[derive(Debug, Clone)]
pub struct HfDir {
    pub dir: PathBuf,
    /// `config.json`, verbatim.
    pub config_json: String,
    /// `tokenizer.json`, if present.
    pub tokenizer_json: Option<PathBuf>,
    /// Defaults when `tokenizer_config.json` is absent.
    pub tokenizer_config: TokenizerConfig,
    /// Defaults when `generation_config.json` is absent.
    pub generation: GenerationConfig,
}

impl HfDir {
    /// Reads the settings files of `dir`; only `config.json` is required.
    pub fn open(dir: &Path) -> Result<HfDir, HfError> {
        let config_json = read(&dir.join("config.json"))?;
        let tokenizer_json = Some(dir.join("tokenizer.json")).filter(|p| p.is_file());

        let tc_path = dir.join("tokenizer_config.json");
        let mut tokenizer_config = match read_optional(&tc_path)? {
            Some(text) => parse_tokenizer_config(&text).map_err(|reason| HfError::Invalid { path: tc_path, reason })?,
            None => TokenizerConfig::default(),
        };
        if tokenizer_config.chat_template.is_none() {
            tokenizer_config.chat_template = read_optional(&dir.join("chat_template.jinja"))?;
        }

        let gc_path = dir.join("generation_config.json");
        let generation = match read_optional(&gc_path)? {
            Some(text) => {
                parse_generation_config(&text).map_err(|reason| HfError::Invalid { path: gc_path, reason })?
            }
            None => GenerationConfig::default(),
        };
        Ok(HfDir { dir: dir.to_owned(), config_json, tokenizer_json, tokenizer_config, generation })
    }
}

fn read(path: &Path) -> Result<String, HfError> {
    std::fs::read_to_string(path).map_err(|source| HfError::Io { path: path.to_owned(), source })
}

fn read_optional(path: &Path) -> Result<Option<String>, HfError> {
    if path.is_file() {
        read(path).map(Some)
    } else {
        Ok(None)
    }
}

/// Parses `tokenizer_config.json`. Errors are messages; the caller adds the path.
pub fn parse_tokenizer_config(json: &str) -> Result<TokenizerConfig, String> {
    let v: Value = serde_json::from_str(json).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v.as_object().ok_or("top level is not an object")?;
    let mut out = TokenizerConfig::default();
    match obj.get("chat_template") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.chat_template = Some(s.clone()),
        Some(Value::Array(list)) => {
            for entry in list {
                let name = entry.get("name").and_then(Value::as_str);
                let template = entry.get("template").and_then(Value::as_str);
                let (Some(name), Some(template)) = (name, template) else {
                    return Err("chat_template list entries need string `name` and `template`".into());
                };
                if name == "default" {
                    out.chat_template = Some(template.to_owned());
                } else {
                    out.named_templates.insert(name.to_owned(), template.to_owned());
                }
            }
        }
        Some(_) => return Err("chat_template must be a string or a list of {name, template}".into()),
    }
    out.bos_token = token_string(obj.get("bos_token"), "bos_token")?;
    out.eos_token = token_string(obj.get("eos_token"), "eos_token")?;
    out.add_bos_token = match obj.get("add_bos_token") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => return Err("add_bos_token must be a bool".into()),
    };
    Ok(out)
}

/// A special token given as a string or as an AddedToken object `{"content": ...}`.
fn token_string(v: Option<&Value>, key: &str) -> Result<Option<String>, String> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(format!("{key} object has no string `content`")),
        },
        Some(_) => Err(format!("{key} must be a string or an object with `content`")),
    }
}

/// Parses `generation_config.json`. Errors are messages; the caller adds the path.
pub fn parse_generation_config(json: &str) -> Result<GenerationConfig, String> {
    let v: Value = serde_json::from_str(json).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v.as_object().ok_or("top level is not an object")?;
    let id = |v: &Value, key: &str| {
        v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| format!("{key} holds {v}, not a token id"))
    };
    let eos_token_ids = match obj.get("eos_token_id") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list.iter().map(|v| id(v, "eos_token_id")).collect::<Result<_, _>>()?,
        Some(v) => vec![id(v, "eos_token_id")?],
    };
    let bos_token_id = match obj.get("bos_token_id") {
        None | Some(Value::Null) => None,
        Some(v) => Some(id(v, "bos_token_id")?),
    };
    Ok(GenerationConfig { eos_token_ids, bos_token_id })
}
