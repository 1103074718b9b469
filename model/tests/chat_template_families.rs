//! Chat template behaviour beyond the llama.cpp fixtures: small representative Llama 3 and
//! Qwen2 style templates with hand-checked output, the helpers templates rely on
//! (`raise_exception`, Python string methods, Python-style `tojson`, `strftime_now`), and
//! the sandbox: no file includes, and a template that loops forever or recurses without end
//! fails with an error instead of hanging.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tessera_model::chat_template::{ChatMessage, ChatTemplate, ChatTemplateError};

const LLAMA3: &str = "{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
";

/// Written across lines the way trim_blocks / lstrip_blocks are meant for: indented block
/// tags and the newlines after them vanish, literal lines stay.
const QWEN2: &str = "{% for message in messages %}
    {% if loop.first and message.role != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
";

fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
    pairs.iter().map(|(r, c)| ChatMessage::new(*r, *c)).collect()
}

fn render(source: &str, messages: &[ChatMessage]) -> Result<String, ChatTemplateError> {
    ChatTemplate::new(source, "<s>", "</s>")?.render(messages, true)
}

#[test]
fn llama3_style_template() {
    let t = ChatTemplate::new(LLAMA3, "<|begin_of_text|>", "<|eot_id|>").unwrap();
    let m = msgs(&[("system", "Be brief."), ("user", "  Hi  \n"), ("assistant", "Hello."), ("user", "Bye")]);
    let want = "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
                <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
                <|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>\
                <|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>";
    assert_eq!(t.render(&m, false).unwrap(), format!("<|begin_of_text|>{want}"));
    assert_eq!(
        t.render(&m, true).unwrap(),
        format!("<|begin_of_text|>{want}<|start_header_id|>assistant<|end_header_id|>\n\n")
    );
    // A tokenizer that adds BOS itself gets the prompt without the template's BOS text.
    let t = t.with_tokenizer_adding_bos(true);
    assert_eq!(t.render(&m, false).unwrap(), want);
}

#[test]
fn qwen2_style_template_with_trim_and_lstrip_blocks() {
    let got = render(QWEN2, &msgs(&[("user", "Hi"), ("assistant", "Hello!"), ("user", "中文 🙂")])).unwrap();
    assert_eq!(
        got,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n中文 🙂<|im_end|>\n<|im_start|>assistant\n"
    );
    let got = render(QWEN2, &msgs(&[("system", "S"), ("user", "U")])).unwrap();
    assert_eq!(got, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n");
}

#[test]
fn raise_exception_becomes_an_error_with_the_message() {
    let t = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with a user turn') }}{% endif %}ok";
    match render(t, &msgs(&[("assistant", "x")])) {
        Err(ChatTemplateError::Raised(m)) => {
            assert_eq!(m, "Conversation must start with a user turn")
        }
        other => panic!("expected Raised, got {other:?}"),
    }
    assert_eq!(render(t, &msgs(&[("user", "x")])).unwrap(), "ok");
}

#[test]
fn python_string_methods_and_loop_controls() {
    let t = "{% for m in messages %}{% if m.content.startswith('skip') %}{% continue %}{% endif %}\
             [{{ m.content.strip() }}|{{ m.content.split(',')[1] }}|{{ m.role.upper() }}]\
             {% if loop.index == 3 %}{% break %}{% endif %}{% endfor %}";
    let got =
        render(t, &msgs(&[("user", "  a,b  "), ("assistant", "skip,me"), ("user", "c,d"), ("user", "e,f")])).unwrap();
    assert_eq!(got, "[a,b|b  |USER][c,d|d|USER]");
}

#[test]
fn tojson_writes_python_json() {
    // Expected strings are Python's: json.dumps(x, ensure_ascii=False) and variants.
    let t = r#"{{ {'a': [1, 2.5, 'x"é<' + "\n\x01"], 'b': none, 'c': true, 'd': 3.0} | tojson }}"#;
    assert_eq!(render(t, &[]).unwrap(), r#"{"a": [1, 2.5, "x\"é<\n\u0001"], "b": null, "c": true, "d": 3.0}"#);
    let t = "{{ {'a': [1, 2], 'b': {}} | tojson(indent=2) }}";
    assert_eq!(render(t, &[]).unwrap(), "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": {}\n}");
    let t = "{{ {'k': 'é🙂'} | tojson(ensure_ascii=true) }}";
    assert_eq!(render(t, &[]).unwrap(), r#"{"k": "\u00e9\ud83d\ude42"}"#);
    let t = "{{ {'a': 1, 'b': [1, 2]} | tojson(separators=(',', ':')) }}";
    assert_eq!(render(t, &[]).unwrap(), r#"{"a":1,"b":[1,2]}"#);
    let t = "{{ messages[0] | tojson }}";
    assert_eq!(render(t, &msgs(&[("user", "hi")])).unwrap(), r#"{"content": "hi", "role": "user"}"#);
}

/// Templates come from model files: a `tojson` that would write terabytes is an error
/// (a huge indent; separators that multiply the output), not an abort.
#[test]
fn tojson_refuses_outputs_a_template_could_blow_up() {
    let err = render("{{ [1, 2] | tojson(indent=1000000000000) }}", &[]).unwrap_err().to_string();
    assert!(err.contains("indent 1000000000000 is over 64"), "{err}");
    assert!(render("{{ [1] | tojson(indent=64) }}", &[]).is_ok());
    let t = "{% set sep = 'x' * 1000000 %}{{ range(100) | list | tojson(separators=(sep, ':')) }}";
    let err = render(t, &[]).unwrap_err().to_string();
    assert!(err.contains("tojson output over"), "{err}");
}

/// Today's UTC date as "%d %b %Y", computed by walking years and months from 1970.
fn today() -> String {
    let mut days = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() / 86_400;
    let mut year = 1970;
    loop {
        let len = if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 { 366 } else { 365 };
        if days < len {
            break;
        }
        days -= len;
        year += 1;
    }
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let lens = [31, if leap { 29 } else { 28 }, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    let names = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let mut month = 0;
    while days >= lens[month] {
        days -= lens[month];
        month += 1;
    }
    format!("{:02} {} {year}", days + 1, names[month])
}

#[test]
fn strftime_now_gives_todays_date() {
    let t = "{% if strftime_now is defined %}Today Date: {{ strftime_now('%d %b %Y') }}{% endif %}";
    let before = today();
    let got = render(t, &[]).unwrap();
    let after = today();
    assert!(got == format!("Today Date: {before}") || got == format!("Today Date: {after}"), "{got}");
}

#[test]
fn tools_is_none_and_undefined_variables_are_empty() {
    let t = "{% if tools is none %}none{% endif %}|{{ missing }}|{% if tools %}has tools{% endif %}";
    assert_eq!(render(t, &[]).unwrap(), "none||");
}

#[test]
fn endless_loop_runs_out_of_fuel() {
    let t = "{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}";
    let start = Instant::now();
    let result = ChatTemplate::new(t, "", "").unwrap().render(&[], true);
    assert!(matches!(result, Err(ChatTemplateError::OutOfFuel(_))), "{result:?}");
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
    // A smaller budget stops a smaller loop that the default lets through.
    let t = "{% for a in range(2000) %}{{ a }}{% endfor %}";
    assert!(ChatTemplate::new(t, "", "").unwrap().render(&[], true).is_ok());
    let small = ChatTemplate::new(t, "", "").unwrap().with_fuel(500).render(&[], true);
    assert!(matches!(small, Err(ChatTemplateError::OutOfFuel(500))), "{small:?}");
}

#[test]
fn endless_recursion_is_an_error() {
    let t = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
    assert!(render(t, &[]).is_err());
}

#[test]
fn templates_cannot_include_files_and_bad_syntax_is_reported() {
    let t = "{% include '/etc/passwd' %}";
    assert!(matches!(render(t, &[]), Err(ChatTemplateError::Render(_))));
    assert!(matches!(ChatTemplate::new("{% for %}", "", ""), Err(ChatTemplateError::Syntax(_))));
    assert!(matches!(ChatTemplate::new("{{ x ", "", ""), Err(ChatTemplateError::Syntax(_))));
}
