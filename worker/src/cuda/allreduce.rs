//! The tensor-parallel all-reduce of the forward pass (after the o and down GEMMs): the
//! one-shot kernel over NVLink peer memory for decode-sized messages (`[tokens, hidden]`
//! bf16 up to a threshold), NCCL for larger ones and wherever the one-shot group could not
//! be set up. See `tessera_kernels::cuda::IpcAllReduce`.
//!
//! Every rank must take the same path for every message, so everything that decides it
//! is agreed collectively at setup: the one-shot group exists on all ranks or on none, and
//! the threshold is the smallest any rank asked for.
//!
//! Environment (read once at setup, per process): `TESSERA_ONESHOT_ALLREDUCE=0` opts this
//! rank out (so the whole group uses NCCL: the A/B switch for benchmarks);
//! `TESSERA_ONESHOT_MAX_BYTES=<n>` sets the largest message sent one-shot (default
//! `ONESHOT_DEFAULT_MAX_BYTES`); `TESSERA_ONESHOT_TIMEOUT_S=<s>` how long the kernel waits
//! for a peer before it gives up by trapping (default `ONESHOT_TIMEOUT_NS`, 30 s; the trap
//! loses the GPU context, and the worker then restarts); `TESSERA_ONESHOT_BLOCKS=<n>` the
//! kernel's grid (read by `Device::ipc_all_reduce_setup`; every rank must agree).

use tessera_kernels::cuda::{bf16, Buf, Device, IpcAllReduce, NcclComm, ONESHOT_DEFAULT_MAX_BYTES};

use crate::error::WorkerError;

/// The all-reduce paths of one tensor-parallel rank.
pub(crate) struct TpAllReduce {
    oneshot: Option<IpcAllReduce>,
    /// Which path is set up, and why not the one-shot one, for logs.
    note: String,
}

impl TpAllReduce {
    /// No tensor parallelism (or NCCL only).
    pub fn none() -> Self {
        TpAllReduce { oneshot: None, note: "one GPU".into() }
    }

    /// Sets up the one-shot group for steps of up to `max_rows` rows of `hidden` values.
    /// Collective: every rank of `comm` calls it at the same point (after loading, before
    /// capturing graphs). A failure of the one-shot setup is not an error: the group falls
    /// back to NCCL (the reason is in [`TpAllReduce::note`] and on stderr); only a failed
    /// collective is.
    pub fn setup(dev: &Device, comm: &NcclComm, max_rows: usize, hidden: usize) -> Result<Self, WorkerError> {
        let (rank, world) = (comm.rank(), comm.world());
        let enabled = std::env::var("TESSERA_ONESHOT_ALLREDUCE").map_or(true, |v| v != "0");
        let asked = std::env::var("TESSERA_ONESHOT_MAX_BYTES")
            .ok()
            .and_then(|v| v.trim().parse::<u32>().ok())
            .unwrap_or(u32::try_from(ONESHOT_DEFAULT_MAX_BYTES).unwrap_or(u32::MAX));
        // The threshold every rank uses: the smallest asked (0 where opted out).
        let asked = if enabled { asked } else { 0 };
        let all = super::tp::all_gather_u32(dev, comm, rank, world, asked)?;
        let threshold = all.iter().copied().min().unwrap_or(0) as usize;
        // The buffers hold the largest decode step; larger messages always go to NCCL.
        let cap = max_rows.saturating_mul(hidden).saturating_mul(2).min(threshold);
        let (oneshot, note) = match dev.ipc_all_reduce_setup(comm, cap) {
            Ok(mut ar) => {
                ar.set_max_bytes(threshold);
                if let Some(t) = crate::step_watch::env_seconds("TESSERA_ONESHOT_TIMEOUT_S") {
                    ar.set_timeout_ns(u64::try_from(t.as_nanos()).unwrap_or(u64::MAX));
                }
                // For A/B runs: TESSERA_ONESHOT_EARLY=0 makes the next kernel wait for the
                // all-reduce's end before it launches.
                ar.set_early_dependents(std::env::var("TESSERA_ONESHOT_EARLY").as_deref() != Ok("0"));
                let note = format!("one-shot all-reduce up to {} bytes, NCCL above ({})", ar.max_bytes(), ar.route());
                (Some(ar), note)
            }
            Err(e) => (None, format!("NCCL all-reduce only: {e}")),
        };
        eprintln!("tensor-parallel rank {rank} of {world}: {note}");
        Ok(TpAllReduce { oneshot, note })
    }

    /// Which path is set up, for logs.
    pub fn note(&self) -> &str {
        &self.note
    }

    /// Sums `buf` (`[t, hidden]`, this rank's partial sums) over the group, in place.
    pub fn run(&self, dev: &Device, comm: &NcclComm, buf: &mut Buf<bf16>) -> Result<(), WorkerError> {
        Ok(dev.tp_all_reduce(comm, self.oneshot.as_ref(), buf)?)
    }

    /// Sums `buf` over the group into the residual stream (`residual += sum`), one kernel
    /// on the one-shot path.
    pub fn run_add(
        &self,
        dev: &Device,
        comm: &NcclComm,
        buf: &mut Buf<bf16>,
        residual: &mut Buf<bf16>,
    ) -> Result<(), WorkerError> {
        Ok(dev.tp_all_reduce_add(comm, self.oneshot.as_ref(), buf, residual)?)
    }
}
