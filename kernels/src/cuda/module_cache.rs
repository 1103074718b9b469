//! On-disk cache of compiled kernel modules (CUBIN for CUDA, AMD code objects for HIP),
//! keyed by a hash of everything that decides the output: the source text, the target arch,
//! the compiler options and the compiler version. NVRTC takes ~0.2 s per module; a warm
//! start reads a file instead. The HIP backend (kernels::hip) shares it: its arch names
//! (`gfx90a`) never collide with CUDA's (`sm_90a`).
//!
//! Directory: `$TESSERA_CACHE_DIR/kernels`, else `$XDG_CACHE_HOME/tessera/kernels`, else
//! `~/.cache/tessera/kernels`. A file is named `<module>-<arch>-<32 hex digits>.<ext>` and
//! written to a temporary name then renamed, so concurrent workers on one host never read a
//! half-written module. A missing, unreadable or non-ELF file is a miss, never an error: the
//! caller recompiles. Pure Rust: tested without a GPU.

use std::fs;
use std::path::{Path, PathBuf};

/// The kind of compiled image a key names: decides the file extension and what a plausible
/// file starts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    /// NVIDIA CUBIN (ELF).
    Cubin,
    /// AMD GPU code object: ELF, or a clang offload bundle wrapping one.
    AmdCodeObject,
}

impl ImageKind {
    pub fn extension(self) -> &'static str {
        match self {
            ImageKind::Cubin => "cubin",
            ImageKind::AmdCodeObject => "co",
        }
    }

    /// Whether `bytes` can be an image of this kind (a cheap check of the magic bytes).
    pub fn plausible(self, bytes: &[u8]) -> bool {
        match self {
            ImageKind::Cubin => bytes.starts_with(b"\x7fELF"),
            ImageKind::AmdCodeObject => bytes.starts_with(b"\x7fELF") || bytes.starts_with(b"__CLANG_OFFLOAD_BUNDLE__"),
        }
    }
}

/// Everything a compiled module depends on; [`CacheKey::hash`] is its stable digest.
#[derive(Debug, Clone, Copy)]
pub struct CacheKey<'a> {
    /// Module name (file stem of the `.cu` source), for readable file names.
    pub module: &'a str,
    /// The complete source text handed to the compiler.
    pub source: &'a str,
    /// The target as the compiler is given it: `sm_90a` (CUDA), `gfx90a` (HIP).
    pub arch: &'a str,
    pub kind: ImageKind,
    /// Compiler options other than the arch, in the order given.
    pub options: &'a [&'a str],
    /// The compiler's version, e.g. `"nvrtc 13.0"`: a new compiler may emit other code.
    pub compiler: &'a str,
}

impl CacheKey<'_> {
    /// 128-bit FNV-1a over the fields, each followed by a 0xff separator byte (which
    /// cannot occur in UTF-8 text, so field boundaries cannot shift). Stable across
    /// builds and platforms, unlike `std`'s `DefaultHasher`.
    pub fn hash(&self) -> u128 {
        let mut h = Fnv128::new();
        h.field(self.module.as_bytes());
        h.field(self.source.as_bytes());
        h.field(self.arch.as_bytes());
        for o in self.options {
            h.field(o.as_bytes());
        }
        h.field(self.compiler.as_bytes());
        h.0
    }

    /// `<module>-<arch>-<hash>.<ext>`; module and arch are reduced to `[A-Za-z0-9_]`.
    pub fn file_name(&self) -> String {
        let clean = |s: &str| -> String {
            s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect()
        };
        format!("{}-{}-{:032x}.{}", clean(self.module), clean(self.arch), self.hash(), self.kind.extension())
    }
}

struct Fnv128(u128);

impl Fnv128 {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013B;

    fn new() -> Self {
        Fnv128(Self::OFFSET)
    }

    fn byte(&mut self, b: u8) {
        self.0 ^= u128::from(b);
        self.0 = self.0.wrapping_mul(Self::PRIME);
    }

    fn field(&mut self, bytes: &[u8]) {
        bytes.iter().for_each(|&b| self.byte(b));
        self.byte(0xff);
    }
}

/// How a module was obtained, for start-up reports and benchmarks.
#[derive(Debug, Clone)]
pub struct ModuleReport {
    pub module: &'static str,
    pub cache_hit: bool,
    /// Milliseconds spent compiling or reading the cache.
    pub millis: f64,
    /// Set when the compiled image could not be written to the cache.
    pub store_error: Option<String>,
}

/// The default cache directory (see the module comment for the order of lookups).
pub fn default_cache_dir() -> PathBuf {
    cache_dir_from(|k| std::env::var_os(k))
}

/// [`default_cache_dir`] with the environment passed in (tests).
fn cache_dir_from(env: impl Fn(&str) -> Option<std::ffi::OsString>) -> PathBuf {
    if let Some(d) = env("TESSERA_CACHE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("kernels");
    }
    let base = env("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("tessera").join("kernels")
}

/// A directory of compiled modules.
#[derive(Debug, Clone)]
pub struct ModuleCache {
    dir: PathBuf,
}

impl ModuleCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        ModuleCache { dir: dir.into() }
    }

    /// The cache at [`default_cache_dir`].
    pub fn default_location() -> Self {
        Self::new(default_cache_dir())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path_for(&self, key: &CacheKey) -> PathBuf {
        self.dir.join(key.file_name())
    }

    /// The cached image for `key`, if a plausible one (see [`ImageKind::plausible`]) is on disk.
    pub fn load(&self, key: &CacheKey) -> Option<Vec<u8>> {
        let bytes = fs::read(self.path_for(key)).ok()?;
        key.kind.plausible(&bytes).then_some(bytes)
    }

    /// Stores `image` for `key` (temporary file + rename). Errors are returned for the
    /// caller to report; a failed store only costs a recompile next start.
    pub fn store(&self, key: &CacheKey, image: &[u8]) -> std::io::Result<PathBuf> {
        fs::create_dir_all(&self.dir)?;
        let path = self.path_for(key);
        // Unique per process and per call: threads of one process (one per GPU) may store
        // the same module at once.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = self.dir.join(format!("{}.tmp{}-{n}", key.file_name(), std::process::id()));
        fs::write(&tmp, image)?;
        if let Err(e) = fs::rename(&tmp, &path) {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    fn key<'a>(source: &'a str, arch: &'a str, options: &'a [&'a str], compiler: &'a str) -> CacheKey<'a> {
        CacheKey { module: "norm", source, arch, kind: ImageKind::Cubin, options, compiler }
    }

    #[test]
    fn fnv128_matches_published_vectors() {
        // FNV-1a 128 of "" is the offset basis; of "a" (from the FNV reference tables).
        assert_eq!(Fnv128::new().0, 0x6c62272e07bb014262b821756295c58d);
        let mut h = Fnv128::new();
        h.byte(b'a');
        assert_eq!(h.0, 0xd228cb696f1a8caf78912b704e4a8964);
    }

    #[test]
    fn every_field_changes_the_key() {
        let base = key("__global__ void k() {}", "sm_90a", &["-O3"], "nvrtc 13.0");
        let h = base.hash();
        assert_eq!(h, key("__global__ void k() {}", "sm_90a", &["-O3"], "nvrtc 13.0").hash(), "deterministic");
        assert_ne!(h, key("__global__ void k() { }", "sm_90a", &["-O3"], "nvrtc 13.0").hash(), "source");
        assert_ne!(h, key("__global__ void k() {}", "sm_90", &["-O3"], "nvrtc 13.0").hash(), "arch");
        assert_ne!(h, key("__global__ void k() {}", "sm_90a", &["-O2"], "nvrtc 13.0").hash(), "options");
        assert_ne!(h, key("__global__ void k() {}", "sm_90a", &[], "nvrtc 13.0").hash(), "no options");
        assert_ne!(h, key("__global__ void k() {}", "sm_90a", &["-O3"], "nvrtc 13.1").hash(), "compiler");
        assert_ne!(h, CacheKey { module: "rope", ..base }.hash(), "module");
        // Moving text across a field boundary must not collide.
        assert_ne!(key("ab", "sm_90a", &["c"], "x").hash(), key("a", "sm_90a", &["bc"], "x").hash());
    }

    #[test]
    fn file_name_shows_module_and_arch() {
        let k = CacheKey { module: "we/ird name", ..key("s", "sm_90a", &[], "nvrtc 13.0") };
        let name = k.file_name();
        assert!(name.starts_with("we_ird_name-sm_90a-"), "{name}");
        assert!(name.ends_with(".cubin"));
        assert_eq!(name.len(), "we_ird_name-sm_90a-".len() + 32 + ".cubin".len());
    }

    #[test]
    fn amd_code_objects_have_their_own_names_and_magic() {
        let k = CacheKey { arch: "gfx90a", kind: ImageKind::AmdCodeObject, ..key("s", "sm_90a", &[], "hiprtc 5.2") };
        let name = k.file_name();
        assert!(name.starts_with("norm-gfx90a-") && name.ends_with(".co"), "{name}");
        assert_ne!(k.hash(), CacheKey { arch: "gfx942", ..k }.hash(), "arch");
        assert!(ImageKind::AmdCodeObject.plausible(b"__CLANG_OFFLOAD_BUNDLE__\x02\x00"));
        assert!(ImageKind::AmdCodeObject.plausible(b"\x7fELF\x02"));
        assert!(!ImageKind::AmdCodeObject.plausible(b"garbage"));
        assert!(!ImageKind::Cubin.plausible(b"__CLANG_OFFLOAD_BUNDLE__"), "a bundle is no CUBIN");
    }

    #[test]
    fn cuda_keys_hash_the_printed_arch() {
        // The key hashes the arch as printed, so `Arch` and its string name the same file.
        let arch = super::super::arch::Arch::parse("sm_90a").unwrap().to_string();
        assert_eq!(key("s", &arch, &[], "nvrtc 13.0").hash(), key("s", "sm_90a", &[], "nvrtc 13.0").hash());
    }

    #[test]
    fn cache_dir_lookup_order() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| OsString::from(*v))
        };
        assert_eq!(cache_dir_from(env(&[("TESSERA_CACHE_DIR", "/c"), ("HOME", "/h")])), PathBuf::from("/c/kernels"));
        assert_eq!(
            cache_dir_from(env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")])),
            PathBuf::from("/x/tessera/kernels")
        );
        assert_eq!(cache_dir_from(env(&[("HOME", "/h")])), PathBuf::from("/h/.cache/tessera/kernels"));
        assert_eq!(
            cache_dir_from(env(&[("TESSERA_CACHE_DIR", ""), ("HOME", "/h")])),
            PathBuf::from("/h/.cache/tessera/kernels")
        );
    }

    #[test]
    fn store_then_load_and_reject_non_elf() {
        let dir = std::env::temp_dir().join(format!("tessera-kcache-test-{}", std::process::id()));
        let cache = ModuleCache::new(&dir);
        let k = key("src", "sm_90a", &[], "nvrtc 13.0");
        assert!(cache.load(&k).is_none(), "empty cache is a miss");
        let image = b"\x7fELF\x02\x01\x01 fake cubin".to_vec();
        let path = cache.store(&k, &image).unwrap();
        assert_eq!(cache.load(&k).as_deref(), Some(&image[..]));
        let other = key("src2", "sm_90a", &[], "nvrtc 13.0");
        assert!(cache.load(&other).is_none(), "other source is a miss");
        fs::write(&path, b"garbage").unwrap();
        assert!(cache.load(&k).is_none(), "a corrupt file is a miss");
        let leftovers: Vec<_> = fs::read_dir(&dir).unwrap().filter_map(Result::ok).collect();
        assert_eq!(leftovers.len(), 1, "no temporary files left behind");
        fs::remove_dir_all(&dir).unwrap();
    }
}
