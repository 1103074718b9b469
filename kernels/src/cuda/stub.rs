//! The CUDA API when the `cuda` feature is not compiled in: the same names and signatures,
//! so callers need no `#[cfg]`. [`Device::new`] returns `NotCompiled("cuda")`; no value of
//! these types can exist, so every other method is statically unreachable.

use std::convert::Infallible;
use std::marker::PhantomData;

use super::arch::Arch;
use super::module_cache::{ModuleCache, ModuleReport};
use super::paged::{DecodePlan, PagedBatch};
use super::qkv_args::QkvPrep;
use super::Elem;
use crate::cpu::attention::PagedKv;
use crate::cpu::rope::{RopeParams, RopeStyle};
use crate::KernelError;
use half::bf16;

/// A typed device allocation (never constructed without the `cuda` feature).
pub struct Buf<T> {
    never: Infallible,
    _elem: PhantomData<T>,
}

impl<T> Buf<T> {
    pub fn len(&self) -> usize {
        match self.never {}
    }

    pub fn is_empty(&self) -> bool {
        match self.never {}
    }
}

/// Page-locked host memory (never constructed without the `cuda` feature).
pub struct HostStage<T> {
    never: Infallible,
    _elem: PhantomData<T>,
}

impl<T> HostStage<T> {
    pub fn len(&self) -> usize {
        match self.never {}
    }
    pub fn is_empty(&self) -> bool {
        match self.never {}
    }
    pub fn as_slice(&self) -> &[T] {
        match self.never {}
    }
    pub fn as_mut_slice(&mut self) -> Result<&mut [T], KernelError> {
        match self.never {}
    }
}

/// Per-position (cos, sin) table of one model's RoPE on the device.
pub struct RopeCache {
    never: Infallible,
}

impl RopeCache {
    pub fn rope_dim(&self) -> usize {
        match self.never {}
    }

    pub fn max_positions(&self) -> usize {
        match self.never {}
    }
}

/// Scratch of split-KV decode (never constructed without the `cuda` feature).
pub struct DecodeWorkspace {
    never: Infallible,
}

impl DecodeWorkspace {
    pub fn rows(&self) -> usize {
        match self.never {}
    }
}

/// Per-row sampling outputs (never constructed without the `cuda` feature).
pub struct SampleOutput {
    never: Infallible,
}

impl SampleOutput {
    pub fn max_rows(&self) -> usize {
        match self.never {}
    }
    pub fn max_logprobs(&self) -> usize {
        match self.never {}
    }
    pub fn tokens(&self) -> &Buf<u32> {
        match self.never {}
    }
    #[allow(unused_variables)]
    pub fn read(&mut self, dev: &Device, n_rows: usize, with_top: bool) -> Result<Vec<super::SampledRow>, KernelError> {
        match self.never {}
    }
    #[allow(unused_variables)]
    pub fn queue_read(&mut self, dev: &Device, n_rows: usize, with_top: bool) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn is_queued(&self) -> bool {
        match self.never {}
    }
    pub fn completion(&self) -> Completion {
        match self.never {}
    }
    pub fn take(&mut self) -> Result<Vec<super::SampledRow>, KernelError> {
        match self.never {}
    }
}

/// Waits for a queued sampling (never constructed without the `cuda` feature).
#[derive(Clone)]
pub struct Completion {
    never: Infallible,
}

impl Completion {
    pub fn wait(&self) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn is_done(&self) -> bool {
        match self.never {}
    }
}

/// Timing events (never constructed without the `cuda` feature).
pub struct Marks {
    never: Infallible,
}

impl Marks {
    pub fn len(&self) -> usize {
        match self.never {}
    }
    pub fn is_empty(&self) -> bool {
        match self.never {}
    }
    pub fn times_us(&self) -> Result<Vec<f64>, KernelError> {
        match self.never {}
    }
}

/// A captured CUDA graph (never constructed without the `cuda` feature).
pub struct Graph {
    #[allow(dead_code)]
    never: Infallible,
}

/// One rank's membership of an NCCL communicator (never constructed without the `cuda`
/// feature).
pub struct NcclComm {
    never: Infallible,
}

impl NcclComm {
    pub fn rank(&self) -> usize {
        match self.never {}
    }
    pub fn world(&self) -> usize {
        match self.never {}
    }
}

/// A CUDA device (never constructed without the `cuda` feature).
pub struct Device {
    never: Infallible,
}

const NOT: KernelError = KernelError::NotCompiled("cuda");

#[allow(unused_variables, clippy::too_many_arguments)]
impl Device {
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        Err(NOT)
    }
    pub fn with_cache(ordinal: usize, cache: ModuleCache) -> Result<Self, KernelError> {
        Err(NOT)
    }
    pub fn count() -> Result<usize, KernelError> {
        Err(NOT)
    }
    pub fn ordinal(&self) -> usize {
        match self.never {}
    }
    pub fn name(&self) -> &str {
        match self.never {}
    }
    pub fn arch(&self) -> Arch {
        match self.never {}
    }
    pub fn module_reports(&self) -> &[ModuleReport] {
        match self.never {}
    }
    pub fn memory_info(&self) -> Result<(usize, usize), KernelError> {
        match self.never {}
    }
    pub fn alloc<T: Elem>(&self, len: usize) -> Result<Buf<T>, KernelError> {
        match self.never {}
    }
    pub fn alloc_weight<T: Elem>(&self, len: usize) -> Result<Buf<T>, KernelError> {
        match self.never {}
    }
    pub fn upload<T: Elem>(&self, host: &[T]) -> Result<Buf<T>, KernelError> {
        match self.never {}
    }
    pub fn upload_weight<T: Elem>(&self, host: &[T]) -> Result<Buf<T>, KernelError> {
        match self.never {}
    }
    pub fn write<T: Elem>(&self, dst: &mut Buf<T>, host: &[T]) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn write_at<T: Elem>(&self, dst: &mut Buf<T>, offset: usize, host: &[T]) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn download<T: Elem>(&self, src: &Buf<T>) -> Result<Vec<T>, KernelError> {
        match self.never {}
    }
    pub fn synchronize(&self) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn poll_error(&self) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn time_ms(&self, reps: usize, f: impl FnMut() -> Result<(), KernelError>) -> Result<f64, KernelError> {
        match self.never {}
    }
    pub fn marks(&self, capacity: usize) -> Result<Marks, KernelError> {
        match self.never {}
    }
    pub fn mark(&self, m: &mut Marks) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn rms_norm(
        &self,
        out: &mut Buf<bf16>,
        x: &Buf<bf16>,
        w: &Buf<bf16>,
        n_rows: usize,
        eps: f32,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn add_rms_norm(
        &self,
        out: &mut Buf<bf16>,
        residual: &mut Buf<bf16>,
        x: &Buf<bf16>,
        w: &Buf<bf16>,
        n_rows: usize,
        eps: f32,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    #[allow(clippy::too_many_arguments)]
    pub fn add_parts_rms_norm(
        &self,
        out: &mut Buf<bf16>,
        residual: &mut Buf<bf16>,
        parts: &Buf<f32>,
        splits: usize,
        w: &Buf<bf16>,
        n_rows: usize,
        eps: f32,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn silu_mul(&self, out: &mut Buf<bf16>, gate: &Buf<bf16>, up: &Buf<bf16>) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn silu_mul_packed(&self, out: &mut Buf<bf16>, gate_up: &Buf<bf16>, n_rows: usize) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn embedding(
        &self,
        out: &mut Buf<bf16>,
        table: &Buf<bf16>,
        ids: &Buf<u32>,
        dim: usize,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn rope_cache(&self, params: &RopeParams, max_positions: usize) -> Result<RopeCache, KernelError> {
        match self.never {}
    }
    pub fn rope(
        &self,
        x: &mut Buf<bf16>,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        positions: &Buf<u32>,
        cache: &RopeCache,
        style: RopeStyle,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn matmul(
        &self,
        out: &mut Buf<bf16>,
        x: &Buf<bf16>,
        m: usize,
        w: &Buf<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_parts(
        &self,
        parts: &mut Buf<f32>,
        splits: usize,
        x: &Buf<bf16>,
        m: usize,
        w: &Buf<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn capture(&self, f: impl FnOnce() -> Result<(), KernelError>) -> Result<Graph, KernelError> {
        match self.never {}
    }
    pub fn launch_graph(&self, graph: &Graph) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn matmul_f32(
        &self,
        out: &mut Buf<f32>,
        x: &Buf<bf16>,
        m: usize,
        w: &Buf<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    #[doc(hidden)]
    pub fn matmul_cublaslt(
        &self,
        out: &mut Buf<bf16>,
        x: &Buf<bf16>,
        m: usize,
        w: &Buf<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn add_residual(&self, residual: &mut Buf<bf16>, x: &Buf<bf16>) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn fused_gemv_applies(&self, m: usize, rows: usize, cols: usize) -> bool {
        match self.never {}
    }
    pub fn fused_norm_gemv_applies(&self, m: usize, rows: usize, cols: usize) -> bool {
        match self.never {}
    }
    pub fn fused_rope_gemv_applies(&self, p: &QkvPrep, cols: usize) -> bool {
        match self.never {}
    }
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_rms_norm_rope(
        &self,
        q_out: &mut Buf<bf16>,
        k_cache: &mut Buf<bf16>,
        v_cache: &mut Buf<bf16>,
        cache: &PagedKv,
        p: &QkvPrep,
        x: &Buf<bf16>,
        gamma: &Buf<bf16>,
        eps: f32,
        w: &Buf<bf16>,
        cols: usize,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_rms_norm(
        &self,
        out: &mut Buf<bf16>,
        x: &Buf<bf16>,
        gamma: &Buf<bf16>,
        eps: f32,
        m: usize,
        w: &Buf<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_rms_norm_swiglu(
        &self,
        act: &mut Buf<bf16>,
        x: &Buf<bf16>,
        gamma: &Buf<bf16>,
        eps: f32,
        m: usize,
        gate_up: &Buf<bf16>,
        ffn: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn matmul_add_residual(
        &self,
        residual: &mut Buf<bf16>,
        x: &Buf<bf16>,
        m: usize,
        w: &Buf<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    #[doc(hidden)]
    pub fn set_gemv_tuning(&self, stages: usize, warps: usize, persistent: bool, pdl: u8) -> Result<(), KernelError> {
        match self.never {}
    }
    #[doc(hidden)]
    pub fn matmul_f32_cublaslt(
        &self,
        out: &mut Buf<f32>,
        x: &Buf<bf16>,
        m: usize,
        w: &Buf<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn copy_rows<T: Elem>(
        &self,
        dst: &mut Buf<T>,
        dst_row: usize,
        src: &Buf<T>,
        src_row: usize,
        n_rows: usize,
        row_len: usize,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn qkv_rope_write(
        &self,
        q_out: &mut Buf<bf16>,
        k_cache: &mut Buf<bf16>,
        v_cache: &mut Buf<bf16>,
        cache: &PagedKv,
        p: &super::QkvPrep,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn fill_uniform(&self, buf: &mut Buf<bf16>, seed: u64, lo: f32, hi: f32) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn write_kv(
        &self,
        cache: &PagedKv,
        k_cache: &mut Buf<bf16>,
        v_cache: &mut Buf<bf16>,
        k: &Buf<bf16>,
        v: &Buf<bf16>,
        slots: &Buf<u32>,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn sample_output(&self, max_rows: usize, max_logprobs: usize) -> Result<SampleOutput, KernelError> {
        match self.never {}
    }
    pub fn sample(
        &self,
        out: &mut SampleOutput,
        logits: &mut Buf<f32>,
        vocab: usize,
        params: &Buf<super::SampleParams>,
        pen_offsets: &Buf<u32>,
        pen_tokens: &Buf<u32>,
        pen_counts: &Buf<u32>,
        bias_offsets: &Buf<u32>,
        bias_tokens: &Buf<u32>,
        bias_values: &Buf<f32>,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn sample_paths(
        &self,
        out: &mut SampleOutput,
        logits: &mut Buf<f32>,
        vocab: usize,
        params: &Buf<super::SampleParams>,
        pen_offsets: &Buf<u32>,
        pen_tokens: &Buf<u32>,
        pen_counts: &Buf<u32>,
        bias_offsets: &Buf<u32>,
        bias_tokens: &Buf<u32>,
        bias_values: &Buf<f32>,
        paths: super::sample_params::SamplePaths,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn decode_workspace(
        &self,
        max_seqs: usize,
        n_heads: usize,
        head_dim: usize,
        max_splits: usize,
    ) -> Result<DecodeWorkspace, KernelError> {
        match self.never {}
    }
    pub fn set_decode_lean_max_seqs(&self, n: usize) {
        match self.never {}
    }
    pub fn set_decode_early_start(&self, early: bool) {
        match self.never {}
    }
    pub fn paged_decode_attention(
        &self,
        out: &mut Buf<bf16>,
        q: &Buf<bf16>,
        batch: &PagedBatch,
        n_heads: usize,
        scale: f32,
        max_context: usize,
        split_len: Option<usize>,
        workspace: Option<&mut DecodeWorkspace>,
    ) -> Result<DecodePlan, KernelError> {
        match self.never {}
    }
    pub fn paged_prefill_attention(
        &self,
        out: &mut Buf<bf16>,
        q: &Buf<bf16>,
        batch: &PagedBatch,
        cu_q: &Buf<u32>,
        max_q_len: usize,
        n_heads: usize,
        scale: f32,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn nccl_unique_id() -> Result<super::NcclId, KernelError> {
        Err(NOT)
    }
    pub fn nccl_join(&self, id: &super::NcclId, rank: usize, world: usize) -> Result<NcclComm, KernelError> {
        match self.never {}
    }
    pub fn all_reduce_sum(&self, comm: &NcclComm, buf: &mut Buf<bf16>) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn all_reduce_sum_f32(&self, comm: &NcclComm, buf: &mut Buf<f32>) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn nccl_send<T: Elem>(
        &self,
        comm: &NcclComm,
        buf: &Buf<T>,
        count: usize,
        peer: usize,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn nccl_recv<T: Elem>(
        &self,
        comm: &NcclComm,
        buf: &mut Buf<T>,
        count: usize,
        peer: usize,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn nccl_all_gather<T: Elem>(
        &self,
        comm: &NcclComm,
        local: &Buf<T>,
        out: &mut Buf<T>,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn copy_2d<T: Elem>(&self, dst: &mut Buf<T>, src: &Buf<T>, c: &super::Copy2d) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn write_2d<T: Elem>(
        &self,
        dst: &mut Buf<T>,
        src: &HostStage<T>,
        c: &super::Copy2d,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn alloc_stage<T: Elem>(&self, len: usize) -> Result<HostStage<T>, KernelError> {
        match self.never {}
    }
    pub fn write_staged<T: Elem>(&self, dst: &mut Buf<T>, src: &HostStage<T>, from: usize) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn unpack4(&self, packed: &Buf<u32>, out: [&mut Buf<u32>; 4]) -> Result<(), KernelError> {
        match self.never {}
    }
    pub fn take_sampled_ids(
        &self,
        ids: &mut Buf<u32>,
        n: usize,
        sampled: &Buf<u32>,
        rows: usize,
    ) -> Result<(), KernelError> {
        match self.never {}
    }
}
