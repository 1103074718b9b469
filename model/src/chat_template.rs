//! Rendering a model's own chat template (the Jinja source in GGUF `tokenizer.chat_template`
//! or `tokenizer_config.json`) into the prompt text, with MiniJinja configured the way
//! Hugging Face's `apply_chat_template` and llama.cpp's server run these templates:
//! `trim_blocks` and `lstrip_blocks` on, loop controls, Python string methods (`.strip()`,
//! `.startswith()`, ...), `raise_exception`, a Python-style `tojson`, `strftime_now`, and
//! the variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools`.
//!
//! Templates come with model files, so they are treated as untrusted: there is no loader
//! (no `include`/`import` of files), and a fuel budget bounds the work of one render, so a
//! template that loops forever fails with [`ChatTemplateError::OutOfFuel`] instead of
//! hanging the request.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{context, Environment, Error, ErrorKind, Value};
use serde::Serialize;

/// Default fuel for one render: roughly two million template instructions, or about
/// 128 MB of produced data; a long conversation through a large template needs a few
/// tens of thousands.
pub const DEFAULT_FUEL: u64 = 2_000_000;

const NAME: &str = "chat_template";

/// What can go wrong with a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    #[error("chat template raised an exception: {0}")]
    Raised(String),
    #[error("chat template ran out of fuel (more than {0} steps): it loops or is far too large")]
    OutOfFuel(u64),
    #[error("chat template failed to render: {0}")]
    Render(String),
}

/// One message of a conversation. `role` is usually "system", "user" or "assistant".
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }

    /// The message as the template sees it: a mapping with `role` and `content`.
    fn to_value(&self) -> Value {
        Value::from_pairs([("role", self.role.as_str()), ("content", self.content.as_str())])
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    fuel: u64,
    strip_bos: bool,
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token` / `eos_token` are the texts the template may print.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| ChatTemplateError::Syntax(e.to_string()))?,
        );
        env.set_fuel(Some(DEFAULT_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string()).map_err(|e| ChatTemplateError::Syntax(describe(&e)))?;
        Ok(Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            fuel: DEFAULT_FUEL,
            strip_bos: false,
        })
    }

    /// Sets the fuel budget of one render.
    pub fn with_fuel(mut self, fuel: u64) -> Self {
        self.env.set_fuel(Some(fuel));
        self.fuel = fuel;
        self
    }

    /// When the tokenizer adds BOS itself, a BOS text the template printed at the start is
    /// removed so the prompt does not get two (what llama.cpp's server does).
    pub fn with_tokenizer_adding_bos(mut self, adds_bos: bool) -> Self {
        self.strip_bos = adds_bos;
        self
    }

    /// The prompt for `messages`; with `add_generation_prompt` it ends with the header that
    /// opens the assistant's reply.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, ChatTemplateError> {
        let messages = messages.iter().map(ChatMessage::to_value).collect::<Vec<_>>();
        self.render_values(Value::from(messages), Value::from(()), add_generation_prompt)
    }

    /// The prompt for a conversation given as JSON, the way Hugging Face's
    /// `apply_chat_template` passes it to templates that handle tool calling: messages with
    /// `role`, `content`, `tool_calls` (`[{"id", "type": "function", "function": {"name",
    /// "arguments": {...}}}]`), `tool_call_id` and `name`; `tools` as
    /// `[{"type": "function", "function": {"name", "description", "parameters"}}]`.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let tools = tools.map_or(Value::from(()), json_value);
        self.render_values(json_value(messages), tools, add_generation_prompt)
    }

    /// The prompt of a probe conversation with one offered tool (`tessera_probe_tool`), an
    /// assistant call (`tessera_probe_call`) and its result (`tessera_probe_result`), when the
    /// template renders all three: then it handles tool calling itself, and the prompt shows
    /// the syntax it writes calls in. `None` otherwise.
    pub fn tool_probe(&self) -> Option<String> {
        let messages = serde_json::json!([
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "tessera_probe_call", "arguments": {"x": 1}}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "tessera_probe_call", "content": "tessera_probe_result"},
        ]);
        let tools = serde_json::json!([{"type": "function", "function": {"name": "tessera_probe_tool",
            "description": "probe", "parameters": {"type": "object", "properties": {}}}}]);
        let out = self.render_json(&messages, Some(&tools), true).ok()?;
        let markers = ["tessera_probe_tool", "tessera_probe_call", "tessera_probe_result"];
        markers.iter().all(|m| out.contains(m)).then_some(out)
    }

    fn render_values(
        &self,
        messages: Value,
        tools: Value,
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let template = self.env.get_template(NAME).map_err(|e| ChatTemplateError::Render(describe(&e)))?;
        let ctx = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            tools => tools,
        };
        let mut out = template.render(ctx).map_err(|e| match e.kind() {
            ErrorKind::OutOfFuel => ChatTemplateError::OutOfFuel(self.fuel),
            ErrorKind::InvalidOperation if e.detail().is_some_and(|d| d.starts_with(RAISED)) => {
                ChatTemplateError::Raised(e.detail().unwrap_or_default()[RAISED.len()..].to_string())
            }
            _ => ChatTemplateError::Render(describe(&e)),
        })?;
        if self.strip_bos && !self.bos_token.is_empty() && out.starts_with(&self.bos_token) {
            out.drain(..self.bos_token.len());
        }
        Ok(out)
    }
}

/// A JSON value as a template value (maps keep serde_json's key order).
fn json_value(v: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    match v {
        J::Null => Value::from(()),
        J::Bool(b) => Value::from(*b),
        J::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (None, Some(u)) => Value::from(u),
            _ => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        J::String(s) => Value::from(s.as_str()),
        J::Array(items) => Value::from(items.iter().map(json_value).collect::<Vec<_>>()),
        J::Object(map) => Value::from_pairs(map.iter().map(|(k, v)| (k.as_str(), json_value(v)))),
    }
}

// Compiled once per model and shared between request tasks.
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<ChatTemplate>();
};

/// The template stored in a GGUF file, if any.
pub fn gguf_chat_template(file: &crate::gguf::GgufFile) -> Option<&str> {
    file.get("tokenizer.chat_template").and_then(|v| v.as_str())
}

/// An error with its source chain and template location, on one line.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        let _ = write!(s, ": {inner}");
        source = inner.source();
    }
    s
}

const RAISED: &str = "raise_exception: ";

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, format!("{RAISED}{message}")))
}

/// `strftime_now(format)`: the current UTC time. Supports %Y %y %m %d %e %j %H %I %M %S
/// %p %b %B %a %A %F %T %%, which is what chat templates use (Llama 3.1: "%d %b %Y").
fn strftime_now(format: String) -> Result<String, Error> {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    strftime(&format, secs)
        .map_err(|c| Error::new(ErrorKind::InvalidOperation, format!("strftime_now: unsupported %{c}")))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// Formats `secs` since the epoch (UTC); `Err` names an unsupported conversion.
fn strftime(format: &str, secs: u64) -> Result<String, char> {
    let days = secs / 86_400;
    let (h, mi, s) = ((secs % 86_400) / 3600, (secs % 3600) / 60, secs % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm, proleptic Gregorian).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_march = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_march + 2) / 153;
    let d = doy_march - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let weekday = ((days as i64 + 3) % 7) as usize; // 1970-01-01 was a Thursday
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(spec) = chars.next() else {
            return Err('%');
        };
        let _ = match spec {
            'Y' => write!(out, "{y}"),
            'y' => write!(out, "{:02}", y.rem_euclid(100)),
            'm' => write!(out, "{m:02}"),
            'd' => write!(out, "{d:02}"),
            'e' => write!(out, "{d:2}"),
            'j' => write!(out, "{yday:03}"),
            'H' => write!(out, "{h:02}"),
            'I' => write!(out, "{:02}", if h % 12 == 0 { 12 } else { h % 12 }),
            'M' => write!(out, "{mi:02}"),
            'S' => write!(out, "{s:02}"),
            'p' => write!(out, "{}", if h < 12 { "AM" } else { "PM" }),
            'b' => write!(out, "{}", &month[..3]),
            'B' => write!(out, "{month}"),
            'a' => write!(out, "{}", &DAYS[weekday][..3]),
            'A' => write!(out, "{}", DAYS[weekday]),
            'F' => write!(out, "{y}-{m:02}-{d:02}"),
            'T' => write!(out, "{h:02}:{mi:02}:{s:02}"),
            '%' => write!(out, "%"),
            other => return Err(other),
        };
    }
    Ok(out)
}

/// `tojson` as Hugging Face defines it for chat templates (Python's `json.dumps` with
/// `ensure_ascii=False`): `", "` and `": "` separators, keys in insertion order, optional
/// `indent`, `separators`, `sort_keys` and `ensure_ascii` (positionally: ensure_ascii,
/// indent). MiniJinja's built-in `tojson` writes compact, HTML-escaped JSON instead.
fn tojson(value: Value, ensure_ascii: Option<Value>, indent: Option<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let pick = |name: &str, positional: Option<Value>| -> Result<Option<Value>, Error> {
        Ok(match kwargs.get::<Option<Value>>(name)? {
            Some(v) => Some(v),
            None => positional,
        })
    };
    let ensure_ascii = pick("ensure_ascii", ensure_ascii)?.is_some_and(|v| v.is_true());
    let indent = match pick("indent", indent)? {
        Some(v) if v.kind() == ValueKind::Number => v.as_i64().map(|i| i.clamp(0, i64::MAX) as u64),
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().len() as u64),
        _ => None,
    };
    // A template is outside input (a model file's): an indent of a trillion would make
    // every line a terabyte before fuel is counted again.
    if let Some(n) = indent.filter(|&n| n > MAX_INDENT as u64) {
        return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson indent {n} is over {MAX_INDENT}")));
    }
    let indent = indent.map(|n| n as usize);
    let (mut item_sep, mut key_sep) = (if indent.is_some() { "," } else { ", " }.to_string(), ": ".to_string());
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")? {
        let mut it = seps.try_iter()?;
        if let Some(v) = it.next() {
            item_sep = v.to_string();
        }
        if let Some(v) = it.next() {
            key_sep = v.to_string();
        }
    }
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let opts = JsonOpts { indent, item_sep, key_sep, sort_keys, ensure_ascii };
    let mut out = String::new();
    write_json(&value, &opts, 0, &mut out)?;
    Ok(out)
}

/// Widest `tojson` indent a template may ask for.
const MAX_INDENT: usize = 64;
/// Longest text one `tojson` call may produce (long separators or deep nesting times the
/// indent can multiply its input many times over).
const MAX_TOJSON_BYTES: usize = 32 << 20;

struct JsonOpts {
    indent: Option<usize>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn write_json(v: &Value, o: &JsonOpts, level: usize, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                // Python writes floats with a fractional part: 1.0, not 1.
                if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
                    let _ = write!(out, "{f:.1}");
                } else if f.is_finite() {
                    let _ = write!(out, "{f}");
                } else {
                    out.push_str(if f.is_nan() {
                        "NaN"
                    } else if f > 0.0 {
                        "Infinity"
                    } else {
                        "-Infinity"
                    });
                }
            }
        }
        ValueKind::String => write_json_str(v.as_str().unwrap_or_default(), o.ensure_ascii, out),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if o.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            let items = keys.into_iter().map(|k| {
                let item = v.get_item(&k);
                (k, item)
            });
            write_container(items, '{', '}', o, level, out, |(k, item), o, level, out| {
                let key = match k.as_str() {
                    Some(s) => s.to_string(),
                    None => k.to_string(),
                };
                write_json_str(&key, o.ensure_ascii, out);
                out.push_str(&o.key_sep);
                write_json(&item?, o, level, out)
            })?;
        }
        _ => match v.try_iter() {
            Ok(items) => {
                write_container(items, '[', ']', o, level, out, |item, o, level, out| write_json(&item, o, level, out))?
            }
            Err(_) => write_json_str(&v.to_string(), o.ensure_ascii, out),
        },
    }
    Ok(())
}

fn write_container<T>(
    items: impl Iterator<Item = T>,
    open: char,
    close: char,
    o: &JsonOpts,
    level: usize,
    out: &mut String,
    mut each: impl FnMut(T, &JsonOpts, usize, &mut String) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    let mut any = false;
    for (i, item) in items.enumerate() {
        any = true;
        if out.len() > MAX_TOJSON_BYTES {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson output over {MAX_TOJSON_BYTES} bytes"),
            ));
        }
        if i > 0 {
            out.push_str(&o.item_sep);
        }
        if let Some(n) = o.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * (level + 1)));
        }
        each(item, o, level + 1, out)?;
    }
    if let (true, Some(n)) = (any, o.indent) {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * level));
    }
    out.push(close);
    Ok(())
}

/// A JSON string literal as Python escapes it.
fn write_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_known_instants() {
        // 2024-02-29 13:05:09 UTC, a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "29 Feb 2024");
        assert_eq!(
            strftime("%A %B %e, %y %j %F %T %I%p %%", t).unwrap(),
            "Thursday February 29, 24 060 2024-02-29 13:05:09 01PM %"
        );
        assert_eq!(strftime("%Y-%m-%d %a", 0).unwrap(), "1970-01-01 Thu");
        assert_eq!(strftime("%Q", 0), Err('Q'));
    }
}
