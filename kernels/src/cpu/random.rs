//! Counter-based uniform random numbers for synthetic weights (`--synthetic` models).
//!
//! The value of element `index` of a buffer filled with `seed` is a pure function of the
//! two: no generator state, so any element can be produced alone, in any order and in
//! parallel. The GPU fill (`kernels/cuda/init.cu`, `cuda::Device::fill_uniform`) computes
//! the same integer hash and the same f32 operations, so its bf16 buffers equal
//! `bf16::from_f32(uniform(..))` bit for bit.

/// 2^64 / golden ratio: the splitmix64 increment, also used to spread indices.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// The splitmix64 output for state `z` (the state advanced by [`GOLDEN`], then mixed).
fn splitmix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The value element `index` of a buffer filled with seed `seed` gets: uniform in
/// `[lo, hi)` from `h = splitmix64(seed ^ index * golden)`: `u = (h >> 40) / 2^24` (24 bits,
/// exact in f32), `lo + u * (hi - lo)` in f32 without fused multiply-add (Rust never fuses
/// on its own). The last rounding can land on `hi`, so callers should expect `[lo, hi]`.
pub fn uniform(seed: u64, index: u64, lo: f32, hi: f32) -> f32 {
    let h = splitmix64(seed ^ index.wrapping_mul(GOLDEN));
    let u = (h >> 40) as f32 / (1u32 << 24) as f32;
    lo + u * (hi - lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hash is splitmix64: state 0 gives the published first output.
    #[test]
    fn hash_is_splitmix64() {
        assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
        // index 0 leaves the seed as it is, so u is the top 24 bits of that output.
        assert_eq!(uniform(0, 0, 0.0, 1.0), 0xe2_20a8 as f32 / 16_777_216.0);
    }

    #[test]
    fn values_stay_in_range_and_cover_it() {
        for (seed, lo, hi) in [(1u64, -0.05f32, 0.05f32), (99, 2.0, 7.5), (u64::MAX, -3.0, -1.0)] {
            let v: Vec<f32> = (0..100_000u64).map(|i| uniform(seed, i, lo, hi)).collect();
            assert!(v.iter().all(|&x| x >= lo && x <= hi), "seed {seed}: a value outside [{lo}, {hi}]");
            let (min, max) = v.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
            let span = hi - lo;
            assert!(min < lo + 1e-3 * span && max > hi - 1e-3 * span, "seed {seed}: range [{min}, {max}]");
        }
    }

    /// Mean, variance and a 16-bin histogram of 1e5 values are those of a uniform
    /// distribution (bounds are several standard deviations wide; the hash is fixed, so
    /// this either always passes or always fails).
    #[test]
    fn distribution_is_uniform() {
        let (lo, hi) = (-1.5f32, 2.5f32);
        let n = 100_000u64;
        let v: Vec<f64> = (0..n).map(|i| f64::from(uniform(7, i, lo, hi))).collect();
        let mean = v.iter().sum::<f64>() / n as f64;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        let span = f64::from(hi - lo);
        assert!((mean - 0.5).abs() < 0.01 * span, "mean {mean}");
        assert!((var - span * span / 12.0).abs() < 0.02 * span * span / 12.0, "variance {var}");
        let mut bins = [0usize; 16];
        for x in &v {
            bins[(((x - f64::from(lo)) / span * 16.0) as usize).min(15)] += 1;
        }
        let expect = n as usize / 16;
        assert!(bins.iter().all(|&b| b.abs_diff(expect) < expect / 20), "histogram {bins:?}");
        // Neighbouring indices are uncorrelated.
        let cov = v.windows(2).map(|w| (w[0] - mean) * (w[1] - mean)).sum::<f64>() / (n - 1) as f64;
        assert!((cov / var).abs() < 0.02, "lag-1 correlation {}", cov / var);
    }

    #[test]
    fn seeds_differ_and_calls_repeat() {
        let a: Vec<f32> = (0..1000u64).map(|i| uniform(1, i, 0.0, 1.0)).collect();
        let b: Vec<f32> = (0..1000u64).map(|i| uniform(2, i, 0.0, 1.0)).collect();
        let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
        assert!(same < 5, "{same} of 1000 values equal across seeds");
        let again: Vec<f32> = (0..1000u64).map(|i| uniform(1, i, 0.0, 1.0)).collect();
        assert_eq!(a, again);
        // Indices past 2^32 are distinct values, not a repeat of the low ones.
        let high: Vec<f32> = (0..1000u64).map(|i| uniform(1, i + (1 << 32), 0.0, 1.0)).collect();
        assert!(a.iter().zip(&high).filter(|(x, y)| x == y).count() < 5);
    }
}
