//! A borrowed weight matrix in any [`GgmlType`]: the view the matmul and the embedding
//! lookup read, typically pointing into a memory-mapped GGUF file.

use super::GgmlType;
use crate::KernelError;

/// Row-major matrix of `rows` rows of `cols` values; each row is a whole number of
/// `ty` blocks, so row `r` is `data[r * row_bytes .. (r + 1) * row_bytes]`.
#[derive(Debug, Clone, Copy)]
pub struct Weight<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> Weight<'a> {
    /// A checked view: `cols` is a whole number of blocks and `data` holds exactly
    /// `rows` rows.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, KernelError> {
        let w = Weight { ty, rows, cols, data };
        w.check("Weight::new")?;
        Ok(w)
    }

    /// Bytes per row, or an error naming `op` when `cols` is not a whole number of blocks.
    pub fn row_bytes(&self, op: &'static str) -> Result<usize, KernelError> {
        self.ty.bytes_for(self.cols).ok_or_else(|| KernelError::Shape {
            op,
            detail: format!(
                "{} columns is not a whole number of {} blocks of {}",
                self.cols,
                self.ty,
                self.ty.block_elems()
            ),
        })
    }

    /// Validates the fields (they are public, so every op re-checks); returns the row size.
    pub fn check(&self, op: &'static str) -> Result<usize, KernelError> {
        let row_bytes = self.row_bytes(op)?;
        let need = row_bytes.checked_mul(self.rows);
        crate::error::check(need == Some(self.data.len()), op, || {
            format!(
                "{} weight of {}x{} needs {} bytes, {} given",
                self.ty,
                self.rows,
                self.cols,
                need.map_or_else(|| "more than usize::MAX".to_string(), |n| n.to_string()),
                self.data.len()
            )
        })?;
        Ok(row_bytes)
    }
}
