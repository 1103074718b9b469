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
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match before any text).
    pub fn new(stops: &[String]) -> Self {
        let stops = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        StopMatcher { stops, held: String::new(), stopped: false, matched: None, include: false }
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
        let keep_from = self.partial_match_start();
        let rest = self.held.split_off(keep_from);
        StopStep::Continue(std::mem::replace(&mut self.held, rest))
    }

    /// Ends the text: whatever was held back could not become a stop string.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }

    /// Start in `held` of the stop string that completes first, and that string.
    fn earliest_match(&self) -> Option<(usize, String)> {
        let found = self.stops.iter().filter_map(|s| self.held.find(s.as_str()).map(|at| (at + s.len(), at, s)));
        found.min().map(|(_, start, s)| (start, s.clone()))
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
        for end in (1..=text.len()).filter(|&e| text.is_char_boundary(e)) {
            let longest = stops.iter().filter(|s| !s.is_empty() && text.as_bytes()[..end].ends_with(s.as_bytes()));
            if let Some(s) = longest.max_by_key(|s| s.len()) {
                return (text[..if include { end } else { end - s.len() }].to_owned(), true);
            }
        }
        (text.to_owned(), false)
    }

    fn pieces(text: &str, stops: &[String], cuts: &[usize]) -> (String, bool) {
        pieces_with(text, stops, cuts, false)
    }

    fn pieces_with(text: &str, stops: &[String], cuts: &[usize], include: bool) -> (String, bool) {
        let mut m = StopMatcher::new(stops).including_stop(include);
        let mut out = String::new();
        let mut last = 0;
        for &cut in cuts.iter().chain(std::iter::once(&text.len())) {
            match m.push(&text[last..cut]) {
                StopStep::Continue(s) => out.push_str(&s),
                StopStep::Stopped(s) => {
                    out.push_str(&s);
                    return (out, true);
                }
            }
            last = cut;
        }
        out.push_str(&m.finish());
        (out, false)
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
        // A small alphabet makes partial matches, overlaps and repeats common.
        let alphabet: Vec<char> = "abé\n".chars().collect();
        let word = |rng: &mut ChaCha8Rng, max: u32| -> String {
            let len = 1 + rng.next_u32() % max;
            (0..len).map(|_| alphabet[(rng.next_u32() as usize) % alphabet.len()]).collect()
        };
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
                    let got = pieces_with(&text, &stops, &cuts, include);
                    assert_eq!(got, want, "text {text:?} stops {stops:?} cuts {cuts:?} include {include}");
                }
            }
        }
        // Both outcomes must be exercised for the comparison to mean something.
        assert!(stopped > 300 && stopped < 2700, "stopped {stopped} of 3000");
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
