//! What one parallel op costs beyond its work: `cpu::par::for_each_task` with `tasks`
//! tasks of `work` nanoseconds of busy arithmetic each, back to back as a decode step
//! issues its ~400 small ops, on each dispatch method (`team`, the default, and rayon's
//! `broadcast`). Prints the median microseconds per op over batches of ops and the
//! overhead over the ideal `ceil(tasks / threads) x work`.
//!
//! Run: `cargo run -p tessera-kernels --release --example par_bench`
//! (`THREADS="16"` picks the pool sizes; default: all cores. The team is sized for the
//! global pool: at another size its rows measure the broadcast it falls back to).

use std::hint::black_box;
use std::time::Instant;

use tessera_kernels::cpu::par::{for_each_task_with, ParMode};

/// Busy arithmetic for `iters` steps (a dependent chain the compiler cannot remove).
fn spin(iters: u64) -> u64 {
    let mut x = black_box(1u64);
    for _ in 0..iters {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    }
    x
}

/// Steps of [`spin`] per nanosecond on this thread.
fn calibrate() -> f64 {
    let n = 20_000_000;
    let t = Instant::now();
    black_box(spin(n));
    n as f64 / t.elapsed().as_nanos() as f64
}

/// Median microseconds per op over 15 batches of `ops` back-to-back ops.
fn per_op(ops: usize, mut op: impl FnMut()) -> f64 {
    for _ in 0..ops {
        op();
    }
    let mut samples: Vec<f64> = (0..15)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..ops {
                op();
            }
            t.elapsed().as_secs_f64() * 1e6 / ops as f64
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn main() {
    let threads: Vec<usize> = match std::env::var("THREADS") {
        Ok(s) => s.split_whitespace().filter_map(|t| t.parse().ok()).collect(),
        Err(_) => vec![std::thread::available_parallelism().map_or(1, |n| n.get())],
    };
    let steps_per_ns = calibrate();
    println!("| threads | method | tasks | work per task ns | µs per op | ideal µs | overhead µs |");
    println!("|---:|---|---:|---:|---:|---:|---:|");
    for &t in &threads {
        let Ok(pool) = rayon::ThreadPoolBuilder::new().num_threads(t).build() else { continue };
        pool.install(|| {
            for (method, mode) in [("team", ParMode::Team), ("broadcast", ParMode::Broadcast)] {
                for (tasks, work_ns) in [(16, 0u64), (64, 0), (16, 1000), (48, 1000), (16, 5000), (100, 500)] {
                    let iters = (work_ns as f64 * steps_per_ns) as u64;
                    let us = per_op(2000, || {
                        for_each_task_with(mode, tasks, |_| {
                            black_box(spin(iters));
                        })
                    });
                    let ideal = tasks.div_ceil(t) as f64 * work_ns as f64 / 1000.0;
                    println!("| {t} | {method} | {tasks} | {work_ns} | {us:.2} | {ideal:.2} | {:.2} |", us - ideal);
                }
            }
        });
    }
}
