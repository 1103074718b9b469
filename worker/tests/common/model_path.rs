//! Where the tests find the default model: `$TESSERA_MODEL_PATH`, else the cache
//! directory. Absent locally means skip; absent under CI is a failure, so a missing
//! download can never turn the comparison tests into silent passes.

use std::path::PathBuf;

pub fn default_model() -> Option<PathBuf> {
    let p = std::env::var_os("TESSERA_MODEL_PATH").map(PathBuf::from).or_else(|| {
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/tessera/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    });
    match p {
        Some(p) if p.exists() => Some(p),
        _ if std::env::var_os("CI").is_some() => panic!("the default model is missing under CI"),
        _ => {
            eprintln!("skipping: default model not found (run `tessera fetch-model`)");
            None
        }
    }
}
