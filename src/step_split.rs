//! Where a benchmarked decode step's wall time goes, from the GPU timestamps the model
//! records per step (`CudaModel::set_marks`: four marks per step): the host's preparation
//! (the GPU has nothing of the step yet but its input copies), the forward pass (graph or
//! kernels, through the LM head), sampling with its read-back to the host, and the caller's
//! time until the next step starts. The GPU idles through the first and the last. (In the
//! bench's overlapped loop a step's marks are queued before the step before's rows are
//! read: its first two then time the GPU's input copies, its third ends at the sampling
//! on the GPU, and "between" is the GPU's gap between steps.)

/// Medians over the steps, µs (of an even count, the upper of the middle two).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepSplit {
    pub prep: f64,
    pub forward: f64,
    pub sampling: f64,
    /// From one step's last mark to the next step's first (one fewer than the steps).
    pub between: f64,
}

impl StepSplit {
    /// From the marks' times (µs, in order, four per step); `None` without a whole step,
    /// or with marks that run backwards (a clock the split cannot be read from).
    pub fn from_marks(times: &[f64]) -> Option<StepSplit> {
        let steps: Vec<&[f64]> = times.chunks_exact(4).collect();
        if steps.is_empty() || times.windows(2).any(|w| w[1] < w[0]) {
            return None;
        }
        let part = |i: usize| median(steps.iter().map(|s| s[i + 1] - s[i]).collect());
        let between = median(steps.windows(2).map(|w| w[1][0] - w[0][3]).collect());
        Some(StepSplit { prep: part(0), forward: part(1), sampling: part(2), between })
    }
}

/// The median of `v` (of an even count, the upper of the middle two; NaN when empty).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_each_step_into_its_four_parts() {
        // Three steps: prep 10, 12, 11; forward 100, 104, 102; sampling 20, 22, 21;
        // between 5 and 7.
        let mut t = Vec::new();
        let mut now = 0.0;
        for (prep, fwd, samp, gap) in [(10.0, 100.0, 20.0, 5.0), (12.0, 104.0, 22.0, 7.0), (11.0, 102.0, 21.0, 0.0)] {
            t.push(now);
            now += prep;
            t.push(now);
            now += fwd;
            t.push(now);
            now += samp;
            t.push(now);
            now += gap;
        }
        let s = StepSplit::from_marks(&t).expect("three whole steps");
        assert_eq!(s, StepSplit { prep: 11.0, forward: 102.0, sampling: 21.0, between: 7.0 });
    }

    #[test]
    fn one_step_has_no_time_between_steps() {
        let s = StepSplit::from_marks(&[0.0, 1.0, 3.0, 6.0]).expect("one whole step");
        assert_eq!((s.prep, s.forward, s.sampling), (1.0, 2.0, 3.0));
        assert!(s.between.is_nan());
    }

    #[test]
    fn incomplete_or_backward_marks_give_nothing() {
        assert_eq!(StepSplit::from_marks(&[]), None);
        assert_eq!(StepSplit::from_marks(&[0.0, 1.0, 2.0]), None);
        assert_eq!(StepSplit::from_marks(&[0.0, 2.0, 1.0, 3.0]), None);
    }

    #[test]
    fn a_partial_last_step_is_left_out() {
        let s = StepSplit::from_marks(&[0.0, 1.0, 2.0, 3.0, 4.0, 50.0]).expect("one whole step");
        assert_eq!(s.forward, 1.0);
        assert!(s.between.is_nan());
    }
}
