//! The plain description a tokenizer is built from: the `tokenizer.ggml.*` metadata of a
//! GGUF file, as data. Keeping it separate from the GGUF reader lets tests build small
//! vocabularies by hand and lets other sources (a converter, a test) fill it directly.

/// Which algorithm turns text into ids (`tokenizer.ggml.model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabKind {
    /// Byte-level BPE with merge ranks (`"gpt2"`): GPT-2, Llama 3, Qwen2, SmolLM2.
    Bpe,
    /// SentencePiece with score-ranked merges and byte fallback (`"llama"`): Llama 1/2, Mistral.
    Spm,
}

/// GGUF token types (`tokenizer.ggml.token_type`), numbered as the format stores them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    Undefined = 0,
    Normal = 1,
    Unknown = 2,
    Control = 3,
    UserDefined = 4,
    Unused = 5,
    Byte = 6,
}

impl TokenType {
    /// The type for a stored number; numbers outside the enum count as `Undefined`, as in
    /// llama.cpp.
    pub fn from_i32(v: i32) -> Self {
        match v {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Undefined,
        }
    }
}

/// Everything the tokenizer needs, as stored in `tokenizer.ggml.*`. `None` means "absent
/// from the metadata": the vocabulary then applies llama.cpp's default for the model kind
/// and pre-tokenizer (for example SentencePiece adds BOS by default, BPE does not).
#[derive(Debug, Clone)]
pub struct TokenizerSpec {
    pub kind: VocabKind,
    /// Token texts, indexed by id (`tokenizer.ggml.tokens`).
    pub tokens: Vec<String>,
    /// Per-token scores (`tokenizer.ggml.scores`); empty means all zero. SPM merges by them.
    pub scores: Vec<f32>,
    /// Per-token GGUF types (`tokenizer.ggml.token_type`); empty means all `Normal`.
    pub token_types: Vec<i32>,
    /// BPE merges in rank order, each "left right" (`tokenizer.ggml.merges`).
    pub merges: Vec<String>,
    /// Pre-tokenizer name (`tokenizer.ggml.pre`), BPE only.
    pub pre: Option<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
}

impl TokenizerSpec {
    /// A spec with the given kind and tokens and everything else absent.
    pub fn new(kind: VocabKind, tokens: Vec<String>) -> Self {
        Self {
            kind,
            tokens,
            scores: Vec::new(),
            token_types: Vec::new(),
            merges: Vec::new(),
            pre: None,
            bos: None,
            eos: None,
            eot: None,
            eom: None,
            unk: None,
            pad: None,
            add_bos: None,
            add_eos: None,
            add_space_prefix: None,
        }
    }
}
