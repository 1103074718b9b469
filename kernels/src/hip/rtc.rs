//! Run-time compilation of one module to an AMD code object through hipRTC, with the shared
//! on-disk [`ModuleCache`] in front (key: source hash + gfx processor + options + hipRTC
//! version, like CUDA's). Needs the HIP libraries and the ROCm device libraries, no GPU.

use std::ffi::{c_char, c_int, CString};
use std::sync::Arc;
use std::time::Instant;

use super::ffi::{self, c_str, HiprtcProgram, RtcApi};
use super::gfx::GfxArch;
use crate::cuda::module_cache::{CacheKey, ImageKind, ModuleCache, ModuleReport};
use crate::KernelError;

/// Options every module is compiled with (besides the arch). No fast math, as on CUDA.
pub const OPTIONS: &[&str] = &["-std=c++17", "-O3"];

/// `"hiprtc <major>.<minor>"`, part of the cache key.
pub fn version() -> Result<String, KernelError> {
    let api = ffi::rtc()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: both pointers are valid for the call.
    check(&api, "hiprtc_version", unsafe { (api.hiprtcVersion)(&mut major, &mut minor) })?;
    Ok(format!("hiprtc {major}.{minor}"))
}

fn check(api: &RtcApi, op: &'static str, code: c_int) -> Result<(), KernelError> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: hiprtcGetErrorString accepts any code.
    // SAFETY: hiprtcGetErrorString returns a static NUL-terminated string (or null).
    let msg = unsafe { c_str((api.hiprtcGetErrorString)(code), "unknown error") };
    Err(KernelError::Device { op, detail: format!("hipRTC error {code}: {msg}") })
}

/// The code object of `source` for `arch`, from `cache` when present, else compiled and stored.
pub fn compile_cached(
    cache: &ModuleCache,
    module: &'static str,
    source: &str,
    arch: &GfxArch,
    compiler: &str,
) -> Result<(Vec<u8>, ModuleReport), KernelError> {
    let t0 = Instant::now();
    let key =
        CacheKey { module, source, arch: arch.processor(), kind: ImageKind::AmdCodeObject, options: OPTIONS, compiler };
    if let Some(image) = cache.load(&key) {
        return Ok((image, ModuleReport { module, cache_hit: true, millis: ms_since(t0), store_error: None }));
    }
    let image = compile(module, source, arch)?;
    let store_error = cache.store(&key, &image).err().map(|e| format!("{}: {e}", cache.dir().display()));
    Ok((image, ModuleReport { module, cache_hit: false, millis: ms_since(t0), store_error }))
}

fn ms_since(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e3
}

/// Owns a `hiprtcProgram` so it is destroyed on every path.
struct Program {
    api: Arc<RtcApi>,
    prog: HiprtcProgram,
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by hiprtcCreateProgram and destroyed only here.
        let _ = unsafe { (self.api.hiprtcDestroyProgram)(&mut self.prog) };
    }
}

/// Compiles `source` for `arch`; a compile failure carries hipRTC's log.
pub fn compile(module: &str, source: &str, arch: &GfxArch) -> Result<Vec<u8>, KernelError> {
    let fail = |log: String| KernelError::Compile { module: module.to_string(), arch: arch.to_string(), log };
    let api = ffi::rtc()?;
    let src = CString::new(source).map_err(|_| fail("source contains a NUL byte".into()))?;
    let name = CString::new(format!("{module}.hip")).map_err(|_| fail("module name contains a NUL byte".into()))?;
    let mut prog: HiprtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings; no headers are passed (counts 0, null arrays).
    let code = unsafe {
        (api.hiprtcCreateProgram)(&mut prog, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null())
    };
    check(&api, "hiprtc_create", code).map_err(|e| fail(e.to_string()))?;
    let prog = Program { api: api.clone(), prog };

    let mut opts: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    opts.push(arch.hiprtc_option());
    // compat.h stops the build if the compiler's wavefront differs from the launch shapes'.
    opts.push(format!("-DTESSERA_EXPECT_WARP_SIZE={}", arch.wavefront_size()));
    let c_opts: Vec<CString> = opts.iter().filter_map(|o| CString::new(o.as_str()).ok()).collect();
    let ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `ptrs` holds `ptrs.len()` valid C strings alive for the call.
    let code = unsafe { (api.hiprtcCompileProgram)(prog.prog, ptrs.len() as c_int, ptrs.as_ptr()) };
    if code != 0 {
        let log = program_log(&prog);
        let status = check(&api, "hiprtc_compile", code).err().map(|e| e.to_string()).unwrap_or_default();
        return Err(fail(format!("{status} with options {opts:?}:\n{log}")));
    }
    let mut size = 0usize;
    // SAFETY: compiled program; valid out-pointer.
    check(&api, "hiprtc_code_size", unsafe { (api.hiprtcGetCodeSize)(prog.prog, &mut size) })
        .map_err(|e| fail(e.to_string()))?;
    if size == 0 {
        return Err(fail("hipRTC produced an empty code object".into()));
    }
    let mut image = vec![0u8; size];
    // SAFETY: `image` holds exactly `size` bytes as hipRTC asked.
    check(&api, "hiprtc_code", unsafe { (api.hiprtcGetCode)(prog.prog, image.as_mut_ptr().cast::<c_char>()) })
        .map_err(|e| fail(e.to_string()))?;
    Ok(image)
}

fn program_log(prog: &Program) -> String {
    let mut size = 0usize;
    // SAFETY: live program; valid out-pointer.
    if unsafe { (prog.api.hiprtcGetProgramLogSize)(prog.prog, &mut size) } != 0 || size == 0 {
        return String::new();
    }
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` holds `size` bytes as asked.
    if unsafe { (prog.api.hiprtcGetProgramLog)(prog.prog, buf.as_mut_ptr().cast::<c_char>()) } != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Compiles every module for `arch` without the cache, returning (module, code object bytes).
/// Needs hipRTC and the device libraries, no GPU: the run-time twin of check_sources.sh.
pub fn compile_all(arch: &GfxArch) -> Result<Vec<(&'static str, usize)>, KernelError> {
    super::sources::modules()
        .iter()
        .map(|&(module, body)| Ok((module, compile(module, &super::sources::full_source(body), arch)?.len())))
        .collect()
}
