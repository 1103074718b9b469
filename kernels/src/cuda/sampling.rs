//! Host side of GPU sampling (`kernels/cuda/sampling.cu`): the preallocated per-row outputs
//! ([`SampleOutput`]), the shape checks and the launch of one CTA per row.
//!
//! Semantics are the CPU sampler's (`worker/src/sampling.rs`: bias, penalties, logprobs of
//! the adjusted logits, greedy or temperature + top-k + top-p + min-p + draw), with two
//! documented differences: the random stream is the counter-based Gumbel-max of
//! [`gumbel_noise`] (deterministic per `(seed, draw)`), and top-k / top-p keep or drop
//! equal logits at their boundary together (see the .cu file's header). Truncated draws and
//! top-N logprobs usually run over at most [`SAMPLE_CANDIDATES`] candidates compacted into
//! shared memory after 2-4 passes over the row, falling back to full-row threshold searches
//! when the candidates cannot be shown to hold the answer.
//!
//! [`SAMPLE_CANDIDATES`]: super::sample_params::SAMPLE_CANDIDATES
//! [`gumbel_noise`]: super::sample_params::gumbel_noise

use std::sync::Arc;

use cudarc::driver::{CudaEvent, LaunchConfig, PushKernelArg};

use super::device::{dev_err, Buf, Device};
use super::inputs::HostStage;
use super::sample_params::{
    SampleParams, SamplePaths, SampledRow, MAX_SAMPLE_VOCAB, MAX_TOP_LOGPROBS, SPLIT_CHUNK, SPLIT_MAX_ROWS,
};
use crate::error::check;
use crate::KernelError;

/// Threads of a sampling CTA (must match SAMPLE_THREADS in the .cu).
const SAMPLE_THREADS: u32 = 1024;
/// Split path (sampling_split.cu): threads per slice CTA, words per slice result
/// (SPLIT_THREADS, sizeof(SplitPart) / 4 there); its logits per slice are
/// [`SPLIT_CHUNK`](super::sample_params::SPLIT_CHUNK).
const SPLIT_THREADS: u32 = 256;
const SPLIT_PART_WORDS: usize = 8;
/// Bias and penalty lists are indexed with u32 offsets plus a thread stride on the device.
const MAX_ENTRIES: usize = 1 << 31;

/// Per-row results of [`Device::sample`], allocated once for up to `max_rows` rows and
/// `max_logprobs` alternatives per row, reused every step.
pub struct SampleOutput {
    /// `[max_rows]` sampled ids, readable by the next step's embedding on the device.
    token: Buf<u32>,
    /// `[max_rows]` log-probability of `token`.
    logprob: Buf<f32>,
    /// `[max_rows, max_logprobs]` (at least one element): most likely ids, best first.
    top_ids: Buf<u32>,
    /// Same shape: their log-probabilities.
    top_logprobs: Buf<f32>,
    /// `[max_rows]` how many top entries each row wrote.
    n_top: Buf<u32>,
    /// `[max_rows]` [`SampledRow::flags`].
    flags: Buf<u32>,
    /// The six arrays above for the rows read, packed by `pack_sampled` into one array
    /// (`[4 max_rows + 2 max_rows max_logprobs]`) in page-locked host memory, written there
    /// by the kernel (no copy back); where the driver does not map that memory, into
    /// `packed` on the device and copied back in one copy.
    packed: Buf<u32>,
    host: HostStage<u32>,
    /// The split path's per-slice results (`[rows, slices, SPLIT_PART_WORDS]`), allocated
    /// on its first use and grown when a call needs more.
    parts: Option<Buf<u32>>,
    max_rows: usize,
    max_logprobs: usize,
    /// Recorded after the last queued pack kernel (and copy back); shared with the
    /// [`Completion`]s handed out.
    done: Arc<CudaEvent>,
    /// `(rows, with_top)` queued by `queue_read` and not yet taken.
    queued: Option<(usize, bool)>,
}

impl SampleOutput {
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    pub fn max_logprobs(&self) -> usize {
        self.max_logprobs
    }

    /// `[max_rows]` sampled token ids of the last call (its first `n_rows` are valid).
    pub fn tokens(&self) -> &Buf<u32> {
        &self.token
    }

    /// Waits for the queued work and reads the first `n_rows` rows: [`SampleOutput::queue_read`]
    /// then [`SampleOutput::take`].
    pub fn read(&mut self, dev: &Device, n_rows: usize, with_top: bool) -> Result<Vec<SampledRow>, KernelError> {
        self.queue_read(dev, n_rows, with_top)?;
        self.take()
    }

    /// Queues the packing of the first `n_rows` rows by one kernel into one array in
    /// page-locked host memory (or into `packed` and one copy back where that memory is not
    /// mapped), and an event after it; [`SampleOutput::take`] waits for that event only, so
    /// work queued after this call (the next decode step) does not hold the read up. With
    /// `with_top` false (no row asked for top logprobs) the top arrays stay on the device
    /// and every row's top list is empty. Until `take`, no other read can be queued (a
    /// second sampling may be: it runs after this pack kernel on the stream).
    pub fn queue_read(&mut self, dev: &Device, n_rows: usize, with_top: bool) -> Result<(), KernelError> {
        const OP: &str = "cuda_sample_read";
        check(n_rows <= self.max_rows, OP, || format!("{n_rows} rows asked for, the output holds {}", self.max_rows))?;
        check(self.queued.is_none(), OP, || "the rows queued before were not taken".to_string())?;
        if n_rows == 0 {
            self.queued = Some((0, with_top));
            return Ok(());
        }
        let l = self.max_logprobs;
        let top = if with_top { n_rows * l } else { 0 };
        let total = 4 * n_rows + 2 * top;
        const BLOCK: u32 = 256;
        let blocks = total.div_ceil(BLOCK as usize).min(64) as u32;
        let (n32, l32, wt) = (n_rows as u32, l as u32, u32::from(with_top));
        let mut b = dev.stream.launch_builder(&dev.kernels.pack_sampled);
        b.arg(&self.token.inner)
            .arg(&self.logprob.inner)
            .arg(&self.n_top.inner)
            .arg(&self.flags.inner)
            .arg(&self.top_ids.inner)
            .arg(&self.top_logprobs.inner)
            .arg(&n32)
            .arg(&l32)
            .arg(&wt);
        let host_addr = dev.stage_kernel_address(&mut self.host)?;
        match &host_addr {
            Some(addr) => b.arg(addr),
            None => b.arg(&mut self.packed.inner),
        };
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument order and types match pack_sampled (the output a u32 pointer: the
        // mapped stage's address or `packed`); it reads n_rows (<= max_rows, checked) entries
        // of the four row arrays and n_rows x max_logprobs of the top ones (their sizes), and
        // writes `total` <= 4 max_rows + 2 max_rows max_logprobs words of the output (the
        // size of both `packed` and the stage, which lives in `self`; `take` waits for the
        // kernel, and dropping the output waits for it too, see `Drop`).
        unsafe { b.launch(cfg) }.map(drop).map_err(dev_err(OP))?;
        if host_addr.is_none() {
            dev.read_staged(&mut self.host, &self.packed, total)?;
        }
        self.done.record(&dev.stream).map_err(dev_err(OP)).inspect_err(|_| {
            // Should the event fail to record (the context is lost), wait for the stream
            // instead, so the stage is never freed under the kernel.
            let _ = dev.stream.synchronize();
        })?;
        self.queued = Some((n_rows, with_top));
        Ok(())
    }

    /// A handle that waits for the rows queued last (from any thread, without `self`).
    pub fn completion(&self) -> Completion {
        Completion(self.done.clone())
    }

    /// Whether rows were queued by [`SampleOutput::queue_read`] and not yet taken.
    pub fn is_queued(&self) -> bool {
        self.queued.is_some()
    }

    /// Waits for the rows queued by [`SampleOutput::queue_read`] (its event, not the whole
    /// stream) and reads them.
    pub fn take(&mut self) -> Result<Vec<SampledRow>, KernelError> {
        const OP: &str = "cuda_sample_take";
        let (n_rows, with_top) =
            self.queued.take().ok_or(KernelError::Shape { op: OP, detail: "no rows were queued".to_string() })?;
        if n_rows == 0 {
            return Ok(Vec::new());
        }
        self.done.synchronize().map_err(dev_err(OP))?;
        let l = self.max_logprobs;
        let top = if with_top { n_rows * l } else { 0 };
        let total = 4 * n_rows + 2 * top;
        let h = &self.host.as_slice()[..total];
        let (token, rest) = h.split_at(n_rows);
        let (logprob, rest) = rest.split_at(n_rows);
        let (n_top, rest) = rest.split_at(n_rows);
        let (flags, rest) = rest.split_at(n_rows);
        let (ids, lps) = rest.split_at(top);
        Ok((0..n_rows)
            .map(|r| {
                let n = if with_top { (n_top[r] as usize).min(l) } else { 0 };
                let top = (r * l..r * l + n).map(|o| (ids[o], f32::from_bits(lps[o]))).collect();
                SampledRow { token: token[r], logprob: f32::from_bits(logprob[r]), top, flags: flags[r] }
            })
            .collect())
    }
}

/// Waits for a queued sampling's rows ([`SampleOutput::completion`]): lets another thread
/// learn when a queued step has finished on the GPU while the output's owner goes on.
/// Should the output queue another read later, a wait that starts after that waits for it.
#[derive(Clone)]
pub struct Completion(Arc<CudaEvent>);

impl Completion {
    /// Blocks until the rows are written.
    pub fn wait(&self) -> Result<(), KernelError> {
        self.0.synchronize().map_err(dev_err("cuda_sample_completion"))
    }

    /// Whether the rows are written (an error counts as done: reading them reports it).
    pub fn is_done(&self) -> bool {
        self.0.try_is_complete().unwrap_or(true)
    }
}

impl Drop for SampleOutput {
    /// Waits for a queued pack kernel that writes the page-locked stage, which is freed
    /// with the output.
    fn drop(&mut self) {
        if self.queued.is_some() {
            // An error means the context, and the kernel with it, is gone.
            let _ = self.done.synchronize();
        }
    }
}

/// Checks one CSR list: `offsets` has `n_rows + 1` entries, the two entry arrays agree.
fn check_csr(
    op: &'static str,
    what: &str,
    offsets: usize,
    n_rows: usize,
    a: usize,
    b: usize,
) -> Result<(), KernelError> {
    check(offsets == n_rows + 1, op, || format!("{what} offsets have {offsets} entries for {n_rows} rows"))?;
    check(a == b, op, || format!("{what} lists disagree: {a} tokens, {b} values"))?;
    check(a < MAX_ENTRIES, op, || format!("{a} {what} entries exceed {MAX_ENTRIES}"))
}

impl Device {
    /// Outputs for up to `max_rows` rows with up to `max_logprobs` (at most
    /// [`MAX_TOP_LOGPROBS`]) alternatives each.
    pub fn sample_output(&self, max_rows: usize, max_logprobs: usize) -> Result<SampleOutput, KernelError> {
        const OP: &str = "cuda_sample_output";
        check(max_rows > 0 && max_rows <= i32::MAX as usize, OP, || {
            format!("max_rows {max_rows} must be in 1..=2^31-1")
        })?;
        check(max_logprobs <= MAX_TOP_LOGPROBS, OP, || {
            format!("max_logprobs {max_logprobs} exceeds {MAX_TOP_LOGPROBS}")
        })?;
        let top = max_rows.checked_mul(max_logprobs).ok_or_else(|| KernelError::Shape {
            op: OP,
            detail: format!("{max_rows} rows x {max_logprobs} logprobs overflow"),
        })?;
        let words = top.checked_mul(2).and_then(|t| t.checked_add(4 * max_rows)).ok_or_else(|| KernelError::Shape {
            op: OP,
            detail: format!("{max_rows} rows x {max_logprobs} logprobs overflow"),
        })?;
        Ok(SampleOutput {
            token: self.alloc(max_rows)?,
            logprob: self.alloc(max_rows)?,
            top_ids: self.alloc(top.max(1))?,
            top_logprobs: self.alloc(top.max(1))?,
            n_top: self.alloc(max_rows)?,
            flags: self.alloc(max_rows)?,
            packed: self.alloc(words)?,
            host: self.alloc_stage(words)?,
            parts: None,
            max_rows,
            max_logprobs,
            done: Arc::new(self.stream.context().new_event(None).map_err(dev_err(OP))?),
            queued: None,
        })
    }

    /// Samples one token per row of `logits` (`[n_rows, vocab]` f32, `n_rows =
    /// logits.len() / vocab`) with `params[r]` (`[n_rows]`), into the first `n_rows` rows
    /// of `out`. On return `logits` holds the biased and penalised values.
    ///
    /// Per-row adjustments are CSR lists: row `r` owns entries `offsets[r]..offsets[r + 1]`
    /// (`offsets`: `[n_rows + 1]`). Bias entries `(bias_tokens, bias_values)` are added
    /// first, then penalties apply to `(pen_tokens, pen_counts)`: one entry per distinct token
    /// of the sequence (prompt and output), count = 1 + the token's occurrences in the output
    /// (0: no entry). The repetition penalty applies to every entry, presence and frequency to
    /// the output occurrences only (vLLM's rule). Within a row a token appears at most once
    /// per list.
    /// Entry arrays may be longer than the offsets use (e.g. padded so that none is empty).
    /// Device-side values cannot be checked here: a token `>= vocab` or offsets out of
    /// order are skipped and reported in [`SampledRow::flags`], as are NaN / +inf logits
    /// and all-banned rows.
    ///
    /// Up to [`SPLIT_MAX_ROWS`] rows, those that [`SampleParams::splits`] are spread over many
    /// CTAs (a single row would otherwise run on one SM); other rows get one CTA each.
    #[allow(clippy::too_many_arguments)]
    pub fn sample(
        &self,
        out: &mut SampleOutput,
        logits: &mut Buf<f32>,
        vocab: usize,
        params: &Buf<SampleParams>,
        pen_offsets: &Buf<u32>,
        pen_tokens: &Buf<u32>,
        pen_counts: &Buf<u32>,
        bias_offsets: &Buf<u32>,
        bias_tokens: &Buf<u32>,
        bias_values: &Buf<f32>,
    ) -> Result<(), KernelError> {
        let paths = if logits.len() / vocab.max(1) <= SPLIT_MAX_ROWS {
            SamplePaths::Both { draws: true }
        } else {
            SamplePaths::PerRowOnly
        };
        let (pt, pc, bt, bv) = (pen_tokens, pen_counts, bias_tokens, bias_values);
        self.sample_paths(out, logits, vocab, params, pen_offsets, pt, pc, bias_offsets, bt, bv, paths)
    }

    /// [`Device::sample`] with the launches `paths` names ([`SamplePaths::for_rows`] picks
    /// them from the rows' parameters). `SplitOnly` with a row that does not split leaves
    /// that row unwritten; `draws: false` with a split row that samples (not greedy) gives
    /// that row its argmax.
    #[allow(clippy::too_many_arguments)]
    pub fn sample_paths(
        &self,
        out: &mut SampleOutput,
        logits: &mut Buf<f32>,
        vocab: usize,
        params: &Buf<SampleParams>,
        pen_offsets: &Buf<u32>,
        pen_tokens: &Buf<u32>,
        pen_counts: &Buf<u32>,
        bias_offsets: &Buf<u32>,
        bias_tokens: &Buf<u32>,
        bias_values: &Buf<f32>,
        paths: SamplePaths,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_sample";
        check(vocab > 0 && vocab <= MAX_SAMPLE_VOCAB, OP, || {
            format!("vocab {vocab} must be in 1..={MAX_SAMPLE_VOCAB}")
        })?;
        check(logits.len().is_multiple_of(vocab), OP, || {
            format!("logits have {} values, not a whole number of rows of {vocab}", logits.len())
        })?;
        let n_rows = logits.len() / vocab;
        check(params.len() == n_rows, OP, || format!("{} params for {n_rows} rows", params.len()))?;
        check(n_rows <= out.max_rows, OP, || format!("{n_rows} rows, the output holds {}", out.max_rows))?;
        check_csr(OP, "penalty", pen_offsets.len(), n_rows, pen_tokens.len(), pen_counts.len())?;
        check_csr(OP, "bias", bias_offsets.len(), n_rows, bias_tokens.len(), bias_values.len())?;
        if n_rows == 0 {
            return Ok(());
        }
        // All below fit u32: vocab <= 2^20, entries < 2^31, rows <= max_rows < 2^31, logprobs <= 20.
        let (v, pen_len, bias_len) = (vocab as u32, pen_tokens.len() as u32, bias_tokens.len() as u32);
        let max_top = out.max_logprobs as u32;
        if paths.split() {
            self.sample_split(out, logits, vocab, n_rows, params, pen_offsets, bias_offsets, bias_len, paths.draws())?;
        }
        if !paths.per_row() {
            return Ok(());
        }
        let skip_split = u32::from(paths.split());
        let cfg =
            LaunchConfig { grid_dim: (n_rows as u32, 1, 1), block_dim: (SAMPLE_THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(&self.kernels.sample_rows);
        b.arg(&mut logits.inner)
            .arg(&v)
            .arg(&params.inner)
            .arg(&pen_offsets.inner)
            .arg(&pen_tokens.inner)
            .arg(&pen_counts.inner)
            .arg(&pen_len)
            .arg(&bias_offsets.inner)
            .arg(&bias_tokens.inner)
            .arg(&bias_values.inner)
            .arg(&bias_len)
            .arg(&mut out.token.inner)
            .arg(&mut out.logprob.inner)
            .arg(&mut out.top_ids.inner)
            .arg(&mut out.top_logprobs.inner)
            .arg(&mut out.n_top.inner)
            .arg(&mut out.flags.inner)
            .arg(&max_top)
            .arg(&skip_split);
        // SAFETY: argument order and types match `sample_rows`; CTA r touches only logits row
        // r (n_rows x vocab checked), params[r], offsets[r..=r + 1] (n_rows + 1 checked),
        // entries below the lengths passed (the kernel bounds them, and tokens by vocab), and
        // output row r (n_rows <= max_rows; top rows of max_top <= the allocation).
        unsafe { b.launch(cfg) }.map(drop).map_err(dev_err(OP))
    }
}

impl Device {
    /// The split path's launches (sampling_split.cu) over `n_rows` rows whose shapes
    /// [`Device::sample_paths`] has checked; rows that do not split return at once. The draw
    /// runs only when `draws` (some split row is not greedy; greedy rows return from it at
    /// once).
    #[allow(clippy::too_many_arguments)]
    fn sample_split(
        &self,
        out: &mut SampleOutput,
        logits: &Buf<f32>,
        vocab: usize,
        n_rows: usize,
        params: &Buf<SampleParams>,
        pen_offsets: &Buf<u32>,
        bias_offsets: &Buf<u32>,
        bias_len: u32,
        draws: bool,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_sample_split";
        let slices = vocab.div_ceil(SPLIT_CHUNK);
        let words = n_rows * slices * SPLIT_PART_WORDS;
        let parts = match out.parts.take() {
            Some(p) if p.len() >= words => p,
            _ => self.alloc::<u32>(words)?,
        };
        let parts = out.parts.insert(parts);
        // vocab <= 2^20 (checked by the caller): at most 256 slices; rows < 2^31.
        let (v, s, rows) = (vocab as u32, slices as u32, n_rows as u32);
        let wide = LaunchConfig { grid_dim: (rows, s, 1), block_dim: (SPLIT_THREADS, 1, 1), shared_mem_bytes: 0 };
        let draw = draws.then_some(&self.kernels.split_draw);
        for f in std::iter::once(&self.kernels.split_stats).chain(draw) {
            let mut b = self.stream.launch_builder(f);
            b.arg(&logits.inner)
                .arg(&v)
                .arg(&params.inner)
                .arg(&pen_offsets.inner)
                .arg(&bias_offsets.inner)
                .arg(&bias_len)
                .arg(&mut parts.inner);
            // SAFETY: argument order and types match split_stats / split_draw; CTA (r, j) reads
            // logits row r's slice j (n_rows x vocab checked by the caller), params[r],
            // offsets[r..=r + 1] (n_rows + 1 checked) and writes parts (r, j) (allocated for
            // n_rows x slices above).
            unsafe { b.launch(wide) }.map(drop).map_err(dev_err(OP))?;
        }
        let narrow = LaunchConfig { grid_dim: (rows, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(&self.kernels.split_finish);
        b.arg(&logits.inner)
            .arg(&v)
            .arg(&params.inner)
            .arg(&pen_offsets.inner)
            .arg(&bias_offsets.inner)
            .arg(&bias_len)
            .arg(&parts.inner)
            .arg(&s)
            .arg(&mut out.token.inner)
            .arg(&mut out.logprob.inner)
            .arg(&mut out.n_top.inner)
            .arg(&mut out.flags.inner);
        // SAFETY: argument order and types match split_finish; CTA r reads parts row r and
        // logits row r, and writes output row r (n_rows <= max_rows checked by the caller).
        unsafe { b.launch(narrow) }.map(drop).map_err(dev_err(OP))
    }
}
