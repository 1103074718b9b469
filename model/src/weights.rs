//! One view over a model's weights, whatever the file format, under canonical
//! (GGUF-style) tensor names, so the forward pass never asks which format it was given.
//!
//! Canonical names: `token_embd.weight`, `output_norm.weight`, `output.weight`,
//! `rope_freqs.weight`, `blk.{i}.{attn_norm, attn_q, attn_k, attn_v, attn_output,
//! ffn_norm, ffn_gate, ffn_up, ffn_down, attn_q_norm, attn_k_norm}.weight` and
//! `blk.{i}.attn_{q,k,v}.bias`. A matrix is `rows` rows of `cols` values (one output per
//! row, as in `y = W x`): GGUF stores dims as `[ne0 = cols, ne1 = rows]`, safetensors as
//! `[rows, cols]`.

use std::path::Path;

use tessera_kernels::GgmlType;

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::gguf::GgufFile;
use crate::hf::HfDir;
use crate::safetensors::SafeTensorsSet;

/// A 1-D or 2-D tensor's bytes and shape. 1-D tensors have `rows == 1`.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    /// `rows` rows of `ty.bytes_for(cols)` bytes each, row-major.
    pub data: &'a [u8],
}

impl TensorView<'_> {
    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows.max(1)
    }
}

/// A Hugging Face directory: its settings files and its safetensors weights.
#[derive(Debug)]
pub struct HfModel {
    pub dir: HfDir,
    pub weights: SafeTensorsSet,
}

/// An opened model, in either format.
#[derive(Debug)]
pub enum ModelFiles {
    Gguf(GgufFile),
    SafeTensors(HfModel),
}

impl ModelFiles {
    /// Opens a `.gguf` file, or a Hugging Face model directory.
    pub fn open(path: &Path) -> Result<ModelFiles, ModelError> {
        if path.is_dir() {
            let dir = HfDir::open(path)?;
            let weights = SafeTensorsSet::open_dir(path)?;
            return Ok(ModelFiles::SafeTensors(HfModel { dir, weights }));
        }
        if path.is_file() {
            return Ok(ModelFiles::Gguf(GgufFile::open(path)?));
        }
        Err(ModelError::Path {
            path: path.to_owned(),
            reason: "no such file or directory (expected a .gguf file or a Hugging Face model directory)".into(),
        })
    }

    /// The model's configuration, validated.
    pub fn config(&self) -> Result<ModelConfig, ModelError> {
        Ok(match self {
            ModelFiles::Gguf(g) => ModelConfig::from_gguf(g)?,
            ModelFiles::SafeTensors(m) => ModelConfig::from_hf_config(&m.dir.config_json)?,
        })
    }

    /// The GGUF file, for readers of its metadata (the tokenizer, the chat template).
    pub fn gguf(&self) -> Option<&GgufFile> {
        match self {
            ModelFiles::Gguf(g) => Some(g),
            ModelFiles::SafeTensors(_) => None,
        }
    }

    /// The Hugging Face directory's settings.
    pub fn hf(&self) -> Option<&HfDir> {
        match self {
            ModelFiles::Gguf(_) => None,
            ModelFiles::SafeTensors(m) => Some(&m.dir),
        }
    }

    pub fn has_tensor(&self, canonical: &str) -> bool {
        match self {
            ModelFiles::Gguf(g) => g.tensor(canonical).is_some(),
            ModelFiles::SafeTensors(m) => hf_name(canonical).is_some_and(|n| m.weights.contains(&n)),
        }
    }

    /// A tensor by canonical name, with its shape checked against its bytes.
    pub fn tensor(&self, canonical: &str) -> Result<TensorView<'_>, ModelError> {
        let bad = |reason: String| ModelError::BadTensor { name: canonical.to_owned(), reason };
        let view = match self {
            ModelFiles::Gguf(g) => {
                let t = g.tensor(canonical).ok_or_else(|| ModelError::MissingTensor {
                    name: canonical.to_owned(),
                    looked_up: canonical.to_owned(),
                    format: "GGUF",
                })?;
                // [ne0, ne1, 1, 1] -> rows = ne1, cols = ne0.
                let (rows, cols) = matrix_shape(t.dims.iter().rev().copied())
                    .ok_or_else(|| bad(format!("GGUF dims {:?} are not a vector or matrix", t.dims)))?;
                TensorView { ty: t.ty, rows, cols, data: g.tensor_data(t) }
            }
            ModelFiles::SafeTensors(m) => {
                let name = hf_name(canonical).unwrap_or_default();
                let (info, data) = m.weights.get(&name).ok_or_else(|| ModelError::MissingTensor {
                    name: canonical.to_owned(),
                    looked_up: name.clone(),
                    format: "safetensors",
                })?;
                let ty = info.ggml_type().ok_or_else(|| crate::safetensors::SafeTensorsError::UnsupportedDtype {
                    name: name.clone(),
                    dtype: info.dtype.clone(),
                })?;
                let (rows, cols) = matrix_shape(info.shape.iter().map(|&d| d as u64))
                    .ok_or_else(|| bad(format!("safetensors shape {:?} is not a vector or matrix", info.shape)))?;
                TensorView { ty, rows, cols, data }
            }
        };
        if view.cols % view.ty.block_elems() != 0 {
            return Err(bad(format!("row length {} is not a whole number of {} blocks", view.cols, view.ty)));
        }
        let need = view.rows.checked_mul(view.cols).and_then(|n| view.ty.bytes_for(n));
        if need != Some(view.data.len()) {
            return Err(bad(format!(
                "{} bytes for {}x{} {} (expected {need:?})",
                view.data.len(),
                view.rows,
                view.cols,
                view.ty
            )));
        }
        Ok(view)
    }
}

/// (rows, cols) from dims listed outermost first; leading 1s are dropped, and at most two
/// dims may remain.
fn matrix_shape(outer_first: impl Iterator<Item = u64>) -> Option<(usize, usize)> {
    let dims: Vec<u64> = outer_first.skip_while(|&d| d == 1).collect();
    let (rows, cols) = match dims.as_slice() {
        [] => (1, 1),
        [c] => (1, *c),
        [r, c] => (*r, *c),
        _ => return None,
    };
    Some((usize::try_from(rows).ok()?, usize::try_from(cols).ok()?))
}

/// The Hugging Face (transformers) name of a canonical tensor; `None` for names HF
/// checkpoints do not have (`rope_freqs.weight`) or that are not canonical.
pub fn hf_name(canonical: &str) -> Option<String> {
    let fixed = match canonical {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some(name.to_owned());
    }
    let rest = canonical.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, kind) = rest.rsplit_once('.')?;
    let module = match (part, kind) {
        ("attn_norm", "weight") => "input_layernorm",
        ("ffn_norm", "weight") => "post_attention_layernorm",
        ("attn_q", _) => "self_attn.q_proj",
        ("attn_k", _) => "self_attn.k_proj",
        ("attn_v", _) => "self_attn.v_proj",
        ("attn_output", "weight") => "self_attn.o_proj",
        ("attn_q_norm", "weight") => "self_attn.q_norm",
        ("attn_k_norm", "weight") => "self_attn.k_norm",
        ("ffn_gate", "weight") => "mlp.gate_proj",
        ("ffn_up", "weight") => "mlp.up_proj",
        ("ffn_down", "weight") => "mlp.down_proj",
        _ => return None,
    };
    if kind != "weight" && kind != "bias" {
        return None;
    }
    Some(format!("model.layers.{layer}.{module}.{kind}"))
}
