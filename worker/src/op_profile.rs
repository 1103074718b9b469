//! Optional wall-clock profile of the CPU forward pass by operation, for finding where a
//! step's time goes on a given machine (`TESSERA_CPU_OP_PROFILE=1`; `tessera bench` prints
//! it). Each op of [`crate::llama::LlamaModel`]'s step is timed as a whole, its parallel
//! region included, so on many cores the table shows which ops do not scale (too few
//! tasks, serial work) rather than which kernels are slow.
//!
//! Off (the default) an op costs one relaxed load of a flag set once; on, two clock reads
//! and an atomic add. The totals are process-wide: meaningful for one model stepping at a
//! time (the benchmark), not for a serving worker.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// The timed operations, in the order the step runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Token embedding lookup (dequantised rows).
    Embed,
    /// The two RMSNorms of each layer (on the fast path, with the quantisation of the
    /// next projection's input, which they write straight away).
    Norm,
    /// Fused q/k/v projection, with bias and q/k norms where the model has them (on the
    /// fast path, without quantising its input: see `Norm`).
    Qkv,
    /// RoPE on q and k.
    Rope,
    /// K/V rows written into the paged cache.
    KvWrite,
    /// Attention over the cache.
    Attention,
    /// Output projection (with its all-gathers when sharded; unsharded, with the residual
    /// add, which its tasks do as they write).
    OProj,
    /// The two residual adds of each layer when tensor-parallel (otherwise inside o_proj
    /// and down).
    Residual,
    /// Fused gate/up projection (on the fast path, without quantising its input).
    GateUp,
    /// SiLU(gate) * up (on the fast path unsharded, with the quantisation of down's input).
    Swiglu,
    /// Down projection (with its all-gathers when sharded; unsharded, with the residual
    /// add, and on the fast path without quantising its input).
    Down,
    /// Final norm and LM head of the rows whose logits are wanted.
    Head,
}

impl Op {
    /// Every op, in [`Op`]'s order.
    pub const ALL: [Op; 12] = [
        Op::Embed,
        Op::Norm,
        Op::Qkv,
        Op::Rope,
        Op::KvWrite,
        Op::Attention,
        Op::OProj,
        Op::Residual,
        Op::GateUp,
        Op::Swiglu,
        Op::Down,
        Op::Head,
    ];

    /// Short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Op::Embed => "embed",
            Op::Norm => "rms_norm",
            Op::Qkv => "qkv",
            Op::Rope => "rope",
            Op::KvWrite => "kv_write",
            Op::Attention => "attention",
            Op::OProj => "o_proj",
            Op::Residual => "residual_add",
            Op::GateUp => "gate_up",
            Op::Swiglu => "swiglu",
            Op::Down => "down",
            Op::Head => "norm+lm_head",
        }
    }
}

const N: usize = Op::ALL.len();
static NANOS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];
static CALLS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];

/// Whether profiling is on (`TESSERA_CPU_OP_PROFILE` set to anything but `0` or empty).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("TESSERA_CPU_OP_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0"))
}

/// Runs `f`, adding its wall time to `op`'s total when profiling is on.
#[inline]
pub fn time<T>(op: Op, f: impl FnOnce() -> T) -> T {
    if !enabled() {
        return f();
    }
    let t = Instant::now();
    let out = f();
    let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
    NANOS[op as usize].fetch_add(ns, Ordering::Relaxed);
    CALLS[op as usize].fetch_add(1, Ordering::Relaxed);
    out
}

/// Totals since the last call, per op: (nanoseconds, calls). Resets them.
pub fn take() -> [(u64, u64); N] {
    std::array::from_fn(|i| (NANOS[i].swap(0, Ordering::Relaxed), CALLS[i].swap(0, Ordering::Relaxed)))
}

/// A markdown table of `totals` (from [`take`], possibly summed over runs) against the
/// `wall` nanoseconds those runs took and the `tokens` they produced.
pub fn table(label: &str, totals: &[(u64, u64); N], wall: u64, tokens: u64) -> String {
    let mut s = format!("| {label}: op | ms | share of wall | µs per token | calls |\n|---|---:|---:|---:|---:|\n");
    let mut sum = 0u64;
    for (op, &(ns, calls)) in Op::ALL.iter().zip(totals) {
        sum += ns;
        s += &format!(
            "| {} | {:.2} | {:.1}% | {:.1} | {calls} |\n",
            op.name(),
            ns as f64 / 1e6,
            100.0 * ns as f64 / wall.max(1) as f64,
            ns as f64 / 1e3 / tokens.max(1) as f64
        );
    }
    let rest = wall.saturating_sub(sum);
    s += &format!(
        "| outside the ops | {:.2} | {:.1}% | {:.1} | |\n",
        rest as f64 / 1e6,
        100.0 * rest as f64 / wall.max(1) as f64,
        rest as f64 / 1e3 / tokens.max(1) as f64
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_accounts_for_the_wall_time_outside_the_ops() {
        let mut totals = [(0u64, 0u64); N];
        totals[Op::Qkv as usize] = (3_000_000, 10);
        totals[Op::Attention as usize] = (1_000_000, 10);
        let t = table("tg", &totals, 5_000_000, 10);
        assert!(t.contains("| qkv | 3.00 | 60.0% | 300.0 | 10 |"), "{t}");
        assert!(t.contains("| attention | 1.00 | 20.0% | 100.0 | 10 |"), "{t}");
        assert!(t.contains("| outside the ops | 1.00 | 20.0% | 100.0 | |"), "{t}");
    }
}
