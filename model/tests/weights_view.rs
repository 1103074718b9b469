//! ModelFiles gives the same canonical view of one random model whether it is stored as
//! GGUF (dims `[cols, rows]`, GGUF names) or as a Hugging Face directory (safetensors
//! `[rows, cols]`, transformers names; written with the `safetensors` crate under names
//! spelled out by hand below), and clear errors for what it cannot serve.

use std::path::PathBuf;

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use safetensors::tensor::TensorView as RefView;
use safetensors::Dtype;
use tessera_kernels::GgmlType;
use tessera_model::error::ModelError;
use tessera_model::gguf::{GgufWriter, MetaValue};
use tessera_model::weights::{hf_name, ModelFiles};

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 16;
const FFN: usize = 96;
const VOCAB: usize = 40;
const LAYERS: usize = 2;

/// (canonical name, transformers name, rows, cols); 1-D tensors have rows = 1.
fn layout() -> Vec<(String, String, usize, usize)> {
    let mut t = vec![
        ("token_embd.weight".into(), "model.embed_tokens.weight".into(), VOCAB, HIDDEN),
        ("output_norm.weight".into(), "model.norm.weight".into(), 1, HIDDEN),
        ("output.weight".into(), "lm_head.weight".into(), VOCAB, HIDDEN),
    ];
    for i in 0..LAYERS {
        let b = |c: &str, h: &str, r: usize, k: usize| (format!("blk.{i}.{c}"), format!("model.layers.{i}.{h}"), r, k);
        t.extend([
            b("attn_norm.weight", "input_layernorm.weight", 1, HIDDEN),
            b("attn_q.weight", "self_attn.q_proj.weight", HEADS * HEAD_DIM, HIDDEN),
            b("attn_k.weight", "self_attn.k_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN),
            b("attn_v.weight", "self_attn.v_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN),
            b("attn_q.bias", "self_attn.q_proj.bias", 1, HEADS * HEAD_DIM),
            b("attn_k.bias", "self_attn.k_proj.bias", 1, KV_HEADS * HEAD_DIM),
            b("attn_v.bias", "self_attn.v_proj.bias", 1, KV_HEADS * HEAD_DIM),
            b("attn_output.weight", "self_attn.o_proj.weight", HIDDEN, HEADS * HEAD_DIM),
            b("ffn_norm.weight", "post_attention_layernorm.weight", 1, HIDDEN),
            b("ffn_gate.weight", "mlp.gate_proj.weight", FFN, HIDDEN),
            b("ffn_up.weight", "mlp.up_proj.weight", FFN, HIDDEN),
            b("ffn_down.weight", "mlp.down_proj.weight", HIDDEN, FFN),
        ]);
    }
    t
}

fn random_f32_bytes(rng: &mut ChaCha8Rng, n: usize) -> Vec<u8> {
    (0..n).flat_map(|_| ((rng.next_u32() as f32 / u32::MAX as f32) * 2.0 - 1.0).to_le_bytes()).collect()
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-weights-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const CONFIG_JSON: &str = r#"{"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40, "max_position_embeddings": 512,
  "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": false, "hidden_act": "silu"}"#;

/// Writes the same random model as `model.gguf` and as an HF directory; returns both paths.
fn write_both(tag: &str, seed: u64) -> (PathBuf, PathBuf, Vec<(String, Vec<u8>)>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let dir = temp_dir(tag);
    let mut w = GgufWriter::new();
    let meta: [(&str, MetaValue); 9] = [
        ("general.architecture", MetaValue::String("qwen2".into())),
        ("qwen2.block_count", MetaValue::U32(LAYERS as u32)),
        ("qwen2.embedding_length", MetaValue::U32(HIDDEN as u32)),
        ("qwen2.feed_forward_length", MetaValue::U32(FFN as u32)),
        ("qwen2.attention.head_count", MetaValue::U32(HEADS as u32)),
        ("qwen2.attention.head_count_kv", MetaValue::U32(KV_HEADS as u32)),
        ("qwen2.context_length", MetaValue::U32(512)),
        ("qwen2.attention.layer_norm_rms_epsilon", MetaValue::F32(1e-6)),
        ("qwen2.rope.freq_base", MetaValue::F32(1e6)),
    ];
    for (k, v) in meta {
        w.add_meta(k, v);
    }
    w.add_meta("qwen2.vocab_size", MetaValue::U32(VOCAB as u32));
    let mut data = Vec::new();
    for (canonical, hf, rows, cols) in layout() {
        let bytes = random_f32_bytes(&mut rng, rows * cols);
        let dims: Vec<u64> = if rows == 1 { vec![cols as u64] } else { vec![cols as u64, rows as u64] };
        w.add_tensor(canonical.clone(), GgmlType::F32, &dims, bytes.clone());
        data.push((hf, bytes));
    }
    let gguf_path = dir.join("model.gguf");
    w.write_file(&gguf_path).unwrap();

    let hf_dir = dir.join("hf");
    std::fs::create_dir_all(&hf_dir).unwrap();
    std::fs::write(hf_dir.join("config.json"), CONFIG_JSON).unwrap();
    let views: Vec<(String, RefView)> = layout()
        .iter()
        .zip(&data)
        .map(|((_, hf, rows, cols), (_, bytes))| {
            let shape = if *rows == 1 { vec![*cols] } else { vec![*rows, *cols] };
            (hf.clone(), RefView::new(Dtype::F32, shape, bytes).unwrap())
        })
        .collect();
    std::fs::write(hf_dir.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
    (gguf_path, hf_dir, data)
}

#[test]
fn gguf_and_hf_give_the_same_views() {
    let (gguf_path, hf_dir, data) = write_both("same", 11);
    let g = ModelFiles::open(&gguf_path).unwrap();
    let h = ModelFiles::open(&hf_dir).unwrap();
    assert!(g.gguf().is_some() && h.gguf().is_none() && h.hf().is_some());
    for ((canonical, _, rows, cols), (_, bytes)) in layout().iter().zip(&data) {
        for files in [&g, &h] {
            assert!(files.has_tensor(canonical));
            let v = files.tensor(canonical).unwrap();
            assert_eq!((v.ty, v.rows, v.cols), (GgmlType::F32, *rows, *cols), "{canonical}");
            assert_eq!(v.data, &bytes[..], "{canonical}");
            assert_eq!(v.row_bytes(), cols * 4);
        }
    }
    let (cg, ch) = (g.config().unwrap(), h.config().unwrap());
    assert_eq!(cg, ch);
    assert!(cg.qkv_bias && !cg.tie_embeddings && cg.head_dim == HEAD_DIM);

    for files in [&g, &h] {
        assert!(!files.has_tensor("blk.2.attn_q.weight"));
        match files.tensor("blk.2.attn_q.weight") {
            Err(e @ ModelError::MissingTensor { .. }) => assert!(e.to_string().contains("blk.2.attn_q.weight")),
            other => panic!("expected a missing-tensor error, got {other:?}"),
        }
    }
    let msg = h.tensor("blk.1.attn_k.weight.extra").unwrap_err().to_string();
    assert!(msg.contains("missing tensor blk.1.attn_k.weight.extra"), "{msg}");
    let msg = h.tensor("rope_freqs.weight").unwrap_err().to_string();
    assert!(msg.contains("rope_freqs.weight") && msg.contains("safetensors"), "{msg}");
    let msg = h
        .tensor("blk.1.ffn_up.weight")
        .map(|_| ())
        .and(h.tensor("blk.7.ffn_up.weight").map(|_| ()))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("model.layers.7.mlp.up_proj.weight"), "{msg}");
    std::fs::remove_dir_all(gguf_path.parent().unwrap()).unwrap();
}

#[test]
fn quantised_and_odd_shapes() {
    let dir = temp_dir("shapes");
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let mut q = vec![0u8; 3 * 2 * 34];
    rng.fill_bytes(&mut q);
    let mut w = GgufWriter::new();
    w.add_tensor("token_embd.weight", GgmlType::Q8_0, &[64, 3], q.clone())
        .add_f32_tensor("blk.0.attn_norm.weight", &[4, 2, 3], &[0.5; 24])
        .add_f32_tensor("blk.0.ffn_norm.weight", &[4, 2, 1], &[0.5; 8]);
    let path = dir.join("m.gguf");
    w.write_file(&path).unwrap();
    let m = ModelFiles::open(&path).unwrap();
    let v = m.tensor("token_embd.weight").unwrap();
    assert_eq!((v.ty, v.rows, v.cols, v.row_bytes(), v.data), (GgmlType::Q8_0, 3, 64, 68, &q[..]));
    let msg = m.tensor("blk.0.attn_norm.weight").unwrap_err().to_string();
    assert!(msg.contains("blk.0.attn_norm.weight") && msg.contains("not a vector or matrix"), "{msg}");
    let v = m.tensor("blk.0.ffn_norm.weight").unwrap();
    assert_eq!((v.rows, v.cols), (2, 4));

    // Safetensors: a BF16 matrix is served as BF16; an I64 tensor is refused by dtype.
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    std::fs::write(hf.join("config.json"), CONFIG_JSON).unwrap();
    let bf = random_f32_bytes(&mut rng, 6);
    let ints = vec![1u8; 16];
    let views = vec![
        ("lm_head.weight".to_string(), RefView::new(Dtype::BF16, vec![3, 4], &bf).unwrap()),
        ("model.norm.weight".to_string(), RefView::new(Dtype::I64, vec![2], &ints).unwrap()),
        ("model.embed_tokens.weight".to_string(), RefView::new(Dtype::BF16, vec![1, 2, 6], &bf).unwrap()),
    ];
    std::fs::write(hf.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
    let m = ModelFiles::open(&hf).unwrap();
    let v = m.tensor("output.weight").unwrap();
    assert_eq!((v.ty, v.rows, v.cols, v.data), (GgmlType::BF16, 3, 4, &bf[..]));
    let msg = m.tensor("output_norm.weight").unwrap_err().to_string();
    assert!(msg.contains("model.norm.weight") && msg.contains("I64"), "{msg}");
    let v = m.tensor("token_embd.weight").unwrap();
    assert_eq!((v.rows, v.cols), (2, 6));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn hf_names() {
    let cases = [
        ("token_embd.weight", Some("model.embed_tokens.weight")),
        ("output.weight", Some("lm_head.weight")),
        ("blk.12.attn_q_norm.weight", Some("model.layers.12.self_attn.q_norm.weight")),
        ("blk.3.attn_k_norm.weight", Some("model.layers.3.self_attn.k_norm.weight")),
        ("blk.0.attn_v.bias", Some("model.layers.0.self_attn.v_proj.bias")),
        ("blk.0.ffn_gate.weight", Some("model.layers.0.mlp.gate_proj.weight")),
        ("rope_freqs.weight", None),
        ("blk.x.attn_q.weight", None),
        ("blk.0.attn_output.bias", None),
        ("blk.0.attn_q.scale", None),
        ("blk.0.nonsense.weight", None),
        ("model.embed_tokens.weight", None),
    ];
    for (canonical, want) in cases {
        assert_eq!(hf_name(canonical).as_deref(), want, "{canonical}");
    }
}

#[test]
fn open_errors() {
    let missing = std::env::temp_dir().join("tessera-definitely-not-here.gguf");
    assert!(matches!(ModelFiles::open(&missing), Err(ModelError::Path { .. })));
    let dir = temp_dir("noconfig");
    let msg = ModelFiles::open(&dir).unwrap_err().to_string();
    assert!(msg.contains("config.json"), "{msg}");
    std::fs::write(dir.join("config.json"), CONFIG_JSON).unwrap();
    let msg = ModelFiles::open(&dir).unwrap_err().to_string();
    assert!(msg.contains("model.safetensors"), "{msg}");
    std::fs::write(dir.join("junk.gguf"), b"not a model at all").unwrap();
    let msg = ModelFiles::open(&dir.join("junk.gguf")).unwrap_err().to_string();
    assert!(msg.contains("not a GGUF file"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}
