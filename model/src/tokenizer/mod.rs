//! Text <-> token ids for the served model. GGUF vocabularies are tokenized by Tessera's own
//! implementation of llama.cpp's algorithms (byte-level BPE with llama.cpp's named
//! pre-tokenizers, SentencePiece with byte fallback), so prompts get exactly the ids
//! llama.cpp would feed the same model; a Hugging Face `tokenizer.json` goes through the
//! `tokenizers` crate. Both sit behind one [`Tokenizer`] with the same encode / decode /
//! streaming API and the special tokens the generator stops on.
//!
//! Layout: `spec` (the metadata as data) and `gguf` (filling it from a file), `vocab`
//! (resolved ids, attributes and defaults), `special` (splitting special tokens out of
//! text), `pretokenize` + `byte_level` + `bpe` (BPE), `spm` (SentencePiece), `native`
//! (the GGUF tokenizer), `hf` (tokenizer.json), `stream` (incremental detokenizer).

mod bpe;
mod byte_level;
mod error;
mod gguf;
mod hf;
mod native;
mod pretokenize;
mod spec;
mod special;
mod spm;
mod stream;
mod vocab;

use std::path::Path;

pub use error::{Result, TokenizerError};
pub use spec::{TokenType, TokenizerSpec, VocabKind};
pub use stream::DecodeStream;

use hf::HfTokenizer;
use native::NativeTokenizer;

/// A tokenizer for one model. Cheap to share (`&self` everywhere); build it once.
pub struct Tokenizer {
    pub(crate) inner: Inner,
    special: SpecialTokens,
}

pub(crate) enum Inner {
    Native(Box<NativeTokenizer>),
    Hf(HfTokenizer),
}

/// Ids with a role, resolved at load.
struct SpecialTokens {
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    /// Sorted; what ends generation.
    stop: Vec<u32>,
    add_bos: bool,
    /// For Hugging Face files: the chat template from `tokenizer_config.json`.
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Builds the llama.cpp-compatible tokenizer for a vocabulary description.
    pub fn from_spec(spec: &TokenizerSpec) -> Result<Self> {
        let native = NativeTokenizer::new(spec)?;
        let v = &native.vocab;
        let special = SpecialTokens {
            bos: v.special.bos,
            eos: v.special.eos,
            eot: v.special.eot,
            stop: v.eog.clone(),
            add_bos: v.add_bos,
            chat_template: None,
        };
        Ok(Self { inner: Inner::Native(Box::new(native)), special })
    }

    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(file: &crate::gguf::GgufFile) -> Result<Self> {
        Self::from_spec(&TokenizerSpec::from_gguf(file)?)
    }

    /// Loads a Hugging Face `tokenizer.json`. BOS/EOS and the chat template are taken from
    /// `tokenizer_config.json` and extra stop ids from `generation_config.json` in the same
    /// directory, when those exist.
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        let hf = HfTokenizer::from_file(path)?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let config = hf::read_special(dir)?;
        let id_of = |text: &Option<String>| text.as_ref().and_then(|t| hf.vocab.get(t).copied());
        let bos = id_of(&config.bos);
        let eos = id_of(&config.eos);
        let eot = vocab::EOT_NAMES.iter().find_map(|name| hf.vocab.get(*name).copied());
        let mut stop: Vec<u32> = vocab::EOG_NAMES.iter().filter_map(|name| hf.vocab.get(*name).copied()).collect();
        stop.extend(eos.iter().chain(eot.iter()).chain(config.generation_eos.iter()));
        stop.retain(|&id| (id as usize) < hf.id_to_text.len());
        stop.sort_unstable();
        stop.dedup();
        // Whether the post-processor prepends BOS shows in what it does to empty text.
        let add_bos = bos.is_some() && hf.encode("", true, false)?.first().copied() == bos;
        let special = SpecialTokens { bos, eos, eot, stop, add_bos, chat_template: config.chat_template };
        Ok(Self { inner: Inner::Hf(hf), special })
    }

    /// Token ids for `text`. `add_special` adds what the model adds around a sequence (BOS,
    /// and EOS for the rare model that wants it); `parse_special` lets special-token texts
    /// such as `<|im_start|>` in `text` become their ids (turn it off for user content).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        match &self.inner {
            Inner::Native(n) => n.encode(text, add_special, parse_special),
            Inner::Hf(h) => h.encode(text, add_special, parse_special),
        }
    }

    /// The text for `ids` (llama.cpp's `detokenize`). With `skip_special`, control tokens
    /// render as nothing. Bytes that are not valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        match &self.inner {
            Inner::Native(n) => Ok(into_string(n.decode(ids, skip_special)?)),
            Inner::Hf(h) => h.decode(ids, skip_special),
        }
    }

    /// Like [`Tokenizer::decode`] but returns the raw bytes (GGUF vocabularies), so output
    /// that splits a character is not altered.
    pub fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>> {
        match &self.inner {
            Inner::Native(n) => n.decode(ids, skip_special),
            Inner::Hf(h) => Ok(h.decode(ids, skip_special)?.into_bytes()),
        }
    }

    /// The bytes one token stands for, special tokens included (llama.cpp's
    /// `token_to_piece(special = true)`). A byte-level token may be part of a character.
    pub fn token_to_piece(&self, id: u32) -> Result<Vec<u8>> {
        match &self.inner {
            Inner::Native(n) => {
                let mut out = Vec::new();
                n.piece(id, true, &mut out)?;
                Ok(out)
            }
            Inner::Hf(h) => Ok(h.decode(&[id], false)?.into_bytes()),
        }
    }

    /// A streaming detokenizer; see [`DecodeStream`].
    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream<'_> {
        DecodeStream::new(self, skip_special)
    }

    /// Number of token ids (the model's embedding rows should match).
    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Inner::Native(n) => n.vocab.len(),
            Inner::Hf(h) => h.id_to_text.len(),
        }
    }

    /// The vocabulary text of `id` (`<|im_end|>`, `Ġthe`, `<0x0A>`), as stored.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        match &self.inner {
            Inner::Native(n) => n.vocab.tokens.get(id as usize).map(String::as_str),
            Inner::Hf(h) => h.id_to_text.get(id as usize).and_then(|t| t.as_deref()),
        }
    }

    /// The id whose vocabulary text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        match &self.inner {
            Inner::Native(n) => n.vocab.text_to_id(text),
            Inner::Hf(h) => h.vocab.get(text).copied(),
        }
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.special.bos
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.special.eos
    }

    /// The end-of-turn token (`<|eot_id|>`, `<|im_end|>`, ...), from metadata or by name.
    pub fn eot_token_id(&self) -> Option<u32> {
        self.special.eot
    }

    /// Whether `encode(.., add_special = true, ..)` starts with BOS.
    pub fn add_bos_token(&self) -> bool {
        self.special.add_bos
    }

    /// Ids that end generation, sorted: EOS, EOT/EOM and the other end-of-generation
    /// tokens llama.cpp recognises by name (for GGUF vocabularies, exactly llama.cpp's
    /// `special_eog_ids`, fill-in-the-middle separators included).
    pub fn stop_token_ids(&self) -> &[u32] {
        &self.special.stop
    }

    pub fn is_stop_token(&self, id: u32) -> bool {
        self.special.stop.binary_search(&id).is_ok()
    }

    /// The chat template a Hugging Face `tokenizer_config.json` carried, if any (GGUF files
    /// carry theirs in `tokenizer.chat_template`, see `chat_template`).
    pub fn hf_chat_template(&self) -> Option<&str> {
        self.special.chat_template.as_deref()
    }
}

// The gateway shares one tokenizer between request tasks.
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<Tokenizer>();
};

fn into_string(bytes: Vec<u8>) -> String {
    match String::from_utf8(bytes) {
        Ok(s) => s,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    }
}
