//! Run-time compilation of one CUDA C source to a CUBIN for one arch through NVRTC, with
//! the on-disk [`ModuleCache`] in front. We ask for SASS (`sm_90a`), not PTX, so loading
//! a module costs no driver JIT and the arch-specific instructions are available.
//!
//! cudarc's safe NVRTC wrapper returns PTX only, so the CUBIN is fetched through its raw
//! bindings here; every call's status is checked.

use std::ffi::{c_char, c_int, CString};
use std::time::Instant;

use cudarc::nvrtc::{result, sys};

use super::arch::Arch;
use super::module_cache::{CacheKey, ImageKind, ModuleCache, ModuleReport};
use crate::KernelError;

/// Options every module is compiled with (besides the arch). No fast-math: the ops are
/// memory-bound and are checked against the CPU reference to tight tolerances.
pub const OPTIONS: &[&str] = &["--std=c++17", "-default-device"];

/// `"nvrtc <major>.<minor>"`, part of the cache key.
pub fn version() -> Result<String, KernelError> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: both pointers are valid for the call.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| KernelError::Device { op: "nvrtc_version", detail: format!("{e:?}") })?;
    Ok(format!("nvrtc {major}.{minor}"))
}

/// The CUBIN of `source` for `arch`, from `cache` when present, else compiled and stored.
pub fn compile_cached(
    cache: &ModuleCache,
    module: &'static str,
    source: &str,
    arch: Arch,
    compiler: &str,
) -> Result<(Vec<u8>, ModuleReport), KernelError> {
    let t0 = Instant::now();
    let arch_name = arch.to_string();
    let key = CacheKey { module, source, arch: &arch_name, kind: ImageKind::Cubin, options: OPTIONS, compiler };
    if let Some(image) = cache.load(&key) {
        let report = ModuleReport { module, cache_hit: true, millis: ms_since(t0), store_error: None };
        return Ok((image, report));
    }
    let image = compile(module, source, arch)?;
    let store_error = cache.store(&key, &image).err().map(|e| format!("{}: {e}", cache.dir().display()));
    Ok((image, ModuleReport { module, cache_hit: false, millis: ms_since(t0), store_error }))
}

fn ms_since(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e3
}

/// Owns an `nvrtcProgram` so it is destroyed on every path.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram and destroyed only here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// Compiles `source` to a CUBIN for `arch`; a compile failure carries NVRTC's log.
pub fn compile(module: &str, source: &str, arch: Arch) -> Result<Vec<u8>, KernelError> {
    let fail =
        |detail: String| KernelError::Compile { module: module.to_string(), arch: arch.to_string(), log: detail };
    let src = CString::new(source).map_err(|_| fail("source contains a NUL byte".into()))?;
    let name = CString::new(format!("{module}.cu")).map_err(|_| fail("module name contains a NUL byte".into()))?;
    let prog = Program(result::create_program(&src, Some(&name)).map_err(|e| fail(format!("create: {e:?}")))?);

    let mut opts: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    opts.push(arch.nvrtc_option());
    // SAFETY: `prog` is a live program; options are converted to C strings by cudarc.
    if let Err(e) = unsafe { result::compile_program(prog.0, &opts) } {
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog.0) }.map(c_chars_to_string).unwrap_or_default();
        return Err(fail(format!("{e:?} with options {opts:?}:\n{log}")));
    }

    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; `size` is a valid out-pointer.
    unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }.result().map_err(|e| fail(format!("cubin size: {e:?}")))?;
    if size == 0 {
        return Err(fail("NVRTC produced an empty CUBIN (was a PTX-only arch given?)".into()));
    }
    let mut image = vec![0u8; size];
    // SAFETY: `image` holds exactly `size` bytes as NVRTC asked.
    unsafe { sys::nvrtcGetCUBIN(prog.0, image.as_mut_ptr().cast::<c_char>()) }
        .result()
        .map_err(|e| fail(format!("cubin: {e:?}")))?;
    Ok(image)
}

fn c_chars_to_string(chars: Vec<c_char>) -> String {
    let bytes: Vec<u8> = chars.into_iter().take_while(|&c| c != 0).map(|c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles every embedded module for `arch` without the cache, returning (module, CUBIN
/// bytes). Needs only libnvrtc, no GPU: a build check for the CUDA sources.
pub fn compile_all(arch: Arch) -> Result<Vec<(&'static str, usize)>, KernelError> {
    super::sources::MODULES
        .iter()
        .map(|&(module, body)| Ok((module, compile(module, &super::sources::full_source(body), arch)?.len())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::sources::{full_source, MODULES};

    /// NVRTC compiles on a machine without a GPU; these run where it is installed and
    /// `TESSERA_NVRTC_TESTS=1` (CI: scripts/setup fetches NVIDIA's libnvrtc wheel, scripts/test
    /// puts it on the library path), so a CUDA source that does not compile fails there, not
    /// on the device.
    fn enabled(test: &str) -> bool {
        let on = std::env::var_os("TESSERA_NVRTC_TESTS").is_some();
        if !on {
            eprintln!("{test}: skipped (TESSERA_NVRTC_TESTS not set)");
        }
        on
    }

    #[test]
    fn every_module_compiles_for_hopper() {
        if !enabled("every_module_compiles_for_hopper") {
            return;
        }
        eprintln!("{}", version().expect("NVRTC loads"));
        let arch = Arch::parse("sm_90a").unwrap();
        for (module, body) in MODULES {
            let cubin = compile(module, &full_source(body), arch).unwrap_or_else(|e| panic!("{e}"));
            // An ELF image: what cuModuleLoadData takes.
            assert_eq!(cubin.get(..4), Some(&b"\x7fELF"[..]), "{module}: not a CUBIN");
        }
    }

    #[test]
    fn a_broken_source_fails_with_the_compilers_log() {
        if !enabled("a_broken_source_fails_with_the_compilers_log") {
            return;
        }
        let arch = Arch::parse("sm_90a").unwrap();
        let src = full_source("extern \"C\" __global__ void k(float* p) { p[0] = undeclared_name; }");
        match compile("broken", &src, arch) {
            Err(KernelError::Compile { module, log, .. }) => {
                assert_eq!(module, "broken");
                assert!(log.contains("undeclared_name"), "log names the error: {log}");
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
    }
}
