//! Hugging Face `tokenizer.json` support through the `tokenizers` crate (1.0 release
//! candidate), for model directories that come without GGUF metadata. The crate's reader
//! accepts only its canonical JSON, so the file goes through `tokenizers`' own upgrade
//! pass first. Vocabulary size and added (special) tokens are read from the same JSON;
//! BOS/EOS come from `tokenizer_config.json` and `generation_config.json` next to it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tokenizers::pipeline::{EncodeOptions, PipelineTokenizer};

use super::error::{Result, TokenizerError};

pub(crate) struct HfTokenizer {
    inner: PipelineTokenizer,
    /// Ids at or above this are byte tokens Tessera added so the crate accepts the file
    /// (see [`pad_byte_atoms`]); they are dropped from encodings.
    padded_from: u32,
    /// Token text -> id for the added tokens and the model vocabulary.
    pub vocab: BTreeMap<String, u32>,
    /// Id -> text, `None` for ids the file does not define.
    pub id_to_text: Vec<Option<String>>,
}

/// What the sibling config files say about special tokens.
#[derive(Default)]
pub(crate) struct HfSpecial {
    pub bos: Option<String>,
    pub eos: Option<String>,
    /// `generation_config.json`'s `eos_token_id` (one id or a list): what HF stops on.
    pub generation_eos: Vec<u32>,
    pub chat_template: Option<String>,
}

fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).map_err(|source| TokenizerError::Io { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text)
        .map_err(|e| TokenizerError::BadConfig { path: path.to_path_buf(), reason: e.to_string() })
}

impl HfTokenizer {
    pub(crate) fn from_file(path: &Path) -> Result<Self> {
        let bad = |reason: String| TokenizerError::BadConfig { path: path.to_path_buf(), reason };
        let mut json = read_json(path)?;
        let mut vocab = BTreeMap::new();
        match json.pointer("/model/vocab") {
            Some(Value::Object(map)) => {
                for (text, id) in map {
                    let id = id.as_u64().and_then(|i| u32::try_from(i).ok());
                    vocab.insert(text.clone(), id.ok_or_else(|| bad(format!("vocab entry {text:?} has no u32 id")))?);
                }
            }
            // Unigram: an array of [piece, score], ids by position.
            Some(Value::Array(list)) => {
                for (i, entry) in list.iter().enumerate() {
                    let text = entry.get(0).and_then(Value::as_str);
                    vocab.insert(
                        text.ok_or_else(|| bad(format!("vocab entry {i} is not [piece, score]")))?.to_string(),
                        i as u32,
                    );
                }
            }
            _ => return Err(bad("model.vocab is missing".into())),
        }
        for entry in json.get("added_tokens").and_then(Value::as_array).into_iter().flatten() {
            let id = entry.get("id").and_then(Value::as_u64).and_then(|i| u32::try_from(i).ok());
            let content = entry.get("content").and_then(Value::as_str);
            let (Some(id), Some(content)) = (id, content) else {
                return Err(bad(format!("added token {entry} lacks an id or content")));
            };
            vocab.insert(content.to_string(), id);
        }
        let size = vocab.values().max().map_or(0, |&m| m as usize + 1);
        // Ids index a table below, so a file claiming id 4e9 for a small vocabulary must
        // not make us allocate one.
        if size > 2 * vocab.len() + 1024 {
            return Err(bad(format!("{} tokens but ids up to {}", vocab.len(), size - 1)));
        }
        let padded_from = size as u32;
        pad_byte_atoms(&mut json, padded_from);
        let mut id_to_text = vec![None; size];
        for (text, &id) in &vocab {
            id_to_text[id as usize] = Some(text.clone());
        }

        tokenizers::canonicalize_value(&mut json).map_err(|e| bad(e.to_string()))?;
        let inner = tokenizers::from_json(&json.to_string()).map_err(|e| bad(e.to_string()))?;
        Ok(Self { inner, padded_from, vocab, id_to_text })
    }

    pub(crate) fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let options = EncodeOptions {
            add_special_tokens: add_special,
            encode_special_tokens: !parse_special,
            ..EncodeOptions::default()
        };
        let mut out = Vec::new();
        self.inner.encode_into(text, &options, &mut out).map_err(|e| TokenizerError::Hf(e.to_string()))?;
        Ok(out.into_iter().map(u32::from).filter(|&id| id < self.padded_from).collect())
    }

    pub(crate) fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.id_to_text.len()) {
            return Err(TokenizerError::TokenOutOfRange { id, size: self.id_to_text.len() });
        }
        self.inner.decode(ids, skip_special).map_err(|e| TokenizerError::Hf(e.to_string()))
    }
}

/// `tokenizers` 1.0.0-rc.3 refuses a byte-level BPE whose vocabulary lacks a token for some
/// byte, and real ones do (SmolLM2 has none for 0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xF1,
/// 0xF2). Earlier `tokenizers` releases and llama.cpp encode such a byte as nothing, so the
/// missing byte characters are appended to the vocabulary with ids from `first_id` on, and
/// `encode` drops those ids again.
fn pad_byte_atoms(json: &mut Value, first_id: u32) {
    let is_byte_level = |v: Option<&Value>| {
        let Some(v) = v else { return false };
        v.get("type").and_then(Value::as_str) == Some("ByteLevel")
            || v.get("pretokenizers")
                .and_then(Value::as_array)
                .is_some_and(|l| l.iter().any(|p| p.get("type").and_then(Value::as_str) == Some("ByteLevel")))
    };
    let byte_level = is_byte_level(json.get("pre_tokenizer"))
        || json.pointer("/model/byte_level").and_then(Value::as_bool) == Some(true);
    if !byte_level || json.pointer("/model/type").and_then(Value::as_str).is_some_and(|t| t != "BPE") {
        return;
    }
    let Some(Value::Object(vocab)) = json.pointer_mut("/model/vocab") else {
        return;
    };
    let mut next = first_id;
    for b in 0..=255u8 {
        let c = super::byte_level::byte_to_char(b).to_string();
        if !vocab.contains_key(&c) {
            vocab.insert(c, Value::from(next));
            next += 1;
        }
    }
}

/// Reads `tokenizer_config.json` and `generation_config.json` from `dir` when present.
pub(crate) fn read_special(dir: &Path) -> Result<HfSpecial> {
    let mut special = HfSpecial::default();
    let config: PathBuf = dir.join("tokenizer_config.json");
    if config.exists() {
        let json = read_json(&config)?;
        // A token is either a string or an AddedToken object with `content`.
        let token = |key: &str| match json.get(key) {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).map(str::to_string),
            _ => None,
        };
        special.bos = token("bos_token");
        special.eos = token("eos_token");
        special.chat_template = match json.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: take "default".
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(Value::as_str))
                .map(str::to_string),
            _ => None,
        };
    }
    let generation = dir.join("generation_config.json");
    if generation.exists() {
        let json = read_json(&generation)?;
        let ids = match json.get("eos_token_id") {
            Some(Value::Array(list)) => list.iter().filter_map(Value::as_u64).collect(),
            Some(v) => v.as_u64().into_iter().collect(),
            None => Vec::new(),
        };
        special.generation_eos = ids.into_iter().filter_map(|i| u32::try_from(i).ok()).collect();
    }
    Ok(special)
}
