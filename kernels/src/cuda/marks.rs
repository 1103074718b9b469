//! Timestamps the GPU takes as its stream reaches chosen points (CUDA events), for
//! benchmarks: where a decode step's wall time goes between the host's preparation, the
//! step's graph, its sampling and read-back, and the host's work between steps, during
//! which the GPU has nothing to run. A mark recorded while the stream is idle fires at
//! once, so it timestamps the host's progress on the GPU's clock.
//!
//! The events are created up front (creating one costs more than recording it); marks past
//! the capacity are not recorded.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaEvent;

use super::device::dev_err;
use super::Device;
use crate::KernelError;

/// A fixed number of timing events recorded in order.
pub struct Marks {
    events: Vec<CudaEvent>,
    used: usize,
}

impl Marks {
    /// Marks recorded so far.
    pub fn len(&self) -> usize {
        self.used
    }

    pub fn is_empty(&self) -> bool {
        self.used == 0
    }

    /// Microseconds from the first mark to each recorded mark, in order; waits for the
    /// last one.
    pub fn times_us(&self) -> Result<Vec<f64>, KernelError> {
        let Some(first) = self.events.first().filter(|_| self.used > 0) else {
            return Ok(Vec::new());
        };
        self.events[..self.used]
            .iter()
            .map(|e| first.elapsed_ms(e).map(|ms| f64::from(ms) * 1e3).map_err(dev_err("cuda_marks")))
            .collect()
    }
}

impl Device {
    /// `capacity` marks' events, none recorded yet.
    pub fn marks(&self, capacity: usize) -> Result<Marks, KernelError> {
        let ctx = self.stream.context();
        let events = (0..capacity)
            .map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)))
            .collect::<Result<_, _>>()
            .map_err(dev_err("cuda_marks"))?;
        Ok(Marks { events, used: 0 })
    }

    /// Records the next mark of `m` on the stream (nothing once all are used).
    pub fn mark(&self, m: &mut Marks) -> Result<(), KernelError> {
        if let Some(e) = m.events.get(m.used) {
            e.record(&self.stream).map_err(dev_err("cuda_mark"))?;
            m.used += 1;
        }
        Ok(())
    }
}
