//! The calling thread's CPU time (Linux `CLOCK_THREAD_CPUTIME_ID`). A step's host cost is
//! reported both as wall time (how long the GPU waited for the step) and as this: on a
//! shared machine the wall time also counts moments the thread was not running (another
//! tenant's load, a virtual CPU's stolen time), which the CPU time leaves out.

use std::time::Duration;

/// The CPU time this thread has used so far (zero where the clock cannot be read).
pub fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(u64::try_from(ts.tv_sec).unwrap_or(0), u32::try_from(ts.tv_nsec).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Busy work advances the thread's CPU clock; sleeping does not (much).
    #[test]
    fn counts_work_not_sleep() {
        let a = thread_cpu_time();
        let mut x = 1u64;
        let t = std::time::Instant::now();
        while t.elapsed() < Duration::from_millis(30) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        }
        std::hint::black_box(x);
        let b = thread_cpu_time();
        std::thread::sleep(Duration::from_millis(60));
        let c = thread_cpu_time();
        assert!(b - a >= Duration::from_millis(10), "30 ms of work counted {:?}", b - a);
        assert!(c - b < Duration::from_millis(20), "60 ms of sleep counted {:?}", c - b);
    }
}
