//! An incremental JSON scanner: one byte at a time, O(1) work per byte, a stack as deep as
//! the nesting (capped at `MAX_DEPTH`), no backtracking. It validates one JSON value (RFC 8259)
//! and reports where keys and values begin and end, with the depth of the container they sit
//! in (the top-level value is at depth 0, the members of a top-level object at depth 1).
//! The tool-call parser uses it to find a call's `name` and to stream its `arguments` text as
//! it arrives, without ever buffering or re-reading the whole call.
//!
//! Non-ASCII bytes are only valid inside strings, so every boundary it reports (a key or a
//! value starting or ending) falls on an ASCII byte or just before one: slicing the input
//! there is always on a UTF-8 character boundary.

/// Deeper nesting is an error (serde_json refuses the same depth).
pub const MAX_DEPTH: usize = 128;

/// Where a reported boundary lies relative to the byte just fed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mark {
    /// A key string starts at this byte (its opening quote).
    KeyStart,
    /// A key string ends at this byte (its closing quote).
    KeyEnd,
    /// A value starts at this byte.
    ValueStart,
    /// A value ends at this byte (a string's quote, a container's bracket, a literal's last
    /// letter).
    ValueEnd,
    /// A number ended just before this byte (numbers have no closing character).
    ValueEndedBefore,
}

/// The boundaries one byte produced, each with its depth; at most two (a number ending before
/// the `}` that closes its object).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Marks {
    pub first: Option<(Mark, usize)>,
    pub second: Option<(Mark, usize)>,
}

impl Marks {
    fn push(&mut self, mark: Mark, depth: usize) {
        if self.first.is_none() {
            self.first = Some((mark, depth));
        } else {
            self.second = Some((mark, depth));
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (Mark, usize)> {
        self.first.into_iter().chain(self.second)
    }
}

/// The byte is not valid JSON at this point (or nests deeper than `MAX_DEPTH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frame {
    Object,
    Array,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpDigits,
}

impl Num {
    /// Whether the number may end here.
    fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::ExpDigits)
    }

    fn next(self, b: u8) -> Option<Num> {
        Some(match (self, b) {
            (Num::Minus, b'0') => Num::Zero,
            (Num::Minus, b'1'..=b'9') => Num::Int,
            (Num::Int, b'0'..=b'9') => Num::Int,
            (Num::Zero | Num::Int, b'.') => Num::Dot,
            (Num::Dot | Num::Frac, b'0'..=b'9') => Num::Frac,
            (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Num::Exp,
            (Num::Exp, b'+' | b'-') => Num::ExpSign,
            (Num::Exp | Num::ExpSign | Num::ExpDigits, b'0'..=b'9') => Num::ExpDigits,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lex {
    /// A value is expected (top level, after `:`, after `,` in an array).
    Value,
    /// After `[`: a value or `]`.
    ValueOrClose,
    /// After `{`: a key or `}`.
    KeyOrClose,
    /// After `,` in an object.
    Key,
    /// After a key.
    Colon,
    /// After a value inside a container.
    CommaOrClose,
    /// Inside a string; `hex` counts the digits still due after `\u`.
    Str {
        key: bool,
        escape: bool,
        hex: u8,
    },
    Num(Num),
    /// Inside `true` / `false` / `null`: the word and how many letters were seen.
    Lit {
        word: &'static [u8],
        seen: u8,
    },
    /// The top-level value is complete.
    Done,
}

#[derive(Debug, Clone)]
pub struct JsonScanner {
    stack: Vec<Frame>,
    lex: Lex,
}

impl Default for JsonScanner {
    fn default() -> Self {
        Self::new()
    }
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl JsonScanner {
    pub fn new() -> Self {
        JsonScanner { stack: Vec::new(), lex: Lex::Value }
    }

    /// Whether the top-level value is complete (bytes after it are not JSON's business).
    pub fn is_done(&self) -> bool {
        self.lex == Lex::Done
    }

    /// Feeds one byte. After an error or once done, further bytes are errors.
    pub fn step(&mut self, b: u8) -> Result<Marks, ScanError> {
        let mut marks = Marks::default();
        if let Lex::Num(n) = self.lex {
            if let Some(next) = n.next(b) {
                self.lex = Lex::Num(next);
                return Ok(marks);
            }
            if !n.complete() {
                return Err(ScanError);
            }
            marks.push(Mark::ValueEndedBefore, self.stack.len());
            self.after_value();
            if self.lex == Lex::Done {
                // A top-level number: this byte is not part of the value.
                return Ok(marks);
            }
        }
        let depth = self.stack.len();
        match self.lex {
            Lex::Str { key, escape, hex } => {
                if hex > 0 {
                    if !b.is_ascii_hexdigit() {
                        return Err(ScanError);
                    }
                    self.lex = Lex::Str { key, escape: false, hex: hex - 1 };
                } else if escape {
                    let hex = match b {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => 0,
                        b'u' => 4,
                        _ => return Err(ScanError),
                    };
                    self.lex = Lex::Str { key, escape: false, hex };
                } else if b == b'\\' {
                    self.lex = Lex::Str { key, escape: true, hex: 0 };
                } else if b == b'"' {
                    if key {
                        marks.push(Mark::KeyEnd, depth);
                        self.lex = Lex::Colon;
                    } else {
                        marks.push(Mark::ValueEnd, depth);
                        self.after_value();
                    }
                } else if b < 0x20 {
                    return Err(ScanError);
                }
            }
            Lex::Lit { word, seen } => {
                if word.get(seen as usize) != Some(&b) {
                    return Err(ScanError);
                }
                if seen as usize + 1 == word.len() {
                    marks.push(Mark::ValueEnd, depth);
                    self.after_value();
                } else {
                    self.lex = Lex::Lit { word, seen: seen + 1 };
                }
            }
            _ if is_ws(b) && self.lex != Lex::Done => {}
            Lex::Value | Lex::ValueOrClose => {
                if self.lex == Lex::ValueOrClose && b == b']' {
                    self.stack.pop();
                    marks.push(Mark::ValueEnd, depth - 1);
                    self.after_value();
                } else {
                    self.start_value(b, depth, &mut marks)?;
                }
            }
            Lex::KeyOrClose | Lex::Key => {
                if b == b'"' {
                    marks.push(Mark::KeyStart, depth);
                    self.lex = Lex::Str { key: true, escape: false, hex: 0 };
                } else if b == b'}' && self.lex == Lex::KeyOrClose {
                    self.stack.pop();
                    marks.push(Mark::ValueEnd, depth - 1);
                    self.after_value();
                } else {
                    return Err(ScanError);
                }
            }
            Lex::Colon => {
                if b != b':' {
                    return Err(ScanError);
                }
                self.lex = Lex::Value;
            }
            Lex::CommaOrClose => match (b, self.stack.last()) {
                (b',', Some(Frame::Object)) => self.lex = Lex::Key,
                (b',', Some(Frame::Array)) => self.lex = Lex::Value,
                (b'}', Some(Frame::Object)) | (b']', Some(Frame::Array)) => {
                    self.stack.pop();
                    marks.push(Mark::ValueEnd, depth - 1);
                    self.after_value();
                }
                _ => return Err(ScanError),
            },
            Lex::Num(_) | Lex::Done => return Err(ScanError),
        }
        Ok(marks)
    }

    fn start_value(&mut self, b: u8, depth: usize, marks: &mut Marks) -> Result<(), ScanError> {
        self.lex = match b {
            b'{' | b'[' => {
                if depth >= MAX_DEPTH {
                    return Err(ScanError);
                }
                marks.push(Mark::ValueStart, depth);
                if b == b'{' {
                    self.stack.push(Frame::Object);
                    Lex::KeyOrClose
                } else {
                    self.stack.push(Frame::Array);
                    Lex::ValueOrClose
                }
            }
            b'"' => {
                marks.push(Mark::ValueStart, depth);
                Lex::Str { key: false, escape: false, hex: 0 }
            }
            b'-' => {
                marks.push(Mark::ValueStart, depth);
                Lex::Num(Num::Minus)
            }
            b'0' => {
                marks.push(Mark::ValueStart, depth);
                Lex::Num(Num::Zero)
            }
            b'1'..=b'9' => {
                marks.push(Mark::ValueStart, depth);
                Lex::Num(Num::Int)
            }
            b't' | b'f' | b'n' => {
                marks.push(Mark::ValueStart, depth);
                let word: &'static [u8] = match b {
                    b't' => b"true",
                    b'f' => b"false",
                    _ => b"null",
                };
                Lex::Lit { word, seen: 1 }
            }
            _ => return Err(ScanError),
        };
        Ok(())
    }

    fn after_value(&mut self) {
        self.lex = if self.stack.is_empty() { Lex::Done } else { Lex::CommaOrClose };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha8Rng;
    use rand_core::{Rng, SeedableRng};

    /// Whether the scanner accepts `text` as one complete value (trailing whitespace allowed).
    fn accepts(text: &str) -> bool {
        let mut s = JsonScanner::new();
        for &b in text.as_bytes() {
            if s.is_done() {
                if is_ws(b) {
                    continue;
                }
                return false;
            }
            match s.step(b) {
                Err(_) => return false,
                // A top-level number ended before `b`, which JSON then sees after the value.
                Ok(m) if m.first == Some((Mark::ValueEndedBefore, 0)) && !is_ws(b) => return false,
                Ok(_) => {}
            }
        }
        // A bare top-level number has no terminator: feed one space to end it.
        if !s.is_done() && s.step(b' ').is_err() {
            return false;
        }
        s.is_done()
    }

    /// Random JSON-ish text: mostly valid values, sometimes with one byte changed.
    fn random_value(rng: &mut ChaCha8Rng, depth: u32, out: &mut String) {
        let pick = rng.next_u32() % if depth > 3 { 5 } else { 7 };
        match pick {
            0 => out.push_str(["true", "false", "null"][(rng.next_u32() % 3) as usize]),
            1 => out.push_str(&format!("{}", (rng.next_u32() as i32) / 7)),
            2 => out.push_str(&format!("{:e}", f64::from(rng.next_u32()) / 1000.0 - 2e6)),
            3 | 4 => {
                let pieces = ["a", "\\\"", "\\\\", "\\u00e9", "é", "{", "}", "[", ",", ":", " ", "\\n", "🦀"];
                out.push('"');
                for _ in 0..rng.next_u32() % 6 {
                    out.push_str(pieces[(rng.next_u32() as usize) % pieces.len()]);
                }
                out.push('"');
            }
            5 => {
                out.push('[');
                for i in 0..rng.next_u32() % 4 {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    random_value(rng, depth + 1, out);
                }
                out.push(']');
            }
            _ => {
                out.push('{');
                for i in 0..rng.next_u32() % 4 {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&format!("\"k{i}\" : "));
                    random_value(rng, depth + 1, out);
                }
                out.push('}');
            }
        }
    }

    /// Agreement with serde_json on valid values and on random corruptions of them.
    #[test]
    fn agrees_with_serde_json() {
        let mut rng = ChaCha8Rng::seed_from_u64(0x15C4);
        let junk = [b'"', b'}', b']', b',', b':', b'\\', b'x', b'1', b'.', b'-', b'e', b' ', b'{', b'['];
        for round in 0..4000 {
            let mut text = String::new();
            random_value(&mut rng, 0, &mut text);
            if round % 2 == 1 && !text.is_empty() {
                let mut bytes = text.clone().into_bytes();
                let at = (rng.next_u32() as usize) % bytes.len();
                if bytes[at].is_ascii() {
                    bytes[at] = junk[(rng.next_u32() as usize) % junk.len()];
                }
                match String::from_utf8(bytes) {
                    Ok(t) => text = t,
                    Err(_) => continue,
                }
            }
            let reference = match serde_json::from_str::<serde_json::Value>(&text) {
                Ok(_) => true,
                // Valid JSON that does not fit an f64: not a syntax question.
                Err(e) if e.to_string().contains("number out of range") => continue,
                Err(_) => false,
            };
            assert_eq!(accepts(&text), reference, "{text:?}");
        }
    }

    #[test]
    fn reports_member_boundaries() {
        let text = r#"{"name": "f", "arguments": {"a": [1, {"b": "}"}], "c": -2.5e3}}"#;
        let mut s = JsonScanner::new();
        let mut seen = Vec::new();
        for (i, &b) in text.as_bytes().iter().enumerate() {
            for (mark, depth) in s.step(b).unwrap().iter() {
                if depth <= 1 {
                    seen.push((mark, depth, i));
                }
            }
        }
        let at = |pat: &str| text.find(pat).unwrap();
        let args_start = at("{\"a\"");
        let want = vec![
            (Mark::ValueStart, 0, 0),
            (Mark::KeyStart, 1, 1),
            (Mark::KeyEnd, 1, 6),
            (Mark::ValueStart, 1, 9),
            (Mark::ValueEnd, 1, 11),
            (Mark::KeyStart, 1, 14),
            (Mark::KeyEnd, 1, 24),
            (Mark::ValueStart, 1, args_start),
            (Mark::ValueEnd, 1, text.len() - 2),
            (Mark::ValueEnd, 0, text.len() - 1),
        ];
        assert_eq!(seen, want);
        assert!(s.is_done());
    }

    #[test]
    fn depth_is_capped() {
        let deep = "[".repeat(MAX_DEPTH + 1);
        let mut s = JsonScanner::new();
        let result: Result<Vec<_>, _> = deep.bytes().map(|b| s.step(b)).collect();
        assert_eq!(result, Err(ScanError));
    }
}
