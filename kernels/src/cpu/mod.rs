//! The CPU platform: the reference implementation of every op, and the engine of
//! GPU-less machines. Each op works on `f32` slices in row-major `[rows, cols]` layout,
//! checks its shapes first, and parallelises over rows/heads where the work is large
//! enough to pay for it (`par.rs` spreads an op's tasks over rayon's pool size of threads).

pub mod activation;
pub mod attention;
pub mod attention_f16;
pub mod attention_tiled;
#[cfg(target_arch = "x86_64")]
mod attention_x86;
pub mod exp_ggml;
pub mod matmul;
pub mod norm;
pub mod packed;
pub mod par;
mod par_team;
pub mod random;
pub mod rope;
pub mod softmax;
