//! bf16 GEMM through cuBLASLt: `out = x · Wᵀ` with `x` `[m, cols]`, `W` `[rows, cols]`
//! (the layout weights are stored in: one output feature per row), `out` `[m, rows]`, all
//! row-major bf16 (or `out` f32 for logits: [`Device::matmul_f32`]), f32 accumulation.
//!
//! cuBLASLt is column-major. A row-major `[r, c]` matrix is the column-major `[c, r]`
//! one, so `out` (row-major `[m, rows]`) is column-major `outᵀ = W · xᵀ`: cuBLAS's
//! `D[rows, m] = op(A)[rows, cols] · B[cols, m]` with `A` = W seen as column-major
//! `[cols, rows]`, transposed, and `B` = x seen as column-major `[cols, m]`.
//!
//! The descriptors and the heuristic's algorithm are made once per (m, rows, cols) and
//! kept: asking the heuristic costs tens of µs of CPU, more than a decode GEMM takes on
//! the GPU. A model has a handful of shapes per batch size, so the map stays small.
//!
//! Batches of at most 8 rows against weights of up to 64M values go to the GEMV kernel
//! instead (`gemv.rs`), which is faster than cuBLASLt there.
//!
//! [`Device::matmul_parts`] splits the inner dimension (`cols`) into `splits` chunks run as
//! one strided cuBLASLt batch, each writing an f32 partial `[m, rows]`; the kernel that
//! consumes the output sums them (`add_parts_rms_norm`). At 16-256 tokens the o and down
//! projections of an 8B model have too few output tiles to keep every SM streaming W, and
//! cuBLASLt's own split-K for down adds a reduction kernel; two chunks stream W 4-19% faster
//! on an H200 (bench/gpu/split_gemm.cu, RESULTS 2026-12-03).
//!
//! A plan of a weight larger than L2, split or of a decode-sized step (at most
//! [`TUNE_MAX_ROWS`] rows of x), times the heuristic's first 8 candidates on its first call
//! outside a graph capture and keeps the fastest; other plans run the first. The heuristic's
//! first choice is not the fastest at decode sizes: gate|up at 64 tokens 62.0 µs, another of
//! its 8 candidates 58.6 (bench/gpu/gemm_candidates.cu); split plans +1.3% at 64 sequences,
//! unsplit ones too 0.8-2.7% shorter forward passes at 64-128 (RESULTS 2026-12-03 and
//! 2026-12-04). `TESSERA_GEMM_TUNE=0`: never; `=split`: split plans only (the earlier rule).
//! The choice is by timing, so two processes may keep different candidates, whose sums may
//! round differently in the last bit (a candidate with another split-K).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublaslt::{result, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::device::{dev_err, Buf, Device};
use super::MAX_SPLITS;
use crate::error::check;
use crate::KernelError;
use half::bf16;

/// cuBLASLt's recommended workspace on Hopper.
const WORKSPACE_BYTES: usize = 32 << 20;
/// Heuristic candidates a split plan times on its first call. H200, the split down GEMM
/// (4096 x 14336) at 64 tokens: the first candidate 32.6 µs, the second 30.9
/// (bench/gpu/split_gemm.cu).
const TUNE_CANDIDATES: usize = 8;
/// Only weights larger than this are timed: a smaller one stays in the 50 MB L2 from one
/// timed call to the next, which would time L2 reads, not the stream from memory that a
/// model's step sees.
const TUNE_MIN_WEIGHT_BYTES: usize = 64 << 20;
/// Timed calls per candidate (after one untimed).
const TUNE_REPS: usize = 5;
/// Unsplit plans are timed up to this many rows of x: the decode graphs' buckets, tuned in
/// their warm-up before capture, and prefill steps this short. Each such shape is timed once
/// per process, on its first step (8 candidates x 6 runs of each GEMM over 64 MiB: about
/// 3 ms for gate|up at 100 tokens, computed from its ~60 µs, more with a 1 GB LM head), so
/// at most 256 shapes ever pay it. A longer prefill step may have any length and runs the
/// heuristic's first choice.
const TUNE_MAX_ROWS: usize = 256;

/// Descriptors and chosen algorithm of one GEMM shape.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    /// The heuristic's candidates, best first (one unless the plan may be tuned).
    algos: Vec<sys::cublasLtMatmulAlgo_t>,
    /// The candidate to run once settled ([`Device::matmul_parts`]): the one timed fastest,
    /// or the first for a plan that is never timed; unset: not settled yet (the first runs).
    tuned: OnceLock<usize>,
}

// SAFETY: the descriptors are immutable after creation and only read by cublasLtMatmul,
// which cuBLAS documents as thread-safe for distinct calls.
unsafe impl Send for Plan {}
unsafe impl Sync for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created in Plan::new and destroyed only here.
        unsafe {
            let _ = result::destroy_matrix_layout(self.a);
            let _ = result::destroy_matrix_layout(self.b);
            let _ = result::destroy_matrix_layout(self.d);
            let _ = result::destroy_matmul_desc(self.desc);
        }
    }
}

/// Creates the layouts one by one, so a failure part-way destroys what exists.
struct Partial {
    desc: Option<sys::cublasLtMatmulDesc_t>,
    layouts: Vec<sys::cublasLtMatrixLayout_t>,
}

impl Drop for Partial {
    fn drop(&mut self) {
        // SAFETY: each handle was created here and not handed on.
        unsafe {
            for l in self.layouts.drain(..) {
                let _ = result::destroy_matrix_layout(l);
            }
            if let Some(d) = self.desc.take() {
                let _ = result::destroy_matmul_desc(d);
            }
        }
    }
}

impl Plan {
    fn new(
        handle: sys::cublasLtHandle_t,
        m: u64,
        rows: u64,
        cols: u64,
        out_f32: bool,
        splits: u64,
        candidates: usize,
    ) -> Result<Self, result::CublasError> {
        use sys::cublasLtMatmulDescAttributes_t as D;
        let bf = sys::cudaDataType_t::CUDA_R_16BF;
        let out_ty = if out_f32 { sys::cudaDataType_t::CUDA_R_32F } else { bf };
        let mut p = Partial { desc: None, layouts: Vec::new() };
        let desc =
            result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType_t::CUDA_R_32F)?;
        p.desc = Some(desc);
        // cublasOperation_t: CUBLAS_OP_T = 1 (cuBLASLt's sys module does not re-export the enum).
        let trans_a: i32 = 1;
        // SAFETY: the attribute value is a live i32 of the size given.
        unsafe {
            result::set_matmul_desc_attribute(
                desc,
                D::CUBLASLT_MATMUL_DESC_TRANSA,
                (&trans_a as *const i32).cast(),
                std::mem::size_of::<i32>(),
            )?;
        }
        // A: W as column-major [cols, rows] (transposed by TRANSA); B: x as [cols, m];
        // D: out as [rows, m]. Split: batch entry i is A's and B's rows (cols / splits) * i
        // onwards (same leading dimension) and D's i-th [rows, m] block.
        let chunk = cols / splits;
        let layouts = [(bf, chunk, rows, cols, chunk), (bf, chunk, m, cols, chunk), (out_ty, rows, m, rows, rows * m)];
        for (ty, r, c, ld, stride) in layouts {
            let ld = i64::try_from(ld).unwrap_or(i64::MAX);
            let l = result::create_matrix_layout(ty, r, c, ld)?;
            p.layouts.push(l);
            if splits > 1 {
                use sys::cublasLtMatrixLayoutAttribute_t as L;
                let count = i32::try_from(splits).unwrap_or(i32::MAX);
                let stride = i64::try_from(stride).unwrap_or(i64::MAX);
                // SAFETY: l is live; the values are an i32 and an i64 of the sizes given.
                unsafe {
                    result::set_matrix_layout_attribute(
                        l,
                        L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        (&count as *const i32).cast(),
                        std::mem::size_of::<i32>(),
                    )?;
                    result::set_matrix_layout_attribute(
                        l,
                        L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                        (&stride as *const i64).cast(),
                        std::mem::size_of::<i64>(),
                    )?;
                }
            }
        }
        let pref = result::create_matmul_pref()?;
        let ws = WORKSPACE_BYTES;
        // SAFETY: sys::cublasLtMatmulHeuristicResult_t is plain data (zeroes are a valid value).
        let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> =
            vec![unsafe { std::mem::zeroed() }; candidates.max(1)];
        let mut found: std::ffi::c_int = 0;
        // SAFETY: pref is live; the value is a usize of the size given; `results` holds the
        // number of results asked for and `found` receives how many were written.
        let status = unsafe {
            let r = result::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const usize).cast(),
                std::mem::size_of::<usize>(),
            )
            .and_then(|()| {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    desc,
                    p.layouts[0],
                    p.layouts[1],
                    p.layouts[2],
                    p.layouts[2],
                    pref,
                    std::ffi::c_int::try_from(results.len()).unwrap_or(1),
                    results.as_mut_ptr(),
                    &mut found,
                )
                .result()
            });
            let _ = result::destroy_matmul_pref(pref);
            r
        };
        status?;
        results.truncate(usize::try_from(found).unwrap_or(0));
        let algos: Vec<_> = results.iter().filter(|r| r.state.result().is_ok()).map(|r| r.algo).collect();
        if algos.is_empty() {
            return Err(result::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED));
        }
        let (a, b, d) = (p.layouts[0], p.layouts[1], p.layouts[2]);
        p.layouts.clear();
        p.desc = None;
        Ok(Plan { desc, a, b, d, algos, tuned: OnceLock::new() })
    }
}

/// The cuBLASLt handle, its workspace and the plans made so far.
pub(crate) struct Gemm {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: Mutex<HashMap<PlanKey, Arc<Plan>>>,
    /// Which plans time the heuristic's candidates (`TESSERA_GEMM_TUNE`).
    tune: Tune,
}

/// Which plans time their candidates: none (`TESSERA_GEMM_TUNE=0`), split ones only
/// (`=split`), or split ones and decode-sized ones (the default).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Tune {
    Never,
    Split,
    SplitAndDecode,
}

impl Tune {
    fn from_env(v: Option<&str>) -> Self {
        match v {
            Some("0") => Tune::Never,
            Some("split") => Tune::Split,
            _ => Tune::SplitAndDecode,
        }
    }

    /// Whether a plan of `m` rows of x in `splits` chunks times its candidates (the weight's
    /// size is checked when it runs).
    fn times(self, m: usize, splits: usize) -> bool {
        match self {
            Tune::Never => false,
            Tune::Split => splits > 1,
            Tune::SplitAndDecode => splits > 1 || m <= TUNE_MAX_ROWS,
        }
    }
}

/// A GEMM plan's key: (m, rows, cols, f32 output, splits of cols).
type PlanKey = (usize, usize, usize, bool, usize);

// SAFETY: the handle is used only through &self methods that serialise plan creation with
// the mutex; cublasLtMatmul on one handle from several threads is allowed by cuBLAS.
unsafe impl Send for Gemm {}
unsafe impl Sync for Gemm {}

impl Drop for Gemm {
    fn drop(&mut self) {
        if let Ok(mut plans) = self.plans.lock() {
            plans.clear();
        }
        // SAFETY: created in Gemm::new; plans using it were dropped above.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

impl Gemm {
    pub(crate) fn new(stream: &Arc<CudaStream>) -> Result<Self, KernelError> {
        let handle = result::create_handle().map_err(dev_err("cublaslt_init"))?;
        let workspace = match stream.alloc_zeros::<u8>(WORKSPACE_BYTES) {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: just created, not shared.
                let _ = unsafe { result::destroy_handle(handle) };
                return Err(dev_err("cublaslt_init")(e));
            }
        };
        let tune = Tune::from_env(std::env::var("TESSERA_GEMM_TUNE").ok().as_deref());
        Ok(Gemm { handle, workspace, plans: Mutex::new(HashMap::new()), tune })
    }

    fn plan(&self, m: usize, rows: usize, cols: usize, out_f32: bool, splits: usize) -> Result<Arc<Plan>, KernelError> {
        let mut plans = self.plans.lock().map_err(|_| KernelError::Device {
            op: "cuda_matmul",
            detail: "GEMM plan cache poisoned by a panic".into(),
        })?;
        let key = (m, rows, cols, out_f32, splits);
        if let Some(p) = plans.get(&key) {
            return Ok(p.clone());
        }
        let candidates = if self.tune.times(m, splits) { TUNE_CANDIDATES } else { 1 };
        let plan = Plan::new(self.handle, m as u64, rows as u64, cols as u64, out_f32, splits as u64, candidates);
        let p = Arc::new(plan.map_err(|e| KernelError::Device {
            op: "cuda_matmul",
            detail: format!("no cuBLASLt plan for m={m} {rows}x{cols} in {splits} splits: {e:?}"),
        })?);
        plans.insert(key, p.clone());
        Ok(p)
    }
}

/// A split count [`Device::matmul_parts`] and the kernels summing its partials take: 1 to
/// [`MAX_SPLITS`].
pub(crate) fn check_splits(op: &'static str, splits: usize) -> Result<(), KernelError> {
    check((1..=MAX_SPLITS).contains(&splits), op, || format!("{splits} splits (1-{MAX_SPLITS})"))
}

/// The operand lengths of `out = x · Wᵀ`: W `[rows, cols]` and not empty, x `[m, cols]`,
/// and `out_len` = m x `out_width` (`rows` for a plain GEMM; a fused epilogue may write
/// fewer values per row of x).
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_gemm_operands(
    op: &'static str,
    x: &Buf<bf16>,
    m: usize,
    w: &Buf<bf16>,
    rows: usize,
    cols: usize,
    out_len: usize,
    out_width: usize,
) -> Result<(), KernelError> {
    check(rows > 0 && cols > 0, op, || format!("weight {rows}x{cols} is empty"))?;
    check(rows.checked_mul(cols) == Some(w.len()), op, || {
        format!("weight has {} values, expected {rows}x{cols}", w.len())
    })?;
    check(m.checked_mul(cols) == Some(x.len()), op, || {
        format!("x has {} values, expected m={m} x cols={cols}", x.len())
    })?;
    check(m.checked_mul(out_width) == Some(out_len), op, || {
        format!("out has {out_len} values, expected m={m} x {out_width}")
    })
}

impl Device {
    /// `out = x · Wᵀ`; `x` `[m, cols]`, `w` `[rows, cols]`, `out` `[m, rows]`.
    pub fn matmul(
        &self,
        out: &mut Buf<bf16>,
        x: &Buf<bf16>,
        m: usize,
        w: &Buf<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        self.gemm_into(&mut out.inner, false, x, m, w, rows, cols, true)
    }

    /// [`Device::matmul`] with an f32 `out` (the LM head: logits keep the accumulator's
    /// precision for sampling and log-probabilities).
    pub fn matmul_f32(
        &self,
        out: &mut Buf<f32>,
        x: &Buf<bf16>,
        m: usize,
        w: &Buf<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        self.gemm_into(&mut out.inner, true, x, m, w, rows, cols, true)
    }

    /// [`Device::matmul`] always through cuBLASLt, never the GEMV (benchmarks compare them).
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
        self.gemm_into(&mut out.inner, false, x, m, w, rows, cols, false)
    }

    /// [`Device::matmul_f32`] always through cuBLASLt, never the GEMV.
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
        self.gemm_into(&mut out.inner, true, x, m, w, rows, cols, false)
    }

    /// `x · Wᵀ` with its inner dimension cut into `splits` equal chunks: `parts[i]` =
    /// `x[:, chunk i] · W[:, chunk i]ᵀ` in f32, `parts` `[splits, m, rows]` (its first values: a
    /// buffer for the largest step serves every smaller one). `cols` must split into chunks of
    /// a multiple of 8 values. For [`Device::add_parts_rms_norm`], which sums them.
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
        const OP: &str = "cuda_matmul_parts";
        check_splits(OP, splits)?;
        check(cols.is_multiple_of(splits) && (cols / splits).is_multiple_of(8), OP, || {
            format!("{cols} columns do not split into {splits} chunks of a multiple of 8")
        })?;
        check(m.checked_mul(rows).and_then(|n| n.checked_mul(splits)).is_some_and(|n| n <= parts.len()), OP, || {
            format!("parts has {} values, fewer than {splits} x m={m} x {rows}", parts.len())
        })?;
        check_gemm_operands(OP, x, m, w, rows, cols, m * rows, rows)?;
        if m == 0 {
            return Ok(());
        }
        let plan = self.gemm.plan(m, rows, cols, true, splits)?;
        let algo = self.tuned_algo(OP, &plan, &mut parts.inner, x, w)?;
        self.run_plan(OP, &plan, algo, &mut parts.inner, x, w)
    }

    /// The candidate of `plan` to run: on its first call outside a graph capture, with a
    /// weight larger than [`TUNE_MIN_WEIGHT_BYTES`], each candidate is run on these operands
    /// and the fastest kept (`out` is overwritten by the caller's run after); else the first.
    fn tuned_algo<T>(
        &self,
        op_name: &'static str,
        plan: &Plan,
        out: &mut CudaSlice<T>,
        x: &Buf<bf16>,
        w: &Buf<bf16>,
    ) -> Result<usize, KernelError> {
        if let Some(&i) = plan.tuned.get() {
            return Ok(i);
        }
        // A plan's weight size is fixed by its shape: one that cannot be tuned is settled at
        // once, so later calls skip the capture query too.
        if plan.algos.len() < 2 || w.len() * 2 <= TUNE_MIN_WEIGHT_BYTES {
            return Ok(*plan.tuned.get_or_init(|| 0));
        }
        let capturing = self.stream.capture_status().map_err(dev_err(op_name))?
            != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        if capturing {
            return Ok(0);
        }
        // A candidate that fails to run is passed over (the first one is what an untuned plan
        // runs, so the caller's own run reports its failure).
        let mut best = (0, f64::INFINITY);
        for i in 0..plan.algos.len() {
            let timed = self
                .run_plan(op_name, plan, i, out, x, w)
                .and_then(|()| self.time_ms(TUNE_REPS, || self.run_plan(op_name, plan, i, out, x, w)));
            if let Ok(ms) = timed {
                if ms < best.1 {
                    best = (i, ms);
                }
            }
        }
        Ok(*plan.tuned.get_or_init(|| best.0))
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm_into<T>(
        &self,
        out: &mut CudaSlice<T>,
        out_f32: bool,
        x: &Buf<bf16>,
        m: usize,
        w: &Buf<bf16>,
        rows: usize,
        cols: usize,
        allow_gemv: bool,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_matmul";
        check_gemm_operands(OP, x, m, w, rows, cols, out.len(), rows)?;
        if m == 0 {
            return Ok(());
        }
        // Decode batches stream W once: the GEMV does that at full bandwidth (gemv.rs).
        if allow_gemv && super::gemv::applies(m, rows, cols) {
            return self.gemv_into(out, out_f32, x, m, w, rows, cols);
        }
        let plan = self.gemm.plan(m, rows, cols, out_f32, 1)?;
        let algo = self.tuned_algo(OP, &plan, out, x, w)?;
        self.run_plan(OP, &plan, algo, out, x, w)
    }

    /// Runs `plan`'s candidate `algo` (the plan made for these operands' shapes and `out`'s
    /// type) on the stream.
    fn run_plan<T>(
        &self,
        op_name: &'static str,
        plan: &Plan,
        algo: usize,
        out: &mut CudaSlice<T>,
        x: &Buf<bf16>,
        w: &Buf<bf16>,
    ) -> Result<(), KernelError> {
        let s = &self.stream;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (wp, _g1) = w.inner.device_ptr(s);
        let (xp, _g2) = x.inner.device_ptr(s);
        let (op, _g3) = out.device_ptr_mut(s);
        let (ws, _g4) = self.gemm.workspace.device_ptr(s);
        // SAFETY: the plan was made for exactly these shapes, splits and output type (the
        // callers pair `out_f32` with `T`); the buffers' lengths were checked against them;
        // beta = 0 so C (aliased to D) is not read.
        unsafe {
            result::matmul(
                self.gemm.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                wp as *const c_void,
                plan.a,
                xp as *const c_void,
                plan.b,
                op as *const c_void,
                plan.d,
                op as *mut c_void,
                plan.d,
                &plan.algos[algo.min(plan.algos.len() - 1)],
                ws as *mut c_void,
                WORKSPACE_BYTES,
                s.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(dev_err(op_name))
    }
}

#[cfg(test)]
mod tests {
    use super::{Tune, TUNE_MAX_ROWS};

    #[test]
    fn tune_setting_chooses_which_plans_are_timed() {
        assert_eq!(Tune::from_env(None), Tune::SplitAndDecode);
        assert_eq!(Tune::from_env(Some("1")), Tune::SplitAndDecode);
        assert_eq!(Tune::from_env(Some("0")), Tune::Never);
        assert_eq!(Tune::from_env(Some("split")), Tune::Split);
        // (rows of x, splits) -> timed under Never, Split, SplitAndDecode
        let cases = [
            ((64, 2), [false, true, true]),
            ((64, 1), [false, false, true]),
            ((TUNE_MAX_ROWS, 1), [false, false, true]),
            ((TUNE_MAX_ROWS + 1, 1), [false, false, false]),
            ((4096, 2), [false, true, true]),
        ];
        for ((m, splits), want) in cases {
            let got = [Tune::Never, Tune::Split, Tune::SplitAndDecode].map(|t| t.times(m, splits));
            assert_eq!(got, want, "m={m} splits={splits}");
        }
    }
}
