//! The resolved vocabulary: token texts and attributes, the text -> id map, the special
//! token ids with llama.cpp's defaults applied, the end-of-generation set, and the list of
//! tokens the special-token splitter looks for. Built once from a [`TokenizerSpec`].

use std::collections::HashMap;

use super::error::{Result, TokenizerError};
use super::pretokenize::{self, PreConfig};
use super::spec::{TokenType, TokenizerSpec, VocabKind};

/// Token attribute bits (llama.cpp's `llama_token_attr`, the subset that matters here).
pub(crate) mod attr {
    pub const UNKNOWN: u32 = 1 << 1;
    pub const UNUSED: u32 = 1 << 2;
    pub const NORMAL: u32 = 1 << 3;
    pub const CONTROL: u32 = 1 << 4;
    pub const USER_DEFINED: u32 = 1 << 5;
    pub const BYTE: u32 = 1 << 6;
    pub const LSTRIP: u32 = 1 << 8;
    pub const RSTRIP: u32 = 1 << 9;
}

/// Texts llama.cpp recognises as "end of turn" when the metadata names no EOT token, in
/// the order Tessera prefers them (llama.cpp takes whichever its hash map yields first).
pub(crate) const EOT_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Texts that end generation (llama.cpp's `special_eog_ids` name list).
pub(crate) const EOG_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Fill-in-the-middle pad/repo/separator tokens, which llama.cpp also treats as end of
/// generation (a code model emitting them has left the current file).
const FIM_EOG_NAMES: &[&[&str]] = &[
    &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"],
    &["<|file_sep|>"],
];

/// Special token ids after defaults and metadata overrides.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
}

pub(crate) struct Vocab {
    pub kind: VocabKind,
    pub tokens: Vec<String>,
    pub scores: Vec<f32>,
    pub attrs: Vec<u32>,
    pub token_to_id: HashMap<String, u32>,
    pub special: SpecialIds,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    pub clean_spaces: bool,
    pub ignore_merges: bool,
    /// End-of-generation ids, sorted.
    pub eog: Vec<u32>,
    /// Ids the special-token splitter looks for (control, user-defined, unknown), longest
    /// text first so `<|im_start|>` wins over a shorter token that is its prefix.
    pub special_cache: Vec<u32>,
}

impl Vocab {
    /// Resolves `spec`; returns the vocabulary and, for BPE, the pre-tokenizer config.
    pub(crate) fn new(spec: &TokenizerSpec) -> Result<(Self, Option<PreConfig>)> {
        let n = spec.tokens.len();
        if n == 0 {
            return Err(TokenizerError::InvalidVocab("the token list is empty".into()));
        }
        if u32::try_from(n).is_err() {
            return Err(TokenizerError::InvalidVocab(format!("{n} tokens do not fit u32 ids")));
        }
        for (what, len) in [("scores", spec.scores.len()), ("token types", spec.token_types.len())] {
            if len != 0 && len < n {
                return Err(TokenizerError::InvalidVocab(format!("{len} {what} for {n} tokens")));
            }
        }

        let mut tokens = Vec::with_capacity(n);
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, text) in spec.tokens.iter().enumerate() {
            // llama.cpp renames empty entries so every id keeps a distinct text.
            let text = if text.is_empty() { format!("[EMPTY_{i}]") } else { text.clone() };
            if token_to_id.insert(text.clone(), i as u32).is_some() {
                return Err(TokenizerError::InvalidVocab(format!("token {text:?} appears twice")));
            }
            tokens.push(text);
        }
        let scores = if spec.scores.is_empty() { vec![0.0; n] } else { spec.scores[..n].to_vec() };
        let mut attrs: Vec<u32> = (0..n)
            .map(|i| match spec.token_types.get(i).map(|&t| TokenType::from_i32(t)) {
                None | Some(TokenType::Normal) => attr::NORMAL,
                Some(TokenType::Unknown) => attr::UNKNOWN,
                Some(TokenType::Control) => attr::CONTROL,
                Some(TokenType::UserDefined) => attr::USER_DEFINED,
                Some(TokenType::Unused) => attr::UNUSED,
                Some(TokenType::Byte) => attr::BYTE,
                Some(TokenType::Undefined) => 0,
            })
            .collect();

        // Defaults by kind, as llama.cpp's loader sets them before reading the metadata.
        let (pre, mut special, mut add_bos, mut add_space_prefix, clean_spaces, ignore_merges) = match spec.kind {
            VocabKind::Spm => {
                let special = SpecialIds { bos: Some(1), eos: Some(2), unk: Some(0), ..Default::default() };
                (None, special, true, true, false, false)
            }
            VocabKind::Bpe => {
                let pre = pretokenize::config_for(spec.pre.as_deref())?;
                let special = SpecialIds { bos: Some(11), eos: Some(11), ..Default::default() };
                let (add_bos, clean, ignore) = (pre.add_bos, pre.clean_spaces, pre.ignore_merges);
                (Some(pre), special, add_bos, false, clean, ignore)
            }
        };
        let in_range = |id: Option<u32>| id.filter(|&i| (i as usize) < n);
        // A default outside the vocabulary is disabled; an out-of-range metadata id keeps
        // the default (both as llama.cpp does).
        for (slot, given) in [
            (&mut special.bos, spec.bos),
            (&mut special.eos, spec.eos),
            (&mut special.eot, spec.eot),
            (&mut special.eom, spec.eom),
            (&mut special.unk, spec.unk),
            (&mut special.pad, spec.pad),
        ] {
            *slot = in_range(*slot);
            if let Some(id) = in_range(given) {
                *slot = Some(id);
            }
        }
        add_bos = spec.add_bos.unwrap_or(add_bos);
        let add_eos = spec.add_eos.unwrap_or(false);
        add_space_prefix = spec.add_space_prefix.unwrap_or(add_space_prefix);

        let id_of = |name: &str| token_to_id.get(name).copied();
        // Tokens found by name are forced to CONTROL, so they are never split as text.
        let mut named: Vec<u32> = Vec::new();
        if special.eot.is_none() {
            special.eot = EOT_NAMES.iter().find_map(|name| id_of(name));
            named.extend(special.eot);
        }
        if special.eom.is_none() {
            special.eom = id_of("<|eom_id|>");
            named.extend(special.eom);
        }
        let mut eog: Vec<u32> = EOG_NAMES.iter().filter_map(|name| id_of(name)).collect();
        eog.extend(FIM_EOG_NAMES.iter().filter_map(|names| names.iter().find_map(|name| id_of(name))));
        named.extend(&eog);
        for &id in &named {
            attrs[id as usize] |= attr::CONTROL;
        }
        eog.extend([special.eos, special.eot, special.eom].into_iter().flatten());
        // gpt-oss style vocabularies end a turn with <|return|>/<|call|>, so <|end|> is plain.
        if ["<|return|>", "<|call|>"].iter().all(|t| id_of(t).is_some())
            || ["<|calls|>", "<|flush|>"].iter().all(|t| id_of(t).is_some())
        {
            if let Some(end) = id_of("<|end|>") {
                eog.retain(|&id| id != end);
                attrs[end as usize] = attr::USER_DEFINED;
            }
        }
        eog.sort_unstable();
        eog.dedup();

        let mut special_cache: Vec<u32> = (0..n as u32)
            .filter(|&id| attrs[id as usize] & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0)
            .collect();
        special_cache.sort_by_key(|&id| std::cmp::Reverse(tokens[id as usize].len()));

        let vocab = Self {
            kind: spec.kind,
            tokens,
            scores,
            attrs,
            token_to_id,
            special,
            add_bos,
            add_eos,
            add_space_prefix,
            clean_spaces,
            ignore_merges,
            eog,
            special_cache,
        };
        Ok((vocab, pre))
    }

    pub(crate) fn len(&self) -> usize {
        self.tokens.len()
    }

    pub(crate) fn attr(&self, id: u32) -> u32 {
        self.attrs.get(id as usize).copied().unwrap_or(0)
    }

    pub(crate) fn text_to_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// The byte-fallback token for `b`: `<0xXX>` for SentencePiece (or the one-byte text if
    /// the vocabulary stores bytes that way), the GPT-2 character for byte-level BPE.
    pub(crate) fn byte_to_id(&self, b: u8) -> Option<u32> {
        match self.kind {
            VocabKind::Spm => self
                .text_to_id(&format!("<0x{b:02X}>"))
                .or_else(|| std::str::from_utf8(&[b]).ok().and_then(|s| self.text_to_id(s))),
            VocabKind::Bpe => {
                let mut buf = [0u8; 4];
                self.text_to_id(super::byte_level::byte_to_char(b).encode_utf8(&mut buf))
            }
        }
    }
}
