//! Other tokenizer families against llama.cpp, on llama.cpp's own vocab-only test models
//! (`models/ggml-vocab-*.gguf` in the llama.cpp source): SentencePiece Llama (byte fallback,
//! space prefix, score merges, BOS), Llama 3 (ignore_merges, digit triples), Qwen2, Qwen3.5,
//! GPT-2, StarCoder, DeepSeek-Coder, Falcon, MPT, Refact, Command-R. Those GGUFs (1-11 MB
//! each) are not committed: scripts/test fetches them (scripts/fetch_llama_vocabs.py) and
//! sets TESSERA_LLAMA_VOCAB_DIR to their directory; unset, the test skips, except under CI,
//! where it fails. The expected ids are committed (tests/fixtures/tokenizer/vocab-*.jsonl,
//! gen_llama_cpp.py).

mod tokenizer_support;

use std::path::PathBuf;

use tokenizer_support::{assert_none, compare_with_fixtures, load_gguf};

const VOCABS: &[&str] = &[
    "llama-spm",
    "llama-bpe",
    "qwen2",
    "qwen35",
    "gpt-2",
    "starcoder",
    "deepseek-coder",
    "falcon",
    "mpt",
    "refact",
    "command-r",
];

#[test]
fn llama_cpp_test_vocabs_match_llama_cpp() {
    let Some(dir) = std::env::var_os("TESSERA_LLAMA_VOCAB_DIR").map(PathBuf::from) else {
        assert!(std::env::var_os("CI").is_none(), "TESSERA_LLAMA_VOCAB_DIR is unset under CI (scripts/test sets it)");
        eprintln!("skipping: set TESSERA_LLAMA_VOCAB_DIR (scripts/fetch_llama_vocabs.py DIR fetches the models)");
        return;
    };
    let mut bad = Vec::new();
    for name in VOCABS {
        let tok = load_gguf(&dir.join(format!("ggml-vocab-{name}.gguf")));
        bad.extend(compare_with_fixtures(&tok, &format!("vocab-{name}")));
    }
    assert_none(&bad);
}
