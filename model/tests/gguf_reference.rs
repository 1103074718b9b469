//! The GGUF reader against the `gguf` Python package (llama.cpp's reader and writer):
//! a tiny file written by the package (fixtures/tiny.gguf, made by
//! fixtures/make_gguf_fixture.py together with what the package reads back from it), and
//! the real default model, whose numbers are pasted below from the package.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tessera_kernels::GgmlType;
use tessera_model::gguf::{GgufFile, MetaValue};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// Checks one value against the package's reading: `ty` is its GGUFValueType name.
fn assert_value(key: &str, ty: &str, expected: &Value, actual: &MetaValue) {
    let ok = match (ty, actual) {
        ("UINT8", MetaValue::U8(_))
        | ("UINT16", MetaValue::U16(_))
        | ("UINT32", MetaValue::U32(_))
        | ("UINT64", MetaValue::U64(_)) => expected.as_u64() == actual.as_u64(),
        ("INT8", MetaValue::I8(_))
        | ("INT16", MetaValue::I16(_))
        | ("INT32", MetaValue::I32(_))
        | ("INT64", MetaValue::I64(_)) => expected.as_i64() == actual.as_i64(),
        // serde_json's default float parsing may miss the nearest f64 by an ulp, so f32s
        // compare after rounding to f32 and f64s within a few ulps.
        ("FLOAT32", MetaValue::F32(v)) => expected.as_f64().map(|e| e as f32) == Some(*v),
        ("FLOAT64", MetaValue::F64(v)) => {
            expected.as_f64().is_some_and(|e| (e - v).abs() <= 4.0 * f64::EPSILON * e.abs())
        }
        ("BOOL", MetaValue::Bool(b)) => expected.as_bool() == Some(*b),
        ("STRING", MetaValue::String(s)) => expected.as_str() == Some(s.as_str()),
        _ => false,
    };
    assert!(ok, "{key}: expected {ty} {expected}, read {actual:?}");
}

#[test]
fn tiny_fixture_matches_python_reader() {
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("tiny.expected.json")).unwrap()).unwrap();
    let g = GgufFile::open(&fixture("tiny.gguf")).unwrap();
    assert_eq!(u64::from(g.version()), expected["version"].as_u64().unwrap());
    assert_eq!(g.alignment(), expected["alignment"].as_u64().unwrap());
    assert_eq!(g.data_offset(), expected["data_offset"].as_u64().unwrap());

    let meta = expected["metadata"].as_object().unwrap();
    assert_eq!(g.metadata().len(), meta.len(), "keys: {:?}", g.metadata().keys().collect::<Vec<_>>());
    for (key, entry) in meta {
        let actual = g.get(key).unwrap_or_else(|| panic!("missing key {key}"));
        let ty = entry["type"].as_str().unwrap();
        if ty == "ARRAY" {
            let elem = entry["elem"].as_str().unwrap();
            let items = actual.as_array().unwrap_or_else(|| panic!("{key} is not an array: {actual:?}"));
            let want = entry["value"].as_array().unwrap();
            assert_eq!(items.len(), want.len(), "{key} length");
            for (a, e) in items.iter().zip(want) {
                assert_value(key, elem, e, a);
            }
        } else {
            assert_value(key, ty, &entry["value"], actual);
        }
    }

    let tensors = expected["tensors"].as_array().unwrap();
    assert_eq!(g.tensors().len(), tensors.len());
    for (t, e) in g.tensors().iter().zip(tensors) {
        assert_eq!(t.name, e["name"].as_str().unwrap());
        assert_eq!(t.ty.name(), e["type"].as_str().unwrap(), "{}", t.name);
        let dims: Vec<u64> = e["dims"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
        assert_eq!(t.dims, dims, "{}", t.name);
        assert_eq!(t.offset, e["offset"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(t.n_bytes as u64, e["n_bytes"].as_u64().unwrap(), "{}", t.name);
        let hex: String = g.tensor_data(t).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, e["data_hex"].as_str().unwrap(), "{} bytes", t.name);
        assert_eq!(g.tensor(&t.name), Some(t));
    }
    // The owned-buffer constructor reads the same file the same way.
    let owned = GgufFile::from_bytes(std::fs::read(fixture("tiny.gguf")).unwrap()).unwrap();
    assert_eq!(owned.tensors(), g.tensors());
    assert_eq!(owned.metadata(), g.metadata());
}

#[path = "../../tests/support/default_model.rs"]
mod default_model;

/// Numbers from gguf 0.19.0:
/// `python3 -c "import gguf; r = gguf.GGUFReader(PATH); print(len(r.tensors), r.data_offset, ...)"`
/// (the full script: for each field `f.contents()`, `len(f.data)` for arrays; for tensors
/// `t.tensor_type.name, list(t.shape), t.data_offset, t.n_bytes`, and sums of `t.data`).
#[test]
fn default_model_matches_python_reader() {
    let Some(path) = default_model::default_model() else { return };
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.file_len(), 98_362_432);
    assert_eq!(g.metadata().len(), 33); // GGUF.kv_count
    assert_eq!(g.tensors().len(), 272);
    assert_eq!(g.alignment(), 32);
    assert_eq!(g.data_offset(), 1_785_664);

    let s = |k: &str| g.get(k).and_then(MetaValue::as_str).unwrap().to_owned();
    let u = |k: &str| g.get(k).and_then(MetaValue::as_u64).unwrap();
    assert_eq!(s("general.architecture"), "llama");
    assert_eq!(s("tokenizer.ggml.model"), "gpt2");
    assert_eq!(s("tokenizer.ggml.pre"), "smollm");
    assert_eq!(u("llama.block_count"), 30);
    assert_eq!(u("llama.context_length"), 8192);
    assert_eq!(u("llama.embedding_length"), 576);
    assert_eq!(u("llama.feed_forward_length"), 1536);
    assert_eq!(u("llama.attention.head_count"), 9);
    assert_eq!(u("llama.attention.head_count_kv"), 3);
    assert_eq!(u("llama.vocab_size"), 49152);
    assert_eq!(u("tokenizer.ggml.eos_token_id"), 2);
    assert_eq!(g.get("llama.rope.freq_base").and_then(MetaValue::as_f64), Some(100000.0));
    assert_eq!(g.get("llama.attention.layer_norm_rms_epsilon"), Some(&MetaValue::F32(1e-5)));
    assert_eq!(g.get("tokenizer.ggml.add_bos_token"), Some(&MetaValue::Bool(false)));
    assert!(s("tokenizer.chat_template").starts_with("{% for message in messages %}"));

    let tokens = g.get("tokenizer.ggml.tokens").and_then(MetaValue::as_array).unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(tokens[0].as_str(), Some("<|endoftext|>"));
    assert_eq!(tokens[2].as_str(), Some("<|im_end|>"));
    assert_eq!(tokens[198].as_str(), Some("Ċ"));
    assert_eq!(tokens[49151].as_str(), Some("ectable"));
    let merges = g.get("tokenizer.ggml.merges").and_then(MetaValue::as_array).unwrap();
    assert_eq!(merges.len(), 48900);
    assert_eq!(merges[0].as_str(), Some("Ġ t"));
    assert_eq!(merges[48899].as_str(), Some("ect able"));
    let types = g.get("tokenizer.ggml.token_type").and_then(MetaValue::as_array).unwrap();
    assert_eq!(types.iter().map(|v| v.as_i64().unwrap()).sum::<i64>(), 49186);

    let count = |ty| g.tensors().iter().filter(|t| t.ty == ty).count();
    assert_eq!((count(GgmlType::Q4_1), count(GgmlType::F32), count(GgmlType::Q8_0)), (210, 61, 1));
    assert_eq!(g.tensors().iter().map(|t| t.n_bytes as u64).sum::<u64>(), 96_576_768);

    let embd = &g.tensors()[0];
    assert_eq!(
        (embd.name.as_str(), embd.ty, embd.dims.as_slice(), embd.offset, embd.n_bytes),
        ("token_embd.weight", GgmlType::Q8_0, &[576u64, 49152][..], 1_785_664, 30_081_024)
    );
    let down = g.tensor("blk.29.ffn_down.weight").unwrap();
    assert_eq!(
        (down.ty, down.dims.as_slice(), down.offset, down.n_bytes),
        (GgmlType::Q4_1, &[1536u64, 576][..], 80_630_848, 552_960)
    );
    assert_eq!(g.tensor_data(down).iter().map(|&b| u64::from(b)).sum::<u64>(), 69_307_170);
    let norm = g.tensor("output_norm.weight").unwrap();
    assert_eq!((norm.offset, norm.n_bytes), (98_360_128, 2304));
    assert_eq!(norm.offset + norm.n_bytes as u64, g.file_len() as u64);
    let norm_vals: Vec<f32> =
        g.tensor_data(norm).chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(&norm_vals[..4], &[1.7578125, 1.8203125, 1.78125, 1.6015625]);
    assert_eq!(norm_vals.iter().map(|&v| f64::from(v)).sum::<f64>(), 1038.33203125);
}
