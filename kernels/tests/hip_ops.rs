//! The HIP backend end to end, as far as this machine allows.
//!
//! - Always (with `--features hip`): when librccl cannot be loaded, the RCCL entry points
//!   fail with a message naming RCCL and what to install (skipped with a message where RCCL is
//!   installed).
//! - `TESSERA_HIPRTC_TESTS=1` (needs libamdhip64 / libhiprtc and rocm-device-libs, no GPU):
//!   every kernel module compiles through hipRTC for gfx90a (64-lane wavefronts) and gfx1030
//!   (32-lane), the run-time twin of kernels/hip/check_sources.sh. (Debian's ROCm 5.2 device
//!   libraries stop at gfx1036 and gfx940; its hipRTC crashes, rather than failing, on an
//!   arch it has no library for, e.g. gfx1100.) The kernels the HIP launchers look up by name
//!   are in their modules.
//! - `TESSERA_HIP_TESTS=1` (needs an AMD GPU with ROCm, rocBLAS; RCCL for the last): buffers
//!   round trip, RMSNorm, the portable paged attention and the rocBLAS GEMM against the CPU
//!   reference on random bf16 inputs (the forward pass's other ops: hip_forward_ops.rs), an RCCL all-reduce over a one-rank communicator. None of these has run yet: no AMD GPU
//!   was available when they were written.
//!
//! Tolerances as kernels/tests/cuda_ops.rs (bf16 outputs against f32/f64 references on the
//! same bf16 inputs): rows `|gpu - ref| <= 2^-7 |ref| + 1e-5`; GEMM `|gpu - ref| <= 2^-8 |ref|
//! + 2^-12 sum_k |x_k w_k|`; attention (values in [-1, 1], f32 softmax on both sides)
//! `|gpu - ref| <= 2^-7 |ref| + 2^-10`.
#![cfg(feature = "hip")]

mod hip_common;

use half::bf16;
use hip_common::{enabled, gemm_reference, gpu, random_bf16};
use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tessera_kernels::cpu::attention::{attention as cpu_attention, PagedKv, SeqSlice};
use tessera_kernels::cpu::norm;
use tessera_kernels::cuda::ModuleCache;
use tessera_kernels::hip::{self, ffi, Blas, Device, GfxArch, RcclComm};

#[test]
fn rccl_absent_is_a_clear_error() {
    if ffi::open_first("RCCL", ffi::RCCL_LIBS, "").is_ok() {
        eprintln!("skipped rccl_absent_is_a_clear_error: librccl is installed here");
        return;
    }
    let msg = hip::rccl_unique_id().expect_err("an RCCL id without librccl").to_string();
    assert!(msg.contains("RCCL is not available") && msg.contains("librccl"), "{msg}");
    // The failure is remembered, not retried into a different message.
    assert_eq!(hip::rccl_unique_id().err().map(|e| e.to_string()), Some(msg));
}

#[test]
fn hiprtc_compiles_every_module() {
    if !enabled("TESSERA_HIPRTC_TESTS", "hiprtc_compiles_every_module") {
        return;
    }
    for arch in ["gfx90a", "gfx1030"] {
        let arch = GfxArch::parse(arch).unwrap();
        let built = hip::rtc::compile_all(&arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(built.len(), hip::sources::modules().len());
        for (module, bytes) in built {
            eprintln!("{arch} {module}: {bytes} bytes");
            assert!(bytes > 0);
        }
    }
    // Through the cache: a miss compiles and stores a plausible code object, a hit returns it.
    let arch = GfxArch::parse("gfx90a:sramecc+:xnack-").unwrap();
    let dir = std::env::temp_dir().join(format!("tessera-hiprtc-cache-{}", std::process::id()));
    let cache = ModuleCache::new(&dir);
    let &(name, body) = hip::sources::modules().iter().find(|(m, _)| *m == "attention").unwrap();
    let source = hip::sources::full_source(body);
    let compiler = hip::rtc::version().unwrap();
    let (first, r1) = hip::rtc::compile_cached(&cache, name, &source, &arch, &compiler).unwrap();
    let (second, r2) = hip::rtc::compile_cached(&cache, name, &source, &arch, &compiler).unwrap();
    assert!(!r1.cache_hit && r1.store_error.is_none() && r2.cache_hit, "{r1:?} {r2:?}");
    assert_eq!(first, second);
    assert!(tessera_kernels::cuda::ImageKind::AmdCodeObject.plausible(&first), "hipRTC output is no code object");
    // The HIP build of attention.cu holds the portable kernels, not the tensor-core ones.
    let has = |sym: &str| first.windows(sym.len()).any(|w| w == sym.as_bytes());
    assert!(has("paged_attention_portable_hd64") && has("paged_attention_portable_hd128") && has("write_kv"));
    assert!(!has("paged_decode_hd128") && !has("paged_prefill_hd128"));
    std::fs::remove_dir_all(&dir).unwrap();
    // Every kernel the forward pass's HIP launchers look up by name is in its module.
    let used: [(&str, &[&str]); 4] = [
        ("norm", &["rms_norm_warp", "rms_norm_block", "add_rms_norm_warp", "add_rms_norm_block"]),
        ("embedding", &["embedding"]),
        ("activation", &["silu_mul", "silu_mul_vec8"]),
        ("qkv", &["qkv_rope_write"]),
    ];
    for (module, kernels) in used {
        let &(_, body) = hip::sources::modules().iter().find(|(m, _)| *m == module).unwrap();
        let image = hip::rtc::compile(module, &hip::sources::full_source(body), &arch).unwrap();
        for k in kernels {
            // The symbol followed by its NUL in the code object's string table.
            let sym = format!("{k}\0");
            assert!(image.windows(sym.len()).any(|w| w == sym.as_bytes()), "{module}: no kernel {k}");
        }
    }
}

#[test]
fn buffers_round_trip() {
    if !enabled("TESSERA_HIP_TESTS", "buffers_round_trip") {
        return;
    }
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let host: Vec<u32> = (0..10_007).map(|_| rng.next_u32()).collect();
    let buf = dev.upload(&host).unwrap();
    assert_eq!(dev.download(&buf).unwrap(), host);
    let zeros = dev.alloc::<f32>(333).unwrap();
    assert!(dev.download(&zeros).unwrap().iter().all(|&v| v == 0.0));
}

#[test]
fn rms_norm_matches_cpu() {
    if !enabled("TESSERA_HIP_TESTS", "rms_norm_matches_cpu") {
        return;
    }
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    // Warp path (64 and 128 wide, odd width) and block path (4096, 4100).
    for (rows, dim) in [(37, 64), (5, 128), (3, 90), (4, 4096), (2, 4100)] {
        let x = random_bf16(&mut rng, rows * dim, 3.0);
        let w = random_bf16(&mut rng, dim, 1.5);
        let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        let mut want = vec![0f32; rows * dim];
        norm::rms_norm(&mut want, &xf, &wf, rows, 1e-5).unwrap();
        let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
        let mut out = dev.upload(&vec![bf16::NAN; rows * dim]).unwrap();
        hip::ops::rms_norm(&dev, &mut out, &xd, &wd, rows, 1e-5).unwrap();
        let got = dev.download(&out).unwrap();
        for (i, (g, want)) in got.iter().zip(&want).enumerate() {
            let err = (g.to_f32() - want).abs();
            assert!(err <= 1e-5 + want.abs() / 128.0, "rms_norm {rows}x{dim} [{i}]: got {g}, want {want}");
        }
    }
}

#[test]
fn paged_attention_matches_cpu() {
    if !enabled("TESSERA_HIP_TESTS", "paged_attention_matches_cpu") {
        return;
    }
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    // (context, queries) per sequence: decodes of 1 and 300 positions (two tiles), a prefill
    // from 0, a chunk after 523 cached positions.
    let seqs: [(usize, usize); 4] = [(1, 1), (300, 1), (40, 40), (530, 7)];
    let (block_size, n_heads, n_kv) = (16usize, 8usize, 2usize);
    for hd in [64usize, 128] {
        let max_blocks = seqs.iter().map(|&(c, _)| c.div_ceil(block_size)).max().unwrap();
        let num_blocks = seqs.len() * max_blocks + 3;
        // Distinct block ids, shuffled: sequence s gets ids[s * max_blocks..].
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.next_u32() as usize % (i + 1));
        }
        let cache_len = num_blocks * block_size * n_kv * hd;
        let k = random_bf16(&mut rng, cache_len, 1.0);
        let v = random_bf16(&mut rng, cache_len, 1.0);
        let total_q: usize = seqs.iter().map(|&(_, n)| n).sum();
        let q = random_bf16(&mut rng, total_q * n_heads * hd, 1.0);
        let scale = 1.0 / (hd as f32).sqrt();
        let f = |b: &[bf16]| b.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
        let (kf, vf, qf) = (f(&k), f(&v), f(&q));
        let cache = PagedKv { block_size, n_kv_heads: n_kv, head_dim: hd };
        let mut want = vec![0f32; qf.len()];
        let (mut cu, mut ctx_lens, mut tables) = (vec![0u32], Vec::new(), Vec::new());
        for (s, &(ctx, nq)) in seqs.iter().enumerate() {
            let table = &ids[s * max_blocks..(s + 1) * max_blocks];
            let t0 = *cu.last().unwrap() as usize;
            let rows = t0 * n_heads * hd..(t0 + nq) * n_heads * hd;
            let seq = SeqSlice { block_table: table, first_pos: ctx - nq, n_tokens: nq };
            cpu_attention(&cache, &kf, &vf, &mut want[rows.clone()], &qf[rows], &seq, n_heads, scale).unwrap();
            cu.push((t0 + nq) as u32);
            ctx_lens.push(ctx as u32);
            tables.extend_from_slice(table);
        }
        let (kd, vd, qd) = (dev.upload(&k).unwrap(), dev.upload(&v).unwrap(), dev.upload(&q).unwrap());
        let (bt, cl, cq) = (dev.upload(&tables).unwrap(), dev.upload(&ctx_lens).unwrap(), dev.upload(&cu).unwrap());
        let inputs = hip::attention::PagedInputs {
            k_cache: &kd,
            v_cache: &vd,
            block_tables: &bt,
            context_lens: &cl,
            cu_q: &cq,
            block_size,
            n_kv,
            head_dim: hd,
        };
        let mut out = dev.upload(&vec![bf16::NAN; q.len()]).unwrap();
        hip::attention::paged_attention(&dev, &mut out, &qd, &inputs, n_heads, scale).unwrap();
        let got = dev.download(&out).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = (g.to_f32() - w).abs();
            assert!(err <= w.abs() / 128.0 + 1.0 / 1024.0, "attention hd {hd} [{i}]: got {g}, want {w}");
        }
    }
}

#[test]
fn gemm_matches_f64_reference() {
    if !enabled("TESSERA_HIP_TESTS", "gemm_matches_f64_reference") {
        return;
    }
    let dev = gpu();
    let blas = Blas::new(&dev).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for (m, n, k) in [(1, 96, 64), (7, 130, 200), (64, 256, 512)] {
        let x = random_bf16(&mut rng, m * k, 1.0);
        let w = random_bf16(&mut rng, n * k, 1.0);
        let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
        let mut out = dev.upload(&vec![bf16::NAN; m * n]).unwrap();
        blas.gemm(&dev, &mut out, &xd, &wd, (m, n, k)).unwrap();
        let got = dev.download(&out).unwrap();
        for (i, (g, &(dot, mag))) in got.iter().zip(&gemm_reference(&x, &w, (m, n, k))).enumerate() {
            let g = g.to_f64();
            let tol = dot.abs() / 256.0 + mag / 4096.0;
            assert!((g - dot).abs() <= tol, "gemm {m}x{n}x{k} [{}, {}]: got {g}, want {dot}", i / n, i % n);
        }
    }
}

#[test]
fn rccl_all_reduce_on_one_rank() {
    if !enabled("TESSERA_HIP_TESTS", "rccl_all_reduce_on_one_rank") {
        return;
    }
    let dev = gpu();
    let id = hip::rccl_unique_id().unwrap();
    let comm = RcclComm::join(&dev, &id, 0, 1).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let host: Vec<f32> = (0..1000).map(|_| rng.next_u32() as f32 / 7.0).collect();
    let mut buf = dev.upload(&host).unwrap();
    comm.all_reduce_sum(&dev, &mut buf).unwrap();
    // One rank: the sum is the input itself.
    assert_eq!(dev.download(&buf).unwrap(), host);
}

/// Without an AMD GPU (or without ROCm), opening one is an error that says so, not a crash.
#[test]
fn no_gpu_is_a_clear_error() {
    match Device::new(0) {
        Ok(dev) => eprintln!("skipped no_gpu_is_a_clear_error: found {} ({})", dev.name(), dev.arch()),
        Err(e) => {
            let msg = e.to_string();
            eprintln!("Device::new(0): {msg}");
            let clear = ["the HIP runtime is not available", "the HIP runtime sees 0"];
            assert!(clear.iter().any(|c| msg.contains(c)), "unclear error: {msg}");
        }
    }
}
