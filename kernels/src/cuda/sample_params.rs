//! What GPU sampling ([`Device::sample`]) reads and returns, in every build: the per-row
//! parameters as the device lays them out, one row's result, and pure-Rust copies of the
//! kernel's integer and random rules (`kernels/cuda/sampling.cu`), so they are tested here
//! without a GPU and a CPU can reproduce what the GPU draws.
//!
//! - [`order_key`]: the `u32` whose unsigned order is `f32::total_cmp`'s; thresholds are
//!   searched over these keys.
//! - [`radix_search`]: the kernel's threshold search, the largest key a monotone
//!   condition holds for, 4 bits per pass (15 candidates evaluated per pass over the row).
//! - [`gumbel_noise`]: the counter-based Gumbel(0, 1) of (seed, draw, token) behind the
//!   Gumbel-max draw, from [`philox4x32_10`].
//!
//! [`Device::sample`]: super::Device::sample

/// Temperatures below this are greedy (the worker's `GREEDY_TEMPERATURE`, vLLM's rule).
pub const GREEDY_TEMPERATURE: f32 = 1e-5;

/// Most top-logprob alternatives a row can return (OpenAI's `top_logprobs` bound; the
/// kernel's SAMPLE_MAX_TOP).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Most candidates the kernel's fast path keeps in shared memory (its CAND_CAP): rows with
/// `top_k` above this, or more tied logits at the candidate threshold, take the full-row path.
pub const SAMPLE_CANDIDATES: usize = 2048;

/// Flag of an input token id that names a row of the previous step's sampled tokens
/// instead of a token (`FROM_SAMPLED | row`; [`Device::take_sampled_ids`] resolves it on
/// the device). Token ids stay below [`MAX_SAMPLE_VOCAB`], far below the flag.
///
/// [`Device::take_sampled_ids`]: super::Device::take_sampled_ids
pub const FROM_SAMPLED: u32 = 1 << 31;

/// Largest vocabulary the kernel handles: token ids take 20 bits of its 52-bit
/// (logit, id) ranking keys.
pub const MAX_SAMPLE_VOCAB: usize = 1 << 20;

/// One row's sampling parameters, laid out as the kernel's `SampleParams` (48 bytes, no
/// padding). Ranges are the worker's `SamplingParams` ones; the kernel never reads out of
/// bounds for other values, and always returns a token (see [`Device::sample`]).
///
/// [`Device::sample`]: super::Device::sample
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleParams {
    /// Key of the row's random stream (the sequence's seed).
    pub seed: u64,
    /// Index of this draw in the sequence's stream (tokens sampled before it), so a
    /// replayed or migrated sequence draws the same tokens.
    pub draw: u64,
    /// Below [`GREEDY_TEMPERATURE`]: greedy; otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (ties at the boundary all kept); 0 = off.
    pub top_k: u32,
    /// Keep the most likely tokens holding this much of the top-k mass; 1 = off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 = off.
    pub min_p: f32,
    /// Divides positive / multiplies negative logits of the row's penalty tokens; 1 = off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of each penalty token.
    pub presence_penalty: f32,
    /// Subtracted once per counted occurrence of each penalty token.
    pub frequency_penalty: f32,
    /// Return this many most likely tokens with their logprobs (capped by the output's
    /// `max_logprobs` and the vocabulary).
    pub n_logprobs: u32,
}

const _: () = assert!(std::mem::size_of::<SampleParams>() == 48 && std::mem::align_of::<SampleParams>() == 8);

impl Default for SampleParams {
    /// Temperature 1, nothing truncated or penalised, seed 0, draw 0, no logprobs.
    fn default() -> Self {
        Self {
            seed: 0,
            draw: 0,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            n_logprobs: 0,
        }
    }
}

impl SampleParams {
    /// Argmax decoding, everything else neutral.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE
    }

    /// Whether the kernels sample this row on the split path (each row over many CTAs)
    /// rather than one CTA per row: no top-N logprobs, no bias entries, no penalty entries
    /// while a penalty is on, and greedy or untruncated. The kernels decide the same from
    /// the row's own inputs (`split_row` in sampling_shared.cuh; NaN parameters fail these
    /// comparisons there as here), so a row's path never depends on its batch.
    pub fn splits(&self, vocab: usize, bias_entries: usize, penalty_entries: usize) -> bool {
        if self.n_logprobs != 0 || bias_entries != 0 {
            return false;
        }
        let penalise = self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0;
        if penalise && penalty_entries != 0 {
            return false;
        }
        if self.is_greedy() {
            return true;
        }
        (self.top_k == 0 || self.top_k as usize >= vocab) && self.top_p >= 1.0 && self.min_p <= 0.0
    }
}

/// Most rows a call samples on the split path: beyond this many, one CTA per row already
/// fills the GPU and the split path's extra CTAs only cost time.
pub const SPLIT_MAX_ROWS: usize = 64;

/// Logits per slice of the split path: sampling_split.cu's SPLIT_CHUNK, its SPLIT_THREADS
/// times SPLIT_PER_THREAD (a test reads them from the source).
pub const SPLIT_CHUNK: usize = 4096;

/// Which sampling launches a call makes. With the split path on, rows that
/// [`SampleParams::splits`] are sampled by it (each row over many CTAs) and the one-CTA-per-row
/// kernel skips them; the token is the same either way, the logprob can differ in the last f32
/// bits (another summation order). `draws`: some split row samples (is not greedy), so the
/// split path's draw launch is needed; with greedy rows only it is left out (it would return
/// at once in every CTA: ~2.4 µs of a batch-1 step on an H200, RESULTS 2026-12-04).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SamplePaths {
    /// Split rows on the split path, the others one CTA each.
    Both { draws: bool },
    /// Every row one CTA each.
    PerRowOnly,
    /// Every row is a split row: only the split path's launches.
    SplitOnly { draws: bool },
}

impl SamplePaths {
    /// The launches for `rows` (`(params, bias entries, penalty entries)` per row): the
    /// split path for at most [`SPLIT_MAX_ROWS`] rows, and only the launches that have rows.
    pub fn for_rows(vocab: usize, rows: impl ExactSizeIterator<Item = (SampleParams, usize, usize)>) -> Self {
        if rows.len() > SPLIT_MAX_ROWS {
            return SamplePaths::PerRowOnly;
        }
        let (mut split, mut per_row, mut draws) = (false, false, false);
        for (p, bias, pen) in rows {
            if p.splits(vocab, bias, pen) {
                split = true;
                draws |= !p.is_greedy();
            } else {
                per_row = true;
            }
        }
        match (per_row, split) {
            (_, false) => SamplePaths::PerRowOnly,
            (false, true) => SamplePaths::SplitOnly { draws },
            (true, true) => SamplePaths::Both { draws },
        }
    }

    /// Whether the one-CTA-per-row kernel is launched.
    pub fn per_row(self) -> bool {
        !matches!(self, SamplePaths::SplitOnly { .. })
    }

    /// Whether the split path is launched (and the per-row kernel skips its rows).
    pub fn split(self) -> bool {
        self != SamplePaths::PerRowOnly
    }

    /// Whether the split path's draw launch runs (some split row is not greedy).
    pub fn draws(self) -> bool {
        matches!(self, SamplePaths::Both { draws: true } | SamplePaths::SplitOnly { draws: true })
    }
}

impl super::sealed::Sealed for SampleParams {}
impl super::Elem for SampleParams {}

// SAFETY: #[repr(C)], plain numbers without padding (asserted above); the kernel's struct
// has the same fields in the same order (and asserts the same size).
#[cfg(feature = "cuda")]
unsafe impl cudarc::driver::DeviceRepr for SampleParams {}
// SAFETY: all fields are integers or floats, for which zero bits are a valid value.
#[cfg(feature = "cuda")]
unsafe impl cudarc::driver::ValidAsZeroBits for SampleParams {}

/// One sampled row as [`SampleOutput::read`] returns it.
///
/// [`SampleOutput::read`]: super::SampleOutput::read
#[derive(Debug, Clone, PartialEq)]
pub struct SampledRow {
    pub token: u32,
    /// Log-probability of `token` under the adjusted logits (after bias and penalties,
    /// before temperature and truncation).
    pub logprob: f32,
    /// The row's `n_logprobs` most likely tokens with theirs, most likely first, lower id
    /// first on equal logits.
    pub top: Vec<(u32, f32)>,
    /// What went wrong in the row, 0 when nothing: [`SampledRow::BAD_LOGIT`] etc.
    pub flags: u32,
}

impl SampledRow {
    /// A logit was NaN or +inf after bias and penalties (the CPU sampler's `BadLogit`);
    /// the row's token and logprobs are unreliable.
    pub const BAD_LOGIT: u32 = 1;
    /// Every logit was -inf (the CPU sampler's `AllBanned`); the token is 0.
    pub const ALL_BANNED: u32 = 2;
    /// A bias or penalty entry named a token outside the vocabulary (skipped), or the row's
    /// offsets were out of order or past the entries (its whole list skipped).
    pub const BAD_ENTRY: u32 = 4;
}

/// The `u32` whose unsigned order is `f32::total_cmp`'s: -NaN < -inf < ... < -0.0 < +0.0
/// < ... < +inf < +NaN.
pub fn order_key(x: f32) -> u32 {
    let u = x.to_bits();
    if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    }
}

/// The kernel's threshold search: the largest `t < 2^bits` with `cond(t)`, for a `cond`
/// that holds at 0 and, once false, stays false for larger `t` (a count or mass of keys
/// `>= t` reaching a bound). `bits` is a multiple of 4 in `4..=64`. Each round fixes 4
/// bits: it tries the 15 candidates `prefix | j << shift` (`j` = 1..15; the kernel counts
/// all of them in one pass over the row) and keeps the largest that holds.
pub fn radix_search(bits: u32, mut cond: impl FnMut(u64) -> bool) -> u64 {
    assert!(
        bits.is_multiple_of(4) && (4..=64).contains(&bits),
        "radix_search: bits {bits} must be a multiple of 4 in 4..=64"
    );
    let mut prefix = 0u64;
    let mut shift = bits;
    while shift > 0 {
        shift -= 4;
        let mut best = 0u64;
        for j in 1..16u64 {
            if cond(prefix | j << shift) {
                best = j;
            }
        }
        prefix |= best << shift;
    }
    prefix
}

/// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11):
/// the block of four random words for counter `ctr` and key `key`.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u32 = 0xD251_1F53;
    const M1: u32 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let (mut c, mut k) = (ctr, key);
    for _ in 0..10 {
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

/// The Gumbel(0, 1) noise of `token` in draw `draw` of stream `seed`: Philox block of
/// counter `(token, 0, draw lo, draw hi)` and key `(seed lo, seed hi)`; its first two
/// words give 52 bits `b`, `u = (b + 0.5) / 2^52` in (0, 1) (exact in f64), noise
/// `-ln(-ln u)`. The kernel computes the same in f64 (its `log` and Rust's `ln` may
/// differ in the last bit).
pub fn gumbel_noise(seed: u64, draw: u64, token: u32) -> f64 {
    let r = philox4x32_10([token, 0, draw as u32, (draw >> 32) as u32], [seed as u32, (seed >> 32) as u32]);
    let bits = ((u64::from(r[0]) << 32) | u64::from(r[1])) >> 12;
    let u = (bits as f64 + 0.5) * (1.0 / (1u64 << 52) as f64);
    -(-u.ln()).ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host's slice length is the kernel's: SPLIT_THREADS x SPLIT_PER_THREAD as
    /// sampling_split.cu defines them.
    #[test]
    fn split_chunk_matches_the_kernel_source() {
        let src = include_str!("../../cuda/sampling_split.cu");
        let define = |name: &str| -> usize {
            let line = src
                .lines()
                .find(|l| l.split_whitespace().take(2).eq(["#define", name]))
                .unwrap_or_else(|| panic!("no #define {name} in sampling_split.cu"));
            line.split_whitespace().nth(2).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{line}"))
        };
        assert_eq!(define("SPLIT_THREADS") * define("SPLIT_PER_THREAD"), SPLIT_CHUNK);
    }

    /// Random123's known-answer vectors for philox4x32 with 10 rounds (kat_vectors).
    #[test]
    fn philox_matches_known_answers() {
        let cases = [
            ([0u32; 4], [0u32; 2], [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]),
            ([u32::MAX; 4], [u32::MAX; 2], [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
                [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
            ),
        ];
        for (ctr, key, want) in cases {
            assert_eq!(philox4x32_10(ctr, key), want, "ctr {ctr:x?} key {key:x?}");
        }
    }

    /// The split path takes greedy and untruncated rows without logprobs or entries, and
    /// nothing else; NaN parameters stay on the one-CTA path.
    #[test]
    fn split_path_rows() {
        let v = 1000;
        let t1 = SampleParams::default();
        assert!(SampleParams::greedy().splits(v, 0, 0));
        assert!(t1.splits(v, 0, 0));
        assert!(SampleParams { top_k: 1000, ..t1 }.splits(v, 0, 0), "top-k >= vocab is off");
        assert!(SampleParams { top_k: 5, ..SampleParams::greedy() }.splits(v, 0, 0), "greedy ignores truncation");
        assert!(!SampleParams { top_k: 999, ..t1 }.splits(v, 0, 0));
        assert!(!SampleParams { top_p: 0.9, ..t1 }.splits(v, 0, 0));
        assert!(!SampleParams { min_p: 0.1, ..t1 }.splits(v, 0, 0));
        assert!(!SampleParams { top_p: f32::NAN, ..t1 }.splits(v, 0, 0));
        assert!(!SampleParams { min_p: f32::NAN, ..t1 }.splits(v, 0, 0));
        assert!(!SampleParams { n_logprobs: 1, ..SampleParams::greedy() }.splits(v, 0, 0));
        assert!(!t1.splits(v, 1, 0), "bias entries");
        assert!(t1.splits(v, 0, 3), "penalty entries are ignored while no penalty is on");
        assert!(!SampleParams { presence_penalty: 0.5, ..t1 }.splits(v, 0, 3));
        assert!(SampleParams { presence_penalty: 0.5, ..t1 }.splits(v, 0, 0));
        let rows = |ps: Vec<SampleParams>| SamplePaths::for_rows(v, ps.into_iter().map(|p| (p, 0, 0)));
        let top = SampleParams { top_p: 0.5, ..t1 };
        let greedy = SampleParams::greedy();
        assert_eq!(rows(vec![t1, t1]), SamplePaths::SplitOnly { draws: true });
        assert_eq!(rows(vec![greedy, greedy]), SamplePaths::SplitOnly { draws: false }, "greedy rows draw nothing");
        assert_eq!(rows(vec![greedy, t1]), SamplePaths::SplitOnly { draws: true });
        assert_eq!(rows(vec![t1, top]), SamplePaths::Both { draws: true });
        assert_eq!(rows(vec![greedy, top]), SamplePaths::Both { draws: false }, "the per-row row draws itself");
        assert_eq!(rows(vec![top]), SamplePaths::PerRowOnly);
        assert_eq!(rows(vec![t1; SPLIT_MAX_ROWS + 1]), SamplePaths::PerRowOnly, "large batches");
        assert!(!SamplePaths::SplitOnly { draws: false }.draws() && SamplePaths::Both { draws: true }.draws());
        assert!(!SamplePaths::PerRowOnly.draws() && !SamplePaths::PerRowOnly.split());
        assert!(!SamplePaths::SplitOnly { draws: true }.per_row() && SamplePaths::Both { draws: false }.per_row());
    }

    /// Small deterministic generator for the tests below (splitmix64).
    fn mix(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    #[test]
    fn order_key_orders_as_total_cmp() {
        let mut v = vec![
            f32::NEG_INFINITY,
            f32::INFINITY,
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1e-45,
            -1e-45,
            f32::MAX,
            f32::MIN,
            f32::NAN,
            -f32::NAN,
        ];
        let mut s = 5u64;
        v.extend((0..2000).map(|_| f32::from_bits(mix(&mut s) as u32)));
        for &a in &v {
            for &b in v.iter().step_by(7) {
                assert_eq!(order_key(a).cmp(&order_key(b)), a.total_cmp(&b), "{a:e} vs {b:e}");
            }
        }
    }

    /// Random logits on a coarse grid (many ties) and some -inf.
    fn tied_logits(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                let r = mix(&mut s);
                if r.is_multiple_of(10) {
                    f32::NEG_INFINITY
                } else {
                    ((r >> 8) % 64) as f32 / 8.0 - 4.0
                }
            })
            .collect()
    }

    /// Counting search: the largest key with at least `k` keys >= it is the k-th largest.
    #[test]
    fn radix_search_finds_kth_largest() {
        for seed in 0..20u64 {
            let x = tied_logits(500 + 37 * seed as usize, seed);
            let keys: Vec<u64> = x.iter().map(|&l| u64::from(order_key(l))).collect();
            let mut sorted = keys.clone();
            sorted.sort_unstable_by(|a, b| b.cmp(a));
            for k in [1usize, 2, 7, 50, keys.len()] {
                let t = radix_search(32, |t| keys.iter().filter(|&&key| key >= t).count() >= k);
                assert_eq!(t, sorted[k - 1], "seed {seed} k {k}");
            }
        }
    }

    /// The 52-bit (logit key, inverted id) ranking: the n-th largest key leaves exactly the
    /// top n tokens by (logit desc, id asc), as the CPU sampler orders its logprobs.
    #[test]
    fn radix_search_ranks_ids_on_ties() {
        let x = tied_logits(3000, 42);
        let id_mask = (MAX_SAMPLE_VOCAB - 1) as u64;
        let comp: Vec<u64> =
            x.iter().enumerate().map(|(i, &l)| (u64::from(order_key(l)) << 20) | (id_mask - i as u64)).collect();
        let mut want: Vec<u32> = (0..x.len() as u32).collect();
        want.sort_by(|&a, &b| x[b as usize].total_cmp(&x[a as usize]).then(a.cmp(&b)));
        for n in [1usize, 5, 20] {
            let t = radix_search(52, |t| comp.iter().filter(|&&c| c >= t).count() >= n);
            let mut got: Vec<u32> = (0..x.len() as u32).filter(|&i| comp[i as usize] >= t).collect();
            got.sort_by(|&a, &b| comp[b as usize].cmp(&comp[a as usize]));
            assert_eq!(got, want[..n], "n {n}");
        }
    }

    /// Mass search: the threshold keeps exactly the groups of equal logits, most likely
    /// first, up to and including the first whose cumulative weight reaches the target.
    #[test]
    fn radix_search_finds_top_p_threshold() {
        let x = tied_logits(2000, 7);
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = x.iter().map(|&l| f64::from(l - max).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut order: Vec<usize> = (0..x.len()).filter(|&i| x[i] > f32::NEG_INFINITY).collect();
        order.sort_by(|&a, &b| x[b].total_cmp(&x[a]));
        for top_p in [0.01, 0.3, 0.5, 0.9, 0.999] {
            let target = top_p * total;
            let mass = |t: u64| -> f64 {
                (0..x.len())
                    .filter(|&i| x[i] > f32::NEG_INFINITY && u64::from(order_key(x[i])) >= t)
                    .map(|i| w[i])
                    .sum()
            };
            let t = radix_search(32, |t| mass(t) >= target);
            // Reference: walk groups of equal logits until the mass reaches the target.
            let (mut cum, mut last) = (0.0, f32::NAN);
            for &i in &order {
                if cum >= target && x[i] != last {
                    break;
                }
                cum += w[i];
                last = x[i];
            }
            assert_eq!(t, u64::from(order_key(last)), "top_p {top_p}");
        }
    }

    /// Gumbel-max over weights draws each index with probability proportional to its
    /// weight: 200k draws of 5 weights land within 5 standard deviations of expectation
    /// (the stream is fixed, so this passes or fails deterministically).
    #[test]
    fn gumbel_max_draws_in_proportion() {
        let logw = [0.0f64, -0.5, -1.0, -2.0, -4.0];
        let total: f64 = logw.iter().map(|l| l.exp()).sum();
        let n = 200_000u64;
        let mut counts = [0u64; 5];
        for draw in 0..n {
            let best = (0..5u32)
                .map(|i| (logw[i as usize] + gumbel_noise(1234, draw, i), i))
                .max_by(|a, b| a.0.total_cmp(&b.0))
                .map(|(_, i)| i)
                .unwrap_or(0);
            counts[best as usize] += 1;
        }
        for (i, &c) in counts.iter().enumerate() {
            let p = logw[i].exp() / total;
            let (mean, sd) = (n as f64 * p, (n as f64 * p * (1.0 - p)).sqrt());
            assert!((c as f64 - mean).abs() <= 5.0 * sd, "index {i}: {c} draws, expected {mean:.0} +- {sd:.0}");
        }
        // Different seeds give different streams.
        assert_ne!(gumbel_noise(1, 0, 0), gumbel_noise(2, 0, 0));
        assert_ne!(gumbel_noise(1, 0, 0), gumbel_noise(1, 1, 0));
    }
}
