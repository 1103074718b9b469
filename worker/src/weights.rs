//! Weight views that outlive the borrow of the model file.
//!
//! A model's tensors stay where the reader put them (a memory map, or an owned buffer for
//! files built in memory). `Linear` and friends hold `'static` slices into that storage
//! while the model keeps the `Arc<ModelFiles>` alive; the storage never moves or changes
//! after loading, which is what makes the lifetime extension sound.

use std::ops::Range;
use std::sync::Arc;

use tessera_kernels::cpu::activation;
use tessera_kernels::cpu::matmul::{self, Isa};
use tessera_kernels::cpu::packed::PackedWeight;
use tessera_kernels::quant::Weight;
use tessera_kernels::GgmlType;
use tessera_model::weights::{ModelFiles, TensorView};

use crate::error::WorkerError;

/// Where a weight's bytes live: in the model file, or in a buffer built at load time
/// (fused projections, column shards). A row shard of an owned weight shares its buffer:
/// `range` picks the bytes that belong to this weight.
#[derive(Clone)]
enum Storage {
    Mapped(&'static [u8]),
    Owned(Arc<[u8]>, Range<usize>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(s) => s,
            // `range` is checked against the buffer wherever a `Storage` is made.
            Storage::Owned(a, r) => a.get(r.clone()).unwrap_or(&[]),
        }
    }

    /// The sub-range `bytes` of this storage, sharing it (no copy); `None` when out of bounds.
    fn slice(&self, bytes: Range<usize>) -> Option<Storage> {
        match self {
            Storage::Mapped(s) => s.get(bytes).map(Storage::Mapped),
            Storage::Owned(a, r) => {
                let start = r.start.checked_add(bytes.start)?;
                let end = r.start.checked_add(bytes.end)?;
                (start <= end && end <= r.end).then(|| Storage::Owned(a.clone(), start..end))
            }
        }
    }
}

/// A 2-D weight, `[rows, cols]` row-major in its stored type, plus (CPU engine) the same
/// weight repacked for the packed matmul kernels when [`Linear::pack`] made one.
#[derive(Clone)]
pub struct Linear {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    data: Storage,
    packed: Option<Arc<PackedWeight>>,
}

impl Linear {
    /// The kernel-facing view.
    pub fn weight(&self) -> Weight<'_> {
        Weight { ty: self.ty, rows: self.rows, cols: self.cols, data: self.data.bytes() }
    }

    /// A weight over bytes built in memory (`rows` rows of `cols` values in `ty`); the
    /// length must match exactly.
    pub(crate) fn from_parts(ty: GgmlType, rows: usize, cols: usize, bytes: Vec<u8>) -> Result<Linear, WorkerError> {
        Weight::new(ty, rows, cols, &bytes)?;
        let len = bytes.len();
        Ok(Linear { ty, rows, cols, data: Storage::Owned(bytes.into(), 0..len), packed: None })
    }

    /// `out = x · Wᵀ` on the CPU (`out`: `[n, rows]`, `x`: `[n, cols]`): the packed kernels
    /// when this weight has a packed copy, else the row-major ones.
    pub fn matmul(&self, out: &mut [f32], x: &[f32], n: usize) -> Result<(), WorkerError> {
        match &self.packed {
            Some(p) => {
                debug_assert!(p.rows() == self.rows && p.cols() == self.cols && p.ty() == self.ty);
                p.matmul(out, x, n)?
            }
            None => matmul::matmul(out, x, n, &self.weight())?,
        }
        Ok(())
    }

    /// `out += x · Wᵀ` (a residual connection): with a packed copy each task adds its
    /// values as it computes them (`PackedWeight::matmul_add`), else the product goes
    /// through `tmp` and is added after. The same bits either way as `matmul` then
    /// `activation::add_inplace`.
    pub fn matmul_add(&self, out: &mut [f32], x: &[f32], n: usize, tmp: &mut [f32]) -> Result<(), WorkerError> {
        match &self.packed {
            Some(p) => p.matmul_add(out, x, n)?,
            None => {
                matmul::matmul(tmp, x, n, &self.weight())?;
                activation::add_inplace(out, tmp)?;
            }
        }
        Ok(())
    }

    /// With `on`, makes the packed copy for this CPU's kernels (kept if there is one; a
    /// no-op where this CPU has no SIMD packed kernel for the type); without, drops it.
    pub fn pack(&mut self, on: bool) -> Result<(), WorkerError> {
        if !on {
            self.packed = None;
        } else if self.packed.is_none() && PackedWeight::has_simd_kernel(Isa::best(), self.ty) {
            self.packed = PackedWeight::pack(&self.weight(), Isa::best())?.map(Arc::new);
        }
        Ok(())
    }

    /// The packed copy, when there is one.
    pub fn packed(&self) -> Option<&PackedWeight> {
        self.packed.as_deref()
    }

    /// Whether [`Linear::matmul`] takes the packed kernels.
    pub fn is_packed(&self) -> bool {
        self.packed.is_some()
    }

    /// Rows `range` as a view sharing this weight's storage; `None` when out of bounds.
    pub(crate) fn row_view(&self, range: Range<usize>) -> Option<Linear> {
        let row_bytes = self.ty.bytes_for(self.cols)?;
        if range.start > range.end || range.end > self.rows {
            return None;
        }
        let bytes = range.start.checked_mul(row_bytes)?..range.end.checked_mul(row_bytes)?;
        let data = self.data.slice(bytes)?;
        Some(Linear { ty: self.ty, rows: range.len(), cols: self.cols, data, packed: None })
    }

    /// The matrices stacked row-wise into one (`[sum of rows, cols]`), so one matmul
    /// computes all their outputs; `None` unless all share the type and row length
    /// (quantised files often store `v` in a different type than `q` and `k`).
    pub fn fuse(parts: &[&Linear]) -> Option<Linear> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.ty != first.ty || p.cols != first.cols) {
            return None;
        }
        let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.weight().data.len()).sum());
        for p in parts {
            bytes.extend_from_slice(p.weight().data);
        }
        let len = bytes.len();
        Some(Linear {
            ty: first.ty,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            data: Storage::Owned(bytes.into(), 0..len),
            packed: None,
        })
    }
}

/// Resolves tensors by canonical name and checks their shapes.
pub struct WeightLoader {
    files: Arc<ModelFiles>,
}

impl WeightLoader {
    pub fn new(files: Arc<ModelFiles>) -> Self {
        WeightLoader { files }
    }

    /// The files the views point into; the model keeps this alive.
    pub fn files(&self) -> &Arc<ModelFiles> {
        &self.files
    }

    pub fn has(&self, name: &str) -> bool {
        self.files.has_tensor(name)
    }

    fn view(&self, name: &str) -> Result<(TensorView<'static>, GgmlType), WorkerError> {
        let v = self.files.tensor(name)?;
        let ty = v.ty;
        // SAFETY: the bytes live in `self.files` (a memory map or a heap buffer owned by it),
        // which is never mutated after loading and is kept alive by every model holding
        // a `WeightLoader`'s `Arc`; the allocation does not move when the Arc is cloned.
        let data: &'static [u8] = unsafe { std::slice::from_raw_parts(v.data.as_ptr(), v.data.len()) };
        Ok((TensorView { ty, rows: v.rows, cols: v.cols, data }, ty))
    }

    /// A matrix of `rows x cols`.
    pub fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear, WorkerError> {
        let (v, ty) = self.view(name)?;
        if v.rows != rows || v.cols != cols {
            return Err(WorkerError::TensorShape {
                name: name.to_string(),
                expected: format!("[{rows}, {cols}]"),
                found: format!("[{}, {}]", v.rows, v.cols),
            });
        }
        Ok(Linear { ty, rows, cols, data: Storage::Mapped(v.data), packed: None })
    }

    /// A 1-D tensor of `len` values, converted to f32 (norm weights, biases, rope factors).
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, WorkerError> {
        let (v, ty) = self.view(name)?;
        if v.rows * v.cols != len {
            return Err(WorkerError::TensorShape {
                name: name.to_string(),
                expected: format!("[{len}]"),
                found: format!("[{}, {}]", v.rows, v.cols),
            });
        }
        let mut out = vec![0.0f32; len];
        tessera_kernels::quant::dequantize_row(ty, v.data, &mut out)?;
        Ok(out)
    }
}
