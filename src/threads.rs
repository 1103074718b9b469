//! The CPU kernels' thread pool size, set once at start.

use anyhow::Result;

/// Sizes rayon's global pool: `n` threads, or every core when `None`.
pub fn init(n: Option<usize>) -> Result<()> {
    if let Some(n) = n {
        if n == 0 {
            anyhow::bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global()?;
    }
    Ok(())
}
