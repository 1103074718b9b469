//! The model's vocabulary as llguidance sees it: one byte string per token id, special
//! (control) tokens prefixed with toktrie's marker byte so no text can ever match them, and
//! the ids that end a sequence. Built once per model from the tokenizer.

use std::sync::Arc;

use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::error::ConstrainError;

/// The tokens of one model, ready for grammar matching. Cheap to clone.
#[derive(Clone)]
pub struct Vocabulary {
    env: TokEnv,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let trie = self.env.tok_trie();
        f.debug_struct("Vocabulary").field("size", &trie.vocab_size()).field("eos", &trie.eos_tokens()).finish()
    }
}

impl Vocabulary {
    /// Builds the vocabulary of `size` ids from `piece(id) -> (bytes, is_special)`: the bytes
    /// the token stands for (empty for an id with no text) and whether it is a control token
    /// (`<|im_end|>`: never produced by text). `eos_ids` are the ids that end a sequence;
    /// they are what a finished grammar allows (at least one, all `< size`).
    pub fn from_pieces(
        size: usize,
        eos_ids: &[u32],
        mut piece: impl FnMut(u32) -> (Vec<u8>, bool),
    ) -> Result<Self, ConstrainError> {
        // toktrie keeps ids in 24 bits and at most 1024 bytes per token.
        if size == 0 || size >= 0xff_ffff {
            return Err(ConstrainError::Vocabulary(format!("{size} tokens")));
        }
        let Some(&first_eos) = eos_ids.first() else {
            return Err(ConstrainError::Vocabulary("no end-of-sequence token".into()));
        };
        if let Some(bad) = eos_ids.iter().find(|&&id| id as usize >= size) {
            return Err(ConstrainError::Vocabulary(format!("end-of-sequence id {bad} is outside the {size} tokens")));
        }
        let words: Vec<Vec<u8>> = (0..size as u32)
            .map(|id| {
                let (bytes, special) = piece(id);
                if special && !bytes.is_empty() {
                    let mut marked = Vec::with_capacity(bytes.len() + 1);
                    marked.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    marked.extend_from_slice(&bytes);
                    marked
                } else {
                    bytes
                }
            })
            .collect();
        if let Some(id) = words.iter().position(|w| w.len() > 1000) {
            return Err(ConstrainError::Vocabulary(format!("token {id} is {} bytes long", words[id].len())));
        }
        let info = TokRxInfo::new(size as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos_ids);
        Ok(Self { env: Arc::new(TrieEnv { trie }) })
    }

    /// Number of token ids.
    pub fn size(&self) -> usize {
        self.env.tok_trie().vocab_size()
    }

    /// The ids that end a sequence.
    pub fn eos_ids(&self) -> &[u32] {
        self.env.tok_trie().eos_tokens()
    }

    /// The bytes of token `id` as the grammar sees them (special tokens carry the marker).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.env.tok_trie().token(id)
    }

    pub(crate) fn env(&self) -> &TokEnv {
        &self.env
    }
}

/// The trie plus a greedy tokenizer over it. llguidance tokenizes only the forced
/// prefixes of grammars with it; declaring it non-canonical keeps llguidance from forcing
/// tokens on its strength (the model's own tokenizer may split text differently).
struct TrieEnv {
    trie: TokTrie,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}
