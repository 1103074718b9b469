//! The description of a strided 2-D block copy between row-major device matrices
//! ([`Device::copy_2d`](super::Device::copy_2d)); pure, so its bounds rule is tested
//! without a GPU.

/// A `[rows, width]` block: element `(i, j)` moves from `src[src_at + i * src_pitch + j]`
/// to `dst[dst_at + i * dst_pitch + j]` (offsets and pitches in elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy2d {
    pub rows: usize,
    pub width: usize,
    pub src_pitch: usize,
    pub src_at: usize,
    pub dst_pitch: usize,
    pub dst_at: usize,
}

impl Copy2d {
    /// Columns `col..col + width` of every row of a `[rows, cols]` matrix, into a dense
    /// `[rows, width]` one.
    pub fn columns(rows: usize, cols: usize, col: usize, width: usize) -> Self {
        Copy2d { rows, width, src_pitch: cols, src_at: col, dst_pitch: width, dst_at: 0 }
    }

    /// Rows `rows` and columns `cols` of one `[_, pitch]` matrix into the same place of
    /// another of the same shape (a changed block of a host mirror to the device copy).
    pub fn block(pitch: usize, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> Self {
        let at = rows.start * pitch + cols.start;
        Copy2d { rows: rows.len(), width: cols.len(), src_pitch: pitch, src_at: at, dst_pitch: pitch, dst_at: at }
    }

    /// Whether the block lies inside a source of `src_len` and a destination of `dst_len`
    /// elements, rows not overlapping within either (`width <= pitch`), with no overflow.
    pub fn fits(&self, src_len: usize, dst_len: usize) -> bool {
        if self.rows == 0 || self.width == 0 {
            return true;
        }
        let end = |at: usize, pitch: usize| -> Option<usize> {
            (self.rows - 1).checked_mul(pitch)?.checked_add(at)?.checked_add(self.width)
        };
        self.width <= self.src_pitch
            && self.width <= self.dst_pitch
            && end(self.src_at, self.src_pitch).is_some_and(|e| e <= src_len)
            && end(self.dst_at, self.dst_pitch).is_some_and(|e| e <= dst_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The block's element moves on the host, the rule `fits` protects.
    fn copy_host(c: &Copy2d, src: &[u32], dst: &mut [u32]) {
        for i in 0..c.rows {
            for j in 0..c.width {
                dst[c.dst_at + i * c.dst_pitch + j] = src[c.src_at + i * c.src_pitch + j];
            }
        }
    }

    #[test]
    fn columns_slice_a_matrix() {
        let (rows, cols) = (5, 7);
        let src: Vec<u32> = (0..(rows * cols) as u32).map(|v| v * 31 + 7).collect();
        let c = Copy2d::columns(rows, cols, 2, 3);
        assert!(c.fits(src.len(), rows * 3));
        let mut dst = vec![0; rows * 3];
        copy_host(&c, &src, &mut dst);
        for i in 0..rows {
            assert_eq!(&dst[i * 3..i * 3 + 3], &src[i * cols + 2..i * cols + 5]);
        }
    }

    #[test]
    fn a_block_lands_in_the_same_place() {
        let (rows, pitch) = (6, 9);
        let src: Vec<u32> = (0..(rows * pitch) as u32).map(|v| v * 17 + 3).collect();
        let c = Copy2d::block(pitch, 2..5, 4..7);
        assert!(c.fits(src.len(), src.len()));
        let mut dst = vec![0; rows * pitch];
        copy_host(&c, &src, &mut dst);
        for (k, (d, s)) in dst.iter().zip(&src).enumerate() {
            let inside = (2..5).contains(&(k / pitch)) && (4..7).contains(&(k % pitch));
            assert_eq!(*d, if inside { *s } else { 0 }, "element {k}");
        }
        assert!(!Copy2d::block(pitch, 5..7, 0..1).fits(rows * pitch, rows * pitch), "row 6 is past the end");
    }

    #[test]
    fn fits_rejects_blocks_past_either_end() {
        let c = Copy2d::columns(4, 8, 6, 2);
        assert!(c.fits(32, 8));
        assert!(!c.fits(31, 8), "last row ends at element 32");
        assert!(!c.fits(32, 7), "destination holds 4 x 2");
        assert!(!Copy2d::columns(4, 8, 7, 2).fits(32, 8), "columns 7..9 of 8");
        let wide = Copy2d { width: 9, ..Copy2d::columns(1, 8, 0, 8) };
        assert!(!wide.fits(100, 100), "rows wider than their pitch overlap");
        let huge = Copy2d { rows: usize::MAX, ..Copy2d::columns(1, 8, 0, 8) };
        assert!(!huge.fits(usize::MAX, usize::MAX), "overflow is not a fit");
        assert!(Copy2d { rows: 0, ..c }.fits(0, 0));
    }
}
