//! llama.cpp's greedy fixture for the default model (tests/fixtures/generation/
//! smollm2_greedy.jsonl, made by gen_llama_cpp.py there): per prompt, llama.cpp's prompt ids,
//! its 64 greedy tokens and its top-5 logprobs at each step. Shared by the CPU and GPU
//! agreement tests.

use serde_json::Value;

pub struct Case {
    pub name: String,
    pub prompt_ids: Vec<u32>,
    pub tokens: Vec<u32>,
    /// Per step, llama.cpp's top-5 `(id, logprob)`.
    pub top5: Vec<Vec<(u32, f64)>>,
}

/// Every case of the default fixture (llama.cpp on the default Q4_1 model).
pub fn load_cases() -> Vec<Case> {
    load_fixture("smollm2_greedy.jsonl")
}

/// Every case of fixture `name` in tests/fixtures/generation/. The test binary may run from
/// another checkout (the GPU machine): the build's path first, else the repository root it
/// runs in.
pub fn load_fixture(name: &str) -> Vec<Case> {
    let built = format!("{}/../tests/fixtures/generation/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(built)
        .or_else(|_| std::fs::read_to_string(format!("tests/fixtures/generation/{name}")))
        .expect("fixture file");
    let ids = |v: &Value| -> Vec<u32> { v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect() };
    text.lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            Case {
                name: v["name"].as_str().unwrap().to_string(),
                prompt_ids: ids(&v["prompt_ids"]),
                tokens: ids(&v["tokens"]),
                top5: v["top5"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| {
                        s.as_array()
                            .unwrap()
                            .iter()
                            .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap()))
                            .collect()
                    })
                    .collect(),
            }
        })
        .collect()
}

/// `log_softmax(row)[id]`, in f64.
pub fn log_softmax_at(row: &[f32], id: u32) -> f64 {
    let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
    row[id as usize] as f64 - m - z.ln()
}
