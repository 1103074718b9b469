//! The coordinator refuses malformed Generate requests at its edge.

use tessera_coordinator::validate::validate;
use tessera_proto::coordinator::GenerateRequest;
use tessera_proto::worker::SamplingParams;

fn req() -> GenerateRequest {
    GenerateRequest {
        request_id: "r".into(),
        prompt_ids: vec![1, 2, 3],
        sampling: Some(SamplingParams { temperature: 0.7, top_p: 0.9, ..Default::default() }),
        max_tokens: 8,
        stop_token_ids: vec![2],
        ignore_eos: false,
    }
}

#[test]
fn a_well_formed_request_passes() {
    assert_eq!(validate(&req(), 100), Ok(()));
    // proto3 zero defaults mean "off" and are accepted.
    let r = GenerateRequest { sampling: Some(SamplingParams::default()), ..req() };
    assert_eq!(validate(&r, 100), Ok(()));
}

#[test]
fn malformed_requests_are_refused_with_the_field_named() {
    let cases: Vec<(&str, GenerateRequest)> = vec![
        ("prompt_ids", GenerateRequest { prompt_ids: vec![], ..req() }),
        ("prompt_ids", GenerateRequest { prompt_ids: vec![1, 100], ..req() }),
        ("stop_token_ids", GenerateRequest { stop_token_ids: vec![4000], ..req() }),
        ("max_tokens", GenerateRequest { max_tokens: 0, ..req() }),
        (
            "temperature",
            GenerateRequest { sampling: Some(SamplingParams { temperature: 2.5, ..Default::default() }), ..req() },
        ),
        (
            "temperature",
            GenerateRequest { sampling: Some(SamplingParams { temperature: f32::NAN, ..Default::default() }), ..req() },
        ),
        ("top_p", GenerateRequest { sampling: Some(SamplingParams { top_p: 1.5, ..Default::default() }), ..req() }),
        ("min_p", GenerateRequest { sampling: Some(SamplingParams { min_p: -0.1, ..Default::default() }), ..req() }),
        (
            "repetition_penalty",
            GenerateRequest {
                sampling: Some(SamplingParams { repetition_penalty: -1.0, ..Default::default() }),
                ..req()
            },
        ),
        (
            "presence_penalty",
            GenerateRequest { sampling: Some(SamplingParams { presence_penalty: 3.0, ..Default::default() }), ..req() },
        ),
        (
            "frequency_penalty",
            GenerateRequest {
                sampling: Some(SamplingParams { frequency_penalty: -3.0, ..Default::default() }),
                ..req()
            },
        ),
        (
            "top_logprobs",
            GenerateRequest { sampling: Some(SamplingParams { top_logprobs: 21, ..Default::default() }), ..req() },
        ),
        (
            "logit_bias",
            GenerateRequest {
                sampling: Some(SamplingParams { logit_bias: [(500, 1.0)].into_iter().collect(), ..Default::default() }),
                ..req()
            },
        ),
        (
            "logit_bias",
            GenerateRequest {
                sampling: Some(SamplingParams { logit_bias: [(5, 150.0)].into_iter().collect(), ..Default::default() }),
                ..req()
            },
        ),
    ];
    for (field, r) in cases {
        let err = validate(&r, 100).expect_err(field);
        assert!(err.0.contains(field), "message {:?} should name {field}", err.0);
    }
}

/// A grammar too big for a step message is refused at the edge: admitted, its first step
/// would be over the workers' message limit and fail the whole replica (then the next one,
/// as the sequence moved). One at the limit passes.
#[test]
fn oversized_sampling_parameters_are_refused() {
    use tessera_coordinator::validate::MAX_SAMPLING_BYTES;
    use tessera_proto::worker::{constraint, Constraint};
    let with_grammar = |bytes: usize| {
        let kind = Some(constraint::Kind::Lark("x".repeat(bytes)));
        GenerateRequest {
            sampling: Some(SamplingParams { constraint: Some(Constraint { kind }), ..Default::default() }),
            ..req()
        }
    };
    let err = validate(&with_grammar(MAX_SAMPLING_BYTES), 100).expect_err("over the limit");
    assert!(err.0.contains("sampling"), "{}", err.0);
    assert_eq!(validate(&with_grammar(MAX_SAMPLING_BYTES - 16), 100), Ok(()));
    // The limit leaves the step room under the workers' message limit.
    const { assert!(4 * MAX_SAMPLING_BYTES <= tessera_proto::MAX_MESSAGE_BYTES) };
}
