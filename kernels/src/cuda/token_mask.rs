//! Host launcher of the constrained-decoding mask (`kernels/cuda/token_mask.cu`): sets the
//! logits of the tokens a row's grammar does not allow to -inf on the device, so the
//! sampling kernel that follows never draws them. Only the constrained rows are launched.
//!
//! The kernel's function is resolved on first use per CUDA context (its module is compiled
//! with the others at start and cached on disk, so this is a cache hit) and kept here, so
//! devices that never constrain pay nothing. Without the `cuda` feature the method exists
//! and is unreachable (no `Device` can be made).

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::{Arc, Mutex};

    use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
    use cudarc::nvrtc::Ptx;

    use super::super::device::{dev_err, Buf, Device};
    use super::super::module_cache::ModuleCache;
    use super::super::{nvrtc, sources};
    use crate::error::check;
    use crate::KernelError;

    const BLOCK: u32 = 256;
    const MODULE: &str = "token_mask";

    /// `(context address, function)`: one entry per CUDA context that has masked a row. A
    /// function keeps its module and context alive, so an address is never reused while
    /// its entry exists.
    static FUNCTIONS: Mutex<Vec<(usize, CudaFunction)>> = Mutex::new(Vec::new());

    fn function(dev: &Device) -> Result<CudaFunction, KernelError> {
        const OP: &str = "cuda_token_mask_load";
        let ctx = dev.stream.context();
        let key = Arc::as_ptr(ctx) as usize;
        let mut cache = FUNCTIONS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, f)) = cache.iter().find(|(k, _)| *k == key) {
            return Ok(f.clone());
        }
        let body = sources::MODULES
            .iter()
            .find(|(n, _)| *n == MODULE)
            .map(|(_, b)| *b)
            .ok_or(KernelError::Device { op: OP, detail: format!("no module {MODULE}") })?;
        let source = sources::full_source(body);
        let compiler = nvrtc::version()?;
        let (image, _) =
            nvrtc::compile_cached(&ModuleCache::default_location(), MODULE, &source, dev.arch(), &compiler)?;
        let module = ctx.load_module(Ptx::from_binary(image)).map_err(dev_err(OP))?;
        let f = module
            .load_function("apply_token_mask")
            .map_err(|e| KernelError::Device { op: OP, detail: format!("{MODULE}.apply_token_mask: {e:?}") })?;
        cache.push((key, f.clone()));
        Ok(f)
    }

    impl Device {
        /// For each `r < n_rows`: sets `logits[rows[r] * vocab + t] = -inf` for every token `t`
        /// whose bit is clear in `masks[r * words ..]` (`words = ceil(vocab / 32)` per row,
        /// bit `t % 32` of word `t / 32`). `logits` is `[rows, vocab]`; a row index past it is
        /// skipped. Enqueued on the device's stream.
        pub fn apply_token_mask(
            &self,
            logits: &mut Buf<f32>,
            vocab: usize,
            masks: &Buf<u32>,
            rows: &Buf<u32>,
            n_rows: usize,
        ) -> Result<(), KernelError> {
            const OP: &str = "cuda_apply_token_mask";
            if n_rows == 0 {
                return Ok(());
            }
            let words = vocab.div_ceil(32);
            check(vocab > 0 && logits.len().is_multiple_of(vocab), OP, || {
                format!("logits of {} values are not rows of {vocab}", logits.len())
            })?;
            check(rows.len() >= n_rows && masks.len() >= n_rows * words, OP, || {
                format!("{n_rows} rows need {n_rows} row ids and {} mask words", n_rows * words)
            })?;
            check(n_rows <= 65_535 && vocab <= u32::MAX as usize, OP, || format!("{n_rows} rows of {vocab}"))?;
            let f = function(self)?;
            let (vocab32, n_logit_rows, words32) = (vocab as u32, (logits.len() / vocab) as u32, words as u32);
            let blocks_x = (vocab as u32).div_ceil(BLOCK).min(1024);
            let cfg =
                LaunchConfig { grid_dim: (blocks_x, n_rows as u32, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
            let mut b = self.stream.launch_builder(&f);
            b.arg(&mut logits.inner).arg(&vocab32).arg(&n_logit_rows).arg(&masks.inner).arg(&rows.inner).arg(&words32);
            // SAFETY: argument types and order match the kernel; it reads masks[r * words + w]
            // for r < n_rows, w < words (checked above to fit), rows[r] for r < n_rows, and
            // writes logits only at rows below n_logit_rows = logits.len() / vocab.
            unsafe { b.launch(cfg) }.map(drop).map_err(dev_err(OP))
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::super::{Buf, Device};
    use crate::KernelError;

    impl Device {
        /// See the CUDA build's documentation; unreachable here (no `Device` exists).
        pub fn apply_token_mask(
            &self,
            _logits: &mut Buf<f32>,
            _vocab: usize,
            _masks: &Buf<u32>,
            _rows: &Buf<u32>,
            _n_rows: usize,
        ) -> Result<(), KernelError> {
            Err(KernelError::NotCompiled("cuda"))
        }
    }
}
