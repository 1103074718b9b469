//! NCCL all-reduce across two GPUs of one process, one thread per rank, as tensor-parallel
//! workers use it: rank 0 makes the id, the other rank receives it as hex (the coordinator's
//! relay), both join, and in-place sums of random bf16 and f32 buffers are checked against
//! the sum of the inputs computed here. Also: an all-reduce recorded into a CUDA graph and
//! replayed twice on fresh inputs, argument errors, and a latency benchmark (eager and inside
//! a CUDA graph, 4 KB .. 256 MB) to compare with ANCHORS.md.
//!
//! Needs two GPUs: the tests run only with `TESSERA_GPU_TESTS=1`, the benchmark only with
//! `TESSERA_GPU_BENCH=1`, and both skip with a message on fewer than two GPUs.
//!
//! Tolerances (two ranks): NCCL adds in f32 and rounds once to the storage type, so a bf16
//! result is within one bf16 rounding of the f32 sum, `|got - s| <= 2^-8 |s|`; f32 results
//! allow for a different order of addition, `|got - s| <= 2^-22 (|a| + |b|)`. Both ranks
//! must hold bit-identical results.
#![cfg(feature = "cuda")]

mod common;

use std::sync::{mpsc, Barrier};

use common::gpu::{rand_bf16, rng, too_few_gpus, unif};
use half::bf16;
use tessera_kernels::cuda::{Device, NcclComm, NcclId};
use tessera_kernels::KernelError;

const WORLD: usize = 2;

// ---------------------------------------------------------------- harness

/// The first two GPUs, or `None` (with a message) unless `var=1` and two GPUs are present.
fn two_gpus(test: &str, var: &str) -> Option<Vec<Device>> {
    if std::env::var(var).as_deref() != Ok("1") {
        eprintln!("skipped {test}: set {var}=1 on a machine with two CUDA GPUs");
        return None;
    }
    let n = Device::count().unwrap_or_else(|e| panic!("{var}=1 but no CUDA driver: {e}"));
    if too_few_gpus(test, n, WORLD) {
        return None;
    }
    // One after the other: the second device finds the first one's compiled modules cached.
    Some((0..WORLD).map(|i| Device::new(i).unwrap_or_else(|e| panic!("GPU {i}: {e}"))).collect())
}

/// Runs `body` on every device at once, one thread per rank, each joined to one fresh
/// communicator; returns the results by rank. Rank 0 makes the id and relays it as hex.
/// The ranks meet at a barrier before tearing down, so none frees buffers a peer still reads.
fn with_ranks<R: Send>(devs: &[Device], body: impl Fn(&Device, &NcclComm, &Barrier) -> R + Sync) -> Vec<R> {
    let world = devs.len();
    let barrier = Barrier::new(world);
    let (mut txs, mut rxs): (Vec<_>, Vec<_>) = (1..world).map(|_| mpsc::channel::<String>()).unzip();
    let mut rxs = rxs.drain(..);
    std::thread::scope(|s| {
        let handles: Vec<_> = devs
            .iter()
            .enumerate()
            .map(|(rank, dev)| {
                let rx = if rank == 0 { None } else { rxs.next() };
                let txs = if rank == 0 { std::mem::take(&mut txs) } else { Vec::new() };
                let (barrier, body) = (&barrier, &body);
                s.spawn(move || {
                    let id = match rx {
                        None => {
                            let id = Device::nccl_unique_id().unwrap();
                            for tx in &txs {
                                tx.send(id.to_hex()).unwrap();
                            }
                            id
                        }
                        Some(rx) => NcclId::from_hex(&rx.recv().expect("rank 0 sent no id")).unwrap(),
                    };
                    let comm = dev.nccl_join(&id, rank, world).unwrap();
                    assert_eq!((comm.rank(), comm.world()), (rank, world));
                    let out = body(dev, &comm, barrier);
                    dev.synchronize().unwrap();
                    barrier.wait();
                    drop(comm);
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    })
}

/// Rank `rank`'s bf16 input for case `seed`: random in [-4, 4), never all zero. Every rank
/// can compute every other rank's input, so each checks the sum on its own.
fn input_bf16(seed: u64, rank: usize, n: usize) -> Vec<bf16> {
    rand_bf16(&mut rng(seed * 16 + rank as u64), n, -4.0, 4.0)
}

fn input_f32(seed: u64, rank: usize, n: usize) -> Vec<f32> {
    let mut r = rng(seed * 16 + rank as u64 + 8);
    (0..n).map(|_| unif(&mut r, -1000.0, 1000.0)).collect()
}

/// Checks `got` (bf16) against the f32 sum of every rank's input; returns the bits.
fn check_bf16(what: &str, got: &[bf16], seed: u64, world: usize) -> Vec<u16> {
    let ins: Vec<Vec<bf16>> = (0..world).map(|r| input_bf16(seed, r, got.len())).collect();
    let mut changed = 0usize;
    for (i, g) in got.iter().enumerate() {
        let s: f32 = ins.iter().map(|v| v[i].to_f32()).sum();
        let g = g.to_f32();
        let err = (g - s).abs();
        assert!(err <= s.abs() / 256.0, "{what}[{i}]: got {g}, want {s} (err {err:e})");
        changed += usize::from(g != ins[0][i].to_f32());
    }
    // An all-reduce that did nothing would leave most of rank 0's input in place.
    assert!(got.len() < 4 || changed > got.len() / 2, "{what}: only {changed} of {} changed", got.len());
    got.iter().map(|b| b.to_bits()).collect()
}

/// Checks `got` (f32) against the sum of every rank's input; returns the bits.
fn check_f32(what: &str, got: &[f32], seed: u64, world: usize) -> Vec<u32> {
    let ins: Vec<Vec<f32>> = (0..world).map(|r| input_f32(seed, r, got.len())).collect();
    for (i, &g) in got.iter().enumerate() {
        let s: f32 = ins.iter().map(|v| v[i]).sum();
        let mag: f32 = ins.iter().map(|v| v[i].abs()).sum();
        let err = (g - s).abs();
        assert!(err <= mag / (1u32 << 22) as f32, "{what}[{i}]: got {g}, want {s} (err {err:e})");
    }
    got.iter().map(|v| v.to_bits()).collect()
}

// ---------------------------------------------------------------- tests

/// Needs libnccl only: where it loads, two ids differ and survive the hex relay; where it
/// does not, the error says libnccl is missing (cudarc itself would panic).
#[test]
fn nccl_unique_id_or_clear_error() {
    match Device::nccl_unique_id() {
        Ok(a) => {
            let b = Device::nccl_unique_id().unwrap();
            assert_ne!(a, b, "two unique ids are equal");
            assert!(a.0.iter().any(|&x| x != 0), "an all-zero id");
            assert_eq!(NcclId::from_hex(&a.to_hex()).unwrap(), a);
        }
        Err(KernelError::Device { op, detail }) => {
            assert_eq!(op, "nccl_unique_id");
            assert!(detail.contains("libnccl"), "{detail}");
            assert_ne!(std::env::var("TESSERA_GPU_TESTS").as_deref(), Ok("1"), "GPU tests need libnccl: {detail}");
            eprintln!("no libnccl here: {detail}");
        }
        Err(e) => panic!("unexpected error {e}"),
    }
}

#[test]
fn all_reduce_sums_bf16_and_f32_on_two_gpus() {
    let Some(devs) = two_gpus("all_reduce_sums_bf16_and_f32_on_two_gpus", "TESSERA_GPU_TESTS") else {
        return;
    };
    // Bad ranks are refused before NCCL is asked (which would block waiting for peers).
    for (rank, world) in [(2, 2), (0, 0), (5, 1)] {
        match devs[0].nccl_join(&NcclId([7; 128]), rank, world) {
            Err(KernelError::Shape { op: "nccl_join", .. }) => {}
            Err(e) => panic!("rank {rank} of {world}: unexpected error {e}"),
            Ok(_) => panic!("rank {rank} of {world} joined"),
        }
    }
    const SIZES: [usize; 7] = [1, 7, 1000, 4099, 65_537, 1 << 20, (3 << 20) + 11];
    let results = with_ranks(&devs, |dev, comm, barrier| {
        let rank = comm.rank();
        let mut bits = Vec::new();
        for (k, &n) in SIZES.iter().enumerate() {
            let seed = k as u64 + 1;
            let mut buf = dev.upload(&input_bf16(seed, rank, n)).unwrap();
            dev.all_reduce_sum(comm, &mut buf).unwrap();
            let got = dev.download(&buf).unwrap();
            let b16 = check_bf16(&format!("bf16 n={n} rank {rank}"), &got, seed, WORLD);

            let mut fbuf = dev.upload(&input_f32(seed, rank, n)).unwrap();
            dev.all_reduce_sum_f32(comm, &mut fbuf).unwrap();
            let got = dev.download(&fbuf).unwrap();
            let b32 = check_f32(&format!("f32 n={n} rank {rank}"), &got, seed, WORLD);
            bits.push((b16, b32));
        }
        // Several collectives queued back to back, one wait: each sums its own buffer.
        let mut bufs: Vec<_> =
            (0..4).map(|k| dev.upload(&input_bf16(100 + k, rank, 3000 + k as usize)).unwrap()).collect();
        for b in bufs.iter_mut() {
            dev.all_reduce_sum(comm, b).unwrap();
        }
        for (k, b) in bufs.iter().enumerate() {
            let got = dev.download(b).unwrap();
            check_bf16(&format!("queued #{k} rank {rank}"), &got, 100 + k as u64, WORLD);
        }
        // A communicator works only on the device that joined it; refused before NCCL runs.
        barrier.wait();
        let other = &devs[1 - rank];
        let mut wrong = other.upload(&[1.0f32; 4]).unwrap();
        match other.all_reduce_sum_f32(comm, &mut wrong) {
            Err(KernelError::Device { op, detail }) => {
                assert_eq!(op, "nccl_all_reduce_f32");
                assert!(detail.contains("joined on GPU"), "{detail}");
            }
            r => panic!("all-reduce on the wrong device: {:?}", r.err()),
        }
        bits
    });
    for (k, n) in SIZES.iter().enumerate() {
        assert!(results[0][k] == results[1][k], "n={n}: the ranks hold different sums");
    }
    eprintln!("all-reduce ok at {} sizes, bf16 and f32, both ranks identical", SIZES.len());
}

#[test]
fn all_reduce_captured_in_cuda_graph_replays() {
    let Some(devs) = two_gpus("all_reduce_captured_in_cuda_graph_replays", "TESSERA_GPU_TESTS") else {
        return;
    };
    let (n, nf) = (65_536 + 5, 4097);
    let results = with_ranks(&devs, |dev, comm, _| {
        let rank = comm.rank();
        let mut buf = dev.upload(&input_bf16(50, rank, n)).unwrap();
        let mut fbuf = dev.upload(&input_f32(50, rank, nf)).unwrap();
        // An eager round first, so NCCL has set up its connections before the capture.
        dev.all_reduce_sum(comm, &mut buf).unwrap();
        dev.all_reduce_sum_f32(comm, &mut fbuf).unwrap();
        dev.synchronize().unwrap();
        let graph = dev
            .capture(|| {
                dev.all_reduce_sum(comm, &mut buf)?;
                dev.all_reduce_sum_f32(comm, &mut fbuf)
            })
            .unwrap();
        let mut bits = Vec::new();
        for replay in 0..2u64 {
            let seed = 60 + replay;
            dev.write(&mut buf, &input_bf16(seed, rank, n)).unwrap();
            dev.write(&mut fbuf, &input_f32(seed, rank, nf)).unwrap();
            dev.launch_graph(&graph).unwrap();
            let got = dev.download(&buf).unwrap();
            let b16 = check_bf16(&format!("graph replay {replay} bf16 rank {rank}"), &got, seed, WORLD);
            let got = dev.download(&fbuf).unwrap();
            let b32 = check_f32(&format!("graph replay {replay} f32 rank {rank}"), &got, seed, WORLD);
            bits.push((b16, b32));
        }
        drop(graph);
        bits
    });
    assert!(results[0] == results[1], "the ranks hold different sums after graph replays");
    eprintln!("graph-captured all-reduce ok over 2 replays");
}

// ---------------------------------------------------------------- benchmark

/// Median over `trials` of `f` (ms per all-reduce), ranks starting each trial together.
fn median_ms(barrier: &Barrier, trials: usize, mut f: impl FnMut() -> f64) -> f64 {
    for _ in 0..2 {
        f();
    }
    let mut t: Vec<f64> = (0..trials)
        .map(|_| {
            barrier.wait();
            f()
        })
        .collect();
    t.sort_by(|a, b| a.total_cmp(b));
    t[t.len() / 2]
}

#[test]
fn bench_nccl_all_reduce_bf16() {
    let Some(devs) = two_gpus("bench_nccl_all_reduce_bf16", "TESSERA_GPU_BENCH") else {
        return;
    };
    // All-reduces per graph: one replay stands for a decode step's worth of them.
    const PER_GRAPH: usize = 8;
    let rows = with_ranks(&devs, |dev, comm, barrier| {
        let mut rows = Vec::new();
        let mut bytes = 4usize << 10;
        while bytes <= 256 << 20 {
            let mut buf = dev.alloc::<bf16>(bytes / 2).unwrap();
            dev.fill_uniform(&mut buf, 7, -1.0, 1.0).unwrap();
            let reps = (64usize << 20).div_ceil(bytes).clamp(5, 200);
            let eager = median_ms(barrier, 7, || dev.time_ms(reps, || dev.all_reduce_sum(comm, &mut buf)).unwrap());
            let graph = dev
                .capture(|| {
                    for _ in 0..PER_GRAPH {
                        dev.all_reduce_sum(comm, &mut buf)?;
                    }
                    Ok(())
                })
                .unwrap();
            let graph_reps = reps.div_ceil(PER_GRAPH).max(3);
            let in_graph = median_ms(barrier, 7, || dev.time_ms(graph_reps, || dev.launch_graph(&graph)).unwrap())
                / PER_GRAPH as f64;
            dev.synchronize().unwrap();
            rows.push((bytes, eager, in_graph));
            bytes *= 4;
        }
        rows
    });
    // Bus bandwidth: each rank sends and receives 2 (n-1)/n of the buffer.
    let busbw = |bytes: usize, ms: f64| 2.0 * (WORLD - 1) as f64 / WORLD as f64 * bytes as f64 / (ms * 1e-3) / 1e9;
    for &(bytes, eager, in_graph) in &rows[0] {
        for (how, ms) in [("eager", eager), ("in graph", in_graph)] {
            println!(
                "BENCH | nccl all_reduce bf16 {how} | {bytes} bytes | {:.1} us | - | {:.1} GB/s busbw (2 GPUs, rank 0)",
                ms * 1e3,
                busbw(bytes, ms)
            );
        }
    }
}
