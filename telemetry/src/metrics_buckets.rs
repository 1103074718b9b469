//! Histogram bucket lists, fixed per metric so every process exposes the same `le` values.
//! The request-level ones are vLLM's (v1 engine `loggers.py`), so its dashboards' queries
//! read ours unchanged; the step and collective ones are ours, from tens of microseconds
//! (a small CPU collective) to seconds (a long prefill on the CPU).

/// `tessera:time_to_first_token_seconds`.
pub const TTFT_SECONDS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];

/// `tessera:inter_token_latency_seconds`.
pub const INTER_TOKEN_SECONDS: &[f64] =
    &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];

/// Whole-request latencies: e2e, queue, prefill, decode, inference.
pub const REQUEST_LATENCY_SECONDS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
];

/// Tokens per step (`tessera:iteration_tokens_total`).
pub const ITERATION_TOKENS: &[f64] =
    &[1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0];

/// Sequences per step.
pub const BATCH_SIZE: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0];

/// One step of the engine or a worker.
pub const STEP_SECONDS: &[f64] =
    &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0];

/// Time one step spent in collectives.
pub const COLLECTIVE_SECONDS: &[f64] =
    &[0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0];

/// Per-request token counts (prompt, generation): vLLM's 1-2-5 series.
pub const REQUEST_TOKENS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0, 50000.0, 100000.0,
    200000.0, 500000.0, 1000000.0,
];
