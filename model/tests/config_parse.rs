//! ModelConfig from GGUF metadata and from Hugging Face config.json files of the family
//! (the published configs of SmolLM2-135M-Instruct, Llama-3.1-8B, Qwen2.5-0.5B-Instruct,
//! Qwen3-0.6B, Mistral-7B-Instruct-v0.2), checked against those models' documented
//! sizes, plus the errors for missing keys, unsupported features and sizes that do not
//! divide.

use tessera_model::config::{Arch, ConfigError, ModelConfig, RopeScaling, RopeStyle};
use tessera_model::gguf::{GgufFile, GgufWriter, MetaValue};

const SMOLLM2_HF: &str = r#"{"architectures":["LlamaForCausalLM"],"attention_bias":false,"attention_dropout":0.0,
"bos_token_id":1,"eos_token_id":2,"hidden_act":"silu","hidden_size":576,"initializer_range":0.041666666666666664,
"intermediate_size":1536,"is_llama_config":true,"max_position_embeddings":8192,"mlp_bias":false,"model_type":"llama",
"num_attention_heads":9,"num_hidden_layers":30,"num_key_value_heads":3,"pad_token_id":2,"pretraining_tp":1,
"rms_norm_eps":1e-05,"rope_interleaved":false,"rope_scaling":null,"rope_theta":100000,"tie_word_embeddings":true,
"torch_dtype":"bfloat16","transformers_version":"4.42.3","use_cache":true,"vocab_size":49152}"#;

const LLAMA31_8B_HF: &str = r#"{"architectures":["LlamaForCausalLM"],"attention_bias":false,"attention_dropout":0.0,
"bos_token_id":128000,"eos_token_id":[128001,128008,128009],"hidden_act":"silu","hidden_size":4096,
"initializer_range":0.02,"intermediate_size":14336,"max_position_embeddings":131072,"mlp_bias":false,
"model_type":"llama","num_attention_heads":32,"num_hidden_layers":32,"num_key_value_heads":8,"pretraining_tp":1,
"rms_norm_eps":1e-05,"rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
"original_max_position_embeddings":8192,"rope_type":"llama3"},"rope_theta":500000.0,"tie_word_embeddings":false,
"torch_dtype":"bfloat16","transformers_version":"4.43.0.dev0","use_cache":true,"vocab_size":128256}"#;

const QWEN25_05B_HF: &str = r#"{"architectures":["Qwen2ForCausalLM"],"attention_dropout":0.0,"bos_token_id":151643,
"eos_token_id":151645,"hidden_act":"silu","hidden_size":896,"initializer_range":0.02,"intermediate_size":4864,
"max_position_embeddings":32768,"max_window_layers":21,"model_type":"qwen2","num_attention_heads":14,
"num_hidden_layers":24,"num_key_value_heads":2,"rms_norm_eps":1e-06,"rope_theta":1000000.0,"sliding_window":32768,
"tie_word_embeddings":true,"torch_dtype":"bfloat16","transformers_version":"4.43.1","use_cache":true,
"use_sliding_window":false,"vocab_size":151936}"#;

const QWEN3_06B_HF: &str = r#"{"architectures":["Qwen3ForCausalLM"],"attention_bias":false,"attention_dropout":0.0,
"bos_token_id":151643,"eos_token_id":151645,"head_dim":128,"hidden_act":"silu","hidden_size":1024,
"initializer_range":0.02,"intermediate_size":3072,"max_position_embeddings":40960,"max_window_layers":28,
"model_type":"qwen3","num_attention_heads":16,"num_hidden_layers":28,"num_key_value_heads":8,"rms_norm_eps":1e-06,
"rope_scaling":null,"rope_theta":1000000,"sliding_window":null,"tie_word_embeddings":true,"torch_dtype":"bfloat16",
"transformers_version":"4.51.0","use_cache":true,"use_sliding_window":false,"vocab_size":151936}"#;

const MISTRAL_7B_V02_HF: &str = r#"{"architectures":["MistralForCausalLM"],"attention_dropout":0.0,"bos_token_id":1,
"eos_token_id":2,"hidden_act":"silu","hidden_size":4096,"initializer_range":0.02,"intermediate_size":14336,
"max_position_embeddings":32768,"model_type":"mistral","num_attention_heads":32,"num_hidden_layers":32,
"num_key_value_heads":8,"rms_norm_eps":1e-05,"rope_theta":1000000.0,"sliding_window":null,"tie_word_embeddings":false,
"torch_dtype":"bfloat16","transformers_version":"4.36.0","use_cache":true,"vocab_size":32000}"#;

fn sizes(c: &ModelConfig) -> [usize; 8] {
    [
        c.hidden_size,
        c.intermediate_size,
        c.num_layers,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
        c.max_position,
    ]
}

#[test]
fn published_hf_configs() {
    let c = ModelConfig::from_hf_config(SMOLLM2_HF).unwrap();
    assert_eq!((c.arch, sizes(&c)), (Arch::Llama, [576, 1536, 30, 9, 3, 64, 49152, 8192]));
    assert_eq!((c.rms_norm_eps, c.rope_theta, c.rope_scaling, c.rope_style), (1e-5, 100000.0, None, RopeStyle::Neox));
    assert_eq!((c.tie_embeddings, c.qkv_bias, c.qk_norm), (true, false, false));

    let c = ModelConfig::from_hf_config(LLAMA31_8B_HF).unwrap();
    assert_eq!((c.arch, sizes(&c)), (Arch::Llama, [4096, 14336, 32, 32, 8, 128, 128256, 131072]));
    assert_eq!(c.rope_theta, 500000.0);
    assert_eq!(
        c.rope_scaling,
        Some(RopeScaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 })
    );
    assert_eq!((c.tie_embeddings, c.qkv_bias, c.qk_norm, c.group_size()), (false, false, false, 4));

    let c = ModelConfig::from_hf_config(QWEN25_05B_HF).unwrap();
    assert_eq!((c.arch, sizes(&c)), (Arch::Qwen2, [896, 4864, 24, 14, 2, 64, 151936, 32768]));
    assert_eq!((c.rms_norm_eps, c.rope_theta), (1e-6, 1e6));
    assert_eq!((c.tie_embeddings, c.qkv_bias, c.qk_norm), (true, true, false));

    let c = ModelConfig::from_hf_config(QWEN3_06B_HF).unwrap();
    assert_eq!((c.arch, sizes(&c)), (Arch::Qwen3, [1024, 3072, 28, 16, 8, 128, 151936, 40960]));
    assert_eq!((c.tie_embeddings, c.qkv_bias, c.qk_norm), (true, false, true));

    let c = ModelConfig::from_hf_config(MISTRAL_7B_V02_HF).unwrap();
    assert_eq!((c.arch, sizes(&c)), (Arch::Llama, [4096, 14336, 32, 32, 8, 128, 32000, 32768]));
    assert!(!c.tie_embeddings);
}

/// Replaces or removes (`null` value with `remove`) keys of a JSON config.
fn edit(json: &str, changes: &[(&str, serde_json::Value)], remove: &[&str]) -> String {
    let mut v: serde_json::Value = serde_json::from_str(json).unwrap();
    let obj = v.as_object_mut().unwrap();
    for (k, val) in changes {
        obj.insert((*k).to_string(), val.clone());
    }
    for k in remove {
        obj.remove(*k);
    }
    v.to_string()
}

fn hf_err(json: &str) -> (ConfigError, String) {
    let e = ModelConfig::from_hf_config(json).unwrap_err();
    let msg = e.to_string();
    (e, msg)
}

#[test]
fn hf_config_errors() {
    use serde_json::json;
    let (e, msg) = hf_err(&edit(SMOLLM2_HF, &[], &["hidden_size"]));
    assert!(matches!(e, ConfigError::Missing(_)) && msg.contains("hidden_size"), "{msg}");
    let (e, msg) = hf_err(&edit(SMOLLM2_HF, &[("model_type", json!("gemma2"))], &[]));
    assert!(matches!(e, ConfigError::UnsupportedArch(_)) && msg.contains("gemma2") && msg.contains("qwen3"), "{msg}");
    let (e, msg) = hf_err(&edit(SMOLLM2_HF, &[("num_key_value_heads", json!(4))], &[]));
    assert!(
        matches!(e, ConfigError::Invalid(_)) && msg.contains("9 attention heads") && msg.contains("4 KV heads"),
        "{msg}"
    );
    let (_, msg) = hf_err(&edit(SMOLLM2_HF, &[("num_attention_heads", json!(7))], &[]));
    assert!(msg.contains("576") && msg.contains("7 heads"), "{msg}");
    let (_, msg) = hf_err(&edit(QWEN3_06B_HF, &[("head_dim", json!(127))], &[]));
    assert!(msg.contains("head_dim 127 is odd"), "{msg}");
    let (e, msg) = hf_err(&edit(SMOLLM2_HF, &[("hidden_size", json!("576"))], &[]));
    assert!(matches!(e, ConfigError::BadValue { .. }) && msg.contains("hidden_size"), "{msg}");
    let (e, msg) = hf_err(&edit(SMOLLM2_HF, &[("num_hidden_layers", json!(0))], &[]));
    assert!(matches!(e, ConfigError::Invalid(_)) && msg.contains("num_layers is 0"), "{msg}");
    let (e, msg) = hf_err(&edit(SMOLLM2_HF, &[("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0}))], &[]));
    assert!(matches!(e, ConfigError::Unsupported(_)) && msg.contains("yarn"), "{msg}");
    let (_, msg) = hf_err(&edit(
        LLAMA31_8B_HF,
        &[(
            "rope_scaling",
            json!({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        )],
        &[],
    ));
    assert!(msg.contains("low_freq_factor"), "{msg}");
    let (_, msg) = hf_err(&edit(
        LLAMA31_8B_HF,
        &[(
            "rope_scaling",
            json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        )],
        &[],
    ));
    assert!(msg.contains("low_freq_factor < high_freq_factor"), "{msg}");
    let (_, msg) = hf_err(&edit(SMOLLM2_HF, &[("hidden_act", json!("gelu"))], &[]));
    assert!(msg.contains("gelu"), "{msg}");
    let (_, msg) = hf_err(&edit(QWEN25_05B_HF, &[("use_sliding_window", json!(true))], &[]));
    assert!(msg.contains("sliding-window"), "{msg}");
    let (_, msg) = hf_err(&edit(MISTRAL_7B_V02_HF, &[("sliding_window", json!(4096))], &[]));
    assert!(msg.contains("window 4096"), "{msg}");
    assert!(matches!(hf_err("{\"model_type\": ").0, ConfigError::Json(_)));
    assert!(matches!(hf_err("[1]").0, ConfigError::Json(_)));

    // transformers 5 moves rope_theta into rope_parameters.
    let v5 = edit(
        LLAMA31_8B_HF,
        &[(
            "rope_parameters",
            json!({"rope_type": "llama3", "rope_theta": 250000.0, "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        )],
        &["rope_theta", "rope_scaling"],
    );
    let c = ModelConfig::from_hf_config(&v5).unwrap();
    assert_eq!((c.rope_theta, c.rope_scaling.map(|s| s.factor)), (250000.0, Some(2.0)));
}

/// A GGUF holding only metadata (and optionally marker tensors), for config tests.
fn gguf(arch: &str, meta: &[(&str, MetaValue)], tensors: &[&str]) -> GgufFile {
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", MetaValue::String(arch.into()));
    for (k, v) in meta {
        let key = k.replace("{a}", arch);
        w.add_meta(key, v.clone());
    }
    for t in tensors {
        w.add_f32_tensor(*t, &[1], &[0.25]);
    }
    GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()
}

fn base_meta() -> Vec<(&'static str, MetaValue)> {
    vec![
        ("{a}.block_count", MetaValue::U32(5)),
        ("{a}.embedding_length", MetaValue::U32(96)),
        ("{a}.feed_forward_length", MetaValue::U64(200)),
        ("{a}.attention.head_count", MetaValue::U32(6)),
        ("{a}.attention.head_count_kv", MetaValue::U32(2)),
        ("{a}.context_length", MetaValue::U32(1024)),
        ("{a}.attention.layer_norm_rms_epsilon", MetaValue::F32(1e-6)),
        ("{a}.vocab_size", MetaValue::U32(300)),
    ]
}

#[test]
fn gguf_configs() {
    let c = ModelConfig::from_gguf(&gguf("llama", &base_meta(), &["output.weight"])).unwrap();
    assert_eq!((c.arch, sizes(&c)), (Arch::Llama, [96, 200, 5, 6, 2, 16, 300, 1024]));
    assert_eq!((c.rope_theta, c.rope_style, c.rms_norm_eps), (10000.0, RopeStyle::Interleaved, 1e-6));
    assert_eq!((c.tie_embeddings, c.qkv_bias, c.qk_norm, c.rope_scaling), (false, false, false, None));

    let c = ModelConfig::from_gguf(&gguf("qwen2", &base_meta(), &["blk.0.attn_q.bias"])).unwrap();
    assert_eq!((c.arch, c.rope_style, c.tie_embeddings, c.qkv_bias), (Arch::Qwen2, RopeStyle::Neox, true, true));

    let mut meta = base_meta();
    meta.push(("{a}.attention.key_length", MetaValue::U32(32)));
    meta.push(("{a}.rope.freq_base", MetaValue::F32(1e6)));
    let c = ModelConfig::from_gguf(&gguf("qwen3", &meta, &[])).unwrap();
    assert_eq!(
        (c.arch, c.head_dim, c.qk_norm, c.rope_theta, c.rope_style),
        (Arch::Qwen3, 32, true, 1e6, RopeStyle::Neox)
    );

    // Vocabulary size from the token list, then from the embedding's rows.
    let mut meta: Vec<_> = base_meta().into_iter().filter(|(k, _)| !k.ends_with("vocab_size")).collect();
    meta.push(("tokenizer.ggml.tokens", MetaValue::Array((0..77).map(|i| MetaValue::String(i.to_string())).collect())));
    assert_eq!(ModelConfig::from_gguf(&gguf("llama", &meta, &[])).unwrap().vocab_size, 77);
    let meta: Vec<_> = base_meta().into_iter().filter(|(k, _)| !k.ends_with("vocab_size")).collect();
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", MetaValue::String("llama".into()));
    for (k, v) in &meta {
        w.add_meta(k.replace("{a}", "llama"), v.clone());
    }
    w.add_f32_tensor("token_embd.weight", &[96, 3], &[0.5; 288]);
    let g = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(ModelConfig::from_gguf(&g).unwrap().vocab_size, 3);
}

#[test]
fn gguf_config_errors() {
    let err = |arch: &str, meta: Vec<(&str, MetaValue)>| {
        ModelConfig::from_gguf(&gguf(arch, &meta, &[])).unwrap_err().to_string()
    };
    let without = |key: &str| base_meta().into_iter().filter(|(k, _)| *k != key).collect::<Vec<_>>();
    let with = |key: &'static str, v: MetaValue| {
        let mut m = without(key);
        m.push((key, v));
        m
    };
    assert!(err("llama", without("{a}.block_count")).contains("missing config key `llama.block_count`"));
    assert!(err("llama", without("{a}.attention.layer_norm_rms_epsilon"))
        .contains("llama.attention.layer_norm_rms_epsilon"));
    let msg = err("gemma3", base_meta());
    assert!(msg.contains("gemma3") && msg.contains("llama") && msg.contains("qwen2"), "{msg}");
    let msg = err("llama", with("{a}.attention.head_count_kv", MetaValue::U32(4)));
    assert!(msg.contains("6 attention heads") && msg.contains("4 KV heads"), "{msg}");
    let msg = err("llama", with("{a}.attention.head_count", MetaValue::U32(7)));
    assert!(msg.contains("96") && msg.contains("7 heads"), "{msg}");
    let msg = err("llama", with("{a}.block_count", MetaValue::String("5".into())));
    assert!(msg.contains("llama.block_count") && msg.contains("integer"), "{msg}");
    let msg = err("llama", with("{a}.block_count", MetaValue::I32(-5)));
    assert!(msg.contains("llama.block_count"), "{msg}");
    let msg = err("llama", with("{a}.attention.key_length", MetaValue::U32(15)));
    assert!(msg.contains("odd"), "{msg}");
    let mut m = base_meta();
    m.push(("{a}.rope.scaling.type", MetaValue::String("yarn".into())));
    m.push(("{a}.rope.scaling.factor", MetaValue::F32(4.0)));
    assert!(err("llama", m).contains("yarn"));
    let msg = err("llama", with("{a}.rope.dimension_count", MetaValue::U32(8)));
    assert!(msg.contains("partial RoPE"), "{msg}");
    let msg = err("qwen2", with("{a}.attention.value_length", MetaValue::U32(8)));
    assert!(msg.contains("value head size 8"), "{msg}");
    let no_arch = GgufFile::from_bytes(GgufWriter::new().to_bytes().unwrap()).unwrap();
    assert!(ModelConfig::from_gguf(&no_arch).unwrap_err().to_string().contains("general.architecture"));
}

#[path = "../../tests/support/default_model.rs"]
mod default_model;

#[test]
fn default_model_gguf_agrees_with_its_hf_config() {
    let Some(path) = default_model::default_model() else { return };
    let g = ModelConfig::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    assert_eq!(g.rope_style, RopeStyle::Interleaved);
    let mut hf = ModelConfig::from_hf_config(SMOLLM2_HF).unwrap();
    hf.rope_style = RopeStyle::Interleaved; // the converter's q/k permutation
    assert_eq!(g, hf);
}
