//! Tests of the tool-call parser: outputs built from known parts (the generator is the
//! reference), split invariance under random cuts, and adversarial inputs (long runs of
//! tag prefixes, huge unterminated JSON, braces and tags inside strings).

use std::time::{Duration, Instant};

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use serde_json::{json, Value};

use super::parser::{MAX_PENDING, OPEN};
use super::*;

fn names() -> Vec<String> {
    vec!["get_weather".to_owned(), "search".to_owned(), "f".to_owned()]
}

/// Adjacent text and same-call argument deltas merged: the split-independent form.
fn normalize(events: Vec<ToolEvent>) -> Vec<ToolEvent> {
    let mut out: Vec<ToolEvent> = Vec::new();
    for e in events {
        match (out.last_mut(), e) {
            (_, ToolEvent::Text(t)) if t.is_empty() => {}
            (Some(ToolEvent::Text(last)), ToolEvent::Text(t)) => last.push_str(&t),
            (Some(ToolEvent::Args { index: a, delta }), ToolEvent::Args { index: b, delta: d }) if *a == b => {
                delta.push_str(&d)
            }
            (_, e) => out.push(e),
        }
    }
    out
}

fn parse_chunks(syntax: ToolSyntax, chunks: &[&str]) -> Vec<ToolEvent> {
    let mut p = ToolCallParser::new(syntax, names());
    let mut events = Vec::new();
    for c in chunks {
        events.extend(p.push(c));
    }
    events.extend(p.finish());
    normalize(events)
}

fn parse(syntax: ToolSyntax, text: &str) -> Vec<ToolEvent> {
    parse_chunks(syntax, &[text])
}

/// `text` cut at random character boundaries (some pieces empty).
fn random_split<'a>(text: &'a str, rng: &mut ChaCha8Rng) -> Vec<&'a str> {
    let mut cuts: Vec<usize> = (0..rng.next_u32() % 12)
        .map(|_| (rng.next_u32() as usize) % (text.len() + 1))
        .filter(|&c| text.is_char_boundary(c))
        .collect();
    cuts.push(0);
    cuts.push(text.len());
    cuts.sort_unstable();
    cuts.windows(2).map(|w| &text[w[0]..w[1]]).collect()
}

fn one_byte_pieces(text: &str) -> Vec<&str> {
    let mut cuts: Vec<usize> = (0..=text.len()).filter(|&c| text.is_char_boundary(c)).collect();
    cuts.dedup();
    cuts.windows(2).map(|w| &text[w[0]..w[1]]).collect()
}

fn call(name: &str, args: &Value) -> String {
    format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {args}}}\n</tool_call>")
}

fn random_args(rng: &mut ChaCha8Rng) -> Value {
    let strings = ["Paris", "}{", "</tool_call>", "<tool_call>", "a \"quoted\" \\ word", "日本", "{\"x\": [1]}"];
    let mut obj = serde_json::Map::new();
    for k in 0..rng.next_u32() % 4 {
        let v = match rng.next_u32() % 4 {
            0 => json!(strings[(rng.next_u32() as usize) % strings.len()]),
            1 => json!((rng.next_u32() as i32) / 3),
            2 => json!([1.5, {"deep": {"er": [null, true]}}]),
            _ => json!({"nested": strings[(rng.next_u32() as usize) % strings.len()]}),
        };
        obj.insert(format!("k{k}"), v);
    }
    Value::Object(obj)
}

/// Texts made of plain parts and calls with known names and arguments: the parser must
/// give back exactly those parts, however the text is split.
#[test]
fn hermes_outputs_from_known_parts() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x7001);
    let plain = ["Sure.", "Let me check: ", "a < b and <tool is not a tag", "{\"name\": \"f\"} as text", "é🦀"];
    for _ in 0..400 {
        let mut text = String::new();
        let mut want = Vec::new();
        let mut calls = 0;
        for _ in 0..1 + rng.next_u32() % 4 {
            if rng.next_u32() % 2 == 0 {
                let p = plain[(rng.next_u32() as usize) % plain.len()];
                // Whitespace-only text after a call is dropped; keep parts visible.
                text.push_str(p);
                want.push(ToolEvent::Text(p.to_owned()));
            } else {
                let name = ["get_weather", "search", "f"][(rng.next_u32() % 3) as usize];
                let args = random_args(&mut rng);
                text.push_str(&call(name, &args));
                want.push(ToolEvent::Start { index: calls, name: name.to_owned() });
                want.push(ToolEvent::Args { index: calls, delta: args.to_string() });
                want.push(ToolEvent::End { index: calls, complete: true });
                calls += 1;
            }
        }
        let want = normalize(want);
        let got = parse(ToolSyntax::Hermes, &text);
        // The arguments text is the model's own; compare it as JSON.
        assert_eq!(strip_args(&got), strip_args(&want), "{text:?}");
        for (g, w) in got.iter().zip(&want) {
            if let (ToolEvent::Args { delta: g, .. }, ToolEvent::Args { delta: w, .. }) = (g, w) {
                assert_eq!(
                    serde_json::from_str::<Value>(g).ok().as_ref(),
                    serde_json::from_str::<Value>(w).ok().as_ref()
                );
            }
        }
        for _ in 0..3 {
            assert_eq!(parse_chunks(ToolSyntax::Hermes, &random_split(&text, &mut rng)), got, "{text:?}");
        }
    }
}

/// The events with argument texts blanked (they are compared as JSON separately).
fn strip_args(events: &[ToolEvent]) -> Vec<ToolEvent> {
    events
        .iter()
        .map(|e| match e {
            ToolEvent::Args { index, .. } => ToolEvent::Args { index: *index, delta: String::new() },
            other => other.clone(),
        })
        .collect()
}

/// Random soups of tag pieces, braces and quotes: whatever the parser decides, a split
/// text gives the same result, and no input text is lost when no call is committed.
#[test]
fn random_soups_are_split_invariant() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x50F7);
    let atoms = [
        "<tool_call>",
        "</tool_call>",
        "<tool_",
        "<",
        "{",
        "}",
        "\"name\"",
        ": ",
        "\"f\"",
        "\"search\"",
        ", ",
        "\"arguments\"",
        "\"parameters\"",
        "[1, 2]",
        "\"}\"",
        "\\",
        "\n",
        " ",
        "x",
        "é",
        ";",
        "<|python_tag|>",
        "<|python",
        "12",
        "tru",
        "true",
    ];
    for round in 0..3000 {
        let text: String = (0..rng.next_u32() % 30).map(|_| atoms[(rng.next_u32() as usize) % atoms.len()]).collect();
        for syntax in [ToolSyntax::Hermes, ToolSyntax::Llama3Json] {
            let whole = parse(syntax, &text);
            let split = parse_chunks(syntax, &random_split(&text, &mut rng));
            assert_eq!(split, whole, "{syntax:?} {text:?}");
            if round % 10 == 0 {
                assert_eq!(parse_chunks(syntax, &one_byte_pieces(&text)), whole, "{syntax:?} {text:?}");
            }
            if !whole.iter().any(|e| matches!(e, ToolEvent::Start { .. })) {
                let texts: String =
                    whole.iter().map(|e| if let ToolEvent::Text(t) = e { t.as_str() } else { "" }).collect();
                assert_eq!(texts, text, "{syntax:?}: text without calls comes back unchanged");
            }
        }
    }
}

#[test]
fn several_calls_with_text_between() {
    let text = format!(
        "I will look both up.\n{}\n{}\nDone.",
        call("get_weather", &json!({"city": "Paris"})),
        call("search", &json!({"q": "x"}))
    );
    let got = parse(ToolSyntax::Hermes, &text);
    let want = vec![
        ToolEvent::Text("I will look both up.\n".to_owned()),
        ToolEvent::Start { index: 0, name: "get_weather".to_owned() },
        ToolEvent::Args { index: 0, delta: r#"{"city":"Paris"}"#.to_owned() },
        ToolEvent::End { index: 0, complete: true },
        ToolEvent::Start { index: 1, name: "search".to_owned() },
        ToolEvent::Args { index: 1, delta: r#"{"q":"x"}"#.to_owned() },
        ToolEvent::End { index: 1, complete: true },
        ToolEvent::Text("\nDone.".to_owned()),
    ];
    assert_eq!(got, want);
}

#[test]
fn arguments_stream_as_they_arrive() {
    let mut p = ToolCallParser::new(ToolSyntax::Hermes, names());
    assert_eq!(p.push("Hi <tool"), vec![ToolEvent::Text("Hi ".to_owned())]);
    assert_eq!(p.push("_call>\n{\"name\": \"se"), vec![]);
    assert_eq!(
        p.push("arch\", \"arguments\": {\"q\": \"ab"),
        vec![
            ToolEvent::Start { index: 0, name: "search".to_owned() },
            ToolEvent::Args { index: 0, delta: "{\"q\": \"ab".to_owned() }
        ]
    );
    assert_eq!(p.push("c\"}"), vec![ToolEvent::Args { index: 0, delta: "c\"}".to_owned() }]);
    assert_eq!(p.push("}\n</tool_call>"), vec![ToolEvent::End { index: 0, complete: true }]);
    assert_eq!(p.finish(), vec![]);
}

#[test]
fn arguments_before_name_and_other_keys() {
    let text = r#"<tool_call>{"arguments": {"n": 5}, "type": "function", "name": "f"}</tool_call>"#;
    let want = vec![
        ToolEvent::Start { index: 0, name: "f".to_owned() },
        ToolEvent::Args { index: 0, delta: r#"{"n": 5}"#.to_owned() },
        ToolEvent::End { index: 0, complete: true },
    ];
    assert_eq!(parse(ToolSyntax::Hermes, text), want);
    // A bare number as arguments ends before the byte after it.
    let text = r#"<tool_call>{"arguments": 42, "name": "f"}</tool_call>"#;
    assert_eq!(parse(ToolSyntax::Hermes, text)[1], ToolEvent::Args { index: 0, delta: "42".to_owned() });
    let text = r#"<tool_call>{"name": "f"}</tool_call>"#;
    assert_eq!(parse(ToolSyntax::Hermes, text)[1], ToolEvent::Args { index: 0, delta: "{}".to_owned() });
}

#[test]
fn non_calls_come_back_as_text() {
    for text in [
        "<tool_call>not json</tool_call>",
        "<tool_call>{\"name\": \"unknown_tool\", \"arguments\": {}}</tool_call>",
        "<tool_call>{\"arguments\": {}}</tool_call> trailing",
        "<tool_call>[1, 2]",
        "<tool_call>{\"name\": 7}",
        "<tool_call>{\"name\": \"f",
        "<tool_",
    ] {
        let got = parse(ToolSyntax::Hermes, text);
        assert_eq!(got, vec![ToolEvent::Text(text.to_owned())], "{text:?}");
    }
}

#[test]
fn committed_calls_that_break_or_stop_early() {
    let text = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": tru} rest";
    let want = vec![
        ToolEvent::Start { index: 0, name: "f".to_owned() },
        ToolEvent::Args { index: 0, delta: "{\"a\": tru".to_owned() },
        ToolEvent::End { index: 0, complete: false },
        ToolEvent::Text("} rest".to_owned()),
    ];
    assert_eq!(parse(ToolSyntax::Hermes, text), want);
    let text = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": [1, ";
    let want = vec![
        ToolEvent::Start { index: 0, name: "f".to_owned() },
        ToolEvent::Args { index: 0, delta: "{\"a\": [1, ".to_owned() },
        ToolEvent::End { index: 0, complete: false },
    ];
    assert_eq!(parse(ToolSyntax::Hermes, text), want);
    // A missing closing tag is tolerated; what follows is text.
    let text = "<tool_call>{\"name\": \"f\", \"arguments\": {}} and then";
    assert_eq!(parse(ToolSyntax::Hermes, text).last(), Some(&ToolEvent::Text(" and then".to_owned())));
}

#[test]
fn llama_json_calls() {
    let text = r#"{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}"#;
    let got = parse(ToolSyntax::Llama3Json, text);
    let want = vec![
        ToolEvent::Start { index: 0, name: "get_weather".to_owned() },
        ToolEvent::Args { index: 0, delta: r#"{"city": "Paris"}"#.to_owned() },
        ToolEvent::End { index: 0, complete: true },
        ToolEvent::Start { index: 1, name: "f".to_owned() },
        ToolEvent::Args { index: 1, delta: "{}".to_owned() },
        ToolEvent::End { index: 1, complete: true },
    ];
    assert_eq!(got, want);
    let tagged = format!("<|python_tag|>{text}");
    assert_eq!(parse(ToolSyntax::Llama3Json, &tagged), want);
    // JSON that is not a call, and calls after text, are text.
    for text in [r#"{"answer": 42}"#, r#"The call: {"name": "f", "parameters": {}}"#, "  <|python", "<b>"] {
        assert_eq!(parse(ToolSyntax::Llama3Json, text), vec![ToolEvent::Text(text.to_owned())], "{text:?}");
    }
}

/// Runs `f`, failing if it takes longer than `limit` (a quadratic parser would).
fn timed<T>(limit: Duration, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let out = f();
    assert!(start.elapsed() < limit, "took {:?}", start.elapsed());
    out
}

#[test]
fn long_runs_of_tag_prefixes_are_linear() {
    let text = "<tool_".repeat(100_000) + "<tool_call" + &"<".repeat(50_000);
    let got = timed(Duration::from_secs(5), || parse_chunks(ToolSyntax::Hermes, &one_byte_pieces(&text)));
    assert_eq!(got, vec![ToolEvent::Text(text.clone())]);
    // Held back at most a tag's length at any time.
    let mut p = ToolCallParser::new(ToolSyntax::Hermes, names());
    let mut released = 0;
    for piece in one_byte_pieces(&text) {
        for e in p.push(piece) {
            if let ToolEvent::Text(t) = e {
                released += t.len();
            }
        }
    }
    assert!(text.len() - released < OPEN.len());
}

#[test]
fn huge_unterminated_json_is_streamed_or_released() {
    // Committed: the arguments stream out as they come, nothing accumulates.
    let body = "x".repeat(4 << 20);
    let mut p = ToolCallParser::new(ToolSyntax::Hermes, names());
    let mut args = 0;
    timed(Duration::from_secs(10), || {
        let head = ["<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \""];
        let chunks =
            head.into_iter().chain(body.as_bytes().chunks(997).map(|c| std::str::from_utf8(c).unwrap_or_default()));
        for chunk in chunks {
            for e in p.push(chunk) {
                if let ToolEvent::Args { delta, .. } = e {
                    args += delta.len();
                }
            }
        }
    });
    assert_eq!(args, "{\"a\": \"".len() + body.len());
    assert_eq!(p.finish(), vec![ToolEvent::End { index: 0, complete: false }]);

    // Not committed (no name yet): held up to MAX_PENDING, then released as text.
    let text = format!("<tool_call>{{\"arguments\": {{\"a\": \"{body}");
    let got = timed(Duration::from_secs(10), || {
        parse_chunks(ToolSyntax::Hermes, &random_split(&text, &mut ChaCha8Rng::seed_from_u64(3)))
    });
    assert_eq!(got, vec![ToolEvent::Text(text.clone())]);
    let mut p = ToolCallParser::new(ToolSyntax::Hermes, names());
    let mut released = 0;
    for chunk in text.as_bytes().chunks(4096) {
        for e in p.push(std::str::from_utf8(chunk).unwrap_or_default()) {
            if let ToolEvent::Text(t) = e {
                released += t.len();
            }
        }
    }
    assert!(text.len() - released <= MAX_PENDING + 4096, "held {}", text.len() - released);

    // The limit falls inside a multi-byte character for one of the two offsets (2- and
    // 3-byte characters): released at the next boundary, the text comes back whole.
    for pad in ["", "a"] {
        for ch in ["é", "€"] {
            let text = format!("<tool_call>{{\"arguments\": \"{pad}{}", ch.repeat(MAX_PENDING));
            assert_eq!(parse(ToolSyntax::Hermes, &text), vec![ToolEvent::Text(text.clone())], "pad {pad:?} {ch}");
            let got = normalize(parse_chunks(ToolSyntax::Llama3Json, &[&text[11..]]));
            assert_eq!(got, vec![ToolEvent::Text(text[11..].to_owned())], "llama3 pad {pad:?} {ch}");
        }
    }

    // Deep nesting is refused at the scanner's depth limit, linearly.
    let deep = format!("<tool_call>{{\"name\": \"f\", \"arguments\": {}", "[".repeat(200_000));
    let got = timed(Duration::from_secs(5), || parse(ToolSyntax::Hermes, &deep));
    assert_eq!(got[2], ToolEvent::End { index: 0, complete: false });
}

#[test]
fn braces_and_tags_inside_strings() {
    let args = json!({"s": "}{\"}]", "t": "</tool_call><tool_call>", "n": {"m": [1, {"k": "\\\"}"}]}});
    let text = format!("{}{}", call("f", &args), call("search", &json!({"q": "{"})));
    let got = parse(ToolSyntax::Hermes, &text);
    assert_eq!(got.len(), 6, "{got:?}");
    assert_eq!(got[1], ToolEvent::Args { index: 0, delta: args.to_string() });
    assert_eq!(got[4], ToolEvent::Args { index: 1, delta: r#"{"q":"{"}"#.to_owned() });
}
