//! The incremental tool-call parser: detokenized text deltas in, plain-text deltas, call
//! starts (name) and argument deltas out, as soon as they are known. Two syntaxes:
//!
//! - `Hermes` (Qwen2.5, Qwen3, and Tessera's fallback prompt format, docs/tools.md):
//!   `<tool_call>` + a JSON object `{"name": ..., "arguments": {...}}` + `</tool_call>`,
//!   anywhere in the output, any number of times.
//! - `Llama3Json` (Llama 3.1 / 3.2): the output *starts* with a JSON object
//!   `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>` when it is
//!   kept as text); further objects may follow, separated by whitespace or `;`.
//!
//! In both, `"arguments"` and `"parameters"` are accepted, keys in any order.
//!
//! Guarantees (tested in `tests` below and in gateway/tests/tools.rs):
//! - Linear time: every input byte is looked at a bounded number of times (at most twice:
//!   once by the JSON scanner, once more as text if a call turns out not to be one).
//! - Bounded buffering: plain text is held back only while it could still be the start of
//!   `<tool_call>` (at most 10 bytes), or whitespace between calls (dropped, at most
//!   `MAX_HELD`); a call is buffered only until its name is known, at most `MAX_PENDING`
//!   bytes. Argument text is passed on as it arrives.
//! - Split invariance: the events, with adjacent deltas merged, do not depend on how the
//!   text was cut into deltas.
//!
//! When something is a call (decided, never undone):
//! - A call is *committed* (its `Start` is emitted) when its `"name"` string is complete and
//!   names one of the offered tools. Until then the call's text is held; if the JSON breaks,
//!   the object closes without a name, the name is not an offered tool, or `MAX_PENDING` is
//!   passed, the held text comes back as plain text (the model wrote something that is not
//!   a call) and parsing goes on after it.
//! - After the commit, the arguments stream out. If the JSON breaks midway, the call ends
//!   there (its arguments are what was received, not valid JSON) and the rest is plain text;
//!   if the output ends first (`max_tokens`), the call ends with the arguments received.
//!   `ParsedCall::complete` tells these cases apart. A call with no `arguments` key gets `{}`.

use super::json_scan::{JsonScanner, Mark};

pub const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
/// A call's text held before its name is known.
pub const MAX_PENDING: usize = 64 * 1024;
/// Whitespace held after a call (dropped if another call or the end follows).
pub const MAX_HELD: usize = 4096;
/// Keys and names longer than this are not captured (such a name is never a tool's).
const MAX_NAME: usize = 256;

/// The tool-call syntax of a model family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    Hermes,
    Llama3Json,
}

/// What the parser produces, in output order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    Text(String),
    /// Call number `index` (0, 1, ... in this output) to tool `name` begins.
    Start {
        index: usize,
        name: String,
    },
    /// More of the JSON text of call `index`'s arguments.
    Args {
        index: usize,
        delta: String,
    },
    /// Call `index` is over; `complete` when its JSON object closed properly.
    End {
        index: usize,
        complete: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Member {
    None,
    Name,
    Args,
    Other,
}

/// A call being read.
struct Call {
    scan: JsonScanner,
    /// Until the commit: every byte of the call's text, for the fallback to plain text.
    raw: Vec<u8>,
    committed: bool,
    member: Member,
    key: Vec<u8>,
    capturing_key: bool,
    name_raw: Vec<u8>,
    capturing_name: bool,
    name: Option<String>,
    /// Arguments text seen before the commit.
    args_pending: Vec<u8>,
    in_args: bool,
    saw_args: bool,
}

impl Call {
    fn new(prefix: &str) -> Self {
        Call {
            scan: JsonScanner::new(),
            raw: prefix.as_bytes().to_vec(),
            committed: false,
            member: Member::None,
            key: Vec::new(),
            capturing_key: false,
            name_raw: Vec::new(),
            capturing_name: false,
            name: None,
            args_pending: Vec::new(),
            in_args: false,
            saw_args: false,
        }
    }
}

enum Mode {
    /// Plain text; `held` may be the start of `<tool_call>` (Hermes), `after_call` holds
    /// whitespace that follows a call.
    Text {
        held: String,
        after_call: bool,
        ws: String,
    },
    /// Llama: at the start of the output (or after a call): whitespace, `;` or
    /// `<|python_tag|>` held; `{` begins a call, anything else is plain text for good.
    LlamaLead {
        held: String,
        after_call: bool,
    },
    /// Llama, once plain text was seen: no more calls.
    PlainForever,
    Call(Box<Call>),
    /// Hermes: after a call's object, whitespace then `</tool_call>` (both dropped).
    Closing {
        held: String,
    },
}

pub struct ToolCallParser {
    syntax: ToolSyntax,
    names: Vec<String>,
    mode: Mode,
    calls: usize,
    out: Vec<ToolEvent>,
}

impl ToolCallParser {
    /// `names`: the offered tools; a call to any other name is plain text.
    pub fn new(syntax: ToolSyntax, names: Vec<String>) -> Self {
        let mode = match syntax {
            ToolSyntax::Hermes => Mode::Text { held: String::new(), after_call: false, ws: String::new() },
            ToolSyntax::Llama3Json => Mode::LlamaLead { held: String::new(), after_call: false },
        };
        ToolCallParser { syntax, names, mode, calls: 0, out: Vec::new() }
    }

    /// Calls committed so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Feeds one text delta; returns the events it completes (adjacent deltas merged).
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        let mut pos = 0;
        while pos < text.len() {
            pos = self.step(text, pos);
        }
        std::mem::take(&mut self.out)
    }

    /// The end of the output: releases held text and ends an open call.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mode = std::mem::replace(&mut self.mode, Mode::PlainForever);
        match mode {
            Mode::Text { held, after_call: _, ws: _ } => self.text(held),
            Mode::LlamaLead { held, after_call } if !after_call => self.text(held),
            Mode::LlamaLead { .. } | Mode::PlainForever | Mode::Closing { .. } => {}
            Mode::Call(call) if call.committed => {
                self.out.push(ToolEvent::End { index: self.calls - 1, complete: false });
            }
            Mode::Call(call) => self.text(String::from_utf8_lossy(&call.raw).into_owned()),
        }
        std::mem::take(&mut self.out)
    }

    /// Consumes some of `text[pos..]` in the current mode; returns the new position.
    fn step(&mut self, text: &str, pos: usize) -> usize {
        match &mut self.mode {
            Mode::Text { .. } => self.step_text(text, pos),
            Mode::LlamaLead { .. } => self.step_lead(text, pos),
            Mode::PlainForever => {
                self.text(text[pos..].to_owned());
                text.len()
            }
            Mode::Call(_) => self.step_call(text, pos),
            Mode::Closing { .. } => self.step_closing(text, pos),
        }
    }

    fn step_text(&mut self, text: &str, pos: usize) -> usize {
        let Mode::Text { held, after_call, ws } = &mut self.mode else { return pos };
        let held_len = held.len();
        let mut s = std::mem::take(held);
        s.push_str(&text[pos..]);
        let (emit, next) = match s.find(OPEN) {
            Some(k) => {
                // The tag ends past the held part (which holds no whole tag).
                let end_in_text = pos + (k + OPEN.len() - held_len);
                (k, Some(end_in_text))
            }
            None => {
                let keep = partial_suffix(&s, OPEN);
                *held = s[s.len() - keep..].to_owned();
                (s.len() - keep, None)
            }
        };
        let plain = &s[..emit];
        let mut released = String::new();
        if *after_call {
            if plain.bytes().all(|b| b.is_ascii_whitespace()) && ws.len() + plain.len() <= MAX_HELD {
                ws.push_str(plain);
            } else {
                released = std::mem::take(ws);
                released.push_str(plain);
                *after_call = false;
            }
        } else {
            released.push_str(plain);
        }
        self.text(released);
        match next {
            Some(end) => {
                self.mode = Mode::Call(Box::new(Call::new(OPEN)));
                end
            }
            None => text.len(),
        }
    }

    fn step_lead(&mut self, text: &str, pos: usize) -> usize {
        let Mode::LlamaLead { held, after_call } = &mut self.mode else { return pos };
        let bytes = text.as_bytes();
        for (i, &b) in bytes.iter().enumerate().skip(pos) {
            // A `<|python_tag|>` being spelled out: the held text from its `<` on.
            let partial = held.rfind('<').map(|t| &held[t..]).filter(|t| t.len() < PYTHON_TAG.len());
            if let Some(partial) = partial {
                if b.is_ascii() && PYTHON_TAG.as_bytes().get(partial.len()) == Some(&b) {
                    held.push(b as char);
                    continue;
                }
                return self.lead_to_plain(text, i);
            }
            let separator = b.is_ascii_whitespace() || b == b'<' || (b == b';' && *after_call);
            if separator && held.len() < MAX_HELD {
                held.push(b as char);
                continue;
            }
            if b == b'{' {
                let prefix = if *after_call { String::new() } else { std::mem::take(held) };
                self.mode = Mode::Call(Box::new(Call::new(&prefix)));
                return i;
            }
            return self.lead_to_plain(text, i);
        }
        text.len()
    }

    /// Llama: the lead turned out to be plain text; releases what was held (unless it only
    /// separated calls) and stays plain from `i` on.
    fn lead_to_plain(&mut self, text: &str, i: usize) -> usize {
        if let Mode::LlamaLead { held, after_call } = std::mem::replace(&mut self.mode, Mode::PlainForever) {
            if !after_call || !held.bytes().all(|b| b.is_ascii_whitespace() || b == b';') {
                self.text(held);
            }
        }
        self.text(text[i..].to_owned());
        text.len()
    }

    fn step_closing(&mut self, text: &str, pos: usize) -> usize {
        let Mode::Closing { held } = &mut self.mode else { return pos };
        let bytes = text.as_bytes();
        let mut i = pos;
        while i < text.len() {
            let b = bytes[i];
            let tag = held.find('<').map_or("", |t| &held[t..]);
            if tag.is_empty() && b.is_ascii_whitespace() && held.len() < MAX_HELD {
                held.push(b as char);
                i += 1;
                continue;
            }
            let mut cand = tag.to_owned();
            cand.push(b as char);
            if b.is_ascii() && CLOSE.starts_with(&cand) {
                held.push(b as char);
                i += 1;
                if cand.len() == CLOSE.len() {
                    self.mode = Mode::Text { held: String::new(), after_call: true, ws: String::new() };
                    return i;
                }
                continue;
            }
            // No closing tag: the held whitespace (and partial tag) is plain text after a call.
            let held = std::mem::take(held);
            self.mode = Mode::Text { held: String::new(), after_call: true, ws: String::new() };
            if held.contains('<') {
                self.text(held);
                if let Mode::Text { after_call, .. } = &mut self.mode {
                    *after_call = false;
                }
            } else if let Mode::Text { ws, .. } = &mut self.mode {
                *ws = held;
            }
            return i;
        }
        text.len()
    }

    fn step_call(&mut self, text: &str, pos: usize) -> usize {
        let bytes = text.as_bytes();
        let index = self.calls.saturating_sub(1);
        let Mode::Call(call) = &mut self.mode else { return pos };
        // Start of the argument text of this delta not yet emitted (committed calls only).
        let mut args_from = (call.committed && call.in_args).then_some(pos);
        let mut end = None;
        let mut i = pos;
        while i < text.len() && end.is_none() {
            let b = bytes[i];
            let Ok(marks) = call.scan.step(b) else {
                end = Some(Outcome::Broken(i));
                break;
            };
            if !call.committed {
                call.raw.push(b);
                // Released at the first character boundary past the limit: `at` slices
                // the delta, and a multi-byte character's continuation bytes are not one.
                if call.raw.len() > MAX_PENDING && text.is_char_boundary(i + 1) {
                    end = Some(Outcome::Broken(i + 1));
                }
            }
            if call.capturing_key {
                push_capped(&mut call.key, b);
            }
            if call.capturing_name {
                push_capped(&mut call.name_raw, b);
            }
            if call.in_args && !call.committed {
                call.args_pending.push(b);
            }
            for (mark, depth) in marks.iter() {
                match (mark, depth) {
                    (Mark::ValueStart, 0) if b != b'{' => end = Some(Outcome::Broken(i + 1)),
                    (Mark::KeyStart, 1) => {
                        call.key.clear();
                        call.key.push(b);
                        call.capturing_key = true;
                    }
                    (Mark::KeyEnd, 1) => {
                        call.capturing_key = false;
                        call.member = match serde_json::from_slice::<String>(&call.key).as_deref() {
                            Ok("name") if call.name.is_none() => Member::Name,
                            Ok("arguments" | "parameters") if !call.saw_args => Member::Args,
                            _ => Member::Other,
                        };
                    }
                    (Mark::ValueStart, 1) => match call.member {
                        Member::Name if b == b'"' => {
                            call.name_raw.clear();
                            call.name_raw.push(b);
                            call.capturing_name = true;
                        }
                        Member::Name => end = Some(Outcome::Broken(i + 1)),
                        Member::Args => {
                            call.in_args = true;
                            call.saw_args = true;
                            if call.committed {
                                args_from = Some(i);
                            } else {
                                call.args_pending.push(b);
                            }
                        }
                        _ => {}
                    },
                    (Mark::ValueEnd | Mark::ValueEndedBefore, 1) => {
                        if call.capturing_name {
                            call.capturing_name = false;
                            let name = serde_json::from_slice::<String>(&call.name_raw).ok();
                            match name.filter(|n| self.names.iter().any(|t| t == n)) {
                                Some(name) => {
                                    call.name = Some(name);
                                    end = Some(Outcome::Commit(i + 1));
                                }
                                None => end = Some(Outcome::Broken(i + 1)),
                            }
                        } else if call.in_args {
                            call.in_args = false;
                            let cut = if mark == Mark::ValueEnd { i + 1 } else { i };
                            if mark == Mark::ValueEndedBefore && !call.committed {
                                // The byte that ended the number is not part of it.
                                call.args_pending.pop();
                            }
                            if let Some(from) = args_from.take() {
                                emit_args(&mut self.out, index, &text[from..cut]);
                            }
                        }
                        call.member = Member::None;
                    }
                    (Mark::ValueEnd, 0) => end = Some(Outcome::Closed(i + 1)),
                    _ => {}
                }
            }
            i += 1;
        }
        // Argument text up to where this delta's work stopped.
        let stop = match end {
            Some(Outcome::Broken(at)) => at.min(i),
            _ => i,
        };
        if let Some(from) = args_from {
            emit_args(&mut self.out, index, &text[from..stop.max(from)]);
        }
        match end {
            None => text.len(),
            Some(Outcome::Broken(at)) => self.break_call(at),
            Some(Outcome::Commit(at)) => {
                self.commit();
                at
            }
            Some(Outcome::Closed(at)) => self.close_call(at),
        }
    }

    /// The name is known and offered: `Start`, then any arguments seen before it.
    fn commit(&mut self) {
        let Mode::Call(call) = &mut self.mode else { return };
        call.committed = true;
        call.raw = Vec::new();
        let name = call.name.clone().unwrap_or_default();
        let pending = std::mem::take(&mut call.args_pending);
        let index = self.calls;
        self.calls += 1;
        self.out.push(ToolEvent::Start { index, name });
        if !pending.is_empty() {
            self.args(index, String::from_utf8_lossy(&pending).into_owned());
        }
    }

    /// The JSON broke at `at` (or the call was refused there): an uncommitted call is plain
    /// text (`raw` holds exactly the bytes before `at`); a committed one ends. Parsing
    /// resumes at `at`.
    fn break_call(&mut self, at: usize) -> usize {
        let resume = match self.syntax {
            ToolSyntax::Hermes => Mode::Text { held: String::new(), after_call: false, ws: String::new() },
            ToolSyntax::Llama3Json => Mode::PlainForever,
        };
        let Mode::Call(call) = std::mem::replace(&mut self.mode, resume) else { return at };
        if call.committed {
            self.out.push(ToolEvent::End { index: self.calls - 1, complete: false });
        } else {
            self.text(String::from_utf8_lossy(&call.raw).into_owned());
        }
        at
    }

    /// The call's object closed at `at`.
    fn close_call(&mut self, at: usize) -> usize {
        let committed = matches!(&self.mode, Mode::Call(c) if c.committed);
        if !committed {
            // An object without an offered tool's name: plain text.
            let resume = match self.syntax {
                ToolSyntax::Hermes => Mode::Text { held: String::new(), after_call: false, ws: String::new() },
                ToolSyntax::Llama3Json => Mode::PlainForever,
            };
            if let Mode::Call(call) = std::mem::replace(&mut self.mode, resume) {
                self.text(String::from_utf8_lossy(&call.raw).into_owned());
            }
            return at;
        }
        let saw_args = matches!(&self.mode, Mode::Call(c) if c.saw_args);
        let index = self.calls - 1;
        if !saw_args {
            self.args(index, "{}".to_owned());
        }
        self.out.push(ToolEvent::End { index, complete: true });
        self.mode = match self.syntax {
            ToolSyntax::Hermes => Mode::Closing { held: String::new() },
            ToolSyntax::Llama3Json => Mode::LlamaLead { held: String::new(), after_call: true },
        };
        at
    }

    fn text(&mut self, s: String) {
        if s.is_empty() {
            return;
        }
        if let Some(ToolEvent::Text(last)) = self.out.last_mut() {
            last.push_str(&s);
        } else {
            self.out.push(ToolEvent::Text(s));
        }
    }

    fn args(&mut self, index: usize, s: String) {
        emit_args(&mut self.out, index, &s);
    }
}

fn emit_args(out: &mut Vec<ToolEvent>, index: usize, s: &str) {
    if s.is_empty() {
        return;
    }
    if let Some(ToolEvent::Args { index: i, delta }) = out.last_mut() {
        if *i == index {
            delta.push_str(s);
            return;
        }
    }
    out.push(ToolEvent::Args { index, delta: s.to_owned() });
}

enum Outcome {
    /// Not a call (or a committed call broke): `raw` holds the bytes before this position.
    Broken(usize),
    /// The name ended just before this position: commit and go on from there.
    Commit(usize),
    /// The object closed just before this position.
    Closed(usize),
}

fn push_capped(buf: &mut Vec<u8>, b: u8) {
    if buf.len() <= MAX_NAME {
        buf.push(b);
    }
}

/// The length of the longest proper prefix of `tag` that `s` ends with.
fn partial_suffix(s: &str, tag: &str) -> usize {
    let max = (tag.len() - 1).min(s.len());
    (1..=max).rev().find(|&k| s.is_char_boundary(s.len() - k) && tag.starts_with(&s[s.len() - k..])).unwrap_or(0)
}
