//! Weight views that outlive the borrow of the model file.
//!
//! A model's tensors stay where the reader put them (a memory map, or an owned buffer for
//! files built in memory). `Linear` and friends hold `'static` slices into that storage
//! while the model keeps the `Arc<ModelFiles>` alive; the storage never moves or changes
//! after loading, which is what makes the lifetime extension sound.

use std::sync::Arc;

use tessera_kernels::quant::Weight;
use tessera_kernels::GgmlType;
use tessera_model::weights::{ModelFiles, TensorView};

use crate::error::WorkerError;

/// Where a weight's bytes live: in the model file, or in a buffer built at load time
/// (fused projections).
#[derive(Clone)]
enum Storage {
    Mapped(&'static [u8]),
    Owned(Arc<[u8]>),
}

/// A 2-D weight, `[rows, cols]` row-major in its stored type.
#[derive(Clone)]
pub struct Linear {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    data: Storage,
}

impl Linear {
    /// The kernel-facing view.
    pub fn weight(&self) -> Weight<'_> {
        let data = match &self.data {
            Storage::Mapped(s) => s,
            Storage::Owned(a) => &a[..],
        };
        Weight { ty: self.ty, rows: self.rows, cols: self.cols, data }
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
        Some(Linear {
            ty: first.ty,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            data: Storage::Owned(bytes.into()),
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
        Ok(Linear { ty, rows, cols, data: Storage::Mapped(v.data) })
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
