//! Stop-string matching over text that arrives in pieces (one detokenized token at a time).
//!
//! The output must be exactly what matching on the whole text gives, however the text is
//! split: the text before the stop string that *completes* first (the occurrence with the
//! lowest end offset; on a tie, the longer one), as a streaming matcher must decide, since it
//! cannot wait to see whether a longer stop string that started earlier will complete too.
//! The stop string itself is not sent unless the matcher was built to include it (vLLM's
//! `include_stop_str_in_output`). So text that could
//! still grow into a stop string (a suffix that is a proper prefix of one) is held back until
//! the next piece decides it. Each push scans only the held-back tail plus the new piece, so
//! the work is O(piece + longest stop) per token.
//!
//! vLLM's `min_tokens` skips the stop checks of a sequence's first tokens: their text goes
//! through `push_unchecked`, which holds back the same possible start of a stop string but
//! ends nothing; a stop string must end in text pushed later (it may begin before, as vLLM's
//! look-back over the previous text finds one).

/// The result of feeding one piece of text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopStep {
    /// No stop string yet; this text is safe to send (may be empty).
    Continue(String),
    /// A stop string matched; this is the text before it. Send it and end the sequence.
    Stopped(String),
}

#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released: a tail that is a proper prefix of a stop string.
    held: String,
    stopped: bool,
    /// The stop string that matched, once one has.
    matched: Option<String>,
    /// Whether the text ends after the matched stop string (else before it).
    include: bool,
    /// Bytes at the front of `held` that came through `push_unchecked`: a match must end
    /// past them.
    unchecked: usize,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match before any text).
    pub fn new(stops: &[String]) -> Self {
        let stops = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        StopMatcher { stops, held: String::new(), stopped: false, matched: None, include: false, unchecked: 0 }
    }

    /// This matcher, ending the text after the stop string instead of before it.
    pub fn including_stop(mut self, include: bool) -> Self {
        self.include = include;
        self
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// The stop string that ended the text, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Feeds the next piece of text. After `Stopped`, further pieces return `Stopped("")`.
    pub fn push(&mut self, piece: &str) -> StopStep {
        if self.stopped {
            return StopStep::Stopped(String::new());
        }
        if self.stops.is_empty() {
            return StopStep::Continue(piece.to_owned());
        }
        self.held.push_str(piece);
        if let Some((at, stop)) = self.earliest_match() {
            self.stopped = true;
            let mut out = std::mem::take(&mut self.held);
            out.truncate(if self.include { at + stop.len() } else { at });
            self.matched = Some(stop);
            return StopStep::Stopped(out);
        }
        StopStep::Continue(self.release())
    }

    /// Feeds a piece that may not end the text (before `min_tokens`); returns what is safe
    /// to send, all but a tail that a later `push` could complete into a stop string.
    pub fn push_unchecked(&mut self, piece: &str) -> String {
        if self.stopped {
            return String::new();
        }
        if self.stops.is_empty() {
            return piece.to_owned();
        }
        self.held.push_str(piece);
        let out = self.release();
        self.unchecked = self.held.len();
        out
    }

    /// Takes the text before the longest tail of `held` that could still start a stop string.
    fn release(&mut self) -> String {
        let keep_from = self.partial_match_start();
        let rest = self.held.split_off(keep_from);
        self.unchecked = self.unchecked.saturating_sub(keep_from);
        std::mem::replace(&mut self.held, rest)
    }

    /// Ends the text: whatever was held back could not become a stop string.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }

    /// Start in `held` of the stop string that completes first past the unchecked bytes, and
    /// that string.
    fn earliest_match(&self) -> Option<(usize, String)> {
        let found = self.stops.iter().filter_map(|s| self.find_checked(s).map(|at| (at + s.len(), at, s)));
        found.min().map(|(_, start, s)| (start, s.clone()))
    }

    /// Start of the first occurrence of `stop` in `held` that ends past `unchecked`.
    /// Occurrences start on character boundaries, so the search may begin at the next one.
    fn find_checked(&self, stop: &str) -> Option<usize> {
        let mut from = (self.unchecked + 1).saturating_sub(stop.len());
        while !self.held.is_char_boundary(from) {
            from += 1;
        }
        self.held.get(from..)?.find(stop).map(|at| from + at)
    }

    /// Start of the longest suffix of `held` that is a proper prefix of some stop string
    /// (`held.len()` when there is none). Such a suffix starts on a character boundary
    /// because stop strings start with one.
    fn partial_match_start(&self) -> usize {
        let held = self.held.as_bytes();
        let longest = self.stops.iter().map(|s| s.len() - 1).max().unwrap_or(0);
        let first = held.len().saturating_sub(longest);
        (first..held.len())
            .find(|&start| {
                let tail = &held[start..];
                self.held.is_char_boundary(start)
                    && self.stops.iter().any(|s| s.len() > tail.len() && s.as_bytes().starts_with(tail))
            })
            .unwrap_or(held.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha8Rng;
    use rand_core::{Rng, SeedableRng};

    /// The reference: scan the whole text for the first position where a stop string ends;
    /// the text up to its start, or (`include`) its end.
    fn whole_text(text: &str, stops: &[String], include: bool) -> (String, bool) {
        whole_text_after(text, stops, include, 0)
    }

    /// `whole_text` where only stop strings ending past byte `unchecked` count.
    fn whole_text_after(text: &str, stops: &[String], include: bool, unchecked: usize) -> (String, bool) {
        for end in (unchecked + 1..=text.len()).filter(|&e| text.is_char_boundary(e)) {
            let longest = stops.iter().filter(|s| !s.is_empty() && text.as_bytes()[..end].ends_with(s.as_bytes()));
            if let Some(s) = longest.max_by_key(|s| s.len()) {
                return (text[..if include { end } else { end - s.len() }].to_owned(), true);
            }
        }
        (text.to_owned(), false)
    }

    fn pieces(text: &str, stops: &[String], cuts: &[usize]) -> (String, bool) {
        pieces_with(text, stops, cuts, false, 0)
    }

    /// `text` fed in pieces cut at `cuts` (and at `unchecked`), those before byte `unchecked`
    /// through `push_unchecked`: the text out and whether a stop string ended it.
    fn pieces_with(text: &str, stops: &[String], cuts: &[usize], include: bool, unchecked: usize) -> (String, bool) {
        let mut m = StopMatcher::new(stops).including_stop(include);
        let mut out = String::new();
        let mut last = 0;
        let mut ends: Vec<usize> = cuts.iter().copied().chain([unchecked, text.len()]).collect();
        ends.sort_unstable();
        ends.dedup();
        for cut in ends {
            let piece = &text[last..cut];
            last = cut;
            if cut <= unchecked {
                out.push_str(&m.push_unchecked(piece));
                continue;
            }
            match m.push(piece) {
                StopStep::Continue(s) => out.push_str(&s),
                StopStep::Stopped(s) => {
                    out.push_str(&s);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    /// 1 to `max` characters of a small alphabet, which makes partial matches, overlaps and
    /// repeats common.
    fn word(rng: &mut ChaCha8Rng, max: u32) -> String {
        let alphabet: Vec<char> = "abé\n".chars().collect();
        let len = 1 + rng.next_u32() % max;
        (0..len).map(|_| alphabet[(rng.next_u32() as usize) % alphabet.len()]).collect()
    }

    fn random_cuts(rng: &mut ChaCha8Rng, text: &str) -> Vec<usize> {
        let mut cuts: Vec<usize> =
            (1..text.len()).filter(|&i| text.is_char_boundary(i) && rng.next_u32() & 3 == 0).collect();
        cuts.dedup();
        cuts
    }

    #[test]
    fn random_splits_match_whole_text() {
        let mut rng = ChaCha8Rng::seed_from_u64(0x5709);
        let mut stopped = 0;
        for _ in 0..3000 {
            let text = word(&mut rng, 40);
            let stops: Vec<String> = (0..1 + rng.next_u32() % 4).map(|_| word(&mut rng, 5)).collect();
            let want = whole_text(&text, &stops, false);
            stopped += want.1 as usize;
            for include in [false, true] {
                let want = whole_text(&text, &stops, include);
                for _ in 0..2 {
                    let cuts = random_cuts(&mut rng, &text);
                    let got = pieces_with(&text, &stops, &cuts, include, 0);
                    assert_eq!(got, want, "text {text:?} stops {stops:?} cuts {cuts:?} include {include}");
                }
            }
        }
        // Both outcomes must be exercised for the comparison to mean something.
        assert!(stopped > 300 && stopped < 2700, "stopped {stopped} of 3000");
    }

    /// `min_tokens`: text pushed unchecked ends nothing, but a stop string that ends after it
    /// counts even when it began inside it, however the text is split.
    #[test]
    fn unchecked_text_ends_nothing_but_can_start_a_stop() {
        let mut rng = ChaCha8Rng::seed_from_u64(0x3170);
        let (mut straddled, mut skipped) = (0, 0);
        for _ in 0..3000 {
            let text = word(&mut rng, 30);
            let stops: Vec<String> = (0..1 + rng.next_u32() % 3).map(|_| word(&mut rng, 4)).collect();
            let bounds: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
            let unchecked = bounds[rng.next_u32() as usize % bounds.len()];
            let want = whole_text_after(&text, &stops, false, unchecked);
            let early = whole_text(&text, &stops, false);
            skipped += (early.1 && early.0.len() + 1 < unchecked) as usize;
            straddled += (want.1 && want.0.len() < unchecked) as usize;
            let cuts = random_cuts(&mut rng, &text);
            assert_eq!(
                pieces_with(&text, &stops, &cuts, false, unchecked),
                want,
                "{text:?} {stops:?} {cuts:?} {unchecked}"
            );
        }
        // Both cases the unchecked text makes must be exercised.
        assert!(skipped > 100 && straddled > 50, "skipped {skipped}, straddled {straddled}");
        // And by hand: "bc" ends inside the unchecked text ("abc"), "cdx" straddles its end.
        let stops = vec!["bc".to_owned(), "cdx".to_owned()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push_unchecked("ab"), "a");
        assert_eq!(m.push_unchecked("c"), "b");
        assert_eq!(m.push("dx!"), StopStep::Stopped(String::new()));
        assert_eq!(m.matched(), Some("cdx"));
    }

    #[test]
    fn holds_back_a_possible_stop_until_decided() {
        let stops = vec!["END".to_owned()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("abcE"), StopStep::Continue("abc".into()));
        assert_eq!(m.push("N"), StopStep::Continue(String::new()));
        // "ENx" cannot become "END": released whole.
        assert_eq!(m.push("x"), StopStep::Continue("ENx".into()));
        assert_eq!(m.push("yE"), StopStep::Continue("y".into()));
        assert_eq!(m.matched(), None);
        assert_eq!(m.push("ND tail"), StopStep::Stopped(String::new()));
        assert_eq!(m.matched(), Some("END"));
        assert_eq!(m.push("more"), StopStep::Stopped(String::new()));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn unfinished_stop_is_released_at_the_end() {
        let stops = vec!["</answer>".to_owned()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("42 </ans"), StopStep::Continue("42 ".into()));
        assert_eq!(m.finish(), "</ans");
    }

    #[test]
    fn first_completed_stop_wins() {
        let stops = vec!["cd".to_owned(), "bcdx".to_owned(), "b".to_owned()];
        assert_eq!(pieces("abcdx", &stops, &[2, 3]), ("a".to_owned(), true));
        // "abcd" started first, but "bc" completed first.
        let stops = vec!["abcd".to_owned(), "bc".to_owned()];
        assert_eq!(pieces("abcd", &stops, &[]), ("a".to_owned(), true));
        // Both end together: the longer one is cut.
        let stops = vec!["xyz".to_owned(), "yz".to_owned()];
        assert_eq!(pieces("wxyz", &stops, &[2, 3]), ("w".to_owned(), true));
    }

    #[test]
    fn no_stops_passes_text_through() {
        let mut m = StopMatcher::new(&[String::new()]);
        assert!(m.is_empty());
        assert_eq!(m.push("abc"), StopStep::Continue("abc".into()));
    }
}
