//! The call grammars (forced, and `auto` with strict tools) against the tool-call parser,
//! through llguidance (tessera-constrain) over a byte vocabulary: hand-written outputs are
//! accepted or refused as the schemas say, and random walks through the grammar's masks always
//! produce text the parser reads as complete calls to offered tools with arguments that satisfy
//! the strict schemas, or (under `auto`) as plain text only.

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use serde_json::{json, Value};
use tessera_constrain::{mask_allows, mask_words, Compiler, Constraint, Limits, SeqMatcher, Vocabulary};
use tessera_gateway::tools::grammar::{auto_call_grammar, forced_call_grammar};
use tessera_gateway::tools::spec::{ToolChoice, ToolDef, ToolRequest};
use tessera_gateway::tools::{ToolCallParser, ToolEvent, ToolSyntax};

const EOS: u32 = 256;

fn compiler() -> Compiler {
    let vocab = Vocabulary::from_pieces(257, &[EOS], |id| {
        if id < 256 {
            (vec![id as u8], false)
        } else {
            (b"<|eos|>".to_vec(), true)
        }
    })
    .expect("byte vocabulary");
    Compiler::new(vocab, Limits::default()).expect("compiler")
}

fn tools(choice: ToolChoice, parallel: bool) -> ToolRequest {
    let weather = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city", "days"], "additionalProperties": false});
    let time = json!({"type": "object", "properties": {"tz": {"enum": ["CET", "UTC"]}}, "required": ["tz"], "additionalProperties": false});
    ToolRequest {
        tools: vec![
            ToolDef { name: "get_weather".into(), description: None, parameters: weather, strict: true },
            ToolDef { name: "get_time".into(), description: None, parameters: time, strict: false },
        ],
        choice,
        parallel,
    }
}

fn matcher(req: &ToolRequest, syntax: ToolSyntax) -> SeqMatcher {
    let grammar = forced_call_grammar(req, syntax)
        .or_else(|| auto_call_grammar(req, syntax))
        .expect("a forced call, or auto with a strict tool, has a grammar");
    compiler().compile(&Constraint::Lark(grammar)).expect("grammar compiles")
}

/// Whether the grammar accepts `text` followed by EOS.
fn accepts(req: &ToolRequest, syntax: ToolSyntax, text: &str) -> bool {
    let mut m = matcher(req, syntax);
    let mut mask = vec![0u32; mask_words(257)];
    for &b in text.as_bytes() {
        if m.fill_mask(&mut mask).is_err() || !mask_allows(&mask, u32::from(b)) || m.commit(u32::from(b)).is_err() {
            return false;
        }
    }
    m.is_accepting()
}

fn hermes(name: &str, args: &str) -> String {
    format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {args}}}\n</tool_call>")
}

#[test]
fn hand_written_calls() {
    let required = tools(ToolChoice::Required, true);
    let w = hermes("get_weather", r#"{"city": "Paris", "days": 3}"#);
    let t = hermes("get_time", r#"{"tz": "UTC"}"#);
    assert!(accepts(&required, ToolSyntax::Hermes, &w));
    assert!(accepts(&required, ToolSyntax::Hermes, &format!("{w}\n{t}")));
    for bad in [
        hermes("get_wether", r#"{"city": "Paris", "days": 3}"#),
        hermes("get_weather", r#"{"city": "Paris"}"#),
        hermes("get_weather", r#"{"city": "Paris", "days": 10}"#),
        hermes("get_time", r#"{"tz": "PST"}"#),
        format!("Sure! {w}"),
        format!("{w} done"),
    ] {
        assert!(!accepts(&required, ToolSyntax::Hermes, &bad), "{bad}");
    }
    let single = tools(ToolChoice::Required, false);
    assert!(!accepts(&single, ToolSyntax::Hermes, &format!("{w}\n{t}")));
    let named = tools(ToolChoice::Named("get_time".into()), true);
    assert!(accepts(&named, ToolSyntax::Hermes, &t) && !accepts(&named, ToolSyntax::Hermes, &w));
    let llama = r#"{"name": "get_time", "parameters": {"tz": "CET"}}; {"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}"#;
    assert!(accepts(&required, ToolSyntax::Llama3Json, llama));
}

/// Random walks: each step picks an allowed byte (favouring closing characters so the walk
/// ends); the finished text must parse into complete calls whose arguments follow the schema.
#[test]
fn random_walks_parse_as_valid_calls() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x6A3);
    let closers = [b'"', b'}', b']', b'\n', b'<', b'/'];
    for syntax in [ToolSyntax::Hermes, ToolSyntax::Llama3Json] {
        let req = tools(ToolChoice::Required, true);
        for _ in 0..12 {
            let mut m = matcher(&req, syntax);
            let mut mask = vec![0u32; mask_words(257)];
            let mut text = Vec::new();
            loop {
                m.fill_mask(&mut mask).expect("mask");
                let allowed: Vec<u32> = (0..257).filter(|&t| mask_allows(&mask, t)).collect();
                assert!(!allowed.is_empty(), "dead end after {:?}", String::from_utf8_lossy(&text));
                let closing: Vec<u32> =
                    allowed.iter().copied().filter(|&t| t < 256 && closers.contains(&(t as u8))).collect();
                let pick = if allowed.contains(&EOS) && (rng.next_u32() % 3 == 0 || text.len() > 600) {
                    EOS
                } else if !closing.is_empty() && rng.next_u32() % 4 != 0 {
                    closing[(rng.next_u32() as usize) % closing.len()]
                } else {
                    let printable: Vec<u32> = allowed
                        .iter()
                        .copied()
                        .filter(|&t| (0x20..0x7f).contains(&t) || t == u32::from(b'\n'))
                        .collect();
                    let from = if printable.is_empty() { &allowed } else { &printable };
                    from[(rng.next_u32() as usize) % from.len()]
                };
                if pick == EOS {
                    break;
                }
                m.commit(pick).expect("commit");
                text.push(pick as u8);
                assert!(text.len() < 5000, "runaway walk");
            }
            let text = String::from_utf8(text).expect("ASCII walk");
            let mut p = ToolCallParser::new(syntax, req.names());
            let mut events = p.push(&text);
            events.extend(p.finish());
            let mut calls: Vec<(String, String, bool)> = Vec::new();
            for e in events {
                match e {
                    ToolEvent::Start { name, .. } => calls.push((name, String::new(), false)),
                    ToolEvent::Args { delta, .. } => calls.last_mut().expect("args after start").1.push_str(&delta),
                    ToolEvent::End { complete, .. } => calls.last_mut().expect("end after start").2 = complete,
                    ToolEvent::Text(t) => assert!(t.trim().is_empty(), "text {t:?} in {text:?}"),
                }
            }
            assert!(!calls.is_empty(), "{text:?}");
            for (name, args, complete) in calls {
                assert!(complete, "{text:?}");
                let args: Value = serde_json::from_str(&args).unwrap_or_else(|e| panic!("{e}: {args:?}"));
                match name.as_str() {
                    "get_weather" => {
                        let days = args["days"].as_i64().unwrap_or(0);
                        assert!(args["city"].is_string() && (1..=9).contains(&days), "{args}");
                    }
                    "get_time" => assert!(args["tz"] == "CET" || args["tz"] == "UTC", "{args}"),
                    other => panic!("unexpected tool {other}"),
                }
            }
        }
    }
}

#[test]
fn auto_with_a_strict_tool() {
    let auto = tools(ToolChoice::Auto, true);
    let w = hermes("get_weather", r#"{"city": "Paris", "days": 3}"#);
    // get_time is not strict: any object, even one its schema refuses.
    let t = hermes("get_time", r#"{"tz": "PST", "extra": [1, {"a": null}]}"#);
    let h = ToolSyntax::Hermes;
    for good in [
        String::new(),
        "It is sunny.".to_owned(),
        "Braces {\"name\": \"get_weather\"} and <tool_cal> or <tool_callx> or </tool_call>\n".to_owned(),
        w.clone(),
        t.clone(),
        format!("Let me check.\n{w}"),
        format!("{w}\n{t}"),
        format!("<tool_c {w}\n{t}\n{w}"),
    ] {
        assert!(accepts(&auto, h, &good), "{good:?}");
    }
    for bad in [
        hermes("get_weather", r#"{"city": "Paris"}"#),
        hermes("get_weather", r#"{"city": "Paris", "days": 3, "x": 1}"#),
        hermes("get_weather", r#"{"city": "Paris", "days": 0}"#),
        hermes("get_time", "[1]"),
        hermes("get_wether", r#"{"city": "Paris", "days": 3}"#),
        "Just text <tool_call> and more".to_owned(),
        format!("{w} done"),
        format!("{w}\nThen {t}"),
    ] {
        assert!(!accepts(&auto, h, &bad), "{bad:?}");
    }
    let single = tools(ToolChoice::Auto, false);
    assert!(accepts(&single, h, &format!("Sure. {w}")) && accepts(&single, h, "No call."));
    assert!(!accepts(&single, h, &format!("{w}\n{t}")));

    let l = ToolSyntax::Llama3Json;
    let lw = r#"{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}"#;
    let lt = r#"{"name": "get_time", "parameters": {"any": "thing"}}"#;
    for good in [String::new(), "Hello {there}".to_owned(), lw.to_owned(), format!("{lt}; {lw}"), "<|python".to_owned()]
    {
        assert!(accepts(&auto, l, &good), "{good:?}");
    }
    for bad in [
        r#"{"name": "get_weather", "parameters": {"city": "Oslo", "days": 12}}"#.to_owned(),
        "  {not a call}".to_owned(),
        "<|python_tag|>{}".to_owned(),
        format!("{lw} and text"),
    ] {
        assert!(!accepts(&auto, l, &bad), "{bad:?}");
    }
    assert!(!accepts(&tools(ToolChoice::Auto, false), l, &format!("{lt}; {lw}")));

    // No strict tool, or a choice that is not auto: no auto grammar.
    let mut lax = tools(ToolChoice::Auto, true);
    lax.tools.iter_mut().for_each(|t| t.strict = false);
    assert_eq!(auto_call_grammar(&lax, h), None);
    assert_eq!(auto_call_grammar(&tools(ToolChoice::Required, true), h), None);
    assert_eq!(auto_call_grammar(&tools(ToolChoice::None, true), h), None);
}

/// Random walks under `auto`: from an empty start, or with a random prefix of a valid call
/// already committed. Text-only outputs must parse as text without calls (the walk favours
/// `<tool_call>`'s bytes and braces); outputs with calls must parse as complete calls whose
/// strict arguments follow the schema.
#[test]
fn auto_random_walks_parse_as_text_or_valid_calls() {
    let mut rng = ChaCha8Rng::seed_from_u64(0xA770);
    let tag_bytes = b"<tool_call>{}\"\n";
    let w = hermes("get_weather", r#"{"city": "Paris", "days": 3}"#);
    let req = tools(ToolChoice::Auto, true);
    for round in 0..24 {
        let mut m = matcher(&req, ToolSyntax::Hermes);
        let mut mask = vec![0u32; mask_words(257)];
        let mut text = Vec::new();
        if round % 2 == 1 {
            // Past "get_w": the call is committed (before it, the text may still be plain).
            let (from, to) = (w.find("get_").unwrap_or(0) + 5, w.find("\"days\"").unwrap_or(w.len()));
            let cut = from + (rng.next_u32() as usize) % (to - from);
            let prefix = format!("Ok. {}", &w[..cut]);
            for &b in prefix.as_bytes() {
                m.commit(u32::from(b)).expect("valid prefix");
            }
            text.extend_from_slice(prefix.as_bytes());
        }
        loop {
            m.fill_mask(&mut mask).expect("mask");
            let allowed: Vec<u32> = (0..257).filter(|&t| mask_allows(&mask, t)).collect();
            assert!(!allowed.is_empty(), "dead end after {:?}", String::from_utf8_lossy(&text));
            let favoured: Vec<u32> =
                allowed.iter().copied().filter(|&t| t < 256 && tag_bytes.contains(&(t as u8))).collect();
            let pick = if allowed.contains(&EOS) && (rng.next_u32() % 8 == 0 || text.len() > 400) {
                EOS
            } else if !favoured.is_empty() && rng.next_u32() % 3 != 0 {
                favoured[(rng.next_u32() as usize) % favoured.len()]
            } else {
                let printable: Vec<u32> =
                    allowed.iter().copied().filter(|&t| (0x20..0x7f).contains(&t) || t == u32::from(b'\n')).collect();
                let from = if printable.is_empty() { &allowed } else { &printable };
                from[(rng.next_u32() as usize) % from.len()]
            };
            if pick == EOS {
                break;
            }
            m.commit(pick).expect("commit");
            text.push(pick as u8);
            assert!(text.len() < 5000, "runaway walk");
        }
        let text = String::from_utf8(text).expect("ASCII walk");
        let mut p = ToolCallParser::new(ToolSyntax::Hermes, req.names());
        let mut events = p.push(&text);
        events.extend(p.finish());
        let mut calls: Vec<(String, String, bool)> = Vec::new();
        let mut plain = String::new();
        for e in events {
            match e {
                ToolEvent::Start { name, .. } => calls.push((name, String::new(), false)),
                ToolEvent::Args { delta, .. } => calls.last_mut().expect("args after start").1.push_str(&delta),
                ToolEvent::End { complete, .. } => calls.last_mut().expect("end after start").2 = complete,
                ToolEvent::Text(t) => plain.push_str(&t),
            }
        }
        if !text.contains("<tool_call>") {
            assert!(calls.is_empty() && plain == text, "{text:?} read as {plain:?} and {calls:?}");
        }
        assert!(round % 2 == 0 || !calls.is_empty(), "{text:?}");
        for (name, args, complete) in calls {
            assert!(complete, "{text:?}");
            let args: Value = serde_json::from_str(&args).unwrap_or_else(|e| panic!("{e}: {args:?}"));
            match name.as_str() {
                "get_weather" => {
                    let days = args["days"].as_i64().unwrap_or(0);
                    assert!(args["city"].is_string() && (1..=9).contains(&days), "{args}");
                }
                "get_time" => assert!(args.is_object(), "{args}"),
                other => panic!("unexpected tool {other}"),
            }
        }
    }
}
