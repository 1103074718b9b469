//! The few HIP runtime, hipRTC, rocBLAS and RCCL functions the backend uses, declared by hand
//! and resolved at run time with libloading.
//!
//! Why not the `hip-sys` crate: its build script links libamdhip64 at build time
//! (`cargo:rustc-link-lib`), so a `--features hip` binary would not even start on a machine
//! without ROCm, and its pre-generated bindings follow ROCm 6 (`hipDeviceProp_t` changed
//! layout in 6.0; Debian bookworm ships 5.2). Loading at run time keeps one binary for every
//! machine: without the libraries, [`Device::new`](super::Device::new) is a clear error.
//! Only ABI-stable entry points are declared (integer error codes, opaque handles, enum
//! values that rocBLAS and NCCL/RCCL have kept since their first releases); the one struct
//! read, the device properties, is scanned for its arch string instead of being laid out.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Arc, OnceLock};

use libloading::Library;

use crate::KernelError;

/// Opaque runtime handles.
pub type HipStream = *mut c_void;
pub type HipModule = *mut c_void;
pub type HipFunction = *mut c_void;
pub type HiprtcProgram = *mut c_void;
pub type RocblasHandle = *mut c_void;
pub type NcclComm = *mut c_void;

/// `hipMemcpyKind` values (unchanged since HIP's first release).
pub const HIP_MEMCPY_HOST_TO_DEVICE: c_int = 1;
pub const HIP_MEMCPY_DEVICE_TO_HOST: c_int = 2;
pub const HIP_MEMCPY_DEVICE_TO_DEVICE: c_int = 3;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawNcclId {
    pub internal: [u8; 128],
}

/// Library file names tried in order, newest ABI first.
pub const HIP_LIBS: &[&str] = &["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"];
/// hipRTC moved out of libamdhip64 in ROCm 6; in 5.x the runtime library exports it.
pub const HIPRTC_LIBS: &[&str] = &["libhiprtc.so", "libhiprtc.so.6", "libamdhip64.so", "libamdhip64.so.5"];
pub const ROCBLAS_LIBS: &[&str] = &["librocblas.so", "librocblas.so.4", "librocblas.so.3", "librocblas.so.0"];
pub const RCCL_LIBS: &[&str] = &["librccl.so", "librccl.so.1"];

/// Opens the first of `names` that loads. The error names the component, every file tried
/// with the loader's reason for the last one, and what to install.
pub fn open_first(what: &'static str, names: &[&str], install: &str) -> Result<Library, KernelError> {
    let mut last = String::from("no candidates");
    for name in names {
        // SAFETY: loading a shared library runs its initialisers; these are the vendor's
        // runtime libraries, loaded as any program linked against them would.
        match unsafe { Library::new(*name) } {
            Ok(lib) => return Ok(lib),
            Err(e) => last = e.to_string(),
        }
    }
    Err(KernelError::Device {
        op: "hip_load",
        detail: format!("{what} is not available: none of {names:?} could be loaded (last: {last}); {install}"),
    })
}

/// Declares a table of C functions resolved from one library.
macro_rules! api_table {
    ($(#[$m:meta])* $name:ident { $( $f:ident : fn($($a:ty),*) $(-> $r:ty)? ; )* }) => {
        $(#[$m])*
        #[allow(non_snake_case)]
        pub struct $name {
            $( pub $f: unsafe extern "C" fn($($a),*) $(-> $r)?, )*
            _lib: Library,
        }

        impl $name {
            /// Resolves every function of the table in `lib`.
            #[allow(non_snake_case)]
            pub fn resolve(lib: Library) -> Result<Self, KernelError> {
                $(
                    // SAFETY: the symbol is declared with the C signature of the vendor's
                    // header; the pointer is only used while `_lib` keeps the library loaded.
                    let $f = unsafe {
                        *lib.get::<unsafe extern "C" fn($($a),*) $(-> $r)?>(concat!(stringify!($f), "\0").as_bytes())
                            .map_err(|e| KernelError::Device {
                                op: "hip_load",
                                detail: format!("{}: missing {}: {e}", stringify!($name), stringify!($f)),
                            })?
                    };
                )*
                Ok($name { $( $f, )* _lib: lib })
            }
        }
    };
}

api_table! {
    /// The HIP runtime (libamdhip64).
    HipApi {
        hipInit: fn(c_uint) -> c_int;
        hipGetDeviceCount: fn(*mut c_int) -> c_int;
        hipSetDevice: fn(c_int) -> c_int;
        hipGetDeviceProperties: fn(*mut c_void, c_int) -> c_int;
        hipMemGetInfo: fn(*mut usize, *mut usize) -> c_int;
        hipMalloc: fn(*mut *mut c_void, usize) -> c_int;
        hipFree: fn(*mut c_void) -> c_int;
        hipMemcpy: fn(*mut c_void, *const c_void, usize, c_int) -> c_int;
        hipMemset: fn(*mut c_void, c_int, usize) -> c_int;
        hipStreamCreate: fn(*mut HipStream) -> c_int;
        hipStreamDestroy: fn(HipStream) -> c_int;
        hipStreamSynchronize: fn(HipStream) -> c_int;
        hipModuleLoadData: fn(*mut HipModule, *const c_void) -> c_int;
        hipModuleUnload: fn(HipModule) -> c_int;
        hipModuleGetFunction: fn(*mut HipFunction, HipModule, *const c_char) -> c_int;
        hipModuleLaunchKernel: fn(HipFunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, HipStream,
            *mut *mut c_void, *mut *mut c_void) -> c_int;
        hipGetErrorString: fn(c_int) -> *const c_char;
    }
}

api_table! {
    /// hipRTC: run-time compilation of HIP C++ to a code object.
    RtcApi {
        hiprtcVersion: fn(*mut c_int, *mut c_int) -> c_int;
        hiprtcCreateProgram: fn(*mut HiprtcProgram, *const c_char, *const c_char, c_int, *const *const c_char,
            *const *const c_char) -> c_int;
        hiprtcCompileProgram: fn(HiprtcProgram, c_int, *const *const c_char) -> c_int;
        hiprtcGetProgramLogSize: fn(HiprtcProgram, *mut usize) -> c_int;
        hiprtcGetProgramLog: fn(HiprtcProgram, *mut c_char) -> c_int;
        hiprtcGetCodeSize: fn(HiprtcProgram, *mut usize) -> c_int;
        hiprtcGetCode: fn(HiprtcProgram, *mut c_char) -> c_int;
        hiprtcDestroyProgram: fn(*mut HiprtcProgram) -> c_int;
        hiprtcGetErrorString: fn(c_int) -> *const c_char;
    }
}

api_table! {
    /// rocBLAS: one mixed-precision GEMM entry point.
    RocblasApi {
        rocblas_create_handle: fn(*mut RocblasHandle) -> c_int;
        rocblas_destroy_handle: fn(RocblasHandle) -> c_int;
        rocblas_set_stream: fn(RocblasHandle, HipStream) -> c_int;
        rocblas_gemm_ex: fn(RocblasHandle, c_int, c_int, c_int, c_int, c_int, *const c_void, *const c_void, c_int,
            c_int, *const c_void, c_int, c_int, *const c_void, *const c_void, c_int, c_int, *mut c_void, c_int,
            c_int, c_int, c_int, i32, u32) -> c_int;
    }
}

api_table! {
    /// RCCL, whose API is NCCL's.
    RcclApi {
        ncclGetUniqueId: fn(*mut u8) -> c_int;
        ncclCommInitRank: fn(*mut NcclComm, c_int, RawNcclId, c_int) -> c_int;
        ncclCommAbort: fn(NcclComm) -> c_int;
        ncclAllReduce: fn(*const c_void, *mut c_void, usize, c_int, c_int, NcclComm, HipStream) -> c_int;
        ncclAllGather: fn(*const c_void, *mut c_void, usize, c_int, NcclComm, HipStream) -> c_int;
        ncclSend: fn(*const c_void, usize, c_int, c_int, NcclComm, HipStream) -> c_int;
        ncclRecv: fn(*mut c_void, usize, c_int, c_int, NcclComm, HipStream) -> c_int;
        ncclGetErrorString: fn(c_int) -> *const c_char;
    }
}

/// rocBLAS enum values (rocblas-types.h).
pub mod rocblas {
    pub const OPERATION_NONE: i32 = 111;
    pub const OPERATION_TRANSPOSE: i32 = 112;
    pub const DATATYPE_F32_R: i32 = 151;
    pub const DATATYPE_BF16_R: i32 = 168;
    pub const GEMM_ALGO_STANDARD: i32 = 0;
}

/// NCCL / RCCL enum values (nccl.h).
pub mod nccl {
    pub const UINT32: i32 = 3;
    pub const FLOAT32: i32 = 7;
    pub const BFLOAT16: i32 = 9;
    pub const SUM: i32 = 0;
}

/// Install hint for the HIP runtime.
pub const HIP_INSTALL: &str =
    "install ROCm (Debian: apt-get install libamdhip64-5 rocm-device-libs) on a machine with an AMD GPU";

/// One loaded copy per process of each library; a failed load is remembered (as its message)
/// so every caller gets the same clear error without retrying dlopen.
fn cached<T>(
    cell: &'static OnceLock<Result<Arc<T>, String>>,
    load: impl FnOnce() -> Result<T, KernelError>,
) -> Result<Arc<T>, KernelError> {
    cell.get_or_init(|| load().map(Arc::new).map_err(|e| e.to_string()))
        .clone()
        .map_err(|detail| KernelError::Device { op: "hip_load", detail })
}

pub fn hip() -> Result<Arc<HipApi>, KernelError> {
    static CELL: OnceLock<Result<Arc<HipApi>, String>> = OnceLock::new();
    cached(&CELL, || HipApi::resolve(open_first("the HIP runtime", HIP_LIBS, HIP_INSTALL)?))
}

pub fn rtc() -> Result<Arc<RtcApi>, KernelError> {
    static CELL: OnceLock<Result<Arc<RtcApi>, String>> = OnceLock::new();
    cached(&CELL, || RtcApi::resolve(open_first("hipRTC", HIPRTC_LIBS, HIP_INSTALL)?))
}

pub fn rocblas() -> Result<Arc<RocblasApi>, KernelError> {
    static CELL: OnceLock<Result<Arc<RocblasApi>, String>> = OnceLock::new();
    cached(&CELL, || RocblasApi::resolve(open_first("rocBLAS", ROCBLAS_LIBS, "install rocBLAS (librocblas)")?))
}

pub fn rccl() -> Result<Arc<RcclApi>, KernelError> {
    static CELL: OnceLock<Result<Arc<RcclApi>, String>> = OnceLock::new();
    cached(&CELL, || RcclApi::resolve(open_first("RCCL", RCCL_LIBS, "install RCCL (librccl) for multi-GPU")?))
}

/// A C string from a library, or `fallback` for a null pointer.
///
/// # Safety
/// `p` is null or points at a NUL-terminated string that outlives the call (the HIP,
/// hipRTC and RCCL error-string functions return static ones).
pub unsafe fn c_str(p: *const c_char, fallback: &str) -> String {
    if p.is_null() {
        return fallback.to_string();
    }
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

impl HipApi {
    /// `Ok` for hipSuccess, else a [`KernelError::Device`] naming `op` and HIP's message.
    pub fn check(&self, op: &'static str, code: c_int) -> Result<(), KernelError> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: hipGetErrorString accepts any code.
        // SAFETY: hipGetErrorString returns a static NUL-terminated string (or null).
        let msg = unsafe { c_str((self.hipGetErrorString)(code), "unknown error") };
        Err(KernelError::Device { op, detail: format!("HIP error {code}: {msg}") })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_names_every_candidate_and_the_fix() {
        let err = open_first("RCCL", &["libtessera-absent-1.so", "libtessera-absent-2.so"], "install RCCL")
            .expect_err("a library that does not exist loaded");
        let msg = err.to_string();
        for part in ["RCCL is not available", "libtessera-absent-1.so", "libtessera-absent-2.so", "install RCCL"] {
            assert!(msg.contains(part), "{part:?} missing from {msg:?}");
        }
    }

    #[test]
    fn a_library_without_the_symbols_is_a_clear_error() {
        // libc loads everywhere and has none of RCCL's symbols.
        let lib = open_first("libc", &["libc.so.6"], "").unwrap();
        let msg = RcclApi::resolve(lib).err().expect("libc resolved as RCCL").to_string();
        assert!(msg.contains("RcclApi: missing ncclGetUniqueId"), "{msg}");
    }
}
