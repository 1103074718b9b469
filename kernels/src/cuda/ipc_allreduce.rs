//! One-shot all-reduce over peer memory for the small messages of tensor-parallel decode:
//! NCCL's all-reduce costs ~12 µs on two H200s at ≤ 64 KB even inside a CUDA graph
//! (ANCHORS.md), while one kernel that pushes its input into every peer's memory over NVLink
//! and sums what the peers pushed into its own needs a few µs.
//! Kernel and its memory-ordering argument: kernels/cuda/allreduce_oneshot.cu.
//!
//! Setup ([`Device::ipc_all_reduce_setup`], collective: every rank of the communicator calls
//! it at the same point): each rank allocates one region with plain `cuMemAlloc` (cudarc's
//! stream-ordered pool memory cannot be exported), zeroes it, exports it with
//! `cuIpcGetMemHandle`, and the ranks all-gather their [`PeerRecord`]s through the NCCL
//! communicator. A peer in another process is mapped with `cuIpcOpenMemHandle` (lazy peer
//! access); a peer in this process (ranks run as threads, as `tessera bench --tp` and the
//! TP tests do; IPC handles cannot be opened by the process that made them) is used through
//! its own pointer after `cuCtxEnablePeerAccess`. When any rank cannot map any peer (no P2P
//! between the GPUs, another host, export refused), every rank gets the same error after a
//! second agreement round, so no rank takes the one-shot path while another takes NCCL.
//! NVLink multicast (NVLS) is never used.
//!
//! Calls ([`Device::all_reduce_sum_small`], [`Device::tp_all_reduce`]) are one kernel
//! launch on the device's stream with no host-side per-call state, so they can be recorded
//! in a CUDA graph and replayed.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaContext, CudaFunction, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use half::bf16;

use super::device::{dev_err, Buf, Device};
use super::ipc_record::{
    data_capacity, decode_slots, encode_slots, process_nonce, region_bytes, PeerRecord, IPC_HANDLE_BYTES,
    ONESHOT_MAX_BLOCKS, ONESHOT_MAX_WORLD,
};
use super::module_cache::ModuleCache;
use super::nccl::NcclComm;
use super::{nvrtc, sources};
use crate::error::check;
use crate::KernelError;

/// Default blocks of the kernel's grid (the same on every rank and every call; see the .cu
/// file and [`oneshot_blocks`]).
/// 16 × 512 threads hold a 64 KB message at one 16-byte vector per thread.
pub const ONESHOT_BLOCKS: u32 = 16;
const ONESHOT_THREADS: u32 = 512;
/// Largest message (bytes) [`Device::tp_all_reduce`] sends one-shot by default; larger
/// ones go to NCCL. Measured on two H200s (`bench_oneshot_vs_nccl` in
/// kernels/tests/cuda_allreduce.rs, bench/RESULTS.md 2026-12-01, the push kernel): inside a
/// CUDA graph one-shot takes 3.8-4.4 µs up to 64 KB against NCCL's 5.8-7.0, 5.6 against 8.4
/// at 256 KB, 7.8 against 9.9 at 512 KB and 12.0 against 13.7 at 1 MB (eagerly 13.4 / 14.1).
/// A decode step of up to 128 sequences of hidden 4096 fits. Per group:
/// [`IpcAllReduce::set_max_bytes`].
pub const ONESHOT_DEFAULT_MAX_BYTES: usize = 1 << 20;
/// The group's grid: `TESSERA_ONESHOT_BLOCKS` (1..=ONESHOT_MAX_BLOCKS; every rank must be
/// given the same, or the setup fails on all of them), else [`ONESHOT_BLOCKS`]. Measured on
/// two H200s (bench/RESULTS.md 2026-12-01, llama-3.1-8b at tp=2): 64 blocks take 512 KB
/// messages from 7.9 to 5.8 µs and 1 MB from 12.1 to 7.9 (+3% decode at 64 sequences, +5%
/// at 128) but batch-1 decode ~1.4% slower than with 16, which stays the default.
fn oneshot_blocks() -> u32 {
    std::env::var("TESSERA_ONESHOT_BLOCKS")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|b| (1..=ONESHOT_MAX_BLOCKS as u32).contains(b))
        .unwrap_or(ONESHOT_BLOCKS)
}

/// A wait for a peer longer than this traps the kernel (a launch error on this rank's
/// stream) instead of spinning the GPU forever on a dead peer.
pub const ONESHOT_TIMEOUT_NS: u64 = 30_000_000_000;

/// Every rank's region as mapped in this process, by value (`OneshotRegions` in the .cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct Regions([u64; ONESHOT_MAX_WORLD]);

// SAFETY: plain `#[repr(C)]` array of u64, the layout of the kernel's struct parameter.
unsafe impl DeviceRepr for Regions {}

/// One rank's one-shot all-reduce state: its shared region, the peers' regions mapped
/// here, and the kernel.
///
/// Drop order: synchronise the device and drop every [`Graph`](super::Graph) that recorded
/// its calls first, and make sure the peers have finished their last call too (e.g. one
/// more NCCL all-reduce) before any rank drops it, since dropping frees the region they read.
pub struct IpcAllReduce {
    ctx: Arc<CudaContext>,
    func: Option<CudaFunction>,
    rank: usize,
    world: usize,
    /// This rank's region (0 until allocated).
    local: CUdeviceptr,
    regions: [u64; ONESHOT_MAX_WORLD],
    /// Peer regions opened through IPC (closed on drop).
    opened: Vec<CUdeviceptr>,
    /// Same-process peers' devices whose primary context was retained (released on drop).
    retained: Vec<sys::CUdevice>,
    /// Bytes of each data buffer: the largest message.
    cap: usize,
    max_bytes: usize,
    timeout_ns: u64,
    /// Whether the kernel lets the next kernel in the stream launch at its start (see
    /// [`IpcAllReduce::set_early_dependents`]).
    early_dependents: bool,
    /// Blocks of every call's grid: fixed for the group's life (the kernel's per-block
    /// epochs and its data-slot reuse argument assume every call launches all of them),
    /// equal on every rank (checked at setup).
    blocks: u32,
    /// How each peer is reached, for logs.
    route: String,
}

// SAFETY: the raw handles are device addresses and device ids, usable from any thread
// once the owning context is bound (every method binds it); the owner serialises use.
unsafe impl Send for IpcAllReduce {}
unsafe impl Sync for IpcAllReduce {}

impl IpcAllReduce {
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Largest message (bytes) the buffers hold.
    pub fn capacity_bytes(&self) -> usize {
        self.cap
    }

    /// Largest message [`Device::tp_all_reduce`] sends one-shot.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Sets [`IpcAllReduce::max_bytes`] (capped at the capacity). Every rank must set the
    /// same value, or the ranks pick different paths for one message and wait on each other.
    pub fn set_max_bytes(&mut self, bytes: usize) {
        self.max_bytes = bytes.min(self.cap);
    }

    /// Sets the dead-peer timeout of later launches (0: wait forever).
    pub fn set_timeout_ns(&mut self, ns: u64) {
        self.timeout_ns = ns;
    }

    /// Whether later launches let the next kernel in the stream launch at their start
    /// (default on): a programmatically launched GEMV then becomes resident beside the
    /// all-reduce and queues its weight copies while the blocks wait on their peers; it
    /// still waits for the whole all-reduce before reading its result. Off: the next kernel
    /// launches when the all-reduce ends.
    pub fn set_early_dependents(&mut self, on: bool) {
        self.early_dependents = on;
    }

    /// How the peers are reached, e.g. "rank 0 of 2: rank 1 same-process peer access".
    pub fn route(&self) -> &str {
        &self.route
    }

    /// `len` bf16 values go one-shot under [`Device::tp_all_reduce`].
    pub fn fits(&self, len: usize) -> bool {
        len.checked_mul(2).is_some_and(|b| b <= self.max_bytes)
    }

    /// Allocates, zeroes and exports this rank's region; loads the kernel.
    fn prepare(&mut self, dev: &Device, max_bytes: usize) -> Result<PeerRecord, String> {
        let d = |what: &str, e: sys::CUresult| format!("{what}: {e:?}");
        if max_bytes == 0 {
            return Err("disabled on this rank (max_bytes 0)".into());
        }
        self.func = Some(load_kernel(dev).map_err(|e| e.to_string())?);
        self.cap = data_capacity(max_bytes);
        let bytes = region_bytes(self.cap);
        self.ctx.bind_to_thread().map_err(|e| format!("bind context: {e:?}"))?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the allocation is freed in Drop.
        unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }.result().map_err(|e| d("cuMemAlloc", e.0))?;
        self.local = ptr;
        // SAFETY: `ptr` holds `bytes` bytes. Flags and epochs must start at 0.
        unsafe { sys::cuMemsetD8_v2(ptr, 0, bytes) }.result().map_err(|e| d("cuMemsetD8", e.0))?;
        // The memset runs on the legacy stream; peers write flags only after setup ends.
        self.ctx.synchronize().map_err(|e| format!("synchronize: {e:?}"))?;
        let uuid = device_uuid(self.ctx.cu_device()).map_err(|e| d("cuDeviceGetUuid", e))?;
        let mut h = sys::CUipcMemHandle { reserved: [0; IPC_HANDLE_BYTES] };
        // SAFETY: valid out-pointer; `ptr` is a cuMemAlloc allocation of this context.
        let ipc_ok = unsafe { sys::cuIpcGetMemHandle(&mut h, ptr) }.result().is_ok();
        Ok(PeerRecord {
            ok: true,
            ipc_ok,
            nonce: process_nonce(),
            uuid,
            ptr,
            cap: self.cap as u64,
            blocks: self.blocks,
            handle: h.reserved.map(|c| c as u8),
        })
    }

    /// Maps every peer's region; returns how each is reached.
    fn open_peers(&mut self, records: &[PeerRecord]) -> Result<String, String> {
        let d = |what: String, e: sys::CUresult| format!("{what}: {e:?}");
        self.ctx.bind_to_thread().map_err(|e| format!("bind context: {e:?}"))?;
        let me = self.ctx.cu_device();
        let my_uuid = device_uuid(me).map_err(|e| d("cuDeviceGetUuid".into(), e))?;
        let mut route = format!("rank {} of {}:", self.rank, self.world);
        self.regions[self.rank] = self.local;
        for (p, rec) in records.iter().enumerate() {
            if p == self.rank {
                continue;
            }
            // The peer's GPU as this process numbers it (absent: hidden by CUDA_VISIBLE_DEVICES).
            let peer_dev = find_device(&rec.uuid).map_err(|e| d("enumerating devices".into(), e))?;
            if let Some(pd) = peer_dev.filter(|&pd| rec.uuid != my_uuid && pd != me) {
                let mut can = 0;
                // SAFETY: valid out-pointer and device handles.
                unsafe { sys::cuDeviceCanAccessPeer(&mut can, me, pd) }
                    .result()
                    .map_err(|e| d(format!("cuDeviceCanAccessPeer for rank {p}"), e.0))?;
                if can == 0 {
                    return Err(format!("this GPU cannot access rank {p}'s GPU memory (no peer access between them)"));
                }
            }
            if rec.nonce == process_nonce() {
                let Some(pd) = peer_dev else {
                    return Err(format!("rank {p} runs in this process on a GPU this process cannot see"));
                };
                if pd != me {
                    let mut pctx: sys::CUcontext = std::ptr::null_mut();
                    // SAFETY: valid out-pointer; released in Drop.
                    unsafe { sys::cuDevicePrimaryCtxRetain(&mut pctx, pd) }
                        .result()
                        .map_err(|e| d(format!("retaining rank {p}'s context"), e.0))?;
                    self.retained.push(pd);
                    self.ctx.bind_to_thread().map_err(|e| format!("bind context: {e:?}"))?;
                    // SAFETY: our context is current; `pctx` is live (retained above).
                    match unsafe { sys::cuCtxEnablePeerAccess(pctx, 0) } {
                        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                        e => return Err(d(format!("cuCtxEnablePeerAccess to rank {p}"), e)),
                    }
                }
                self.regions[p] = rec.ptr;
                route.push_str(&format!(" rank {p} same-process peer access;"));
            } else {
                if !rec.ipc_ok {
                    return Err(format!("rank {p} could not export its region (cuIpcGetMemHandle failed there)"));
                }
                let h = sys::CUipcMemHandle { reserved: rec.handle.map(|b| b as _) };
                let mut ptr: CUdeviceptr = 0;
                let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
                // SAFETY: valid out-pointer; the handle came from the peer's cuIpcGetMemHandle;
                // closed in Drop.
                unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, h, flags) }
                    .result()
                    .map_err(|e| d(format!("cuIpcOpenMemHandle of rank {p}'s region"), e.0))?;
                self.opened.push(ptr);
                self.regions[p] = ptr;
                route.push_str(&format!(" rank {p} CUDA IPC;"));
            }
        }
        route.pop();
        Ok(route)
    }
}

impl Drop for IpcAllReduce {
    fn drop(&mut self) {
        // Teardown errors have nowhere to go; the process keeps running either way.
        let _ = self.ctx.bind_to_thread();
        for &p in &self.opened {
            // SAFETY: opened by cuIpcOpenMemHandle in this context, closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(p) };
        }
        for &d in &self.retained {
            // SAFETY: retained once per entry in open_peers.
            let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(d) };
        }
        if self.local != 0 {
            // SAFETY: allocated by cuMemAlloc in prepare, freed once.
            let _ = unsafe { sys::cuMemFree_v2(self.local) };
        }
    }
}

/// The kernel, from the module cache (the device compiled it at start, so normally a hit).
fn load_kernel(dev: &Device) -> Result<CudaFunction, KernelError> {
    const MODULE: &str = "allreduce_oneshot";
    let body = sources::MODULES
        .iter()
        .find(|(m, _)| *m == MODULE)
        .map(|&(_, b)| b)
        .ok_or_else(|| KernelError::Device { op: "oneshot_setup", detail: format!("no kernel module {MODULE}") })?;
    let source = sources::full_source(body);
    let (image, _) =
        nvrtc::compile_cached(&ModuleCache::default_location(), MODULE, &source, dev.arch(), &nvrtc::version()?)?;
    let module = dev.stream.context().load_module(Ptx::from_binary(image)).map_err(dev_err("cuda_load_module"))?;
    module.load_function("allreduce_oneshot").map_err(|e| KernelError::Device {
        op: "cuda_load_function",
        detail: format!("{MODULE}.allreduce_oneshot: {e:?}"),
    })
}

fn device_uuid(dev: sys::CUdevice) -> Result<[u8; 16], sys::CUresult> {
    let mut u = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: valid out-pointer and device handle.
    unsafe { sys::cuDeviceGetUuid_v2(&mut u, dev) }.result().map_err(|e| e.0)?;
    Ok(u.bytes.map(|c| c as u8))
}

/// The device of this process with UUID `uuid`, if visible.
fn find_device(uuid: &[u8; 16]) -> Result<Option<sys::CUdevice>, sys::CUresult> {
    let mut n = 0;
    // SAFETY: valid out-pointer.
    unsafe { sys::cuDeviceGetCount(&mut n) }.result().map_err(|e| e.0)?;
    for i in 0..n {
        let mut d: sys::CUdevice = 0;
        // SAFETY: valid out-pointer; `i` < count.
        unsafe { sys::cuDeviceGet(&mut d, i) }.result().map_err(|e| e.0)?;
        if device_uuid(d)? == *uuid {
            return Ok(Some(d));
        }
    }
    Ok(None)
}

/// Every rank's `bytes` (the same length on every rank) through one NCCL f32 all-reduce.
fn all_gather_bytes(dev: &Device, comm: &NcclComm, bytes: &[u8]) -> Result<Vec<Vec<u8>>, KernelError> {
    let (rank, world) = (comm.rank(), comm.world());
    let mut buf = dev.upload(&encode_slots(bytes, rank, world))?;
    dev.all_reduce_sum_f32(comm, &mut buf)?;
    decode_slots(&dev.download(&buf)?, bytes.len(), world)
}

impl Device {
    /// Sets up the one-shot all-reduce of `comm`'s group for messages up to `max_bytes`
    /// (collective: every rank calls it at the same point, with the same `max_bytes`; 0
    /// opts this rank out, which fails the setup on every rank). Errors are the same on
    /// every rank: the caller falls back to NCCL on all of them. Not inside a capture.
    pub fn ipc_all_reduce_setup(&self, comm: &NcclComm, max_bytes: usize) -> Result<IpcAllReduce, KernelError> {
        const OP: &str = "oneshot_setup";
        let (rank, world) = (comm.rank(), comm.world());
        if !(2..=ONESHOT_MAX_WORLD).contains(&world) {
            return Err(KernelError::Device {
                op: OP,
                detail: format!("one-shot all-reduce serves groups of 2..={ONESHOT_MAX_WORLD} GPUs, not {world}"),
            });
        }
        const _: () = assert!(ONESHOT_BLOCKS as usize <= ONESHOT_MAX_BLOCKS);
        let mut ar = IpcAllReduce {
            ctx: self.stream.context().clone(),
            func: None,
            rank,
            world,
            local: 0,
            regions: [0; ONESHOT_MAX_WORLD],
            opened: Vec::new(),
            retained: Vec::new(),
            cap: 0,
            max_bytes: 0,
            timeout_ns: ONESHOT_TIMEOUT_NS,
            early_dependents: true,
            blocks: oneshot_blocks(),
            route: String::new(),
        };
        // A local failure still takes part in the exchange, so the peers learn of it.
        let prepared = ar.prepare(self, max_bytes);
        let mine = prepared.as_ref().map_or_else(|_| PeerRecord::failed(process_nonce()), Clone::clone);
        let records = all_gather_bytes(self, comm, &mine.to_bytes())?
            .iter()
            .map(|b| PeerRecord::from_bytes(b))
            .collect::<Result<Vec<_>, _>>()?;
        debug_assert_eq!(records.len(), world);
        // Every rank sees the same records, so these errors are the same everywhere.
        let failed: Vec<usize> = (0..world).filter(|&r| !records[r].ok).collect();
        if !failed.is_empty() {
            let why = prepared.err().map(|e| format!("; this rank: {e}")).unwrap_or_default();
            return Err(KernelError::Device {
                op: OP,
                detail: format!("rank(s) {failed:?} could not set up one-shot all-reduce{why}"),
            });
        }
        if records.iter().any(|r| r.cap != records[0].cap || r.blocks != records[0].blocks) {
            let caps: Vec<(u64, u32)> = records.iter().map(|r| (r.cap, r.blocks)).collect();
            return Err(KernelError::Device {
                op: OP,
                detail: format!(
                    "ranks disagree on (buffer bytes, blocks): {caps:?}; every rank must ask the same size"
                ),
            });
        }
        // Second round: did every rank map every peer?
        let opened = ar.open_peers(&records);
        let oks = all_gather_bytes(self, comm, &[u8::from(opened.is_ok())])?;
        let failed: Vec<usize> = (0..world).filter(|&r| oks[r] != [1]).collect();
        match opened {
            Ok(route) if failed.is_empty() => {
                ar.route = route;
                ar.max_bytes = ONESHOT_DEFAULT_MAX_BYTES.min(ar.cap);
                Ok(ar)
            }
            opened => {
                let why = opened.err().map(|e| format!("; this rank: {e}")).unwrap_or_default();
                Err(KernelError::Device {
                    op: OP,
                    detail: format!("rank(s) {failed:?} could not map their peers' memory{why}"),
                })
            }
        }
    }

    /// In-place bf16 sum over the group of `ar`, one kernel on the device's stream
    /// (capturable in a CUDA graph). f32 accumulation in rank order: every rank gets the
    /// same bits. Every rank must call it with the same length, like NCCL's all-reduce.
    pub fn all_reduce_sum_small(&self, ar: &IpcAllReduce, buf: &mut Buf<bf16>) -> Result<(), KernelError> {
        self.oneshot(ar, buf, None)
    }

    /// As [`Device::all_reduce_sum_small`], but the group's sum is added to `residual`
    /// (`residual = bf16(residual + bf16(sum))`, as the all-reduce followed by
    /// [`Device::add_residual`] rounds it) and `buf` is left as it was.
    pub fn all_reduce_sum_small_add(
        &self,
        ar: &IpcAllReduce,
        buf: &mut Buf<bf16>,
        residual: &mut Buf<bf16>,
    ) -> Result<(), KernelError> {
        self.oneshot(ar, buf, Some(residual))
    }

    fn oneshot(
        &self,
        ar: &IpcAllReduce,
        buf: &mut Buf<bf16>,
        residual: Option<&mut Buf<bf16>>,
    ) -> Result<(), KernelError> {
        const OP: &str = "oneshot_all_reduce_bf16";
        if ar.ctx.ordinal() != self.ordinal() {
            return Err(KernelError::Device {
                op: OP,
                detail: format!(
                    "the one-shot group was set up on GPU {}, not this device (GPU {})",
                    ar.ctx.ordinal(),
                    self.ordinal()
                ),
            });
        }
        let n = buf.len();
        if let Some(r) = &residual {
            check(r.len() == n, OP, || format!("residual has {} values, the message {n}", r.len()))?;
        }
        if n * 2 > ar.cap {
            return Err(KernelError::Shape {
                op: OP,
                detail: format!("{n} bf16 values ({} bytes) exceed the one-shot buffers of {} bytes", n * 2, ar.cap),
            });
        }
        let Some(func) = &ar.func else {
            return Err(KernelError::Device { op: OP, detail: "the kernel was not loaded".into() });
        };
        if n == 0 {
            return Ok(());
        }
        let (n64, rank, world) = (n as u64, ar.rank as u32, ar.world as u32);
        let (cap, timeout, local, regions) = (ar.cap as u64, ar.timeout_ns, ar.local, Regions(ar.regions));
        let early = u32::from(ar.early_dependents);
        let cfg = LaunchConfig { grid_dim: (ar.blocks, 1, 1), block_dim: (ONESHOT_THREADS, 1, 1), shared_mem_bytes: 0 };
        let s = &self.stream;
        // The kernel's `residual` pointer: 0 (null) for the plain all-reduce.
        let (res_ptr, _guard) = match residual {
            Some(r) => {
                let (p, g) = r.inner.device_ptr_mut(s);
                (p, Some(g))
            }
            None => (0, None),
        };
        let mut b = s.launch_builder(func);
        b.arg(&mut buf.inner).arg(&n64).arg(&rank).arg(&world).arg(&cap).arg(&timeout).arg(&local).arg(&regions);
        b.arg(&res_ptr).arg(&early);
        // SAFETY: argument types and order match the kernel; `buf` (and `residual`) hold n
        // values, each region holds region_bytes(cap) bytes with cap >= 2 n (checked above),
        // and every rank's regions stay mapped while `ar` lives.
        unsafe { b.launch(cfg) }.map(drop).map_err(dev_err(OP))
    }

    /// The tensor-parallel all-reduce: one-shot when `ar` is set up and the message fits
    /// its [`IpcAllReduce::max_bytes`], NCCL otherwise. The choice depends only on the
    /// length, so every rank takes the same path.
    pub fn tp_all_reduce(
        &self,
        comm: &NcclComm,
        ar: Option<&IpcAllReduce>,
        buf: &mut Buf<bf16>,
    ) -> Result<(), KernelError> {
        match ar {
            Some(ar) if ar.fits(buf.len()) => self.all_reduce_sum_small(ar, buf),
            _ => self.all_reduce_sum(comm, buf),
        }
    }

    /// The tensor-parallel all-reduce with the residual add: `residual += sum over the
    /// group of buf`, one-shot (one kernel) where [`Device::tp_all_reduce`] would take it,
    /// else NCCL in place then [`Device::add_residual`]; the same bits either way.
    pub fn tp_all_reduce_add(
        &self,
        comm: &NcclComm,
        ar: Option<&IpcAllReduce>,
        buf: &mut Buf<bf16>,
        residual: &mut Buf<bf16>,
    ) -> Result<(), KernelError> {
        match ar {
            Some(ar) if ar.fits(buf.len()) => self.all_reduce_sum_small_add(ar, buf, residual),
            _ => {
                self.all_reduce_sum(comm, buf)?;
                self.add_residual(residual, buf)
            }
        }
    }
}

/// A rank's one-shot state moves with its worker thread.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<IpcAllReduce>();
};
