//! One AMD GPU: the runtime loaded at run time, a stream, device buffers, and the kernel
//! modules compiled by hipRTC for the device's gfx arch and loaded with hipModuleLoadData.
//! Kernels are launched by name with a [`LaunchShape`] sized for the device's wavefront.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::marker::PhantomData;
use std::sync::Arc;

use super::ffi::{self, HipApi, HipFunction, HipModule, HipStream};
use super::gfx::GfxArch;
use super::launch::LaunchShape;
use super::{rtc, sources, Elem};
use crate::cuda::module_cache::{ModuleCache, ModuleReport};
use crate::KernelError;

/// An AMD GPU with its stream and loaded modules. Every call first makes the device current
/// on the calling thread (HIP's current device is per thread).
pub struct Device {
    api: Arc<HipApi>,
    ordinal: usize,
    name: String,
    arch: GfxArch,
    stream: HipStream,
    modules: HashMap<&'static str, HipModule>,
}

// SAFETY: the stream and modules are runtime handles usable from any thread once the device is
// made current, which every method does; `Device` is not `Sync`.
unsafe impl Send for Device {}

/// hipErrorNoDevice and hipErrorInvalidDevice: what hipInit returns on a machine without a
/// usable AMD GPU (no /dev/kfd, or no permission on it).
const HIP_NO_DEVICE: [i32; 2] = [100, 101];

/// Number of AMD GPUs the runtime sees (0 when there are none, or /dev/kfd is missing); an
/// error when the runtime itself is missing or fails otherwise.
pub fn device_count() -> Result<usize, KernelError> {
    let api = ffi::hip()?;
    // SAFETY: plain calls with valid out-pointers.
    unsafe {
        let init = (api.hipInit)(0);
        if HIP_NO_DEVICE.contains(&init) {
            return Ok(0);
        }
        api.check("hip_init", init)?;
        let mut n = 0;
        api.check("hip_device_count", (api.hipGetDeviceCount)(&mut n))?;
        Ok(n.max(0) as usize)
    }
}

impl Device {
    /// Opens GPU `ordinal`: loads the runtime, reads the device's name and gfx arch, makes a
    /// stream. Kernel modules are compiled separately ([`Device::load_modules`]).
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        let api = ffi::hip()?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(KernelError::Device {
                op: "hip_device",
                detail: format!(
                    "AMD GPU {ordinal} requested, the HIP runtime sees {count} (is /dev/kfd present and readable?)"
                ),
            });
        }
        // SAFETY: valid ordinal (checked above).
        api.check("hip_set_device", unsafe { (api.hipSetDevice)(ordinal as i32) })?;
        // hipDeviceProp_t is ~800 bytes in ROCm 5 and ~1.5 KiB in 6; 16 KiB covers both with room.
        let mut props = vec![0u64; 2048];
        // SAFETY: the buffer is larger than any release's struct and 8-byte aligned.
        api.check("hip_device_properties", unsafe {
            (api.hipGetDeviceProperties)(props.as_mut_ptr().cast(), ordinal as i32)
        })?;
        // SAFETY: reinterpreting the u64 buffer's bytes.
        let bytes = unsafe { std::slice::from_raw_parts(props.as_ptr().cast::<u8>(), props.len() * 8) };
        // `char name[256]` is the struct's first field in every release.
        let name_end = bytes[..256].iter().position(|&b| b == 0).unwrap_or(256);
        let name = String::from_utf8_lossy(&bytes[..name_end]).into_owned();
        let arch = GfxArch::find_in_properties(bytes).ok_or_else(|| KernelError::Device {
            op: "hip_device",
            detail: format!("no gfx arch in the properties of GPU {ordinal} ({name})"),
        })?;
        let mut stream: HipStream = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the device is current.
        api.check("hip_stream_create", unsafe { (api.hipStreamCreate)(&mut stream) })?;
        Ok(Device { api, ordinal, name, arch, stream, modules: HashMap::new() })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn arch(&self) -> &GfxArch {
        &self.arch
    }

    /// Lanes per wavefront the modules are compiled for (launch shapes must use it).
    pub fn wavefront_size(&self) -> u32 {
        self.arch.wavefront_size()
    }

    pub(crate) fn stream(&self) -> HipStream {
        self.stream
    }

    pub(crate) fn bind(&self) -> Result<(), KernelError> {
        // SAFETY: the ordinal was valid at construction.
        self.api.check("hip_set_device", unsafe { (self.api.hipSetDevice)(self.ordinal as i32) })
    }

    /// (free, total) device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize), KernelError> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        self.api.check("hip_mem_info", unsafe { (self.api.hipMemGetInfo)(&mut free, &mut total) })?;
        Ok((free, total))
    }

    /// Compiles (or reads from `cache`) and loads every kernel module for this device's arch.
    pub fn load_modules(&mut self, cache: &ModuleCache) -> Result<Vec<ModuleReport>, KernelError> {
        self.bind()?;
        let compiler = rtc::version()?;
        let mut reports = Vec::new();
        for &(module, body) in sources::modules() {
            let (image, report) =
                rtc::compile_cached(cache, module, &sources::full_source(body), &self.arch, &compiler)?;
            let mut m: HipModule = std::ptr::null_mut();
            // SAFETY: `image` is a code object for this device's arch, alive for the call.
            self.api
                .check("hip_module_load", unsafe { (self.api.hipModuleLoadData)(&mut m, image.as_ptr().cast()) })?;
            if let Some(old) = self.modules.insert(module, m) {
                // SAFETY: replaced handle, loaded by an earlier call.
                let _ = unsafe { (self.api.hipModuleUnload)(old) };
            }
            reports.push(report);
        }
        Ok(reports)
    }

    /// The kernel `name` of a loaded `module`.
    pub fn function(&self, module: &str, name: &str) -> Result<Kernel, KernelError> {
        let m = *self.modules.get(module).ok_or_else(|| KernelError::Device {
            op: "hip_function",
            detail: format!("module {module:?} is not loaded (call load_modules)"),
        })?;
        let c = CString::new(name).map_err(|_| KernelError::Device { op: "hip_function", detail: name.into() })?;
        let mut f: HipFunction = std::ptr::null_mut();
        // SAFETY: a loaded module and a valid C string.
        self.api
            .check("hip_module_get_function", unsafe { (self.api.hipModuleGetFunction)(&mut f, m, c.as_ptr()) })
            .map_err(|e| KernelError::Device { op: "hip_function", detail: format!("{module}::{name}: {e}") })?;
        Ok(Kernel { f })
    }

    /// Queues `kernel` on the device's stream.
    ///
    /// # Safety
    /// `args` must point at values whose types and order match the kernel's parameters, and
    /// every device pointer among them must be valid for what the kernel accesses.
    pub unsafe fn launch(
        &self,
        kernel: Kernel,
        shape: LaunchShape,
        args: &mut [*mut c_void],
    ) -> Result<(), KernelError> {
        self.bind()?;
        let [gx, gy, gz] = shape.grid;
        // SAFETY: the caller guarantees the arguments; the function belongs to this device.
        let code = unsafe {
            (self.api.hipModuleLaunchKernel)(
                kernel.f,
                gx,
                gy,
                gz,
                shape.block,
                1,
                1,
                shape.shared_bytes,
                self.stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        self.api.check("hip_launch", code)
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        self.bind()?;
        // SAFETY: the device's own stream.
        self.api.check("hip_synchronize", unsafe { (self.api.hipStreamSynchronize)(self.stream) })
    }

    /// `len` elements of device memory, zeroed.
    pub fn alloc<T: Elem>(&self, len: usize) -> Result<DevBuf<T>, KernelError> {
        self.bind()?;
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| KernelError::Shape { op: "hip_alloc", detail: format!("{len} elements overflow") })?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; at least one byte so the pointer is distinct.
        self.api.check("hip_malloc", unsafe { (self.api.hipMalloc)(&mut ptr, bytes.max(1)) })?;
        let buf = DevBuf { ptr, len, api: self.api.clone(), _t: PhantomData };
        // SAFETY: freshly allocated `bytes` bytes.
        self.api.check("hip_memset", unsafe { (self.api.hipMemset)(ptr, 0, bytes) })?;
        Ok(buf)
    }

    /// A device copy of `host`.
    pub fn upload<T: Elem>(&self, host: &[T]) -> Result<DevBuf<T>, KernelError> {
        let buf = self.alloc::<T>(host.len())?;
        // SAFETY: both sides hold `size_of_val(host)` bytes.
        self.api.check("hip_upload", unsafe {
            (self.api.hipMemcpy)(
                buf.ptr,
                host.as_ptr().cast(),
                std::mem::size_of_val(host),
                ffi::HIP_MEMCPY_HOST_TO_DEVICE,
            )
        })?;
        Ok(buf)
    }

    /// Overwrites the start of `buf` with `host` (at most its length).
    pub fn write<T: Elem>(&self, buf: &mut DevBuf<T>, host: &[T]) -> Result<(), KernelError> {
        if host.len() > buf.len {
            return Err(KernelError::Shape {
                op: "hip_write",
                detail: format!("{} values into a buffer of {}", host.len(), buf.len),
            });
        }
        self.bind()?;
        // SAFETY: `buf` holds at least `host.len()` elements (checked).
        self.api.check("hip_write", unsafe {
            (self.api.hipMemcpy)(
                buf.ptr,
                host.as_ptr().cast(),
                std::mem::size_of_val(host),
                ffi::HIP_MEMCPY_HOST_TO_DEVICE,
            )
        })
    }

    /// Copies rows `src_row..src_row + rows` of `src` to rows `dst_row..` of `dst` (both rows
    /// of `row_len` elements), device to device, ordered after the stream's queued work
    /// (hipMemcpy runs on the null stream, which waits for this blocking stream).
    pub fn copy_rows<T: Elem>(
        &self,
        dst: &mut DevBuf<T>,
        dst_row: usize,
        src: &DevBuf<T>,
        src_row: usize,
        rows: usize,
        row_len: usize,
    ) -> Result<(), KernelError> {
        let end = |row: usize| row.checked_add(rows).and_then(|r| r.checked_mul(row_len));
        match (end(dst_row), end(src_row)) {
            (Some(d), Some(s)) if d <= dst.len && s <= src.len => {}
            _ => {
                return Err(KernelError::Shape {
                    op: "hip_copy_rows",
                    detail: format!(
                        "{rows} rows of {row_len} from row {src_row} of {} values to row {dst_row} of {}",
                        src.len, dst.len
                    ),
                })
            }
        }
        if rows == 0 || row_len == 0 {
            return Ok(());
        }
        self.bind()?;
        let size = std::mem::size_of::<T>();
        // SAFETY: both ranges lie inside their allocations (checked above).
        self.api.check("hip_copy_rows", unsafe {
            (self.api.hipMemcpy)(
                dst.ptr.cast::<u8>().add(dst_row * row_len * size).cast(),
                src.ptr.cast::<u8>().add(src_row * row_len * size).cast(),
                rows * row_len * size,
                ffi::HIP_MEMCPY_DEVICE_TO_DEVICE,
            )
        })
    }

    /// The contents of `buf` (waits for the stream first).
    pub fn download<T: Elem>(&self, buf: &DevBuf<T>) -> Result<Vec<T>, KernelError> {
        self.synchronize()?;
        let mut host: Vec<T> = Vec::with_capacity(buf.len);
        // SAFETY: `host` has capacity for `len` elements; hipMemcpy writes all of them before
        // the length is set; T is plain data (Elem is sealed to bf16, f32, u32).
        unsafe {
            self.api.check(
                "hip_download",
                (self.api.hipMemcpy)(
                    host.as_mut_ptr().cast(),
                    buf.ptr,
                    buf.len * std::mem::size_of::<T>(),
                    ffi::HIP_MEMCPY_DEVICE_TO_HOST,
                ),
            )?;
            host.set_len(buf.len);
        }
        Ok(host)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let _ = self.bind();
        // SAFETY: handles created by this device and released once.
        unsafe {
            let _ = (self.api.hipStreamSynchronize)(self.stream);
            for (_, m) in self.modules.drain() {
                let _ = (self.api.hipModuleUnload)(m);
            }
            let _ = (self.api.hipStreamDestroy)(self.stream);
        }
    }
}

/// A kernel of a loaded module.
#[derive(Clone, Copy)]
pub struct Kernel {
    f: HipFunction,
}

/// `len` elements of `T` in device memory; freed on drop.
pub struct DevBuf<T: Elem> {
    ptr: *mut c_void,
    len: usize,
    api: Arc<HipApi>,
    _t: PhantomData<T>,
}

// SAFETY: device memory is addressable from any thread; access goes through the device.
unsafe impl<T: Elem> Send for DevBuf<T> {}

impl<T: Elem> DevBuf<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address (a kernel argument's value).
    pub fn device_ptr(&self) -> *mut c_void {
        self.ptr
    }
}

impl<T: Elem> Drop for DevBuf<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by hipMalloc and freed once.
        let _ = unsafe { (self.api.hipFree)(self.ptr) };
    }
}
