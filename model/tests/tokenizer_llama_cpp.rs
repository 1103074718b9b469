//! The default model's tokenizer against llama.cpp: token ids with and without special-token
//! parsing for 300+ strings (code, numbers, whitespace runs, many scripts, emoji and ZWJ
//! sequences, special tokens inside text, random mixtures), token pieces, detokenization
//! with and without special tokens for those ids and for random id sequences, and the
//! special ids and end-of-generation set. Fixtures: tests/fixtures/tokenizer/smollm2.*,
//! made by gen_llama_cpp.py.

mod tokenizer_support;

use tokenizer_support::{assert_none, compare_with_fixtures, default_model, load_gguf};

#[test]
fn smollm2_matches_llama_cpp() {
    let Some(path) = default_model() else { return };
    let tok = load_gguf(&path);
    assert_none(&compare_with_fixtures(&tok, "smollm2"));
}
