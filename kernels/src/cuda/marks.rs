//! Timestamps the GPU takes as its stream reaches chosen points (CUDA events), for
//! benchmarks: where a decode step's wall time goes between the host's preparation, the
//! step's graph, its sampling and read-back, and the host's work between steps, during
//! which the GPU has nothing to run. A mark recorded while the stream is idle fires at
//! once, so it timestamps the host's progress on the GPU's clock.
//!
//! The events are created up front, so a step only records them; marks past the capacity
//! are not recorded.

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
    /// last one. Summed in f64 from the intervals between neighbouring marks: CUDA gives
    /// each interval as f32 milliseconds, whose rounding would be microseconds if taken
    /// from the first mark tens of seconds earlier.
    pub fn times_us(&self) -> Result<Vec<f64>, KernelError> {
        let mut times = Vec::with_capacity(self.used);
        let mut now = 0.0;
        for (i, e) in self.events[..self.used].iter().enumerate() {
            if i > 0 {
                let ms = self.events[i - 1].elapsed_ms(e).map_err(dev_err("cuda_marks"))?;
                now += f64::from(ms) * 1e3;
            }
            times.push(now);
        }
        Ok(times)
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
