//! The CUDA ops against the CPU reference (`tessera_kernels::cpu`) and against scalar
//! references written here, on random bf16 inputs at several shapes, outputs poisoned with
//! NaN first so an unwritten element fails. Plus micro-benchmarks (GB/s for the
//! memory-bound ops, TFLOP/s for the GEMM at Llama-3.1-8B layer shapes).
//!
//! Needs a GPU: the tests run only with `TESSERA_GPU_TESTS=1` (otherwise each prints that it
//! was skipped), the benchmarks only with `TESSERA_GPU_BENCH=1`. `bench/gpu/run.sh` runs
//! both on the device machine.
//!
//! Tolerances (outputs are bf16, references f32/f64 on the same bf16-rounded inputs):
//! - elementwise and row ops (rms_norm, silu_mul, rope): `|gpu - ref| <= 2^-7 |ref| + atol`,
//!   i.e. the output's bf16 rounding (at most 2^-8 relative) with room for f32 reordering
//!   to flip one rounding; atol 1e-5 covers results that cancel to near zero.
//! - exact ops (embedding, the stored residual sum, fused vs unfused norm): bit equality.
//! - GEMM: `|gpu - ref| <= 2^-8 |ref| + 2^-12 sum_k |x_k w_k|` per element (bf16 output
//!   rounding plus f32 accumulation in any order) and relative L2 error <= 4e-3.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::*;

use half::bf16;
use rand_core::Rng;
use tessera_kernels::cpu::rope::{rope as cpu_rope, Llama3Scaling, RopeParams, RopeStyle};
use tessera_kernels::cpu::{activation, norm};
use tessera_kernels::cuda::{Buf, Copy2d, Device, HostStage, ModuleCache};
use tessera_kernels::KernelError;

// ---------------------------------------------------------------- harness

/// `|got - want| <= atol + rtol * |want|` everywhere; NaN never passes.
fn assert_close(what: &str, got: &[bf16], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = (0usize, 0f32);
    for (i, (g, &w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32();
        let err = (g - w).abs();
        assert!(err <= atol + rtol * w.abs(), "{what}[{i}]: got {g}, want {w} (err {err:e})");
        if err > worst.1 {
            worst = (i, err);
        }
    }
    eprintln!("{what}: ok, {} values, max abs err {:.3e} at {}", got.len(), worst.1, worst.0);
}

const RTOL: f32 = 1.0 / 128.0;
const ATOL: f32 = 1e-5;

// ---------------------------------------------------------------- sources

/// Every module compiles for Hopper. Needs only libnvrtc (no GPU), so it also runs where
/// `TESSERA_NVRTC_TESTS=1` is set on a GPU-less machine with the NVRTC library.
#[test]
fn sources_compile_for_sm_90a() {
    let enabled = ["TESSERA_GPU_TESTS", "TESSERA_NVRTC_TESTS"].iter().any(|k| std::env::var(k).as_deref() == Ok("1"));
    if !enabled {
        eprintln!("skipped sources_compile_for_sm_90a: set TESSERA_NVRTC_TESTS=1 where libnvrtc is installed");
        return;
    }
    let arch = tessera_kernels::cuda::Arch::parse("sm_90a").unwrap();
    eprintln!("{}", tessera_kernels::cuda::nvrtc::version().unwrap());
    for (module, bytes) in tessera_kernels::cuda::nvrtc::compile_all(arch).unwrap() {
        assert!(bytes > 0, "{module}: empty image");
        eprintln!("{module}.cu -> {bytes} bytes of sm_90a CUBIN");
    }
}

// ---------------------------------------------------------------- rms_norm

#[test]
fn rms_norm_matches_cpu() {
    let Some(dev) = gpu("rms_norm_matches_cpu") else { return };
    let mut r = rng(11);
    // (rows, dim): decode and prefill rows of Llama-8B (4096) and SmolLM2 (576), Qwen3's
    // per-head norm (dim 64, warp path), a long row over the warp limit (block path), and
    // dims not a multiple of 8 (scalar paths) on both launch shapes, and a row too long to
    // stay in registers (16384).
    for (rows, dim, eps) in [
        (1, 4096, 1e-5f32),
        (7, 4096, 1e-5),
        (33, 576, 1e-5),
        (45, 64, 1e-6),
        (3, 7, 0.5),
        (5, 1030, 1e-6),
        (2, 8192, 1e-5),
        (2, 16384, 1e-5),
    ] {
        let x = rand_bf16(&mut r, rows * dim, -3.0, 3.0);
        let w = rand_bf16(&mut r, dim, -2.0, 2.0);
        let mut want = vec![f32::NAN; x.len()];
        norm::rms_norm(&mut want, &to_f32(&x), &to_f32(&w), rows, eps).unwrap();

        let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
        let mut out = poisoned(&dev, x.len());
        dev.rms_norm(&mut out, &xd, &wd, rows, eps).unwrap();
        assert_close(&format!("rms_norm {rows}x{dim}"), &dev.download(&out).unwrap(), &want, ATOL, RTOL);
    }
}

#[test]
fn add_rms_norm_matches_unfused_and_cpu() {
    let Some(dev) = gpu("add_rms_norm_matches_unfused_and_cpu") else { return };
    let mut r = rng(12);
    for (rows, dim) in [(1, 4096), (9, 576), (40, 64), (3, 1030), (4, 13), (2, 16384)] {
        let eps = 1e-5;
        let x = rand_bf16(&mut r, rows * dim, -2.0, 2.0);
        let res = rand_bf16(&mut r, rows * dim, -4.0, 4.0);
        let w = rand_bf16(&mut r, dim, -2.0, 2.0);
        // The stored residual is the bf16 rounding of the f32 sum, as `half` rounds it.
        let sum: Vec<bf16> = x.iter().zip(&res).map(|(a, b)| bf16::from_f32(a.to_f32() + b.to_f32())).collect();
        let mut want = vec![f32::NAN; x.len()];
        norm::rms_norm(&mut want, &to_f32(&sum), &to_f32(&w), rows, eps).unwrap();

        let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
        let mut resd = dev.upload(&res).unwrap();
        let mut out = poisoned(&dev, x.len());
        dev.add_rms_norm(&mut out, &mut resd, &xd, &wd, rows, eps).unwrap();
        let (got_out, got_res) = (dev.download(&out).unwrap(), dev.download(&resd).unwrap());
        let what = format!("add_rms_norm {rows}x{dim}");
        assert!(
            got_res.iter().zip(&sum).all(|(g, s)| g.to_bits() == s.to_bits()),
            "{what}: stored residual differs from bf16(x + residual)"
        );
        assert_close(&what, &got_out, &want, ATOL, RTOL);

        // Fused == add then unfused norm, bit for bit.
        let mut out2 = poisoned(&dev, x.len());
        dev.rms_norm(&mut out2, &resd, &wd, rows, eps).unwrap();
        let unfused = dev.download(&out2).unwrap();
        assert!(
            unfused.iter().zip(&got_out).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: fused and unfused outputs differ"
        );
    }
}

/// The split GEMM's consumer: `add_parts_rms_norm` over f32 partials equals `add_rms_norm`
/// of their bf16-rounded sum (summed in split order on the host) bit for bit, residual
/// and output, on the block path, the warp path and the general (dim % 8 != 0) path; the
/// partials' buffer may be longer than the step needs.
#[test]
fn add_parts_rms_norm_equals_add_of_the_rounded_sum() {
    let Some(dev) = gpu("add_parts_rms_norm_equals_add_of_the_rounded_sum") else { return };
    let mut r = rng(13);
    for (rows, dim, splits) in [(16, 4096, 2), (64, 4096, 2), (9, 576, 4), (3, 1030, 3), (5, 13, 2), (1, 4096, 1)] {
        let eps = 1e-5;
        let spare = 3 * dim;
        let parts: Vec<f32> = (0..splits * rows * dim + spare).map(|_| unif(&mut r, -2.0, 2.0)).collect();
        let res = rand_bf16(&mut r, rows * dim, -4.0, 4.0);
        let w = rand_bf16(&mut r, dim, -2.0, 2.0);
        let x: Vec<bf16> = (0..rows * dim)
            .map(|i| {
                let mut a = parts[i];
                for s in 1..splits {
                    a += parts[s * rows * dim + i];
                }
                bf16::from_f32(a)
            })
            .collect();
        let wd = dev.upload(&w).unwrap();
        let (mut res_a, mut res_b) = (dev.upload(&res).unwrap(), dev.upload(&res).unwrap());
        let (mut out_a, mut out_b) = (poisoned(&dev, rows * dim), poisoned(&dev, rows * dim));
        dev.add_rms_norm(&mut out_a, &mut res_a, &dev.upload(&x).unwrap(), &wd, rows, eps).unwrap();
        let pd = dev.upload(&parts).unwrap();
        dev.add_parts_rms_norm(&mut out_b, &mut res_b, &pd, splits, &wd, rows, eps).unwrap();
        let what = format!("add_parts_rms_norm {rows}x{dim} in {splits}");
        let same = |a: &Buf<bf16>, b: &Buf<bf16>| {
            let (a, b) = (dev.download(a).unwrap(), dev.download(b).unwrap());
            a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits())
        };
        assert!(same(&res_a, &res_b), "{what}: stored residual differs from add_rms_norm's");
        assert!(same(&out_a, &out_b), "{what}: output differs from add_rms_norm's");
        eprintln!("{what}: ok");
    }
    // Too few partials for the rows, or a split count out of range: an error, nothing run.
    let (w, mut res, mut out) =
        (dev.alloc::<bf16>(8).unwrap(), dev.alloc::<bf16>(16).unwrap(), dev.alloc::<bf16>(16).unwrap());
    let short = dev.alloc::<f32>(31).unwrap();
    assert!(matches!(
        dev.add_parts_rms_norm(&mut out, &mut res, &short, 2, &w, 2, 1e-5),
        Err(KernelError::Shape { .. })
    ));
    let long = dev.alloc::<f32>(1024).unwrap();
    assert!(matches!(
        dev.add_parts_rms_norm(&mut out, &mut res, &long, 0, &w, 2, 1e-5),
        Err(KernelError::Shape { .. })
    ));
    assert!(matches!(
        dev.add_parts_rms_norm(&mut out, &mut res, &long, 9, &w, 2, 1e-5),
        Err(KernelError::Shape { .. })
    ));
}

#[test]
fn norm_rejects_bad_shapes() {
    let Some(dev) = gpu("norm_rejects_bad_shapes") else { return };
    let x = dev.upload(&[bf16::ONE; 12]).unwrap();
    let w = dev.upload(&[bf16::ONE; 5]).unwrap();
    let mut out = dev.alloc::<bf16>(12).unwrap();
    assert!(matches!(dev.rms_norm(&mut out, &x, &w, 2, 1e-5), Err(KernelError::Shape { .. })));
    let w4 = dev.upload(&[bf16::ONE; 4]).unwrap();
    assert!(matches!(dev.rms_norm(&mut out, &x, &w4, 3, f32::NAN), Err(KernelError::Shape { .. })));
}

/// The residual add alone: bit for bit bf16(residual + x), on the 8-wide and the scalar
/// kernels (lengths with and without a multiple of 8).
#[test]
fn add_residual_matches_cpu() {
    let Some(dev) = gpu("add_residual_matches_cpu") else { return };
    let mut r = rng(17);
    for n in [1usize, 7, 8, 4096, 4099, 65_536] {
        let (res0, x) = (rand_bf16(&mut r, n, -4.0, 4.0), rand_bf16(&mut r, n, -1.0, 1.0));
        let (mut res, xd) = (dev.upload(&res0).unwrap(), dev.upload(&x).unwrap());
        dev.add_residual(&mut res, &xd).unwrap();
        let got = dev.download(&res).unwrap();
        for (i, ((g, a), b)) in got.iter().zip(&res0).zip(&x).enumerate() {
            let want = bf16::from_f32(a.to_f32() + b.to_f32());
            assert_eq!(g.to_bits(), want.to_bits(), "add_residual n={n} [{i}]: {g} vs {want}");
        }
    }
    let (mut a, b) = (dev.alloc::<bf16>(8).unwrap(), dev.alloc::<bf16>(9).unwrap());
    assert!(dev.add_residual(&mut a, &b).is_err());
}

// ---------------------------------------------------------------- silu_mul

#[test]
fn silu_mul_matches_cpu() {
    let Some(dev) = gpu("silu_mul_matches_cpu") else { return };
    let mut r = rng(13);
    for n in [8 * 1000, 3 * 14336, 1001, 5] {
        let g = rand_bf16(&mut r, n, -8.0, 8.0);
        let u = rand_bf16(&mut r, n, -3.0, 3.0);
        let mut want = vec![f32::NAN; n];
        activation::silu_mul(&mut want, &to_f32(&g), &to_f32(&u)).unwrap();
        let (gd, ud) = (dev.upload(&g).unwrap(), dev.upload(&u).unwrap());
        let mut out = poisoned(&dev, n);
        dev.silu_mul(&mut out, &gd, &ud).unwrap();
        assert_close(&format!("silu_mul n={n}"), &dev.download(&out).unwrap(), &want, ATOL, RTOL);
    }
    // Packed gate|up rows, as a fused gate_up GEMM writes them.
    for (rows, ffn) in [(5, 1536), (3, 14336), (4, 13)] {
        let gu = rand_bf16(&mut r, rows * 2 * ffn, -8.0, 8.0);
        let gu32 = to_f32(&gu);
        let mut want = Vec::with_capacity(rows * ffn);
        for row in gu32.chunks(2 * ffn) {
            let (g, u) = row.split_at(ffn);
            let mut o = vec![f32::NAN; ffn];
            activation::silu_mul(&mut o, g, u).unwrap();
            want.extend(o);
        }
        let gud = dev.upload(&gu).unwrap();
        let mut out = poisoned(&dev, rows * ffn);
        dev.silu_mul_packed(&mut out, &gud, rows).unwrap();
        assert_close(&format!("silu_mul_packed {rows}x{ffn}"), &dev.download(&out).unwrap(), &want, ATOL, RTOL);
    }
}

// ---------------------------------------------------------------- embedding

#[test]
fn embedding_copies_table_rows() {
    let Some(dev) = gpu("embedding_copies_table_rows") else { return };
    let mut r = rng(14);
    for (vocab, dim, n) in [(1000usize, 576usize, 37usize), (49152, 4096, 5), (300, 13, 64)] {
        let table = rand_bf16(&mut r, vocab * dim, -1.0, 1.0);
        let mut ids: Vec<u32> = (0..n).map(|_| r.next_u32() % vocab as u32).collect();
        ids[n / 2] = ids[0]; // a repeated id
        let bad = n - 1;
        ids[bad] = vocab as u32 + 7; // out of range: must give NaN, not a wild read
        let (td, idd) = (dev.upload(&table).unwrap(), dev.upload(&ids).unwrap());
        let mut out = poisoned(&dev, n * dim);
        dev.embedding(&mut out, &td, &idd, dim).unwrap();
        let got = dev.download(&out).unwrap();
        for (t, (&id, row)) in ids.iter().zip(got.chunks(dim)).enumerate() {
            if t == bad {
                assert!(row.iter().all(|v| v.is_nan()), "out-of-range id must give a NaN row");
            } else {
                let want = &table[id as usize * dim..(id as usize + 1) * dim];
                assert!(row.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "embedding row {t} (id {id})");
            }
        }
        eprintln!("embedding vocab={vocab} dim={dim} n={n}: ok");
    }
}

/// Weight buffers (`alloc_weight`, `upload_weight`) round their allocations up to 2 MiB but
/// have exactly the length asked for, hold what was uploaded (or zeros), and work as an
/// operand; dropping one frees its whole allocation: 16 rounds of 64 weights that each
/// take 2 MiB for 8 KB leave the free memory where it was (a leak would lose 2 GiB).
#[test]
fn weight_buffers_hold_their_values_and_free_their_padding() {
    let Some(dev) = gpu("weight_buffers_hold_their_values_and_free_their_padding") else { return };
    let mut r = rng(15);
    for len in [1usize, 4095, (1 << 20) + 3, 3 << 20] {
        let host = rand_bf16(&mut r, len, -1.0, 1.0);
        let w = dev.upload_weight(&host).unwrap();
        assert_eq!(w.len(), len);
        let got = dev.download(&w).unwrap();
        assert!(got.iter().zip(&host).all(|(a, b)| a.to_bits() == b.to_bits()), "upload_weight of {len} values");
        let z = dev.alloc_weight::<bf16>(len).unwrap();
        assert_eq!(z.len(), len);
        assert!(dev.download(&z).unwrap().iter().all(|v| v.to_bits() == 0), "alloc_weight of {len} values: zeros");
    }
    let (vocab, dim) = (300usize, 4097usize);
    let table = rand_bf16(&mut r, vocab * dim, -1.0, 1.0);
    let (td, ids) = (dev.upload_weight(&table).unwrap(), dev.upload(&[7u32, 299, 0]).unwrap());
    let mut out = poisoned(&dev, 3 * dim);
    dev.embedding(&mut out, &td, &ids, dim).unwrap();
    let got = dev.download(&out).unwrap();
    for (row, id) in got.chunks(dim).zip([7usize, 299, 0]) {
        let want = &table[id * dim..(id + 1) * dim];
        assert!(row.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "gather of row {id} from a weight");
    }
    dev.synchronize().unwrap();
    let (free0, _) = dev.memory_info().unwrap();
    for _ in 0..16 {
        let held: Vec<Buf<bf16>> = (0..64).map(|_| dev.alloc_weight::<bf16>(4096).unwrap()).collect();
        drop(held);
        dev.synchronize().unwrap();
    }
    let (free1, _) = dev.memory_info().unwrap();
    let lost = free0.saturating_sub(free1);
    assert!(lost <= 512 << 20, "{} MiB of free memory lost over 1,024 weight buffers", lost >> 20);
    eprintln!("weight buffers: ok, {} MiB free memory lost over 1,024 buffers", lost >> 20);
}

/// A strided 2-D block copy (device to device, and host to device) moves exactly the
/// block: every element inside it equals the source's, every other element of the
/// destination keeps its value; a block past either end is an error, not a copy.
#[test]
fn copy_2d_and_write_2d_move_exactly_the_block() {
    let Some(dev) = gpu("copy_2d_and_write_2d_move_exactly_the_block") else { return };
    let mut r = rng(15);
    let (rows, cols) = (37usize, 53usize);
    let src = rand_bf16(&mut r, rows * cols, -1.0, 1.0);
    let old = rand_bf16(&mut r, rows * cols, 2.0, 3.0);
    let sd = dev.upload(&src).unwrap();
    let staged = stage_of(&dev, &src);
    for c in [
        Copy2d { rows: 5, width: 7, src_pitch: cols, src_at: 3 * cols + 11, dst_pitch: cols, dst_at: 20 * cols + 2 },
        Copy2d { rows: rows - 1, width: 1, src_pitch: cols, src_at: cols + 40, dst_pitch: cols, dst_at: 40 },
        Copy2d { rows: 2, width: cols, src_pitch: cols, src_at: 0, dst_pitch: cols, dst_at: (rows - 2) * cols },
    ] {
        let mut want = old.clone();
        for i in 0..c.rows {
            for j in 0..c.width {
                want[c.dst_at + i * c.dst_pitch + j] = src[c.src_at + i * c.src_pitch + j];
            }
        }
        let mut dd = dev.upload(&old).unwrap();
        dev.copy_2d(&mut dd, &sd, &c).unwrap();
        let mut dh = dev.upload(&old).unwrap();
        dev.write_2d(&mut dh, &staged, &c).unwrap();
        for (what, buf) in [("copy_2d", &dd), ("write_2d", &dh)] {
            let got = dev.download(buf).unwrap();
            let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what} {c:?}: the destination is not the expected one");
        }
    }
    let past = Copy2d { rows: 2, width: 4, src_pitch: cols, src_at: (rows - 1) * cols, dst_pitch: cols, dst_at: 0 };
    let mut dd = dev.upload(&old).unwrap();
    assert!(dev.copy_2d(&mut dd, &sd, &past).is_err(), "a block past the source's end");
    assert!(dev.write_2d(&mut dd, &staged, &past).is_err(), "a block past the host source's end");
    assert!(dev.write_2d(&mut dd, &stage_of(&dev, &src[..cols]), &Copy2d::columns(2, cols, 0, 1)).is_err());
    let past_dst = Copy2d { rows: 2, width: 4, src_pitch: cols, src_at: 0, dst_pitch: cols, dst_at: (rows - 1) * cols };
    assert!(dev.copy_2d(&mut dd, &sd, &past_dst).is_err(), "a block past the destination's end");
    assert!(dev.write_2d(&mut dd, &staged, &past_dst).is_err(), "a block past the destination's end");
    let got = dev.download(&dd).unwrap();
    assert!(got.iter().zip(&old).all(|(a, b)| a.to_bits() == b.to_bits()), "a refused copy wrote");
    eprintln!("copy_2d / write_2d: ok");
}

/// A pinned host stage holding `v`.
fn stage_of<T: tessera_kernels::cuda::Elem>(dev: &Device, v: &[T]) -> HostStage<T> {
    let mut s = dev.alloc_stage::<T>(v.len()).unwrap();
    s.as_mut_slice().unwrap().copy_from_slice(v);
    s
}

/// A decode graph's packed inputs: a staged copy delivers the stage as it was when the copy
/// was queued, even when the host rewrites the stage before the stream reaches the copy
/// (the rewrite waits), and `unpack4` splits the `[4, n]` upload into its four rows.
#[test]
fn staged_inputs_arrive_as_queued_and_unpack_into_four_arrays() {
    let Some(dev) = gpu("staged_inputs_arrive_as_queued_and_unpack_into_four_arrays") else { return };
    let mut r = rng(16);
    for n in [1usize, 5, 256, 1000] {
        let mut stage = dev.alloc_stage::<u32>(4 * n).unwrap();
        assert!(stage.as_slice().iter().all(|&v| v == 0), "a new stage is zero-filled");
        let first: Vec<u32> = (0..4 * n).map(|_| r.next_u32()).collect();
        let second: Vec<u32> = (0..4 * n).map(|_| r.next_u32()).collect();
        stage.as_mut_slice().unwrap().copy_from_slice(&first);
        // Keep the stream busy (~ms of device copies) so the staged copy is still queued
        // when the host rewrites the stage.
        let big = 256 << 20;
        let (src, mut dst) = (dev.alloc::<u32>(big).unwrap(), dev.alloc::<u32>(big).unwrap());
        for _ in 0..4 {
            dev.copy_rows(&mut dst, 0, &src, 0, 1, big).unwrap();
        }
        let (mut p1, mut p2) = (dev.alloc::<u32>(4 * n).unwrap(), dev.alloc::<u32>(4 * n).unwrap());
        dev.write_staged(&mut p1, &stage, 0).unwrap();
        stage.as_mut_slice().unwrap().copy_from_slice(&second);
        dev.write_staged(&mut p2, &stage, 0).unwrap();
        assert_eq!(dev.download(&p1).unwrap(), first, "n {n}: the first copy saw the rewrite");
        assert_eq!(dev.download(&p2).unwrap(), second, "n {n}");

        let mut out: Vec<Buf<u32>> = (0..4).map(|_| dev.upload(&vec![u32::MAX - 1; n]).unwrap()).collect();
        let [a, b, c, d] = &mut out[..] else { unreachable!() };
        dev.unpack4(&p1, [a, b, c, d]).unwrap();
        for (k, o) in out.iter().enumerate() {
            assert_eq!(dev.download(o).unwrap(), first[k * n..(k + 1) * n], "n {n}: row {k}");
        }
        let [a, b, c, d] = &mut out[..] else { unreachable!() };
        assert!(dev.unpack4(&p2, [a, b, c, d]).is_ok());
        let short = dev.alloc::<u32>(4 * n - 1).unwrap();
        let [a, b, c, d] = &mut out[..] else { unreachable!() };
        assert!(dev.unpack4(&short, [a, b, c, d]).is_err(), "n {n}: a packed array of the wrong length");
        // A part of the stage: row 3 alone; past the end is refused.
        let mut small = dev.alloc::<u32>(n).unwrap();
        dev.write_staged(&mut small, &stage, 3 * n).unwrap();
        assert_eq!(dev.download(&small).unwrap(), second[3 * n..], "n {n}: row 3 alone");
        assert!(dev.write_staged(&mut small, &stage, 3 * n + 1).is_err(), "n {n}: past the stage's end");
        assert!(dev.write_staged(&mut small, &stage, usize::MAX).is_err(), "n {n}: an overflowing offset");

        // The strided copy marks the stage read too: rows 1..3 queued behind busy work, the
        // stage rewritten at once, the copy still delivers what was there when it was queued.
        for _ in 0..4 {
            dev.copy_rows(&mut dst, 0, &src, 0, 1, big).unwrap();
        }
        let mut q = dev.alloc::<u32>(4 * n).unwrap();
        dev.write_2d(&mut q, &stage, &Copy2d::block(n, 1..3, 0..n)).unwrap();
        stage.as_mut_slice().unwrap().copy_from_slice(&first);
        let got = dev.download(&q).unwrap();
        assert_eq!(got[n..3 * n], second[n..3 * n], "n {n}: the 2-D copy saw the rewrite");
        assert!(got[..n].iter().chain(&got[3 * n..]).all(|&v| v == 0), "n {n}: rows outside the block");
    }
    // A stage is tied to the stream of the device that made it.
    let other = Device::new(0).unwrap();
    let (stage, mut buf) = (dev.alloc_stage::<u32>(8).unwrap(), other.alloc::<u32>(8).unwrap());
    assert!(other.write_staged(&mut buf, &stage, 0).is_err(), "a stage of another device's stream");
    assert!(other.write_2d(&mut buf, &stage, &Copy2d::block(8, 0..1, 0..8)).is_err());
    eprintln!("staged inputs / unpack4: ok");
}

/// `take_sampled_ids` against a CPU reference on random ids: flagged entries (`FROM_SAMPLED |
/// row`) take `sampled[row]`, rows past `rows` token 0, the rest stay; entries past `n` are
/// untouched; bad lengths are refused.
#[test]
fn take_sampled_ids_matches_cpu() {
    use tessera_kernels::cuda::FROM_SAMPLED;
    let Some(dev) = gpu("take_sampled_ids_matches_cpu") else { return };
    let mut r = rng(17);
    for (n, len, rows) in [(1usize, 1usize, 1usize), (7, 9, 3), (256, 256, 256), (1000, 1003, 64), (3000, 3000, 5000)] {
        let ids: Vec<u32> = (0..len)
            .map(|_| match r.next_u32() % 3 {
                // A row, sometimes past the sampled ones.
                0 => FROM_SAMPLED | (r.next_u32() % (rows as u32 + 4)),
                _ => r.next_u32() % 150_000,
            })
            .collect();
        let sampled: Vec<u32> = (0..rows).map(|_| r.next_u32() % 150_000 + 1).collect();
        let want: Vec<u32> = ids
            .iter()
            .enumerate()
            .map(|(i, &v)| match v & FROM_SAMPLED {
                0 => v,
                _ if i >= n => v,
                _ => sampled.get((v & !FROM_SAMPLED) as usize).copied().unwrap_or(0),
            })
            .collect();
        let (mut d_ids, d_sampled) = (dev.upload(&ids).unwrap(), dev.upload(&sampled).unwrap());
        dev.take_sampled_ids(&mut d_ids, n, &d_sampled, rows).unwrap();
        assert_eq!(dev.download(&d_ids).unwrap(), want, "n {n} of {len}, {rows} rows");
        assert!(dev.take_sampled_ids(&mut d_ids, len + 1, &d_sampled, rows).is_err(), "n past the ids");
        assert!(dev.take_sampled_ids(&mut d_ids, n, &d_sampled, rows + 1).is_err(), "rows past the buffer");
    }
    eprintln!("take_sampled_ids: ok");
}

// ---------------------------------------------------------------- rope

#[test]
fn rope_matches_cpu() {
    let Some(dev) = gpu("rope_matches_cpu") else { return };
    let mut r = rng(15);
    let llama3 =
        Llama3Scaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 };
    // (tokens, heads, head_dim, rope_dim, theta, llama3 scaling)
    let cases = [
        (5usize, 32usize, 128usize, 128usize, 500_000f32, Some(llama3)),
        (3, 9, 64, 64, 10_000.0, None),
        (17, 8, 128, 128, 1_000_000.0, None),
        (4, 3, 64, 32, 10_000.0, None), // partial rotary: dims 32..64 pass through
    ];
    let max_pos = 4096usize;
    for (tokens, heads, hd, rd, theta, scaling) in cases {
        let params = RopeParams::new(rd, theta, scaling, None).unwrap();
        let cache = dev.rope_cache(&params, max_pos).unwrap();
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            let x = rand_bf16(&mut r, tokens * heads * hd, -3.0, 3.0);
            let mut pos: Vec<u32> = (0..tokens).map(|_| r.next_u32() % max_pos as u32).collect();
            pos[0] = max_pos as u32 - 1;
            let mut want = to_f32(&x);
            cpu_rope(&mut want, tokens, heads, hd, &pos, &params, style).unwrap();

            let mut xd = dev.upload(&x).unwrap();
            let pd = dev.upload(&pos).unwrap();
            dev.rope(&mut xd, tokens, heads, hd, &pd, &cache, style).unwrap();
            let got = dev.download(&xd).unwrap();
            let what = format!("rope {style:?} {tokens}x{heads}x{hd} rope_dim {rd}");
            assert_close(&what, &got, &want, ATOL, RTOL);
            for (g, x0) in got.chunks(hd).zip(x.chunks(hd)) {
                assert!(
                    g[rd..].iter().zip(&x0[rd..]).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: pass-through dims changed"
                );
            }
        }
    }
    // A position past the table poisons only its own token.
    let params = RopeParams::new(64, 10_000.0, None, None).unwrap();
    let cache = dev.rope_cache(&params, 16).unwrap();
    let x = rand_bf16(&mut r, 2 * 64, -1.0, 1.0);
    let mut xd = dev.upload(&x).unwrap();
    let pd = dev.upload(&[3u32, 16]).unwrap();
    dev.rope(&mut xd, 2, 1, 64, &pd, &cache, RopeStyle::Neox).unwrap();
    let got = dev.download(&xd).unwrap();
    assert!(got[..64].iter().all(|v| v.is_finite()) && got[64..].iter().all(|v| v.is_nan()));
}

// ---------------------------------------------------------------- GEMM

/// `out[i, j] = sum_k x[i, k] w[j, k]` in f64, and `sum_k |x[i, k] w[j, k]|` for the bound.
fn matmul_ref(x: &[f32], w: &[f32], m: usize, rows: usize, cols: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut out, mut mag) = (vec![0.0; m * rows], vec![0.0; m * rows]);
    for i in 0..m {
        let xr = &x[i * cols..(i + 1) * cols];
        for j in 0..rows {
            let wr = &w[j * cols..(j + 1) * cols];
            let (mut s, mut a) = (0f64, 0f64);
            for (&xv, &wv) in xr.iter().zip(wr) {
                let p = f64::from(xv) * f64::from(wv);
                s += p;
                a += p.abs();
            }
            out[i * rows + j] = s;
            mag[i * rows + j] = a;
        }
    }
    (out, mag)
}

#[test]
fn matmul_matches_f64_reference() {
    let Some(dev) = gpu("matmul_matches_f64_reference") else { return };
    let mut r = rng(16);
    // (m, rows, cols): decode and small-batch Llama-8B-like shapes, SmolLM2's FFN, and an
    // odd shape whose leading dimensions are not 16-byte multiples.
    for (m, rows, cols) in
        [(1, 4096, 4096), (16, 1536, 576), (5, 6144, 4096), (64, 2048, 4096), (512, 512, 1024), (3, 17, 24)]
    {
        let x = rand_bf16(&mut r, m * cols, -1.0, 1.0);
        let w = rand_bf16(&mut r, rows * cols, -0.05, 0.05);
        let (want, mag) = matmul_ref(&to_f32(&x), &to_f32(&w), m, rows, cols);
        let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
        let mut out = poisoned(&dev, m * rows);
        dev.matmul(&mut out, &xd, m, &wd, rows, cols).unwrap();
        let got = dev.download(&out).unwrap();
        let what = format!("matmul m={m} {rows}x{cols}");
        let (mut e2, mut r2) = (0f64, 0f64);
        for (i, ((g, &w), &a)) in got.iter().zip(&want).zip(&mag).enumerate() {
            let g = f64::from(g.to_f32());
            let err = (g - w).abs();
            assert!(err <= w.abs() / 256.0 + a / 4096.0, "{what}[{i}]: got {g}, want {w} (err {err:e}, sum|xw| {a})");
            e2 += err * err;
            r2 += w * w;
        }
        let rel = (e2 / r2).sqrt();
        assert!(rel <= 4e-3, "{what}: relative L2 error {rel:e}");
        eprintln!("{what}: ok, rel L2 {rel:.2e}");
    }
    let (x, w) = (dev.alloc::<bf16>(6).unwrap(), dev.alloc::<bf16>(6).unwrap());
    let mut out = dev.alloc::<bf16>(4).unwrap();
    assert!(matches!(dev.matmul(&mut out, &x, 2, &w, 3, 3), Err(KernelError::Shape { .. })));
}

/// The split GEMM: its partials' f32 sum against the f64 reference (the GEMM bound without
/// the output's bf16 rounding), every partial written (the buffer is NaN-poisoned and
/// longer than needed: the spare tail stays NaN), at the engine's 16-256-token shapes and
/// 2-8 splits (4096 x 8704 is over gemm.rs's 64 MiB: its first call times the heuristic's
/// candidates, and the second, with the one kept, gives the same bits); shapes that do not
/// split into 8-value chunks are refused.
#[test]
fn matmul_parts_sum_matches_f64_reference() {
    let Some(dev) = gpu("matmul_parts_sum_matches_f64_reference") else { return };
    let mut r = rng(17);
    for (m, rows, cols, splits) in
        [(16, 4096, 4096, 2), (64, 4096, 8704, 2), (9, 576, 1536, 4), (256, 512, 1024, 8), (33, 100, 48, 3)]
    {
        let x = rand_bf16(&mut r, m * cols, -1.0, 1.0);
        let w = rand_bf16(&mut r, rows * cols, -0.05, 0.05);
        let (want, mag) = matmul_ref(&to_f32(&x), &to_f32(&w), m, rows, cols);
        let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
        let n = m * rows;
        let mut parts = dev.upload(&vec![f32::NAN; splits * n + 7]).unwrap();
        dev.matmul_parts(&mut parts, splits, &xd, m, &wd, rows, cols).unwrap();
        let got = dev.download(&parts).unwrap();
        let what = format!("matmul_parts m={m} {rows}x{cols} in {splits}");
        dev.matmul_parts(&mut parts, splits, &xd, m, &wd, rows, cols).unwrap();
        let again = dev.download(&parts).unwrap();
        assert!(got.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: a second call differs");
        assert!(got[splits * n..].iter().all(|v| v.is_nan()), "{what}: wrote past its partials");
        let (mut e2, mut r2) = (0f64, 0f64);
        for (i, (&w, &a)) in want.iter().zip(&mag).enumerate() {
            let g: f64 = (0..splits).map(|s| f64::from(got[s * n + i])).sum();
            let err = (g - w).abs();
            assert!(err <= a / 4096.0, "{what}[{i}]: got {g}, want {w} (err {err:e}, sum|xw| {a})");
            e2 += err * err;
            r2 += w * w;
        }
        let rel = (e2 / r2).sqrt();
        assert!(rel <= 1e-3, "{what}: relative L2 error {rel:e}");
        eprintln!("{what}: ok, rel L2 {rel:.2e}");
    }
    let (x, w) = (dev.alloc::<bf16>(2 * 24).unwrap(), dev.alloc::<bf16>(3 * 24).unwrap());
    let mut parts = dev.alloc::<f32>(64).unwrap();
    // 24 columns make no two chunks of a multiple of 8; 3 chunks of 8 are fine.
    assert!(matches!(dev.matmul_parts(&mut parts, 2, &x, 2, &w, 3, 24), Err(KernelError::Shape { .. })));
    assert!(matches!(dev.matmul_parts(&mut parts, 9, &x, 2, &w, 3, 24), Err(KernelError::Shape { .. })));
    let mut few = dev.alloc::<f32>(17).unwrap();
    assert!(matches!(dev.matmul_parts(&mut few, 3, &x, 2, &w, 3, 24), Err(KernelError::Shape { .. })));
    dev.matmul_parts(&mut parts, 3, &x, 2, &w, 3, 24).unwrap();
}

// ---------------------------------------------------------------- module cache

#[test]
fn module_cache_hits_on_second_start() {
    let Some(_) = gpu("module_cache_hits_on_second_start") else { return };
    let dir = std::env::temp_dir().join(format!("tessera-gpu-cache-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let first = Device::with_cache(0, ModuleCache::new(&dir)).unwrap();
    let second = Device::with_cache(0, ModuleCache::new(&dir)).unwrap();
    for (a, b) in first.module_reports().iter().zip(second.module_reports()) {
        eprintln!("module {}: compiled in {:.1} ms, then loaded from cache in {:.2} ms", a.module, a.millis, b.millis);
        assert!(!a.cache_hit && a.store_error.is_none(), "first start must compile and store {}", a.module);
        assert!(b.cache_hit, "second start must hit the cache for {}", b.module);
    }
    assert_eq!(first.arch(), second.arch());
    eprintln!("device {} arch {}", first.name(), first.arch());
    // The cached modules work: one op through the second device.
    let x = second.upload(&[bf16::from_f32(3.0), bf16::from_f32(4.0)]).unwrap();
    let w = second.upload(&[bf16::ONE, bf16::from_f32(2.0)]).unwrap();
    let mut out = poisoned(&second, 2);
    second.rms_norm(&mut out, &x, &w, 1, 0.0).unwrap();
    let got = to_f32(&second.download(&out).unwrap());
    // rms = sqrt((9 + 16) / 2); out = x / rms * w.
    let rms = 12.5f32.sqrt();
    assert_close("cached rms_norm", &second.download(&out).unwrap(), &[3.0 / rms, 8.0 / rms], ATOL, RTOL);
    assert!(got.iter().all(|v| v.is_finite()));
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------- benchmarks

/// Fast random bf16 in [-1, 1) (xorshift; the bench needs volume, not quality).
fn fast_rand_bf16(n: usize, seed: u64) -> Vec<bf16> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect()
}

#[test]
fn bench_memory_bound_ops() {
    let Some(dev) = bench_enabled("bench_memory_bound_ops") else { return };
    let (rows, dim) = (32768usize, 4096usize);
    let n = rows * dim;
    let x = dev.upload(&fast_rand_bf16(n, 1)).unwrap();
    let w = dev.upload(&fast_rand_bf16(dim, 2)).unwrap();
    let mut res = dev.upload(&fast_rand_bf16(n, 3)).unwrap();
    let mut out = dev.alloc::<bf16>(n).unwrap();
    let gb = |bytes: usize, ms: f64| bytes as f64 / (ms * 1e-3) / 1e9;

    let ms = median_ms(&dev, 7, 10, |_| dev.rms_norm(&mut out, &x, &w, rows, 1e-5));
    println!(
        "BENCH | rms_norm | {rows}x{dim} bf16 | {:.1} us | - | {:.0} GB/s (read x, write out)",
        ms * 1e3,
        gb(2 * n * 2, ms)
    );
    let ms = median_ms(&dev, 7, 10, |_| dev.add_rms_norm(&mut out, &mut res, &x, &w, rows, 1e-5));
    println!(
        "BENCH | add_rms_norm | {rows}x{dim} bf16 | {:.1} us | - | {:.0} GB/s (read x, res; write res, out)",
        ms * 1e3,
        gb(4 * n * 2, ms)
    );
    let x1 = dev.upload(&fast_rand_bf16(dim, 9)).unwrap();
    let mut out1 = dev.alloc::<bf16>(dim).unwrap();
    let ms = median_ms(&dev, 7, 200, |_| dev.rms_norm(&mut out1, &x1, &w, 1, 1e-5));
    println!("BENCH | rms_norm | 1x{dim} (decode) | {:.2} us | - | launch-bound", ms * 1e3);

    let (t, ffn) = (4096usize, 14336usize);
    let gu = dev.upload(&fast_rand_bf16(t * 2 * ffn, 4)).unwrap();
    let mut act = dev.alloc::<bf16>(t * ffn).unwrap();
    let ms = median_ms(&dev, 7, 10, |_| dev.silu_mul_packed(&mut act, &gu, t));
    println!("BENCH | silu_mul_packed | {t}x{ffn} bf16 | {:.1} us | - | {:.0} GB/s", ms * 1e3, gb(3 * t * ffn * 2, ms));

    let params = RopeParams::new(128, 500_000.0, None, None).unwrap();
    let cache = dev.rope_cache(&params, 8192).unwrap();
    let (tok, heads) = (8192usize, 32usize);
    let mut q = dev.upload(&fast_rand_bf16(tok * heads * 128, 5)).unwrap();
    let pos = dev.upload(&(0..tok as u32).collect::<Vec<_>>()).unwrap();
    let ms = median_ms(&dev, 7, 10, |_| dev.rope(&mut q, tok, heads, 128, &pos, &cache, RopeStyle::Neox));
    println!(
        "BENCH | rope neox | {tok}x{heads}x128 bf16 | {:.1} us | - | {:.0} GB/s",
        ms * 1e3,
        gb(2 * tok * heads * 128 * 2, ms)
    );

    let table = dev.upload(&fast_rand_bf16(128_256 * dim, 6)).unwrap();
    let ids = dev.upload(&(0..8192u32).map(|i| (i * 7919) % 128_256).collect::<Vec<_>>()).unwrap();
    let mut emb = dev.alloc::<bf16>(8192 * dim).unwrap();
    let ms = median_ms(&dev, 7, 10, |_| dev.embedding(&mut emb, &table, &ids, dim));
    println!(
        "BENCH | embedding | 8192 ids x {dim} bf16 | {:.1} us | - | {:.0} GB/s",
        ms * 1e3,
        gb(2 * 8192 * dim * 2, ms)
    );
}

#[test]
fn bench_gemm_llama8b() {
    let Some(dev) = bench_enabled("bench_gemm_llama8b") else { return };
    // Llama-3.1-8B layer GEMMs: (name, rows = out features, cols = in features).
    let shapes = [("qkv", 6144usize, 4096usize), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)];
    // Weights come from one random pool; several copies per shape so that the set read in a
    // timing loop is well over the 50 MB L2 and every call streams from HBM.
    let pool = fast_rand_bf16(6144 * 4096 * 2, 7);
    for (name, rows, cols) in shapes {
        let wbytes = rows * cols * 2;
        let copies = (300_000_000usize.div_ceil(wbytes)).clamp(1, 8);
        let ws: Vec<Buf<bf16>> = (0..copies)
            .map(|c| {
                let mut host = Vec::with_capacity(rows * cols);
                let mut off = c * 9973;
                while host.len() < rows * cols {
                    let take = (rows * cols - host.len()).min(pool.len() - off);
                    host.extend_from_slice(&pool[off..off + take]);
                    off = 0;
                }
                dev.upload(&host).unwrap()
            })
            .collect();
        for m in [1usize, 16, 512] {
            let x = dev.upload(&fast_rand_bf16(m * cols, 8 + m as u64)).unwrap();
            let mut out = dev.alloc::<bf16>(m * rows).unwrap();
            let reps = if m == 512 { 20 } else { 100 };
            let ms = median_ms(&dev, 7, reps, |i| dev.matmul(&mut out, &x, m, &ws[i % copies], rows, cols));
            let flops = 2.0 * (m * rows * cols) as f64;
            let bytes = (rows * cols + m * cols + m * rows) * 2;
            println!(
                "BENCH | gemm {name} | M={m} N={rows} K={cols} | {:.1} us | {:.1} TFLOP/s | {:.0} GB/s",
                ms * 1e3,
                flops / (ms * 1e-3) / 1e12,
                bytes as f64 / (ms * 1e-3) / 1e9
            );
        }
    }
}
