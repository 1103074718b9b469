//! The one-shot all-reduce over peer memory (kernels/cuda/allreduce_oneshot.cu) on two GPUs,
//! in both topologies it serves:
//! - one process per rank (as TP worker processes run): CUDA IPC. IPC handles cannot be
//!   opened by the process that made them, so the parent test re-executes this binary once
//!   per rank (`rank_process`, driven by `TESSERA_ONESHOT_*` variables; rank 0's NCCL id
//!   travels as hex) and checks every child succeeded;
//! - one thread per rank in one process (as `tessera bench --tp` and worker/tests/cuda_tp.rs
//!   run): same-process peer access.
//!
//! Checks, on every rank: random bf16 inputs (never zero) at 1 element, odd sizes, 4 KB,
//! 64 KB and the largest the buffers hold, each bit-identical to the f32 sum in rank order
//! computed here and rounded once (so also bit-identical across ranks); 1000 back-to-back
//! calls of changing sizes and data with no host synchronisation between them (a rank that
//! overwrote a buffer a slow peer still reads would show as a wrong sum); calls recorded in
//! a CUDA graph, replayed on fresh inputs and 100 times back to back; `tp_all_reduce` taking
//! NCCL above the one-shot limit; an oversized message refused.
//!
//! Needs two GPUs: tests run with `TESSERA_GPU_TESTS=1`, the benchmark (one-shot vs NCCL by
//! message size, eager and inside a CUDA graph) with `TESSERA_GPU_BENCH=1`; both skip with a
//! message on fewer than two GPUs.
#![cfg(feature = "cuda")]

mod common;

use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::gpu::{rand_bf16, rng, too_few_gpus};
use half::bf16;
use tessera_kernels::cuda::{Buf, Device, IpcAllReduce, NcclComm, NcclId};
use tessera_kernels::KernelError;

const WORLD: usize = 2;
/// Largest message the tests set up for: a 256-token decode step of a 4096-wide model.
const MAX_BYTES: usize = 256 * 4096 * 2;
/// Child processes' environment.
const ENV_ROLE: &str = "TESSERA_ONESHOT_ROLE";
const ENV_RANK: &str = "TESSERA_ONESHOT_RANK";
const ENV_WORLD: &str = "TESSERA_ONESHOT_WORLD";
const ENV_ID: &str = "TESSERA_ONESHOT_ID";

// ---------------------------------------------------------------- harness

/// `Some(gpu count)` when `var=1` and at least two GPUs are present; else a skip message.
fn enabled(test: &str, var: &str) -> bool {
    if std::env::var(var).as_deref() != Ok("1") {
        eprintln!("skipped {test}: set {var}=1 on a machine with two CUDA GPUs");
        return false;
    }
    let n = Device::count().unwrap_or_else(|e| panic!("{var}=1 but no CUDA driver: {e}"));
    !too_few_gpus(test, n, WORLD)
}

/// What a rank runs once its group is set up.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Role {
    Test,
    Bench,
    /// Rank 1 never joins the call: rank 0's wait must give up (see `missing_peer`).
    MissingPeer,
}

fn role_body(role: Role, dev: &Device, comm: &NcclComm, ar: &mut IpcAllReduce) {
    match role {
        Role::Test => check_all(dev, comm, ar),
        Role::Bench => bench(dev, comm, ar),
        Role::MissingPeer => unreachable!("handled by missing_peer"),
    }
}

/// A peer that never arrives: rank 1 stays alive with its region mapped but never calls;
/// rank 0's all-reduce, with a 300 ms timeout, must fail within seconds (the kernel traps)
/// with an error that says the GPU context is lost (`KernelError::context_lost`, which
/// makes a worker restart instead of failing every later step). Ends the process: nothing
/// on a lost context can be torn down cleanly.
fn missing_peer(rank: usize, dev: &Device, mut ar: IpcAllReduce) -> ! {
    if rank == 0 {
        ar.set_timeout_ns(300_000_000);
        let mut buf = dev.upload(&input(11, 0, 4096)).unwrap();
        let t0 = Instant::now();
        let got = dev.all_reduce_sum_small(&ar, &mut buf).and_then(|()| dev.synchronize());
        let waited = t0.elapsed();
        let err = got.expect_err("an all-reduce without its peer succeeded");
        assert!(err.context_lost(), "not a lost-context error: {err}");
        assert!(waited < Duration::from_secs(5), "gave up only after {waited:?}");
        eprintln!("RESULT one-shot all-reduce without its peer: failed after {waited:?} (timeout 300 ms): {err}");
    } else {
        std::thread::sleep(Duration::from_secs(4));
    }
    std::process::exit(0);
}

/// Joins, sets up the one-shot group, runs `role`, then meets the peers before tearing
/// down (a rank must not free its region while a peer may still read it).
fn run_rank(role: Role, rank: usize, world: usize, id: &NcclId) {
    let dev = Device::new(rank).unwrap_or_else(|e| panic!("GPU {rank}: {e}"));
    let comm = dev.nccl_join(id, rank, world).unwrap();
    let mut ar = dev.ipc_all_reduce_setup(&comm, MAX_BYTES).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    assert_eq!((ar.rank(), ar.world()), (rank, world));
    assert!(ar.capacity_bytes() >= MAX_BYTES);
    eprintln!("one-shot group ready: {}", ar.route());
    if role == Role::MissingPeer {
        missing_peer(rank, &dev, ar);
    }
    role_body(role, &dev, &comm, &mut ar);
    sync_ranks(&dev, &comm);
    drop(ar);
    drop(comm);
}

/// Runs `role` with one child process per rank (this binary, test `rank_process`); panics
/// unless every child exits successfully within the deadline.
fn with_processes(role: Role) {
    let id = Device::nccl_unique_id().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..WORLD)
        .map(|r| {
            Command::new(&exe)
                .args(["--exact", "rank_process", "--nocapture", "--test-threads=1"])
                .env(ENV_ROLE, format!("{role:?}"))
                .env(ENV_RANK, r.to_string())
                .env(ENV_WORLD, WORLD.to_string())
                .env(ENV_ID, id.to_hex())
                .stdout(Stdio::inherit())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap_or_else(|e| panic!("spawning rank {r}: {e}"))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(540);
    let mut status = [None; WORLD];
    while status.iter().any(Option::is_none) {
        for (r, c) in children.iter_mut().enumerate() {
            if status[r].is_none() {
                status[r] = c.try_wait().unwrap();
            }
        }
        // A failed rank leaves its peer waiting in a collective: stop everyone.
        let failed = status.iter().flatten().any(|s| !s.success());
        if failed || Instant::now() > deadline {
            std::thread::sleep(Duration::from_secs(if failed { 5 } else { 0 }));
            for c in children.iter_mut() {
                let _ = c.kill();
            }
            for (r, c) in children.iter_mut().enumerate() {
                status[r] = Some(c.wait().unwrap());
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for (r, s) in status.iter().enumerate() {
        assert!(s.is_some_and(|s| s.success()), "rank process {r} failed: {s:?}");
    }
}

/// Runs `role` with one thread per rank in this process.
fn with_threads(role: Role) {
    let id = Device::nccl_unique_id().unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORLD)
            .map(|r| {
                s.spawn({
                    let id = id.clone();
                    move || run_rank(role, r, WORLD, &id)
                })
            })
            .collect();
        for (r, h) in hs.into_iter().enumerate() {
            h.join().unwrap_or_else(|_| panic!("rank thread {r} panicked"));
        }
    });
}

/// A rank process started by [`with_processes`]; does nothing when run otherwise.
#[test]
fn rank_process() {
    let Ok(role) = std::env::var(ENV_ROLE) else { return };
    let role = match role.as_str() {
        "Test" => Role::Test,
        "Bench" => Role::Bench,
        "MissingPeer" => Role::MissingPeer,
        other => panic!("{ENV_ROLE}={other}"),
    };
    let get = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"));
    let rank: usize = get(ENV_RANK).parse().unwrap();
    let world: usize = get(ENV_WORLD).parse().unwrap();
    let id = NcclId::from_hex(&get(ENV_ID)).unwrap();
    run_rank(role, rank, world, &id);
    eprintln!("rank {rank} of {world}: {role:?} passed");
}

/// Every rank waits here until all have arrived and their queued work has finished.
fn sync_ranks(dev: &Device, comm: &NcclComm) {
    let mut b = dev.upload(&[1.0f32]).unwrap();
    dev.all_reduce_sum_f32(comm, &mut b).unwrap();
    assert_eq!(dev.download(&b).unwrap(), [comm.world() as f32]);
}

// ---------------------------------------------------------------- references

/// Rank `rank`'s input of case `seed` (every rank can compute every other's): random in
/// [-4, 4), never all zero.
fn input(seed: u64, rank: usize, n: usize) -> Vec<bf16> {
    rand_bf16(&mut rng(seed * 64 + rank as u64), n, -4.0, 4.0)
}

/// The expected sum: f32 in rank order 0..world, one bf16 rounding.
fn reference(seed: u64, world: usize, n: usize) -> Vec<bf16> {
    let ins: Vec<Vec<bf16>> = (0..world).map(|r| input(seed, r, n)).collect();
    (0..n)
        .map(|i| {
            let mut s = ins[0][i].to_f32();
            for v in &ins[1..] {
                s += v[i].to_f32();
            }
            bf16::from_f32(s)
        })
        .collect()
}

/// `got` must equal `want` bit for bit; `mine` (this rank's input) must mostly differ.
fn assert_bits(what: &str, got: &[bf16], want: &[bf16], mine: &[bf16]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits(),
            "{what}[{i}] of {}: got {g} ({:#06x}), want {w} ({:#06x})",
            got.len(),
            g.to_bits(),
            w.to_bits()
        );
    }
    let changed = got.iter().zip(mine).filter(|(g, m)| g.to_bits() != m.to_bits()).count();
    assert!(got.len() < 4 || changed > got.len() / 2, "{what}: only {changed} of {} changed", got.len());
}

// ---------------------------------------------------------------- checks

fn check_all(dev: &Device, comm: &NcclComm, ar: &mut IpcAllReduce) {
    let (rank, world) = (comm.rank(), comm.world());
    let largest = ar.capacity_bytes() / 2;
    // 1. Sizes: one element, odd sizes around the 8-wide vectors, 4 KB, 64 KB (+ odd), the largest.
    for (k, &n) in [1usize, 7, 8, 9, 4099, 2048, 32_768, 32_773, 131_071, largest].iter().enumerate() {
        let seed = 1 + k as u64;
        let mine = input(seed, rank, n);
        let mut buf = dev.upload(&mine).unwrap();
        dev.all_reduce_sum_small(ar, &mut buf).unwrap();
        assert_bits(&format!("n={n} rank {rank}"), &dev.download(&buf).unwrap(), &reference(seed, world, n), &mine);
    }
    eprintln!("rank {rank}: sizes 1 .. {largest} bit-exact");

    // 1b. With the residual add: residual = bf16(residual + sum) bit for bit (the sum
    // rounded first, as an all-reduce then an add rounds it), buf left as it was.
    for (k, &n) in [1usize, 9, 4099, 32_768].iter().enumerate() {
        let seed = 50 + k as u64;
        let mine = input(seed, rank, n);
        let res0 = input(seed + 100, 0, n); // the same residual stream on every rank
        let sum = reference(seed, world, n);
        let want: Vec<bf16> = sum.iter().zip(&res0).map(|(s, r)| bf16::from_f32(s.to_f32() + r.to_f32())).collect();
        let (mut buf, mut res) = (dev.upload(&mine).unwrap(), dev.upload(&res0).unwrap());
        dev.all_reduce_sum_small_add(ar, &mut buf, &mut res).unwrap();
        assert_bits(&format!("add n={n} rank {rank}"), &dev.download(&res).unwrap(), &want, &res0);
        let after = dev.download(&buf).unwrap();
        assert!(after.iter().zip(&mine).all(|(a, m)| a.to_bits() == m.to_bits()), "add n={n}: buf was changed");
    }
    eprintln!("rank {rank}: all-reduce + residual add bit-exact");

    // 2. 1000 back-to-back calls of changing sizes and data, no host sync between them.
    const CALLS: usize = 1000;
    let sizes = [4099usize, 32_773, 1, 777, 8, 65_536];
    let seed_of = |i: usize| 1000 + i as u64;
    let n_of = |i: usize| sizes[i % sizes.len()];
    let offsets: Vec<usize> = (0..CALLS)
        .scan(0, |o, i| {
            let at = *o;
            *o += n_of(i);
            Some(at)
        })
        .collect();
    let total = offsets[CALLS - 1] + n_of(CALLS - 1);
    let mut all_in = Vec::with_capacity(total);
    for i in 0..CALLS {
        all_in.extend(input(seed_of(i), rank, n_of(i)));
    }
    let ins = dev.upload(&all_in).unwrap();
    let mut outs = dev.alloc::<bf16>(total).unwrap();
    let mut work: Vec<Buf<bf16>> = sizes.iter().map(|&n| dev.alloc::<bf16>(n).unwrap()).collect();
    sync_ranks(dev, comm);
    for i in 0..CALLS {
        let (n, at, w) = (n_of(i), offsets[i], &mut work[i % sizes.len()]);
        dev.copy_rows(w, 0, &ins, at, n, 1).unwrap();
        dev.all_reduce_sum_small(ar, w).unwrap();
        dev.copy_rows(&mut outs, at, w, 0, n, 1).unwrap();
    }
    let got = dev.download(&outs).unwrap();
    for (i, &at) in offsets.iter().enumerate() {
        let n = n_of(i);
        let what = format!("back-to-back call {i} (n={n}) rank {rank}");
        assert_bits(&what, &got[at..at + n], &reference(seed_of(i), world, n), &all_in[at..at + n]);
    }
    eprintln!("rank {rank}: {CALLS} back-to-back calls bit-exact");

    // 3. Inside a CUDA graph: three all-reduces per replay, fresh inputs per replay.
    let gsizes = [4096usize, 33, 32_768];
    let mut g_in: Vec<Buf<bf16>> = gsizes.iter().map(|&n| dev.alloc::<bf16>(n).unwrap()).collect();
    let mut g_work: Vec<Buf<bf16>> = gsizes.iter().map(|&n| dev.alloc::<bf16>(n).unwrap()).collect();
    let mut g_out: Vec<Buf<bf16>> = gsizes.iter().map(|&n| dev.alloc::<bf16>(n).unwrap()).collect();
    let graph = dev
        .capture(|| {
            for j in 0..gsizes.len() {
                dev.copy_rows(&mut g_work[j], 0, &g_in[j], 0, gsizes[j], 1)?;
                dev.all_reduce_sum_small(ar, &mut g_work[j])?;
                dev.copy_rows(&mut g_out[j], 0, &g_work[j], 0, gsizes[j], 1)?;
            }
            Ok(())
        })
        .unwrap();
    let gseed = |replay: u64, j: usize| 5000 + replay * 8 + j as u64;
    for replay in 0..5u64 {
        for (j, &n) in gsizes.iter().enumerate() {
            dev.write(&mut g_in[j], &input(gseed(replay, j), rank, n)).unwrap();
        }
        dev.launch_graph(&graph).unwrap();
        for (j, &n) in gsizes.iter().enumerate() {
            let what = format!("graph replay {replay} all-reduce {j} (n={n}) rank {rank}");
            let mine = input(gseed(replay, j), rank, n);
            assert_bits(&what, &dev.download(&g_out[j]).unwrap(), &reference(gseed(replay, j), world, n), &mine);
        }
    }
    // 100 replays back to back on the last inputs: each replay re-reads g_in, so the
    // result stays the last replay's sum.
    for _ in 0..100 {
        dev.launch_graph(&graph).unwrap();
    }
    for (j, &n) in gsizes.iter().enumerate() {
        let mine = input(gseed(4, j), rank, n);
        let what = format!("after 100 replays, all-reduce {j} rank {rank}");
        assert_bits(&what, &dev.download(&g_out[j]).unwrap(), &reference(gseed(4, j), world, n), &mine);
    }
    drop(graph);
    eprintln!("rank {rank}: graph replays bit-exact");

    // 4. The chooser: above the one-shot limit NCCL sums (within one bf16 rounding).
    ar.set_max_bytes(8192);
    assert!(ar.fits(4096) && !ar.fits(4097));
    for (seed, n) in [(7001u64, 4096usize), (7002, 50_001)] {
        let mine = input(seed, rank, n);
        let mut buf = dev.upload(&mine).unwrap();
        dev.tp_all_reduce(comm, Some(ar), &mut buf).unwrap();
        let got = dev.download(&buf).unwrap();
        let want = reference(seed, world, n);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let (g, w) = (g.to_f32(), w.to_f32());
            assert!((g - w).abs() <= w.abs() / 128.0, "tp_all_reduce n={n} [{i}]: {g} vs {w}");
        }
    }
    // ... and with the residual add, NCCL then add_residual above the limit.
    for (seed, n) in [(7003u64, 4096usize), (7004, 50_001)] {
        let mine = input(seed, rank, n);
        let res0 = input(seed + 100, 0, n);
        let (mut buf, mut res) = (dev.upload(&mine).unwrap(), dev.upload(&res0).unwrap());
        dev.tp_all_reduce_add(comm, Some(ar), &mut buf, &mut res).unwrap();
        let got = dev.download(&res).unwrap();
        for (i, ((g, s), r)) in got.iter().zip(reference(seed, world, n)).zip(&res0).enumerate() {
            let (g, w) = (g.to_f32(), s.to_f32() + r.to_f32());
            assert!((g - w).abs() <= w.abs() / 64.0 + 1e-2, "tp_all_reduce_add n={n} [{i}]: {g} vs {w}");
        }
    }
    ar.set_max_bytes(usize::MAX);
    assert_eq!(ar.max_bytes(), ar.capacity_bytes());

    // 5. Too large for the buffers: refused on every rank before any launch.
    let mut big = dev.alloc::<bf16>(largest + 1).unwrap();
    match dev.all_reduce_sum_small(ar, &mut big) {
        Err(KernelError::Shape { op, detail }) => {
            assert_eq!(op, "oneshot_all_reduce_bf16");
            assert!(detail.contains("exceed"), "{detail}");
        }
        r => panic!("an oversized one-shot all-reduce: {:?}", r.err()),
    }
    // The group still works afterwards.
    let mine = input(9000, rank, 1000);
    let mut buf = dev.upload(&mine).unwrap();
    dev.all_reduce_sum_small(ar, &mut buf).unwrap();
    assert_bits("after the refusal", &dev.download(&buf).unwrap(), &reference(9000, world, 1000), &mine);
}

#[test]
fn oneshot_all_reduce_across_processes() {
    if enabled("oneshot_all_reduce_across_processes", "TESSERA_GPU_TESTS") {
        with_processes(Role::Test);
    }
}

#[test]
fn oneshot_all_reduce_across_threads() {
    if enabled("oneshot_all_reduce_across_threads", "TESSERA_GPU_TESTS") {
        with_threads(Role::Test);
    }
}

#[test]
fn oneshot_all_reduce_gives_up_on_a_missing_peer() {
    if enabled("oneshot_all_reduce_gives_up_on_a_missing_peer", "TESSERA_GPU_TESTS") {
        with_processes(Role::MissingPeer);
    }
}

/// Setup errors are the same on every rank: a rank that opts out (max_bytes 0) fails the
/// whole group, and the group's NCCL communicator keeps working.
#[test]
fn oneshot_setup_fails_together() {
    if !enabled("oneshot_setup_fails_together", "TESSERA_GPU_TESTS") {
        return;
    }
    let id = Device::nccl_unique_id().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        for r in 0..WORLD {
            let (id, tx) = (id.clone(), tx.clone());
            s.spawn(move || {
                let dev = Device::new(r).unwrap();
                let comm = dev.nccl_join(&id, r, WORLD).unwrap();
                let res = dev.ipc_all_reduce_setup(&comm, if r == 1 { 0 } else { MAX_BYTES });
                tx.send((r, res.err().map(|e| e.to_string()))).unwrap();
                sync_ranks(&dev, &comm);
            });
        }
    });
    drop(tx);
    let errs: Vec<(usize, Option<String>)> = rx.iter().collect();
    assert_eq!(errs.len(), WORLD);
    for (r, e) in errs {
        let e = e.unwrap_or_else(|| panic!("rank {r} set up although rank 1 opted out"));
        assert!(e.contains("rank(s) [1]"), "rank {r}: {e}");
    }
}

// ---------------------------------------------------------------- benchmark

/// Median over `trials` of `f` (ms per all-reduce), the ranks starting each trial together.
fn median_ms(dev: &Device, comm: &NcclComm, trials: usize, mut f: impl FnMut() -> f64) -> f64 {
    f();
    let mut t: Vec<f64> = (0..trials)
        .map(|_| {
            sync_ranks(dev, comm);
            f()
        })
        .collect();
    t.sort_by(|a, b| a.total_cmp(b));
    t[t.len() / 2]
}

fn bench(dev: &Device, comm: &NcclComm, ar: &mut IpcAllReduce) {
    // All-reduces per graph: one replay stands for part of a decode step.
    const PER_GRAPH: usize = 16;
    ar.set_max_bytes(usize::MAX);
    let mut rows = Vec::new();
    let mut bytes = 2usize << 10;
    while bytes <= (1 << 20).min(ar.capacity_bytes()) {
        let mut buf = dev.alloc::<bf16>(bytes / 2).unwrap();
        dev.fill_uniform(&mut buf, 7, -1.0, 1.0).unwrap();
        let reps = 200;
        let mut row = vec![bytes as f64];
        for oneshot in [true, false] {
            let call =
                |b: &mut Buf<bf16>| if oneshot { dev.all_reduce_sum_small(ar, b) } else { dev.all_reduce_sum(comm, b) };
            let eager = median_ms(dev, comm, 7, || dev.time_ms(reps, || call(&mut buf)).unwrap());
            let graph = dev
                .capture(|| {
                    for _ in 0..PER_GRAPH {
                        call(&mut buf)?;
                    }
                    Ok(())
                })
                .unwrap();
            let in_graph =
                median_ms(dev, comm, 7, || dev.time_ms(reps / PER_GRAPH, || dev.launch_graph(&graph)).unwrap())
                    / PER_GRAPH as f64;
            dev.synchronize().unwrap();
            drop(graph);
            row.extend([eager * 1e3, in_graph * 1e3]);
        }
        rows.push(row);
        bytes *= 2;
    }
    if comm.rank() != 0 {
        return;
    }
    println!("# one-shot all-reduce vs NCCL, bf16, {} GPUs: {}", comm.world(), ar.route());
    println!("| bytes | one-shot eager (us) | NCCL eager (us) | one-shot in graph (us) | NCCL in graph (us) | graph speed-up |");
    println!("|---|---|---|---|---|---|");
    for r in &rows {
        println!("| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}x |", r[0], r[1], r[3], r[2], r[4], r[4] / r[2]);
        for (how, us) in
            [("one-shot eager", r[1]), ("one-shot in graph", r[2]), ("nccl eager", r[3]), ("nccl in graph", r[4])]
        {
            println!(
                "BENCH | all_reduce bf16 {how} | {} bytes | {us:.1} us | - | - ({} GPUs, rank 0)",
                r[0],
                comm.world()
            );
        }
    }
}

/// One-shot vs NCCL latency by message size, one process per rank (the deployment shape),
/// then one thread per rank (`tessera bench --tp`'s shape).
#[test]
fn bench_oneshot_vs_nccl() {
    if enabled("bench_oneshot_vs_nccl", "TESSERA_GPU_BENCH") {
        println!("## ranks as processes (CUDA IPC)");
        with_processes(Role::Bench);
        println!("## ranks as threads (same-process peer access)");
        with_threads(Role::Bench);
    }
}
