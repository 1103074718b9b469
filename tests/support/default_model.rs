//! Where every crate's tests find the default model (SmolLM2-135M-Instruct Q4_1), one rule
//! for all of them (each test crate includes this file with `#[path]`):
//! `$TESSERA_MODEL_PATH`, which must exist when set (scripts/test sets it from `tessera
//! fetch-model`); else the file in the cache directory `tessera fetch-model` writes to
//! (`$TESSERA_CACHE_DIR`, else `$XDG_CACHE_HOME/tessera/models`, else
//! `~/.cache/tessera/models`, as src/default_model.rs). Absent on a developer's machine
//! means the caller skips (with a message); absent under CI (`CI` set) is a failure, so a
//! missing download can never turn the comparison tests into silent passes.

#![allow(dead_code)]

use std::path::PathBuf;

pub fn default_model() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TESSERA_MODEL_PATH") {
        let p = PathBuf::from(p);
        assert!(p.exists(), "TESSERA_MODEL_PATH={} does not exist", p.display());
        return Some(p);
    }
    let dir = std::env::var_os("TESSERA_CACHE_DIR").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from(".cache"))
            .join("tessera/models")
    });
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.exists() {
        return Some(p);
    }
    assert!(std::env::var_os("CI").is_none(), "the default model is missing under CI (looked for {})", p.display());
    eprintln!(
        "skipping: the default model is not at {} (run `tessera fetch-model` or set TESSERA_MODEL_PATH)",
        p.display()
    );
    None
}
