//! The CPU matmul for Q4_0, Q4_1 and Q8_0 weights repacked once at load, sixteen rows
//! side by side, so that one SIMD lane holds one weight row and one integer dot product
//! instruction advances sixteen rows (AVX-512) or eight (AVX2) for one token.
//!
//! Why: the row-major kernels (`matmul.rs`) give each (row, token) pair its own vector of
//! eight partial sums, converted to f32 and scaled once per 32-value block: three vector
//! instructions per 32 multiply-adds, plus the horizontal sum. Here a block of sixteen rows
//! is laid out so that lane `r` of the k-th 64-byte chunk holds row `r`'s values
//! `4k .. 4k + 4`; against one token's four activation bytes broadcast to all lanes, eight
//! `vpdpbusd` give all sixteen rows' exact block sums, and one convert and two FMAs apply
//! the block scales to all sixteen at once. llama.cpp's repacked x86 kernels (`q4_0_8x8`,
//! AMX) rest on the same idea; the layout and arithmetic here are our own.
//!
//! Layout: rows in groups of [`GROUP`] (the last group padded with zero rows), each group
//! as `cols / 32` records, one per block of 32 columns:
//! - Q4_0 / Q4_1: 256 bytes of nibbles, chunk `k < 4` = the sixteen rows' quant bytes
//!   `4k .. 4k + 4` (low nibbles: values `4k..`, high nibbles: values `16 + 4k..`), then
//!   the sixteen f16 `d`, then the sixteen f16 `m` (Q4_1; zero for Q4_0).
//! - Q8_0: 512 bytes, chunk `k < 8` = the sixteen rows' values `4k .. 4k + 4` plus 128
//!   (as u8, since `vpdpbusd` multiplies u8 by i8), then the f16 `d`, then 32 zero bytes.
//!
//! Arithmetic (every instruction set, bit for bit the scalar kernel here): for each
//! (row, token), over the blocks in order, `acc = fma(f32(isum), d_w · d_x, acc)`, then
//! for Q4_0/Q4_1 `acc = fma(m_w, s_x, acc)` (`m_w = -8 d_w` for Q4_0; `s_x` = the
//! activation block's `d · Σq`); `isum` is the exact integer block dot product (Q8_0's
//! `+128` taken out as `-128 Σq`). The token tile only changes which tokens share a pass
//! over the weights, never a value, so a token's output is the same in any batch. These
//! bits differ from the row-major kernels' (another f32 summation order); a model runs
//! all its matmuls of one weight on one of the two, so it stays batch invariant.

use super::matmul::{split_plan, Isa};
use super::par::{self, SharedMut};
use crate::error::check;
use crate::quant::q8::ActsQ8;
use crate::quant::{GgmlType, Weight};
use crate::KernelError;

#[cfg(target_arch = "x86_64")]
#[path = "packed_simd.rs"]
mod simd;

/// Weight rows per group (the lanes of one 512-bit register of i32).
pub const GROUP: usize = 16;

/// Tokens per pass over a group's records (their accumulators stay in registers).
const TILE: usize = 8;

/// A 64-byte aligned line of the packed buffer.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Which kernel family runs a packed weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

/// A Q4_0, Q4_1 or Q8_0 weight in the packed layout (see the module comment), with the
/// instruction set that multiplies it.
pub struct PackedWeight {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    path: Path,
    /// Bytes per record (one group's block).
    rec: usize,
    lines: Vec<Line>,
}

/// Whether `ty` has packed kernels.
fn packable(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// Bytes of quant data in a record of `ty`.
fn quant_bytes(ty: GgmlType) -> usize {
    if ty == GgmlType::Q8_0 {
        512
    } else {
        256
    }
}

impl PackedWeight {
    /// Packs `w` for `isa`, or `None` when `isa` has no packed kernel for its type: every
    /// set takes Q4_0, Q4_1 and Q8_0 (the scalar one is a reference for tests, slower than
    /// the row-major scalar kernels: see [`PackedWeight::has_simd_kernel`]).
    pub fn pack(w: &Weight, isa: Isa) -> Result<Option<Self>, KernelError> {
        Self::pack_parts(std::slice::from_ref(w), isa)
    }

    /// Whether `isa` multiplies packed `ty` weights with SIMD kernels (faster than the
    /// row-major ones): AVX2 or AVX-512 VNNI, and Q4_0, Q4_1 or Q8_0.
    pub fn has_simd_kernel(isa: Isa, ty: GgmlType) -> bool {
        packable(ty) && isa.packed_path() != Path::Scalar
    }

    /// The matrices `parts` stacked row-wise (one `[Σ rows, cols]` weight, e.g. the q, k
    /// and v projections), packed for `isa` without first copying them into one buffer;
    /// `None` when the type has no packed kernel. The parts must share type and columns.
    pub fn pack_parts(parts: &[Weight], isa: Isa) -> Result<Option<Self>, KernelError> {
        const OP: &str = "PackedWeight::pack";
        let Some(first) = parts.first() else {
            return Err(KernelError::Shape { op: OP, detail: "no matrices to pack".into() });
        };
        let (ty, cols) = (first.ty, first.cols);
        let (mut rows, mut n_rows): (Vec<&[u8]>, usize) = (Vec::new(), 0);
        for w in parts {
            let row_bytes = w.check(OP)?;
            check(w.ty == ty && w.cols == cols, OP, || {
                format!("parts of {ty} x {cols} and {} x {} columns", w.ty, w.cols)
            })?;
            if row_bytes > 0 {
                rows.extend(w.data.chunks_exact(row_bytes));
            }
            n_rows += w.rows;
        }
        if !packable(ty) {
            return Ok(None);
        }
        let path = isa.packed_path();
        let (nb, groups) = (cols / 32, n_rows.div_ceil(GROUP));
        let rec = quant_bytes(ty) + 64;
        let mut lines = vec![Line([0; 64]); groups * nb * rec / 64];
        let packed = |lines| PackedWeight { ty, rows: n_rows, cols, path, rec, lines };
        if lines.is_empty() {
            return Ok(Some(packed(lines)));
        }
        let (block, qb) = (ty.block_bytes(), quant_bytes(ty));
        // One task per group of rows (the engine packs every layer at load).
        par::for_each_chunk_mut(&mut lines, nb * rec / 64, |g, group| {
            // SAFETY: `Line` is 64 plain bytes; the view covers exactly this group's lines.
            let bytes = unsafe { std::slice::from_raw_parts_mut(group.as_mut_ptr() as *mut u8, group.len() * 64) };
            for (lane, row) in rows.iter().skip(g * GROUP).take(GROUP).enumerate() {
                for (b, blk) in row.chunks_exact(block).enumerate() {
                    let out = &mut bytes[b * rec..(b + 1) * rec];
                    out[qb + 2 * lane..qb + 2 * lane + 2].copy_from_slice(&blk[0..2]);
                    if ty == GgmlType::Q8_0 {
                        for (i, &q) in blk[2..34].iter().enumerate() {
                            out[(i / 4) * 64 + lane * 4 + i % 4] = q ^ 0x80;
                        }
                        continue;
                    }
                    let qs = if ty == GgmlType::Q4_1 {
                        out[qb + 32 + 2 * lane..qb + 32 + 2 * lane + 2].copy_from_slice(&blk[2..4]);
                        &blk[4..20]
                    } else {
                        &blk[2..18]
                    };
                    for k in 0..4 {
                        out[k * 64 + lane * 4..k * 64 + lane * 4 + 4].copy_from_slice(&qs[4 * k..4 * k + 4]);
                    }
                }
            }
        });
        Ok(Some(packed(lines)))
    }

    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held (the packed copy; the original stays wherever it was).
    pub fn bytes(&self) -> usize {
        self.lines.len() * 64
    }

    /// `out = x · Wᵀ`: `out` is `[n, rows]`, `x` is `[n, cols]`.
    pub fn matmul(&self, out: &mut [f32], x: &[f32], n: usize) -> Result<(), KernelError> {
        self.matmul_parts(&mut [out], x, n)
    }

    /// `out += x · Wᵀ` (a residual connection), each sum one f32 addition of the product
    /// to `out`'s value, as [`PackedWeight::matmul`] then `activation::add_inplace`
    /// give; but the task that computes a value adds it while it is in its cache, and no
    /// second pass over the threads' outputs reads them back from other cores.
    pub fn matmul_add(&self, out: &mut [f32], x: &[f32], n: usize) -> Result<(), KernelError> {
        self.matmul_into(&mut [out], x, n, true)
    }

    /// [`PackedWeight::matmul`] with the output rows split between buffers in order:
    /// `outs[i]` is `[n, rows_i]`, the `rows_i` adding up to the weight's rows (the parts
    /// of [`PackedWeight::pack_parts`]), so a stacked weight's outputs land where their
    /// consumers read them, with no copy out of a joint `[n, rows]` buffer.
    pub fn matmul_parts(&self, outs: &mut [&mut [f32]], x: &[f32], n: usize) -> Result<(), KernelError> {
        self.matmul_into(outs, x, n, false)
    }

    /// [`PackedWeight::matmul_parts`] of activations already quantised
    /// (`ActsQ8::quantize_plain`, or an op that wrote them straight away, such as
    /// `norm::rms_norm_q8`): `acts` holds `n` rows of this weight's `cols`. Its quants
    /// must lie in -127..=127, as the quantisers make them (the AVX2 Q8_0 kernel's sign
    /// trick would read -128 as +128 and part from the scalar kernel).
    pub fn matmul_parts_q8(&self, outs: &mut [&mut [f32]], acts: &ActsQ8, n: usize) -> Result<(), KernelError> {
        self.matmul_acts(outs, acts, n, false)
    }

    /// [`PackedWeight::matmul_add`] of activations already quantised (see
    /// [`PackedWeight::matmul_parts_q8`]).
    pub fn matmul_add_q8(&self, out: &mut [f32], acts: &ActsQ8, n: usize) -> Result<(), KernelError> {
        self.matmul_acts(&mut [out], acts, n, true)
    }

    /// The f32 entries' body: `x` quantised, then [`PackedWeight::matmul_acts`].
    fn matmul_into(&self, outs: &mut [&mut [f32]], x: &[f32], n: usize, add: bool) -> Result<(), KernelError> {
        check(n.checked_mul(self.cols) == Some(x.len()), OP, || {
            format!(
                "x has {} values, expected n={n} x cols={} for a {}x{} weight",
                x.len(),
                self.cols,
                self.rows,
                self.cols
            )
        })?;
        self.matmul_acts(outs, &ActsQ8::quantize_plain(x, self.cols), n, add)
    }

    /// The body of every entry: `acts` checked against the weight, then the outputs.
    fn matmul_acts(&self, outs: &mut [&mut [f32]], acts: &ActsQ8, n: usize, add: bool) -> Result<(), KernelError> {
        let nb = self.cols / 32;
        check(
            acts.cols == self.cols
                && Some(acts.qs.len()) == n.checked_mul(self.cols)
                && acts.d.len() == n * nb
                && acts.s.len() == n * nb,
            OP,
            || {
                format!(
                    "activations of {} values in rows of {} for n={n} x cols={}",
                    acts.qs.len(),
                    acts.cols,
                    self.cols
                )
            },
        )?;
        let mut total = 0usize;
        for out in outs.iter() {
            let rows = out.len().checked_div(n).unwrap_or(0);
            check(rows * n == out.len(), OP, || format!("an output of {} values is not n={n} whole rows", out.len()))?;
            total += rows;
        }
        check(total == self.rows || n == 0 && outs.iter().all(|o| o.is_empty()), OP, || {
            format!("outputs of {total} rows in all for a {}-row weight", self.rows)
        })?;
        if n == 0 || self.rows == 0 {
            return Ok(());
        }
        if self.cols == 0 {
            if !add {
                outs.iter_mut().for_each(|o| o.fill(0.0));
            }
            return Ok(());
        }
        let mut first = 0;
        let parts: Vec<Part> = outs
            .iter_mut()
            .map(|out| {
                let (rows, f) = (out.len() / n, first);
                first += rows;
                Part { first: f, rows, base: SharedMut::new(out) }
            })
            .collect();
        // Q8_0 takes the `+128` of its weights out through each activation block's Σq.
        let qsum: Vec<i32> = if self.ty == GgmlType::Q8_0 {
            acts.qs.chunks_exact(32).map(|b| b.iter().map(|&v| v as i32).sum()).collect()
        } else {
            Vec::new()
        };
        let a = Acts { qs: &acts.qs, d: &acts.d, s: &acts.s, qsum: &qsum, cols: self.cols, nb };
        self.run(&parts, n, &a, add);
        Ok(())
    }

    /// Spreads groups of rows over the threads; each task runs all `n` tokens over its
    /// groups, [`TILE`] tokens per pass, and writes (or adds, `add`) each group's lanes
    /// into the parts that hold those rows (`parts` in row order, covering all rows).
    fn run(&self, parts: &[Part], n: usize, a: &Acts, add: bool) {
        let groups = self.rows.div_ceil(GROUP);
        let group_bytes = self.rec * a.nb;
        let (serial, per) = split_plan(groups, group_bytes, n);
        let rows = self.rows;
        let task = |i: usize| {
            for g in i * per..((i + 1) * per).min(groups) {
                let (r0, valid) = (g * GROUP, GROUP.min(rows - g * GROUP));
                let recs = &self.lines[g * group_bytes / 64..(g + 1) * group_bytes / 64];
                // The first part holding one of the group's rows.
                let first_part = parts.partition_point(|p| p.first + p.rows <= r0);
                let mut tile = [[0.0f32; GROUP]; TILE];
                for t0 in (0..n).step_by(TILE) {
                    let tn = TILE.min(n - t0);
                    self.tile(recs, a, t0, tn, &mut tile);
                    for (j, vals) in tile.iter().take(tn).enumerate() {
                        // Lanes `lane ..` go to the part holding row `r0 + lane`, up to its end.
                        let mut lane = 0;
                        let mut pi = first_part;
                        while lane < valid {
                            let p = &parts[pi];
                            let (from, take) =
                                (r0 + lane - p.first, (valid - lane).min(p.first + p.rows - (r0 + lane)));
                            let at = (t0 + j) * p.rows + from;
                            // SAFETY: part `p` is `[n, p.rows]` (checked by `matmul_acts`);
                            // its rows `from ..+ take` of every token belong to this task's group.
                            let dst = unsafe { p.base.slice(at, at + take) };
                            if add {
                                dst.iter_mut().zip(&vals[lane..lane + take]).for_each(|(d, v)| *d += v);
                            } else {
                                dst.copy_from_slice(&vals[lane..lane + take]);
                            }
                            (lane, pi) = (lane + take, pi + 1);
                        }
                    }
                }
            }
        };
        let tasks = groups.div_ceil(per);
        if serial {
            (0..tasks).for_each(task);
        } else {
            par::for_each_task(tasks, task);
        }
    }

    /// One group × tokens `t0 .. t0 + tn` into `tile[t][lane]`.
    fn tile(&self, recs: &[Line], a: &Acts, t0: usize, tn: usize, tile: &mut [[f32; GROUP]; TILE]) {
        // SAFETY: `Line` is 64 plain bytes.
        let recs = unsafe { std::slice::from_raw_parts(recs.as_ptr() as *const u8, recs.len() * 64) };
        match self.path {
            Path::Scalar => scalar_tile(self.ty, recs, self.rec, a, t0, tn, tile),
            // SAFETY: the path was picked for a constructed `Isa` with these features;
            // `recs` holds `a.nb` records and the activations `t0 + tn` tokens.
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => unsafe { simd::avx2_tile(self.ty, recs, self.rec, a, t0, tn, tile) },
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 => unsafe { simd::avx512_tile(self.ty, recs, self.rec, a, t0, tn, tile) },
        }
    }
}

/// One output buffer of [`PackedWeight::matmul_parts`]: rows `first ..+ rows` of the
/// weight, `[n, rows]`.
struct Part<'a> {
    first: usize,
    rows: usize,
    base: SharedMut<'a, f32>,
}

/// The name in the packed matmul's errors.
const OP: &str = "packed matmul";

/// The quantised activations as the packed kernels read them.
pub(crate) struct Acts<'a> {
    /// `[n, cols]` i8.
    pub qs: &'a [i8],
    /// `[n, nb]` block scales and `d · Σq`.
    pub d: &'a [f32],
    pub s: &'a [f32],
    /// `[n, nb]` exact `Σq` (Q8_0 only, else empty).
    pub qsum: &'a [i32],
    pub cols: usize,
    pub nb: usize,
}

impl Isa {
    /// The packed kernels this set runs, if any.
    fn packed_path(self) -> Path {
        #[cfg(target_arch = "x86_64")]
        {
            if self.has_avx512vnni() {
                return Path::Avx512;
            }
            if self.has_avx2() {
                return Path::Avx2;
            }
        }
        Path::Scalar
    }
}

/// `m_w` of lane `lane` of a record (`-8 d_w` for Q4_0, 0 for Q8_0).
pub(crate) fn offset_of(ty: GgmlType, rec: &[u8], lane: usize) -> f32 {
    let qb = quant_bytes(ty);
    let f16 = |at: usize| half::f16::from_le_bytes([rec[at], rec[at + 1]]).to_f32();
    match ty {
        GgmlType::Q4_1 => f16(qb + 32 + 2 * lane),
        GgmlType::Q4_0 => f16(qb + 2 * lane) * -8.0,
        _ => 0.0,
    }
}

/// The portable kernel, and the definition of the packed arithmetic.
fn scalar_tile(
    ty: GgmlType,
    recs: &[u8],
    rec_bytes: usize,
    a: &Acts,
    t0: usize,
    tn: usize,
    tile: &mut [[f32; GROUP]; TILE],
) {
    let qb = quant_bytes(ty);
    for (j, out) in tile.iter_mut().take(tn).enumerate() {
        let t = t0 + j;
        for (lane, o) in out.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for b in 0..a.nb {
                let rec = &recs[b * rec_bytes..(b + 1) * rec_bytes];
                let x = &a.qs[t * a.cols + b * 32..][..32];
                let mut isum: i32 = 0;
                for k in 0..8 {
                    for i in 0..4 {
                        let w = match ty {
                            GgmlType::Q8_0 => rec[k * 64 + lane * 4 + i] as i32,
                            _ if k < 4 => (rec[k * 64 + lane * 4 + i] & 0x0F) as i32,
                            _ => (rec[(k - 4) * 64 + lane * 4 + i] >> 4) as i32,
                        };
                        isum += w * x[4 * k + i] as i32;
                    }
                }
                if ty == GgmlType::Q8_0 {
                    isum -= 128 * a.qsum[t * a.nb + b];
                }
                let dw = half::f16::from_le_bytes([rec[qb + 2 * lane], rec[qb + 2 * lane + 1]]).to_f32();
                acc = (isum as f32).mul_add(dw * a.d[t * a.nb + b], acc);
                if ty != GgmlType::Q8_0 {
                    acc = offset_of(ty, rec, lane).mul_add(a.s[t * a.nb + b], acc);
                }
            }
            *o = acc;
        }
    }
}
