//! Filling a [`TokenizerSpec`] from a GGUF file's `tokenizer.ggml.*` metadata.

use super::error::{Result, TokenizerError};
use super::spec::{TokenizerSpec, VocabKind};
use crate::gguf::{GgufFile, MetaValue};

const MODEL: &str = "tokenizer.ggml.model";
const TOKENS: &str = "tokenizer.ggml.tokens";
const SCORES: &str = "tokenizer.ggml.scores";
const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const MERGES: &str = "tokenizer.ggml.merges";
const PRE: &str = "tokenizer.ggml.pre";

fn array<'f>(file: &'f GgufFile, key: &'static str) -> Result<Option<&'f [MetaValue]>> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => v.as_array().map(Some).ok_or(TokenizerError::WrongType { key, expected: "an array" }),
    }
}

fn strings(file: &GgufFile, key: &'static str) -> Result<Vec<String>> {
    let Some(items) = array(file, key)? else {
        return Ok(Vec::new());
    };
    items
        .iter()
        .map(|v| v.as_str().map(str::to_string))
        .collect::<Option<Vec<_>>>()
        .ok_or(TokenizerError::WrongType { key, expected: "an array of strings" })
}

/// A token id; a negative value (some converters write -1 for "none") means absent, and an
/// id past the vocabulary is dealt with when the vocabulary is resolved.
fn id(file: &GgufFile, key: &'static str) -> Result<Option<u32>> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => match v.as_i64() {
            Some(i) if i < 0 => Ok(None),
            Some(i) => Ok(Some(u32::try_from(i).unwrap_or(u32::MAX))),
            None => Err(TokenizerError::WrongType { key, expected: "an integer" }),
        },
    }
}

fn flag(file: &GgufFile, key: &'static str) -> Result<Option<bool>> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => v.as_bool().map(Some).ok_or(TokenizerError::WrongType { key, expected: "a bool" }),
    }
}

impl TokenizerSpec {
    /// Reads the tokenizer metadata of `file`.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let model = file
            .get(MODEL)
            .ok_or(TokenizerError::MissingKey(MODEL))?
            .as_str()
            .ok_or(TokenizerError::WrongType { key: MODEL, expected: "a string" })?;
        let kind = match model {
            "gpt2" => VocabKind::Bpe,
            "llama" => VocabKind::Spm,
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };
        let tokens = strings(file, TOKENS)?;
        if tokens.is_empty() {
            return Err(TokenizerError::MissingKey(TOKENS));
        }
        let mut spec = TokenizerSpec::new(kind, tokens);
        if let Some(items) = array(file, SCORES)? {
            spec.scores = items
                .iter()
                .map(|v| match v {
                    MetaValue::F32(f) => Some(*f),
                    MetaValue::I32(i) => Some(*i as f32),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()
                .ok_or(TokenizerError::WrongType { key: SCORES, expected: "an array of f32 or i32" })?;
        }
        if let Some(items) = array(file, TOKEN_TYPE)? {
            spec.token_types = items
                .iter()
                .map(|v| v.as_i64().and_then(|i| i32::try_from(i).ok()))
                .collect::<Option<Vec<_>>>()
                .ok_or(TokenizerError::WrongType { key: TOKEN_TYPE, expected: "an array of i32" })?;
        }
        spec.merges = strings(file, MERGES)?;
        spec.pre = match file.get(PRE) {
            None => None,
            Some(v) => {
                Some(v.as_str().ok_or(TokenizerError::WrongType { key: PRE, expected: "a string" })?.to_string())
            }
        };
        spec.bos = id(file, "tokenizer.ggml.bos_token_id")?;
        spec.eos = id(file, "tokenizer.ggml.eos_token_id")?;
        spec.eot = id(file, "tokenizer.ggml.eot_token_id")?;
        spec.eom = id(file, "tokenizer.ggml.eom_token_id")?;
        spec.unk = id(file, "tokenizer.ggml.unknown_token_id")?;
        spec.pad = id(file, "tokenizer.ggml.padding_token_id")?;
        spec.add_bos = flag(file, "tokenizer.ggml.add_bos_token")?;
        spec.add_eos = flag(file, "tokenizer.ggml.add_eos_token")?;
        spec.add_space_prefix = flag(file, "tokenizer.ggml.add_space_prefix")?;
        Ok(spec)
    }
}
