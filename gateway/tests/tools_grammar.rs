//! The forced-call grammar against the tool-call parser, through llguidance (tessera-constrain)
//! over a byte vocabulary: hand-written calls are accepted or refused as the schemas say, and
//! random walks through the grammar's masks always produce text the parser reads as complete
//! calls to offered tools with arguments that satisfy the schema's required fields.

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use serde_json::{json, Value};
use tessera_constrain::{mask_allows, mask_words, Compiler, Constraint, Limits, SeqMatcher, Vocabulary};
use tessera_gateway::tools::grammar::forced_call_grammar;
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
    let grammar = forced_call_grammar(req, syntax).expect("a forced call has a grammar");
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
